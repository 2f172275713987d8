/* contract: the engine's graph-ready attention (src/engine/cuda/attn.cu: keel_ecu_attn, keel_ecu_kv_append) under
 * gates 1-4 with float64 references and planted controls from its compiled twin (twin_attn.cu). Each registration
 * brings its own `run`; the gates mean what they mean for the tiles:
 *   1 a launch on the smallest shape reports no error and its outputs are finite
 *   2 every buffer (inputs, position, scratch, outputs, caches) sits between canary guards; after a launch on every
 *     shape at every m the guards and the inputs are intact and every output was written
 *   3 every output within its bound of the float64 reference, two seeds and three distributions (normal; large
 *     scores and values; keys drifting so the running maximum rises from tile to tile); outputs all equal fail
 *   4 two launches give the same bits; each row launched alone (m = 1 at its own position), and the first and the
 *     last m-1 rows as one launch, give the bits of the window (the shapes cross from split-K to walking launches)
 * Cache rows after the window's last position hold NaN, so a kernel that reads them fails gates 1 and 3. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_regs_cuda.h"

const char *const keel_contract_cuda_attn_entries[] = {"keel_ecu_attn", "keel_ecu_kv_append", NULL};

#if !defined(KEEL_HAVE_CUDA)
int keel_contract_register_cuda_attn(keel_contract_table *t) {
    (void)t;
    return 0;
}
#else
#include "../engine/cuda/ecuda.h"

#define U 0x1p-24
#define GUARD KEEL_CONTRACT_GUARD
#define MAXB 8

enum { R_IN, R_OUT, R_STATE, R_SCRATCH };

/* One registration's geometry: attention (nh query heads over nkv KV heads of hd) or a cache append (kvd wide). */
typedef struct aspec {
    const char *name, *entry;
    int append, nh, nkv, hd, kvd, bias;
    int n_shapes;
    keel_contract_shape shapes[KEEL_CONTRACT_MAX_SHAPES]; /* n: cache rows; k: rows after the window; m range */
} aspec;

typedef struct abuf {
    const char *name;
    keel_dtype dt;
    size_t n, row; /* elements; elements per window row (0: not row-wise) */
    int role;
    void *h;
    keel_contract_gbuf g;
} abuf;

typedef struct acase {
    const aspec *sp;
    int m, ctx, pos;
    int nb;
    abuf b[MAXB];
} acase;

/* Buffer indices. */
enum { A_Q, A_QB, A_KC, A_VC, A_POS, A_SCR, A_O, A_OF };
enum { P_K, P_V, P_KB, P_VB, P_KC, P_VC, P_POS };


static void add(acase *c, const char *name, keel_dtype dt, size_t n, size_t row, int role) {
    KEEL_ASSERT(c->nb < MAXB);
    c->b[c->nb++] = (abuf){.name = name, .dt = dt, .n = n, .row = row, .role = role, .h = keel_xcalloc(n + 1, 8)};
}

static size_t bytes_of(const abuf *b) { return b->n * keel_dtype_size(b->dt); }
static float *F(const acase *c, int i) { return c->b[i].h; }

static void case_free(acase *c) {
    for (int i = 0; i < c->nb; i++) free(c->b[i].h);
    memset(c, 0, sizeof *c);
}

