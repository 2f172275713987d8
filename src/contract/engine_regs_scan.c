/* contract: the GPU sampler (keel_ecu_sample, src/engine/cuda/sample.cu), the chunked Mamba-2 scan
 * (keel_ecu_ssm_chunked, src/engine/cuda/scan.cu) and the router's group filter (keel_ecu_route with n_group > 1,
 * src/engine/cuda/kernels.cu) under gates 1-4, with planted controls from their twins (twin_scan.cu; the router's
 * from twin_engine_cuda.cu). Each registration brings its own `run`:
 *   1 a launch of the first case reports no error and leaves finite outputs (the sampler: a token in [0, V))
 *   2 every buffer, scratch included, sits between canary guards; after every case the guards and the inputs are
 *     intact and every output was written
 *   3 the sampler: the token equals the CPU sampler's (keel_sampler_sample: an exact reference, one integer) on
 *     every case; the scan: outputs and final state within the bound derived below of the float64 recurrence; the
 *     router: items and experts exact, weights within (K + 12) 2^-24 |w|
 *   4 a second launch gives the same bits; the scan equals the token-by-token keel_ecu_ssm it replaces within the
 *     sum of both kernels' bounds; the router: each row launched alone gives the window's bits */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_regs_cuda.h"

const char *const keel_contract_cuda_scan_entries[] = {"keel_ecu_sample", "keel_ecu_ssm_chunked", "keel_ecu_route",
                                                       NULL};

#if !defined(KEEL_HAVE_CUDA)
int keel_contract_register_cuda_scan(keel_contract_table *t) {
    (void)t;
    return 0;
}
#else
#include "../engine/engine.h"
#include "twin_scan.h"

#define U 0x1p-24
#define ETA 0x1p-126 /* absolute slack of an fp32 exp near or below the normal range */
#define GUARD KEEL_CONTRACT_GUARD
#define MAXB 8

enum { K_SAMPLE = 1, K_SCAN, K_ROUTE };
enum { R_IN, R_OUT, R_STATE, R_SCRATCH };

typedef struct sbuf {
    keel_dtype dt;
    size_t n;
    int role;
    void *h;
    keel_contract_gbuf g;
} sbuf;

typedef struct scase {
    int kind, m, idx;
    int V, dist, pos; /* sampler */
    keel_sampler_cfg cfg;
    int NH, P, N, G;  /* scan */
    bool per_token;   /* scan: launch the token-by-token keel_ecu_ssm instead (gate 4) */
    int nb;
    sbuf b[MAXB];
} scase;

static int rbelow(keel_contract_rng *r, int n) { return (int)(keel_contract_runif(r) * n); }
static double gam(int k) { return k * U / (1.0 - k * U); }

static void add(scase *c, keel_dtype dt, size_t n, int role) {
    KEEL_ASSERT(c->nb < MAXB);
    c->b[c->nb++] = (sbuf){.dt = dt, .n = n, .role = role, .h = keel_xcalloc(n + 1, 8)};
}
static void case_free(scase *c) {
    for (int i = 0; i < c->nb; i++) free(c->b[i].h);
    c->nb = 0;
}
static size_t bytes_of(const sbuf *b) { return b->n * keel_dtype_size(b->dt); }
static double hget(const sbuf *b, const void *h, size_t i) {
    if (b->dt == KEEL_DT_I32) return ((const int32_t *)h)[i];
    if (b->dt == KEEL_DT_U32) return ((const uint32_t *)h)[i];
    if (b->dt == KEEL_DT_U8) return ((const uint8_t *)h)[i];
    return keel_dtype_get_f32(b->dt, h, i);
}
static double vget(const scase *c, int i, size_t j) { return hget(&c->b[i], c->b[i].h, j); }
static void hset(sbuf *b, size_t i, double v) { keel_dtype_set_f32(b->dt, b->h, i, (float)v); }

/* ---- the sampler's cases: vocabularies x configurations x logit distributions x positions ---- */

enum { SV_N = 5, SC_N = 12, SD_N = 6, SP_N = 2 };
static const int sample_V[SV_N] = {1, 37, 1000, 4099, 131072};

static keel_sampler_cfg sample_cfg(int i) {
    static const keel_sampler_cfg C[SC_N] = {
        {.temp = 0.0f, .top_p = 1.0f},                 /* greedy */
        {.temp = 1.0f, .top_p = 1.0f},                 /* the whole distribution */
        {.temp = 0.7f, .top_p = 0.9f},                 /* top-p */
        {.temp = 1.0f, .top_k = 1, .top_p = 1.0f},     /* top-k 1 */
        {.temp = 1.0f, .top_p = 1e-30f},               /* tiny top-p */
        {.temp = 1.0f, .top_p = 1.0f, .min_p = 0.05f}, /* min-p */
        {.temp = 1e-30f, .top_p = 1.0f},               /* tiny temperature: the tied maxima only */
        {.temp = 1e30f, .top_p = 1.0f},                /* huge temperature: flat */
        {.temp = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f},
        {.temp = 1.5f, .top_k = 1000, .top_p = 0.5f},
        {.temp = INFINITY, .top_p = 1.0f},
        {.temp = 1.0f, .top_p = 1.0f, .min_p = 1.0f}, /* the maximum and its ties */
    };
    return C[i];
}

/* Distributions: 0 normal x 3, 1 a grid with ties everywhere, 2 NaN-laced with signed zeros and -inf, 3 nearly
 * flat, 4 wide with two +inf (tied), 5 all NaN (no candidate). */
static void sample_logits(keel_contract_rng *r, float *l, int V, int d) {
    for (int i = 0; i < V; i++) {
        if (d == 0) l[i] = (float)(3.0 * keel_contract_rnorm(r));
        else if (d == 1) l[i] = (float)(rbelow(r, 9) * 0.5 - 2.0);
        else if (d == 2) l[i] = rbelow(r, 10) == 0 ? NAN : rbelow(r, 10) == 0 ? (rbelow(r, 2) ? 0.0f : -0.0f) : (float)keel_contract_rnorm(r);
        else if (d == 3) l[i] = (float)(1e-3 * keel_contract_rnorm(r));
        else if (d == 4) l[i] = (float)(30.0 * keel_contract_rnorm(r));
        else l[i] = NAN;
    }
    if (d == 2) l[rbelow(r, V)] = -INFINITY;
    if (d == 4) l[rbelow(r, V)] = INFINITY, l[rbelow(r, V)] = INFINITY;
}

