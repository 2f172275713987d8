/* Stream tiles: quantized matrix times up to 8 activation rows on tensor cores, read straight from MLX codes.
 *
 * Shape of the work (docs/stream-tiles.md has the why):
 * - A block is 4 warps; a warp owns 16 rows of W (the m16 side of mma m16n8k16); the 8 activation rows are n8.
 *   Blocks are items (routed experts, or 8-row groups of a long launch) fastest, then row tiles, then k-slices.
 * - Each warp streams its rows through a private ring of shared-memory stages filled by asynchronous copies
 *   (cp.async on sm_80+, asking L2 for whole 256-byte blocks): a stage is 16 rows x NBC blocks of 32 codes plus
 *   their scales and biases. The ring is as deep as the 64 KB block allows for the launch's scale dtype and group
 *   (up to 8 stages, all but one in flight).
 * - x is staged per block in x-chunks (the whole k when it fits) in mma fragment order, with per-group sums of x.
 * - Thread (g, t) reads codes 8t..8t+7 of rows g and g+8 of each 32-code block (bits bytes, byte-aligned), turns
 *   them into exact bf16/f16 integers under a magic exponent, one mma per 16 codes; at each group end
 *   acc = fma(bias, sum(x), fma(scale, S, acc)). With bf16 activations at 2-6 bits the codes keep the magic's
 *   offset (q + 128: one packed subtract a code pair fewer) and S is the mma sum less 128 sum(x).
 * - A k-split (chosen from n, k and the SM count only) writes fp32 partials; the last block of a tile to finish
 *   adds them in slice order (and routed fc2's items in list order) and stores, so one launch does it all;
 *   stream_finish does that step as a second launch where one block would have too much to add.
 */
#include <stdio.h>
#include <string.h>

#include "cuda.h"
#include "port.h"
#include "tile.cuh"

/* Planted-fault hook points for the contract's twin (src/contract/twin_cuda_stream.cu); no effect here. */
#ifndef KEEL_PLANT_DECODE
#define KEEL_PLANT_DECODE(B, XF16, v, p) codes_to_pairs<B, XF16>(v, p)
#endif
#ifndef KEEL_PLANT_BIAS
#define KEEL_PLANT_BIAS(b) (b)
#endif
#ifndef KEEL_PLANT_GROUP_END
#define KEEL_PLANT_GROUP_END(acc, s, S, bi, xsum, epi) __fmaf_rn(bi, xsum, __fmaf_rn(s, S, acc))
#endif
#ifndef KEEL_PLANT_ROWS
#define KEEL_PLANT_ROWS(acc, bf16) ((void)0)
#endif
#ifndef KEEL_PLANT_STORE
#define KEEL_PLANT_STORE(y, i, v, bf16, last) ((void)(last), store_out(y, i, v, bf16))
#endif
#ifndef KEEL_PLANT_EW_STORED
#define KEEL_PLANT_EW_STORED(y, bf16, i, count) ((void)0)
#endif
#define KEEL_STREAM_PLANT_HOOKS 1

/* The stage body is straight-line code on CUDA; on HIP, whose mma twin is many instructions, one group at a time
 * (unrolled, the AMD compiler spills). */
#if defined(__HIPCC__)
#define KEEL_STAGE_UNROLL _Pragma("unroll 1")
#else
#define KEEL_STAGE_UNROLL _Pragma("unroll")
#endif

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
/* Blocks per SM the launch bounds ask for (a register cap): three on sm_90/sm_100, whose 228 KB of shared memory
 * hold three 64 KB blocks; two on sm_80 (164 KB); one on the 100 KB chips (sm_86/87/89/120). */
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
#define KEEL_STREAM_MIN_BLOCKS 1
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KEEL_STREAM_MIN_BLOCKS 3
#else
#define KEEL_STREAM_MIN_BLOCKS 2
#endif
constexpr int kRowsPerWarp = 16;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
constexpr int kSmemBytes = 65536;         /* dynamic shared memory of every block (gfx1030's limit) */
constexpr int kXBytes = 16384;            /* staged x fragments per block */
constexpr int kXSums = 256;               /* per-group x-sum entries per x-chunk (chunk codes / 32 * m <= 256) */
constexpr int kQuad = 128;                /* k-split granularity: a multiple of every group size */
constexpr int kChunkUnit = 256;           /* x-chunks are multiples of every stage length */
constexpr int kMaxRows = KEEL_CUDA_STREAM_MAX_ROWS;
constexpr int kMaxStages = 8;             /* ring depth cap (cp.async.wait_group immediates up to 6) */
constexpr int kLongSlice = 2048;        /* codes of a slice worth halving when the grid stays one wave */
constexpr int kFoldMax = 64;              /* partials per output the last block adds itself (more: stream_finish) */
/* floats of the x-sum table: kXsw an entry, two-float rows padded (xs_stride: 4 floats a row, 8 rows); a multiple
 * of 16 so the warps' regions stay 16-byte aligned */
template <int B> constexpr int kXsFloats = kXsw<B> == 1 ? kXSums : kXSums * kXsw<B> + 32;
/* a warp's table and ring */
template <int B> constexpr int kWarpBytes = (kSmemBytes - kXBytes - kXsFloats<B> * 4) / kWarps;
static_assert(kWarpBytes<2> % 16 == 0 && kWarpBytes<4> % 16 == 0, "the warps' regions stay 16-byte aligned");

enum { SDT_BF16 = 0, SDT_F16 = 1, SDT_F32 = 2 };
enum { MODE_STORE = 0, MODE_REDUCE = 1 };

/* Per-width layout constants, all compile-time; the ring's depth is chosen per launch (scale words vary). */
template <int B> struct Geo {
    static constexpr int NBC = B >= 6 ? 4 : 8;              /* 32-code blocks per stage */
    static constexpr int SK = NBC * 32;                      /* codes per stage */
    static constexpr int WPR = NBC * B;                      /* words per row per stage */
    static constexpr int VPL = WPR / 8;                      /* 16-byte vectors per lane per stage */
    static constexpr int RS = B == 5 ? WPR : WPR + 4;        /* shared row stride in words (banks, read slack) */
    static constexpr int SWMAX = NBC;                        /* raw scale words per row per stage at most (F32, g32) */
    static constexpr int CW = kRowsPerWarp * RS + 4;         /* code words per stage (+ read slack) */
    static constexpr int SBR = NBC + 1;                      /* fp32 (scale, bias) pairs per row, padded */
    static constexpr int SBF = kRowsPerWarp * SBR * 8;       /* bytes of the warp's (scale, bias) table */
    static constexpr int RING = (kWarpBytes<B> - SBF) / 4;   /* words of the warp's ring */
};

struct Params {
    const uint32_t *w;
    const void *sc;
    const void *bi;
    long long ew, es;       /* expert strides: words, scale elements */
    int n, k, group, sdt;
    const uint16_t *x;
    long long x_item;       /* elements between items' activations (0: shared x) */
    int m;                  /* rows per item (1..8) */
    const keel_cuda_route *items; /* NULL: one item {0, mask0}, or rows_m's 8-row groups */
    int n_items;
    uint32_t mask0;
    int rows_m;             /* keel_cuda_stream_matmul_rows: all rows (items are 8-row groups); else 0 */
    const float *rw;        /* routing weights [item][8] (MODE_REDUCE) */
    void *y;
    long long y_item;       /* elements between items' outputs (MODE_STORE) */
    long long last;         /* index of the last output element */
    int ydt_bf16, epi, mode, vec16, sb4, splits, xk, tiles;
    int nst, stride, sw;    /* ring stages, words per stage slot, scale words per row per stage */
    int l2_block;           /* code copies ask L2 for the whole 256-byte block around them */
    int diag;               /* benchmark diagnosis only: 1 skips the arithmetic, 2 the weight copies */
    int pfs;                /* stages per L2 prefetch chunk of each row (0: none); one chunk ahead of the ring */
    int fold;               /* the last block of a tile adds the partials (else stream_finish does) */
    int fast;               /* the common launch: stream_loop_fast */
    float *part;            /* splits > 1 or MODE_REDUCE: [split][item][8][n] fp32 partials */
    unsigned *cnt;          /* arrivals per (tile, item) (per tile in MODE_REDUCE); zero between launches */
};