static void layout(acase *c) {
    const aspec *s = c->sp;
    const size_t m = (size_t)c->m, ctx = (size_t)c->ctx;
    if (s->append) {
        const size_t kvd = (size_t)s->kvd;
        add(c, "k", KEEL_DT_F32, m * kvd, kvd, R_IN), add(c, "v", KEEL_DT_F32, m * kvd, kvd, R_IN);
        add(c, "k bias", KEEL_DT_BF16, s->bias ? kvd : 0, 0, R_IN), add(c, "v bias", KEEL_DT_BF16, s->bias ? kvd : 0, 0, R_IN);
        add(c, "k cache", KEEL_DT_F32, ctx * kvd, 0, R_STATE), add(c, "v cache", KEEL_DT_F32, ctx * kvd, 0, R_STATE);
        add(c, "position", KEEL_DT_I32, 1, 0, R_IN);
        return;
    }
    const size_t qd = (size_t)s->nh * s->hd, kvd = (size_t)s->nkv * s->hd;
    const size_t scr = keel_ecu_attn_scratch_bytes(c->m, s->nh, s->hd, c->ctx) / sizeof(float);
    add(c, "q", KEEL_DT_F32, m * qd, qd, R_IN), add(c, "q bias", KEEL_DT_BF16, s->bias ? qd : 0, 0, R_IN);
    add(c, "k cache", KEEL_DT_F32, ctx * kvd, 0, R_IN), add(c, "v cache", KEEL_DT_F32, ctx * kvd, 0, R_IN);
    add(c, "position", KEEL_DT_I32, 1, 0, R_IN), add(c, "scratch", KEEL_DT_F32, scr ? scr : 1, 0, R_SCRATCH);
    add(c, "o (bf16)", KEEL_DT_BF16, m * qd, qd, R_OUT), add(c, "o (fp32)", KEEL_DT_F32, m * qd, qd, R_OUT);
}

static void hset(abuf *b, size_t i, double v) {
    if (b->dt == KEEL_DT_I32) ((int32_t *)b->h)[i] = (int32_t)v;
    else keel_dtype_set_f32(b->dt, b->h, i, (float)v);
}
static double hget(const abuf *b, const void *h, size_t i) {
    if (b->dt == KEEL_DT_I32) return ((const int32_t *)h)[i];
    return keel_dtype_get_f32(b->dt, h, i);
}

/* dist 0: normal; 1: scores of order 8 and values x1000; 2: keys drift along the position so every tile raises the
 * running maximum (queries positive). Attention cache rows after the window are NaN. */
static void generate(acase *c, uint64_t seed, int dist) {
    keel_contract_rng r = {seed * 0x9e3779b97f4a7c15ull + 0x51ed27ull + (uint64_t)c->sp->hd};
    const aspec *s = c->sp;
    if (s->append) {
        const double big = dist == 1 ? 1000.0 : 1.0;
        for (int i = 0; i < c->nb; i++)
            for (size_t j = 0; j < c->b[i].n; j++) hset(&c->b[i], j, keel_contract_rnorm(&r) * (i < P_KB ? big : 1.0));
        hset(&c->b[P_POS], 0, c->pos);
        return;
    }
    const int kvd = s->nkv * s->hd, last = c->pos + c->m - 1;
    const double qs = dist == 1 ? 2.0 : 1.0, ks = dist == 1 ? 4.0 : dist == 2 ? 0.5 : 1.0, vs = dist == 1 ? 1000.0 : 1.0;
    for (size_t j = 0; j < c->b[A_Q].n; j++) hset(&c->b[A_Q], j, dist == 2 ? fabs(keel_contract_rnorm(&r)) : keel_contract_rnorm(&r) * qs);
    for (size_t j = 0; j < c->b[A_QB].n; j++) hset(&c->b[A_QB], j, 0.5 * keel_contract_rnorm(&r));
    for (int row = 0; row < c->ctx; row++)
        for (int i = 0; i < kvd; i++) {
            const size_t e = (size_t)row * kvd + i;
            const double kv = keel_contract_rnorm(&r) * ks + (dist == 2 ? 0.01 * row : 0.0), vv = keel_contract_rnorm(&r) * vs;
            hset(&c->b[A_KC], e, row <= last ? kv : NAN);
            hset(&c->b[A_VC], e, row <= last ? vv : NAN);
        }
    hset(&c->b[A_POS], 0, c->pos);
}

static acase make(const aspec *sp, const keel_contract_shape *sh, int m, uint64_t seed, int dist) {
    acase c = {.sp = sp, .m = m, .ctx = sh->n, .pos = sh->n - m - sh->k};
    KEEL_ASSERT(c.pos >= 0);
    layout(&c);
    generate(&c, seed, dist);
    return c;
}

