/* Packed stream tiles: the stream tile's arithmetic on a matrix repacked once into mma fragment order.
 *
 * Shape of the work (docs/stream-tiles.md, "The packed tile", has the why):
 * - keel_cuda_pack (pack.c, on the host) rewrites an MLX affine matrix (BF16 scales) tile by tile: 16 rows (the mma m16 side),
 *   then spans of 128 codes, each span a record of the 32 lanes' codes (lane (g, t): its bytes of rows g and g + 8
 *   of the span's four 32-code blocks, contiguous) followed by the rows' (scale, bias) halves. The same bytes as
 *   the source (k padded to whole spans with zeros), so one 16- or 8-byte load is a lane's fragment material.
 * - A warp streams its tiles' records straight into registers, D spans ahead, with no shared-memory ring and no
 *   per-stage bookkeeping; the block stages x (the whole k when it fits) in the ring tile's fragment order.
 * - Per 32-code block and group the warp issues exactly the ring tile's decode, mma chain and group end, so a
 *   launch equals keel_cuda_stream_matmul on the same matrix bit for bit wherever neither splits k.
 * - Few row tiles and a long k (keel_cuda_packed_splits): a kernel of its own walks each tile's k in two or four parts
 *   on as many warps of a block and adds the parts' sums in order before the epilogue.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda.h"
#include "port.h"
#include "tile.cuh"

#ifndef KEEL_PK_PLANT_DECODE
#define KEEL_PK_PLANT_DECODE(B, XF16, v, p) codes_to_pairs<B, XF16>(v, p)
#endif
#ifndef KEEL_PK_PLANT_FAST /* the 2-, 3-, 5- and 6-bit decodes from the lane words (the twin's width plant needs the generic one) */
#define KEEL_PK_PLANT_FAST() true
#endif
#ifndef KEEL_PK_PLANT_BIAS
#define KEEL_PK_PLANT_BIAS(b) (b)
#endif
#ifndef KEEL_PK_PLANT_ROWS
#define KEEL_PK_PLANT_ROWS(acc) ((void)0)
#endif
#ifndef KEEL_PK_PLANT_STORE
#define KEEL_PK_PLANT_STORE(y, i, v, bf16, last) ((void)(last), store_out(y, i, v, bf16))
#endif
#define KEEL_PACKED_PLANT_HOOKS 1