/* Item it of a launch: a routed (expert, token mask), an 8-row group of a long launch, or the one plain item. */
__device__ __forceinline__ keel_cuda_route route_of(const Params &P, int it) {
    if (P.items) return P.items[it];
    if (P.rows_m) {
        const int rem = P.rows_m - kMaxRows * it;
        return keel_cuda_route{0, rem >= kMaxRows ? 0xffu : (1u << rem) - 1u};
    }
    return keel_cuda_route{0, P.mask0};
}





/* What one lane copies for its warp: the item's matrix and the warp's rows, the lane's scale row, the slice. */
template <int B> struct Prod {
    const uint32_t *wb;               /* the item's matrix */
    int rw;                           /* words per row (a matrix of an item holds < 2^31 words) */
    int row0, rlast;                  /* the warp's first row; the matrix's last row (rows past it are clamped) */
    long long e;                      /* the lane's scale row: first element of row (lane % 16) */
    long long e_end;                  /* one past the item's last scale element */
    const void *base;                 /* scales (lanes 0..15) or biases (16..31) */
    int ks, ke, lg;                   /* the slice [ks, ke) of k; log2(group) */
};

/* The lane's 16-byte code vectors of a stage: word offsets from the stage's first word of row 0 of the matrix
 * (rows past the matrix clamped to its last) and in a slot. Both loops copy through these. */
template <int B> __device__ __forceinline__ void lane_vectors(const Prod<B> &Q, int lane, int *roff, int *doff) {
    using G = Geo<B>;
#pragma unroll
    for (int i = 0; i < G::VPL; i++) {
        const int v = i * 32 + lane, rr = v / (G::WPR / 4), u = v % (G::WPR / 4);
        roff[i] = min(Q.row0 + rr, Q.rlast) * Q.rw + 4 * u;
        doff[i] = rr * G::RS + 4 * u;
    }
}

/* Where thread t's codes 8t..8t+7 of a 32-code block start in a slot row: word (x) and bit shift (y). */
template <int B> __device__ __forceinline__ int2 thread_codes(int t) {
    return make_int2((t * B) >> 2, ((t * B) & 3) * 8);
}

/* Whether the last of a stage's nwd scale words (its first holding par halves before the stage's) would reach
 * past the matrix, whose scales end rem halves after the stage's first. */
__device__ __forceinline__ bool scale_tail(int nwd, int par, long long rem) { return 2 * nwd - 1 - par >= rem; }

/* A stage's (scale, bias) table from 16-bit raw halves: the lane's N halves loaded together (PRED: only the first
 * ngs, within the slot either way), then converted (bf16 or f16), then stored as fp32 at dst[2 * gs]; groups from
 * ngs on (past the slice end) get zeros. Loads before stores: the stores may alias the next load otherwise. */
template <int N, bool PRED>
__device__ __forceinline__ void fill_table16(const uint16_t *r16, float *dst, int ngs, bool bf) {
    uint16_t h[N];
#pragma unroll
    for (int gs = 0; gs < N; gs++) h[gs] = !PRED || gs < ngs ? r16[gs] : (uint16_t)0;
    float v[N];
    if (bf) {
#pragma unroll
        for (int gs = 0; gs < N; gs++) v[gs] = kp_bf16_to_f32(h[gs]);
    } else {
#pragma unroll
        for (int gs = 0; gs < N; gs++) v[gs] = kp_f16_to_f32(h[gs]);
    }
    if (!PRED && ngs < N) {
#pragma unroll
        for (int gs = 0; gs < N; gs++) v[gs] = gs < ngs ? v[gs] : 0.f;
    }
#pragma unroll
    for (int gs = 0; gs < N; gs++) dst[2 * gs] = v[gs];
}

/* Issues the asynchronous copies of stage s (codes, scales, biases of the warp's 16 rows) into `slot`, then
 * commits a group (also when there is nothing to copy, so that group counting stays uniform). A partial last
 * stage copies only its blocks; the blocks after them are never read with non-zero x. roff/doff: the lane's code
 * vectors as word offsets in the matrix and the slot (stream_loop). The general loop's copies; issue_fast is the
 * FAST loop's. */