/* ---- the scan's cases: (heads, head dim, state, groups, tokens) x two seeds x two distributions ---- */

typedef struct scan_shape {
    int NH, P, N, G, m;
} scan_shape;
static const scan_shape scan_shapes[] = {
    {2, 16, 48, 1, 1},   {2, 16, 48, 1, 3},    {4, 24, 48, 2, 31}, {4, 24, 48, 2, 33},
    {4, 24, 48, 2, 64},  {16, 64, 128, 8, 100}, {8, 16, 128, 2, 256},
};
enum { SCAN_SHAPES = sizeof scan_shapes / sizeof scan_shapes[0] };

/* ---- the router's cases: E experts in 8 groups, the best 2 groups kept, top 6; windows of 1..8 rows ---- */

enum { RT_E = 64, RT_K = 6, RT_G = 8, RT_TG = 2, RT_PER = RT_E / RT_G };
static const double rt_corr[RT_PER] = {0.125, 0.0, -0.125, 0.0, 0.125, -0.125, 0.0, 0.125}; /* by slot in group */

static int n_cases(int kind, int gate) {
    if (gate == 1) return 1;
    if (kind == K_SAMPLE) return SV_N * SC_N * SD_N * SP_N;
    if (kind == K_SCAN) return SCAN_SHAPES * 4;
    return 8 * 2; /* m = 1..8, two seeds */
}

/* The float64 view of a router row: biased scores b (masked groups at 0), sigmoid scores sg, the kept groups. */
static void route_row_ref(const float *l, double *sg, double *b, bool *keep_g) {
    double gs[RT_G];
    for (int i = 0; i < RT_E; i++) sg[i] = 1.0 / (1.0 + exp(-(double)l[i])), b[i] = sg[i] + rt_corr[i % RT_PER];
    for (int q = 0; q < RT_G; q++) {
        double t1 = -INFINITY, t2 = -INFINITY;
        for (int i = q * RT_PER; i < (q + 1) * RT_PER; i++)
            if (b[i] > t1) t2 = t1, t1 = b[i];
            else if (b[i] > t2) t2 = b[i];
        gs[q] = t1 + t2, keep_g[q] = false;
    }
    for (int t = 0; t < RT_TG; t++) {
        int best = -1;
        for (int q = 0; q < RT_G; q++)
            if (!keep_g[q] && (best < 0 || gs[q] > gs[best])) best = q;
        keep_g[best] = true;
    }
    for (int i = 0; i < RT_E; i++)
        if (!keep_g[i / RT_PER]) b[i] = 0.0;
}

/* Two groups are the same when their logits are (the correction bias repeats per group): same floats, same sums. */
static bool same_group(const float *l, int a, int c) {
    return memcmp(l + a * RT_PER, l + c * RT_PER, RT_PER * sizeof(float)) == 0;
}

/* Whether float arithmetic must make the choices float64 makes on this row. The kernel's biased score is
 * fl(fl(1 / fl(1 + expf(-l))) + corr): expf within 2 ulp (4u, u = 2^-24), the add and the division one rounding
 * each, so the sigmoid is within 6u relative (it is below 1: 6u absolute) and the biased score (|b| <= 1.125)
 * within 6u + 2u = 8u. A group score adds the top two: within 2 x 8u + 3u = 19u, the top-two choice itself being
 * 1-Lipschitz. So the kept groups are float64's when the last kept and the first dropped group scores differ by
 * more than 2 x 19u (asked: 64u), or the two groups are the same (an exact tie in both: the lower id); and the
 * chosen experts and their order are float64's when each adjacent pair of the K + 1 best differ by more than
 * 2 x 8u (asked: 32u) or are the same (logit and correction, or both masked to 0). */
static bool route_row_ok(const float *l, bool tie_row) {
    double sg[RT_E], b[RT_E], gs[RT_G];
    bool keep_g[RT_G];
    route_row_ref(l, sg, b, keep_g);
    int order[RT_G];
    for (int q = 0; q < RT_G; q++) {
        double t1 = -INFINITY, t2 = -INFINITY;
        for (int i = q * RT_PER; i < (q + 1) * RT_PER; i++) {
            const double v = sg[i] + rt_corr[i % RT_PER];
            if (v > t1) t2 = t1, t1 = v;
            else if (v > t2) t2 = v;
        }
        gs[q] = t1 + t2, order[q] = q;
    }
    for (int i = 1; i < RT_G; i++) /* by score descending, lower group first on ties */
        for (int j = i; j > 0 && (gs[order[j]] > gs[order[j - 1]] ||
                                   (gs[order[j]] == gs[order[j - 1]] && order[j] < order[j - 1]));
             j--) {
            const int t = order[j];
            order[j] = order[j - 1], order[j - 1] = t;
        }
    for (int q = 0; q + 1 < RT_G; q++) { /* every adjacent pair around the cut: apart, or the same group */
        if (q + 1 < RT_TG - 1 || q > RT_TG) continue;
        const int a = order[q], c = order[q + 1];
        if (!(gs[a] - gs[c] > 64 * U) && !same_group(l, a, c)) return false;
    }
    if (tie_row && !same_group(l, order[RT_TG - 1], order[RT_TG])) return false;
    int idx[RT_E];
    for (int i = 0; i < RT_E; i++) idx[i] = i;
    for (int i = 1; i < RT_E; i++)
        for (int j = i; j > 0 && (b[idx[j]] > b[idx[j - 1]] || (b[idx[j]] == b[idx[j - 1]] && idx[j] < idx[j - 1])); j--) {
            const int t = idx[j];
            idx[j] = idx[j - 1], idx[j - 1] = t;
        }
    bool tied_group_chosen = !tie_row;
    for (int k = 0; k < RT_K; k++) {
        const int a = idx[k], c = idx[k + 1];
        const bool same = (b[a] == 0.0 && b[c] == 0.0) || (l[a] == l[c] && rt_corr[a % RT_PER] == rt_corr[c % RT_PER] &&
                                                          keep_g[a / RT_PER] == keep_g[c / RT_PER]);
        if (!(b[a] - b[c] > 32 * U) && !same) return false;
        if (tie_row && a / RT_PER == order[RT_TG - 1]) tied_group_chosen = true;
    }
    return tied_group_chosen; /* a tie row's tie decides experts: a control flipping ties must show */
}

