/* engine/cuda: the GPU engine's kernels besides the stream tiles: embedding, norms with fused residual adds, the
 * Mamba-2 conv and scan, the router and its unions, the fp32 matvec and argmax (attention: attn.cu). Products and sums are
 * written with explicit rounding (__fmul_rn/__fadd_rn) where the CPU engine's order is followed, so no
 * contraction changes the arithmetic between the two. Block reductions use a fixed tree, so results never depend on
 * which window a row is in. */
#include <stdio.h>
#include <string.h>

#include "../../kernels/cuda/port.h"
#include "ecuda.h"


/* Built a second time as the contract's twin (src/contract/twin_engine_cuda.cu) with KEEL_ECU_TWIN 1: the launchers
 * are renamed and one planted fault (KEEL_ECU_PLANT_*) can be armed at a time. */
#ifndef KEEL_ECU_TWIN
#define KEEL_ECU_TWIN 0
#define KEEL_ECU_FN(name) keel_ecu_##name
#else
#define KEEL_ECU_FN(name) keel_contract_twin_ecu_##name
#endif

namespace {

#if KEEL_ECU_TWIN
__device__ int g_plant;
#define PLANTED(f) (g_plant == (f))
#else
#define PLANTED(f) false
#endif

constexpr int kNormThreads = 256;

__device__ __forceinline__ float ld_dt(const void *p, int dt, long long i) {
    if (dt == KEEL_DT_BF16) return kp_bf16_to_f32(((const uint16_t *)p)[i]);
    if (dt == KEEL_DT_F16) return kp_f16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

struct DVec {
    const void *p;
    int dt, n;
};

DVec dv(const keel_ecu_vec *v) {
    DVec d = {v ? v->p : nullptr, v ? (int)v->dt : 0, v ? v->n : 0};
    return d;
}

__device__ __forceinline__ float vget(const DVec &v, long long i) { return ld_dt(v.p, v.dt, i); }

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }
__device__ __forceinline__ float softplus(float v) { return v > 0.0f ? v + log1pf(expf(-v)) : log1pf(expf(v)); }

__device__ __forceinline__ uint32_t code_at(const uint32_t *row, int bits, int c) {
    unsigned long long bit = (unsigned long long)c * (unsigned)bits, wi = bit >> 5;
    unsigned sh = (unsigned)(bit & 31u);
    unsigned long long two = (unsigned long long)row[wi] | (sh + (unsigned)bits > 32u ? (unsigned long long)row[wi + 1] << 32 : 0ull);
    return (uint32_t)(two >> sh) & ((1u << bits) - 1u);
}

/* Sum over the block with a fixed tree (v[i] += v[i + s] for s = blockDim/2 .. 1, blockDim a power of two >= 32);
 * every thread gets the result. The strides below a warp go through shuffles, which add the same pairs in the same
 * order as the shared-memory steps above them. buf holds blockDim.x floats. */
__device__ float block_sum(float v, float *buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s >= 32; s >>= 1) {
        if ((int)threadIdx.x < s) buf[threadIdx.x] = __fadd_rn(buf[threadIdx.x], buf[threadIdx.x + s]);
        __syncthreads();
    }
    if (threadIdx.x < 32) {
        float w = buf[threadIdx.x];
        for (int s = 16; s > 0; s >>= 1) w = __fadd_rn(w, kp_shfl_down_f32(w, s));
        if (threadIdx.x == 0) buf[0] = w;
    }
    __syncthreads();
    float r = buf[0];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, kp_shfl_xor_f32(v, o));
    return v;
}

struct QW {
    const uint32_t *w;
    const void *sc, *bi;
    int n, k, bits, group, sdt;
};

QW qw(const keel_cuda_qw *W) {
    QW q = {W->w, W->scales, W->biases, W->n, W->k, W->bits, W->group, (int)W->sdt};
    return q;
}

__global__ void embed_kernel(QW t, const int *tok, int m, float *x) {
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)m * t.k) return;
    int r = (int)(i / t.k), c = (int)(i % t.k);
    long long row = tok[r];
    if (t.bits == 0) {
        x[i] = ld_dt(t.w, t.sdt, row * t.k + c);
        return;
    }
    const uint32_t *rw = t.w + row * ((long long)t.k * t.bits / 32);
    long long g = row * (t.k / t.group) + c / t.group;
    float s = ld_dt(t.sc, t.sdt, g), b = ld_dt(t.bi, t.sdt, g);
    const uint32_t q = PLANTED(KEEL_ECU_PLANT_WIDTH4) ? code_at(rw, 4, c) : code_at(rw, t.bits, c);
    x[i] = __fadd_rn(__fmul_rn(s, (float)q), b);
}

__device__ void norm_row(const float *xr, DVec w, int n, float eps, float *yf, uint16_t *yb, float *buf) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss = __fadd_rn(ss, __fmul_rn(xr[i], xr[i]));
    ss = block_sum(ss, buf);
    const float inv = 1.0f / sqrtf(__fadd_rn(ss / (float)n, eps));
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = __fmul_rn(__fmul_rn(xr[i], inv), vget(w, i));
        if (yf) yf[i] = v;
        if (yb) yb[i] = kp_f32_to_bf16(v);
    }
}

__global__ void rmsnorm_kernel(const float *x, int ldx, DVec w, int n, float eps, float *yf, uint16_t *yb, int ldy) {
    __shared__ float buf[kNormThreads];
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    const long long r = blockIdx.x;
    norm_row(x + r * ldx, w, n, eps, yf ? yf + r * ldy : nullptr, yb ? yb + r * ldy : nullptr, buf);
    if (PLANTED(KEEL_ECU_PLANT_PASTEND) && threadIdx.x == 0 && r == gridDim.x - 1 && yf) yf[r * ldy + n] = 0.0f;
}

#if defined(__HIPCC__)
constexpr int kNormRegs = 8; /* RDNA holds 128 VGPRs a lane at this block size: 16 elements' five arrays spill */
#else
constexpr int kNormRegs = 16; /* a row of up to kNormRegs * kNormThreads elements is held in registers */
#endif

/* Row r of the residual add and RMSNorm held in registers (n <= kNormRegs * kNormThreads, kNormThreads threads):
 * v = x + ((a [+ b]) [+ bias]), then with w the norm of v times w. With `store` v goes to xo (may be x: each thread
 * reads its elements before it writes them) and the norm to yf / yb; with keep the norm goes to keep (fp32) too.
 * The model's weights load before the grid wait, then every load of the row at once (one round trip). */