template <int B>
__device__ __forceinline__ void issue_stage(const Params &P, const Prod<B> &Q, int s, uint32_t *slot, int lane,
                                            const int *roff, const int *doff) {
    using G = Geo<B>;
    const int k0 = Q.ks + s * G::SK;
    if (k0 < Q.ke) {
        const int nb = min(G::NBC, (Q.ke - k0) >> 5), nw = nb * B;
        const uint32_t *wk = Q.wb + (k0 >> 5) * B;
        if (P.diag == 2) {
        } else if (P.vec16) {
#pragma unroll
            for (int i = 0; i < G::VPL; i++) {
                if (4 * ((i * 32 + lane) % (G::WPR / 4)) >= nw) continue;
                if (P.l2_block)
                    kp_cp_async16_l2(slot + doff[i], wk + roff[i]);
                else
                    kp_cp_async16(slot + doff[i], wk + roff[i]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < G::VPL; i++) {
                const int u4 = 4 * ((i * 32 + lane) % (G::WPR / 4));
#pragma unroll
                for (int j = 0; j < 4; j++)
                    if (u4 + j < nw) kp_cp_async4(slot + doff[i] + j, wk + roff[i] + j);
            }
        }
        const int ngs = (nb * 32) >> Q.lg;
        const long long e0 = Q.e + (k0 >> Q.lg);
        uint32_t *dst = slot + G::CW + (lane >> 4) * (kRowsPerWarp * P.sw) + (lane & 15) * P.sw;
        if (P.sdt == SDT_F32) {
#pragma unroll
            for (int i = 0; i < G::SWMAX; i++)
                if (i < ngs) kp_cp_async4(dst + i, (const float *)Q.base + e0 + i);
        } else if (P.sb4) { /* the words holding halves e0 .. e0 + ngs - 1 */
            const long long w0 = e0 >> 1;
            const int par = (int)(e0 & 1), nwd = (par + ngs + 1) >> 1;
            const bool tail = scale_tail(nwd, par, Q.e_end - e0);
            const uint32_t *src = (const uint32_t *)Q.base + w0;
#pragma unroll
            for (int i = 0; i < G::NBC / 2 + 1; i++)
                if (i < nwd - (int)tail) kp_cp_async4(dst + i, src + i);
            if (tail) /* its first half alone, synchronously */
                ((uint16_t *)(dst + nwd - 1))[0] = ((const uint16_t *)Q.base)[2 * (w0 + nwd - 1)];
        } else {
            uint16_t *d16 = (uint16_t *)dst + (e0 & 1);
#pragma unroll
            for (int i = 0; i < G::SWMAX; i++)
                if (i < ngs) d16[i] = ((const uint16_t *)Q.base)[e0 + i];
        }
    }
    kp_cp_commit();
}

/* Asks L2 for chunk c (pfs stages) of the warp's 16 rows: lane l < 16 the codes of row l, and every lane its scale
 * (l < 16) or bias (l >= 16) elements of row l % 16. Long contiguous row pieces keep DRAM streaming at full rate
 * while the ring copies short pieces out of L2. */
template <int B>
__device__ __forceinline__ void prefetch_chunk(const Params &P, const Prod<B> &Q, int c, int lane) {
    using G = Geo<B>;
    const int k0 = Q.ks + c * P.pfs * G::SK;
    if (k0 >= Q.ke) return;
    const int k1 = min(Q.ke, k0 + P.pfs * G::SK);
    if (lane < 16) {
        const int row = min(Q.row0 + lane, Q.rlast);
        kp_prefetch_l2(Q.wb + (long long)row * Q.rw + (k0 >> 5) * B, (long long)((k1 - k0) >> 5) * B * 4);
    }
    const int esz = P.sdt == SDT_F32 ? 4 : 2;
    kp_prefetch_l2((const char *)Q.base + (Q.e + (k0 >> Q.lg)) * esz, (long long)((k1 - k0) >> Q.lg) * esz);
}



/* The NBC blocks of a stage of one warp's 16 rows, groups of BPG blocks (compile-time, so it is straight-line code
 * the compiler can overlap, every offset an immediate). ra/rb: the thread's bytes in rows g and g + 8; xfb: its
 * x fragment of the first block (blocks 4 apart); xsa/xsb: the x sums of its columns 2t, 2t+1 for the first
 * group; sa/sb: the (scale, bias) pairs of rows g and g + 8. ONE (m = 1): the odd columns' group ends are left out
 * (their accumulators stay zero and are never stored). */
template <int B, bool XF16, int BPG, bool ONE = false>
__device__ __forceinline__ void stage_body(const uint32_t *ra, const uint32_t *rb, int tsh, const uint4 *xfb,
                                           int xsw, bool xlive, const float *xsa, const float *xsb, bool xs0ok, bool xs1ok,
                                           const float2 *sa, const float2 *sb, int epi, float acc[4]) {
    using G = Geo<B>;
    (void)epi;
    KEEL_STAGE_UNROLL
    for (int gs = 0; gs < G::NBC / BPG; gs++) {
        float S[4] = {0.f, 0.f, 0.f, 0.f};
        KEEL_STAGE_UNROLL
        for (int b = 0; b < BPG; b++) {
            const int jb = gs * BPG + b;
            uint32_t pa[4], pb[4];
            {
                unsigned long long va, vb;
                if constexpr (B == 4) { /* thread t's codes are word t of the block: no shift */
                    va = ra[jb * B];
                    vb = rb[jb * B];
                } else if constexpr (B == 2) {
                    va = ra[jb * B] >> tsh;
                    vb = rb[jb * B] >> tsh;
                } else if constexpr (B == 8) { /* words 2t, 2t + 1 of the block */
                    va = (unsigned long long)ra[jb * B + 1] << 32 | ra[jb * B];
                    vb = (unsigned long long)rb[jb * B + 1] << 32 | rb[jb * B];
                } else {
                    va = ((unsigned long long)ra[jb * B + 1] << 32 | ra[jb * B]) >> tsh;
                    vb = ((unsigned long long)rb[jb * B + 1] << 32 | rb[jb * B]) >> tsh;
                }
                KEEL_PLANT_DECODE(B, XF16, va, pa);
                KEEL_PLANT_DECODE(B, XF16, vb, pb);
            }
            uint4 xv = make_uint4(0u, 0u, 0u, 0u);
            if (xlive) xv = xfb[jb * 4 + ((jb & 1) ? -xsw : xsw)]; /* xf_at's pair swap of odd rows */
            const uint32_t a0[4] = {pa[0], pb[0], pa[1], pb[1]}, b0[2] = {xv.x, xv.y};
            const uint32_t a1[4] = {pa[2], pb[2], pa[3], pb[3]}, b1[2] = {xv.z, xv.w};
            kp_mma_16816<XF16>(S, a0, b0);
            kp_mma_16816<XF16>(S, a1, b1);
        }
        constexpr int W = kXsw<B>;
        const float2 s0 = sa[gs], s1 = sb[gs];
        const float xs0 = xs0ok ? xsa[gs * W] : 0.f, os0 = xs0ok ? place_sum<B, XF16>(xsa, gs) : 0.f;
        S[0] = offset_out<B, XF16>(S[0], xs0, os0); /* the codes' offset out */
        S[2] = offset_out<B, XF16>(S[2], xs0, os0);
        acc[0] = KEEL_PLANT_GROUP_END(acc[0], s0.x, S[0], KEEL_PLANT_BIAS(s0.y), xs0, epi);
        acc[2] = KEEL_PLANT_GROUP_END(acc[2], s1.x, S[2], KEEL_PLANT_BIAS(s1.y), xs0, epi);
        if constexpr (!ONE) { /* columns 2t + 1: activation rows 1, 3, 5, 7, none of them live when m = 1 */
            const float xs1 = xs1ok ? xsb[gs * W] : 0.f, os1 = xs1ok ? place_sum<B, XF16>(xsb, gs) : 0.f;
            S[1] = offset_out<B, XF16>(S[1], xs1, os1);
            S[3] = offset_out<B, XF16>(S[3], xs1, os1);
            acc[1] = KEEL_PLANT_GROUP_END(acc[1], s0.x, S[1], KEEL_PLANT_BIAS(s0.y), xs1, epi);
            acc[3] = KEEL_PLANT_GROUP_END(acc[3], s1.x, S[3], KEEL_PLANT_BIAS(s1.y), xs1, epi);
        }
    }
}

/* Adds the partials of output (o, r, row) in slice order (routed fc2: each item's slices, then the items in list
 * order with their routing weights), applies the epilogue and stores. Outputs outside an item's mask stay untouched.
 * The tile's last block and stream_finish both end here, so either gives the same bits. */
__device__ __forceinline__ void finish_out(const Params &P, int o, int r, int row) {
    constexpr int kBatch = 8; /* partials loaded together, then added in order: one L2 round trip per batch */
    const long long per = (long long)kMaxRows * P.n, at = (long long)r * P.n + row;
    float v;
    if (P.mode == MODE_REDUCE) {
        float tot = 0.f, acc = 0.f;
        int it0 = 0, s0 = 0; /* (item, slice) of the batch's first partial */
        for (int b0 = 0; b0 < P.n_items * P.splits; b0 += kBatch) {
            float pv[kBatch], wv[kBatch];
            uint32_t mv[kBatch];
#pragma unroll
            for (int j = 0, it = it0, s = s0; j < kBatch; j++) {
                const bool live = it < P.n_items;
                pv[j] = live ? kp_ldcg_f32(P.part + ((long long)s * P.n_items + it) * per + at) : 0.f;
                const bool end = live && s == P.splits - 1;
                mv[j] = end ? route_of(P, it).mask : 0u;
                wv[j] = end ? P.rw[it * kMaxRows + r] : 0.f;
                if (++s == P.splits) s = 0, it++;
            }
#pragma unroll
            for (int j = 0; j < kBatch; j++) {
                if (it0 >= P.n_items) break;
                acc = __fadd_rn(s0 == 0 ? 0.f : acc, pv[j]);
                if (s0 == P.splits - 1 && ((mv[j] >> r) & 1u)) tot = __fmaf_rn(wv[j], acc, tot);
                if (++s0 == P.splits) s0 = 0, it0++;
            }
        }
        v = tot;
    } else {
        if (!((route_of(P, o).mask >> r) & 1u)) return;
        float acc = 0.f;
        for (int s0 = 0; s0 < P.splits; s0 += kBatch) {
            float pv[kBatch];
#pragma unroll
            for (int j = 0; j < kBatch; j++) {
                const long long pi = ((long long)(s0 + j) * P.n_items + o) * per + at;
                pv[j] = s0 + j < P.splits ? kp_ldcg_f32(P.part + pi) : 0.f;
            }
#pragma unroll
            for (int j = 0; j < kBatch; j++)
                if (s0 + j < P.splits) acc = __fadd_rn(acc, pv[j]);
        }
        v = acc;
    }
    v = P.epi == KEEL_EPI_RELU2 ? relu2(v) : v;
    KEEL_PLANT_STORE(P.y, (long long)o * P.y_item + at, v, P.ydt_bf16, P.last);
}

/* A new x-chunk at k0 for the block (every warp is done with the last one): x in fragment order, then its group
 * sums. Returns the chunk's blocks of 32 codes (whole stages of SK codes). */
template <int B, bool XF16, int SK = Geo<B>::SK>
__device__ __forceinline__ int next_chunk(const Params &P, const uint16_t *__restrict__ x, uint32_t mask, int k0, int ke,
                                          uint4 *xf, float *xs) {
    __syncthreads();
    const int len = min(P.xk, ke - k0), lenp = (len + SK - 1) / SK * SK;
    stage_x<kThreads>(P.m, P.k, x, mask, k0, len, lenp, xf);
    __syncthreads();
    stage_xsum<kThreads, B, XF16>(P.m, P.group, lenp, xf, xs);
    __syncthreads();
    return lenp >> 5;
}

/* The warp's walk over its slice, for launches the FAST loop does not take (unaligned W or scales, F32 scales, a
 * one-slot ring, diagnosis, L2 prefetch): the ring's first stages, the wait for the previous kernel, then per
 * stage the x-chunk (block-wide), the next stage's copies, the (scale, bias) table and the stage body. The copies
 * and the arithmetic are the FAST loop's, so either gives the same bits. */
template <int B, bool XF16>
__device__ __forceinline__ void stream_loop(const Params &P, const Prod<B> &Q, const uint16_t *__restrict__ x,
                                            uint32_t mask, uint4 *xf, float *xs, float2 *sbf, uint32_t *ring,
                                            int lane, int lg, int lbpg, int nstage, float acc[4]) {
    using G = Geo<B>;
    const int g = lane >> 2, t = lane & 3, nst = P.nst, stride = P.stride;
    int roff[G::VPL], doff[G::VPL]; /* the lane's code vectors, as word offsets in the matrix and the slot */
    lane_vectors<B>(Q, lane, roff, doff);
    const int2 tc = thread_codes<B>(t);
    const int tw = tc.x, tsh = tc.y;
    const bool xlive = g < P.m, xs0ok = 2 * t < P.m, xs1ok = 2 * t + 1 < P.m;

    if (P.pfs) {
        prefetch_chunk<B>(P, Q, 0, lane);
        prefetch_chunk<B>(P, Q, 1, lane);
    }
    for (int s = 0; s < nst - 1; s++) issue_stage<B>(P, Q, s, ring + s * stride, lane, roff, doff);
    kp_grid_wait(); /* weights only so far: x, the partials and the counters belong to the previous kernel until now */

    int kc = 0, slot_i = 0, nblk = 0; /* position in the x-chunk; ring slot of stage s; the chunk's blocks */
    for (int s = 0; s < nstage; s++) {
        const int k0 = Q.ks + s * G::SK;
        if (P.pfs && s > 0 && s % P.pfs == 0) prefetch_chunk<B>(P, Q, s / P.pfs + 1, lane);
        if (kc == 0) nblk = next_chunk<B, XF16>(P, x, mask, k0, Q.ke, xf, xs);
        /* stage s + nst - 1 goes into the slot stage s - 1 used; a ring of one slot (F32 scales, group 32, wide
         * codes) copies stage s itself, then waits for it */
        if (nst > 1) kp_cp_wait_dyn(nst - 2);
        kp_syncwarp(); /* stage s has landed for every lane (nst > 1); every lane is done with stage s - 1 */
        const int next = slot_i + nst - 1 < nst ? slot_i + nst - 1 : slot_i - 1;
        issue_stage<B>(P, Q, s + nst - 1, ring + next * stride, lane, roff, doff);
        if (nst == 1) {
            kp_cp_wait<0>();
            kp_syncwarp();
        }

        const uint32_t *slot = ring + slot_i * stride;
        { /* the stage's scales and biases to fp32 (scale, bias) pairs; groups past the slice end get zeros */
            const int rr = lane & 15, which = lane >> 4;
            const int ngs = (min(G::NBC, (Q.ke - k0) >> 5) * 32) >> lg;
            const long long e0 = Q.e + (k0 >> lg);
            const uint32_t *raw = slot + G::CW + which * (kRowsPerWarp * P.sw) + rr * P.sw;
            float *dst = (float *)(sbf + rr * G::SBR) + which;
            if (P.sdt != SDT_F32) { /* 16-bit: predicated loads, a zero half is 0.0f in both dtypes */
                fill_table16<G::NBC, true>((const uint16_t *)raw + (int)(e0 & 1), dst, ngs, P.sdt == SDT_BF16);
            } else {
#pragma unroll
                for (int gs = 0; gs < G::NBC; gs++) dst[2 * gs] = gs < ngs ? __uint_as_float(raw[gs]) : 0.f;
            }
        }
        kp_syncwarp();
        if (P.diag != 1) {
            const int ngc = nblk * 32 >> lg; /* groups in this x-chunk */
            const uint32_t *ra = slot + g * G::RS + tw, *rb = ra + 8 * G::RS;
            const uint4 *xfb = xf + (g * nblk + (kc >> 5)) * 4 + t;
            const int xsw = (g & 1) * 4;
            const float *xsa = xs + 2 * t * xs_stride<B>(ngc) + (kc >> lg) * kXsw<B>;
            const float *xsb = xsa + xs_stride<B>(ngc);
            const float2 *sa = sbf + g * G::SBR, *sb = sbf + (g + 8) * G::SBR;
            if (lbpg == 0)
                stage_body<B, XF16, 1>(ra, rb, tsh, xfb, xsw, xlive, xsa, xsb, xs0ok, xs1ok, sa, sb, P.epi, acc);
            else if (lbpg == 1)
                stage_body<B, XF16, 2>(ra, rb, tsh, xfb, xsw, xlive, xsa, xsb, xs0ok, xs1ok, sa, sb, P.epi, acc);
            else
                stage_body<B, XF16, 4>(ra, rb, tsh, xfb, xsw, xlive, xsa, xsb, xs0ok, xs1ok, sa, sb, P.epi, acc);
        }
        kc += G::SK;
        if (kc == P.xk) kc = 0;
        slot_i = slot_i == nst - 1 ? 0 : slot_i + 1;
    }
    kp_cp_wait<0>();
}

/* The FAST loop's copy state of one lane: the stage's code words (advanced a stage at a time) and the lane's code
 * vectors in it and in a slot; the lane's scale (lanes 0..15) or bias (16..31) halves of its row. */
template <int B> struct FastCopy {
    const uint32_t *wk;          /* the next stage to issue: its first code word of row 0 of the matrix */
    int roff[Geo<B>::VPL];       /* the lane's code vectors: word offsets from wk (rows clamped) */
    int doff[Geo<B>::VPL];       /* ... and in a slot */
    const uint16_t *sh;          /* the lane's first half of the next stage to issue */
    int rem;                     /* halves from sh to the end of the item's scales (capped) */
    int sdo;                     /* the lane's raw scale words in a slot */
};

/* FAST issue of the stage at k0 into `slot` (16-byte code copies asking L2 for 256-byte blocks; the 32-bit words
 * holding the stage's GPS scale halves, the last one alone when its second half lies past the matrix), then the
 * commit; the same bytes land where issue_stage puts them. Advances C by a stage. */
template <int B, int GPS>
__device__ __forceinline__ void issue_fast(const Prod<B> &Q, FastCopy<B> &C, int k0, uint32_t *slot, int lane) {
    using G = Geo<B>;
    constexpr int LG = GPS * 32 == G::SK ? 5 : 2 * GPS * 32 == G::SK ? 6 : 7; /* log2 of the group */
    if (k0 < Q.ke) {
        const bool full = k0 + G::SK <= Q.ke;
        const int nb = full ? G::NBC : (Q.ke - k0) >> 5, nw = nb * B;
#pragma unroll
        for (int i = 0; i < G::VPL; i++)
            if (full || 4 * ((i * 32 + lane) % (G::WPR / 4)) < nw) kp_cp_async16_l2(slot + C.doff[i], C.wk + C.roff[i]);
        const int ngs = full ? GPS : (nb * 32) >> LG, par = (int)(((uintptr_t)C.sh >> 1) & 1u);
        const uint32_t *ws = (const uint32_t *)(C.sh - par);
        const int nwd = (par + ngs + 1) >> 1;
        uint32_t *dst = slot + C.sdo;
        if (C.rem > GPS + 1) { /* every word of the stage lies within the matrix */
#pragma unroll
            for (int i = 0; i < GPS / 2 + 1; i++)
                if (i < nwd) kp_cp_async4(dst + i, ws + i);
        } else {
            const bool tail = scale_tail(nwd, par, C.rem);
#pragma unroll
            for (int i = 0; i < GPS / 2 + 1; i++)
                if (i < nwd - (int)tail) kp_cp_async4(dst + i, ws + i);
            if (tail) /* its first half alone, synchronously */
                ((uint16_t *)(dst + nwd - 1))[0] = ((const uint16_t *)ws)[2 * (nwd - 1)];
        }
    }
    C.wk += G::NBC * B;
    C.sh += GPS;
    C.rem -= GPS;
    kp_cp_commit();
}

/* The common launch's walk over its slice (16-byte code copies, 4-byte aligned 16-bit scales, a ring of two or more
 * slots, no diagnosis or prefetch), with the group (BPG blocks) known at compile time: per-lane copy state advanced
 * a stage at a time, the (scale, bias) table converted from loads issued together, and the x rows past m read from
 * row 0 (their output columns are never stored). The same copies and arithmetic as stream_loop: the same bits. */
template <int B, bool XF16, int BPG, bool ONE>
__device__ __forceinline__ void stream_loop_fast(const Params &P, const Prod<B> &Q, const uint16_t *__restrict__ x,
                                                 uint32_t mask, uint4 *xf, float *xs, float2 *sbf, uint32_t *ring,
                                                 int lane, int nstage, float acc[4]) {
    using G = Geo<B>;
    constexpr int GPS = G::NBC / BPG, LG = BPG == 1 ? 5 : BPG == 2 ? 6 : 7;
    const int g = lane >> 2, t = lane & 3, nst = P.nst, stride = P.stride;
    FastCopy<B> C;
    C.wk = Q.wb + (Q.ks >> 5) * B;
    lane_vectors<B>(Q, lane, C.roff, C.doff);
    const long long e0 = Q.e + (Q.ks >> LG);
    C.sh = (const uint16_t *)Q.base + e0;
    C.rem = (int)min(Q.e_end - e0, 1ll << 30);
    C.sdo = G::CW + (lane >> 4) * (kRowsPerWarp * P.sw) + (lane & 15) * P.sw;
    const int par0 = (int)(e0 & 1);
    const int2 tc = thread_codes<B>(t);
    const int tw = tc.x, tsh = tc.y;
    const int gx = g < P.m ? g : 0, r0 = 2 * t < P.m ? 2 * t : 0, r1 = 2 * t + 1 < P.m ? 2 * t + 1 : 0;
    const bool bf = P.sdt == SDT_BF16;

    for (int s = 0; s < nst - 1; s++) issue_fast<B, GPS>(Q, C, Q.ks + s * G::SK, ring + s * stride, lane);
    kp_grid_wait(); /* weights only so far: x, the partials and the counters belong to the previous kernel until now */

    int kc = 0, slot_i = 0, nblk = 0; /* position in the x-chunk; ring slot of stage s; the chunk's blocks */
    for (int s = 0; s < nstage; s++) {
        const int k0 = Q.ks + s * G::SK;
        if (kc == 0) nblk = next_chunk<B, XF16>(P, x, mask, k0, Q.ke, xf, xs);
        kp_cp_wait_dyn(nst - 2);
        kp_syncwarp(); /* stage s has landed for every lane; every lane is done with stage s - 1 */
        const int next = slot_i + nst - 1 < nst ? slot_i + nst - 1 : slot_i - 1;
        issue_fast<B, GPS>(Q, C, k0 + (nst - 1) * G::SK, ring + next * stride, lane);

        const uint32_t *slot = ring + slot_i * stride;
        { /* the stage's scales and biases to fp32 (scale, bias) pairs; groups past the slice end get zeros */
            const int ngs = (min(G::NBC, (Q.ke - k0) >> 5) * 32) >> LG;
            const int par = (GPS & 1) ? (par0 + s * GPS) & 1 : par0;
            fill_table16<GPS, false>((const uint16_t *)(slot + C.sdo) + par,
                                     (float *)(sbf + (lane & 15) * G::SBR) + (lane >> 4), ngs, bf);
        }
        kp_syncwarp();
        {
            const int ngc = nblk * 32 >> LG; /* groups in this x-chunk */
            const uint32_t *ra = slot + g * G::RS + tw, *rb = ra + 8 * G::RS;
            const uint4 *xfb = xf + (gx * nblk + (kc >> 5)) * 4 + t;
            const int xsw = ONE ? 0 : (gx & 1) * 4;
            const float *xsa = xs + r0 * xs_stride<B>(ngc) + (kc >> LG) * kXsw<B>;
            const float *xsb = xs + r1 * xs_stride<B>(ngc) + (kc >> LG) * kXsw<B>;
            const float2 *sa = sbf + g * G::SBR, *sb = sbf + (g + 8) * G::SBR;
            stage_body<B, XF16, BPG, ONE>(ra, rb, tsh, xfb, xsw, true, xsa, xsb, true, true, sa, sb, P.epi, acc);
        }
        kc += G::SK;
        if (kc == P.xk) kc = 0;
        slot_i = slot_i == nst - 1 ? 0 : slot_i + 1;
    }
    kp_cp_wait<0>();
}

/* The FAST loop for the launch's group (1, 2 or 4 blocks). */
template <int B, bool XF16, bool ONE>
__device__ __forceinline__ void stream_fast_bpg(const Params &P, const Prod<B> &Q, const uint16_t *__restrict__ x,
                                                uint32_t mask, uint4 *xf, float *xs, float2 *sbf, uint32_t *ring,
                                                int lane, int lbpg, int nstage, float acc[4]) {
    if (lbpg == 0)
        stream_loop_fast<B, XF16, 1, ONE>(P, Q, x, mask, xf, xs, sbf, ring, lane, nstage, acc);
    else if (lbpg == 1)
        stream_loop_fast<B, XF16, 2, ONE>(P, Q, x, mask, xf, xs, sbf, ring, lane, nstage, acc);
    else
        stream_loop_fast<B, XF16, 4, ONE>(P, Q, x, mask, xf, xs, sbf, ring, lane, nstage, acc);
}

template <int B, bool XF16>
__global__ void __launch_bounds__(kThreads, KEEL_STREAM_MIN_BLOCKS) stream_tile(Params P) {
    using G = Geo<B>;
    extern __shared__ uint4 smem_raw[];
    uint4 *xf = smem_raw;                                      /* kXBytes of fragments */
    float *xs = (float *)(smem_raw + kXBytes / 16);           /* kXSums entries */
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
    kp_grid_release(); /* the next launch on the stream may start its own weight prefetch now */
    if (P.items) kp_grid_wait(); /* the routed list is the previous kernel's output */
    uint8_t *wsm = (uint8_t *)(xs + kXsFloats<B>) + warp * kWarpBytes<B>;
    float2 *sbf = (float2 *)wsm;                               /* the warp's (scale, bias) table */
    uint32_t *ring = (uint32_t *)(wsm + G::SBF);               /* then its ring of P.nst slots */

    /* items fastest (8-row groups of one tile share its weights in L2), then row tiles, then k-slices */
    const int it = (int)(blockIdx.x % (unsigned)P.n_items), rest = (int)(blockIdx.x / (unsigned)P.n_items);
    const int tile = rest % P.tiles, split = rest / P.tiles;
    const keel_cuda_route item = route_of(P, it);
    const int row0 = tile * kRowsPerBlock + warp * kRowsPerWarp;
    const int groups = P.k / P.group, lg = 31 - __clz(P.group), lbpg = lg - 5;
    const long long row_words = (long long)P.k * B / 32;
    Prod<B> Q;
    {
        const uint32_t *W = P.w + (long long)item.expert * P.ew;
        Q.wb = W;
        Q.rw = (int)row_words;
        Q.row0 = row0;
        Q.rlast = P.n - 1;
        const long long sb0 = (long long)item.expert * P.es;
        Q.e = sb0 + (long long)min(row0 + (lane & 15), P.n - 1) * groups;
        Q.e_end = sb0 + (long long)P.n * groups;
        Q.base = lane >> 4 ? P.bi : P.sc;
        const int nq = (P.k + kQuad - 1) / kQuad;
        Q.ks = (int)min((long long)P.k, (long long)nq * split / P.splits * kQuad);
        Q.ke = (int)min((long long)P.k, (long long)nq * (split + 1) / P.splits * kQuad);
        Q.lg = lg;
    }
    const uint16_t *x = P.x + (long long)it * P.x_item;
    const int nstage = (Q.ke - Q.ks + G::SK - 1) / G::SK;

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (P.fast && P.m == 1) /* one activation row (decode): the odd columns' group ends left out */
        stream_fast_bpg<B, XF16, true>(P, Q, x, item.mask, xf, xs, sbf, ring, lane, lbpg, nstage, acc);
    else if (P.fast)
        stream_fast_bpg<B, XF16, false>(P, Q, x, item.mask, xf, xs, sbf, ring, lane, lbpg, nstage, acc);
    else
        stream_loop<B, XF16>(P, Q, x, item.mask, xf, xs, sbf, ring, lane, lg, lbpg, nstage, acc);

    KEEL_PLANT_ROWS(acc, P.ydt_bf16);
    const bool to_part = P.splits > 1 || P.mode == MODE_REDUCE;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int r = 2 * t + (e & 1), row = row0 + g + 8 * (e >> 1);
        if (r >= P.m || !((item.mask >> r) & 1u) || row >= P.n) continue;
        if (to_part) {
            P.part[(((long long)split * P.n_items + it) * kMaxRows + r) * P.n + row] = acc[e];
        } else {
            const float v = P.epi == KEEL_EPI_RELU2 ? relu2(acc[e]) : acc[e];
            KEEL_PLANT_STORE(P.y, (long long)it * P.y_item + (long long)r * P.n + row, v, P.ydt_bf16, P.last);
        }
    }
    if (!to_part || !P.fold) return;
    /* The last block of this tile (of this item; of every item in MODE_REDUCE) to arrive adds the partials. */
    __threadfence();
    __syncthreads();
    unsigned *last = (unsigned *)xs; /* every warp is past the loop: the x sums are free */
    if (threadIdx.x == 0) {
        const int ci = P.mode == MODE_REDUCE ? tile : tile * P.n_items + it;
        const unsigned want = (unsigned)(P.mode == MODE_REDUCE ? P.splits * P.n_items : P.splits);
        const unsigned got = atomicAdd(P.cnt + ci, 1u) + 1u;
        if (got == want) P.cnt[ci] = 0u; /* all arrived: zero again for the next launch */
        *last = got == want;
    }
    __syncthreads();
    if (!*last) return;
    __threadfence();
    const int rows = min(kRowsPerBlock, P.n - tile * kRowsPerBlock), o = P.mode == MODE_REDUCE ? 0 : it;
    for (int e = threadIdx.x; e < rows * P.m; e += kThreads) finish_out(P, o, e / rows, tile * kRowsPerBlock + e % rows);
}

