/* contract twin: the stream tile leaking a trace of the previous row of a pass into each row (planted fault:
 * within the gate-3 bound, must go red at gate 4 where each row is compared with that row launched alone). */
#include <math.h>
#include <string.h>

#include "contract.h"

/* v plus 2^-22 of the smaller of |v| and the previous row's stored value, signed like that value. */
static inline float plant_leak(const float *y, int n, int r, int j, float v) {
    if (r % 8 == 0) return v;
    const float p = y[(size_t)(r - 1) * (size_t)n + (size_t)j];
    return v + copysignf(fminf(fabsf(v), fabsf(p)) * 0x1p-22f, p);
}

#define KEEL_STREAM_MATMUL keel_contract_twin_rowleak_matmul
#define KEEL_STREAM_RELU2 keel_contract_twin_rowleak_relu2
#define KEEL_STREAM_USE_AVX2() (strcmp(keel_cpu_isa(), "avx2") == 0)
#define KEEL_STREAM_STORE(t, r, j, v) store(t, r, j, plant_leak((t)->y, (t)->W->n, r, j, v))
#include "../kernels/cpu/stream_body.h"