__device__ __forceinline__ void add_norm_regs(long long r, float *xo, const float *x, const float *a, const float *b,
                                              DVec bias, DVec w, int n, float eps, float *yf, uint16_t *yb,
                                              float *keep, bool store, float *buf) {
    float v[kNormRegs], wv[kNormRegs], bv[kNormRegs];
#pragma unroll
    for (int j = 0; j < kNormRegs; j++) { /* the model's weights first: no kernel writes them */
        const int i = threadIdx.x + j * kNormThreads;
        wv[j] = w.n && i < n ? vget(w, i) : 0.0f;
        bv[j] = bias.n && i < n ? vget(bias, i) : 0.0f;
    }
    kp_grid_wait(); /* x, a and b are the previous kernels' */
    float av[kNormRegs], ov[kNormRegs];
#pragma unroll
    for (int j = 0; j < kNormRegs; j++) { /* loads only: no use between them, so all are in flight at once */
        const int i = threadIdx.x + j * kNormThreads;
        v[j] = i < n ? x[r * n + i] : 0.0f;
        av[j] = i < n ? a[r * n + i] : 0.0f;
        ov[j] = b && i < n ? b[r * n + i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kNormRegs; j++) {
        const int i = threadIdx.x + j * kNormThreads;
        if (i < n) {
            float t = av[j];
            if (b) t = __fadd_rn(t, ov[j]);
            if (bias.n && !PLANTED(KEEL_ECU_PLANT_NOBIAS)) t = __fadd_rn(t, bv[j]);
            v[j] = __fadd_rn(v[j], t);
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < kNormRegs; j++) {
        const int i = threadIdx.x + j * kNormThreads;
        if (i < n) {
            if (store) xo[r * n + i] = v[j];
            ss = __fadd_rn(ss, __fmul_rn(v[j], v[j]));
        }
    }
    if (!w.n) return;
    ss = block_sum(ss, buf);
    const float inv = 1.0f / sqrtf(__fadd_rn(ss / (float)n, eps));
    float *of = store && yf ? yf + r * n : nullptr;
    uint16_t *ob = store && yb ? yb + r * n : nullptr;
#pragma unroll
    for (int j = 0; j < kNormRegs; j++) {
        const int i = threadIdx.x + j * kNormThreads;
        if (i < n) {
            const float t = __fmul_rn(__fmul_rn(v[j], inv), wv[j]);
            if (of) of[i] = t;
            if (ob) ob[i] = kp_f32_to_bf16(t);
            if (keep) keep[i] = t;
        }
    }
}

__global__ void add_rmsnorm_kernel(float *xo, const float *x, const float *__restrict__ a,
                                   const float *__restrict__ b, DVec bias, DVec w, int n, float eps,
                                   float *__restrict__ yf, uint16_t *__restrict__ yb) {
    __shared__ float buf[kNormThreads];
    kp_grid_release(); /* a stream tile after this may start its weight prefetch */
    const long long r = blockIdx.x;
    if (n <= kNormRegs * kNormThreads && blockDim.x == kNormThreads) {
        add_norm_regs(r, xo, x, a, b, bias, w, n, eps, yf, yb, nullptr, true, buf);
        return;
    }
    kp_grid_wait();
    for (int i = threadIdx.x; i < n; i += blockDim.x) { /* the same sums in the same order as add_norm_regs */
        float t = a[r * n + i];
        if (b) t = __fadd_rn(t, b[r * n + i]);
        if (bias.n && !PLANTED(KEEL_ECU_PLANT_NOBIAS)) t = __fadd_rn(t, vget(bias, i));
        xo[r * n + i] = __fadd_rn(x[r * n + i], t);
    }
    __syncthreads();
    if (w.n) norm_row(xo + r * n, w, n, eps, yf ? yf + r * n : nullptr, yb ? yb + r * n : nullptr, buf);
}

__global__ void add_bias_kernel(float *y, int m, int n, int ld, DVec b) {
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)m * n) return;
    long long r = i / n, c = i % n;
    y[r * ld + c] = __fadd_rn(y[r * ld + c], vget(b, c));
    if (PLANTED(KEEL_ECU_PLANT_PASTEND) && i == (long long)m * n - 1) y[r * ld + n] = 0.0f;
}

/* Routing of a matvec: item i of m*K reads expert sel[i] (experts ew words / es scale elements apart) and x row
 * i (x_per_item) or i / K; y row i. Without sel: item i is row i of one matrix. */
struct Route {
    const int *sel;
    int K, x_per_item;
    long long ew, es;
};

/* One warp per (item, output): lane j takes codes j, j+32, ... of each group; the group sums are warp-reduced. */
/* Code j (0..31) of a 32-code unit held in B words (LSB first), as an exact float: or-ed under 2^23, 2^23 taken off. */
template <int B> __device__ __forceinline__ float unit_code(const uint32_t *wd, int j) {
    const int bit = j * B, wi = bit >> 5, sh = bit & 31;
    uint32_t q = wd[wi] >> sh;
    if (sh + B > 32) q |= wd[wi + 1] << (32 - sh);
    return __fsub_rn(__uint_as_float((q & ((1u << B) - 1u)) | 0x4B000000u), 8388608.0f);
}

/* Eight bf16 values in one 16-byte word as fp32, in order. */
__device__ __forceinline__ void bf16x8(uint4 h, float out[8]) {
    const uint32_t u[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
    for (int i = 0; i < 4; i++) out[2 * i] = __uint_as_float(u[i] << 16), out[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
}

/* x[i .. i + 8) as fp32: one 16-byte load (bf16) or two (fp32); i a multiple of 8. */
__device__ __forceinline__ void x_vec8(const void *x, int x_bf16, long long i, float out[8]) {
    if (x_bf16) {
        bf16x8(*(const uint4 *)((const uint16_t *)x + i), out);
    } else {
        const float4 a = *(const float4 *)((const float *)x + i), b = *((const float4 *)((const float *)x + i) + 1);
        out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
    }
}

/* A lane's share of one output of the quantized matvec: for each of its 32-code units u (lane, lane + 32, ...) the
 * unit's scale*sum(x*q) + bias*sum(x), each sum as four interleaved partial sums of 8 codes added in a fixed tree,
 * units added in order. The words of the next unit are loaded before this one is used. */
template <int B>
__device__ __forceinline__ float units_dot(const uint32_t *rw, long long go, const QW &W, const void *x, int x_bf16,
                                           long long xo, int units, int lug, int lane) {
    float acc = 0.0f;
    uint32_t wd[B];
    if (lane < units)
#pragma unroll
        for (int i = 0; i < B; i++) wd[i] = kp_ldg32(rw + (long long)lane * B + i);
    for (int u = lane; u < units; u += 32) {
        uint32_t cur[B];
#pragma unroll
        for (int i = 0; i < B; i++) cur[i] = wd[i];
        if (u + 32 < units)
#pragma unroll
            for (int i = 0; i < B; i++) wd[i] = kp_ldg32(rw + (long long)(u + 32) * B + i);
        const long long gi = go + (u >> lug);
        const float sc = ld_dt(W.sc, W.sdt, gi), bi = ld_dt(W.bi, W.sdt, gi);
        float sxq[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sx[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const long long x0 = xo + (long long)u * 32;
#pragma unroll
        for (int v = 0; v < 4; v++) { /* 8 activations a step */
            float xv[8];
            x_vec8(x, x_bf16, x0 + 8 * v, xv);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int j = 8 * v + i;
                sxq[j & 3] = __fmaf_rn(xv[i], unit_code<B>(cur, j), sxq[j & 3]);
                sx[j & 3] = __fadd_rn(sx[j & 3], xv[i]);
            }
        }
        const float q = __fadd_rn(__fadd_rn(sxq[0], sxq[1]), __fadd_rn(sxq[2], sxq[3]));
        const float t = __fadd_rn(__fadd_rn(sx[0], sx[1]), __fadd_rn(sx[2], sx[3]));
        const float bterm = PLANTED(KEEL_ECU_PLANT_NOBIAS) ? 0.0f : __fmul_rn(bi, t);
        acc = __fadd_rn(acc, __fmaf_rn(sc, q, bterm));
    }
    return acc;
}

constexpr int kVecLoads = 12; /* a lane's 16-byte weight loads in flight: rows of up to 3072 in one batch */

/* Whether a float matrix's rows take the vector path: BF16 weights, k a multiple of 8, weights and x 16-byte aligned. */
__device__ __forceinline__ bool vec_rows(const QW &W, const void *x) {
    return W.sdt == KEEL_DT_BF16 && (W.k & 7) == 0 && (((uintptr_t)W.w | (uintptr_t)x) & 15) == 0;
}

/* One output of the fp32 matvec per warp (warp = item * n + output). Float matrices whose rows take the vector path
 * (vec_rows: a function of the matrix and x only, never of m) sum 8-element vectors; others element by element, NB
 * elements a lane loaded before it adds any (1 for the plain matvec, more for the fused router); the same sums in the
 * same order, so the same bits, whatever NB. */
template <int NB>
__device__ __forceinline__ void matvec_warp(const QW &W, const Route &R, const void *x, int x_bf16, int m, void *y,
                                            int y_bf16, int epi, int warp, int lane) {
    const int items = R.sel ? m * R.K : m;
    if (warp >= items * W.n) return;
    const int it = warp / W.n, o = warp % W.n;
    const int xr = R.sel && !R.x_per_item ? it / R.K : it;
    const long long ex = R.sel ? R.sel[it] : 0;
    const long long xo = (long long)xr * W.k;
    float acc = 0.0f;
    const long long wo = ex * R.es + (long long)o * W.k; /* a float matrix's row */
    if (W.bits == 0 && vec_rows(W, x)) { /* lane l sums the 8-element vectors l, l + 32, ... in order */
        const uint4 *wr = (const uint4 *)((const uint16_t *)W.w + wo);
        const int nv = W.k >> 3;
        for (int v0 = lane; v0 < nv; v0 += 32 * kVecLoads) {
            uint4 wv[kVecLoads];
#pragma unroll
            for (int j = 0; j < kVecLoads; j++) /* every weight load of the batch before the first use */
                wv[j] = v0 + 32 * j < nv ? wr[v0 + 32 * j] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int j = 0; j < kVecLoads; j++) {
                const int v = v0 + 32 * j;
                if (v < nv) { /* a predicate, not a break: the batch stays in registers */
                    float xv[8], wf[8];
                    x_vec8(x, x_bf16, xo + 8ll * v, xv);
                    bf16x8(wv[j], wf);
#pragma unroll
                    for (int e = 0; e < 8; e++) acc = __fadd_rn(acc, __fmul_rn(xv[e], wf[e]));
                }
            }
        }
    } else if (W.bits == 0) { /* lane l sums elements l, l + 32, ... in order */
        for (int c0 = lane; c0 < W.k; c0 += 32 * NB) {
            float xv[NB], wv[NB];
#pragma unroll
            for (int j = 0; j < NB; j++) {
                const int c = c0 + 32 * j;
                xv[j] = c >= W.k ? 0.0f
                        : x_bf16 ? kp_bf16_to_f32(((const uint16_t *)x)[xo + c])
                                 : ((const float *)x)[xo + c];
                wv[j] = c < W.k ? ld_dt(W.w, W.sdt, wo + c) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < NB; j++)
                if (c0 + 32 * j < W.k) acc = __fadd_rn(acc, __fmul_rn(xv[j], wv[j]));
        }
    } else { /* lane l takes the 32-code units l, l+32, ...; each unit is `bits` whole words */
        const uint32_t *rw = W.w + ex * R.ew + (long long)o * ((long long)W.k * W.bits / 32);
        const long long go = ex * R.es + (long long)o * (W.k / W.group);
        const int units = W.k >> 5, lug = 31 - __clz(W.group) - 5;
        switch (W.bits) {
        case 2: acc = units_dot<2>(rw, go, W, x, x_bf16, xo, units, lug, lane); break;
        case 3: acc = units_dot<3>(rw, go, W, x, x_bf16, xo, units, lug, lane); break;
        case 4: acc = units_dot<4>(rw, go, W, x, x_bf16, xo, units, lug, lane); break;
        case 5: acc = units_dot<5>(rw, go, W, x, x_bf16, xo, units, lug, lane); break;
        case 6: acc = units_dot<6>(rw, go, W, x, x_bf16, xo, units, lug, lane); break;
        default: acc = units_dot<8>(rw, go, W, x, x_bf16, xo, units, lug, lane); break;
        }
    }
    acc = warp_sum(acc);
    if (W.bits == 0 && PLANTED(KEEL_ECU_PLANT_ROWLEAK) && m > 1) acc = __fmul_rn(acc, 1.0f + 0x1p-22f);
    if (lane == 0) {
        if (epi == KEEL_EPI_RELU2) acc = acc > 0.0f ? __fmul_rn(acc, acc) : 0.0f;
        long long yi = (long long)it * W.n + o;
        if (y_bf16) ((uint16_t *)y)[yi] = kp_f32_to_bf16(acc);
        else ((float *)y)[yi] = acc;
    }
}

__global__ void matvec_kernel(QW W, Route R, const void *x, int x_bf16, int m, void *y, int y_bf16, int epi) {
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    matvec_warp<1>(W, R, x, x_bf16, m, y, y_bf16, epi, (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5),
                (int)(threadIdx.x & 31));
}

/* add_rmsnorm then the fp32 matvec in one launch (the MoE router): every block norms the m rows into shared memory
 * (add_norm_regs: add_rmsnorm_kernel's bits), block 0 also stores them as add_rmsnorm does, then the warps' outputs
 * as matvec_kernel on those rows. */
__global__ void matvec_norm_kernel(QW W, float *xo, const float *x, const float *__restrict__ a,
                                   const float *__restrict__ b, DVec bias, DVec w, float eps, float *yf,
                                   uint16_t *yb, int m, float *y) {
    extern __shared__ float xn[]; /* (m, k) the normed rows */
    __shared__ float buf[kNormThreads];
    kp_grid_release(); /* the next kernel may launch; it waits for this one's outputs */
    for (int r = 0; r < m; r++)
        add_norm_regs(r, xo, x, a, b, bias, w, W.k, eps, yf, yb, xn + (long long)r * W.k, blockIdx.x == 0, buf);
    __syncthreads();
    const Route R = {nullptr, 1, 0, 0, 0};
    matvec_warp<1>(W, R, xn, 0, m, y, 0, KEEL_EPI_NONE, (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5),
                   (int)(threadIdx.x & 31));
}

/* out (m, n) = sum over slots k in order of w[(r*K+k)*8] * y[(r*K+k)] (the CPU engine's slot-order sum). */
__global__ void combine_kernel(const float *y, const float *w, int m, int K, int n, float *out) {
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)m * n) return;
    const long long r = i / n, c = i % n;
    float acc = 0.0f;
    for (int k = 0; k < K; k++) {
        if (PLANTED(KEEL_ECU_PLANT_NOBIAS) && k == K - 1) break;
        acc = __fadd_rn(acc, __fmul_rn(w[(r * K + k) * 8], y[(r * K + k) * n + c]));
    }
    out[i] = acc;
}