/* The partials' sums as a launch of its own, one thread per output: for routed fc2 launches with more partials per
 * output than one block should add (kFoldMax). */
__global__ void stream_finish(Params P) {
    const long long per = (long long)P.m * P.n;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int outs = P.mode == MODE_REDUCE ? 1 : P.n_items;
    if (i >= per * outs) return;
    finish_out(P, (int)(i / per), (int)(i % per / P.n), (int)(i % P.n));
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
        KEEL_PLANT_EW_STORED(y, bf16, i, count);
    }
}

/* One stream's scratch: launches on one stream run in order, so they can share it; two streams need two. */
struct Scratch {
    cudaStream_t st;
    float *part;   /* k-split and routed fc2 partials, grown (never shrunk) on a first launch of a size */
    size_t part_cap;
    unsigned *cnt; /* arrival counters, zero between launches */
    size_t cnt_cap;
};
constexpr int kMaxScratch = 16; /* streams with scratch at once (keel_cuda_stream_scratch_release frees one) */
Scratch g_scr[kMaxScratch];
int g_n_scr = 0;

Scratch *scratch_of(cudaStream_t st) {
    for (int i = 0; i < g_n_scr; i++)
        if (g_scr[i].st == st) return &g_scr[i];
    KEEL_ASSERTF(g_n_scr < kMaxScratch, "stream tiles: scratch for more than %d streams at once", kMaxScratch);
    g_scr[g_n_scr] = Scratch{st, nullptr, 0, nullptr, 0};
    return &g_scr[g_n_scr++];
}
constexpr int kL2Block = 1; /* default: code copies ask L2 for whole 256-byte blocks */
int g_l2_block = kL2Block, g_max_stages = kMaxStages, g_diag = 0;
int g_pf_stages = KEEL_CUDA_STREAM_PREFETCH_DEFAULT, g_pdl = KEEL_CUDA_STREAM_PDL_DEFAULT;
int g_split_target = KEEL_CUDA_STREAM_SPLIT_TARGET_DEFAULT, g_split_long = KEEL_CUDA_STREAM_SPLIT_LONG_DEFAULT,
    g_split_down = KEEL_CUDA_STREAM_SPLIT_ROUND_DEFAULT;