/* Rows [r0, r0+m') of c as their own case: row-wise inputs sliced, the rest copied, the position moved. */
static acase sub_case(const acase *c, int r0, int m) {
    acase s = *c;
    s.m = m, s.pos = c->pos + r0, s.nb = 0;
    layout(&s);
    for (int i = 0; i < c->nb; i++) {
        const abuf *from = &c->b[i];
        abuf *to = &s.b[i];
        if (from->role != R_IN && from->role != R_STATE) continue;
        const size_t es = keel_dtype_size(from->dt);
        memcpy(to->h, (uint8_t *)from->h + (from->row ? (size_t)r0 * from->row * es : 0), bytes_of(to));
    }
    hset(&s.b[c->sp->append ? P_POS : A_POS], 0, s.pos);
    return s;
}

/* ---- float64 references and bounds, outputs (and states) in buffer order ---- */

static size_t n_out(const acase *c) {
    size_t t = 0;
    for (int i = 0; i < c->nb; i++)
        if (c->b[i].role == R_OUT || c->b[i].role == R_STATE) t += c->b[i].n;
    return t;
}

/* The attention of one (row, head): the arithmetic of attn.cu (its header) against exact sums. A key's score is an
 * fma chain over a quarter of the head's float4 slices, the quarters added in a tree, times the scale: L_s roundings
 * of sum |q k| scale. A key's weight passes through at most nc + 4 expf (2 ulp = 4u each) and the subtractions that
 * feed them (u |s - M| in all, telescoping), and shifts with its score error; the weights' shared factors cancel in
 * O / L. O's terms pass kChunk + nc + 8 roundings (fma chains, rescales, merges), L's nc + 10, the division one. */
static void attn_ref(const acase *c, int r, int h, double *o, double *e) {
    const aspec *s = c->sp;
    const int hd = s->hd, kvd = s->nkv * hd, qd = s->nh * hd, kh = h / (s->nh / s->nkv), p = c->pos + r;
    const int dg = (hd + 3) / 4, ls = 4 * ((dg + 3) / 4) + 4, nc = p / KEEL_ECU_ATTN_CHUNK + 1;
    const double scale = (double)(1.0f / sqrtf((float)hd));
    double *sc = keel_xmalloc((size_t)(p + 1) * sizeof(double)), *es = keel_xmalloc((size_t)(p + 1) * sizeof(double));
    double *q = keel_xmalloc((size_t)hd * sizeof(double));
    for (int i = 0; i < hd; i++) {
        float v = F(c, A_Q)[(size_t)r * qd + (size_t)h * hd + i];
        if (s->bias) v = v + (float)hget(&c->b[A_QB], c->b[A_QB].h, (size_t)h * hd + i); /* the kernel's fp32 add */
        q[i] = v;
    }
    double M = -INFINITY, esmax = 0;
    for (int j = 0; j <= p; j++) {
        double d = 0, a = 0;
        const float *k = F(c, A_KC) + (size_t)j * kvd + (size_t)kh * hd;
        for (int i = 0; i < hd; i++) d += q[i] * k[i], a += fabs(q[i] * k[i]);
        sc[j] = d * scale, es[j] = 1.01 * ls * U * a * scale;
        M = fmax(M, sc[j]), esmax = fmax(esmax, es[j]);
    }
    double L = 0, wrho = 0, vmax = 0;
    for (int j = 0; j <= p; j++) L += exp(sc[j] - M);
    for (int j = 0; j <= p; j++) {
        const double w = exp(sc[j] - M) / L, rho = 1.01 * (es[j] + U * (M - sc[j] + 2 * esmax) + 4 * U * (nc + 5));
        es[j] = rho, wrho += w * rho, sc[j] = w;
    }
    for (int d = 0; d < hd; d++) {
        double acc = 0, a = 0, ar = 0;
        for (int j = 0; j <= p; j++) {
            const double v = F(c, A_VC)[(size_t)j * kvd + (size_t)kh * hd + d];
            acc += sc[j] * v, a += sc[j] * fabs(v), ar += sc[j] * fabs(v) * es[j], vmax = fmax(vmax, fabs(v));
        }
        o[d] = acc;
        e[d] = 1.01 * (ar + fabs(acc) * wrho + (KEEL_ECU_ATTN_CHUNK + nc + 8) * U * a + (nc + 11) * U * fabs(acc)) +
               1e-30 * (1 + vmax);
    }
    free(sc), free(es), free(q);
}