constexpr int kMaxConvK = 8;

/* The causal conv of channel c (of C) over m tokens, as conv_kernel computes it: the window h (K-1 earlier inputs,
 * win[k*C + c]) then each token's input at proj[r*ld + off + c]; silu outputs to out[r * ldo]; h leaves shifted.
 * The loops run to kMaxConvK with the run-time width as a predicate, so w and h stay in registers. */
__device__ __forceinline__ void conv_channel(const float *proj, int ld, int off, const float *win, DVec cw, DVec cb,
                                             int K, int C, int m, int c, float *out, long long ldo, float *h) {
    float w[kMaxConvK - 1];
#pragma unroll
    for (int k = 0; k < kMaxConvK - 1; k++) {
        w[k] = k < K - 1 ? vget(cw, (long long)c * K + k) : 0.0f;
        h[k] = k < K - 1 ? win[(long long)k * C + c] : 0.0f;
    }
    const float wl = vget(cw, (long long)c * K + K - 1), b = cb.n ? vget(cb, c) : 0.0f;
    for (int r = 0; r < m; r++) {
        const float in = proj[(long long)r * ld + off + c];
        float acc = b;
#pragma unroll
        for (int k = 0; k < kMaxConvK - 1; k++)
            if (k < K - 1) acc = __fadd_rn(acc, __fmul_rn(w[k], h[k]));
        acc = __fadd_rn(acc, __fmul_rn(wl, in));
        out[(long long)r * ldo] = silu(acc);
        if (PLANTED(KEEL_ECU_PLANT_NOSHIFT)) continue;
#pragma unroll
        for (int k = 0; k < kMaxConvK - 1; k++) { /* h[k] = h[k + 1] below K - 2, h[K - 2] = in, by selects */
            const float nx = k + 1 < kMaxConvK - 1 ? h[k + 1] : 0.0f;
            h[k] = k + 1 < K - 1 ? nx : k == K - 2 ? in : h[k];
        }
    }
}

__global__ void conv_kernel(const float *proj, int ld, int off, float *win, DVec cw, DVec cb, int K, int C, int m,
                            float *out) {
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    const int c = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (c >= C) return;
    float h[kMaxConvK - 1];
    conv_channel(proj, ld, off, win, cw, cb, K, C, m, c, out + c, C, h);
#pragma unroll
    for (int k = 0; k < kMaxConvK - 1; k++)
        if (k < K - 1) win[(long long)k * C + c] = h[k];
}

constexpr int kMaxStatePerLane = 8; /* ssm_state up to 256 */

/* Channel p of head h's state row (N) into the lanes' registers s (lane + 32 i). */
__device__ __forceinline__ void ssm_load(const float *state, int P, int N, int h, int p, int lane, float *s) {
    const float *srow = state + ((long long)h * P + p) * N;
#pragma unroll
    for (int i = 0; i < kMaxStatePerLane; i++) {
        int n = lane + 32 * i;
        s[i] = n < N ? srow[n] : 0.0f;
    }
}

/* Head h's scan constants: A = -exp(A_log), D and the dt bias (model weights: readable before the grid wait). */
struct SsmHead {
    float A, D, bias;
};
__device__ __forceinline__ SsmHead ssm_head(DVec dtb, DVec alog, DVec Dv, int h) {
    const float al = vget(alog, h), d = vget(Dv, h), b = vget(dtb, h); /* three loads in flight together */
    SsmHead c = {-expf(al), d, b};
    return c;
}