namespace {

constexpr int kPkWarps = 8;
constexpr int kPkThreads = kPkWarps * 32;
constexpr int kSpan = KEEL_CUDA_PACK_SPAN;  /* codes of a span: four 32-code blocks */
constexpr int kPkRows = KEEL_CUDA_PACK_ROWS; /* rows of a tile (the mma m16 side) */
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
#define KEEL_PK_MIN_BLOCKS 1
#else
#define KEEL_PK_MIN_BLOCKS 2
#endif

#define KEEL_PK_NO_PAIRS_SM 80 /* sm_80's ptxas spills the pair walks at 128 registers: its image leaves them out */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 10 * KEEL_PK_NO_PAIRS_SM
#define KEEL_PK_ARCH_PAIRS 0
#else
#define KEEL_PK_ARCH_PAIRS 1
#endif
#ifndef KEEL_PK_PAIRS /* whether a warp may walk two tiles side by side at width B, m = 1 (ONE), group 32 << LG */
#define KEEL_PK_PAIRS(B, ONE, LG) (KEEL_PK_ARCH_PAIRS && (B) <= ((ONE) ? 5 : 4) && (LG) >= 1)
#endif

#if defined(__HIPCC__) /* the AMD compiler keeps a third span of the parts walks in scratch */
#define KEEL_PK_PART3 0
#else
#define KEEL_PK_PART3 1
#endif

/* Per-width constants: register ring depth (D spans of each of T tiles, D - K of them in flight). Two tiles side by
 * side (two independent decode and mma chains a warp, sharing each span's x fragments) fit 128 registers where
 * KEEL_PK_PAIRS allows them. Three spans where they fit sm_90's 128 registers without spills: one tile below 5 bits,
 * two tiles at 2 bits (m = 1); in the split kernel's m = 1 walks (SPLIT) also one tile at 5-6 bits and at 8 bits with
 * one group a span, two tiles at 3 bits and at 4-5 bits with one group a span; in the parts kernel's walks (PART,
 * CUDA only) two tiles at 2 bits with one group a span. K: spans loaded as one batch every K steps (D = 2K; walk's
 * comment says why), in the split kernel's one-tile m = 1 walks at 2-3 bits. */
template <int B, int T, bool ONE, int LG, bool SPLIT = false, bool PART = false> struct PGeo {
    static constexpr bool S1 = SPLIT && ONE; /* the split kernel's m = 1 walks */
    static constexpr int K = S1 && T == 1 && B <= 3 ? 2 : 1;
    static constexpr bool P3 = (ONE && B == 2) || (KEEL_PK_PART3 && PART && B == 2 && LG == 2) ||
                               (S1 && (B == 3 || (B <= 5 && LG == 2))); /* pair walks of three spans */
    static constexpr int D = K > 1 ? 2 * K : T == 1 ? (B < 5 || (S1 && (B <= 6 || LG == 2)) ? 3 : 2) : P3 ? 3 : 2;
    /* steps a walk's loop unrolls: 2D in the split kernel's three-span m = 1 walks at 4-8 bits (but 5 bits group
     * 128), where ptxas then waits every other step; D elsewhere */
    static constexpr int U = S1 && K == 1 && D == 3 && B >= 4 && !(B == 5 && LG == 2) ? 2 * D : D;
};

/* log2 of the group's 32-code blocks: the compile-time walk a group takes */
__host__ __device__ __forceinline__ int pk_lg(int group) { return group == 32 ? 0 : group == 64 ? 1 : 2; }

struct PParams {
    const uint8_t *w;       /* packed records */
    int n, k, kp, group;    /* kp: k padded to whole spans */
    int ns, tiles;          /* spans per tile, tiles */
    int rec;                /* bytes of a span record */
    const uint16_t *x;
    int m;
    void *y;
    int ydt_bf16, epi;
    long long last;         /* index of the last output element */
    int xk;                 /* codes of an x-chunk (a multiple of kSpan; kp when the whole k fits) */
    int pairs;              /* a warp walks two tiles side by side (units of two tiles) */
    int split;              /* k in parts (pk_splits: 2 or 4, else 0; layouts: packed_split); xk: a region's chunk */
    float *part;            /* (tiles, split, 32 lanes, 4) the parts' sums when parts run on blocks of their own */
    unsigned *cnt;          /* (tiles) parts arrived, zero between launches */
    int sstr, tstr, pstr;   /* split walks: bytes from a tile's span record to its next span's, from tile 2p's to tile
                               2p + 1's and from pair p's to pair p + 1's (keel_cuda_pack_at: tile- or span-major) */
};

#ifndef KEEL_PK_SPLIT_KERNEL /* the k-in-parts kernel is built (the contract twin leaves it out) */
#define KEEL_PK_SPLIT_KERNEL 1
#endif
/* the unsplit walk steps by P's strides and so reads span-major packs: only where no split kernel takes them (the twin) */
constexpr bool kPkUnsplitStrides = !KEEL_PK_SPLIT_KERNEL;

/* The parts the packed tile walks k in: 2 where few row tiles and a long k would leave most of the chip idle with one
 * warp a tile, 4 where k is twice as long again (a warp then walks two tiles' quarters side by side where the width
 * allows pairs: as many walks as halves, two chains each), else 1; a function of the shape and the chip's SM count
 * alone, so never of m or the grid. */
int pk_splits(int n, int k) {
    const int ns = (k + kSpan - 1) / kSpan, tiles = (n + kPkRows - 1) / kPkRows;
    if (!KEEL_PK_SPLIT_KERNEL || ns % 2 != 0 || ns < 64 || 2LL * tiles > 16LL * keel_cuda_sm_count()) return 1;
    return ns % 4 == 0 && ns >= 128 ? 4 : 2;
}

thread_local int pk_last_walk; /* KEEL_CUDA_PK_WALK_* of this host thread's last launch */
int pk_xbytes = KEEL_CUDA_PACKED_XBUDGET_AUTO; /* x a block stages at most (longer k: chunks); keel_cuda_packed_xbudget */


/* Item i (block i / 2, row g + 8 (i % 2)) of a lane's span codes as the ring tile's thread bytes (LSB first);
 * i is a constant wherever the loops unroll. At 2 bits the pack interleaves a block's two items (a0 b0 a1 b1,
 * KEEL_CUDA_PACK_BYTE): the byte permute, its own inverse, gives them back. */
template <int B> __device__ __forceinline__ unsigned long long item_at(const uint32_t c[2 * B], int i) {
    const int o = i * B, w = o / 4, ob = o % 4;
    if (B == 2) return __byte_perm(c[i / 2], 0u, 0x3120u) >> (16 * (i % 2));
    if (B == 4) return c[i];
    if (B == 8) return (unsigned long long)c[2 * i + 1] << 32 | c[2 * i];
    if (ob + B <= 4) return c[w] >> (8 * ob);
    return ((unsigned long long)c[w + 1] << 32 | c[w]) >> (8 * ob);
}

/* A lane's span: codes (2B words) and its row pair's (scale, bias) halves (2 words a group, up to 4 groups). */
template <int B> struct Span {
    uint32_t c[2 * B];
    uint32_t s[8];
};

/* LGPS: log2 of the span's groups (0..2). */
template <int B, int LGPS> __device__ __forceinline__ void load_span(Span<B> &S, const uint8_t *rec, int lane) {
    const uint8_t *pc = rec + lane * KEEL_CUDA_PACK_CHUNK(B); /* chunk i at pc + 32 * chunk * i */
    if constexpr (B % 2 == 0) {
#pragma unroll
        for (int i = 0; i < B / 2; i++) {
            const uint4 v = kp_ldg16_stream(pc + 512 * i);
            S.c[4 * i] = v.x, S.c[4 * i + 1] = v.y, S.c[4 * i + 2] = v.z, S.c[4 * i + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < B; i++) {
            const uint2 v = kp_ldg8_stream(pc + 256 * i);
            S.c[2 * i] = v.x, S.c[2 * i + 1] = v.y;
        }
    }
    const uint8_t *ps = rec + 256 * B + (lane >> 2) * (8 << LGPS);
    if constexpr (LGPS == 0) {
        const uint2 v = kp_ldg8(ps);
        S.s[0] = v.x, S.s[1] = v.y;
    } else {
        const uint4 v = kp_ldg16(ps);
        S.s[0] = v.x, S.s[1] = v.y, S.s[2] = v.z, S.s[3] = v.w;
        if constexpr (LGPS == 2) {
            const uint4 u = kp_ldg16(ps + 16);
            S.s[4] = u.x, S.s[5] = u.y, S.s[6] = u.z, S.s[7] = u.w;
        }
    }
}

/* A 6-bit item (8 codes, 6 bytes from byte OB of lo:hi) as codes_to_pairs<6>'s operand words: bytes 0,1,3,4 hold
 * codes 0, 1 | 4, 5 at bits 0, 6 | 16, 22, and bytes 1,2,4,5 codes 2, 3 | 6, 7 at 4, 10 | 20, 26 (moved down 4). */
template <bool XF16, int OB> __device__ __forceinline__ void six_to_pairs(uint32_t lo, uint32_t hi, uint32_t p[4]) {
    constexpr uint32_t sx = OB | (OB + 1) << 4 | (OB + 3) << 8 | (OB + 4) << 12;
    constexpr uint32_t sy = (OB + 1) | (OB + 2) << 4 | (OB + 4) << 8 | (OB + 5) << 12;
    wide_to_pairs<6, XF16>(__byte_perm(lo, hi, sx), __byte_perm(lo, hi, sy) >> 4, p);
}

/* Bits [n, n + 32) of hi:lo, zeros below bit 0 (n in -31..63, constant wherever the span's loop unrolls). */
__device__ __forceinline__ uint32_t bits_at(uint32_t lo, uint32_t hi, int n) {
    return n < 0 ? lo << -n : n == 0 ? lo : n < 32 ? __funnelshift_r(lo, hi, n) : hi >> (n - 32);
}

/* A 3-bit item (8 codes, 3 bytes from byte ob of lo:hi) as codes_to_pairs<3>'s operand words: codes 0-3 are bits
 * 0-11 of the item, codes 4-7 bits 12-23, so one select of the item and the item moved up 4 bits. */
template <bool XF16> __device__ __forceinline__ void three_to_pairs(uint32_t lo, uint32_t hi, int ob, uint32_t p[4]) {
    halves_to_pairs<3, XF16>(__byte_perm(bits_at(lo, hi, 8 * ob), bits_at(lo, hi, 8 * ob - 4), 0x7610u), p);
}

/* A 5-bit item (8 codes, 5 bytes from byte ob of lo:hi) as codes_to_pairs<5>'s operand words: codes 0, 1 | 4, 5
 * are bits 0-9 | 20-29 of the item, codes 2, 3 | 6, 7 bits 10-19 | 30-39; each half-word pair is one select. */
template <bool XF16> __device__ __forceinline__ void five_to_pairs(uint32_t lo, uint32_t hi, int ob, uint32_t p[4]) {
    const int b = 8 * ob;
    wide_to_pairs<5, XF16>(__byte_perm(bits_at(lo, hi, b), bits_at(lo, hi, b + 4), 0x7610u),
                           __byte_perm(bits_at(lo, hi, b + 10), bits_at(lo, hi, b + 14), 0x7610u), p);
}

/* The operand words of block jb of a lane's span: items 2jb (pa) and 2jb + 1 (pb). */
template <int B, bool XF16>
__device__ __forceinline__ void block_pairs(const Span<B> &S, int jb, uint32_t pa[4], uint32_t pb[4]) {
    if (B == 2 && KEEL_PK_PLANT_FAST()) { /* word jb holds (a0 b0 a1 b1), the pack's order: both items' halves */
        const uint32_t w = S.c[jb];
        halves_to_pairs<2, XF16>(w, pa);
        halves_to_pairs<2, XF16>(w >> 8, pb);
    } else if (B == 3 && KEEL_PK_PLANT_FAST()) { /* item i at byte 3i */
        const int oa = 6 * jb, ob = 6 * jb + 3;
        three_to_pairs<XF16>(S.c[(oa / 4) % (2 * B)], S.c[(oa / 4 + 1) % (2 * B)], oa % 4, pa);
        three_to_pairs<XF16>(S.c[(ob / 4) % (2 * B)], S.c[(ob / 4 + 1) % (2 * B)], ob % 4, pb);
    } else if (B == 5 && KEEL_PK_PLANT_FAST()) { /* item i at byte 5i */
        const int oa = 10 * jb, ob = 10 * jb + 5;
        five_to_pairs<XF16>(S.c[(oa / 4) % (2 * B)], S.c[(oa / 4 + 1) % (2 * B)], oa % 4, pa);
        five_to_pairs<XF16>(S.c[(ob / 4) % (2 * B)], S.c[(ob / 4 + 1) % (2 * B)], ob % 4, pb);
    } else if (B == 6 && KEEL_PK_PLANT_FAST()) { /* item 2jb at byte 12jb, item 2jb + 1 at 12jb + 6 */
        six_to_pairs<XF16, 0>(S.c[(3 * jb) % (2 * B)], S.c[(3 * jb + 1) % (2 * B)], pa);
        six_to_pairs<XF16, 2>(S.c[(3 * jb + 1) % (2 * B)], S.c[(3 * jb + 2) % (2 * B)], pb);
    } else {
        KEEL_PK_PLANT_DECODE(B, XF16, item_at<B>(S.c, 2 * jb), pa);
        KEEL_PK_PLANT_DECODE(B, XF16, item_at<B>(S.c, 2 * jb + 1), pb);
    }
}

/* One span of T tiles of a warp's 16 rows each: per group of 2^LG blocks (1, 2 or 4) the ring tile's two mma per
 * block and its group end, the tiles' chains interleaved. xb: x fragments of the span's first block for this
 * thread's x row (xsw: that row's pair swap); xsa/xsb: x sums of its columns' first group. ONE (m = 1): the odd
 * columns' group ends are left out. */
template <int B, bool XF16, bool ONE, int LG, int T>
__device__ __forceinline__ void span_body(const Span<B> *Sp, const uint4 *xb, int xsw, const float *xsa,
                                          const float *xsb, float (*accp)[4]) {
    float Sms[T][4];
#pragma unroll
    for (int u = 0; u < T; u++) Sms[u][0] = Sms[u][1] = Sms[u][2] = Sms[u][3] = 0.f;
#pragma unroll
    for (int jb = 0; jb < 4; jb++) {
        uint32_t pas[T][4], pbs[T][4];
#pragma unroll
        for (int u = 0; u < T; u++) block_pairs<B, XF16>(Sp[u], jb, pas[u], pbs[u]);
        const uint4 xv = xb[jb * 4 + ((jb & 1) ? -xsw : xsw)]; /* xf_at's pair swap of odd rows */
        const uint32_t b0[2] = {xv.x, xv.y}, b1[2] = {xv.z, xv.w};
#pragma unroll
        for (int u = 0; u < T; u++) {
            const uint32_t *pa = pas[u], *pb = pbs[u];
            const uint32_t a0[4] = {pa[0], pb[0], pa[1], pb[1]}, a1[4] = {pa[2], pb[2], pa[3], pb[3]};
            kp_mma_16816<XF16>(Sms[u], a0, b0);
            kp_mma_16816<XF16>(Sms[u], a1, b1);
        }
        if (((jb + 1) & ((1 << LG) - 1)) != 0) continue; /* the group goes on */
        const int gs = jb >> LG;
#pragma unroll
        for (int u = 0; u < T; u++) {
            const Span<B> &S = Sp[u];
            float *Sm = Sms[u], *acc = accp[u];
            /* (scale, bias) of rows g and g + 8: register indices constant for every group size */
            const uint32_t w0 = S.s[2 * gs], w1 = S.s[2 * gs + 1];
            const float s0 = kp_bf16_to_f32(w0 & 0xffffu), b0v = kp_bf16_to_f32(w0 >> 16);
            const float s1 = kp_bf16_to_f32(w1 & 0xffffu), b1v = kp_bf16_to_f32(w1 >> 16);
            const float xs0 = xsa[gs * kXsw<B>], os0 = place_sum<B, XF16>(xsa, gs);
            Sm[0] = offset_out<B, XF16>(Sm[0], xs0, os0); /* the codes' offset out */
            Sm[2] = offset_out<B, XF16>(Sm[2], xs0, os0);
            acc[0] = __fmaf_rn(KEEL_PK_PLANT_BIAS(b0v), xs0, __fmaf_rn(s0, Sm[0], acc[0]));
            acc[2] = __fmaf_rn(KEEL_PK_PLANT_BIAS(b1v), xs0, __fmaf_rn(s1, Sm[2], acc[2]));
            if constexpr (!ONE) {
                const float xs1 = xsb[gs * kXsw<B>], os1 = place_sum<B, XF16>(xsb, gs);
                Sm[1] = offset_out<B, XF16>(Sm[1], xs1, os1);
                Sm[3] = offset_out<B, XF16>(Sm[3], xs1, os1);
                acc[1] = __fmaf_rn(KEEL_PK_PLANT_BIAS(b0v), xs1, __fmaf_rn(s0, Sm[1], acc[1]));
                acc[3] = __fmaf_rn(KEEL_PK_PLANT_BIAS(b1v), xs1, __fmaf_rn(s1, Sm[3], acc[3]));
            }
            Sm[0] = Sm[1] = Sm[2] = Sm[3] = 0.f;
        }
    }
}

/* Stores a finished tile's outputs (rows g and g + 8, activation rows 2t and 2t + 1 where live). */
__device__ __forceinline__ void store_tile(const PParams &P, int tile, int lane, float acc[4]) {
    KEEL_PK_PLANT_ROWS(acc);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int r = 2 * t + (e & 1), row = tile * kPkRows + g + 8 * (e >> 1);
        if (r >= P.m || row >= P.n) continue;
        const float v = P.epi == KEEL_EPI_RELU2 ? relu2(acc[e]) : acc[e];
        KEEL_PK_PLANT_STORE(P.y, (long long)r * P.n + row, v, P.ydt_bf16, P.last);
    }
}

/* Leaves this block's part (blockIdx.x mod split, split 2 or 4) of a finished tile's sums in the launch's scratch
 * (parts_meet adds them). */
__device__ __forceinline__ void part_put(const PParams &P, int tile, int lane, const float acc[4]) {
    if (tile >= P.tiles) return; /* a unit's second tile past the last one */
    float *mine = P.part + ((size_t)tile * P.split + (blockIdx.x & (P.split - 1))) * 128 + lane * 4;
    *(float4 *)mine = make_float4(acc[0], acc[1], acc[2], acc[3]);
}

/* After a warp's walk put its parts of tiles T * (u0 + j * step) + u (j < nt): counts each tile's arrived parts, and
 * the tile's last part to arrive adds them in order (((first + second) + third) + fourth), as packed_split does, and
 * stores. Out of the walk, so the walk's registers stay those of the unsplit kernel. */
template <int T> __device__ __forceinline__ void parts_meet(const PParams &P, int u0, int step, int nt, int lane) {
    const unsigned S = (unsigned)P.split;
    __threadfence(); /* this lane's parts, before the count */
    for (int j = 0; j < nt; j++)
        for (int u = 0; u < T; u++) {
            const int tile = T * (u0 + j * step) + u;
            if (tile >= P.tiles) continue;
            unsigned got = kp_shfl(0u, 0); /* every lane's fence before the count */
            if (lane == 0) {
                got = atomicAdd(P.cnt + tile, 1u) + 1u;
                if (got == S) P.cnt[tile] = 0u; /* all arrived: zero again for the next launch */
            }
            if (kp_shfl(got, 0) != S) continue;
            __threadfence();
            const float *all = P.part + (size_t)tile * S * 128 + lane * 4;
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; e++) v[e] = kp_ldcg_f32(all + e);
            for (unsigned q = 1; q < S; q++)
#pragma unroll
                for (int e = 0; e < 4; e++) v[e] = __fadd_rn(v[e], kp_ldcg_f32(all + q * 128 + e));
            store_tile(P, tile, lane, v);
        }
}