static void reference(const acase *c, double *ref, double *bnd) {
    const aspec *s = c->sp;
    memset(bnd, 0, n_out(c) * sizeof(double));
    if (s->append) { /* k cache then v cache: untouched rows exact, window rows x + bias rounded once */
        const size_t kvd = (size_t)s->kvd, cn = (size_t)c->ctx * kvd;
        for (int which = 0; which < 2; which++) {
            const abuf *x = &c->b[which ? P_V : P_K], *b = &c->b[which ? P_VB : P_KB], *st = &c->b[which ? P_VC : P_KC];
            double *rf = ref + which * cn, *bd = bnd + which * cn;
            for (size_t i = 0; i < cn; i++) rf[i] = hget(st, st->h, i);
            for (int r = 0; r < c->m; r++)
                for (size_t i = 0; i < kvd; i++) {
                    const double xv = hget(x, x->h, (size_t)r * kvd + i), bv = b->n ? hget(b, b->h, i) : 0.0;
                    const size_t at = (size_t)(c->pos + r) * kvd + i;
                    rf[at] = xv + bv, bd[at] = U * (fabs(xv) + fabs(bv));
                }
        }
        return;
    }
    const int hd = s->hd, qd = s->nh * hd;
    const size_t on = (size_t)c->m * qd;
    double *o = keel_xmalloc((size_t)hd * sizeof(double)), *e = keel_xmalloc((size_t)hd * sizeof(double));
    for (int r = 0; r < c->m; r++)
        for (int h = 0; h < s->nh; h++) {
            attn_ref(c, r, h, o, e);
            for (int d = 0; d < hd; d++) {
                const size_t i = (size_t)r * qd + (size_t)h * hd + d;
                ref[i] = ref[on + i] = o[d];
                bnd[i] = e[d] + 0x1p-8 * (fabs(o[d]) + e[d]) + 0x1p-126;  /* bf16: one rounding of 8 bits */
                bnd[on + i] = e[d] + U * (fabs(o[d]) + e[d]) + 0x1p-126; /* fp32 */
            }
        }
    free(o), free(e);
}

/* ---- launches ---- */

static void *dp(const acase *c, int i) { return (uint8_t *)c->b[i].g.dev + GUARD; }
static keel_ecu_vec vec(const acase *c, int i) { return (keel_ecu_vec){dp(c, i), c->b[i].dt, (int)c->b[i].n}; }

static void launch_with(const acase *c, bool twin) {
    const aspec *s = c->sp;
    if (s->append) {
        keel_ecu_vec kb = vec(c, P_KB), vb = vec(c, P_VB);
        (twin ? keel_contract_twin_ecu_kv_append : keel_ecu_kv_append)(dp(c, P_K), dp(c, P_V), &kb, &vb, dp(c, P_KC),
                                                                        dp(c, P_VC), s->kvd, dp(c, P_POS), c->m, NULL);
        return;
    }
    keel_ecu_vec qb = vec(c, A_QB);
    (twin ? keel_contract_twin_ecu_attn : keel_ecu_attn)(dp(c, A_Q), &qb, dp(c, A_KC), dp(c, A_VC), s->nkv * s->hd,
                                                          dp(c, A_POS), c->m, s->nh, s->nkv, s->hd, c->ctx,
                                                          dp(c, A_SCR), dp(c, A_O), dp(c, A_OF), NULL);
}

static void launch_real(const keel_contract_reg *reg, const keel_contract_args *a) {
    (void)reg;
    launch_with(a->x, false);
}

#define TWIN_FN(fault)                                                                     \
    static void twin_##fault(const keel_contract_reg *reg, const keel_contract_args *a) { \
        (void)reg;                                                                         \
        keel_contract_twin_ecu_attn_arm(KEEL_ECU_ATTN_PLANT_##fault);                     \
        launch_with(a->x, true);                                                           \
    }
TWIN_FN(NORESCALE)
TWIN_FN(ROWLEAK)
TWIN_FN(PASTEND)
TWIN_FN(NOBIAS)