/* The scan of channel p of head h over m tokens by one warp, as ssm_kernel computes it, from its state row s (as
 * ssm_load leaves it; stored back at the end); token r's x at x0[r*xld], its B and C at B0 + r*xld and C0 + r*xld;
 * y (m, NH*P). */
__device__ __forceinline__ void ssm_run(float *s, const float *x0, const float *B0, const float *C0, long long xld,
                                        const float *proj, int ld, int dt_off, float *state, SsmHead hc, int NH, int P,
                                        int N, int m, float *y, int h, int p, int lane) {
    float *srow = state + ((long long)h * P + p) * N;
    const int DI = NH * P;
    const float A = hc.A, Dh = hc.D, bias = hc.bias;
    for (int r = 0; r < m; r++) {
        const float *B = B0 + r * xld, *Cm = C0 + r * xld;
        const float dtr = proj[(long long)r * ld + dt_off + h], xv = x0[r * xld];
        float bv[kMaxStatePerLane], cv[kMaxStatePerLane]; /* the token's loads first, all in flight at once */
#pragma unroll
        for (int i = 0; i < kMaxStatePerLane; i++) {
            const int n = lane + 32 * i;
            bv[i] = n < N ? B[n] : 0.0f;
            cv[i] = n < N ? Cm[n] : 0.0f;
        }
        const float dt = softplus(__fadd_rn(dtr, bias));
        const float dA = expf(__fmul_rn(A, dt));
        const float xdt = __fmul_rn(xv, dt);
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < kMaxStatePerLane; i++) {
            int n = lane + 32 * i;
            if (n < N) {
                s[i] = __fadd_rn(__fmul_rn(dA, s[i]), __fmul_rn(xdt, bv[i]));
                acc = __fadd_rn(acc, __fmul_rn(s[i], cv[i]));
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) y[(long long)r * DI + h * P + p] = PLANTED(KEEL_ECU_PLANT_NOBIAS) ? acc : __fadd_rn(acc, __fmul_rn(Dh, xv));
    }
    for (int i = 0; i < kMaxStatePerLane; i++) {
        int n = lane + 32 * i;
        if (n < N) srow[n] = s[i];
    }
}

/* One warp per (head, channel p): the state row (N) lives in the lanes' registers across the m tokens. */
__global__ void ssm_kernel(const float *xbc, int CD, const float *proj, int ld, int dt_off, float *state, DVec dtb,
                           DVec alog, DVec Dv, int NH, int P, int N, int G, int m, float *y) {
    const int warp = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5), lane = (int)(threadIdx.x & 31);
    const int h = min(warp / P, NH - 1), p = warp % P, DI = NH * P, grp = h / (NH / G);
    const SsmHead hc = ssm_head(dtb, alog, Dv, h); /* weights before the wait */
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    if (warp >= NH * P) return;
    float s[kMaxStatePerLane];
    ssm_load(state, P, N, h, p, lane, s);
    ssm_run(s, xbc + h * P + p, xbc + DI + grp * N, xbc + DI + G * N + grp * N, CD, proj, ld, dt_off, state, hc, NH, P,
            N, m, y, h, p, lane);
}

constexpr int kGateRegs = 4; /* a group of up to kGateRegs * blockDim elements is held in registers */

/* The gated RMSNorm of group q of row r by one block of kNormThreads (buf as many floats), as gate_norm_kernel
 * computes it; y is read from L2 (the fused Mamba step reads other blocks' y). */
__device__ __forceinline__ void gate_norm_group(const float *y, const float *proj, int ld, DVec w, int G, int DI,
                                                float eps, uint16_t *out, float *outf, int r, int q, float *buf) {
    const int gs = PLANTED(KEEL_ECU_PLANT_GROUPS) && q == 0 ? DI / G + 1 : DI / G;
    const float *yr = y + (long long)r * DI + (long long)q * gs, *z = proj + (long long)r * ld + (long long)q * gs;
    if (gs <= kGateRegs * (int)blockDim.x) { /* the group in registers: every load first, then the loop's sums */
        float v[kGateRegs], zv[kGateRegs], wv[kGateRegs];
#pragma unroll
        for (int j = 0; j < kGateRegs; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            v[j] = i < gs ? kp_ldcg_f32(yr + i) : 0.0f;
            zv[j] = i < gs ? z[i] : 0.0f;
            wv[j] = i < gs ? vget(w, (long long)q * gs + i) : 0.0f;
        }
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < kGateRegs; j++)
            if (threadIdx.x + j * blockDim.x < (unsigned)gs) {
                v[j] = __fmul_rn(v[j], silu(zv[j]));
                ss = __fadd_rn(ss, __fmul_rn(v[j], v[j]));
            }
        ss = block_sum(ss, buf);
        const float inv = 1.0f / sqrtf(__fadd_rn(ss / (float)gs, eps));
        uint16_t *o = out ? out + (long long)r * DI + (long long)q * gs : nullptr;
#pragma unroll
        for (int j = 0; j < kGateRegs; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i >= gs) continue;
            const float t = __fmul_rn(__fmul_rn(v[j], inv), wv[j]);
            if (o) o[i] = kp_f32_to_bf16(t);
            if (outf) outf[(long long)r * DI + (long long)q * gs + i] = t;
        }
        return;
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < gs; i += blockDim.x) {
        float v = __fmul_rn(kp_ldcg_f32(yr + i), silu(z[i]));
        ss = __fadd_rn(ss, __fmul_rn(v, v));
    }
    ss = block_sum(ss, buf);
    const float inv = 1.0f / sqrtf(__fadd_rn(ss / (float)gs, eps));
    uint16_t *o = out ? out + (long long)r * DI + (long long)q * gs : nullptr;
    for (int i = threadIdx.x; i < gs; i += blockDim.x) {
        float v = __fmul_rn(kp_ldcg_f32(yr + i), silu(z[i]));
        const float t = __fmul_rn(__fmul_rn(v, inv), vget(w, (long long)q * gs + i));
        if (o) o[i] = kp_f32_to_bf16(t);
        if (outf) outf[(long long)r * DI + (long long)q * gs + i] = t;
    }
}

__global__ void gate_norm_kernel(const float *y, const float *proj, int ld, DVec w, int G, int DI, float eps,
                                 uint16_t *out, float *outf) {
    __shared__ float buf[kNormThreads];
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    gate_norm_group(y, proj, ld, w, G, DI, eps, out, outf, blockIdx.x / G, blockIdx.x % G, buf);
}

/* One Mamba-2 step of m <= 8 tokens in one launch. proj rows are z (DI) | xBC (CD) | dt (NH). A block of
 * kNormThreads per (head h, slice of kMambaSlice of its P channels): the state rows of its channels loaded first (a
 * warp two channels, both in flight), the conv of its x channels and of its group's B and C channels (conv_channel;
 * the x windows written at once, each block owning its own), the scan of its channels (ssm_run); then the last of the
 * group's blocks to finish (a counter, which it resets) writes the group's B and C windows (every block of the group
 * has read them by then) and applies the gated norm of the group (gate_norm_group). The same device functions as
 * conv_kernel, ssm_kernel and gate_norm_kernel, so their bits. */
constexpr int kMambaSlice = 16; /* channels a block: two a warp */
static_assert(kMambaSlice == 2 * (kNormThreads / 32), "the fused Mamba step gives each warp two channels");

