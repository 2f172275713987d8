/* engine/cuda: attention over the fp32 KV cache, flash-style with split-K, and the cache append. Causal GQA
 * without RoPE (scale 1/sqrt(head_dim)), the CPU engine's semantics (src/engine/attention.c). The position comes
 * from device memory and no launch configuration depends on it, so both launches can be captured once in a CUDA
 * graph and replayed at every position.
 *
 * Arithmetic of one (row, head) at position p, fixed by p and the inputs alone (docs/cuda-engine.md):
 *   keys 0..p in chunks of kChunk, each chunk in tiles of kTile keys;
 *   score = ((c0 + c1) + (c2 + c3)) * scale, c_w an fma chain over the w-th quarter of the head's float4 slices;
 *   per tile (online softmax): m' = max(m, tile max), alpha = exp(m - m'), p_j = exp(s_j - m'),
 *     l = fma(l, alpha, butterfly sum of p_j), o = o*alpha then an fma chain over the tile's keys in order;
 *   chunks merged in chunk order from an empty state: M' = max(M, m_c), a = exp(M - M'), b = exp(m_c - M'),
 *     L = fma(L, a, l_c*b), O = fma(O, a, o_c*b); out = O / L.
 * A block computes the pairs (row, query head) of one KV head that it holds (the K/V tile in shared memory serves
 * every query head of the group and every row of the block). Up to kSplitMaxM rows, blocks take chunks (split-K)
 * and write each chunk's (m, l, o) to scratch, and a combine kernel merges them; above it, each block walks all
 * chunks and merges in place. Both evaluate the expressions above, so a row gets the same bits alone (m = 1) or in
 * any window, in either mode. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../../kernels/cuda/port.h"
#include "ecuda.h"

/* Built a second time as the contract's twin (src/contract/twin_attn.cu) with KEEL_ATTN_TWIN 1: the launchers are
 * renamed keel_contract_twin_ecu_* and the KEEL_PLANT_ATTN_* / KEEL_PLANT_KV_* hooks carry planted faults. */
#ifndef KEEL_ATTN_TWIN
#define KEEL_ATTN_TWIN 0
#define KEEL_ATTN_FN(name) keel_ecu_##name
#else
#define KEEL_ATTN_FN(name) keel_contract_twin_ecu_##name
#endif

/* Hooks: each is exactly the code it stands for (the production kernels are unchanged). */
#ifndef KEEL_PLANT_ATTN_RESCALE /* a tile's rescale of the running o by alpha */
#define KEEL_PLANT_ATTN_RESCALE(o, alpha) __fmul_rn(o, alpha)
#endif
#ifndef KEEL_PLANT_ATTN_OUT /* the final value of an output (multi: the launch has more than one row) */
#define KEEL_PLANT_ATTN_OUT(v, multi) ((void)(multi), (v))
#endif
#ifndef KEEL_PLANT_ATTN_STORED /* after the fp32 store of element i (last: the launch's last element) */
#define KEEL_PLANT_ATTN_STORED(of, i, last, v) ((void)0)
#endif
#ifndef KEEL_PLANT_KV_BIAS /* a k/v bias element */
#define KEEL_PLANT_KV_BIAS(b) (b)
#endif
#ifndef KEEL_PLANT_KV_STORED /* after the cache store of element i (last: the launch's last element) */
#define KEEL_PLANT_KV_STORED(kc, i, last, v) ((void)0)
#endif
#define KEEL_ATTN_PLANT_HOOKS 1

