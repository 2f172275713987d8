/* contract twin: the stream tile reading every code as 4 bits wide (planted fault, must go red at gate 3). */
#include <string.h>

#include "contract.h"

#define KEEL_STREAM_MATMUL keel_contract_twin_width4_matmul
#define KEEL_STREAM_RELU2 keel_contract_twin_width4_relu2
#define KEEL_STREAM_USE_AVX2() (strcmp(keel_cpu_isa(), "avx2") == 0)
#define KEEL_STREAM_BITS(bits) ((bits) * 0 + 4)
#include "../kernels/cpu/stream_body.h"