__global__ void mamba_step_kernel(const float *proj, int ld, float *win, DVec cw, DVec cb, int K, float *state,
                                  DVec dtb, DVec alog, DVec Dv, int NH, int P, int N, int G, int m, DVec nw, float eps,
                                  float *xbc, float *y, unsigned *cnt, uint16_t *out, float *outf) {
    extern __shared__ float msm[]; /* xs (m, kMambaSlice + 2N): the conv outputs the scan reads; hs (2N, K-1) */
    __shared__ float buf[kNormThreads];
    __shared__ unsigned last;
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    const int S = (P + kMambaSlice - 1) / kMambaSlice, h = blockIdx.x / S, p0 = (blockIdx.x % S) * kMambaSlice;
    const int np = min(kMambaSlice, P - p0), DI = NH * P, CD = DI + 2 * G * N, grp = h / (NH / G);
    const int W = kMambaSlice + 2 * N, tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    float *xs = msm, *hs = msm + (size_t)m * W;
    const int pa = wid, pb = wid + kNormThreads / 32; /* this warp's channels within the slice */
    float sa[kMaxStatePerLane], sb[kMaxStatePerLane];
    if (pa < np) ssm_load(state, P, N, h, p0 + pa, lane, sa);
    if (pb < np) ssm_load(state, P, N, h, p0 + pb, lane, sb);
    for (int j = tid; j < np + 2 * N; j += blockDim.x) { /* the slice's x channels, then the group's B, then C */
        const int c = j < np ? h * P + p0 + j : j < np + N ? DI + grp * N + (j - np) : DI + G * N + grp * N + (j - np - N);
        const int at = j < np ? j : kMambaSlice + (j - np);
        float hh[kMaxConvK - 1];
        conv_channel(proj, ld, DI, win, cw, cb, K, CD, m, c, xs + at, W, hh);
        for (int r = 0; r < m; r++) xbc[(long long)r * CD + c] = xs[r * W + at];
#pragma unroll
        for (int k = 0; k < kMaxConvK - 1; k++) {
            if (k >= K - 1) continue;
            if (j < np) win[(long long)k * CD + c] = hh[k];
            else hs[(j - np) * (K - 1) + k] = hh[k];
        }
    }
    __syncthreads();
    const float *B0 = xs + kMambaSlice, *C0 = xs + kMambaSlice + N;
    const SsmHead hc = ssm_head(dtb, alog, Dv, h);
    if (pa < np) ssm_run(sa, xs + pa, B0, C0, W, proj, ld, DI + CD, state, hc, NH, P, N, m, y, h, p0 + pa, lane);
    if (pb < np) ssm_run(sb, xs + pb, B0, C0, W, proj, ld, DI + CD, state, hc, NH, P, N, m, y, h, p0 + pb, lane);
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(&cnt[grp], 1u) == (unsigned)(NH / G * S) - 1u;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int j = tid; j < 2 * N; j += blockDim.x) {
        const int c = j < N ? DI + grp * N + j : DI + G * N + grp * N + (j - N);
        for (int k = 0; k < K - 1; k++) win[(long long)k * CD + c] = hs[j * (K - 1) + k];
    }
    for (int r = 0; r < m; r++) gate_norm_group(y, proj, ld, nw, G, DI, eps, out, outf, r, grp, buf);
    if (tid == 0) cnt[grp] = 0u;
}

constexpr int kMaxExperts = 1024;

/* A float's order as an unsigned key: a greater float has a greater key, -0 the key of +0, NaN the lowest. */
__device__ __forceinline__ uint32_t order_key(float f) {
    if (f != f) return 0u;
    const uint32_t u = f == 0.0f ? 0u : __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Whether score sa of a beats score sb of b: by order key (a NaN never beats a number), ties to the lower id. */
__device__ __forceinline__ bool better(float sa, int a, float sb, int b) {
    const uint32_t ka = order_key(sa), kb = order_key(sb);
    return ka > kb || (ka == kb && (PLANTED(KEEL_ECU_PLANT_TIES) ? a > b : a < b));
}

constexpr int kRouteRegs = 8; /* experts a lane holds in registers on route_row's fast path (E <= 256) */

/* route_row for E <= 32 * kRouteRegs experts, K <= 32, no group filter: each lane holds experts lane + 32 j in
 * registers; a round's winner is the largest key (warp max), ties to the lower id (warp min over the lanes holding
 * it); lane k keeps slot k. The same scores, choices and weights as route_row's shared-memory path (both order by
 * order_key, so a NaN score loses on either). */
__device__ __forceinline__ void route_row_regs(const float *logits, const DVec &corr, int E, int K, int norm_topk,
                                               float scaling, keel_cuda_route *items, float *weights, int *sel, int r,
                                               int lane) {
    float sv[kRouteRegs], cv[kRouteRegs];
    uint32_t kv[kRouteRegs], left = 0u; /* left: bit j while expert lane + 32 j is not chosen */
    /* every load first (one round trip, not one per expert; the dtype branch outside the loads), then the scores */
#pragma unroll
    for (int j = 0; j < kRouteRegs; j++) {
        const int i = lane + 32 * j;
        sv[j] = i < E ? logits[(long long)r * E + i] : 0.0f;
    }
    const bool c16 = corr.dt == KEEL_DT_BF16 || corr.dt == KEEL_DT_F16; /* as ld_dt reads it */
#pragma unroll
    for (int j = 0; j < kRouteRegs; j++) cv[j] = 0.0f;
    if (corr.n && !c16) {
#pragma unroll
        for (int j = 0; j < kRouteRegs; j++) cv[j] = lane + 32 * j < E ? ((const float *)corr.p)[lane + 32 * j] : 0.0f;
    } else if (corr.n) {
        uint16_t h[kRouteRegs];
#pragma unroll
        for (int j = 0; j < kRouteRegs; j++) h[j] = lane + 32 * j < E ? ((const uint16_t *)corr.p)[lane + 32 * j] : 0;
        const bool bf = corr.dt == KEEL_DT_BF16;
#pragma unroll
        for (int j = 0; j < kRouteRegs; j++) cv[j] = bf ? kp_bf16_to_f32(h[j]) : kp_f16_to_f32(h[j]);
    }
#pragma unroll
    for (int j = 0; j < kRouteRegs; j++) {
        const int i = lane + 32 * j;
        sv[j] = 1.0f / (1.0f + expf(-sv[j]));
        kv[j] = order_key(corr.n && i < E ? __fadd_rn(sv[j], cv[j]) : sv[j]);
        if (i < E) left |= 1u << j;
    }
    int my_e = 0;
    float my_s = 0.0f;
    for (int k = 0; k < K; k++) {
        uint32_t bk = 0u;
        int bj = -1;
#pragma unroll
        for (int j = 0; j < kRouteRegs; j++) /* ascending ids: ties keep the lower (the planted control: the higher) */
            if (((left >> j) & 1u) && (bj < 0 || kv[j] > bk || (PLANTED(KEEL_ECU_PLANT_TIES) && kv[j] == bk))) {
                bk = kv[j];
                bj = j;
            }
        const uint32_t top = kp_warp_max_u32(bj >= 0 ? bk : 0u);
        const bool cand = bj >= 0 && bk == top;
        const uint32_t id = (uint32_t)(lane + 32 * bj);
        const uint32_t win = PLANTED(KEEL_ECU_PLANT_TIES) ? kp_warp_max_u32(cand ? id : 0u)
                                                          : kp_warp_min_u32(cand ? id : 0xffffffffu);
        const int wl = (int)(win & 31u), wj = (int)(win >> 5);
        float ws = 0.0f;
#pragma unroll
        for (int j = 0; j < kRouteRegs; j++)
            if (j == wj) ws = sv[j];
        ws = kp_shfl_idx_f32(ws, wl);
        if (lane == wl) left &= ~(1u << wj);
        if (lane == k) {
            my_e = (int)win;
            my_s = ws;
        }
    }
    float sum = 0.0f;
    for (int k = 0; k < K; k++) sum = __fadd_rn(sum, kp_shfl_idx_f32(my_s, k));
    const float denom = __fadd_rn(sum, 1e-20f);
    if (lane < K) {
        const float w = __fmul_rn(norm_topk ? my_s / denom : my_s, scaling);
        const long long it = (long long)r * K + lane;
        items[it].expert = my_e;
        items[it].mask = 1u;
        sel[it] = my_e;
        for (int j = 0; j < 8; j++) weights[it * 8 + j] = j == 0 ? w : 0.0f;
    }
    kp_syncwarp();
}

/* One warp per row: sigmoid scores, correction bias, group filter, top-k by (score, lower id), weights. */
/* The router of row r by one warp, in shared scratch s, b (E floats), used (E bytes), chosen (64 ints), gs (64
 * floats) and keep (64 bytes, the group filter's). */
__device__ __forceinline__ void route_row(const float *logits, const DVec &corr, int E, int K, int n_group,
                                          int topk_group, int norm_topk, float scaling, keel_cuda_route *items,
                                          float *weights, int *sel, int r, int lane, float *s, float *b,
                                          unsigned char *used, int *chosen, float *gs, unsigned char *keep) {
    if (E <= 32 * kRouteRegs && K <= 32 && !(n_group > 1 && topk_group < n_group)) {
        route_row_regs(logits, corr, E, K, norm_topk, scaling, items, weights, sel, r, lane);
        return;
    }
    for (int i = lane; i < E; i += 32) {
        float l = logits[(long long)r * E + i];
        s[i] = 1.0f / (1.0f + expf(-l));
        b[i] = corr.n ? __fadd_rn(s[i], vget(corr, i)) : s[i];
        used[i] = 0;
    }
    kp_syncwarp();
    if (n_group > 1 && topk_group < n_group && lane == 0) {
        const int per = E / n_group;
        for (int g = 0; g < n_group; g++) {
            float t1 = -INFINITY, t2 = -INFINITY;
            for (int i = g * per; i < (g + 1) * per; i++) {
                if (b[i] > t1) { t2 = t1; t1 = b[i]; }
                else if (b[i] > t2) t2 = b[i];
            }
            gs[g] = per >= 2 ? __fadd_rn(t1, t2) : t1;
            keep[g] = 0;
        }
        for (int t = 0; t < topk_group; t++) {
            int best = -1;
            for (int g = 0; g < n_group; g++)
                if (!keep[g] && (best < 0 || better(gs[g], g, gs[best], best))) best = g;
            keep[best] = 1;
        }
        for (int i = 0; i < E; i++)
            if (!keep[i / per]) b[i] = 0.0f;
    }
    kp_syncwarp();
    for (int k = 0; k < K; k++) {
        float bv = -INFINITY;
        int bi = -1;
        for (int i = lane; i < E; i += 32)
            if (!used[i] && (bi < 0 || better(b[i], i, bv, bi))) { bv = b[i]; bi = i; }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = kp_shfl_xor_f32(bv, o);
            int oi = kp_shfl_xor_i32(bi, o);
            if (oi >= 0 && (bi < 0 || better(ov, oi, bv, bi))) { bv = ov; bi = oi; }
        }
        if (lane == 0) {
            used[bi] = 1;
            chosen[k] = bi;
        }
        kp_syncwarp();
    }
    if (lane == 0) {
        float sum = 0.0f;
        for (int k = 0; k < K; k++) sum = __fadd_rn(sum, s[chosen[k]]);
        const float denom = __fadd_rn(sum, 1e-20f);
        for (int k = 0; k < K; k++) {
            float w = s[chosen[k]];
            w = __fmul_rn(norm_topk ? w / denom : w, scaling);
            const long long it = (long long)r * K + k;
            items[it].expert = chosen[k];
            items[it].mask = 1u;
            sel[it] = chosen[k];
            for (int j = 0; j < 8; j++) weights[it * 8 + j] = j == 0 ? w : 0.0f;
        }
    }
    kp_syncwarp();
}