namespace {

constexpr int kTile = 32;                  /* keys per tile: one per lane in the softmax step */
constexpr int kChunk = KEEL_ECU_ATTN_CHUNK; /* keys per split-K chunk */
constexpr int kTiles = kChunk / kTile;
constexpr int kPairs = 16;                 /* (row, query head) pairs a block computes */
constexpr int kThreads = 128;
constexpr int kSplitMaxM = KEEL_ECU_ATTN_SPLIT_MAX_M;
constexpr int kSmemMax = 65536;            /* the dynamic shared memory the tile kernel is allowed on every chip */
constexpr int kGridTarget = 512;           /* split-K blocks a launch aims for; they loop over chunks */
constexpr int kSeg = 128;                  /* chunks the combine kernel scans at a time (= its block size) */
constexpr int kMergeBatch = 32;            /* chunks whose partials the combine loads together before merging */
constexpr int kMaxHeadDim = 256;
static_assert(kChunk % kTile == 0, "a chunk is whole tiles");
static_assert(kPairs == 16, "the score step maps 16 pairs x 32 keys onto a warp");

__device__ __forceinline__ float ld_dt(const void *p, int dt, long long i) {
    if (dt == KEEL_DT_BF16) return kp_bf16_to_f32(((const uint16_t *)p)[i]);
    if (dt == KEEL_DT_F16) return kp_f16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* Everything a launch passes; the layout fields are fixed by the shape (never by the position). */
struct AP {
    const float *q;
    const void *qb;
    int qb_dt, qb_n;
    const float *kc, *vc;
    int kvd;
    const int *d_pos;
    int m, nh, hd, ctx;
    int G, HB, RB, hgroups; /* query heads per KV head; a block's heads and rows; head groups per KV head */
    int DG, KS, DX;         /* float4 slices of a head; shared row stride (floats); slice lanes in the PV step */
    int NC;                 /* chunks the cache holds */
    int walk, alias, vec4;
    float scale;
    float *part_o, *part_ml; /* split-K scratch: (m, nh, NC, hd) and (m, nh, NC, 2) */
    uint16_t *o;
    float *of;
};

#if KEEL_ATTN_TWIN
__device__ int g_attn_plant;
#endif

/* The position of pair pi of a block whose rows start at r0, or -1 when the pair is not computed. */
__device__ __forceinline__ int pair_pos(const AP &a, int r0, int hg, int pi, int pos0, int *row, int *head, int kh) {
    const int rl = pi / a.HB, hl = pi - rl * a.HB;
    const int r = r0 + rl, hi = hg * a.HB + hl;
    if (rl >= a.RB || r >= a.m || hi >= a.G) return -1;
    *row = r;
    *head = kh * a.G + hi;
    return min(max(pos0 + r, 0), a.ctx - 1);
}

__device__ __forceinline__ void store_out(const AP &a, long long i, float v) {
    v = KEEL_PLANT_ATTN_OUT(v, a.m > 1);
    if (a.o) a.o[i] = kp_f32_to_bf16(v);
    if (a.of) {
        a.of[i] = v;
        KEEL_PLANT_ATTN_STORED(a.of, i, (long long)a.m * a.nh * a.hd - 1, v);
    }
}

/* o (two float4 slices) += p * v, each element one fma. */
__device__ __forceinline__ void pv_fma(float4 o[2], float p, const float4 &v0, const float4 &v1) {
    o[0].x = __fmaf_rn(p, v0.x, o[0].x);
    o[0].y = __fmaf_rn(p, v0.y, o[0].y);
    o[0].z = __fmaf_rn(p, v0.z, o[0].z);
    o[0].w = __fmaf_rn(p, v0.w, o[0].w);
    o[1].x = __fmaf_rn(p, v1.x, o[1].x);
    o[1].y = __fmaf_rn(p, v1.y, o[1].y);
    o[1].z = __fmaf_rn(p, v1.z, o[1].z);
    o[1].w = __fmaf_rn(p, v1.w, o[1].w);
}

/* A thread's share of a tile copy: elements tid, tid + kThreads, ... of rows of w elements, walked without division. */
struct Walk {
    int j0, e0, dj, de;
};

__device__ __forceinline__ Walk walk_for(int w) {
    const int t = (int)threadIdx.x;
    Walk r = {t / w, t % w, kThreads / w, kThreads % w};
    return r;
}

/* Asynchronous copy of rows [ks, ks+kn) of one KV head's slice of a cache into a tile buffer (row stride KS); wv
 * walks float4 slices (vec4) or floats. */
__device__ __forceinline__ void load_tile(const AP &a, const Walk &wv, float *dst, const float *cache, int kh, int ks,
                                          int kn) {
    const float *src = cache + (long long)ks * a.kvd + (long long)kh * a.hd;
    const int w = a.vec4 ? a.DG : a.hd;
    for (int j = wv.j0, e = wv.e0; j < kn;) {
        if (a.vec4) kp_cp_async16(dst + j * a.KS + 4 * e, src + (long long)j * a.kvd + 4 * e);
        else kp_cp_async4(dst + j * a.KS + e, src + (long long)j * a.kvd + e);
        j += wv.dj, e += wv.de;
        if (e >= w) e -= w, j++;
    }
}

/* The key offset of the tile after (c, t) in this block's sequence, or -1 when there is none. */
__device__ __forceinline__ int next_tile(int c, int t, int cstep, int cmax, int p_max, int *nc, int *nt) {
    if (t + 1 < kTiles && c * kChunk + (t + 1) * kTile <= p_max) {
        *nc = c, *nt = t + 1;
    } else {
        if (c + cstep > cmax) return -1;
        *nc = c + cstep, *nt = 0;
    }
    return *nc * kChunk + *nt * kTile;
}

/* One block: 16 pairs of one KV head over its chunks. PT: pairs per thread in the PV step (1, 2 or 4). */
template <int PT>
__global__ void __launch_bounds__(kThreads, 2) attn_tile_kernel(AP a) {
    extern __shared__ float4 smem4[];
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    float *sm = (float *)smem4;
    float *Kb = sm;
    float *Vb = a.alias ? Kb : Kb + kTile * a.KS;
    float *Q = Vb + kTile * a.KS;
    float *SQ = Q + kPairs * a.KS;     /* [quarter][pair][key] partial dots */
    float *PM = SQ + 4 * kPairs * kTile; /* [pair][key] softmax numerators */
    float *ALPHA = PM + kTile * kPairs, *CA = ALPHA + kPairs, *CB = CA + kPairs, *LL = CB + kPairs;
    int *NV = (int *)(LL + kPairs);

    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int kh = blockIdx.y / a.hgroups, hg = blockIdx.y - kh * a.hgroups, r0 = blockIdx.z * a.RB;
    const int pos0 = *a.d_pos;
    const int last_row = min(r0 + a.RB, a.m) - 1;
    const int p_max = min(max(pos0 + last_row, 0), a.ctx - 1);
    const int cmax = p_max / kChunk;
    const int c0 = a.walk ? 0 : (int)blockIdx.x, cstep = a.walk ? 1 : (int)gridDim.x;
    if (c0 > cmax) return;

    /* zero the tile buffers (their padding columns stay zero) and load this block's queries (+ bias) */
    for (int i = tid; i < (a.alias ? 1 : 2) * kTile * a.KS / 4; i += kThreads) smem4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    { /* the pairs' queries: a batch of elements loaded before any is stored (one round trip, not one a pair) */
        constexpr int kQBatch = 8;
        const int nq = kPairs * a.KS;
        for (int e0 = tid; e0 < nq; e0 += kThreads * kQBatch) {
            float qv[kQBatch], bv[kQBatch];
#pragma unroll
            for (int j = 0; j < kQBatch; j++) {
                const int e = e0 + j * kThreads, pi = e / a.KS, d = e - pi * a.KS;
                int row = 0, head = 0;
                const bool on = e < nq && pair_pos(a, r0, hg, pi, pos0, &row, &head, kh) >= 0 && d < a.hd;
                qv[j] = on ? a.q[((long long)row * a.nh + head) * a.hd + d] : 0.0f;
                bv[j] = on && a.qb_n ? ld_dt(a.qb, a.qb_dt, (long long)head * a.hd + d) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < kQBatch; j++) {
                const int e = e0 + j * kThreads;
                if (e < nq) Q[e] = a.qb_n ? __fadd_rn(qv[j], bv[j]) : qv[j];
            }
        }
    }
    __syncthreads();

    /* per-pair state: the stats warp wid owns pairs wid + 4k (its lanes hold identical copies) */
    float mrun[kPairs / 4], lrun[kPairs / 4], Mw[kPairs / 4], Lw[kPairs / 4];
    int ppw[kPairs / 4], row = 0, head = 0;
#pragma unroll
    for (int k = 0; k < kPairs / 4; k++) {
        Mw[k] = -INFINITY, Lw[k] = 0.0f;
        ppw[k] = pair_pos(a, r0, hg, wid + 4 * k, pos0, &row, &head, kh);
    }
    /* the PV step: thread (dx, px) owns slices dx and dx + DX of pairs px*PT .. px*PT+PT-1 */
    const int dx = tid % a.DX, px = tid / a.DX;
    const bool pv = px * PT < kPairs;
    const int d40 = dx, d41 = dx + a.DX;
    int ppt[PT];
    float4 oc[PT][2], O[PT][2];
#pragma unroll
    for (int i = 0; i < PT; i++) {
        ppt[i] = pv ? pair_pos(a, r0, hg, px * PT + i, pos0, &row, &head, kh) : -1;
        O[i][0] = O[i][1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

    const Walk wv = walk_for(a.vec4 ? a.DG : a.hd);
    /* prologue: the first tile's keys (and values, unless they share the buffer) */
    {
        const int ks = c0 * kChunk, kn = min(kTile, p_max - ks + 1);
        load_tile(a, wv, Kb, a.kc, kh, ks, kn);
        kp_cp_commit();
        if (!a.alias) {
            load_tile(a, wv, Vb, a.vc, kh, ks, kn);
            kp_cp_commit();
        }
    }

    for (int c = c0; c <= cmax; c += cstep) {
#pragma unroll
        for (int k = 0; k < kPairs / 4; k++) mrun[k] = -INFINITY, lrun[k] = 0.0f;
#pragma unroll
        for (int i = 0; i < PT; i++) oc[i][0] = oc[i][1] = make_float4(0.f, 0.f, 0.f, 0.f);

        for (int t = 0; t < kTiles; t++) {
            const int ks = c * kChunk + t * kTile;
            if (ks > p_max) break;
            const int kn = min(kTile, p_max - ks + 1);
            int nc = 0, nt = 0;
            const int nks = next_tile(c, t, cstep, cmax, p_max, &nc, &nt);
            const int nkn = nks >= 0 ? min(kTile, p_max - nks + 1) : 0;

            if (a.alias) kp_cp_wait<0>();
            else kp_cp_wait<1>();
            __syncthreads();

            /* scores: warp w sums quarter w of the slices for 16 pairs x 32 keys (lane: keys kx+8i, pairs px+4i) */
            {
                const int w = wid, qlo = (w * a.DG) >> 2, qhi = ((w + 1) * a.DG) >> 2;
                const int kx = lane & 7, qx = lane >> 3;
                float acc[4][4];
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
#pragma unroll 1
                for (int d4 = qlo; d4 < qhi; d4++) {
                    float4 kf[4], qf[4];
#pragma unroll
                    for (int j = 0; j < 4; j++) kf[j] = *(const float4 *)(Kb + (kx + 8 * j) * a.KS + 4 * d4);
#pragma unroll
                    for (int i = 0; i < 4; i++) qf[i] = *(const float4 *)(Q + (qx + 4 * i) * a.KS + 4 * d4);
#pragma unroll
                    for (int i = 0; i < 4; i++)
#pragma unroll
                        for (int j = 0; j < 4; j++) {
                            float s = acc[i][j];
                            s = __fmaf_rn(qf[i].x, kf[j].x, s);
                            s = __fmaf_rn(qf[i].y, kf[j].y, s);
                            s = __fmaf_rn(qf[i].z, kf[j].z, s);
                            acc[i][j] = __fmaf_rn(qf[i].w, kf[j].w, s);
                        }
                }
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++) SQ[(w * kPairs + qx + 4 * i) * kTile + kx + 8 * j] = acc[i][j];
            }
            __syncthreads();
            if (a.alias) load_tile(a, wv, Vb, a.vc, kh, ks, kn); /* the keys are no longer needed */
            else if (nks >= 0) load_tile(a, wv, Kb, a.kc, kh, nks, nkn);
            kp_cp_commit();

            /* online softmax: warp wid takes pairs wid + 4k (the four side by side), lane = key */
            {
                float sv[kPairs / 4], mt[kPairs / 4], ts[kPairs / 4];
                bool valid[kPairs / 4];
#pragma unroll
                for (int k = 0; k < kPairs / 4; k++) {
                    const float *sq = SQ + (wid + 4 * k) * kTile + lane;
                    const float s0 = __fadd_rn(__fadd_rn(sq[0], sq[kPairs * kTile]),
                                               __fadd_rn(sq[2 * kPairs * kTile], sq[3 * kPairs * kTile]));
                    valid[k] = ks + lane <= ppw[k];
                    sv[k] = valid[k] ? __fmul_rn(s0, a.scale) : -INFINITY;
                    mt[k] = sv[k];
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                    for (int k = 0; k < kPairs / 4; k++) mt[k] = fmaxf(mt[k], kp_shfl_xor_f32(mt[k], o));
                float mn[kPairs / 4], al[kPairs / 4];
#pragma unroll
                for (int k = 0; k < kPairs / 4; k++) {
                    mn[k] = fmaxf(mrun[k], mt[k]);
                    al[k] = expf(__fadd_rn(mrun[k], -mn[k]));
                    ts[k] = valid[k] ? expf(__fadd_rn(sv[k], -mn[k])) : 0.0f;
                    PM[(wid + 4 * k) * kTile + lane] = ts[k];
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                    for (int k = 0; k < kPairs / 4; k++) ts[k] = __fadd_rn(ts[k], kp_shfl_xor_f32(ts[k], o));
#pragma unroll
                for (int k = 0; k < kPairs / 4; k++) {
                    const int pi = wid + 4 * k, pp = ppw[k];
                    if (pp < ks) { /* no key of this tile for the pair: its state is left as it is */
                        if (lane == 0) NV[pi] = 0;
                        continue;
                    }
                    lrun[k] = __fmaf_rn(lrun[k], al[k], ts[k]);
                    mrun[k] = mn[k];
                    if (lane == 0) {
                        ALPHA[pi] = al[k];
                        NV[pi] = min(kTile, pp - ks + 1);
                    }
                }
            }
            if (a.alias) kp_cp_wait<0>();
            else kp_cp_wait<1>();
            __syncthreads();

            /* o = o*alpha + sum over the tile's keys in order of p_j * v_j */
            if (pv) {
                int nv[PT], nvmin = kTile, nvmax = 0;
#pragma unroll
                for (int i = 0; i < PT; i++) {
                    nv[i] = NV[px * PT + i];
                    nvmin = min(nvmin, nv[i]);
                    nvmax = max(nvmax, nv[i]);
                    if (nv[i] > 0) {
                        const float al = ALPHA[px * PT + i];
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            oc[i][h].x = KEEL_PLANT_ATTN_RESCALE(oc[i][h].x, al);
                            oc[i][h].y = KEEL_PLANT_ATTN_RESCALE(oc[i][h].y, al);
                            oc[i][h].z = KEEL_PLANT_ATTN_RESCALE(oc[i][h].z, al);
                            oc[i][h].w = KEEL_PLANT_ATTN_RESCALE(oc[i][h].w, al);
                        }
                    }
                }
                const bool two = d41 < a.DG;
                const float *pm = PM + px * PT * kTile;
                if (nvmin == kTile) { /* every key of the tile for every pair of the thread */
#pragma unroll 4
                    for (int j = 0; j < kTile; j++) {
                        const float4 v0 = *(const float4 *)(Vb + j * a.KS + 4 * d40);
                        const float4 v1 = two ? *(const float4 *)(Vb + j * a.KS + 4 * d41) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                        for (int i = 0; i < PT; i++) pv_fma(oc[i], pm[i * kTile + j], v0, v1);
                    }
                } else {
                    for (int j = 0; j < nvmax; j++) {
                        const float4 v0 = *(const float4 *)(Vb + j * a.KS + 4 * d40);
                        const float4 v1 = two ? *(const float4 *)(Vb + j * a.KS + 4 * d41) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                        for (int i = 0; i < PT; i++)
                            if (j < nv[i]) pv_fma(oc[i], pm[i * kTile + j], v0, v1);
                    }
                }
            }
            __syncthreads();
            if (a.alias) {
                if (nks >= 0) load_tile(a, wv, Kb, a.kc, kh, nks, nkn);
            } else if (nks >= 0) {
                load_tile(a, wv, Vb, a.vc, kh, nks, nkn);
            }
            kp_cp_commit();
        }

        /* the chunk's (m, l, o): to scratch (split-K), or merged into the running (M, L, O) (walk) */
        const int cs = c * kChunk;
        if (!a.walk) {
#pragma unroll
            for (int k = 0; k < kPairs / 4; k++)
                if (ppw[k] >= cs && lane == 0) {
                    pair_pos(a, r0, hg, wid + 4 * k, pos0, &row, &head, kh);
                    const long long pi = ((long long)row * a.nh + head) * a.NC + c;
                    a.part_ml[2 * pi] = mrun[k];
                    a.part_ml[2 * pi + 1] = lrun[k];
                }
#pragma unroll
            for (int i = 0; i < PT; i++) {
                if (ppt[i] < cs) continue;
                pair_pos(a, r0, hg, px * PT + i, pos0, &row, &head, kh);
                float *dst = a.part_o + (((long long)row * a.nh + head) * a.NC + c) * a.hd;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int d = 4 * (h ? d41 : d40);
                    const float v[4] = {oc[i][h].x, oc[i][h].y, oc[i][h].z, oc[i][h].w};
                    for (int e = 0; e < 4; e++)
                        if (d + e < a.hd) dst[d + e] = v[e];
                }
            }
        } else {
#pragma unroll
            for (int k = 0; k < kPairs / 4; k++) {
                if (ppw[k] < cs) continue;
                const float Mn = fmaxf(Mw[k], mrun[k]);
                const float ca = expf(__fadd_rn(Mw[k], -Mn)), cb = expf(__fadd_rn(mrun[k], -Mn));
                Lw[k] = __fmaf_rn(Lw[k], ca, __fmul_rn(lrun[k], cb));
                Mw[k] = Mn;
                if (lane == 0) CA[wid + 4 * k] = ca, CB[wid + 4 * k] = cb;
            }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < PT; i++) {
                if (ppt[i] < cs) continue;
                const float ca = CA[px * PT + i], cb = CB[px * PT + i];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    O[i][h].x = __fmaf_rn(O[i][h].x, ca, __fmul_rn(oc[i][h].x, cb));
                    O[i][h].y = __fmaf_rn(O[i][h].y, ca, __fmul_rn(oc[i][h].y, cb));
                    O[i][h].z = __fmaf_rn(O[i][h].z, ca, __fmul_rn(oc[i][h].z, cb));
                    O[i][h].w = __fmaf_rn(O[i][h].w, ca, __fmul_rn(oc[i][h].w, cb));
                }
            }
        }
    }
    kp_cp_wait<0>();
    if (!a.walk) return;

    /* walk: out = O / L */
#pragma unroll
    for (int k = 0; k < kPairs / 4; k++)
        if (lane == 0) LL[wid + 4 * k] = Lw[k];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < PT; i++) {
        if (ppt[i] < 0) continue;
        const float L = LL[px * PT + i];
        pair_pos(a, r0, hg, px * PT + i, pos0, &row, &head, kh);
        const long long base = ((long long)row * a.nh + head) * a.hd;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int d = 4 * (h ? d41 : d40);
            const float v[4] = {O[i][h].x, O[i][h].y, O[i][h].z, O[i][h].w};
            for (int e = 0; e < 4; e++)
                if (d + e < a.hd) store_out(a, base + d + e, __fdiv_rn(v[e], L));
        }
    }
}