/* A warp's walk over spans [s0, s1) of its units u0, u0 + step, ... (nt of them; unit u is tiles Tu..Tu + T - 1,
 * a tile past the last one reads tile Tu and stores nothing), its ring of D spans a tile (PGeo) running across unit
 * boundaries. The x-chunk in shared memory starts at span s0. Stores each tile when `final`; otherwise (one unit,
 * a chunk of its k) leaves its sums in acc. SPLIT: packed_split's walk (its ring depth, PGeo). ptxas gives every
 * weight load of the ring one scoreboard, so a wait for the oldest span waits for all in flight; with K > 1 the
 * walk loads K spans at once every K steps, after the wait for the current one, so each load has K steps to land.
 * hook: called once the first spans are loading, and by a warp with nothing to walk (it may be block-wide). */
template <int B, bool XF16, bool ONE, int LG, int T, bool PART, bool SPLIT, class Hook>
__device__ __forceinline__ void walk(const PParams &P, int u0, int step, int nt, int s0, int s1, bool final,
                                     const uint4 *xf, const float *xs, int nblk, int ngc, int lane,
                                     float (*acc)[4], const Hook &hook) {
    using G = PGeo<B, T, ONE, LG, SPLIT, PART>;
    constexpr int D = G::D, K = G::K, U = G::U;
    const int nsp = s1 - s0, total = nt * nsp;
    if (total <= 0) {
        hook(); /* block-wide: every warp calls it */
        return;
    }
    const int g = lane >> 2, t = lane & 3;
    const int gx = g < P.m ? g : 0, r0 = 2 * t < P.m ? 2 * t : 0, r1 = 2 * t + 1 < P.m ? 2 * t + 1 : 0;
    const uint4 *xrow = xf + gx * nblk * 4 + t;
    const int xsw = ONE ? 0 : (gx & 1) * 4;
    const float *xsa0 = xs + r0 * xs_stride<B>(ngc), *xsb0 = xs + r1 * xs_stride<B>(ngc);
    Span<B> buf[D][T];
    /* the load cursor: its record pointer and the spans left in its unit (a count, no tile arithmetic a span). The
     * unsplit kernel's walks take tile-major matrices (keel_cuda_pack_upload), a unit's second tile tstride on (0
     * when past the last tile); the split walks take either layout through P's strides, a second tile past the last
     * one reading the pack's zero tile, and units step apart (step even, or 0); so does the unsplit walk where
     * kPkUnsplitStrides */
    constexpr bool kSplitWalk = SPLIT || PART || kPkUnsplitStrides;
    const long long tstride = kSplitWalk ? 0LL : (long long)P.ns * P.rec; /* the unsplit walk's tile stride */
    const long long tjump = kSplitWalk ? (long long)(T * step / 2) * P.pstr - (long long)nsp * P.sstr
                                       : (long long)T * step * tstride - (long long)nsp * P.rec;
    const uint8_t *lp = kSplitWalk
                            ? P.w + (long long)(T * u0 / 2) * P.pstr + (T * u0 % 2) * P.tstr + (long long)s0 * P.sstr
                            : P.w + (long long)T * u0 * tstride + (long long)s0 * P.rec;
    int lleft = nsp, lu = u0;
    auto second = [&](int u) { return T > 1 && T * u + 1 < P.tiles ? tstride : 0LL; };
    long long loff = kSplitWalk ? 0LL : second(u0);
    auto load = [&](Span<B> *S) {
        if constexpr (kSplitWalk) {
#pragma unroll
            for (int u = 0; u < T; u++) load_span<B, 2 - LG>(S[u], lp + u * P.tstr, lane);
            lp += P.sstr;
            if (--lleft == 0) {
                lp += tjump;
                lleft = nsp;
            }
        } else {
#pragma unroll
            for (int u = 0; u < T; u++) load_span<B, 2 - LG>(S[u], lp + u * loff, lane);
            lp += P.rec;
            if (--lleft == 0) {
                lp += tjump;
                lleft = nsp;
                lu += step;
                loff = second(lu);
            }
        }
    };
    constexpr int HA = Hook::kAfter < D - K ? Hook::kAfter : D - K; /* spans in flight when the hook runs */
#pragma unroll
    for (int d = 0; d < HA; d++)
        if (d < total) load(buf[d]);
    hook(); /* x put in order while the first spans are on their way */
#pragma unroll
    for (int d = HA; d < D - K; d++)
        if (d < total) load(buf[d]);
    /* the compute cursor: the unit's ordinal, the spans left in it, its x fragments and x sums */
    int ct = 0, cleft = nsp;
    const uint4 *xp = xrow;
    const float *xsa = xsa0, *xsb = xsb0;
    for (int q0 = 0; q0 < total; q0 += U) {
#pragma unroll
        for (int dd = 0; dd < U; dd++) {
            const int d = dd % D, q = q0 + dd;
#if defined(__HIPCC__) /* HIP keeps the unrolled steps' buffer indices constant (no scratch) only without a break */
            if (q < total) {
#else
            if (q >= total) break;
            {
#endif
                if (d % K == 0) { /* spans q + D - K .. q + D - 1 into the slots of the K spans before q */
                    /* K > 1: a zero (ydt_bf16 is 0 or 1) the compiler cannot prove, from this span's codes, so the
                     * batch's loads go out after this span's wait and that wait does not cover them */
                    if constexpr (K > 1) lp += buf[d][0].c[0] & ((uint32_t)P.ydt_bf16 >> 1);
#pragma unroll
                    for (int j = 0; j < K; j++)
                        if (q + D - K + j < total) load(buf[(d + D - K + j) % D]);
                }
                span_body<B, XF16, ONE, LG, T>(buf[d], xp, xsw, xsa, xsb, acc);
                xp += 16, xsa += (4 >> LG) * kXsw<B>, xsb += (4 >> LG) * kXsw<B>; /* four blocks: 16 fragments, 4 / 2^LG groups */
                if (--cleft == 0) {
                    cleft = nsp;
                    xp = xrow, xsa = xsa0, xsb = xsb0;
                    if (final) {
#pragma unroll
                        for (int u = 0; u < T; u++) {
                            if constexpr (PART)
                                part_put(P, T * (u0 + ct * step) + u, lane, acc[u]);
                            else
                                store_tile(P, T * (u0 + ct * step) + u, lane, acc[u]);
                            acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.f;
                        }
                    }
                    ++ct;
                }
            }
        }
    }
}

/* The per-group sums of the R regions' staged x (stage_xsum each), then a barrier. */
template <int B, bool XF16>
__device__ __forceinline__ void sum_parts(const PParams &P, int R, int lenp, const uint4 *smem, size_t xfn, float *xs0,
                                          size_t xsn) {
    for (int h = 0; h < R; h++) stage_xsum<kPkThreads, B, XF16>(P.m, P.group, lenp, smem + h * xfn, xs0 + h * xsn);
    __syncthreads();
}

/* Stages chunk c (lenp codes a region) of each of the R regions' x side by side (region h from span h * hs),
 * then their per-group sums. */
template <int B, bool XF16>
__device__ __forceinline__ void stage_parts(const PParams &P, int R, int hs, int c, int lenp, uint4 *smem, size_t xfn,
                                            float *xs0, size_t xsn) {
    const int xsp = P.xk / kSpan;
    __syncthreads();
    for (int h = 0; h < R; h++) {
        const int c0 = (h * hs + c * xsp) * kSpan;
        stage_x<kPkThreads>(P.m, P.k, P.x, 0xffu, c0, min(lenp, P.k - c0), lenp, smem + h * xfn);
    }
    __syncthreads();
    sum_parts<B, XF16>(P, R, lenp, smem, xfn, xs0, xsn);
}

/* Widths whose split walks take XOrder without spills: not 6 bits (sm_90) and none in sm_80's image. */
template <int B> constexpr bool kPkEarly = KEEL_PK_ARCH_PAIRS && B != 6;
/* The unsplit and parts kernels' walks that take XOrder: not the m = 1 pair walks (slower with it) but at 5 bits
 * (sm_90 spills the bf16 5-bit kernel without it), and where sm_90 spills with it not the 4-bit pair and parts walks,
 * the 3-bit bf16 parts walks and the 2-bit bf16 unsplit pair walks; none in sm_80's image. */
template <int B, bool XF16, bool ONE, int T, bool PART>
constexpr bool kPkEarlyRun = KEEL_PK_ARCH_PAIRS && !(ONE && T == 2 && B != 5) && !(B == 4 && (T == 2 || PART)) &&
                             !(!XF16 && B == 3 && PART) && !(!XF16 && B == 2 && T == 2 && !PART);

/* Whether x may be copied asynchronously: 16-byte aligned, and so is every row (its regions start at whole spans). */
__device__ __forceinline__ bool x_async_ok(const PParams &P) {
    return ((uintptr_t)P.x & 15u) == 0 && (P.m == 1 || P.k % 8 == 0);
}

/* The first half of stage_x (m rows, m a constant 1 where the caller knows it): each thread copies its uint4s of
 * x-chunk [c0, c0 + len) asynchronously straight to their places xf_at(row, block, t) (at m = 1 the natural uint4
 * index) and zeros the padding; XOrder puts each slot's words in fragment order. */
__device__ __forceinline__ void copy_x(const PParams &P, int m, int c0, int len, int lenp, uint4 *xf) {
    const int nblk = lenp / 32, nunits = m * nblk * 4, lblk = len / 32;
    for (int d = threadIdx.x; d < nunits; d += kPkThreads) {
        const int q = d >> 2, r = m == 1 ? 0 : q / nblk, j = (q - r * nblk) ^ (r & 1);
        if (j < lblk) kp_cp_async16(xf + d, P.x + (long long)r * P.k + c0 + 32 * j + 8 * (d & 3));
        else xf[d] = make_uint4(0u, 0u, 0u, 0u);
    }
}

/* copy_x of each of the R regions' chunk (region h from span h * hs), one commit. */
__device__ __forceinline__ void copy_parts(const PParams &P, int m, int R, int hs, int lenp, uint4 *smem, size_t xfn) {
    for (int h = 0; h < R; h++) {
        const int c0 = h * hs * kSpan;
        copy_x(P, m, c0, max(0, min(lenp, P.k - c0)), lenp, smem + h * xfn);
    }
    kp_cp_commit();
}

/* The second half, called by the walk once its first spans are loading (every warp of the block calls it): waits
 * for this thread's copies, puts its own uint4s in fragment order (xf_order) in place, then the per-group sums. The
 * R regions of whole x (P.xk codes each, their sums after them: pk_smem_bytes) are found from P alone, so the walk
 * holds no registers for them across its first loads. */
template <int B, bool XF16, bool ONE, int R> struct XOrder {
    static constexpr int kAfter = R > 1 ? 1 << 20 : 1; /* the walk's spans in flight before it: all D - K, or one */
    const PParams &P;
    uint4 *smem;
    bool on;
    __device__ __forceinline__ void operator()() const {
        if (!on) return;
        const int m = ONE ? 1 : P.m, nunits = m * P.xk / 8;
        const size_t xfn = (size_t)m * P.xk / 8, xsn = (size_t)m * xs_stride<B>(P.xk / P.group);
        kp_cp_wait<0>();
        for (int h = 0; h < R; h++)
            for (int e = threadIdx.x; e < nunits; e += kPkThreads) {
                uint4 *q = smem + h * xfn + e;
                const uint4 v = *q;
                *q = xf_order(v.x, v.y, v.z, v.w);
            }
        __syncthreads();
        sum_parts<B, XF16>(P, R, P.xk, smem, xfn, (float *)(smem + R * xfn), xsn);
    }
};

/* PART: k in P.split parts on blocks of their own (the grid a multiple of split): block b walks part b % split of its
 * units, staging that part of x alone, and parts_meet adds the parts; else each block walks all of k. */
template <int B, bool XF16, bool ONE, int LG, int T, bool PART>
__device__ __forceinline__ void packed_run(const PParams &P, uint4 *xf, float *xs) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ls = P.split >> 1; /* PART: log2 of split (2 or 4) */
    const int bi = PART ? blockIdx.x >> ls : blockIdx.x, nb = PART ? gridDim.x >> ls : gridDim.x;
    const int kr = PART ? P.kp >> ls : P.kp, sr = PART ? (blockIdx.x & (P.split - 1)) * (P.ns >> ls) : 0; /* codes, first span */
    const int nchunk = (kr + P.xk - 1) / P.xk, spc = P.xk / kSpan, units = (P.tiles + T - 1) / T;
    const bool whole = nchunk == 1; /* x staged once, each warp walks all its units; else one unit a round */
    const bool early = kPkEarlyRun<B, XF16, ONE, T, PART> && whole && x_async_ok(P); /* x copied, then ordered by the walk */
    /* whole: warp slots block-minor, so a grid with fewer units than warps keeps every block (and SM) busy */
    const int nw = nb * kPkWarps, gw = whole ? warp * nb + bi : bi * kPkWarps + warp;
    float acc[T][4];
#pragma unroll
    for (int u = 0; u < T; u++) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.f;
    kp_grid_wait(); /* x (and the scratch) belong to the previous kernel until now */
    for (int base = bi * kPkWarps; base < (whole ? bi * kPkWarps + 1 : units); base += nw) {
        const int unit = whole ? gw : base + warp;
        const int nt = whole ? (gw < units ? (units - gw + nw - 1) / nw : 0) : unit < units;
        for (int c = 0; c < nchunk; c++) {
            const int c0 = sr * kSpan + c * P.xk, lenp = min(P.xk, kr - c * P.xk), len = max(0, min(lenp, P.k - c0));
            if (early) { /* whole x: one round, one walk call a warp, which puts x in order after its first loads */
                copy_x(P, ONE ? 1 : P.m, c0, len, lenp, xf);
                kp_cp_commit();
            } else {
                __syncthreads();
                stage_x<kPkThreads>(P.m, P.k, P.x, 0xffu, c0, len, lenp, xf);
                __syncthreads();
                stage_xsum<kPkThreads, B, XF16>(P.m, P.group, lenp, xf, xs);
                __syncthreads();
            }
            const XOrder<B, XF16, ONE, 1> hook = {P, xf, early}; /* lenp is P.xk where early */
            walk<B, XF16, ONE, LG, T, PART, false, XOrder<B, XF16, ONE, 1>>(P, unit, nw, nt, sr + c * spc,
                                                                     sr + c * spc + lenp / kSpan, c == nchunk - 1, xf,
                                                                     xs, lenp / 32, lenp / P.group, lane, acc, hook);
        }
        if constexpr (PART) parts_meet<T>(P, unit, nw, nt, lane);
    }
}