/* Buffers and inputs of case i of a kind (gate 1: the first). */
static void make_case(int kind, int i, scase *c) {
    memset(c, 0, sizeof *c);
    c->kind = kind, c->idx = i;
    if (kind == K_SAMPLE) {
        const int p = i % SP_N, d = (i / SP_N) % SD_N, ci = (i / (SP_N * SD_N)) % SC_N, vi = i / (SP_N * SD_N * SC_N);
        c->V = sample_V[vi], c->dist = d, c->m = 1;
        c->cfg = sample_cfg(ci);
        c->cfg.seed = 0x5eed0000ull + (uint64_t)i * 7919u;
        c->pos = p ? 1000003 + i : i;
        keel_contract_rng r = {0x9e3779b97f4a7c15ull ^ (uint64_t)(i + 1) * 0x2545f4914f6cdd1dull};
        add(c, KEEL_DT_F32, (size_t)c->V, R_IN);
        add(c, KEEL_DT_I32, 1, R_IN);
        add(c, KEEL_DT_I32, 1, R_OUT);
        add(c, KEEL_DT_U8, keel_ecu_sample_scratch_bytes(c->V), R_SCRATCH);
        sample_logits(&r, c->b[0].h, c->V, d);
        ((int32_t *)c->b[1].h)[0] = c->pos;
    } else if (kind == K_SCAN) {
        const scan_shape *s = &scan_shapes[i / 4];
        const int seed = 1 + (i & 1), big = (i >> 1) & 1;
        c->NH = s->NH, c->P = s->P, c->N = s->N, c->G = s->G, c->m = s->m;
        const size_t DI = (size_t)s->NH * s->P, CD = DI + 2u * (size_t)s->G * s->N, m = (size_t)s->m;
        add(c, KEEL_DT_F32, m * CD, R_IN);                              /* xbc = x | B | C */
        add(c, KEEL_DT_F32, m * (size_t)(s->NH + 4), R_IN);             /* proj rows, dt at column 4 */
        add(c, KEEL_DT_F32, DI * (size_t)s->N, R_STATE);                /* state (NH, P, N) */
        add(c, KEEL_DT_BF16, (size_t)s->NH, R_IN);                      /* dt_bias */
        add(c, KEEL_DT_F32, (size_t)s->NH, R_IN);                       /* A_log */
        add(c, KEEL_DT_BF16, (size_t)s->NH, R_IN);                      /* D */
        add(c, KEEL_DT_F32, m * DI, R_OUT);                             /* y */
        keel_contract_rng r = {0x1234567ull + (uint64_t)seed * 0x9e3779b97f4a7c15ull + (uint64_t)i};
        const double mag = big ? 64.0 : 1.0;
        for (size_t j = 0; j < c->b[0].n; j++) hset(&c->b[0], j, keel_contract_rnorm(&r) * mag);
        for (size_t j = 0; j < c->b[1].n; j++) hset(&c->b[1], j, keel_contract_rnorm(&r));
        for (size_t j = 0; j < c->b[2].n; j++) hset(&c->b[2], j, keel_contract_rnorm(&r) * mag);
        for (int h = 0; h < s->NH; h++)
            hset(&c->b[3], h, 0.5 * keel_contract_rnorm(&r)), hset(&c->b[4], h, 2.0 * keel_contract_runif(&r) - 1.0), hset(&c->b[5], h, keel_contract_rnorm(&r));
    } else {
        c->m = 1 + i % 8;
        const int m = c->m;
        add(c, KEEL_DT_F32, (size_t)m * RT_E, R_IN);
        add(c, KEEL_DT_F32, RT_E, R_IN);
        add(c, KEEL_DT_U32, (size_t)m * RT_K * 2, R_OUT);
        add(c, KEEL_DT_F32, (size_t)m * RT_K * 8, R_OUT);
        add(c, KEEL_DT_I32, (size_t)m * RT_K, R_OUT);
        for (int e = 0; e < RT_E; e++) hset(&c->b[1], e, rt_corr[e % RT_PER]);
        keel_contract_rng r = {0xabcdef12345ull + (uint64_t)i * 0x9e3779b97f4a7c15ull};
        for (int row = 0; row < m; row++) {
            float *l = (float *)c->b[0].h + (size_t)row * RT_E;
            const bool tie = (row + i / 8) % 2 == 1; /* every other row ties two groups at the cut */
            for (int tries = 0;; tries++) {
                KEEL_ASSERTF(tries < 100000, "router case %d row %d: no row with the margins", i, row);
                for (int e = 0; e < RT_E; e++) l[e] = (float)(floor(keel_contract_runif(&r) * 65.0) / 16.0 - 2.0);
                if (tie) { /* make the 2nd and 3rd best groups the same */
                    double sg[RT_E], b[RT_E], gs[RT_G];
                    bool kg[RT_G];
                    route_row_ref(l, sg, b, kg);
                    int o[RT_G];
                    for (int q = 0; q < RT_G; q++) {
                        double t1 = -INFINITY, t2 = -INFINITY;
                        for (int e = q * RT_PER; e < (q + 1) * RT_PER; e++) {
                            const double v = sg[e] + rt_corr[e % RT_PER];
                            if (v > t1) t2 = t1, t1 = v;
                            else if (v > t2) t2 = v;
                        }
                        gs[q] = t1 + t2, o[q] = q;
                    }
                    for (int a = 1; a < RT_G; a++)
                        for (int j = a; j > 0 && gs[o[j]] > gs[o[j - 1]]; j--) {
                            const int t = o[j];
                            o[j] = o[j - 1], o[j - 1] = t;
                        }
                    memcpy(l + o[RT_TG] * RT_PER, l + o[RT_TG - 1] * RT_PER, RT_PER * sizeof(float));
                }
                if (route_row_ok(l, tie)) break;
            }
        }
    }
}

/* ---- float64 references and bounds ---- */

static size_t n_out(const scase *c) {
    size_t t = 0;
    for (int i = 0; i < c->nb; i++)
        if (c->b[i].role == R_OUT || c->b[i].role == R_STATE) t += c->b[i].n;
    return t;
}

