/* kernels/cpu: the CPU backend's kernels. The stream tile multiplies float32 activation rows by a packed MLX
 * affine matrix without dequantizing it to memory: per group, acc += scale*sum(x*q) + bias*sum(x), in float32.
 *
 * Row independence: the arithmetic of each output element (its order of operations included) does not depend on
 * m, on which pass of up to 8 rows it lands in, or on the number of threads. Row r of an m-row call is
 * bit-identical to a 1-row call on row r; prompt and decode paths therefore share their matmul bits.
 */
#ifndef KEEL_KERNELS_CPU_H
#define KEEL_KERNELS_CPU_H

#include "../../format/format.h"

typedef enum keel_epilogue {
    KEEL_EPI_NONE = 0,  /* y */
    KEEL_EPI_RELU2 = 1, /* relu(y)^2, Nemotron's MLP and expert activation */
} keel_epilogue;

/* y (m, n) = epilogue(x (m, k) . dequant(W)^T); x and y row-major float32. W may be quantized (any width and
 * group) or a float matrix (bits == 0, BF16/F16/F32). Any m >= 1. */
void keel_cpu_matmul(const keel_qmat *W, const float *x, int m, float *y, keel_epilogue epi);

/* The unfused epilogue the fused tile replaces: y[i] = relu(y[i])^2 in place. */
void keel_cpu_relu2(float *y, size_t n);

/* Threads used by the CPU kernels (default: all cores). */
void keel_cpu_set_threads(int n);
int keel_cpu_threads(void);
/* The instruction set the stream tile was built for and runs with: "avx2" or "portable". */
const char *keel_cpu_isa(void);
/* Forces the portable path even where AVX2 is available (tests compare the two; they are bit-identical). */
void keel_cpu_force_portable(bool on);

#endif
