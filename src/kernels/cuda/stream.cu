/* Stream tiles: quantized matrix times up to 8 activation rows on tensor cores, read straight from MLX codes.
 *
 * Shape of the work (docs/stream-tiles.md has the why):
 * - A block is 4 warps; a warp owns 16 rows of W (the m16 side of mma m16n8k16); the 8 activation rows are n8.
 * - k is walked in x-chunks of 1024 codes: the block stages x into shared memory in mma fragment order (plus the
 *   per-group sums of x for the bias term), then each warp streams its 16 rows of that chunk.
 * - A warp streams W in sub-chunks (16 rows x NBC blocks of 32 codes) with 16-byte coalesced loads into
 *   registers, one sub-chunk ahead, parks them in a warp-private shared buffer and reads back, per thread and per
 *   32-code block, the 8 consecutive codes of its two rows (bits bytes, byte-aligned for every width).
 * - Codes become exact bf16/f16 integers by or-ing them under a magic exponent and subtracting it (pairs at
 *   a time); one mma per 16 codes per row; at each group end acc += scale*S + bias*sum(x).
 * - Optional k-split over x-chunks (chosen from n, k and the SM count only) writes fp32 partials that a second
 *   kernel adds in slice order, so every output element has one fixed order of operations whatever m is.
 */
#include <stdio.h>

#include "cuda.h"
#include "port.h"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMinBlocks = 4; /* blocks per SM the register budget must allow (5-bit: two fewer, no spills) */
/* Chips with 100 KB of shared memory per SM (sm_86, sm_87, sm_89, sm_120) hold three of these blocks, not four. */
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
#define KEEL_STREAM_MIN_BLOCKS 3
#else
#define KEEL_STREAM_MIN_BLOCKS kMinBlocks
#endif
constexpr int kRowsPerWarp = 16;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
constexpr int kXK = 1024;              /* codes per x-chunk */
constexpr int kXBlocks = kXK / 32;     /* 32-code blocks per x-chunk */
constexpr int kMaxRows = KEEL_CUDA_STREAM_MAX_ROWS;

enum { SDT_BF16 = 0, SDT_F16 = 1, SDT_F32 = 2 };
enum { MODE_STORE = 0, MODE_REDUCE = 1 };

/* Per-width layout constants, all compile-time. */
template <int B> struct Geo {
    static constexpr int NBC = B == 2 ? 16 : B >= 6 ? 4 : 8;            /* 32-code blocks per sub-chunk */
    static constexpr int WPR = NBC * B;                      /* words per row per sub-chunk */
    static constexpr int VPR = WPR / 4;                      /* 16-byte vectors per row per sub-chunk */
    static constexpr int VPL = kRowsPerWarp * VPR / 32;      /* vectors per lane per sub-chunk */
    static constexpr int TGT = B == 8 ? 8 : 4;               /* row stride mod 32 banks */
    static constexpr int RS = WPR + ((TGT - WPR % 32) + 32) % 32; /* shared row stride in words */
    static constexpr int BUF = kRowsPerWarp * RS + 4;        /* words per warp buffer (+ read slack) */
    static constexpr int SBUF = 32 * NBC;                    /* fp32 scale/bias slots per warp */
};

struct Params {
    const uint32_t *w;
    const void *sc;
    const void *bi;
    long long ew, es;       /* expert strides: words, scale elements */
    int n, k, group, sdt;
    const uint16_t *x;
    long long x_item;       /* elements between items' activations (0: shared x) */
    int m;
    const keel_cuda_route *items; /* NULL: one item {0, mask0} */
    int n_items;
    uint32_t mask0;
    const float *rw;        /* routing weights [item][8] (MODE_REDUCE) */
    void *y;
    long long y_item;       /* elements between items' outputs (MODE_STORE) */
    int ydt_bf16, epi, mode, vec16, splits;
    float *part;            /* splits > 1: [split][item][8][n] fp32 partials */
};

__device__ __forceinline__ float relu2(float v) { return v > 0.f ? __fmul_rn(v, v) : 0.f; }