/* Split-K: one block per (query head, row) merges the row's chunks in order: prefix maxima by a block scan (max
 * is exact, so the scan order does not matter), then per channel the fma chain of the merge, a batch of chunks'
 * partials loaded before the batch's merges. */
__global__ void __launch_bounds__(kSeg) attn_combine_kernel(AP a) {
    __shared__ float smx[kSeg], sa[kSeg], sb[kSeg], wmx[kSeg / 32];
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    const int h = blockIdx.x, r = blockIdx.y, tid = threadIdx.x;
    const int pp = min(max(*a.d_pos + r, 0), a.ctx - 1), nc = pp / kChunk + 1;
    const long long base = ((long long)r * a.nh + h) * a.NC;
    const int d0 = tid, d1 = tid + kSeg;
    float O0 = 0.0f, O1 = 0.0f, L = 0.0f, Mprev = -INFINITY;
    for (int s0 = 0; s0 < nc; s0 += kSeg) {
        const int ns = min(kSeg, nc - s0);
        const float mc = tid < ns ? a.part_ml[2 * (base + s0 + tid)] : -INFINITY;
        float v = mc; /* inclusive prefix maximum: within the warp by shuffles, then over the warps before */
        const int lane = tid & 31, wid = tid >> 5;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float t = __uint_as_float(kp_shfl(__float_as_uint(v), lane >= o ? lane - o : 0));
            if (lane >= o) v = fmaxf(v, t);
        }
        if (lane == 31) wmx[wid] = v;
        __syncthreads();
        for (int w = 0; w < wid; w++) v = fmaxf(v, wmx[w]);
        smx[tid] = v;
        __syncthreads();
        if (tid < ns) {
            const float Mc = fmaxf(Mprev, smx[tid]), Mb = tid ? fmaxf(Mprev, smx[tid - 1]) : Mprev;
            sa[tid] = expf(__fadd_rn(Mb, -Mc));
            sb[tid] = expf(__fadd_rn(mc, -Mc));
        }
        __syncthreads();
        const float *po = a.part_o + (base + s0) * a.hd;
        const float *pl = a.part_ml + 2 * (base + s0) + 1;
        for (int c0 = 0; c0 < ns; c0 += kMergeBatch) { /* a batch's loads all in flight, then its merges in order */
            float lv[kMergeBatch], o0[kMergeBatch], o1[kMergeBatch];
#pragma unroll
            for (int j = 0; j < kMergeBatch; j++) {
                const int c = c0 + j;
                lv[j] = c < ns ? pl[2 * c] : 0.0f;
                o0[j] = c < ns && d0 < a.hd ? po[(long long)c * a.hd + d0] : 0.0f;
                o1[j] = c < ns && d1 < a.hd ? po[(long long)c * a.hd + d1] : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < kMergeBatch; j++) {
                const int c = c0 + j;
                if (c >= ns) continue;
                const float ca = sa[c], cb = sb[c];
                L = __fmaf_rn(L, ca, __fmul_rn(lv[j], cb));
                if (d0 < a.hd) O0 = __fmaf_rn(O0, ca, __fmul_rn(o0[j], cb));
                if (d1 < a.hd) O1 = __fmaf_rn(O1, ca, __fmul_rn(o1[j], cb));
            }
        }
        Mprev = fmaxf(Mprev, smx[ns - 1]);
        __syncthreads();
    }
    const long long out = ((long long)r * a.nh + h) * a.hd;
    if (d0 < a.hd) store_out(a, out + d0, __fdiv_rn(O0, L));
    if (d1 < a.hd) store_out(a, out + d1, __fdiv_rn(O1, L));
}

