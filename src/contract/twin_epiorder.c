/* contract twin: the fused relu2 tile summing the bias term first and the lanes in sequence, an order different
 * from the plain tile it replaces (planted fault: within the gate-3 bound, must go red at gate 4). */
#include <string.h>

#include "contract.h"

#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx2"))) static inline void plant_lanes(__m256 v, float *out) { _mm256_storeu_ps(out, v); }
#endif

static inline float plant_seq(float first, const float *a) {
    float s = first;
    for (int l = 0; l < 8; l++) s = s + a[l];
    return s;
}

#define PLANT_FUSED(t) ((t)->epi == KEEL_EPI_RELU2)
#define KEEL_STREAM_MATMUL keel_contract_twin_epiorder_matmul
#define KEEL_STREAM_RELU2 keel_contract_twin_epiorder_relu2
#define KEEL_STREAM_USE_AVX2() (strcmp(keel_cpu_isa(), "avx2") == 0)
#define KEEL_STREAM_QFINAL(t, hs, lanes, bacc) (PLANT_FUSED(t) ? plant_seq(bacc, lanes) : (hs) + (bacc))
#define KEEL_STREAM_FFINAL(t, hs, lanes) (PLANT_FUSED(t) ? plant_seq(0.0f, lanes) : (hs))
#define KEEL_STREAM_QFINAL_AVX2(t, hs, lanes, bacc)                                                           \
    (PLANT_FUSED(t) ? (plant_lanes(lanes, lane_buf), plant_seq(bacc, lane_buf)) : (hs) + (bacc))
#define KEEL_STREAM_FFINAL_AVX2(t, hs, lanes)                                                                 \
    (PLANT_FUSED(t) ? (plant_lanes(lanes, lane_buf), plant_seq(0.0f, lane_buf)) : (hs))
static _Thread_local float lane_buf[8];
#include "../kernels/cpu/stream_body.h"
