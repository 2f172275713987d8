/* engine/cuda: the Mamba-2 scan of a prompt in the chunked (SSD) form. Within a chunk of L tokens the outputs are
 * a masked matrix product: y_t = sum_{s<=t} (C_t . B_s) exp(a(t,s)) dt_s x_s + exp(a(t,-1)) C_t . H + D x_t, with
 * a(t,s) = A (dt_{s+1} + ... + dt_t) summed directly for each (t, s) (no difference of long cumulative sums) and H
 * the state at the chunk's start; the state then passes to the next chunk as H = exp(a(L-1,-1)) H + sum_s
 * exp(a(L-1,s)) dt_s x_s B_s. One block per (head, 16 head channels) walks the chunks in order with its slice of
 * the state in registers (16 lanes of 8 state entries per channel); every sum has a fixed order, so a launch is
 * bit-reproducible. The same layouts as keel_ecu_ssm (ecuda.h), whose token-by-token sequence it replaces within
 * the bound derived in src/contract/engine_regs_scan.c. */
#include <string.h>

#include "../../kernels/cuda/port.h"
#include "ecuda.h"
#include "scan_fn.h"

namespace {

constexpr int kScanThreads = 256;
constexpr int kPT = 16;               /* head channels per block */
constexpr int kNQ = 16;               /* lanes sharing one channel's state row */
constexpr int kChunk = 32;            /* tokens per chunk */
constexpr int kScanMaxN = 128;        /* ssm_state */
constexpr int kNJ = kScanMaxN / kNQ;  /* state entries per lane */
constexpr int kRow = kScanMaxN + 1;   /* padded B, C rows: lanes reading one column of different rows miss banks */
constexpr int kMRow = kChunk + 1;
constexpr int kPlantNoDSkip = 3, kPlantDecay = 4, kPlantRerun = 5; /* the twin's faults (src/contract/twin_scan.h) */

struct SVec {
    const void *p;
    int dt, n;
};

SVec sv(const keel_ecu_vec *v) {
    SVec d = {v ? v->p : nullptr, v ? (int)v->dt : 0, v ? v->n : 0};
    return d;
}

__device__ __forceinline__ float sget(const SVec &v, long long i) {
    if (v.dt == KEEL_DT_BF16) return kp_bf16_to_f32(((const uint16_t *)v.p)[i]);
    if (v.dt == KEEL_DT_F16) return kp_f16_to_f32(((const uint16_t *)v.p)[i]);
    return ((const float *)v.p)[i];
}

/* dt exactly as the token-by-token scan computes it (kernels.cu), so both see the same dt bits */
__device__ __forceinline__ float scan_softplus(float v) { return v > 0.0f ? v + log1pf(expf(-v)) : log1pf(expf(v)); }

__device__ __forceinline__ float half_sum(float v) { /* over the 16 lanes of a channel, a fixed tree */
    for (int o = 8; o > 0; o >>= 1) v = __fadd_rn(v, kp_shfl_xor_f32(v, o));
    return v;
}

#if KEEL_SCAN_TWIN
__device__ unsigned g_scan_runs; /* the run-to-run control's launch counter */
__device__ __forceinline__ bool next_run_odd() { return (atomicAdd(&g_scan_runs, 1u) & 1u) != 0; }
#else
__device__ __forceinline__ bool next_run_odd() { return false; }
#endif

__global__ void __launch_bounds__(kScanThreads) ssm_chunk_kernel(const float *xbc, int CD, const float *proj, int ld,
                                                                  int dt_off, float *state, SVec dtb, SVec alog,
                                                                  SVec Dv, int NH, int P, int N, int G, int m,
                                                                  float *y) {
    __shared__ float Bs[kChunk * kRow], Cs[kChunk * kRow];
    __shared__ float M[kChunk * kMRow]; /* decay, then (C_t . B_s) decay dt_s */
    __shared__ float xs[kChunk * kPT], ys[kChunk * kPT];
    __shared__ float dts[kChunk], adt[kChunk], dec0[kChunk], decS[kChunk];
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    const int h = (int)blockIdx.x, p0 = (int)blockIdx.y * kPT, tid = (int)threadIdx.x;
    const int pi = tid / kNQ, nq = tid % kNQ, p = p0 + pi;
    const bool pin = p < P;
    const int DI = NH * P, grp = h / (NH / G);
    const float A = -expf(sget(alog, h)), Dh = sget(Dv, h), bias = sget(dtb, h);
    const bool odd_run = KEEL_SCAN_PLANTED(kPlantRerun) && h == 0 && p0 == 0 && tid == 0 && next_run_odd();
    float H[kNJ];
    for (int j = 0; j < kNJ; j++) {
        const int n = nq + kNQ * j;
        H[j] = pin && n < N ? state[((long long)h * P + p) * N + n] : 0.0f;
    }
    for (int t0 = 0; t0 < m; t0 += kChunk) {
        const int Lc = min(kChunk, m - t0);
        for (int i = tid; i < Lc * N; i += kScanThreads) {
            const int s = i / N, n = i % N;
            const float *row = xbc + (long long)(t0 + s) * CD + DI;
            Bs[s * kRow + n] = row[(long long)grp * N + n];
            Cs[s * kRow + n] = row[(long long)G * N + (long long)grp * N + n];
        }
        for (int i = tid; i < Lc * kPT; i += kScanThreads) {
            const int s = i / kPT, q = i % kPT;
            xs[i] = p0 + q < P ? xbc[(long long)(t0 + s) * CD + (long long)h * P + p0 + q] : 0.0f;
        }
        if (tid < Lc) {
            const float dt = scan_softplus(__fadd_rn(proj[(long long)(t0 + tid) * ld + dt_off + h], bias));
            dts[tid] = dt;
            adt[tid] = __fmul_rn(A, dt);
        }
        __syncthreads();
        if (tid < Lc) { /* row t of the decay: exp(A (dt_{s+1} + ... + dt_t)) for s = t .. -1, summed from t down */
            const int t = tid;
            float acc = 0.0f;
            M[t * kMRow + t] = 1.0f;
            if (t == Lc - 1) decS[t] = 1.0f;
            for (int s = t - 1; s >= -1; s--) {
                if (!(KEEL_SCAN_PLANTED(kPlantDecay) && s == -1)) acc = __fadd_rn(acc, adt[s + 1]);
                const float e = expf(acc);
                if (s >= 0) M[t * kMRow + s] = e;
                else dec0[t] = e;
                if (t == Lc - 1 && s >= 0) decS[s] = e;
            }
        }
        __syncthreads();
        {
            const int t = tid >> 3;
            for (int k = 0; k < kChunk / 8; k++) {
                const int s = (tid & 7) + 8 * k;
                if (t >= Lc || s > t) continue;
                float g = 0.0f;
                for (int n = 0; n < N; n++) g = __fadd_rn(g, __fmul_rn(Cs[t * kRow + n], Bs[s * kRow + n]));
                M[t * kMRow + s] = __fmul_rn(__fmul_rn(g, M[t * kMRow + s]), dts[s]);
            }
        }
        __syncthreads();
        float inter[kChunk / kNQ] = {0.0f, 0.0f};
        for (int t = 0; t < Lc; t++) { /* C_t . H for this channel, lane (t mod 16) keeps it */
            float part = 0.0f;
            for (int j = 0; j < kNJ; j++) {
                const int n = nq + kNQ * j;
                if (n < N) part = __fadd_rn(part, __fmul_rn(Cs[t * kRow + n], H[j]));
            }
            part = half_sum(part);
            if ((t & (kNQ - 1)) == nq) inter[t / kNQ] = part;
        }
        for (int k = 0; k < kChunk / kNQ; k++) {
            const int t = nq + kNQ * k;
            if (t >= Lc) continue;
            float intra = 0.0f;
            for (int s = 0; s <= t; s++) intra = __fadd_rn(intra, __fmul_rn(M[t * kMRow + s], xs[s * kPT + pi]));
            float v = __fadd_rn(intra, __fmul_rn(dec0[t], inter[k]));
            if (!KEEL_SCAN_PLANTED(kPlantNoDSkip)) v = __fadd_rn(v, __fmul_rn(Dh, xs[t * kPT + pi]));
            if (odd_run && t0 == 0 && t == 0) v = nextafterf(v, INFINITY);
            ys[t * kPT + pi] = v;
        }
        float acc[kNJ];
        for (int j = 0; j < kNJ; j++) acc[j] = 0.0f;
        for (int s = 0; s < Lc; s++) {
            const float c = __fmul_rn(__fmul_rn(decS[s], dts[s]), xs[s * kPT + pi]);
            for (int j = 0; j < kNJ; j++) {
                const int n = nq + kNQ * j;
                if (n < N) acc[j] = __fadd_rn(acc[j], __fmul_rn(c, Bs[s * kRow + n]));
            }
        }
        const float decL = dec0[Lc - 1];
        for (int j = 0; j < kNJ; j++) H[j] = __fadd_rn(__fmul_rn(decL, H[j]), acc[j]);
        __syncthreads();
        for (int i = tid; i < Lc * kPT; i += kScanThreads) {
            const int s = i / kPT, q = i % kPT;
            if (p0 + q < P) y[(long long)(t0 + s) * DI + (long long)h * P + p0 + q] = ys[i];
        }
        __syncthreads();
    }
    for (int j = 0; j < kNJ; j++) {
        const int n = nq + kNQ * j;
        if (pin && n < N) state[((long long)h * P + p) * N + n] = H[j];
    }
}

} // namespace