struct DVec {
    const void *p;
    int dt, n;
};

/* Cache rows *d_pos + r = k (resp. v) row r [+ bias], r < m. */
__global__ void kv_append_kernel(const float *k, const float *v, DVec kb, DVec vb, float *kc, float *vc, int kvd,
                                 const int *d_pos, int m) {
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, n = (long long)m * kvd;
    if (i >= n) return;
    const long long r = i / kvd, c = i - r * kvd, dst = ((long long)*d_pos + r) * kvd + c;
    float kv = k[i], vv = v[i];
    if (kb.n) kv = __fadd_rn(kv, KEEL_PLANT_KV_BIAS(ld_dt(kb.p, kb.dt, c)));
    if (vb.n) vv = __fadd_rn(vv, KEEL_PLANT_KV_BIAS(ld_dt(vb.p, vb.dt, c)));
    kc[dst] = kv;
    vc[dst] = vv;
    KEEL_PLANT_KV_STORED(kc, dst, i == n - 1, kv);
}

/* The launch layout of a shape: slices, strides, pairs per thread, whether K and V share one buffer. */
struct Layout {
    int DG, KS, DX, PT, alias;
    size_t bytes;
};

size_t layout_bytes(int KS, int alias) {
    const size_t f = (size_t)(alias ? 1 : 2) * kTile * KS + (size_t)kPairs * KS + 4 * kPairs * kTile +
                     (size_t)kTile * kPairs + 5 * kPairs;
    return f * sizeof(float);
}