__device__ __forceinline__ float load_scale(const void *p, long long i, int sdt) {
    if (sdt == SDT_BF16) return kp_bf16_to_f32(((const uint16_t *)p)[i]);
    if (sdt == SDT_F16) return kp_f16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

__device__ __forceinline__ void store_out(void *y, long long i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)y)[i] = kp_f32_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* The 8 codes c0..c7 of one thread (bits B each, LSB first in v) as four operand words, word i holding
 * (c_i, c_{i+4}) as exact bf16 or f16 integers. */
template <int B, bool XF16> __device__ __forceinline__ void codes_to_pairs(unsigned long long v, uint32_t p[4]) {
    if constexpr (B == 8) {
        uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if constexpr (XF16) {
                uint32_t two = __byte_perm(lo, hi, 0x0040u | (uint32_t)i | ((uint32_t)(i + 4) << 8));
                p[i] = kp_sub_f16x2((two & 0x00ff00ffu) | 0x64006400u, 0x64006400u);
            } else {
                float a = __uint_as_float(__byte_perm(lo, 0x4b000000u, 0x7540u | (uint32_t)i)) - 8388608.f;
                float b = __uint_as_float(__byte_perm(hi, 0x4b000000u, 0x7540u | (uint32_t)i)) - 8388608.f;
                p[i] = kp_pack_bf16x2(a, b);
            }
        }
    } else {
        constexpr uint32_t m2 = (1u << (2 * B)) - 1u, mm = ((1u << B) - 1u) * 0x00010001u;
        constexpr uint32_t magic = XF16 ? 0x64006400u : 0x43004300u;
        uint32_t w1 = ((uint32_t)v & m2) | (((uint32_t)(v >> (4 * B)) & m2) << 16);
        uint32_t w2 = ((uint32_t)(v >> (2 * B)) & m2) | (((uint32_t)(v >> (6 * B)) & m2) << 16);
        uint32_t q[4] = {(w1 & mm) | magic, ((w1 >> B) & mm) | magic, (w2 & mm) | magic, ((w2 >> B) & mm) | magic};
#pragma unroll
        for (int i = 0; i < 4; i++) p[i] = XF16 ? kp_sub_f16x2(q[i], magic) : kp_sub_bf16x2(q[i], magic);
    }
}

/* Loads one sub-chunk (16 rows x WPR words from word w0 of each row) into registers; zeros past the end. */
template <int B>
__device__ __forceinline__ void load_sub(uint4 (&r)[Geo<B>::VPL], const uint32_t *W, int row0, int n,
                                         long long row_words, long long w0, int lane, int vec16) {
    using G = Geo<B>;
#pragma unroll
    for (int i = 0; i < G::VPL; i++) {
        int v = i * 32 + lane, rr = v / G::VPR, u = v % G::VPR;
        int row = row0 + rr;
        long long wi = w0 + 4 * u;
        uint4 z = make_uint4(0u, 0u, 0u, 0u);
        if (row < n) {
            const uint32_t *p = W + (long long)row * row_words + wi;
            if (vec16 && wi + 4 <= row_words) {
                z = kp_ld_stream16((const uint4 *)p);
            } else {
                if (wi + 0 < row_words) z.x = kp_ld_stream4(p + 0);
                if (wi + 1 < row_words) z.y = kp_ld_stream4(p + 1);
                if (wi + 2 < row_words) z.z = kp_ld_stream4(p + 2);
                if (wi + 3 < row_words) z.w = kp_ld_stream4(p + 3);
            }
        }
        r[i] = z;
    }
}

template <int B>
__device__ __forceinline__ void park_sub(const uint4 (&r)[Geo<B>::VPL], uint32_t *buf, int lane) {
    using G = Geo<B>;
#pragma unroll
    for (int i = 0; i < G::VPL; i++) {
        int v = i * 32 + lane, rr = v / G::VPR, u = v % G::VPR;
        *(uint4 *)(buf + rr * G::RS + 4 * u) = r[i];
    }
}