/* dt = softplus(fl(raw + bias)) relative to softplus(raw + bias): the sum's rounding through softplus' sensitivity
 * (at most 1 above 0, |v| below), expf (2 ulp: 4u), log1pf and the add; all of it below e^-80, where expf leaves
 * the normal range. */
static double eps_dt(double v) { return v < -80.0 ? 1.0 : (8.0 + (v < 0 ? -v : 0.0)) * U; }

/* The scan's exact recurrence (state then y, per output) and two bounds: bc for the chunked kernel, bt for the
 * token-by-token one. Per token, dt and A dt as above (A = -expf(A_log): 4u; the product: u); exp of a value x
 * known within d is exp(x) within expm1(d + 5u) relative and 2^-126 absolute. Token by token (kernels.cu): the
 * state row s = fl(fl(dA s) + fl(fl(x dt) B)) and y = a warp sum of s C (ceil(N/32) terms a lane and 5 levels)
 * plus fl(D x). Chunked (scan.cu), per chunk of 32 tokens: a(t,s) = A dt_{s+1} + ... + A dt_t summed in order
 * (t-s-1 roundings of partial sums no larger than |a|), G = C_t . B_s (N roundings), M = fl(fl(G exp(a)) dt), y
 * = fl(fl(sum_s fl(M x_s) + fl(exp(a(t,-1)) C_t . H)) + fl(D x)) with C_t . H summed over ceil(N/16) terms a
 * lane and a 4-level tree, and H = fl(fl(exp(a(L-1,-1)) H) + sum_s fl(fl(fl(exp(a(L-1,s)) dt_s) x_s) B_s)). The
 * error of H carries from chunk to chunk (and from token to token). Each bound is first-order exact in these
 * roundings, with products of relative errors kept whole, then widened by 5%. */