/* ---- the registrations' geometry and shapes ---- */

#define SH(n, k, lo, hi) {n, k, lo, hi}
static const aspec SPECS[] = {
    /* Nemotron-3-Nano's attention: 32 query heads over 2 KV heads of 128 (16 a group: one block's pairs) */
    {"attn/h32kv2d128", "keel_ecu_attn", 0, 32, 2, 128, 0, 0, 3, {SH(48, 5, 1, 2), SH(300, 0, 1, 3), SH(420, 9, 33, 34)}},
    /* head_dim 256 (keys and values share one tile buffer), 3 query heads a group, a q bias */
    {"attn/h6kv2d256/qbias", "keel_ecu_attn", 0, 6, 2, 256, 0, 1, 3, {SH(40, 3, 1, 2), SH(260, 0, 1, 6), SH(150, 4, 33, 33)}},
    /* an odd head_dim (4-byte copies, a padded slice), 5 query heads over one KV head */
    {"attn/h5kv1d37", "keel_ecu_attn", 0, 5, 1, 37, 0, 0, 3, {SH(50, 2, 1, 2), SH(140, 0, 1, 4), SH(170, 6, 34, 34)}},
    /* one query head per KV head: 16 rows a block */
    {"attn/h4kv4d64", "keel_ecu_attn", 0, 4, 4, 64, 0, 0, 3, {SH(40, 1, 1, 2), SH(300, 0, 15, 17), SH(140, 2, 40, 40)}},
    {"kv-append/kvd256/bias-bf16", "keel_ecu_kv_append", 1, 0, 0, 0, 256, 1, 2, {SH(4, 0, 1, 2), SH(40, 0, 1, 8)}},
    {"kv-append/kvd74", "keel_ecu_kv_append", 1, 0, 0, 0, 74, 0, 2, {SH(3, 0, 1, 2), SH(50, 0, 1, 5)}},
};
#undef SH

/* ---- gates ---- */

static const aspec *spec_of(const keel_contract_reg *reg) { return &SPECS[reg->tile_cols]; } /* the index rides in tile_cols */

/* Uploads c between guards, launches, and downloads every output and state into outs; with check, the guards, the
 * inputs and that every output was written. False with the reason. */
static bool run_case(const keel_contract_reg *reg, keel_contract_launch_fn launch, acase *c, void **outs, bool check,
                     char *why, size_t cap) {
    const keel_contract_backend *be = reg->be;
    for (int i = 0; i < c->nb; i++) {
        abuf *b = &c->b[i];
        const bool data = b->role == R_IN || b->role == R_STATE;
        keel_contract_gbuf_make(&b->g, be, b->name, data ? b->h : NULL, bytes_of(b), i + 1);
    }
    keel_contract_args a = {.x = c, .m = c->m};
    launch(reg, &a);
    bool ok = be->sync(why, cap);
    for (int i = 0; i < c->nb; i++) {
        abuf *b = &c->b[i];
        const size_t nb = bytes_of(b);
        uint8_t *back = keel_xmalloc(nb + 2 * GUARD);
        be->download(back, b->g.dev, nb + 2 * GUARD);
        if (ok && check) ok = keel_contract_gbuf_check(&b->g, back, b->role == R_IN, why, cap);
        if (b->role == R_OUT || b->role == R_STATE) {
            outs[i] = keel_xmalloc(nb + 8);
            memcpy(outs[i], back + GUARD, nb);
        }
        if (ok && check && b->role == R_OUT) {
            const size_t es = keel_dtype_size(b->dt);
            for (size_t e = 0; ok && e < b->n; e++) {
                size_t u = 0;
                while (u < es && back[GUARD + e * es + u] == KEEL_CONTRACT_UNWRITTEN) u++;
                if (u == es) {
                    snprintf(why, cap, "%s element %zu was not written", b->name, e);
                    ok = false;
                }
            }
        }
        free(back);
        keel_contract_gbuf_free(&b->g, be);
    }
    return ok;
}

static void free_outs(const acase *c, void **outs) {
    for (int i = 0; i < c->nb; i++) free(outs[i]), outs[i] = NULL;
}

