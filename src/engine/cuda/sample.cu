/* engine/cuda: the seeded sampler on the GPU, drawing the CPU sampler's token (src/engine/sample.c) for the same
 * logits, configuration, seed and position: the same integer weights (src/engine/sample_fixed.h, whose three float
 * steps are written with explicit rounding) and the same cuts, located without sorting. One block of 1024
 * threads: a pass for the largest logit, a pass for a histogram of Y >> 7 (Y: the weight's exponent in 1/4096
 * octaves, which never falls along the order; candidate counts and exact 64-bit weight sums by integer atomics, so
 * the order of arrival does not matter), then each query (the element at a rank, or the first element whose
 * inclusive weight sum exceeds a target) narrows down to one key by radix select: the bucket holding the target is
 * found by an exact prefix sum, its elements compacted to scratch with the next digit's histogram, then the order
 * key's digits in turn down to the id bits. The position is read from device memory
 * so a captured graph replays it; nothing is allocated and nothing waits on the host. */
#include <string.h>

#include "../../kernels/cuda/port.h"
#include "../sample_fixed.h"
#include "ecuda.h"
#include "scan_fn.h"

namespace {

constexpr int kSampThreads = 1024;
constexpr int kSampBuckets = 2048;     /* 11-bit digits */
constexpr uint32_t kIdMask = 0x1fffffu; /* ids below KEEL_SAMP_VMAX = 2^21 */
constexpr int kTopShift = 7;            /* the top level's buckets: Y >> 7 < YCAP >> 7 = 1376 */
static_assert((KEEL_SAMP_YCAP >> kTopShift) <= kSampBuckets, "the top level's buckets fit the histogram");
constexpr int kPlantTies = 1, kPlantPastEnd = 2; /* the twin's faults (KEEL_SCAN_PLANT_*, src/contract/twin_scan.h) */

/* The digits of a key (order key << 32 | id), most significant first: the logit's 32 bits in 11 + 11 + 10, the
 * id's 21 bits in 10 + 11. */
__device__ __forceinline__ uint32_t digit(uint64_t key, int lvl) {
    switch (lvl) {
    case 0: return (uint32_t)(key >> 53);
    case 1: return (uint32_t)(key >> 42) & 2047u;
    case 2: return (uint32_t)(key >> 32) & 1023u;
    case 3: return (uint32_t)(key >> 11) & 1023u;
    default: return (uint32_t)key & 2047u;
    }
}

struct SampShared {
    uint32_t t1[64], t2[64];
    uint32_t hc[kSampBuckets];           /* candidates per bucket */
    unsigned long long hs[kSampBuckets]; /* their weight sum */
    uint32_t wc[32];
    unsigned long long ws[32];
    float wmax[32];
    uint32_t n, nvalid, npos, nthr, top_id, bucket, bcnt;
    unsigned long long wall, bsum;
    float lmax;
};

/* The id a planted tie fault reverses: ties then go to the higher id. */
__device__ __forceinline__ uint32_t id_code(uint32_t i) {
    return KEEL_SCAN_PLANTED(kPlantTies) ? kIdMask - i : i;
}

/* Candidate i as (key, weight > 0, the top bucket Y >> 7 of its weight's exponent); false for NaN and for weight 0
 * (which never stays). Y never falls along the order, so the buckets cut the order into consecutive runs, and
 * they spread a crowded logit range over many buckets where the key's top bits would not. */
__device__ __forceinline__ bool cand_of(const float *logits, int i, float lmax, float scale, const SampShared &sh,
                                        uint64_t *key, uint64_t *w, uint32_t *top) {
    const float l = logits[i];
    if (l != l) return false;
    const uint32_t y = keel_samp_y(l, lmax, scale);
    *w = keel_samp_w(y, sh.t1, sh.t2);
    *top = y >> kTopShift;
    if (!*w) return false;
    *key = (uint64_t)keel_samp_okey(l) << 32 | id_code((uint32_t)i);
    return true;
}

__device__ __forceinline__ uint64_t key_weight(uint64_t key, float lmax, float scale, const SampShared &sh) {
    const float l = __uint_as_float(keel_samp_okey_bits((uint32_t)(key >> 32)));
    return keel_samp_w(keel_samp_y(l, lmax, scale), sh.t1, sh.t2);
}

constexpr uint32_t kNone = 0xffffffffu; /* no bucket: the lane has no candidate this round */

/* Adds (1, w) to bucket d of (hc, hs) unless d is kNone (integer atomics: the same sums in any order). */
__device__ __forceinline__ void hist_add(uint32_t *hc, unsigned long long *hs, uint32_t d, uint64_t w) {
    if (d != kNone) atomicAdd(&hc[d], 1u), atomicAdd(&hs[d], (unsigned long long)w);
}

/* Appends key to list for each lane with take, one atomic on the count a warp. Every lane of the warp calls it. */
__device__ __forceinline__ void list_append(uint64_t *list, uint32_t *n, bool take, uint64_t key) {
    const uint32_t b = kp_ballot(take);
    if (!b) return;
    const int lane = (int)(threadIdx.x & 31u), lead = __ffs((int)b) - 1;
    uint32_t base = 0;
    if (lane == lead) base = atomicAdd(n, (uint32_t)__popc((int)b));
    base = kp_shfl(base, lead);
    if (take) list[base + (uint32_t)__popc((int)(b & ((1u << lane) - 1u)))] = key;
}

__device__ __forceinline__ unsigned long long shfl_u64(unsigned long long v, int src) {
    const uint32_t lo = kp_shfl((uint32_t)v, src), hi = kp_shfl((uint32_t)(v >> 32), src);
    return (unsigned long long)hi << 32 | lo;
}

/* Inclusive prefix sums of (c, s) over the block's threads in thread order (integers: exact). */
__device__ void block_scan(uint32_t &c, unsigned long long &s, SampShared &sh) {
    const int lane = (int)(threadIdx.x & 31u), wid = (int)(threadIdx.x >> 5);
    for (int d = 1; d < 32; d <<= 1) {
        const int src = lane >= d ? lane - d : lane;
        const uint32_t oc = kp_shfl(c, src);
        const unsigned long long os = shfl_u64(s, src);
        if (lane >= d) c += oc, s += os;
    }
    if (lane == 31) sh.wc[wid] = c, sh.ws[wid] = s;
    __syncthreads();
    if (wid == 0) {
        uint32_t wc = sh.wc[lane];
        unsigned long long ws = sh.ws[lane];
        for (int d = 1; d < 32; d <<= 1) {
            const int src = lane >= d ? lane - d : lane;
            const uint32_t oc = kp_shfl(wc, src);
            const unsigned long long os = shfl_u64(ws, src);
            if (lane >= d) wc += oc, ws += os;
        }
        sh.wc[lane] = wc, sh.ws[lane] = ws;
    }
    __syncthreads();
    if (wid > 0) c += sh.wc[wid - 1], s += sh.ws[wid - 1];
    __syncthreads();
}

/* The bucket of (hc, hs) holding the target: by count (rank `target`), or by weight (the first element whose
 * inclusive sum exceeds `target`); into sh.bucket with the count and weight of the buckets before it. */
__device__ void find_bucket(const uint32_t *hc, const unsigned long long *hs, bool by_weight,
                            unsigned long long target, SampShared &sh) {
    const int j = (int)threadIdx.x;
    const uint32_t c0 = hc[2 * j], c1 = hc[2 * j + 1];
    const unsigned long long s0 = hs[2 * j], s1 = hs[2 * j + 1];
    uint32_t c = c0 + c1;
    unsigned long long s = s0 + s1;
    block_scan(c, s, sh);
    uint32_t ec = c - c0 - c1;
    unsigned long long es = s - s0 - s1;
    for (int b = 0; b < 2; b++) {
        const uint32_t cb = b ? c1 : c0;
        const unsigned long long sb = b ? s1 : s0;
        const bool in = by_weight ? (target >= es && target - es < sb) : (target >= ec && target - ec < cb);
        if (in) sh.bucket = (uint32_t)(2 * j + b), sh.bcnt = ec, sh.bsum = es;
        ec += cb, es += sb;
    }
    __syncthreads();
}

struct Found {
    uint64_t key;
    uint32_t rank;           /* candidates before it */
    unsigned long long before; /* their weight */
};

/* The candidate at rank `target` (by count) or the first whose inclusive weight sum exceeds `target` (by weight);
 * the target must lie within the candidates. h0c/h0s: the top level's histogram; la, lb: scratch lists. */
__device__ Found select(const float *logits, int V, float lmax, float scale, bool by_weight, unsigned long long target,
                        const uint32_t *h0c, const unsigned long long *h0s, uint64_t *la, uint64_t *lb,
                        SampShared &sh) {
    Found f = {0, 0, 0};
    find_bucket(h0c, h0s, by_weight, target, sh);
    uint32_t b = sh.bucket;
    f.rank = sh.bcnt, f.before = sh.bsum;
    target -= by_weight ? sh.bsum : sh.bcnt;
    for (int i = (int)threadIdx.x; i < kSampBuckets; i += kSampThreads) sh.hc[i] = 0, sh.hs[i] = 0;
    if (threadIdx.x == 0) sh.n = 0;
    __syncthreads();
    for (int base = 0; base < V; base += kSampThreads) { /* the bucket's candidates, the key's first digit counted */
        const int i = base + (int)threadIdx.x;
        uint64_t key = 0, w = 0;
        uint32_t yb = 0;
        const bool take = i < V && cand_of(logits, i, lmax, scale, sh, &key, &w, &yb) && yb == b;
        list_append(la, &sh.n, take, key);
        hist_add(sh.hc, sh.hs, take ? digit(key, 0) : kNone, take ? w : 0u);
    }
    __syncthreads();
    uint32_t n = sh.n;
    uint64_t *src = la, *dst = lb;
    for (int lvl = 0; n > 1 && lvl <= 4; lvl++) {
        find_bucket(sh.hc, sh.hs, by_weight, target, sh);
        b = sh.bucket;
        f.rank += sh.bcnt, f.before += sh.bsum;
        target -= by_weight ? sh.bsum : sh.bcnt;
        __syncthreads(); /* every thread has read the histogram's result before it is cleared */
        for (int i = (int)threadIdx.x; i < kSampBuckets; i += kSampThreads) sh.hc[i] = 0, sh.hs[i] = 0;
        if (threadIdx.x == 0) sh.n = 0;
        __syncthreads();
        for (uint32_t base = 0; base < n; base += kSampThreads) {
            const uint32_t i = base + threadIdx.x;
            const uint64_t key = i < n ? src[i] : 0u;
            const bool take = i < n && digit(key, lvl) == b;
            list_append(dst, &sh.n, take, key);
            if (lvl < 4)
                hist_add(sh.hc, sh.hs, take ? digit(key, lvl + 1) : kNone, take ? key_weight(key, lmax, scale, sh) : 0u);
        }
        __syncthreads();
        n = sh.n;
        uint64_t *t = src;
        src = dst, dst = t;
        __syncthreads();
    }
    f.key = src[0];
    __syncthreads();
    return f;
}

__global__ void __launch_bounds__(kSampThreads) sample_kernel(const float *logits, int V, float temp, int top_k,
                                                               float top_p, float min_p, unsigned long long seed,
                                                               const int *d_pos, int *out, uint64_t *la, uint64_t *lb,
                                                               uint32_t *h0c, unsigned long long *h0s) {
    __shared__ SampShared sh;
    kp_grid_enter(); /* the previous kernel done, the next may launch */
    const int tid = (int)threadIdx.x, lane = tid & 31, wid = tid >> 5;
    if (tid < 64) sh.t1[tid] = keel_samp_t1[tid], sh.t2[tid] = keel_samp_t2[tid];
    if (tid == 0) sh.nvalid = 0, sh.npos = 0, sh.nthr = 0, sh.wall = 0, sh.top_id = 0xffffffffu;
    /* the largest candidate logit and the number of candidates */
    float mx = -INFINITY;
    uint32_t nv = 0;
    for (int i = tid; i < V; i += kSampThreads) {
        const float l = logits[i];
        if (l == l) nv++, mx = fmaxf(mx, l);
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, kp_shfl_xor_f32(mx, o));
    if (lane == 0) sh.wmax[wid] = mx;
    __syncthreads();
    if (nv) atomicAdd(&sh.nvalid, nv);
    if (tid == 0) {
        float m = sh.wmax[0];
        for (int w = 1; w < kSampThreads / 32; w++) m = fmaxf(m, sh.wmax[w]);
        sh.lmax = m == 0.0f ? 0.0f : m; /* +0 for either zero */
    }
    __syncthreads();
    const float lmax = sh.lmax;
    const uint32_t nvalid = sh.nvalid;
    if (nvalid == 0) { /* no candidate: id 0, as on the CPU */
        if (tid == 0) *out = 0;
        return;
    }
    if (!(temp > 0.0f)) { /* greedy: the lowest id of the largest logit */
        uint32_t best = 0xffffffffu;
        for (int i = tid; i < V; i += kSampThreads)
            if (logits[i] == lmax) best = min(best, id_code((uint32_t)i));
        if (best != 0xffffffffu) atomicMin(&sh.top_id, best);
        __syncthreads();
        if (tid == 0) *out = (int)id_code(sh.top_id);
        if (KEEL_SCAN_PLANTED(kPlantPastEnd) && tid == 0) out[1] = 0;
        return;
    }
    const float scale = keel_samp_scale(temp);
    const uint64_t thr = keel_samp_thr(min_p);
    for (int i = tid; i < kSampBuckets; i += kSampThreads) sh.hc[i] = 0, sh.hs[i] = 0;
    __syncthreads();
    uint32_t npos = 0, nthr = 0, top = 0xffffffffu;
    unsigned long long wall = 0;
    for (int base = 0; base < V; base += kSampThreads) { /* the top level's histogram, the counts, the total */
        const int i = base + tid;
        uint64_t key = 0, w = 0;
        uint32_t yb = 0;
        const bool c = i < V && cand_of(logits, i, lmax, scale, sh, &key, &w, &yb);
        hist_add(sh.hc, sh.hs, c ? yb : kNone, w);
        if (!c) continue;
        npos++, nthr += w >= thr, wall += w;
        if (logits[i] == lmax) top = min(top, (uint32_t)key);
    }
    if (npos) atomicAdd(&sh.npos, npos), atomicAdd(&sh.nthr, nthr), atomicAdd(&sh.wall, wall);
    if (top != 0xffffffffu) atomicMin(&sh.top_id, top);
    __syncthreads();
    for (int i = tid; i < kSampBuckets; i += kSampThreads) h0c[i] = sh.hc[i], h0s[i] = sh.hs[i];
    __syncthreads();
    const uint32_t np_all = sh.npos, top_id = id_code(sh.top_id);
    const unsigned long long w_all = sh.wall;
    const uint32_t nk = top_k > 0 && (uint32_t)top_k < nvalid ? (uint32_t)top_k : nvalid;
    const uint32_t nkp = min(nk, np_all);
    uint32_t n = max(1u, min(nkp, sh.nthr));
    if (top_p < 1.0f) { /* the prefix whose weight before each element stays below ceil(top_p x top-k mass) */
        const unsigned long long t1 =
            nkp == np_all ? w_all : select(logits, V, lmax, scale, false, nkp, h0c, h0s, la, lb, sh).before;
        const uint64_t need = keel_samp_need(top_p, t1);
        const uint32_t np =
            need == 0 ? 1u : select(logits, V, lmax, scale, true, need - 1, h0c, h0s, la, lb, sh).rank + 1;
        n = min(n, np);
    }
    int tok;
    if (n == 1) {
        tok = (int)top_id;
    } else {
        const unsigned long long tot =
            n == np_all ? w_all : select(logits, V, lmax, scale, false, n, h0c, h0s, la, lb, sh).before;
        const uint64_t t = keel_samp_target(keel_samp_r53(seed, (int64_t)*d_pos), tot);
        const Found f = select(logits, V, lmax, scale, true, t, h0c, h0s, la, lb, sh);
        tok = (int)id_code((uint32_t)f.key & kIdMask);
    }
    if (tid == 0) *out = tok;
    if (KEEL_SCAN_PLANTED(kPlantPastEnd) && tid == 0) out[1] = 0;
}

} // namespace