/* Stages x-chunk [k0, k0+len) of item activations into mma fragment order, loads issued in batches. */
__device__ __forceinline__ void stage_x(int m, int k, const uint16_t *__restrict__ x, uint32_t mask, int k0, int len,
                                        uint2 *xf) {
    const int nb = len / 32;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, s = (threadIdx.x >> 5) & 1;
    const bool live = g < m && ((mask >> g) & 1u);
    const uint32_t *row = (const uint32_t *)(x + (long long)g * k + k0 + 8 * t + 2 * s);
    constexpr int kBatch = 8;
    for (int jb0 = threadIdx.x >> 6; jb0 < nb; jb0 += 2 * kBatch) {
        uint32_t w0[kBatch], w1[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; i++) {
            const int jb = jb0 + 2 * i;
            w0[i] = w1[i] = 0u;
            if (live && jb < nb) {
                w0[i] = __ldg(row + jb * 16);     /* x[2s], x[2s+1] */
                w1[i] = __ldg(row + jb * 16 + 2); /* x[2s+4], x[2s+5] */
            }
        }
#pragma unroll
        for (int i = 0; i < kBatch; i++) {
            const int jb = jb0 + 2 * i;
            if (jb < nb) xf[(jb * 2 + s) * 32 + lane] = make_uint2(__byte_perm(w0[i], w1[i], 0x5410), __byte_perm(w0[i], w1[i], 0x7632));
        }
    }
}

/* Per-group sums of x (bias term) from the staged fragments, in one fixed order: blocks, then t, s, elements. */
template <bool XF16> __device__ __forceinline__ void stage_xsum(int len, int group, const uint2 *xf, float *xs) {
    const int ng = len / group, bpg = group / 32;
    for (int e = threadIdx.x; e < ng * kMaxRows; e += kThreads) {
        const int r = e % kMaxRows, gi = e / kMaxRows;
        float acc = 0.f;
        for (int b = 0; b < bpg; b++) {
            const uint2 *p = xf + (gi * bpg + b) * 64 + 4 * r;
            uint2 v[8];
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = p[(i >> 1) + (i & 1) * 32]; /* t = i/2, s = i%2 */
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const uint32_t q[2] = {v[i].x, v[i].y};
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const float lo = XF16 ? kp_f16_to_f32((uint16_t)q[j]) : kp_bf16_to_f32((uint16_t)q[j]);
                    const float hi = XF16 ? kp_f16_to_f32((uint16_t)(q[j] >> 16)) : kp_bf16_to_f32((uint16_t)(q[j] >> 16));
                    acc = __fadd_rn(__fadd_rn(acc, lo), hi);
                }
            }
        }
        xs[e] = acc;
    }
}

/* Loads the scales and biases of the sub-chunk's groups for the warp's 16 rows (as fp32), one per lane-slot. */
template <int B>
__device__ __forceinline__ void load_sb(float (&r)[Geo<B>::NBC], const void *sc, const void *bi, int sdt, long long sbase,
                                        int row0, int n, int groups, int g0, int ngs, int lane) {
#pragma unroll
    for (int i = 0; i < Geo<B>::NBC; i++) {
        r[i] = 0.f;
        if (i < ngs) {
            const int v = i * 32 + lane, rr = v / (2 * ngs), rest = v % (2 * ngs), which = rest / ngs, gl = rest % ngs;
            const int row = min(row0 + rr, n - 1);
            if (g0 + gl < groups) r[i] = load_scale(which ? bi : sc, sbase + (long long)row * groups + g0 + gl, sdt);
        }
    }
}

