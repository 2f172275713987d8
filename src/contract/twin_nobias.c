/* contract twin: the stream tile with the bias term dropped (planted fault, must go red at gate 3). */
#include <string.h>

#include "contract.h"

#define KEEL_STREAM_MATMUL keel_contract_twin_nobias_matmul
#define KEEL_STREAM_RELU2 keel_contract_twin_nobias_relu2
#define KEEL_STREAM_USE_AVX2() (strcmp(keel_cpu_isa(), "avx2") == 0)
#define KEEL_STREAM_BIAS(b) ((b) * 0.0f)
#include "../kernels/cpu/stream_body.h"