static void scan_reference(const scase *c, double *ref, double *bc, double *bt) {
    const int NH = c->NH, P = c->P, N = c->N, G = c->G, m = c->m, L = 32;
    const int DI = NH * P, CD = DI + 2 * G * N, ld = NH + 4;
    const size_t ns = (size_t)DI * N, pn = (size_t)P * N;
    double *dt = keel_xmalloc((size_t)m * sizeof(double)), *edt = keel_xmalloc((size_t)m * sizeof(double));
    double *adt = keel_xmalloc((size_t)m * sizeof(double)), *ead = keel_xmalloc((size_t)m * sizeof(double));
    double *dec = keel_xmalloc((size_t)L * (L + 1) * sizeof(double)), *rdec = keel_xmalloc((size_t)L * (L + 1) * sizeof(double));
    double *Mm = keel_xmalloc((size_t)L * L * sizeof(double)), *eM = keel_xmalloc((size_t)L * L * sizeof(double));
    double *s = keel_xmalloc(pn * sizeof(double)), *es = keel_xmalloc(pn * sizeof(double));
    double *H = keel_xmalloc(pn * sizeof(double)), *eH = keel_xmalloc(pn * sizeof(double));
    double *acc = keel_xmalloc((size_t)N * sizeof(double)), *eacc = keel_xmalloc((size_t)N * sizeof(double));
    double *macc = keel_xmalloc((size_t)N * sizeof(double));
    const int nj = (N + 15) / 16, nw = (N + 31) / 32;
#define XBC(t, j) vget(c, 0, (size_t)(t) * CD + (size_t)(j))
#define BV(t, n) XBC(t, DI + (size_t)grp * N + (n))
#define CV(t, n) XBC(t, DI + (size_t)G * N + (size_t)grp * N + (n))
    for (int h = 0; h < NH; h++) {
        const int grp = h / (NH / G);
        const double A = -exp(vget(c, 4, (size_t)h)), D = vget(c, 5, (size_t)h), bias = vget(c, 3, (size_t)h);
        for (int t = 0; t < m; t++) {
            const double v = vget(c, 1, (size_t)t * ld + 4 + h) + bias;
            dt[t] = v > 0 ? v + log1p(exp(-v)) : log1p(exp(v));
            edt[t] = eps_dt(v);
            adt[t] = A * dt[t];
            ead[t] = (1 + edt[t]) * (1 + 4 * U) * (1 + U) - 1;
        }
        for (size_t i = 0; i < pn; i++) s[i] = H[i] = vget(c, 2, (size_t)h * pn + i), es[i] = eH[i] = 0;
        for (int t0 = 0; t0 < m; t0 += L) {
            const int Lc = m - t0 < L ? m - t0 : L;
            /* the chunk's decays exp(a(t,s)) (index s + 1; s = -1 from the state) and the masked products M */
            for (int t = 0; t < Lc; t++) {
                double a = 0, aa = 0, ea = 0;
                dec[t * (L + 1) + t + 1] = 1.0, rdec[t * (L + 1) + t + 1] = 0.0;
                for (int sidx = t - 1; sidx >= -1; sidx--) {
                    const int r = t0 + sidx + 1, cnt = t - sidx;
                    a += adt[r], aa += fabs(adt[r]) * (1 + ead[r]), ea += fabs(adt[r]) * ead[r];
                    dec[t * (L + 1) + sidx + 1] = exp(a);
                    rdec[t * (L + 1) + sidx + 1] = expm1(ea + (cnt - 1) * U * aa + 5 * U);
                }
            }
            for (int t = 0; t < Lc; t++)
                for (int sidx = 0; sidx <= t; sidx++) {
                    double g = 0, ga = 0;
                    for (int n = 0; n < N; n++) g += CV(t0 + t, n) * BV(t0 + sidx, n), ga += fabs(CV(t0 + t, n) * BV(t0 + sidx, n));
                    const double de = dec[t * (L + 1) + sidx + 1], rd = rdec[t * (L + 1) + sidx + 1];
                    const double d_t = dt[t0 + sidx], e_t = edt[t0 + sidx];
                    const double decmag = de * (1 + rd) + ETA, gmag = fabs(g) + gam(N) * ga;
                    const double mmag = gmag * decmag * d_t * (1 + e_t) * (1 + U) * (1 + U);
                    Mm[t * L + sidx] = g * de * d_t;
                    eM[t * L + sidx] = gam(N) * ga * decmag * d_t * (1 + e_t) +
                                       fabs(g) * (de * d_t * ((1 + rd) * (1 + e_t) - 1) + ETA * d_t * (1 + e_t)) +
                                       (2 * U + U * U) * mmag;
                }
            for (int p = 0; p < P; p++) {
                double *sp = s + (size_t)p * N, *esp = es + (size_t)p * N, *Hp = H + (size_t)p * N, *eHp = eH + (size_t)p * N;
                for (int t = 0; t < Lc; t++) {
                    const int tt = t0 + t;
                    const double xv = XBC(tt, (size_t)h * P + p), Dx = D * xv;
                    /* exact: one token of the recurrence; bound of the token-by-token kernel alongside */
                    const double sdA = exp(adt[tt]), rdA = expm1(fabs(adt[tt]) * ead[tt] + 5 * U);
                    const double rxb = (1 + edt[tt]) * (1 + U) * (1 + U) - 1;
                    double yacc = 0, ymag = 0, yeacc = 0;
                    for (int n = 0; n < N; n++) {
                        const double s0 = sp[n], xb = xv * dt[tt] * BV(tt, n), Cn = CV(tt, n);
                        const double amag = sdA * (fabs(s0) + esp[n]) * (1 + rdA) + ETA * (fabs(s0) + esp[n]);
                        const double e1 = sdA * esp[n] + (fabs(s0) + esp[n]) * (sdA * rdA + ETA) + U * amag;
                        sp[n] = sdA * s0 + xb;
                        esp[n] = 1.05 * (e1 + fabs(xb) * rxb + U * (amag + fabs(xb) * (1 + rxb)) * (1 + U));
                        yacc += sp[n] * Cn, ymag += (fabs(sp[n]) + esp[n]) * fabs(Cn), yeacc += esp[n] * fabs(Cn);
                    }
                    const size_t yo = ns + (size_t)tt * DI + (size_t)h * P + p;
                    ref[yo] = yacc + Dx;
                    bt[yo] = 1.05 * (yeacc + gam(nw + 6) * ymag + U * fabs(Dx) +
                                     U * (ymag * (1 + gam(nw + 6)) + fabs(Dx) * (1 + U)));
                    /* chunked: the masked products over s <= t, then C_t . H from the chunk's start */
                    double ia = 0, ie = 0;
                    for (int sidx = 0; sidx <= t; sidx++) {
                        const double xs = fabs(XBC(t0 + sidx, (size_t)h * P + p));
                        ia += (fabs(Mm[t * L + sidx]) + eM[t * L + sidx]) * xs, ie += eM[t * L + sidx] * xs * (1 + U);
                    }
                    ie += gam(t + 2) * ia;
                    double dot = 0, dmag = 0, de_ = 0;
                    for (int n = 0; n < N; n++) {
                        const double Cn = CV(tt, n);
                        dot += Cn * Hp[n], dmag += fabs(Cn) * (fabs(Hp[n]) + eHp[n]), de_ += fabs(Cn) * eHp[n];
                    }
                    de_ += gam(nj + 5) * dmag;
                    const double d0 = dec[t * (L + 1)], r0 = rdec[t * (L + 1)];
                    const double imag = (d0 * (1 + r0) + ETA) * (fabs(dot) + de_);
                    const double ei = d0 * (1 + r0) * de_ + fabs(dot) * (d0 * r0 + ETA) + U * imag;
                    bc[yo] = 1.05 * (ie + ei + U * fabs(Dx) +
                                     gam(2) * (ia * (1 + gam(t + 2)) + imag * (1 + U) + fabs(Dx) * (1 + U)));
                }
                /* the state passed to the next chunk */
                const int tl = Lc - 1;
                const double dL = dec[tl * (L + 1)], rL = rdec[tl * (L + 1)];
                for (int n = 0; n < N; n++) acc[n] = 0, eacc[n] = 0, macc[n] = 0;
                for (int sidx = 0; sidx < Lc; sidx++) {
                    const double xs = XBC(t0 + sidx, (size_t)h * P + p), d_t = dt[t0 + sidx], e_t = edt[t0 + sidx];
                    const double dS = dec[tl * (L + 1) + sidx + 1], rS = rdec[tl * (L + 1) + sidx + 1];
                    const double cs = dS * d_t * xs, rc = (1 + rS) * (1 + e_t) * (1 + U) * (1 + U) - 1;
                    const double ec = fabs(cs) * rc + ETA * d_t * fabs(xs) * (1 + e_t) * (1 + U) * (1 + U);
                    for (int n = 0; n < N; n++) {
                        const double Bn = BV(t0 + sidx, n);
                        acc[n] += cs * Bn, macc[n] += (fabs(cs) + ec) * fabs(Bn), eacc[n] += ec * fabs(Bn);
                    }
                }
                for (int n = 0; n < N; n++) {
                    const double ea = eacc[n] + gam(Lc + 1) * macc[n];
                    const double hmag = (dL * (1 + rL) + ETA) * (fabs(Hp[n]) + eHp[n]);
                    const double eh = dL * (1 + rL) * eHp[n] + fabs(Hp[n]) * (dL * rL + ETA) + U * hmag;
                    eHp[n] = 1.05 * (eh + ea + U * (hmag * (1 + U) + macc[n] * (1 + gam(Lc + 1))));
                    Hp[n] = sp[n]; /* the exact state at the next chunk's start */
                }
            }
        }
        for (size_t i = 0; i < pn; i++) {
            const size_t o = (size_t)h * pn + i;
            ref[o] = s[i], bt[o] = es[i] + U * fabs(s[i]), bc[o] = eH[i];
        }
    }
#undef XBC
#undef BV
#undef CV
    free(dt), free(edt), free(adt), free(ead), free(dec), free(rdec), free(Mm), free(eM);
    free(s), free(es), free(H), free(eH), free(acc), free(eacc), free(macc);
}

/* scan_reference of a case, computed once per process (the controls and gate 4 ask again for the same cases). */
static const double *const *scan_ref_cached(const scase *c) {
    static double *cache[SCAN_SHAPES * 4][3];
    KEEL_ASSERT(c->idx >= 0 && c->idx < SCAN_SHAPES * 4);
    double **e = cache[c->idx];
    if (!e[0]) {
        const size_t N = n_out(c);
        for (int k = 0; k < 3; k++) e[k] = keel_xcalloc(N + 1, sizeof(double));
        scan_reference(c, e[0], e[1], e[2]);
    }
    return (const double *const *)e;
}