__global__ void route_kernel(const float *logits, DVec corr, int E, int K, int n_group, int topk_group, int norm_topk,
                             float scaling, keel_cuda_route *items, float *weights, int *sel) {
    __shared__ float s[kMaxExperts], b[kMaxExperts];
    __shared__ unsigned char used[kMaxExperts];
    __shared__ int chosen[64];
    __shared__ float gs[64];
    __shared__ unsigned char keep[64];
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    route_row(logits, corr, E, K, n_group, topk_group, norm_topk, scaling, items, weights, sel, blockIdx.x, threadIdx.x,
              s, b, used, chosen, gs, keep);
}

/* Per group of up to 8 consecutive rows (one warp a group): the union of the experts its rows selected, in ascending
 * expert order, as routed items (expert, mask of the group's rows that chose it) with weights [item][row] taken from
 * the one-row weights (m*K*8, [row*K+slot][0]); padded to cap items with (0, 0) items no row reads. Ascending order
 * makes a row's experts meet it in the same order whichever rows share its window. */
constexpr int kMaxUnionSel = 8 * 64; /* a group's selections: 8 rows of up to 64 experts */

__device__ __forceinline__ void union_group(const int *sel, const float *w, int m, int K, int E, int cap,
                                            keel_cuda_route *items, float *weights, int g, int lane, int *gsel,
                                            float *gw) {
    const int r0 = 8 * g, rows = min(8, m - r0);
    keel_cuda_route *it = items + (size_t)g * cap;
    float *wt = weights + (size_t)g * cap * 8;
    for (int i = lane; i < rows * K; i += 32) { /* the group's selections and weights, read once */
        gsel[i] = sel[r0 * K + i];
        gw[i] = w[((size_t)r0 * K + i) * 8];
    }
    kp_syncwarp();
    int count = 0;
    for (int base = 0; base < E; base += 32) {
        const int ex = PLANTED(KEEL_ECU_PLANT_ORDER) ? E - 1 - (base + lane) : base + lane;
        uint32_t mask = 0;
        float wr[8];
#pragma unroll
        for (int r = 0; r < 8; r++) wr[r] = 0.0f;
        if (base + lane < E)
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < K; j++)
                    if (gsel[r * K + j] == ex) mask |= 1u << r, wr[r] = gw[r * K + j];
        const uint32_t live = kp_ballot(mask != 0u); /* the live lanes below this one come first */
        const int idx = count + __popc(live & ((1u << lane) - 1u)), n_live = __popc(live);
        if (mask && idx < cap) {
            it[idx].expert = ex;
            it[idx].mask = mask;
#pragma unroll
            for (int r = 0; r < 8; r++) wt[(size_t)idx * 8 + r] = wr[r];
        }
        count += n_live;
    }
    for (int i = count + lane; i < cap; i += 32) {
        it[i].expert = 0;
        it[i].mask = 0u;
#pragma unroll
        for (int r = 0; r < 8; r++) wt[(size_t)i * 8 + r] = 0.0f;
    }
    kp_syncwarp();
}

__global__ void union_kernel(const int *sel, const float *w, int m, int K, int E, int cap, keel_cuda_route *items,
                             float *weights) {
    __shared__ int gsel[kMaxUnionSel];
    __shared__ float gw[kMaxUnionSel];
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    union_group(sel, w, m, K, E, cap, items, weights, blockIdx.x, threadIdx.x, gsel, gw);
}

/* The MoE router in one launch: the fp32 router matvec (warp per logit, as matvec_kernel), then the last block to
 * finish (a ticket counter; the logits made visible by a fence) routes every row (one warp a row, as route_kernel),
 * builds the 8-row groups' unions (as union_kernel) and resets the ticket for the next launch. The same device
 * functions as the three kernels it replaces, so the same bits. One launch at a time: the ticket is global. */
constexpr int kRouterThreads = 256;
__device__ unsigned g_router_ticket;

/* Per-warp scratch of the routing phase: s, b (E floats), chosen (64 ints), gs (64 floats), keep (64), used (E);
 * the union phase reuses it for a group's selections and weights (8 K ints and floats). */
__host__ __device__ inline size_t router_scratch(int E, int K) {
    const size_t route = (size_t)E * 9 + 576, uni = (size_t)64 * K;
    return ((route > uni ? route : uni) + 15) & ~(size_t)15;
}

__global__ void router_kernel(QW W, const float *x, int m, float *logits, DVec corr, int K, int n_group,
                              int topk_group, int norm_topk, float scaling, keel_cuda_route *items1, float *w1,
                              int *sel, int cap, keel_cuda_route *items, float *weights, int warps) {
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    const int E = W.n, lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const Route R = {nullptr, 1, 0, 0, 0};
    matvec_warp<8>(W, R, x, 0, m, logits, 0, KEEL_EPI_NONE, (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5),
                      lane);
    __shared__ unsigned last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&g_router_ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    extern __shared__ unsigned char rsm[];
    unsigned char *mine = rsm + (size_t)wid * router_scratch(E, K);
    float *s = (float *)mine, *b = s + E;
    int *chosen = (int *)(b + E);
    float *gs = (float *)(chosen + 64);
    unsigned char *keep = (unsigned char *)(gs + 64), *used = keep + 64;
    for (int r = wid; wid < warps && r < m; r += warps) /* the warps whose scratch fits in shared memory */
        route_row(logits, corr, E, K, n_group, topk_group, norm_topk, scaling, items1, w1, sel, r, lane, s, b, used,
                  chosen, gs, keep);
    __threadfence_block();
    __syncthreads();
    for (int g = wid; wid < warps && g < (m + 7) / 8; g += warps)
        union_group(sel, w1, m, K, E, cap, items, weights, g, lane, (int *)mine, (float *)mine + 8 * K);
    if (threadIdx.x == 0) g_router_ticket = 0u;
}

/* route_kernel and union_kernel in one launch: block g routes rows 8g..8g+7 (a warp a row; warps loop when the
 * block has fewer), then its first warp builds the group's union from the selections and weights the block just
 * wrote (visible after the barrier). The same device functions in the same order: the two launches' bits. */
