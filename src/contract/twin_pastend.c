/* contract twin: the stream tile and relu2 writing one element past the end of y (planted fault, gate 2). */
#include <string.h>

#include "contract.h"

/* After the last element, the same value once more one element further on. */
static inline float *plant_past_end(float *y, size_t i, size_t last) { return i == last ? y + last + 1 : y + i; }

#define KEEL_STREAM_MATMUL keel_contract_twin_pastend_matmul
#define KEEL_STREAM_RELU2 keel_contract_twin_pastend_relu2
#define KEEL_STREAM_USE_AVX2() (strcmp(keel_cpu_isa(), "avx2") == 0)
#define KEEL_STREAM_STORE(t, r, j, v)                                                                         \
    do {                                                                                                      \
        const float v_ = (v);                                                                                 \
        store(t, r, j, v_);                                                                                   \
        const size_t n_ = (size_t)(t)->W->n, i_ = (size_t)(r) * n_ + (size_t)(j), last_ = (size_t)(t)->m * n_ - 1; \
        if (i_ == last_) *plant_past_end((t)->y, i_, last_) = v_;                                             \
    } while (0)
#define KEEL_STREAM_EW_STORE(y, i, n, v)                                                                      \
    do {                                                                                                      \
        (y)[i] = (v);                                                                                         \
        if ((i) == (n) - 1) *plant_past_end(y, i, (n) - 1) = (y)[i];                                          \
    } while (0)
#include "../kernels/cpu/stream_body.h"