/* k in S parts (P.split: 2 or 4, its own kernel) at m = 1 (m > 1: packed_run's parts on blocks of their own); each
 * part's sum runs over its spans from zero, and the parts add in a fixed order (((first + second) + third) + fourth)
 * before the first warp stores, so the bits never depend on m, T, the chunking, the layout or the grid. Two layouts
 * of a block's 8 warps:
 * - T = 2 (quarters at m = 1 with whole x, widths with pairs): warps slot, slot + 2, ... walk the 4 parts of unit
 *   base + slot (two tiles side by side), each part's x staged once side by side;
 * - T = 1: warps slot and slot + 4 walk the first and the second half of tile base + slot through their halves'
 *   x-chunks, each half as S / 2 parts (at a part's start the sum so far goes to shared memory and the walk restarts
 *   from zero). */
template <int B, bool XF16, bool ONE, int LG, int T>
__device__ __forceinline__ void packed_split(const PParams &P, uint4 *smem) {
    constexpr int R = T == 2 ? 4 : 2; /* x regions and warps a unit */
    /* parts a warp walks: 1, or 2 (quarters, T = 1); T = 2 walks one part through whole x (launcher) */
    const int S = T == 2 ? 4 : P.split, slots = kPkWarps / R, per = T == 2 ? 1 : S / R;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, reg = warp / slots, slot = warp % slots;
    const int units = (P.tiles + T - 1) / T, hs = P.ns / R, hq = P.ns / S, xsp = P.xk / kSpan;
    const int nchunk = T == 2 ? 1 : (hs + xsp - 1) / xsp, gps = (4 >> LG) * kXsw<B>; /* x-sum floats a span */
    const size_t xfn = (size_t)P.m * P.xk / 8, xsn = (size_t)P.m * xs_stride<B>(P.xk / P.group); /* a chunk's uint4s, sums */
    float *xs0 = (float *)(smem + R * xfn);
    float *psum = xs0 + R * xsn; /* (R regions, slots, 32 lanes, per, T, 4) the parts' sums */
    kp_grid_wait(); /* x belongs to the previous kernel until now */
    /* one chunk: staged once; at m = 1 copied asynchronously and put in order by the first walk after its first loads */
    const bool early = kPkEarly<B> && nchunk == 1 && P.m == 1 && x_async_ok(P);
    if (early) copy_parts(P, 1, R, hs, P.xk, smem, xfn);
    else if (nchunk == 1) stage_parts<B, XF16>(P, R, hs, 0, P.xk, smem, xfn, xs0, xsn);
    bool pending = early; /* the first walk call of the block's first round puts x in order */
    for (int base = blockIdx.x * slots; base < units; base += gridDim.x * slots) {
        const int unit = base + slot, bq = reg * hs + hq; /* bq: the second part's first span (per = 2) */
        float *mine = psum + ((size_t)(reg * slots + slot) * 32 + lane) * per * T * 4; /* this warp's parts */
        float acc[T][4];
#pragma unroll
        for (int u = 0; u < T; u++) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.f;
        for (int c = 0; c < nchunk; c++) {
            const int lenp = min(P.xk, (hs - c * xsp) * kSpan), s0 = reg * hs + c * xsp, s1 = s0 + lenp / kSpan;
            if (nchunk > 1) stage_parts<B, XF16>(P, R, hs, c, lenp, smem, xfn, xs0, xsn);
            /* the chunk's spans in segments that end at the second part's start (one walk call: inlined once) */
            for (int a = s0, e; a < s1; a = e) {
                e = per == 2 && a < bq && bq < s1 ? bq : s1;
                if (per == 2 && a == bq) { /* the first part's sum is kept in shared memory; the second from zero */
#pragma unroll
                    for (int u = 0; u < T; u++)
#pragma unroll
                        for (int v = 0; v < 4; v++) mine[u * 4 + v] = acc[u][v], acc[u][v] = 0.f;
                }
                const XOrder<B, XF16, ONE, R> hook = {P, smem, pending};
                pending = false;
                walk<B, XF16, ONE, LG, T, false, true, XOrder<B, XF16, ONE, R>>(P, unit, 0, unit < units, a, e, false,
                                                       smem + reg * xfn + (a - s0) * 16, xs0 + reg * xsn + (a - s0) * gps,
                                                       lenp / 32, lenp / P.group, lane, acc, hook);
            }
        }
        if (reg) {
#pragma unroll
            for (int u = 0; u < T; u++)
#pragma unroll
                for (int v = 0; v < 4; v++) mine[(per - 1) * T * 4 + u * 4 + v] = acc[u][v];
        }
        __syncthreads();
        if (!reg && unit < units) {
            if (per == 2) {
#pragma unroll
                for (int u = 0; u < T; u++)
#pragma unroll
                    for (int v = 0; v < 4; v++) acc[u][v] = __fadd_rn(mine[u * 4 + v], acc[u][v]);
            }
            for (int q = per; q < S; q++) { /* the later parts in order */
                const float *o = mine + ((size_t)(q / per) * slots * 32 * per + q % per) * T * 4;
#pragma unroll
                for (int u = 0; u < T; u++)
#pragma unroll
                    for (int v = 0; v < 4; v++) acc[u][v] = __fadd_rn(acc[u][v], o[u * 4 + v]);
            }
#pragma unroll
            for (int u = 0; u < T; u++) store_tile(P, T * unit + u, lane, acc[u]);
        }
        __syncthreads(); /* psum is read before the next round writes it */
    }
}