Layout layout_for(int hd) {
    Layout l;
    l.DG = (hd + 3) / 4;
    l.KS = (4 * l.DG + 31) / 32 * 32 + 4; /* = 4 mod 32 floats: the score step's row reads hit distinct banks */
    l.DX = (l.DG + 1) / 2;
    const int pxn = kThreads / l.DX;
    l.PT = pxn >= kPairs ? 1 : 2 * pxn >= kPairs ? 2 : 4;
    l.alias = layout_bytes(l.KS, 0) > (size_t)kSmemMax;
    l.bytes = layout_bytes(l.KS, l.alias);
    return l;
}

template <int PT> void launch_tiles(const AP &a, dim3 grid, size_t bytes, cudaStream_t st) {
    static bool attr_set = false; /* the tile kernels may use kSmemMax bytes (set once per kernel) */
    if (!attr_set) {
        KEEL_CUDA_CHECK(cudaFuncSetAttribute(attn_tile_kernel<PT>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemMax));
#if !defined(__HIPCC__) /* all of L1 as shared memory, so several blocks fit on an SM */
        KEEL_CUDA_CHECK(cudaFuncSetAttribute(attn_tile_kernel<PT>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             (int)cudaSharedmemCarveoutMaxShared));
#endif
        attr_set = true;
    }
    KP_LAUNCH(keel_ecu_pdl_on(), (attn_tile_kernel<PT>), grid, dim3(kThreads), bytes, st, a);
    KEEL_CUDA_CHECK_LAUNCH();
}

} // namespace