template <int B, bool XF16> __global__ void __launch_bounds__(kThreads, B == 5 ? kMinBlocks - 2 : KEEL_STREAM_MIN_BLOCKS) stream_tile(Params P) {
    using G = Geo<B>;
    extern __shared__ uint4 smem_raw[];
    uint2 *xf = (uint2 *)smem_raw;                                 /* kXBlocks * 64 */
    float *xs = (float *)(xf + kXBlocks * 64);                     /* kXBlocks * 8 */
    uint32_t *wbuf = (uint32_t *)(xs + kXBlocks * kMaxRows) + (threadIdx.x >> 5) * G::BUF;
    float *sbuf = (float *)((uint32_t *)(xs + kXBlocks * kMaxRows) + kWarps * G::BUF) + (threadIdx.x >> 5) * G::SBUF;

    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
    const int row0 = blockIdx.x * kRowsPerBlock + warp * kRowsPerWarp;
    const long long row_words = (long long)P.k * B / 32;
    const int groups = P.k / P.group, lbpg = P.group == 32 ? 0 : P.group == 64 ? 1 : 2;
    const int nchunks = (P.k + kXK - 1) / kXK;
    const int split = blockIdx.z;
    const int c_begin = (int)((long long)nchunks * split / P.splits);
    const int c_end = (int)((long long)nchunks * (split + 1) / P.splits);

    int it_begin = 0, it_end = 1;
    if (P.mode == MODE_STORE) {
        it_begin = blockIdx.y;
        it_end = blockIdx.y + 1;
    } else {
        it_end = P.n_items;
    }

    float tot[4] = {0.f, 0.f, 0.f, 0.f}; /* MODE_REDUCE: weighted sum over items */
    for (int it = it_begin; it < it_end; it++) {
        keel_cuda_route item = P.items ? P.items[it] : keel_cuda_route{0, P.mask0};
        const uint32_t *W = P.w + (long long)item.expert * P.ew;
        const long long sbase = (long long)item.expert * P.es;
        const uint16_t *x = P.x + (long long)it * P.x_item;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};

        uint4 regs[G::VPL];
        float sregs[G::NBC];
        const int ngs = G::NBC * 32 / P.group; /* groups per sub-chunk (sub-chunks hold whole groups) */
        int c = c_begin, sc = 0;
        if (c < c_end) {
            load_sub<B>(regs, W, row0, P.n, row_words, (long long)c * kXK / 32 * B, lane, P.vec16);
            load_sb<B>(sregs, P.sc, P.bi, P.sdt, sbase, row0, P.n, groups, c * kXK / P.group, ngs, lane);
        }
        for (; c < c_end; c++) {
            const int k0 = c * kXK, len = min(kXK, P.k - k0), nb = len / 32;
            const int nsub = (nb + G::NBC - 1) / G::NBC;
            __syncthreads();
            stage_x(P.m, P.k, x, item.mask, k0, len, xf);
            __syncthreads();
            stage_xsum<XF16>(len, P.group, xf, xs);
            __syncthreads();
            for (sc = 0; sc < nsub; sc++) {
                kp_syncwarp();
                park_sub<B>(regs, wbuf, lane);
#pragma unroll
                for (int i = 0; i < G::NBC; i++)
                    if (i < ngs) sbuf[i * 32 + lane] = sregs[i];
                kp_syncwarp();
                /* next sub-chunk of this slice, possibly in the next x-chunk */
                long long nw = -1;
                if (sc + 1 < nsub)
                    nw = (long long)(k0 / 32 + (sc + 1) * G::NBC) * B;
                else if (c + 1 < c_end)
                    nw = (long long)(c + 1) * kXK / 32 * B;
                if (nw >= 0) {
                    load_sub<B>(regs, W, row0, P.n, row_words, nw, lane, P.vec16);
                    load_sb<B>(sregs, P.sc, P.bi, P.sdt, sbase, row0, P.n, groups, (int)(nw / B * 32 / P.group), ngs, lane);
                }

                const int jb_end = min(G::NBC, nb - sc * G::NBC);
                float S0[4] = {0.f, 0.f, 0.f, 0.f}, S1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
                for (int jb = 0; jb < jb_end; jb++) {
                    uint32_t pa[4], pb[4];
                    {
                        const int byte = jb * 4 * B + t * B, wi = byte >> 2, sh = (byte & 3) * 8;
                        const uint32_t *ra = wbuf + g * G::RS + wi, *rb = ra + 8 * G::RS;
                        unsigned long long va = ((unsigned long long)ra[1] << 32 | ra[0]) >> sh;
                        unsigned long long vb = ((unsigned long long)rb[1] << 32 | rb[0]) >> sh;
                        codes_to_pairs<B, XF16>(va, pa);
                        codes_to_pairs<B, XF16>(vb, pb);
                    }
                    const int cb = sc * G::NBC + jb; /* block within x-chunk */
                    uint2 x0 = xf[(cb * 2 + 0) * 32 + lane], x1 = xf[(cb * 2 + 1) * 32 + lane];
                    uint32_t a0[4] = {pa[0], pb[0], pa[1], pb[1]}, b0[2] = {x0.x, x0.y};
                    uint32_t a1[4] = {pa[2], pb[2], pa[3], pb[3]}, b1[2] = {x1.x, x1.y};
                    kp_mma_16816<XF16>(S0, a0, b0);
                    kp_mma_16816<XF16>(S1, a1, b1);
                    const int gb = k0 / 32 + cb; /* block within the row */
                    if (((gb + 1) & ((1 << lbpg) - 1)) == 0) {
                        const int gl = cb >> lbpg, gs = jb >> lbpg; /* group in x-chunk, in sub-chunk */
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const int rr = g + 8 * h;
                            const float s = sbuf[rr * 2 * ngs + gs], bi = sbuf[rr * 2 * ngs + ngs + gs];
#pragma unroll
                            for (int j = 0; j < 2; j++) {
                                const int e = 2 * h + j;
                                const float S = __fadd_rn(S0[e], S1[e]);
                                const float v = __fmaf_rn(bi, xs[gl * kMaxRows + 2 * t + j], __fmul_rn(s, S));
                                acc[e] = __fadd_rn(acc[e], v);
                                S0[e] = 0.f;
                                S1[e] = 0.f;
                            }
                        }
                    }
                }
            }
        }

        if (P.mode == MODE_REDUCE) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = 2 * t + (e & 1);
                if (r < P.m && ((item.mask >> r) & 1u)) tot[e] = __fmaf_rn(P.rw[it * kMaxRows + r], acc[e], tot[e]);
            }
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = 2 * t + (e & 1), row = row0 + g + 8 * (e >> 1);
                if (r >= P.m || !((item.mask >> r) & 1u) || row >= P.n) continue;
                if (P.splits > 1) {
                    P.part[(((long long)split * gridDim.y + it) * kMaxRows + r) * P.n + row] = acc[e];
                } else {
                    const float v = P.epi == KEEL_EPI_RELU2 ? relu2(acc[e]) : acc[e];
                    store_out(P.y, (long long)it * P.y_item + (long long)r * P.n + row, v, P.ydt_bf16);
                }
            }
        }
    }
    if (P.mode == MODE_REDUCE) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = 2 * t + (e & 1), row = row0 + g + 8 * (e >> 1);
            if (r >= P.m || row >= P.n) continue;
            if (P.splits > 1) {
                P.part[((long long)split * kMaxRows + r) * P.n + row] = tot[e];
            } else {
                const float v = P.epi == KEEL_EPI_RELU2 ? relu2(tot[e]) : tot[e];
                store_out(P.y, (long long)r * P.n + row, v, P.ydt_bf16);
            }
        }
    }
}