int g_pdl_ok = -1; /* the device can launch programmatic dependents (sm_90+), once known */

/* Whether launches go out as programmatic dependents: asked for, and the device has them (sm_90+). */
bool pdl_active(void) {
#if defined(__HIPCC__)
    return false;
#else
    if (g_pdl_ok < 0) {
        int dev = 0, major = 0;
        KEEL_CUDA_CHECK(cudaGetDevice(&dev));
        KEEL_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        g_pdl_ok = major >= 9;
    }
    return g_pdl && g_pdl_ok;
#endif
}

/* A tile's launch attributes: its 64 KB of dynamic shared memory, and all of the SM's shared memory for shared memory
 * (as many blocks as fit). Set once per kernel before its first launch or occupancy query. */
void tile_attrs(const void *fn) {
    KEEL_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
#if !defined(__HIPCC__)
    KEEL_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
#endif
}

int g_bps = 0; /* stream tiles an SM holds at once (the 4-bit bf16 tile's occupancy, attributes as launched) */
int blocks_per_sm(void) {
    if (g_bps == 0) {
        const void *fn = (const void *)stream_tile<4, false>;
        tile_attrs(fn);
        KEEL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&g_bps, fn, kThreads, kSmemBytes));
        if (g_bps < 1) g_bps = 1;
    }
    return g_bps;
}