extern "C" size_t KEEL_ATTN_FN(attn_scratch_bytes)(int m, int nh, int hd, int ctx) {
    if (m < 1 || m > kSplitMaxM) return 0;
    const size_t nc = ((size_t)ctx + kChunk - 1) / kChunk;
    return (size_t)m * (size_t)nh * nc * ((size_t)hd + 2) * sizeof(float);
}

extern "C" size_t KEEL_ATTN_FN(attn_scratch_max_bytes)(int m_max, int nh, int hd, int ctx) {
    return KEEL_ATTN_FN(attn_scratch_bytes)(m_max < kSplitMaxM ? m_max : kSplitMaxM, nh, hd, ctx);
}

extern "C" void KEEL_ATTN_FN(kv_append)(const float *k, const float *v, const keel_ecu_vec *kb, const keel_ecu_vec *vb,
                                        float *kc, float *vc, int kvd, const int *d_pos, int m, void *st) {
    KEEL_ASSERTF(m >= 1 && kvd >= 1, "kv append of %d rows of %d", m, kvd);
    const DVec kd = {kb ? kb->p : nullptr, kb ? (int)kb->dt : 0, kb ? kb->n : 0};
    const DVec vd = {vb ? vb->p : nullptr, vb ? (int)vb->dt : 0, vb ? vb->n : 0};
    const long long n = (long long)m * kvd;
    KP_LAUNCH(keel_ecu_pdl_on(), kv_append_kernel, dim3((unsigned)((n + 255) / 256)), dim3(256), 0, st, k, v, kd, vd,
              kc, vc, kvd, d_pos, m);
    KEEL_CUDA_CHECK_LAUNCH();
}