template <int B, bool XF16, bool ONE, bool PART>
__device__ __forceinline__ void run_lg(const PParams &P, int lg, uint4 *xf, float *xs) {
    /* one switch (an if-chain here left sm_90's 4-bit kernel 4-8 bytes of spills); the launcher sets P.pairs only
     * where KEEL_PK_PAIRS(B, ONE, lg) holds, so lg 0 never pairs */
    switch (lg + 3 * (P.pairs != 0)) {
    case 0: packed_run<B, XF16, ONE, 0, 1, PART>(P, xf, xs); break;
    case 1: packed_run<B, XF16, ONE, 1, 1, PART>(P, xf, xs); break;
    case 2: packed_run<B, XF16, ONE, 2, 1, PART>(P, xf, xs); break;
    case 4: if (KEEL_PK_PAIRS(B, ONE, 1)) packed_run<B, XF16, ONE, 1, 2, PART>(P, xf, xs); break;
    default: if (KEEL_PK_PAIRS(B, ONE, 2)) packed_run<B, XF16, ONE, 2, 2, PART>(P, xf, xs); break;
    }
}

template <int B, bool XF16>
__global__ void __launch_bounds__(kPkThreads, KEEL_PK_MIN_BLOCKS) stream_packed(PParams P) {
    extern __shared__ uint4 pk_smem[];
    kp_grid_release();
    uint4 *xf = pk_smem;
    float *xs = (float *)(pk_smem + (size_t)P.m * P.xk / 8);
    /* the group at compile time: the group loop unrolls */
    const int lg = pk_lg(P.group);
    if (P.m == 1) /* one activation row (decode): the odd columns' group ends left out */
        run_lg<B, XF16, true, false>(P, lg, xf, xs);
    else
        run_lg<B, XF16, false, false>(P, lg, xf, xs);
}