__global__ void route_window_kernel(const float *logits, DVec corr, int m, int E, int K, int n_group, int topk_group,
                                    int norm_topk, float scaling, keel_cuda_route *items1, float *w1, int *sel, int cap,
                                    keel_cuda_route *items, float *weights) {
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    extern __shared__ unsigned char wsm[];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, warps = (int)(blockDim.x >> 5), g = (int)blockIdx.x;
    unsigned char *mine = wsm + (size_t)wid * router_scratch(E, K);
    float *s = (float *)mine, *b = s + E;
    int *chosen = (int *)(b + E);
    float *gs = (float *)(chosen + 64);
    unsigned char *keep = (unsigned char *)(gs + 64), *used = keep + 64;
    for (int r = 8 * g + wid; r < min(m, 8 * g + 8); r += warps)
        route_row(logits, corr, E, K, n_group, topk_group, norm_topk, scaling, items1, w1, sel, r, lane, s, b, used,
                  chosen, gs, keep);
    __syncthreads(); /* the group's selections and weights are written and visible to the block */
    if (wid == 0) union_group(sel, w1, m, K, E, cap, items, weights, g, lane, (int *)wsm, (float *)wsm + 8 * K);
}

constexpr int kArgThreads = 1024;

__global__ void argmax_kernel(const float *__restrict__ v, int n, int *out) {
    constexpr int kBatch = 16; /* loads in flight a thread; each thread still walks its indices in ascending order */
    __shared__ float bv[kArgThreads];
    __shared__ int bi[kArgThreads];
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    float best = 0.0f;
    int id = -1;
    for (int base = threadIdx.x; base < n; base += blockDim.x * kBatch) {
        float xv[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; j++) {
            const int i = base + j * (int)blockDim.x;
            xv[j] = i < n ? v[i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kBatch; j++) {
            const int i = base + j * (int)blockDim.x;
            const float x = xv[j];
            if (i >= n || x != x) continue; /* NaN never wins */
            if (id < 0 || x > best || (PLANTED(KEEL_ECU_PLANT_TIES) && x == best)) { best = x; id = i; }
        }
    }
    bv[threadIdx.x] = best;
    bi[threadIdx.x] = id;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) {
            int oi = bi[threadIdx.x + s];
            float ov = bv[threadIdx.x + s];
            int mi = bi[threadIdx.x];
            const bool tie_wins = PLANTED(KEEL_ECU_PLANT_TIES) ? oi > mi : oi < mi;
            if (oi >= 0 && (mi < 0 || ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && tie_wins))) {
                bv[threadIdx.x] = ov;
                bi[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = bi[0] < 0 ? 0 : bi[0];
}

unsigned blocks_for(long long n, int threads) { return (unsigned)((n + threads - 1) / threads); }

} // namespace

extern "C" void KEEL_ECU_FN(embed)(const keel_cuda_qw *t, const int *tok, int m, float *x, void *st) {
    long long total = (long long)m * t->k;
    KP_LAUNCH(keel_ecu_pdl_on(), embed_kernel, dim3(blocks_for(total, 256)), dim3(256), 0, st, qw(t), tok, m, x);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(rmsnorm)(const float *x, int ldx, const keel_ecu_vec *w, int m, int n, float eps, float *yf,
                                 uint16_t *yb, int ldy, void *st) {
    KP_LAUNCH(keel_ecu_pdl_on(), rmsnorm_kernel, dim3((unsigned)m), dim3(kNormThreads), 0, st, x, ldx, dv(w), n, eps,
              yf, yb, ldy);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(add_rmsnorm)(float *xo, const float *x, const float *a, const float *b,
                                     const keel_ecu_vec *bias, const keel_ecu_vec *w, int m, int n, float eps,
                                     float *yf, uint16_t *yb, void *st) {
    /* a programmatic dependent: the norm's weights load while the previous kernel finishes */
    KP_LAUNCH(keel_ecu_pdl_on(), add_rmsnorm_kernel, dim3((unsigned)m), dim3(kNormThreads), 0, st, xo, x, a, b,
              dv(bias), dv(w), n, eps, yf, yb);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(matvec_norm)(const keel_cuda_qw *W, float *xo, const float *x, const float *a,
                                     const float *b, const keel_ecu_vec *bias, const keel_ecu_vec *w, int m,
                                     float eps, float *yf, uint16_t *yb, float *y, void *st) {
    KEEL_ASSERT(W && xo && x && a && w && w->n && yf && xo != x);
    const size_t smem = (size_t)m * (size_t)W->k * sizeof(float);
    if (W->k > kNormRegs * kNormThreads || smem > KEEL_ECU_MATVEC_NORM_SMEM) { /* the two launches it stands for */
        KEEL_ECU_FN(add_rmsnorm)(xo, x, a, b, bias, w, m, W->k, eps, yf, yb, st);
        KEEL_ECU_FN(matvec)(W, yf, KEEL_DT_F32, m, y, KEEL_DT_F32, KEEL_EPI_NONE, st);
        return;
    }
    const long long threads = (long long)m * W->n * 32;
    KP_LAUNCH(keel_ecu_pdl_on(), matvec_norm_kernel, dim3(blocks_for(threads, kNormThreads)), dim3(kNormThreads), smem,
              st, qw(W), xo, x, a, b, dv(bias), dv(w), eps, yf, yb, m, y);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(add_bias)(float *y, int m, int n, int ld, const keel_ecu_vec *b, void *st) {
    if (!b || !b->n) return;
    KP_LAUNCH(keel_ecu_pdl_on(), add_bias_kernel, dim3(blocks_for((long long)m * n, 256)), dim3(256), 0, st, y, m, n,
              ld, dv(b));
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(matvec)(const keel_cuda_qw *W, const void *x, keel_dtype xdt, int m, void *y, keel_dtype ydt,
                                keel_epilogue epi, void *st) {
    KEEL_ASSERT(xdt == KEEL_DT_F32 || xdt == KEEL_DT_BF16);
    KEEL_ASSERT(ydt == KEEL_DT_F32 || ydt == KEEL_DT_BF16);
    long long threads = (long long)m * W->n * 32;
    Route R = {nullptr, 1, 0, 0, 0};
    KP_LAUNCH(keel_ecu_pdl_on(), matvec_kernel, dim3(blocks_for(threads, 256)), dim3(256), 0, st, qw(W), R, x,
              xdt == KEEL_DT_BF16, m, y, ydt == KEEL_DT_BF16, (int)epi);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(matvec_routed)(const keel_cuda_qw *W, const float *x, bool x_per_item, int m,
                                           const int *sel, int K, float *y, keel_epilogue epi, void *st) {
    const long long ew = W->expert_words, es = W->expert_groups ? W->expert_groups : (long long)W->n * W->k;
    Route R = {sel, K, x_per_item ? 1 : 0, ew, W->bits ? es : (long long)W->n * W->k};
    long long threads = (long long)m * K * W->n * 32;
    matvec_kernel<<<blocks_for(threads, 256), 256, 0, (cudaStream_t)st>>>(qw(W), R, x, 0, m, y, 0, (int)epi);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(combine)(const float *y, const float *w, int m, int K, int n, float *out, void *st) {
    KP_LAUNCH(keel_ecu_pdl_on(), combine_kernel, dim3(blocks_for((long long)m * n, 256)), dim3(256), 0, st, y, w, m, K,
              n, out);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(conv)(const float *proj, int ld, int off, float *win, const keel_ecu_vec *cw,
                              const keel_ecu_vec *cb, int K, int C, int m, float *out, void *st) {
    KEEL_ASSERTF(K >= 1 && K <= kMaxConvK, "conv kernel %d (1..%d)", K, kMaxConvK);
    KP_LAUNCH(keel_ecu_pdl_on(), conv_kernel, dim3(blocks_for(C, 128)), dim3(128), 0, st, proj, ld, off, win, dv(cw),
              dv(cb), K, C, m, out);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(ssm)(const float *xbc, int CD, const float *proj, int ld, int dt_off, float *state,
                             const keel_ecu_vec *dt_bias, const keel_ecu_vec *A_log, const keel_ecu_vec *D, int NH,
                             int P, int N, int G, int m, float *y, void *st) {
    KEEL_ASSERTF(N >= 1 && N <= 32 * kMaxStatePerLane, "ssm state %d (1..%d)", N, 32 * kMaxStatePerLane);
    KP_LAUNCH(keel_ecu_pdl_on(), ssm_kernel, dim3(blocks_for((long long)NH * P * 32, 128)), dim3(128), 0, st, xbc, CD,
              proj, ld, dt_off, state, dv(dt_bias), dv(A_log), dv(D), NH, P, N, G, m, y);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(gate_norm)(const float *y, const float *proj, int ld, const keel_ecu_vec *w, int G, int DI,
                                   float eps, int m, uint16_t *out, float *outf, void *st) {
    KP_LAUNCH(keel_ecu_pdl_on(), gate_norm_kernel, dim3((unsigned)(m * G)), dim3(kNormThreads), 0, st, y, proj, ld,
              dv(w), G, DI, eps, out, outf);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(mamba_step)(const float *proj, int ld, float *win, const keel_ecu_vec *cw,
                                        const keel_ecu_vec *cb, int K, float *state, const keel_ecu_vec *dt_bias,
                                        const keel_ecu_vec *A_log, const keel_ecu_vec *D, int NH, int P, int N, int G,
                                        int m, const keel_ecu_vec *norm, float eps, float *xbc, float *y,
                                        unsigned *cnt, uint16_t *out, float *outf, void *st) {
    KEEL_ASSERTF(m >= 1 && m <= 8 && K >= 1 && K <= kMaxConvK && N >= 1 && N <= 32 * kMaxStatePerLane && P >= 1 &&
                 G >= 1 && NH % G == 0, "mamba step m %d K %d N %d P %d heads %d groups %d", m, K, N, P, NH, G);
    const size_t smem = ((size_t)m * (size_t)(kMambaSlice + 2 * N) + (size_t)2 * N * (size_t)(K - 1)) * sizeof(float);
    KEEL_ASSERTF(smem <= 48 * 1024, "mamba step: %zu bytes of shared memory", smem);
    const long long blocks = (long long)NH * ((P + kMambaSlice - 1) / kMambaSlice);
    KP_LAUNCH(keel_ecu_pdl_on(), mamba_step_kernel, dim3((unsigned)blocks), dim3(kNormThreads), smem, st, proj, ld, win,
              dv(cw), dv(cb), K, state, dv(dt_bias), dv(A_log), dv(D), NH, P, N, G, m, dv(norm), eps, xbc, y, cnt, out,
              outf);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(route)(const float *logits, const keel_ecu_vec *corr, int E, int K, int n_group,
                               int topk_group, bool norm_topk, float scaling, int m, keel_cuda_route *items,
                               float *weights, int *sel, void *st) {
    KEEL_ASSERTF(E >= 1 && E <= kMaxExperts && K >= 1 && K <= 64 && K <= E && n_group <= 64, "router E %d K %d", E, K);
    KP_LAUNCH(keel_ecu_pdl_on(), route_kernel, dim3((unsigned)m), dim3(32), 0, st, logits, dv(corr), E, K, n_group,
              topk_group, norm_topk ? 1 : 0, scaling, items, weights, sel);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(route_union)(const int *sel, const float *w, int m, int K, int E, int cap,
                                         keel_cuda_route *items, float *weights, void *st) {
    KEEL_ASSERTF(m >= 1 && K >= 1 && K <= 64 && E >= K && cap >= 1, "route union m %d K %d E %d cap %d", m, K, E, cap);
    KP_LAUNCH(keel_ecu_pdl_on(), union_kernel, dim3((unsigned)((m + 7) / 8)), dim3(32), 0, st, sel, w, m, K, E, cap,
              items, weights);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(route_window)(const float *logits, const keel_ecu_vec *corr, int E, int K, int n_group,
                                          int topk_group, bool norm_topk, float scaling, int m,
                                          keel_cuda_route *items1, float *w1, int *sel, int cap,
                                          keel_cuda_route *items, float *weights, void *st) {
    KEEL_ASSERTF(E >= 1 && E <= kMaxExperts && K >= 1 && K <= 64 && K <= E && n_group <= 64 && m >= 1 && cap >= 1,
                 "route window E %d K %d m %d cap %d", E, K, m, cap);
    const size_t per = router_scratch(E, K);
    const int warps = (int)KEEL_MIN(KEEL_MIN((size_t)8, (size_t)m), (size_t)(40 * 1024) / per);
    KEEL_ASSERTF(warps >= 1, "route window scratch %zu bytes a warp", per);
    KP_LAUNCH(keel_ecu_pdl_on(), route_window_kernel, dim3((unsigned)((m + 7) / 8)), dim3((unsigned)(32 * warps)),
              per * (size_t)warps, st, logits, dv(corr), m, E, K, n_group, topk_group, norm_topk ? 1 : 0, scaling,
              items1, w1, sel, cap, items, weights);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(router)(const keel_cuda_qw *W, const float *x, int m, float *logits,
                                    const keel_ecu_vec *corr, int K, int n_group, int topk_group, bool norm_topk,
                                    float scaling, keel_cuda_route *items1, float *w1, int *sel, int cap,
                                    keel_cuda_route *items, float *weights, void *st) {
    const int E = W->n;
    KEEL_ASSERTF(W->bits == 0 && E >= 1 && E <= kMaxExperts && K >= 1 && K <= 64 && K <= E && n_group <= 64 &&
                 m >= 1 && cap >= 1, "router E %d K %d m %d bits %d", E, K, m, W->bits);
    const size_t per = router_scratch(E, K);
    const int warps = (int)KEEL_MIN((size_t)(kRouterThreads / 32), (size_t)(40 * 1024) / per);
    KEEL_ASSERTF(warps >= 1, "router scratch %zu bytes a warp", per);
    const long long threads = (long long)m * E * 32;
    KP_LAUNCH(keel_ecu_pdl_on(), router_kernel, dim3(blocks_for(threads, kRouterThreads)), dim3(kRouterThreads),
              per * (size_t)warps, st, qw(W), x, m, logits, dv(corr), K, n_group, topk_group, norm_topk ? 1 : 0,
              scaling, items1, w1, sel, cap, items, weights, warps);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ECU_FN(argmax)(const float *v, int n, int *out, void *st) {
    KP_LAUNCH(keel_ecu_pdl_on(), argmax_kernel, dim3(1), dim3(kArgThreads), 0, st, v, n, out);
    KEEL_CUDA_CHECK_LAUNCH();
}

#if KEEL_ECU_TWIN
extern "C" void keel_contract_twin_ecu_arm(int fault) { KEEL_CUDA_CHECK(cudaMemcpyToSymbol(g_plant, &fault, sizeof fault)); }
#else
/* The engine's kernels of this file by audit symbol (contract/records). */
static const struct {
    const char *name;
    const void *fn;
} g_ecu_kernels[] = {
    {"embed_kernel", (const void *)embed_kernel},         {"rmsnorm_kernel", (const void *)rmsnorm_kernel},
    {"add_rmsnorm_kernel", (const void *)add_rmsnorm_kernel}, {"add_bias_kernel", (const void *)add_bias_kernel},
    {"matvec_kernel", (const void *)matvec_kernel},       {"combine_kernel", (const void *)combine_kernel},
    {"matvec_norm_kernel", (const void *)matvec_norm_kernel},
    {"conv_kernel", (const void *)conv_kernel},           {"ssm_kernel", (const void *)ssm_kernel},
    {"gate_norm_kernel", (const void *)gate_norm_kernel},
    {"route_kernel", (const void *)route_kernel},         {"argmax_kernel", (const void *)argmax_kernel},
    {"union_kernel", (const void *)union_kernel},         {"router_kernel", (const void *)router_kernel},
    {"mamba_step_kernel", (const void *)mamba_step_kernel}, {"route_window_kernel", (const void *)route_window_kernel},
};

/* The host function pointer of a kernel by its audit symbol, for the gate-5 live check. */
extern "C" const void *keel_ecu_kernel_fn(const char *symbol) {
    if (!symbol) return NULL;
    for (size_t i = 0; i < sizeof g_ecu_kernels / sizeof g_ecu_kernels[0]; i++)
        if (!strcmp(g_ecu_kernels[i].name, symbol)) return g_ecu_kernels[i].fn;
    return NULL;
}

extern "C" const void *keel_ecu_kernel_at(int i) {
    return i >= 0 && (size_t)i < sizeof g_ecu_kernels / sizeof g_ecu_kernels[0] ? g_ecu_kernels[i].fn : NULL;
}

#endif