static bool check_finite(const acase *c, void **outs, char *why, size_t cap) {
    for (int i = 0; i < c->nb; i++)
        for (size_t j = 0; outs[i] && j < c->b[i].n; j++)
            if (!isfinite(hget(&c->b[i], outs[i], j))) {
                snprintf(why, cap, "%s element %zu is not finite", c->b[i].name, j);
                return false;
            }
    return true;
}

static bool check_ref(const acase *c, void **outs, keel_contract_gate_result *gr) {
    const size_t N = n_out(c);
    double *ref = keel_xcalloc(N + 1, sizeof(double)), *bnd = keel_xcalloc(N + 1, sizeof(double));
    reference(c, ref, bnd);
    size_t at = 0;
    bool ok = true;
    for (int i = 0; i < c->nb && ok; i++) {
        const abuf *b = &c->b[i];
        if (b->role != R_OUT && b->role != R_STATE) continue;
        bool varied = b->n < 2;
        for (size_t j = 0; j < b->n && ok; j++) {
            const double y = hget(b, outs[i], j), d = fabs(y - ref[at + j]);
            if (j && y != hget(b, outs[i], 0)) varied = true;
            const double frac = bnd[at + j] > 0 ? d / bnd[at + j] : (d > 0 ? INFINITY : 0);
            if (frac > gr->frac || gr->bound_at_max == 0) gr->frac = frac, gr->max_err = d, gr->bound_at_max = bnd[at + j];
            if (!(d <= bnd[at + j])) {
                snprintf(gr->detail, sizeof gr->detail,
                         "m=%d pos=%d ctx=%d: %s element %zu: got %.9g, float64 reference %.9g, |d| %.3g, bound %.3g "
                         "(%.1fx)", c->m, c->pos, c->ctx, b->name, j, y, ref[at + j], d, bnd[at + j], frac);
                ok = false;
            }
        }
        if (ok && !varied) {
            snprintf(gr->detail, sizeof gr->detail, "%s: all %zu values equal (a vacuous pass)", b->name, b->n);
            ok = false;
        }
        at += b->n;
    }
    free(ref), free(bnd);
    return ok;
}

/* Rows [r0, r0+m') of the window's outputs (w) against a launch of those rows (s, starting at its row 0). Caches:
 * the rows the sub-launch wrote. */
static bool same_rows(const acase *c, void **w, void **s, int r0, int m, char *why, size_t cap) {
    for (int i = 0; i < c->nb; i++) {
        const abuf *b = &c->b[i];
        if (b->role != R_OUT && b->role != R_STATE) continue;
        const size_t es = keel_dtype_size(b->dt);
        size_t wo = 0, so = 0, len = bytes_of(b);
        if (b->role == R_OUT) wo = (size_t)r0 * b->row * es, len = (size_t)m * b->row * es;
        else wo = so = (size_t)(c->pos + r0) * c->sp->kvd * es, len = (size_t)m * c->sp->kvd * es;
        if (memcmp((uint8_t *)w[i] + wo, (uint8_t *)s[i] + so, len)) {
            snprintf(why, cap, "%s rows %d..%d (positions %d..) launched as %d row%s differ from the %d-row window",
                     b->name, r0, r0 + m - 1, c->pos + r0, m, m > 1 ? "s" : "", c->m);
            return false;
        }
    }
    return true;
}

static bool gate4(const keel_contract_reg *reg, keel_contract_launch_fn launch, acase *c, void **o1,
                  keel_contract_gate_result *gr) {
    void *o2[MAXB] = {0};
    bool ok = run_case(reg, launch, c, o2, true, gr->detail, sizeof gr->detail) &&
              same_rows(c, o1, o2, 0, c->m, gr->detail, sizeof gr->detail);
    free_outs(c, o2);
    /* every row alone, then the first and the last m-1 rows */
    for (int t = 0; ok && c->m > 1 && t < c->m + 2; t++) {
        const int r0 = t < c->m ? t : t == c->m ? 0 : 1, mm = t < c->m ? 1 : c->m - 1;
        acase s = sub_case(c, r0, mm);
        ok = run_case(reg, launch, &s, o2, true, gr->detail, sizeof gr->detail) &&
             same_rows(c, o1, o2, r0, mm, gr->detail, sizeof gr->detail);
        free_outs(&s, o2);
        case_free(&s);
    }
    return ok;
}