template <int B, bool XF16, bool ONE>
__device__ __forceinline__ void split_lg(const PParams &P, int lg, uint4 *smem) {
    if (lg == 0) packed_split<B, XF16, ONE, 0, 1>(P, smem);
    else if (lg == 1 && ONE && KEEL_PK_PAIRS(B, ONE, 1) && P.pairs) packed_split<B, XF16, ONE, 1, 2>(P, smem);
    else if (lg == 1) packed_split<B, XF16, ONE, 1, 1>(P, smem);
    else if (ONE && KEEL_PK_PAIRS(B, ONE, 2) && P.pairs) packed_split<B, XF16, ONE, 2, 2>(P, smem);
    else packed_split<B, XF16, ONE, 2, 1>(P, smem);
}

/* The packed tile with k in parts (keel_cuda_packed_splits > 1) at m = 1: the parts of a unit on warps of one block
 * (whole x). A kernel of its own, so the walks of the common case keep their registers and schedule. */
template <int B, bool XF16>
__global__ void __launch_bounds__(kPkThreads, KEEL_PK_MIN_BLOCKS) stream_packed_split(PParams P) {
    extern __shared__ uint4 pk_smem[];
    kp_grid_release();
    /* m > 1 launches take stream_packed_parts; the m > 1 walks are compiled here all the same, as without them ptxas
     * schedules the m = 1 walks slower (docs/stream-tiles.md, "The two trees side by side") */
    if (P.m == 1) split_lg<B, XF16, true>(P, pk_lg(P.group), pk_smem);
    else split_lg<B, XF16, false>(P, pk_lg(P.group), pk_smem);
}

/* The packed tile with k in parts at m > 1: each part on blocks of their own, so a block stages its part of x and not
 * all of it, and the parts' sums meet in the stream's scratch (parts_meet). Its own kernel: with the split kernel's
 * walks in one kernel ptxas spilled. */
template <int B, bool XF16>
__global__ void __launch_bounds__(kPkThreads, KEEL_PK_MIN_BLOCKS) stream_packed_parts(PParams P) {
    extern __shared__ uint4 pk_smem[];
    kp_grid_release();
    run_lg<B, XF16, false, true>(P, pk_lg(P.group), pk_smem, (float *)(pk_smem + (size_t)P.m * P.xk / 8));
}

/* Shared memory of a launch staging R x regions (1 unsplit): R chunks of x, their sums (xs_stride) and a split's
 * parts' sums. */
template <int B> static size_t pk_smem_bytes(const PParams &P, int R) {
    const size_t psum = R > 1 ? (size_t)R * (kPkWarps / R) * 32 * (P.split / R) * (R == 4 ? 2 : 1) * 4 * 4 : 0;
    return R * ((size_t)P.m * P.xk * 2 + (size_t)P.m * xs_stride<B>(P.xk / P.group) * 4) + psum;
}