/* The router's float64 reference: items (expert, mask 1), weights [item][8] (slot 0 only), sel; weights within
 * (K + 12) u |w| (K sigmoid sums, the division, the scaling). */
static void route_reference(const scase *c, double *ref, double *bnd) {
    const int m = c->m;
    const size_t o_w = (size_t)m * RT_K * 2, o_sel = o_w + (size_t)m * RT_K * 8;
    for (int r = 0; r < m; r++) {
        double sg[RT_E], b[RT_E];
        bool kg[RT_G], used[RT_E] = {false};
        route_row_ref((const float *)c->b[0].h + (size_t)r * RT_E, sg, b, kg);
        int sel[RT_K];
        double sum = 0;
        for (int k = 0; k < RT_K; k++) {
            int best = -1;
            for (int i = 0; i < RT_E; i++)
                if (!used[i] && (best < 0 || b[i] > b[best])) best = i;
            used[best] = true, sel[k] = best, sum += sg[best];
        }
        for (int k = 0; k < RT_K; k++) {
            const size_t it = (size_t)r * RT_K + k;
            ref[it * 2] = sel[k], ref[it * 2 + 1] = 1, ref[o_sel + it] = sel[k];
            for (int j = 0; j < 8; j++) {
                const double w = j == 0 ? sg[sel[k]] / (sum + 1e-20) * 2.5 : 0.0;
                ref[o_w + it * 8 + j] = w, bnd[o_w + it * 8 + j] = (RT_K + 12) * U * fabs(w);
            }
        }
    }
}

/* ---- device side ---- */

static void *dptr(const sbuf *b) { return (uint8_t *)b->g.dev + GUARD; }

typedef struct skern {
    void (*sample)(const float *, int, float, int, float, float, uint64_t, const int *, int *, void *, void *);
    void (*ssm)(const float *, int, const float *, int, int, float *, const keel_ecu_vec *, const keel_ecu_vec *,
                const keel_ecu_vec *, int, int, int, int, int, float *, void *);
    void (*route)(const float *, const keel_ecu_vec *, int, int, int, int, bool, float, int, keel_cuda_route *,
                  float *, int *, void *);
} skern;

static const skern REAL = {keel_ecu_sample, keel_ecu_ssm_chunked, keel_ecu_route};
static const skern TWIN = {keel_contract_twin_ecu_sample, keel_contract_twin_ecu_ssm_chunked,
                           keel_contract_twin_ecu_route};

static keel_ecu_vec vec(const scase *c, int i) { return (keel_ecu_vec){dptr(&c->b[i]), c->b[i].dt, (int)c->b[i].n}; }

static void launch_with(const skern *K, const scase *c) {
    void *p[MAXB];
    for (int i = 0; i < c->nb; i++) p[i] = dptr(&c->b[i]);
    if (c->kind == K_SAMPLE) {
        K->sample(p[0], c->V, c->cfg.temp, c->cfg.top_k, c->cfg.top_p, c->cfg.min_p, c->cfg.seed, p[1], p[2], p[3], NULL);
    } else if (c->kind == K_SCAN) {
        keel_ecu_vec dtb = vec(c, 3), al = vec(c, 4), D = vec(c, 5);
        const int DI = c->NH * c->P, CD = DI + 2 * c->G * c->N;
        (c->per_token ? keel_ecu_ssm : K->ssm)(p[0], CD, p[1], c->NH + 4, 4, p[2], &dtb, &al, &D, c->NH, c->P, c->N,
                                               c->G, c->m, p[6], NULL);
    } else {
        keel_ecu_vec corr = vec(c, 1);
        K->route(p[0], &corr, RT_E, RT_K, RT_G, RT_TG, true, 2.5f, c->m, p[2], p[3], p[4], NULL);
    }
}

static void launch_real(const keel_contract_reg *reg, const keel_contract_args *a) {
    (void)reg;
    launch_with(&REAL, a->x);
}

#define TWIN_SCAN(fault)                                                                      \
    static void twin_##fault(const keel_contract_reg *reg, const keel_contract_args *a) {    \
        (void)reg;                                                                            \
        keel_contract_twin_scan_arm(KEEL_SCAN_PLANT_##fault);                                \
        launch_with(&TWIN, a->x);                                                             \
    }
TWIN_SCAN(TIES)
TWIN_SCAN(PASTEND)
TWIN_SCAN(NODSKIP)
TWIN_SCAN(DECAY)
TWIN_SCAN(RERUN)

static void twin_route_ties(const keel_contract_reg *reg, const keel_contract_args *a) {
    (void)reg;
    keel_contract_twin_ecu_arm(KEEL_ECU_PLANT_TIES);
    launch_with(&TWIN, a->x);
}

/* Launches c on guarded device copies and fetches every output and state (host dtypes) into outs; false with a
 * reason when the launch, a guard, an input or an unwritten output says so (the last three with `check`). */
static bool run_case(const keel_contract_reg *reg, keel_contract_launch_fn launch, scase *c, void **outs, bool check,
                     char *why, size_t cap) {
    const keel_contract_backend *be = reg->be;
    static const char *const names[MAXB] = {"buffer 0", "buffer 1", "buffer 2", "buffer 3",
                                            "buffer 4", "buffer 5", "buffer 6", "buffer 7"};
    for (int i = 0; i < c->nb; i++) {
        const sbuf *b = &c->b[i];
        const bool data = b->role == R_IN || b->role == R_STATE;
        keel_contract_gbuf_make(&c->b[i].g, be, names[i], data ? b->h : NULL, bytes_of(b), 11 + i);
    }
    keel_contract_args a = {.x = c, .m = c->m};
    launch(reg, &a);
    bool ok = be->sync(why, cap);
    for (int i = 0; i < c->nb; i++) {
        sbuf *b = &c->b[i];
        const size_t nb = bytes_of(b);
        uint8_t *back = keel_xmalloc(nb + 2 * GUARD);
        be->download(back, b->g.dev, nb + 2 * GUARD);
        if (ok && check) ok = keel_contract_gbuf_check(&b->g, back, b->role == R_IN, why, cap);
        if (ok && check && b->role == R_OUT) {
            const size_t es = keel_dtype_size(b->dt);
            for (size_t j = 0; ok && j < b->n; j++) {
                size_t u = 0;
                while (u < es && back[GUARD + j * es + u] == KEEL_CONTRACT_UNWRITTEN) u++;
                if (u == es) {
                    snprintf(why, cap, "output buffer %d element %zu was not written", i, j);
                    ok = false;
                }
            }
        }
        if (outs && (b->role == R_OUT || b->role == R_STATE)) {
            outs[i] = keel_xmalloc(nb + 8);
            memcpy(outs[i], back + GUARD, nb);
        }
        free(back);
    }
    for (int i = 0; i < c->nb; i++) keel_contract_gbuf_free(&c->b[i].g, be);
    return ok;
}