/* Grows a device buffer to `need` bytes (zeroed when asked); a no-op once warm, so launches can be captured. */
unsigned g_epoch = 0; /* bumped whenever a scratch buffer moves: a captured graph holding the old one is stale */

void grow(void **buf, size_t *cap, size_t need, bool zero) {
    if (need <= *cap) return;
    g_epoch++;
    KEEL_CUDA_CHECK(cudaDeviceSynchronize());
    if (*buf) KEEL_CUDA_CHECK(cudaFree(*buf));
    KEEL_CUDA_CHECK(cudaMalloc(buf, need));
    if (zero) KEEL_CUDA_CHECK(cudaMemset(*buf, 0, need));
    KEEL_CUDA_CHECK(cudaDeviceSynchronize());
    *cap = need;
}

template <int B, bool XF16> void launch_t(const Params &P, unsigned blocks, cudaStream_t st) {
    static bool attr = false;
    if (!attr) {
        tile_attrs((const void *)stream_tile<B, XF16>);
        attr = true;
    }
    KP_LAUNCH(pdl_active(), (stream_tile<B, XF16>), dim3(blocks), dim3(kThreads), (size_t)kSmemBytes, st, P);
    KEEL_CUDA_CHECK_LAUNCH();
}

template <bool XF16> void launch_bits(int bits, const Params &P, unsigned blocks, cudaStream_t st) {
    switch (bits) {
    case 2: launch_t<2, XF16>(P, blocks, st); break;
    case 3: launch_t<3, XF16>(P, blocks, st); break;
    case 4: launch_t<4, XF16>(P, blocks, st); break;
    case 5: launch_t<5, XF16>(P, blocks, st); break;
    case 6: launch_t<6, XF16>(P, blocks, st); break;
    case 8: launch_t<8, XF16>(P, blocks, st); break;
    default: KEEL_ASSERTF(false, "stream tile: bits %d", bits);
    }
}