/* Adds the k-split partials in slice order, applies the epilogue and stores. One thread per output element. */
__global__ void stream_finish(Params P, int items) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, per = (long long)kMaxRows * P.n;
    if (i >= per * items) return;
    int it = (int)(i / per), r = (int)(i % per / P.n), row = (int)(i % P.n);
    uint32_t mask = P.mode == MODE_REDUCE ? ((1u << P.m) - 1u) : (P.items ? P.items[it].mask : P.mask0);
    if (r >= P.m || !((mask >> r) & 1u)) return;
    float acc = 0.f;
    for (int s = 0; s < P.splits; s++) acc = __fadd_rn(acc, P.part[((long long)s * items + it) * per + (long long)r * P.n + row]);
    const float v = P.epi == KEEL_EPI_RELU2 ? relu2(acc) : acc;
    store_out(P.y, (long long)it * P.y_item + (long long)r * P.n + row, v, P.ydt_bf16);
}

__global__ void relu2_kernel(void *y, int bf16, size_t count) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        if (bf16) {
            uint16_t *p = (uint16_t *)y;
            p[i] = kp_f32_to_bf16(relu2(kp_bf16_to_f32(p[i])));
        } else {
            float *p = (float *)y;
            p[i] = relu2(p[i]);
        }
    }
}