static void free_outs(const scase *c, void **outs) {
    for (int i = 0; i < c->nb; i++) free(outs[i]), outs[i] = NULL;
}

static bool same_bits(const scase *c, void **a, void **b, char *why, size_t cap) {
    for (int i = 0; i < c->nb; i++)
        if (a[i] && b[i] && memcmp(a[i], b[i], bytes_of(&c->b[i])) != 0) {
            snprintf(why, cap, "output %d of a second launch differs bit for bit", i);
            return false;
        }
    return true;
}

/* Gate 1's extra check: a token in [0, V), finite floats. */
static bool finite_outs(const scase *c, void **outs, char *why, size_t cap) {
    if (c->kind == K_SAMPLE) {
        const int tok = ((const int32_t *)outs[2])[0];
        if (tok < 0 || tok >= c->V) {
            snprintf(why, cap, "token %d outside [0, %d)", tok, c->V);
            return false;
        }
        return true;
    }
    for (int i = 0; i < c->nb; i++)
        for (size_t j = 0; outs[i] && (c->b[i].dt == KEEL_DT_F32) && j < c->b[i].n; j++)
            if (!isfinite(hget(&c->b[i], outs[i], j))) {
                snprintf(why, cap, "output %d element %zu is not finite", i, j);
                return false;
            }
    return true;
}

static void describe(const scase *c, char *buf, size_t cap) {
    if (c->kind == K_SAMPLE)
        snprintf(buf, cap, "V %d dist %d temp %g top_k %d top_p %g min_p %g seed %llu pos %d", c->V, c->dist,
                 (double)c->cfg.temp, c->cfg.top_k, (double)c->cfg.top_p, (double)c->cfg.min_p,
                 (unsigned long long)c->cfg.seed, c->pos);
    else if (c->kind == K_SCAN)
        snprintf(buf, cap, "heads %d P %d N %d groups %d m %d", c->NH, c->P, c->N, c->G, c->m);
    else
        snprintf(buf, cap, "E %d K %d groups %d keep %d m %d", RT_E, RT_K, RT_G, RT_TG, c->m);
}

/* Outputs against ref within bnd (integers exactly); float outputs that are all equal fail. */
static bool check_within(const scase *c, void **outs, const double *ref, const double *bnd, const char *what,
                         keel_contract_gate_result *gr) {
    size_t at = 0;
    for (int i = 0; i < c->nb; i++) {
        const sbuf *b = &c->b[i];
        if (b->role != R_OUT && b->role != R_STATE) continue;
        const bool integer = b->dt == KEEL_DT_I32 || b->dt == KEEL_DT_U32;
        bool varied = integer || b->n < 2;
        for (size_t j = 0; j < b->n; j++) {
            const double y = hget(b, outs[i], j), d = fabs(y - ref[at + j]), e = integer ? 0.0 : bnd[at + j];
            if (j && y != hget(b, outs[i], 0)) varied = true;
            const double frac = e > 0 ? d / e : (d > 0 ? INFINITY : 0.0);
            if (frac > gr->frac || gr->bound_at_max == 0) gr->frac = frac, gr->max_err = d, gr->bound_at_max = e;
            if (!(d <= e)) {
                char cs[160];
                describe(c, cs, sizeof cs);
                snprintf(gr->detail, sizeof gr->detail, "%s, output %d element %zu: got %.9g, %s %.9g, |d| %.3g, bound %.3g", cs,
                         i, j, y, what, ref[at + j], d, e);
                return false;
            }
        }
        if (!varied) {
            snprintf(gr->detail, sizeof gr->detail, "output %d: all %zu values equal (a vacuous pass)", i, b->n);
            return false;
        }
        at += b->n;
    }
    return true;
}

static bool gate3(const scase *c, void **outs, keel_contract_gate_result *gr) {
    if (c->kind == K_SAMPLE) {
        keel_sampler s;
        keel_sampler_init(&s, &c->cfg, c->V);
        const int want = keel_sampler_sample(&s, c->b[0].h, c->pos), got = ((const int32_t *)outs[2])[0];
        keel_sampler_free(&s);
        gr->bound_at_max = 0;
        if (got != want) {
            char cs[160];
            describe(c, cs, sizeof cs);
            snprintf(gr->detail, sizeof gr->detail, "%s: token %d, the CPU sampler's %d", cs, got, want);
            return false;
        }
        return true;
    }
    if (c->kind == K_SCAN) {
        const double *const *e = scan_ref_cached(c);
        return check_within(c, outs, e[0], e[1], "float64 reference", gr);
    }
    const size_t N = n_out(c);
    double *ref = keel_xcalloc(N + 1, sizeof(double)), *bnd = keel_xcalloc(N + 1, sizeof(double));
    route_reference(c, ref, bnd);
    const bool ok = check_within(c, outs, ref, bnd, "float64 reference", gr);
    free(ref), free(bnd);
    return ok;
}