extern "C" size_t KEEL_SCN_FN(sample_scratch_bytes)(int V) {
    return (size_t)(V > 0 ? V : 0) * 16u + (size_t)kSampBuckets * 12u;
}

extern "C" void KEEL_SCN_FN(sample)(const float *logits, int V, float temp, int top_k, float top_p, float min_p,
                                    uint64_t seed, const int *d_pos, int *out_tok, void *scratch, void *st) {
    KEEL_ASSERTF(V >= 1 && V <= KEEL_SAMP_VMAX, "sampler vocabulary %d (1..%d)", V, KEEL_SAMP_VMAX);
    uint8_t *p = (uint8_t *)scratch;
    uint64_t *la = (uint64_t *)p, *lb = la + V;
    unsigned long long *h0s = (unsigned long long *)(lb + V);
    uint32_t *h0c = (uint32_t *)(h0s + kSampBuckets);
    KP_LAUNCH(keel_ecu_pdl_on(), sample_kernel, dim3(1), dim3(kSampThreads), 0, st, logits, V, temp, top_k, top_p,
              min_p, (unsigned long long)seed, d_pos, out_tok, la, lb, h0c, h0s);
    KEEL_CUDA_CHECK_LAUNCH();
}

#if !KEEL_SCAN_TWIN
/* The sampler's kernel by its gate-5 audit symbol (keel_ecu_scan_kernel_fn in scan.cu asks here). */
extern "C" const void *keel_ecu_sample_kernel_fn(const char *symbol) {
    if (symbol && !strcmp(symbol, "sample_kernel")) return (const void *)sample_kernel;
    return NULL;
}

extern "C" const void *keel_ecu_sample_kernel_at(int i) { return i == 0 ? (const void *)sample_kernel : NULL; }
#endif