/* The most shared memory one block of the current device may have (opt-in), in bytes. */
static size_t pk_block_smem_max(void) {
    int dev = 0, optin = 0;
    KEEL_CUDA_CHECK(cudaGetDevice(&dev));
    KEEL_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return (size_t)optin;
}

/* The auto x budget of kernel fn: the largest (KiB steps) whose launches keep the blocks an SM that
 * KEEL_CUDA_PACKED_XBYTES gives it. Leaves fn's dynamic shared-memory attribute at the device's most. */
static int pk_auto_xbytes(const void *fn) {
#if defined(__HIPCC__)
    (void)fn;
    return KEEL_CUDA_PACKED_XBYTES; /* no AMD card has measured a larger one (the audit's gfx records say so too) */
#else
    const size_t most = pk_block_smem_max();
    int want = 0, xb = KEEL_CUDA_PACKED_XBYTES;
    KEEL_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)most));
    KEEL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&want, fn, kPkThreads, KEEL_CUDA_PACKED_SMEM));
    for (int b = xb + 1024; KEEL_CUDA_PACKED_SMEM_FOR((size_t)b) <= most; b += 1024) {
        int got = 0;
        KEEL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&got, fn, kPkThreads,
                                                                      KEEL_CUDA_PACKED_SMEM_FOR((size_t)b)));
        if (got < want) break;
        xb = b;
    }
    return xb;
#endif
}

/* Picks the launch's walk (x-chunk, tile pairs, k-split layout) and grid, then launches. */
template <int B, bool XF16> void launch_pk(const PParams &P, cudaStream_t st) {
    static size_t attr[3] = {0, 0, 0}; /* the kernels' dynamic shared memory attribute as last set */
    /* blocks an SM by kernel and shared memory (it depends on m, the chunk and the group), the last kPkOcc seen */
    enum { kPkOcc = 16 };
    static struct { size_t smem; int split, bps; } occ[kPkOcc];
    static int nocc = 0;
    /* the kernel: 0 unsplit, 1 k in parts at m = 1 (one block a unit), 2 at m > 1 (blocks a part) */
    const int sp = !P.split ? 0 : P.m == 1 ? 1 : 2;
#if KEEL_PK_SPLIT_KERNEL
    const void *fn = sp == 2   ? (const void *)stream_packed_parts<B, XF16>
                     : sp == 1 ? (const void *)stream_packed_split<B, XF16>
                               : (const void *)stream_packed<B, XF16>;
#else
    const void *fn = (const void *)stream_packed<B, XF16>;
#endif
    static int auto_xb[3] = {0, 0, 0}; /* each kernel's auto budget, found on its first auto launch */
    if (pk_xbytes < 0 && !auto_xb[sp]) {
        auto_xb[sp] = pk_auto_xbytes(fn);
        attr[sp] = 0; /* the search moved the attribute */
    }
    const int xbytes = pk_xbytes > 0 ? pk_xbytes : auto_xb[sp];
    const size_t cap = KEEL_CUDA_PACKED_SMEM_FOR((size_t)xbytes);
    if (attr[sp] != cap) {
        KEEL_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cap));
        attr[sp] = cap;
    }
    static int arch_pairs = -1; /* the image this device runs has the pair walks */
    if (arch_pairs < 0) {
#if defined(__HIPCC__)
        arch_pairs = 1;
#else
        cudaFuncAttributes fa;
        KEEL_CUDA_CHECK(cudaFuncGetAttributes(&fa, fn));
        arch_pairs = fa.binaryVersion != KEEL_PK_NO_PAIRS_SM;
#endif
    }
    const bool can = arch_pairs && KEEL_PK_PAIRS(B, P.m == 1, pk_lg(P.group));
    PParams Q = P;
    const int most = xbytes / 2 / P.m / kSpan * kSpan; /* codes of x a block stages at most */
    const bool parts = sp == 2; /* the parts on blocks of their own: a block stages its part of x */
    const int kr = parts ? P.kp / P.split : P.kp; /* codes of k one block walks */
    if (!P.split || parts) {
        Q.xk = kr <= most ? kr : most;
    } else {
        /* quarters at m = 1 with whole x, where the width has pairs: four regions, two tiles a warp; else two
         * regions (halves) of x-chunks as long as shared memory allows */
        Q.xk = P.kp / 4;
        Q.pairs = can && P.split == 4 && P.m == 1 && Q.xk <= most / 4 && pk_smem_bytes<B>(Q, 4) <= cap;
        if (!Q.pairs) Q.xk = P.kp / 2 <= most / 2 ? P.kp / 2 : most / 2 / kSpan * kSpan;
    }
    /* the chunk shrinks to what shared memory allows (the x sums and the halves' parts' sums beside x; the pairs'
     * chunk was checked above) */
    const int R = !P.split || parts ? 1 : Q.pairs ? 4 : 2;
    while (pk_smem_bytes<B>(Q, R) > cap) Q.xk -= kSpan;
    const size_t smem = pk_smem_bytes<B>(Q, R);
    KEEL_ASSERT(Q.xk >= kSpan && smem <= cap);
    int bps = 0;
    for (int i = 0; i < nocc && i < kPkOcc; i++)
        if (occ[i].smem == smem && occ[i].split == sp) bps = occ[i].bps;
    if (bps == 0) {
        KEEL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, fn, kPkThreads, smem));
        if (bps < 1) bps = 1;
        occ[nocc % kPkOcc].smem = smem, occ[nocc % kPkOcc].split = sp, occ[nocc % kPkOcc].bps = bps, nocc++;
    }
    /* one block a unit at most (whole k: units spread over blocks first), no more than fit at once */
    const long long fill = (long long)bps * keel_cuda_sm_count();
    /* tile pairs only where there are pairs enough for every warp (else fewer warps an SM would walk them) */
    if (!P.split) Q.pairs = can && (P.tiles + 1) / 2 >= fill * kPkWarps;
    if (parts) Q.pairs = can;
    const long long units = Q.pairs ? (P.tiles + 1) / 2 : P.tiles;
    unsigned blocks;
    if (parts) { /* blocks a part: one a unit at most (whole part: units spread over blocks first); a multiple of split */
        const long long want = Q.xk < kr ? (units + kPkWarps - 1) / kPkWarps : units, most_b = fill / P.split;
        KEEL_ASSERT(most_b >= 1);
        blocks = (unsigned)((want < most_b ? want : most_b) * P.split);
        keel_cuda_stream_scratch_get(st, (size_t)P.tiles * P.split * 128 * sizeof(float), (size_t)P.tiles, &Q.part,
                                     &Q.cnt);
    } else {
        const long long slots = P.split ? kPkWarps / (Q.pairs ? 4 : 2) : kPkWarps;
        const long long want = P.split || Q.xk < P.kp ? (units + slots - 1) / slots : units;
        blocks = (unsigned)(want < fill ? want : fill);
    }
    pk_last_walk = (Q.pairs ? KEEL_CUDA_PK_WALK_PAIRS : 0) | (sp ? KEEL_CUDA_PK_WALK_SPLIT : 0) |
                   (parts ? KEEL_CUDA_PK_WALK_PARTS : 0);
#if KEEL_PK_SPLIT_KERNEL
    if (parts)
        KP_LAUNCH(keel_cuda_stream_pdl_active(), (stream_packed_parts<B, XF16>), dim3(blocks), dim3(kPkThreads), smem, st, Q);
    else if (sp)
        KP_LAUNCH(keel_cuda_stream_pdl_active(), (stream_packed_split<B, XF16>), dim3(blocks), dim3(kPkThreads), smem, st, Q);
    else
#endif
        KP_LAUNCH(keel_cuda_stream_pdl_active(), (stream_packed<B, XF16>), dim3(blocks), dim3(kPkThreads), smem, st, Q);
    KEEL_CUDA_CHECK_LAUNCH();
}