/* Gate 4 beyond repeat bits: the scan against the token-by-token kernel; the router's rows alone. */
static bool gate4(const keel_contract_reg *reg, keel_contract_launch_fn launch, scase *c, void **o1,
                  keel_contract_gate_result *gr) {
    void *o2[MAXB] = {0};
    bool ok = true;
    if (c->kind == K_SCAN) {
        c->per_token = true;
        ok = run_case(reg, launch_real, c, o2, true, gr->detail, sizeof gr->detail);
        c->per_token = false;
        if (ok) {
            const size_t N = n_out(c);
            const double *const *e = scan_ref_cached(c);
            double *bnd = keel_xcalloc(N + 1, sizeof(double)), *y2 = keel_xcalloc(N + 1, sizeof(double));
            size_t at = 0;
            for (int i = 0; i < c->nb; i++) { /* the per-token outputs play the reference, both bounds summed */
                if (c->b[i].role != R_OUT && c->b[i].role != R_STATE) continue;
                for (size_t j = 0; j < c->b[i].n; j++) y2[at + j] = hget(&c->b[i], o2[i], j), bnd[at + j] = e[1][at + j] + e[2][at + j];
                at += c->b[i].n;
            }
            keel_contract_gate_result tmp = {0};
            ok = check_within(c, o1, y2, bnd, "token-by-token keel_ecu_ssm", &tmp);
            if (!ok) snprintf(gr->detail, sizeof gr->detail, "%s", tmp.detail);
            free(bnd), free(y2);
        }
        free_outs(c, o2);
    } else if (c->kind == K_ROUTE && c->m > 1) {
        for (int r = 0; ok && r < c->m; r++) {
            scase rc = *c;
            rc.m = 1;
            for (int i = 0; i < c->nb; i++) { /* every buffer but corr is row-wise */
                sbuf *b = &rc.b[i];
                const size_t es = keel_dtype_size(b->dt), row = i == 1 ? b->n : b->n / (size_t)c->m;
                b->n = row;
                b->h = keel_xcalloc(row + 1, 8);
                memcpy(b->h, (uint8_t *)c->b[i].h + (i == 1 ? 0 : (size_t)r * row * es), row * es);
            }
            ok = run_case(reg, launch, &rc, o2, true, gr->detail, sizeof gr->detail);
            for (int i = 0; ok && i < c->nb; i++) {
                if (c->b[i].role != R_OUT) continue;
                const size_t bytes = bytes_of(&rc.b[i]);
                if (memcmp((uint8_t *)o1[i] + (size_t)r * bytes, o2[i], bytes) != 0) {
                    snprintf(gr->detail, sizeof gr->detail, "row %d of %d launched alone: output %d differs bit for bit", r,
                             c->m, i);
                    ok = false;
                }
            }
            free_outs(&rc, o2);
            case_free(&rc);
        }
    }
    return ok;
}

static void scan_run(const keel_contract_table *t, const keel_contract_reg *reg, keel_contract_launch_fn launch,
                     int max_gate, keel_contract_result *res) {
    (void)t;
    memset(res, 0, sizeof *res);
    if (reg->available && !reg->available(reg, res->gate[1].detail, sizeof res->gate[1].detail)) {
        res->gate[1].ran = true;
        res->first_red = 1;
        return;
    }
    const int kind = reg->tile_cols; /* the kind rides in tile_cols */
    for (int g = 1; g <= max_gate && g <= 4; g++) {
        keel_contract_gate_result *gr = &res->gate[g];
        gr->ran = gr->pass = true;
        for (int i = 0; i < n_cases(kind, g) && gr->pass; i++) {
            scase c;
            make_case(kind, i, &c);
            void *o1[MAXB] = {0}, *o2[MAXB] = {0};
            gr->pass = run_case(reg, launch, &c, o1, g >= 2, gr->detail, sizeof gr->detail);
            if (gr->pass && g == 1) gr->pass = finite_outs(&c, o1, gr->detail, sizeof gr->detail);
            if (gr->pass && g == 3) gr->pass = gate3(&c, o1, gr);
            if (gr->pass && g == 4) {
                gr->pass = run_case(reg, launch, &c, o2, true, gr->detail, sizeof gr->detail) &&
                           same_bits(&c, o1, o2, gr->detail, sizeof gr->detail);
                free_outs(&c, o2);
                if (gr->pass) gr->pass = gate4(reg, launch, &c, o1, gr);
            }
            free_outs(&c, o1);
            case_free(&c);
        }
        if (!gr->pass) {
            res->first_red = g;
            return;
        }
    }
}

static bool available(const keel_contract_reg *reg, char *why, size_t cap) {
    (void)reg;
    if (keel_cuda_device_count() < 1) {
        snprintf(why, cap, "no CUDA device");
        return false;
    }
    return true;
}

typedef struct spec {
    int kind;
    const char *name, *entry, *replaces;
    int rows_min, rows_max, n_controls;
    keel_contract_control controls[3];
} spec;

int keel_contract_register_cuda_scan(keel_contract_table *t) {
    char why[256];
    const keel_contract_backend *be = keel_contract_cuda_backend(why, sizeof why);
    if (!be) return 0;
    static const spec S[] = {
        {K_SAMPLE, "sample/v1-131072", "keel_ecu_sample", NULL, 1, 1, 2,
         {{"ties-to-higher-id", 3, twin_TIES}, {"write-past-end", 2, twin_PASTEND}}},
        {K_SCAN, "mamba-scan-chunked/l32", "keel_ecu_ssm_chunked", "cuda/engine/mamba-scan/p16n48g2", 1, 256, 3,
         {{"d-skip-dropped", 3, twin_NODSKIP}, {"decay-one-short", 3, twin_DECAY}, {"run-to-run", 4, twin_RERUN}}},
        {K_ROUTE, "route-groups/e64k6g8t2", "keel_ecu_route", NULL, 1, 8, 1, {{"ties-to-higher-id", 3, twin_route_ties}}},
    };
    int added = 0;
    for (size_t i = 0; i < sizeof S / sizeof S[0]; i++) {
        const spec *sp = &S[i];
        keel_contract_reg *r = keel_contract_table_add(t);
        memset(r, 0, sizeof *r);
        snprintf(r->name, sizeof r->name, "cuda/engine/%s", sp->name);
        r->be = be;
        r->entry = sp->entry;
        r->path = "engine";
        r->family = KEEL_CF_FLOAT; /* fp32 and integer arithmetic on float data; the `run` above brings the gates */
        r->tile_cols = sp->kind;
        r->sdt = KEEL_DT_F32, r->xdt = KEEL_DT_F32, r->ydt = KEEL_DT_F32;
        r->rows_min = sp->rows_min, r->rows_max = sp->rows_max;
        r->n_shapes = 1;
        r->shapes[0] = (keel_contract_shape){1, 1, sp->rows_min, sp->rows_max};
        if (sp->replaces) {
            r->n_replaces = 1;
            snprintf(r->replaces[0], sizeof r->replaces[0], "%s", sp->replaces);
            r->same_order = false;
        }
        r->launch = launch_real;
        r->available = available;
        r->run = scan_run;
        for (int k = 0; k < sp->n_controls; k++) r->controls[r->n_controls++] = sp->controls[k];
        added++;
    }
    return added;
}
#endif