extern "C" void KEEL_SCN_FN(ssm_chunked)(const float *xbc, int CD, const float *proj, int ld, int dt_off, float *state,
                                         const keel_ecu_vec *dt_bias, const keel_ecu_vec *A_log, const keel_ecu_vec *D,
                                         int NH, int P, int N, int G, int m, float *y, void *st) {
    KEEL_ASSERTF(N >= 1 && N <= kScanMaxN, "chunked ssm state %d (1..%d)", N, kScanMaxN);
    KEEL_ASSERTF(NH >= 1 && P >= 1 && G >= 1 && NH % G == 0, "chunked ssm heads %d, groups %d", NH, G);
    if (m <= 0) return;
    dim3 grid((unsigned)NH, (unsigned)((P + kPT - 1) / kPT));
    KP_LAUNCH(keel_ecu_pdl_on(), ssm_chunk_kernel, grid, dim3(kScanThreads), 0, st, xbc, CD, proj, ld, dt_off, state,
              sv(dt_bias), sv(A_log), sv(D), NH, P, N, G, m, y);
    KEEL_CUDA_CHECK_LAUNCH();
}

#if !KEEL_SCAN_TWIN
extern "C" const void *keel_ecu_sample_kernel_fn(const char *symbol);
extern "C" const void *keel_ecu_sample_kernel_at(int i);

/* The host function pointer of a kernel of scan.cu or sample.cu by its gate-5 audit symbol; NULL if unknown. */
extern "C" const void *keel_ecu_scan_kernel_fn(const char *symbol) {
    if (symbol && !strcmp(symbol, "ssm_chunk_kernel")) return (const void *)ssm_chunk_kernel;
    return keel_ecu_sample_kernel_fn(symbol);
}

extern "C" const void *keel_ecu_scan_kernel_at(int i) {
    return i == 0 ? (const void *)ssm_chunk_kernel : keel_ecu_sample_kernel_at(i - 1);
}
#endif