extern "C" void KEEL_ATTN_FN(attn)(const float *q, const keel_ecu_vec *qb, const float *kc, const float *vc, int kvd,
                                   const int *d_pos, int m, int nh, int nkv, int hd, int ctx, float *scratch,
                                   uint16_t *o, float *of, void *st) {
    KEEL_ASSERTF(hd >= 1 && hd <= kMaxHeadDim, "head_dim %d (1..%d)", hd, kMaxHeadDim);
    KEEL_ASSERTF(nkv >= 1 && nh >= nkv && nh % nkv == 0 && kvd >= nkv * hd, "%d query heads over %d KV heads of %d (kvd %d)",
                 nh, nkv, hd, kvd);
    KEEL_ASSERTF(m >= 1 && ctx >= 1, "attention of %d rows over %d cache rows", m, ctx);
    const Layout l = layout_for(hd);
    AP a;
    memset(&a, 0, sizeof a);
    a.q = q, a.qb = qb ? qb->p : nullptr, a.qb_dt = qb ? (int)qb->dt : 0, a.qb_n = qb ? qb->n : 0;
    a.kc = kc, a.vc = vc, a.kvd = kvd, a.d_pos = d_pos;
    a.m = m, a.nh = nh, a.hd = hd, a.ctx = ctx;
    a.G = nh / nkv, a.HB = a.G < kPairs ? a.G : kPairs, a.RB = kPairs / a.HB, a.hgroups = (a.G + a.HB - 1) / a.HB;
    a.DG = l.DG, a.KS = l.KS, a.DX = l.DX, a.NC = (ctx + kChunk - 1) / kChunk;
    a.walk = m > kSplitMaxM, a.alias = l.alias;
    a.vec4 = hd % 4 == 0 && kvd % 4 == 0 && ((uintptr_t)kc & 15) == 0 && ((uintptr_t)vc & 15) == 0;
    a.scale = 1.0f / sqrtf((float)hd);
    a.o = o, a.of = of;
    const unsigned Y = (unsigned)(nkv * a.hgroups), Z = (unsigned)((m + a.RB - 1) / a.RB);
    unsigned X = 1;
    if (!a.walk) {
        KEEL_ASSERTF(scratch != nullptr, "split-K attention of %d rows without scratch", m);
        const size_t nc = (size_t)a.NC;
        a.part_o = scratch;
        a.part_ml = scratch + (size_t)m * nh * nc * hd;
        const unsigned want = kGridTarget / (Y * Z) > 0 ? kGridTarget / (Y * Z) : 1;
        X = (unsigned)a.NC < want ? (unsigned)a.NC : want;
    }
    const dim3 grid(X, Y, Z);
    cudaStream_t s = (cudaStream_t)st;
    if (l.PT == 1) launch_tiles<1>(a, grid, l.bytes, s);
    else if (l.PT == 2) launch_tiles<2>(a, grid, l.bytes, s);
    else launch_tiles<4>(a, grid, l.bytes, s);
    if (!a.walk) {
        KP_LAUNCH(keel_ecu_pdl_on(), attn_combine_kernel, dim3((unsigned)nh, (unsigned)m), dim3(kSeg), 0, s, a);
        KEEL_CUDA_CHECK_LAUNCH();
    }
}