/* The compile-time geometry a launch needs on the host: codes per stage, code words per slot, ring words. */
struct GeoRt {
    int sk, cw, ring;
};
template <int B> GeoRt geo_rt(void) { return GeoRt{Geo<B>::SK, Geo<B>::CW, Geo<B>::RING}; }
GeoRt geo_of(int bits) {
    switch (bits) {
    case 2: return geo_rt<2>();
    case 3: return geo_rt<3>();
    case 4: return geo_rt<4>();
    case 5: return geo_rt<5>();
    case 6: return geo_rt<6>();
    default: return geo_rt<8>();
    }
}

int sdt_code(keel_dtype d) {
    KEEL_ASSERTF(d == KEEL_DT_BF16 || d == KEEL_DT_F16 || d == KEEL_DT_F32, "stream tile: scale dtype %s",
                 keel_dtype_name(d));
    return d == KEEL_DT_BF16 ? SDT_BF16 : d == KEEL_DT_F16 ? SDT_F16 : SDT_F32;
}

void run(const keel_cuda_qw *W, Params P, keel_dtype xdt, keel_dtype ydt, int n_items, void *stream) {
    KEEL_ASSERT(W && W->w && W->scales && W->biases && P.x && P.y);
    KEEL_ASSERTF(keel_quant_bits_ok(W->bits) && keel_quant_group_ok(W->group) && W->k > 0 && W->n > 0 &&
                     W->k % W->group == 0,
                 "stream tile: n %d k %d bits %d group %d", W->n, W->k, W->bits, W->group);
    KEEL_ASSERTF(P.m >= 1 && P.m <= kMaxRows, "stream tile: m %d (1..%d)", P.m, kMaxRows);
    KEEL_ASSERT(xdt == KEEL_DT_BF16 || xdt == KEEL_DT_F16);
    KEEL_ASSERTF(((uintptr_t)P.x & 3u) == 0, "stream tile: activations must be 4-byte aligned");
    KEEL_ASSERT(ydt == KEEL_DT_F32 || ydt == KEEL_DT_BF16);
    KEEL_ASSERT(n_items >= 1);
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
    const long long rw = (long long)W->k * W->bits / 32;
    KEEL_ASSERTF(rw * W->n < (1ll << 31), "stream tile: n %d x %lld words per row (2^31 words at most)", W->n, rw);
    P.vec16 = (rw % 4 == 0) && (((uintptr_t)W->w & 15u) == 0) && (W->expert_words % 4 == 0);
    P.sb4 = (((uintptr_t)W->scales | (uintptr_t)W->biases) & 3u) == 0;
    P.n_items = n_items;
    P.tiles = (W->n + kRowsPerBlock - 1) / kRowsPerBlock;
    P.splits = keel_cuda_stream_splits(W->n, W->k, W->items);
    P.xk = kXBytes / 2 / P.m / kChunkUnit * kChunkUnit; /* x-chunk codes; never changes the arithmetic */
    const GeoRt geo = geo_of(W->bits);
    P.sw = P.sdt == SDT_F32 ? geo.sk / W->group : geo.sk / (2 * W->group) + 1;
    P.stride = geo.cw + 2 * kRowsPerWarp * P.sw;
    P.nst = geo.ring / P.stride < g_max_stages ? geo.ring / P.stride : g_max_stages;
    KEEL_ASSERTF(P.nst >= 1, "stream tile: a %d-bit ring holds %d stages", W->bits, P.nst);
    P.l2_block = g_l2_block;
    P.diag = g_diag;
    P.pfs = g_pf_stages == 0 ? 0 : g_pf_stages > P.nst ? g_pf_stages : P.nst; /* a chunk covers the ring's reach */
    P.fast = P.vec16 && P.sb4 && P.sdt != SDT_F32 && P.l2_block && !P.diag && !P.pfs && P.nst > 1;
    const bool partials = P.splits > 1 || P.mode == MODE_REDUCE;
    P.fold = P.mode == MODE_STORE || (long long)n_items * P.splits <= kFoldMax;
    if (partials) {
        Scratch *sc = scratch_of(st);
        grow((void **)&sc->part, &sc->part_cap, (size_t)P.splits * n_items * kMaxRows * W->n * sizeof(float), false);
        grow((void **)&sc->cnt, &sc->cnt_cap, (size_t)P.tiles * n_items * sizeof(unsigned), true);
        P.part = sc->part;
        P.cnt = sc->cnt;
    }
    const long long blocks = (long long)P.tiles * n_items * P.splits;
    KEEL_ASSERTF(blocks < (1ll << 31), "stream tile: %lld blocks", blocks);
    if (xdt == KEEL_DT_F16)
        launch_bits<true>(W->bits, P, (unsigned)blocks, st);
    else
        launch_bits<false>(W->bits, P, (unsigned)blocks, st);
    if (partials && !P.fold) {
        const long long total = (long long)P.m * W->n * (P.mode == MODE_REDUCE ? 1 : n_items);
        stream_finish<<<(unsigned)((total + 255) / 256), 256, 0, st>>>(P);
        KEEL_CUDA_CHECK_LAUNCH();
    }
}

} // namespace

#if !defined(keel_cuda_stream_matmul) /* the contract twin's copy keeps its own scratch and needs no epoch */
extern "C" unsigned keel_cuda_stream_scratch_epoch(void) { return g_epoch; }