template <int B> constexpr size_t smem_bytes() {
    return (size_t)kXBlocks * 64 * sizeof(uint2) + (size_t)kXBlocks * kMaxRows * sizeof(float) +
           (size_t)kWarps * Geo<B>::BUF * sizeof(uint32_t) + (size_t)kWarps * Geo<B>::SBUF * sizeof(float);
}

int g_sms = 0;
float *g_part = nullptr;
size_t g_part_cap = 0;

int sm_count(void) {
    if (g_sms == 0) {
        int dev = 0;
        KEEL_CUDA_CHECK(cudaGetDevice(&dev));
        KEEL_CUDA_CHECK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, dev));
    }
    return g_sms;
}

template <int B, bool XF16> void launch_t(const Params &P, dim3 grid, cudaStream_t st) {
    static bool attr = false;
    constexpr size_t sm = smem_bytes<B>();
    if (!attr) {
        KEEL_CUDA_CHECK(cudaFuncSetAttribute(stream_tile<B, XF16>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
        attr = true;
    }
    stream_tile<B, XF16><<<grid, kThreads, sm, st>>>(P);
    KEEL_CUDA_CHECK_LAUNCH();
}

template <bool XF16> void launch_bits(int bits, const Params &P, dim3 grid, cudaStream_t st) {
    switch (bits) {
    case 2: launch_t<2, XF16>(P, grid, st); break;
    case 3: launch_t<3, XF16>(P, grid, st); break;
    case 4: launch_t<4, XF16>(P, grid, st); break;
    case 5: launch_t<5, XF16>(P, grid, st); break;
    case 6: launch_t<6, XF16>(P, grid, st); break;
    case 8: launch_t<8, XF16>(P, grid, st); break;
    default: KEEL_ASSERTF(false, "stream tile: bits %d", bits);
    }
}

int sdt_code(keel_dtype d) {
    KEEL_ASSERTF(d == KEEL_DT_BF16 || d == KEEL_DT_F16 || d == KEEL_DT_F32, "stream tile: scale dtype %s",
                 keel_dtype_name(d));
    return d == KEEL_DT_BF16 ? SDT_BF16 : d == KEEL_DT_F16 ? SDT_F16 : SDT_F32;
}

void run(const keel_cuda_qw *W, Params P, keel_dtype xdt, keel_dtype ydt, int grid_items, void *stream) {
    KEEL_ASSERT(W && W->w && W->scales && W->biases && P.x && P.y);
    KEEL_ASSERTF(keel_quant_bits_ok(W->bits) && keel_quant_group_ok(W->group) && W->k > 0 && W->n > 0 &&
                     W->k % W->group == 0,
                 "stream tile: n %d k %d bits %d group %d", W->n, W->k, W->bits, W->group);
    KEEL_ASSERTF(P.m >= 1 && P.m <= kMaxRows, "stream tile: m %d (1..%d)", P.m, kMaxRows);
    KEEL_ASSERT(xdt == KEEL_DT_BF16 || xdt == KEEL_DT_F16);
    KEEL_ASSERTF(((uintptr_t)P.x & 3u) == 0, "stream tile: activations must be 4-byte aligned");
    KEEL_ASSERT(ydt == KEEL_DT_F32 || ydt == KEEL_DT_BF16);
    cudaStream_t st = (cudaStream_t)stream;
    P.w = W->w;
    P.sc = W->scales;
    P.bi = W->biases;
    P.ew = W->expert_words;
    P.es = W->expert_groups;
    P.n = W->n;
    P.k = W->k;
    P.group = W->group;
    P.sdt = sdt_code(W->sdt);
    P.ydt_bf16 = ydt == KEEL_DT_BF16;
    long long rw = (long long)W->k * W->bits / 32;
    P.vec16 = (rw % 4 == 0) && (((uintptr_t)W->w & 15u) == 0) && (W->expert_words % 4 == 0);
    P.splits = keel_cuda_stream_splits(W->n, W->k, P.mode == MODE_STORE ? grid_items : 1);
    int gy = P.mode == MODE_STORE ? grid_items : 1;
    if (P.splits > 1) {
        size_t need = (size_t)P.splits * gy * kMaxRows * W->n * sizeof(float);
        if (need > g_part_cap) {
            KEEL_CUDA_CHECK(cudaDeviceSynchronize());
            if (g_part) KEEL_CUDA_CHECK(cudaFree(g_part));
            KEEL_CUDA_CHECK(cudaMalloc((void **)&g_part, need));
            g_part_cap = need;
        }
        P.part = g_part;
    }
    dim3 grid((unsigned)((W->n + kRowsPerBlock - 1) / kRowsPerBlock), (unsigned)gy, (unsigned)P.splits);
    if (xdt == KEEL_DT_F16)
        launch_bits<true>(W->bits, P, grid, st);
    else
        launch_bits<false>(W->bits, P, grid, st);
    if (P.splits > 1) {
        long long total = (long long)kMaxRows * W->n * gy;
        stream_finish<<<(unsigned)((total + 255) / 256), 256, 0, st>>>(P, gy);
        KEEL_CUDA_CHECK_LAUNCH();
    }
}

} // namespace

extern "C" int keel_cuda_stream_splits(int n, int k, int n_items) {
    long long blocks = (long long)((n + kRowsPerBlock - 1) / kRowsPerBlock) * (n_items > 0 ? n_items : 1);
    int nchunks = (k + kXK - 1) / kXK;
    long long want = (4LL * sm_count() + blocks - 1) / blocks; /* about 4 blocks (16 warps) per SM */
    if (want < 1) want = 1;
    if (want > nchunks) want = nchunks;
    return (int)want;
}

extern "C" void keel_cuda_stream_matmul(const keel_cuda_qw *W, const void *x, keel_dtype xdt, int m, void *y,
                                        keel_dtype ydt, keel_epilogue epi, void *stream) {
    Params P = {};
    P.x = (const uint16_t *)x;
    P.m = m;
    P.mask0 = (1u << m) - 1u;
    P.y = y;
    P.epi = (int)epi;
    P.mode = MODE_STORE;
    run(W, P, xdt, ydt, 1, stream);
}

extern "C" void keel_cuda_stream_experts_up(const keel_cuda_qw *W1, const void *x, keel_dtype xdt, int m,
                                            const keel_cuda_route *items, int n_items, void *h, keel_dtype hdt,
                                            keel_epilogue epi, void *stream) {
    KEEL_ASSERT(items && n_items >= 1);
    Params P = {};
    P.x = (const uint16_t *)x;
    P.m = m;
    P.items = items;
    P.n_items = n_items;
    P.y = h;
    P.y_item = (long long)m * W1->n;
    P.epi = (int)epi;
    P.mode = MODE_STORE;
    run(W1, P, xdt, hdt, n_items, stream);
}

extern "C" void keel_cuda_stream_experts_down(const keel_cuda_qw *W2, const void *h, keel_dtype hdt, int m,
                                              const keel_cuda_route *items, const float *weights, int n_items,
                                              void *y, keel_dtype ydt, void *stream) {
    KEEL_ASSERT(items && weights && n_items >= 1);
    Params P = {};
    P.x = (const uint16_t *)h;
    P.x_item = (long long)m * W2->k;
    P.m = m;
    P.items = items;
    P.n_items = n_items;
    P.rw = weights;
    P.y = y;
    P.epi = KEEL_EPI_NONE;
    P.mode = MODE_REDUCE;
    run(W2, P, hdt, ydt, n_items, stream);
}

extern "C" void keel_cuda_relu2(void *y, keel_dtype ydt, size_t count, void *stream) {
    KEEL_ASSERT(ydt == KEEL_DT_F32 || ydt == KEEL_DT_BF16);
    if (count == 0) return;
    size_t blocks = (count + 255) / 256;
    if (blocks > 4096) blocks = 4096;
    relu2_kernel<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(y, ydt == KEEL_DT_BF16, count);
    KEEL_CUDA_CHECK_LAUNCH();
}