static void attn_run(const keel_contract_table *t, const keel_contract_reg *reg, keel_contract_launch_fn launch,
                     int max_gate, keel_contract_result *res) {
    (void)t;
    memset(res, 0, sizeof *res);
    if (keel_cuda_device_count() < 1) {
        res->gate[1].ran = true;
        snprintf(res->gate[1].detail, sizeof res->gate[1].detail, "no CUDA device");
        res->first_red = 1;
        return;
    }
    const aspec *sp = spec_of(reg);
    void *o1[MAXB] = {0};
    for (int g = 1; g <= max_gate && g <= 4; g++) {
        keel_contract_gate_result *gr = &res->gate[g];
        gr->ran = gr->pass = true;
        for (int s = 0; s < reg->n_shapes && gr->pass; s++) {
            const keel_contract_shape *sh = &reg->shapes[s];
            const int m_hi = g == 1 ? sh->m_lo : sh->m_hi;
            if (g == 1 && s > 0) break; /* gate 1: the smallest shape at its smallest m */
            for (int m = sh->m_lo; m <= m_hi && gr->pass; m++)
                for (int seed = 1; seed <= (g == 3 ? 2 : 1) && gr->pass; seed++)
                    for (int d = 0; d < (g == 3 ? 3 : 1) && gr->pass; d++) {
                        acase c = make(sp, sh, m, (uint64_t)seed, d);
                        gr->pass = run_case(reg, launch, &c, o1, g >= 2, gr->detail, sizeof gr->detail);
                        if (gr->pass && g == 1) gr->pass = check_finite(&c, o1, gr->detail, sizeof gr->detail);
                        if (gr->pass && g == 3) gr->pass = check_ref(&c, o1, gr);
                        if (gr->pass && g == 4) gr->pass = gate4(reg, launch, &c, o1, gr);
                        free_outs(&c, o1);
                        case_free(&c);
                    }
        }
        if (!gr->pass) {
            res->first_red = g;
            return;
        }
    }
}


/* ---- the table ---- */

int keel_contract_register_cuda_attn(keel_contract_table *t) {
    char why[256];
    const keel_contract_backend *be = keel_contract_cuda_backend(why, sizeof why);
    if (!be) return 0;
    int added = 0;
    for (size_t i = 0; i < sizeof SPECS / sizeof SPECS[0]; i++) {
        const aspec *sp = &SPECS[i];
        keel_contract_reg *r = keel_contract_table_add(t);
        memset(r, 0, sizeof *r);
        snprintf(r->name, sizeof r->name, "cuda/engine/%s", sp->name);
        r->be = be;
        r->entry = sp->entry;
        r->path = "engine";
        r->family = KEEL_CF_FLOAT; /* fp32 arithmetic on float data; the `run` below brings the gates */
        r->tile_cols = (int)i;
        r->sdt = KEEL_DT_BF16, r->xdt = KEEL_DT_F32, r->ydt = KEEL_DT_F32;
        r->rows_min = sp->shapes[0].m_lo, r->rows_max = sp->shapes[sp->n_shapes - 1].m_hi;
        r->n_shapes = sp->n_shapes;
        memcpy(r->shapes, sp->shapes, sizeof sp->shapes[0] * (size_t)sp->n_shapes);
        r->launch = launch_real;
        r->run = attn_run;
        r->controls[r->n_controls++] = (keel_contract_control){"write-past-end", 2, twin_PASTEND};
        if (sp->append && sp->bias) r->controls[r->n_controls++] = (keel_contract_control){"bias-dropped", 3, twin_NOBIAS};
        if (!sp->append) {
            r->controls[r->n_controls++] = (keel_contract_control){"rescale-dropped", 3, twin_NORESCALE};
            r->controls[r->n_controls++] = (keel_contract_control){"row-leak", 4, twin_ROWLEAK};
        }
        added++;
    }
    return added;
}
#endif