#if KEEL_ATTN_TWIN
extern "C" void keel_contract_twin_ecu_attn_arm(int fault) {
    KEEL_CUDA_CHECK(cudaDeviceSynchronize());
    KEEL_CUDA_CHECK(cudaMemcpyToSymbol(g_attn_plant, &fault, sizeof fault));
}
#else
/* The attention kernels by audit symbol (contract/records). */
static const struct {
    const char *name;
    const void *fn;
} g_attn_kernels[] = {
    {"attn_tile_kernel<1>", (const void *)attn_tile_kernel<1>},
    {"attn_tile_kernel<2>", (const void *)attn_tile_kernel<2>},
    {"attn_tile_kernel<4>", (const void *)attn_tile_kernel<4>},
    {"attn_combine_kernel", (const void *)attn_combine_kernel},
    {"kv_append_kernel", (const void *)kv_append_kernel},
};

/* The host function pointer of an attention kernel by its audit symbol, for gate 5's live check. */
extern "C" const void *keel_ecu_attn_kernel_fn(const char *symbol) {
    if (!symbol) return NULL;
    for (size_t i = 0; i < sizeof g_attn_kernels / sizeof g_attn_kernels[0]; i++)
        if (!strcmp(g_attn_kernels[i].name, symbol)) return g_attn_kernels[i].fn;
    return NULL;
}

extern "C" const void *keel_ecu_attn_kernel_at(int i) {
    return i >= 0 && (size_t)i < sizeof g_attn_kernels / sizeof g_attn_kernels[0] ? g_attn_kernels[i].fn : NULL;
}
#endif
