/* Gate-5 planted twin: a local array indexed at run time (a stack frame) with more live values than the
 * 32 registers its launch bounds leave (spills). `keel audit --source` on this file must report both. */
#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#endif
#include <stdint.h>

__global__ void __launch_bounds__(128, 16) gate5_local_array(const float *x, const int *idx, float *y, int n) {
    float a[256];
    float v[64];
    const int t = threadIdx.x;
#pragma unroll
    for (int i = 0; i < 64; i++) v[i] = x[i * n + t];
    for (int i = 0; i < 256; i++) a[i] = x[(i + 64) * n + t] * v[i & 63];
    float s = a[idx[t] & 255];
#pragma unroll
    for (int i = 0; i < 64; i++) s = fmaf(s, v[i], v[63 - i]);
    y[t] = s;
}