extern "C" void keel_cuda_stream_scratch_release(void *owner) {
    const cudaStream_t st = (cudaStream_t)owner;
    for (int i = 0; i < g_n_scr; i++) {
        if (g_scr[i].st != st) continue;
        KEEL_CUDA_CHECK(cudaStreamSynchronize(st));
        if (g_scr[i].part) KEEL_CUDA_CHECK(cudaFree(g_scr[i].part));
        if (g_scr[i].cnt) KEEL_CUDA_CHECK(cudaFree(g_scr[i].cnt));
        g_scr[i] = g_scr[--g_n_scr];
        g_epoch++;
        return;
    }
}

extern "C" void keel_cuda_stream_scratch_get(void *stream, size_t part_bytes, size_t counters, float **part,
                                             unsigned **cnt) {
    KEEL_ASSERT(part && cnt);
    Scratch *sc = scratch_of((cudaStream_t)stream);
    grow((void **)&sc->part, &sc->part_cap, part_bytes, false);
    grow((void **)&sc->cnt, &sc->cnt_cap, counters * sizeof(unsigned), true);
    *part = sc->part;
    *cnt = sc->cnt;
}
#endif

extern "C" int keel_cuda_stream_splits(int n, int k, int items) {
    /* Split k when the row tiles of the `items` matrices a launch brings (the stack's hint, never the launch's list)
     * cannot give the SMs g_split_target / 4 blocks each: then that many blocks (at most that many with g_split_down),
     * slices of at least two 128-code quads. Else, with g_split_long, a slice of kLongSlice+ codes halves when twice
     * the blocks still fit the SMs. */
    const long long tiles = (long long)(n + kRowsPerBlock - 1) / kRowsPerBlock * (items > 1 ? items : 1),
                    sms = keel_cuda_sm_count(), q = g_split_target;
    /* enough blocks: a long slice still halves when both halves' blocks run in one wave (each warp's chain of
     * stages is the time of a launch that fills the chip once) */
    if (4 * tiles >= q * sms) return g_split_long && k >= kLongSlice && 2 * tiles <= blocks_per_sm() * sms ? 2 : 1;
    long long want = g_split_down ? q * sms / (4 * tiles) : (q * sms + 4 * tiles - 1) / (4 * tiles);
    const long long nq = (k + kQuad - 1) / kQuad, most = k / (2 * kQuad) > 1 ? k / (2 * kQuad) : 1;
    if (want > nq) want = nq;
    if (want > most) want = most;
    return (int)(want < 1 ? 1 : want);
}

extern "C" bool keel_cuda_stream_tune(int l2_block, int max_stages) {
    if (l2_block == -1 && max_stages == -1) {
        g_l2_block = kL2Block;
        g_max_stages = kMaxStages;
        return true;
    }
    if (l2_block < 0 || l2_block > 1 || max_stages < 2 || max_stages > kMaxStages) return false;
    g_l2_block = l2_block;
    g_max_stages = max_stages;
    return true;
}

extern "C" bool keel_cuda_stream_prefetch(int chunk_stages) {
    if (chunk_stages < 0 || chunk_stages > 64) return false;
    g_pf_stages = chunk_stages;
    return true;
}

extern "C" void keel_cuda_stream_pdl(int on) { g_pdl = on != 0; }

extern "C" bool keel_cuda_stream_pdl_active(void) { return pdl_active(); }

extern "C" void keel_cuda_stream_split_long(int on) { g_split_long = on != 0; }

extern "C" void keel_cuda_stream_split_round(int down) { g_split_down = down != 0; }

extern "C" bool keel_cuda_stream_split_target(int quarters) {
    if (quarters < 1 || quarters > 64) return false;
    g_split_target = quarters;
    return true;
}

extern "C" void keel_cuda_stream_matmul(const keel_cuda_qw *W, const void *x, keel_dtype xdt, int m, void *y,
                                        keel_dtype ydt, keel_epilogue epi, void *stream) {
    Params P = {};
    P.x = (const uint16_t *)x;
    P.m = m;
    P.mask0 = (1u << m) - 1u;
    P.y = y;
    P.last = (long long)m * W->n - 1;
    P.epi = (int)epi;
    P.mode = MODE_STORE;
    run(W, P, xdt, ydt, 1, stream);
}

extern "C" void keel_cuda_stream_matmul_rows(const keel_cuda_qw *W, const void *x, keel_dtype xdt, int m, void *y,
                                             keel_dtype ydt, keel_epilogue epi, void *stream) {
    KEEL_ASSERTF(m >= 1 && m <= KEEL_CUDA_STREAM_ROWS_MAX, "stream tile: m %d (1..%d)", m, KEEL_CUDA_STREAM_ROWS_MAX);
    if (m <= kMaxRows) {
        keel_cuda_stream_matmul(W, x, xdt, m, y, ydt, epi, stream);
        return;
    }
    Params P = {};
    P.x = (const uint16_t *)x;
    P.x_item = (long long)kMaxRows * W->k;
    P.m = kMaxRows;
    P.rows_m = m;
    P.y = y;
    P.y_item = (long long)kMaxRows * W->n;
    P.last = (long long)m * W->n - 1;
    P.epi = (int)epi;
    P.mode = MODE_STORE;
    run(W, P, xdt, ydt, (m + kMaxRows - 1) / kMaxRows, stream);
}

extern "C" void keel_cuda_stream_experts_up(const keel_cuda_qw *W1, const void *x, keel_dtype xdt, int m,
                                            const keel_cuda_route *items, int n_items, void *h, keel_dtype hdt,
                                            keel_epilogue epi, void *stream) {
    KEEL_ASSERT(items && n_items >= 1);
    Params P = {};
    P.x = (const uint16_t *)x;
    P.m = m;
    P.items = items;
    P.y = h;
    P.y_item = (long long)m * W1->n;
    P.last = (long long)n_items * m * W1->n - 1;
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
    P.rw = weights;
    P.y = y;
    P.last = (long long)m * W2->n - 1;
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

/* The contract twin includes this file with the launchers renamed: the kernel lookup is defined once, here. */
#if !defined(keel_cuda_stream_matmul)
extern "C" void keel_cuda_stream_diag(int mode) { g_diag = mode; }

extern "C" const void *keel_cuda_kernel_fn(const char *symbol) {
    static const struct {
        const char *name;
        const void *fn;
    } tab[] = {
        {"stream_tile<2,false>", (const void *)stream_tile<2, false>}, {"stream_tile<3,false>", (const void *)stream_tile<3, false>},
        {"stream_tile<4,false>", (const void *)stream_tile<4, false>}, {"stream_tile<5,false>", (const void *)stream_tile<5, false>},
        {"stream_tile<6,false>", (const void *)stream_tile<6, false>}, {"stream_tile<8,false>", (const void *)stream_tile<8, false>},
        {"stream_tile<2,true>", (const void *)stream_tile<2, true>},   {"stream_tile<3,true>", (const void *)stream_tile<3, true>},
        {"stream_tile<4,true>", (const void *)stream_tile<4, true>},   {"stream_tile<5,true>", (const void *)stream_tile<5, true>},
        {"stream_tile<6,true>", (const void *)stream_tile<6, true>},   {"stream_tile<8,true>", (const void *)stream_tile<8, true>},
        {"stream_finish", (const void *)stream_finish},                {"relu2_kernel", (const void *)relu2_kernel},
    };
    if (!symbol) return NULL;
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        if (!strcmp(tab[i].name, symbol)) return tab[i].fn;
    const void *pk = keel_cuda_packed_kernel_fn(symbol);
    return pk ? pk : keel_cuda_bench_kernel_fn(symbol);
}
#endif