template <bool XF16> void launch_pk_bits(int bits, const PParams &P, cudaStream_t st) {
    switch (bits) {
    case 2: launch_pk<2, XF16>(P, st); break;
    case 3: launch_pk<3, XF16>(P, st); break;
    case 4: launch_pk<4, XF16>(P, st); break;
    case 5: launch_pk<5, XF16>(P, st); break;
    case 6: launch_pk<6, XF16>(P, st); break;
    case 8: launch_pk<8, XF16>(P, st); break;
    default: KEEL_ASSERTF(false, "packed tile: bits %d", bits);
    }
}

} // namespace

#if !defined(keel_cuda_stream_matmul_packed) /* the contract twin shares this one */
extern "C" bool keel_cuda_pack_upload(const keel_qmat *W, keel_cuda_pw *out, char *why, size_t why_cap) {
    KEEL_ASSERT(W && out);
    const size_t need = keel_cuda_pack_bytes(W->n, W->k, W->bits, W->group);
    void *host = need ? malloc(need) : NULL;
    if (need && !host) {
        snprintf(why, why_cap, "packed tile: out of host memory for %zu bytes", need);
        return false;
    }
    const bool span_major = keel_cuda_packed_splits(W->n, W->k) > 1; /* the split walks stream it faster */
    if (!keel_cuda_pack(W, span_major, host, need, why, why_cap)) {
        free(host);
        return false;
    }
    void *dev = keel_cuda_malloc(need); /* cudaMalloc: 256-byte aligned */
    keel_cuda_upload(dev, host, need);
    free(host);
    *out = (keel_cuda_pw){.w = (const uint8_t *)dev, .n = W->n, .k = W->k, .bits = W->bits, .group = W->group,
                          .sdt = W->sdt, .span_major = span_major};
    return true;
}

extern "C" bool keel_cuda_pack_upload_qw(const keel_cuda_qw *W, keel_cuda_pw *out, char *why, size_t why_cap) {
    KEEL_ASSERT(W && out);
    const size_t cw = (size_t)W->n * keel_quant_row_words(W->k, W->bits) * 4;
    const size_t sb = (size_t)W->n * (W->k / W->group) * keel_dtype_size(W->sdt);
    void *hw = malloc(cw ? cw : 1), *hs = malloc(sb ? sb : 1), *hb = malloc(sb ? sb : 1);
    bool ok = hw && hs && hb;
    if (!ok) {
        snprintf(why, why_cap, "packed tile: out of host memory for a %zu-byte read-back", cw + 2 * sb);
    } else {
        keel_cuda_download(hw, W->w, cw);
        keel_cuda_download(hs, W->scales, sb);
        keel_cuda_download(hb, W->biases, sb);
        const keel_qmat host = {W->n, W->k, W->bits, W->group, W->sdt, (const uint32_t *)hw, hs, hb};
        ok = keel_cuda_pack_upload(&host, out, why, why_cap);
    }
    free(hw), free(hs), free(hb);
    return ok;
}
#endif

extern "C" void keel_cuda_stream_matmul_packed(const keel_cuda_pw *W, const void *x, keel_dtype xdt, int m, void *y,
                                               keel_dtype ydt, keel_epilogue epi, void *stream) {
    KEEL_ASSERT(W && W->w && x && y);
    KEEL_ASSERTF(keel_cuda_pack_scales_ok(W->sdt), "packed tile: BF16 scales only (keel_cuda_pack refuses others)");
    KEEL_ASSERTF(((uintptr_t)W->w & 15u) == 0, "packed tile: the packed matrix must be 16-byte aligned");
    KEEL_ASSERTF(m >= 1 && m <= KEEL_CUDA_STREAM_MAX_ROWS, "packed tile: m %d (1..%d)", m, KEEL_CUDA_STREAM_MAX_ROWS);
    KEEL_ASSERT(xdt == KEEL_DT_BF16 || xdt == KEEL_DT_F16);
    KEEL_ASSERT(ydt == KEEL_DT_F32 || ydt == KEEL_DT_BF16);
    KEEL_ASSERTF(((uintptr_t)x & 3u) == 0, "packed tile: activations must be 4-byte aligned");
    PParams P = {};
    P.w = W->w;
    P.n = W->n;
    P.k = W->k;
    P.ns = (W->k + kSpan - 1) / kSpan;
    P.kp = P.ns * kSpan;
    P.group = W->group;
    P.tiles = (W->n + kPkRows - 1) / kPkRows;
    P.rec = KEEL_CUDA_PACK_REC(W->bits, W->group);
    /* the split walks' strides, from the layout's record index (they fit ints: keel_cuda_pack_bytes) */
    const size_t at0 = keel_cuda_pack_at(W->n, W->k, W->span_major, 0, 0);
    P.sstr = (int)((keel_cuda_pack_at(W->n, W->k, W->span_major, 0, 1) - at0) * P.rec);
    P.tstr = (int)((keel_cuda_pack_at(W->n, W->k, W->span_major, 1, 0) - at0) * P.rec);
    P.pstr = (int)((keel_cuda_pack_at(W->n, W->k, W->span_major, 2, 0) - at0) * P.rec);
    P.x = (const uint16_t *)x;
    P.m = m;
    P.y = y;
    P.ydt_bf16 = ydt == KEEL_DT_BF16;
    P.epi = (int)epi;
    P.last = (long long)m * W->n - 1;
    const int S = pk_splits(W->n, W->k);
    P.split = S > 1 ? S : 0;
    KEEL_ASSERTF(!W->span_major || P.split || kPkUnsplitStrides, "packed tile: a span-major matrix "
                 "(keel_cuda_pack_upload packs one only where k splits) on the unsplit kernel's tile-major walk");
    if (xdt == KEEL_DT_F16)
        launch_pk_bits<true>(W->bits, P, (cudaStream_t)stream);
    else
        launch_pk_bits<false>(W->bits, P, (cudaStream_t)stream);
}

#if !defined(keel_cuda_stream_matmul_packed)
extern "C" int keel_cuda_packed_splits(int n, int k) { return pk_splits(n, k); }

extern "C" int keel_cuda_packed_last_walk(void) { return pk_last_walk; }

extern "C" bool keel_cuda_packed_xbudget(int bytes) {
    if (bytes == 0 || bytes == KEEL_CUDA_PACKED_XBUDGET_AUTO) { /* the default */
        pk_xbytes = KEEL_CUDA_PACKED_XBUDGET_AUTO;
        return true;
    }
    if (bytes < KEEL_CUDA_PACKED_XBYTES_MIN || bytes % 1024) return false;
    if (KEEL_CUDA_PACKED_SMEM_FOR((size_t)bytes) > pk_block_smem_max()) return false;
    pk_xbytes = bytes;
    return true;
}

extern "C" int keel_cuda_packed_xbudget_now(void) { return pk_xbytes; }

extern "C" const void *keel_cuda_packed_kernel_fn(const char *symbol) {
/* one row per (width, f16 activations) instance of kernel K, named as the audit names it */
#define KP_FN(K, B, X) {#K "<" #B "," #X ">", (const void *)K<B, X>}
#define KP_FNS(K)                                                                                                  \
    KP_FN(K, 2, false), KP_FN(K, 3, false), KP_FN(K, 4, false), KP_FN(K, 5, false), KP_FN(K, 6, false),            \
        KP_FN(K, 8, false), KP_FN(K, 2, true), KP_FN(K, 3, true), KP_FN(K, 4, true), KP_FN(K, 5, true),           \
        KP_FN(K, 6, true), KP_FN(K, 8, true)
    static const struct {
        const char *name;
        const void *fn;
    } tab[] = {KP_FNS(stream_packed), KP_FNS(stream_packed_split), KP_FNS(stream_packed_parts)};
#undef KP_FNS
#undef KP_FN
    if (!symbol) return NULL;
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        if (!strcmp(tab[i].name, symbol)) return tab[i].fn;
    return NULL;
}
#endif
