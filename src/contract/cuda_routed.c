/* contract: gates 1-4 for the routed CUDA stream tiles (keel_cuda_stream_experts_up / _down), which gates.c's
 * single-matrix cases cannot express: E experts stacked in W, a routing (items of {expert, token mask} in
 * ascending expert order, top-2 per token) and routing weights. Same gates, same bound arithmetic (KEEL_CA_MMA):
 *   1 the variant has an image for this device and fits its limits; a launch reports no error, outputs finite
 *   2 every operand between canary guards, inputs unchanged, every routed output written and every output outside
 *     an item's mask left untouched (fc1 writes only the rows its items selected), on every shape and m
 *   3 within the float64 reference's bound, four distributions, two seeds; routing weights of unselected slots are
 *     NaN, so reading one shows
 *   4 two launches equal; every token range launched alone (its items' masks shifted, empty items dropped, the
 *     list order kept) equals those tokens of the whole launch; the launch equals what it replaces: per item the
 *     plain stream tile (then relu2 for fused fc1), and for fc2 the weighted sum fma(w, y_i, tot) over the items in
 *     list order on the host in fp32, bit for bit where neither side k-splits differently, else within the bound.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "contract.h"

#include "../kernels/cuda/cuda.h" /* keel_cuda_route (plain C); the runner itself needs no device */

#define U32 0x1p-24
#define GUARD KEEL_CONTRACT_GUARD
#define UNWRITTEN KEEL_CONTRACT_UNWRITTEN
#define MAX_E 8


enum { D_NORMAL, D_LARGE, D_NEGGROUPS, D_ZERORANGE, D_COUNT };
static const char *const DIST_NAMES[D_COUNT] = {"normal", "large-magnitude", "all-negative-groups", "zero-range-groups"};

/* One routed launch on the host: stacked W (E*n rows), x (up: m x k; down: n_items x m x k), routing. */
typedef struct rcase {
    int m, n, k, E, n_items;
    bool down;
    keel_dtype xdt;
    keel_qmat W;
    uint32_t *w;
    void *s, *b, *x;
    keel_cuda_route items[MAX_E];
    float wts[MAX_E * 8];
} rcase;

static void rcase_free(rcase *c) {
    free(c->w), free(c->s), free(c->b), free(c->x);
    memset(c, 0, sizeof *c);
}

static size_t x_elems(const rcase *c) { return (size_t)(c->down ? c->n_items : 1) * (size_t)c->m * (size_t)c->k; }
static size_t y_elems(const rcase *c) { return (size_t)(c->down ? 1 : c->n_items) * (size_t)c->m * (size_t)c->n; }

/* Top-2 routing of m tokens over E experts; the last token always takes the last expert (so the last item holds
 * the last row, where a write past the end would start). Unselected weights are NaN. */
static void route(rcase *c, keel_contract_rng *r, uint64_t seed) {
    uint32_t masks[MAX_E] = {0};
    for (int t = 0; t < c->m; t++) {
        int e1 = (int)((t * 7 + seed) % (uint64_t)c->E), e2 = (e1 + 1 + (int)((t + seed) % (uint64_t)(c->E - 1))) % c->E;
        if (t == c->m - 1) e1 = c->E - 1, e2 = (int)((seed + (uint64_t)t) % (uint64_t)(c->E - 1));
        masks[e1] |= 1u << t, masks[e2] |= 1u << t;
    }
    c->n_items = 0;
    for (int e = 0; e < c->E; e++)
        if (masks[e]) c->items[c->n_items++] = (keel_cuda_route){.expert = e, .mask = masks[e]};
    for (int i = 0; i < c->n_items; i++)
        for (int t = 0; t < 8; t++) c->wts[i * 8 + t] = (c->items[i].mask >> t) & 1u ? (float)(0.25 + 0.5 * keel_contract_runif(r)) : NAN;
}

static rcase gen(const keel_contract_reg *reg, int n, int k, int m, int d, uint64_t seed) {
    rcase c = {.m = m, .n = n, .k = k, .E = reg->experts, .down = reg->family == KEEL_CF_ROUTED_DOWN, .xdt = reg->xdt};
    keel_contract_rng r = {.s = 0x9e3779b97f4a7c15ull ^ (seed * 0x2545f4914f6cdd1dull + (uint64_t)d * 977u + 7u)};
    for (int i = 0; i < 4; i++) keel_contract_rnext(&r);
    route(&c, &r, seed);
    const double mag = d == D_LARGE ? 1000.0 : 1.0;
    const int G = reg->group, ng = k / G, bits = reg->bits, qmax = (1 << bits) - 1, rows = c.E * n;
    c.x = keel_xmalloc(x_elems(&c) * keel_dtype_size(c.xdt) + 1);
    for (size_t i = 0; i < x_elems(&c); i++) {
        double v = mag * keel_contract_rnorm(&r);
        if (d == D_NEGGROUPS && ((int)(i % (size_t)k) / G) % 3 == 1) v = -fabs(v);
        keel_dtype_set_f32(c.xdt, c.x, i, (float)v);
    }
    const size_t words = keel_quant_row_words(k, bits), sb = (size_t)rows * (size_t)ng * keel_dtype_size(reg->sdt);
    c.w = keel_xmalloc((size_t)rows * words * 4 + 4);
    c.s = keel_xmalloc(sb + 1);
    c.b = keel_xmalloc(sb + 1);
    uint8_t *codes = keel_xmalloc((size_t)k);
    for (int j = 0; j < rows; j++) {
        for (int g = 0; g < ng; g++) {
            double s = mag * keel_contract_rnorm(&r) / (double)(1 << bits), b = 0.5 * mag * keel_contract_rnorm(&r);
            const uint8_t c0 = (uint8_t)(keel_contract_rnext(&r) % (uint64_t)(qmax + 1));
            const bool one_code = d == D_ZERORANGE && (j + g) % 2 == 1;
            for (int q = 0; q < G; q++) codes[g * G + q] = one_code ? c0 : (uint8_t)(keel_contract_rnext(&r) % (uint64_t)(qmax + 1));
            if (d == D_ZERORANGE && (j + g) % 2 == 0) s = 0.0;
            if (d == D_NEGGROUPS && (j + g) % 2 == 1) {
                s = fabs(s);
                b = -(fabs(b) + s * qmax) - 1e-3 * mag;
            }
            keel_dtype_set_f32(reg->sdt, c.s, (size_t)j * (size_t)ng + (size_t)g, (float)s);
            keel_dtype_set_f32(reg->sdt, c.b, (size_t)j * (size_t)ng + (size_t)g, (float)b);
        }
        keel_quant_pack_row(codes, k, bits, c.w + (size_t)j * words);
    }
    free(codes);
    c.W = (keel_qmat){.n = rows, .k = k, .bits = bits, .group = G, .sdt = reg->sdt, .w = c.w, .scales = c.s, .biases = c.b};
    return c;
}

/* Tokens [r0, r0+m) of c: masks shifted, items left empty dropped (list order kept), weights and x moved along.
 * Shares c's weights: free only its x. */
static rcase sub_tokens(const rcase *c, int r0, int m, int *item_of) {
    rcase s = *c;
    s.m = m;
    s.n_items = 0;
    const size_t row = (size_t)c->k * keel_dtype_size(c->xdt);
    s.x = keel_xmalloc((size_t)(c->down ? c->n_items : 1) * (size_t)m * row + 1);
    if (!c->down) memcpy(s.x, (const uint8_t *)c->x + (size_t)r0 * row, (size_t)m * row);
    for (int i = 0; i < c->n_items; i++) {
        const uint32_t mask = (c->items[i].mask >> r0) & ((1u << m) - 1u);
        if (!mask) continue;
        const int o = s.n_items++;
        item_of[o] = i;
        s.items[o] = (keel_cuda_route){.expert = c->items[i].expert, .mask = mask};
        for (int t = 0; t < 8; t++) s.wts[o * 8 + t] = t < m ? c->wts[i * 8 + r0 + t] : NAN;
        if (c->down)
            memcpy((uint8_t *)s.x + (size_t)o * (size_t)m * row,
                   (const uint8_t *)c->x + ((size_t)i * (size_t)c->m + (size_t)r0) * row, (size_t)m * row);
    }
    return s;
}

/* ---- reference ------------------------------------------------------------------------------------- */

static double out_unit(keel_dtype dt) { return dt == KEEL_DT_BF16 ? 0x1p-8 : 0.0; }

/* The k-split of this launch: the stack's launch-width hint decides it, never the item list. */
static int splits_of(const keel_contract_reg *reg, const rcase *c) {
    return reg->splits ? reg->splits(c->n, c->k, KEEL_CONTRACT_ITEMS_OF(reg)) : 1;
}

/* x_i[t] . W[expert]^T row j in float64, and its gate-3 bound before any epilogue. */
static void dot_ref(const keel_contract_reg *reg, const rcase *c, int item, int t, int j, double *acc, double *e) {
    const int k = c->k, G = reg->group, ng = k / G;
    const int wrow = c->items[item].expert * c->n + j;
    const uint32_t *row = c->w + (size_t)wrow * keel_quant_row_words(k, reg->bits);
    const size_t xo = ((size_t)(c->down ? item : 0) * (size_t)c->m + (size_t)t) * (size_t)k;
    const double off = keel_contract_mma_offset(reg->bits, c->xdt);
    double a = 0, A = 0;
    for (int q = 0; q < k; q++) {
        const size_t gi = (size_t)wrow * (size_t)ng + (size_t)(q / G);
        const double s = keel_dtype_get_f32(reg->sdt, c->s, gi), b = keel_dtype_get_f32(reg->sdt, c->b, gi);
        const double sq = s * (double)keel_quant_code(row, reg->bits, q), x = keel_dtype_get_f32(c->xdt, c->x, xo + (size_t)q);
        a += x * (sq + b);
        A += fabs(x) * (fabs(sq) + fabs(b) + 2 * off * fabs(s));
    }
    *acc = a;
    *e = 1.01 * keel_contract_mma_roundings(G, k, splits_of(reg, c)) * U32 * A + 1e-30;
}

/* Reference and bound of every output; `routed[i]` false where the output is outside every mask (fc1). */
static void reference(const keel_contract_reg *reg, const rcase *c, double *ref, double *bound, bool *routed) {
    const int n = c->n, m = c->m;
    if (!c->down) {
        for (int i = 0; i < c->n_items; i++)
            for (int t = 0; t < m; t++)
                for (int j = 0; j < n; j++) {
                    const size_t o = ((size_t)i * (size_t)m + (size_t)t) * (size_t)n + (size_t)j;
                    routed[o] = (c->items[i].mask >> t) & 1u;
                    ref[o] = bound[o] = 0;
                    if (!routed[o]) continue;
                    double a, e;
                    dot_ref(reg, c, i, t, j, &a, &e);
                    if (reg->epi == KEEL_EPI_RELU2) {
                        if (!reg->same_order) e += out_unit(reg->ydt) * (fabs(a) + e); /* the sequence stores y first */
                        const double r = a > 0 ? a : 0;
                        e = e * (2 * r + e) + U32 * (r + e) * (r + e);
                        a = r * r;
                    }
                    ref[o] = a;
                    bound[o] = e + out_unit(reg->ydt) * (fabs(a) + e);
                }
        return;
    }
    const int chain = c->n_items + splits_of(reg, c) + 1; /* fma over items, k-split partials, a spare */
    for (int t = 0; t < m; t++)
        for (int j = 0; j < n; j++) {
            double y = 0, E = 0, W = 0;
            for (int i = 0; i < c->n_items; i++) {
                if (!((c->items[i].mask >> t) & 1u)) continue;
                double a, e;
                dot_ref(reg, c, i, t, j, &a, &e);
                const double w = c->wts[i * 8 + t];
                y += w * a;
                E += fabs(w) * e;
                W += fabs(w) * (fabs(a) + e);
            }
            const size_t o = (size_t)t * (size_t)n + (size_t)j;
            routed[o] = true;
            ref[o] = y;
            bound[o] = 1.01 * (E + chain * U32 * W) + 1e-30;
            bound[o] += out_unit(reg->ydt) * (fabs(y) + bound[o]);
        }
}

/* ---- guarded launches ------------------------------------------------------------------------------ */

typedef keel_contract_gbuf gbuf;

/* Launches `launch` on c into y (ydt elements). With `check`: guards, inputs unchanged, every routed output
 * written and every other output untouched. */
static bool launch_case(const keel_contract_reg *reg, keel_contract_launch_fn launch, const rcase *c, void *y,
                        bool check, char *why, size_t cap) {
    const keel_contract_backend *be = reg->be;
    const size_t ys = keel_dtype_size(reg->ydt), yb = y_elems(c) * ys;
    const size_t sbytes = (size_t)c->W.n * (size_t)(c->k / reg->group) * keel_dtype_size(reg->sdt);
    gbuf b[7];
    keel_contract_gbuf_make(&b[0], be, "W", c->w, (size_t)c->W.n * keel_quant_row_words(c->k, reg->bits) * 4, 1);
    keel_contract_gbuf_make(&b[1], be, "scales", c->s, sbytes, 2);
    keel_contract_gbuf_make(&b[2], be, "biases", c->b, sbytes, 3);
    keel_contract_gbuf_make(&b[3], be, "x", c->x, x_elems(c) * keel_dtype_size(c->xdt), 4);
    keel_contract_gbuf_make(&b[4], be, "items", c->items, (size_t)c->n_items * sizeof(keel_cuda_route), 5);
    keel_contract_gbuf_make(&b[5], be, "weights", c->wts, (size_t)c->n_items * 8 * sizeof(float), 6);
    keel_contract_gbuf_make(&b[6], be, c->down ? "y" : "h", NULL, yb, 7);
    keel_contract_args a = {.W = c->W, .m = c->m, .count = y_elems(c), .n_items = c->n_items};
    a.W.w = (const uint32_t *)((uint8_t *)b[0].dev + GUARD);
    a.W.scales = (uint8_t *)b[1].dev + GUARD;
    a.W.biases = (uint8_t *)b[2].dev + GUARD;
    a.x = (uint8_t *)b[3].dev + GUARD;
    a.items = (uint8_t *)b[4].dev + GUARD;
    a.weights = (const float *)((uint8_t *)b[5].dev + GUARD);
    a.y = (uint8_t *)b[6].dev + GUARD;
    launch(reg, &a);
    bool ok = be->sync(why, cap);
    uint8_t *back = keel_xmalloc(yb + 2 * GUARD);
    be->download(back, b[6].dev, yb + 2 * GUARD);
    memcpy(y, back + GUARD, yb);
    if (ok && check) {
        ok = keel_contract_gbuf_check(&b[6], back, false, why, cap);
        const size_t cnt = y_elems(c);
        bool *routed = keel_xmalloc(cnt);
        for (size_t i = 0; i < cnt; i++) { /* fc2 writes every token; fc1 the tokens in each item's mask */
            const size_t per = (size_t)c->m * (size_t)c->n;
            routed[i] = c->down || ((c->items[i / per].mask >> (i % per / (size_t)c->n)) & 1u);
        }
        for (size_t i = 0; ok && i < cnt; i++) {
            size_t u = 0;
            while (u < ys && back[GUARD + i * ys + u] == UNWRITTEN) u++;
            if (routed[i] && u == ys) {
                snprintf(why, cap, "output %zu (a routed token) was not written", i);
                ok = false;
            } else if (!routed[i] && u != ys) {
                snprintf(why, cap, "output %zu (item %zu, token %zu, outside its mask) was written", i,
                         i / ((size_t)c->m * c->n), i % ((size_t)c->m * c->n) / (size_t)c->n);
                ok = false;
            }
        }
        free(routed);
        for (int i = 0; ok && i < 6; i++) {
            uint8_t *ib = keel_xmalloc(b[i].bytes + 2 * GUARD);
            be->download(ib, b[i].dev, b[i].bytes + 2 * GUARD);
            ok = keel_contract_gbuf_check(&b[i], ib, true, why, cap);
            free(ib);
        }
    }
    free(back);
    for (int i = 0; i < 7; i++) keel_contract_gbuf_free(&b[i], be);
    return ok;
}

/* ---- gates ------------------------------------------------------------------------------------------ */

#define FAIL(gr, ...)                                                                              \
    do {                                                                                           \
        (gr)->pass = false;                                                                        \
        snprintf((gr)->detail, sizeof (gr)->detail, __VA_ARGS__);                                 \
    } while (0)

static double yget(const keel_contract_reg *reg, const void *y, size_t i) { return keel_dtype_get_f32(reg->ydt, y, i); }
static void *ybuf(const keel_contract_reg *reg, const rcase *c) { return keel_xcalloc(y_elems(c) + 1, keel_dtype_size(reg->ydt)); }

static bool within_bound(const keel_contract_reg *reg, const rcase *c, const void *y, const char *what,
                         keel_contract_gate_result *gr) {
    const size_t cnt = y_elems(c);
    double *ref = keel_xmalloc(cnt * sizeof(double)), *bound = keel_xmalloc(cnt * sizeof(double));
    bool *routed = keel_xmalloc(cnt);
    reference(reg, c, ref, bound, routed);
    size_t bad = 0, worst = 0, nonzero = 0, distinct = 0, checked = 0, first = cnt;
    double wfrac = 0;
    for (size_t i = 0; i < cnt; i++) {
        if (!routed[i]) continue;
        const double v = yget(reg, y, i), err = fabs(v - ref[i]), frac = err / bound[i];
        if (first == cnt) first = i;
        checked++;
        if (!(err <= bound[i])) bad++;
        if (!(frac <= wfrac)) wfrac = frac, worst = i;
        nonzero += v != 0.0;
        distinct += v != yget(reg, y, first);
    }
    if (wfrac > gr->frac || isnan(wfrac)) {
        gr->frac = wfrac;
        gr->max_err = fabs(yget(reg, y, worst) - ref[worst]);
        gr->bound_at_max = bound[worst];
    }
    bool ok = true;
    if (bad) {
        int o = snprintf(gr->detail, sizeof gr->detail, "%s: %zu of %zu outside the bound, worst y[%zu] at %.3g of it;",
                         what, bad, checked, worst, wfrac);
        for (size_t i = 0, shown = 0; i < cnt && shown < 4 && o > 0 && (size_t)o < sizeof gr->detail; i++)
            if (routed[i]) {
                shown++;
                o += snprintf(gr->detail + o, sizeof gr->detail - (size_t)o, " y[%zu]=%.7g ref %.7g (%.2g of bound)", i,
                              yget(reg, y, i), ref[i], fabs(yget(reg, y, i) - ref[i]) / bound[i]);
            }
        ok = false;
    } else if (checked > 1 && (nonzero == 0 || distinct == 0)) {
        snprintf(gr->detail, sizeof gr->detail, "%s: all %zu routed outputs are %s (a vacuous pass)", what, checked,
                 nonzero == 0 ? "zero" : "equal");
        ok = false;
    }
    gr->pass = gr->pass && ok;
    free(ref), free(bound), free(routed);
    return ok;
}

static void gate1(const keel_contract_reg *reg, keel_contract_launch_fn launch, keel_contract_gate_result *gr) {
    char why[256] = "";
    if (reg->available && !reg->available(reg, why, sizeof why)) {
        FAIL(gr, "not launchable on %s: %s", reg->be->chip, why);
        return;
    }
    const keel_contract_shape *s = &reg->shapes[0];
    rcase c = gen(reg, s->n, s->k, reg->rows_min, D_NORMAL, 1);
    void *y = ybuf(reg, &c);
    if (!launch_case(reg, launch, &c, y, false, why, sizeof why))
        FAIL(gr, "the launch on n=%d k=%d m=%d reported an error: %s", s->n, s->k, c.m, why);
    const size_t per = (size_t)c.m * (size_t)c.n;
    for (size_t i = 0; gr->pass && i < y_elems(&c); i++)
        if ((c.down || ((c.items[i / per].mask >> (i % per / (size_t)c.n)) & 1u)) && !isfinite(yget(reg, y, i)))
            FAIL(gr, "the launch on n=%d k=%d m=%d left output %zu non-finite", s->n, s->k, c.m, i);
    free(y);
    rcase_free(&c);
}

static void gate2(const keel_contract_reg *reg, keel_contract_launch_fn launch, keel_contract_gate_result *gr) {
    char why[256];
    for (int si = 0; si < reg->n_shapes && gr->pass; si++) {
        const keel_contract_shape *s = &reg->shapes[si];
        for (int m = s->m_lo; m <= s->m_hi && gr->pass; m++) {
            rcase c = gen(reg, s->n, s->k, m, D_NORMAL, (uint64_t)(100 * si + m));
            void *y = ybuf(reg, &c);
            if (!launch_case(reg, launch, &c, y, true, why, sizeof why))
                FAIL(gr, "n=%d k=%d m=%d, %d items: %s", s->n, s->k, m, c.n_items, why);
            free(y);
            rcase_free(&c);
        }
    }
}

static void gate3(const keel_contract_reg *reg, keel_contract_launch_fn launch, keel_contract_gate_result *gr) {
    char why[256], what[160];
    for (int d = 0; d < D_COUNT && gr->pass; d++)
        for (int seed = 1; seed <= 2 && gr->pass; seed++) {
            const keel_contract_shape *s = &reg->shapes[seed == 1 ? reg->n_shapes - 1 : KEEL_MIN(1, reg->n_shapes - 1)];
            const int m = seed == 1 ? KEEL_MIN(2, s->m_hi) : s->m_hi;
            rcase c = gen(reg, s->n, s->k, m, d, (uint64_t)(1000 + seed));
            void *y = ybuf(reg, &c);
            if (!launch_case(reg, launch, &c, y, false, why, sizeof why)) {
                FAIL(gr, "launch error: %s", why);
            } else {
                snprintf(what, sizeof what, "%s seed %d, n=%d k=%d m=%d, %d items", DIST_NAMES[d], seed, s->n, s->k, m,
                         c.n_items);
                within_bound(reg, &c, y, what, gr);
            }
            free(y);
            rcase_free(&c);
        }
}

static bool same_elem(const keel_contract_reg *reg, const void *a, size_t i, const void *b, size_t j) {
    const size_t es = keel_dtype_size(reg->ydt);
    return memcmp((const uint8_t *)a + i * es, (const uint8_t *)b + j * es, es) == 0;
}

/* Every token range launched alone equals the same tokens of the whole launch (masked outputs, bit for bit). */
static void gate4_rows(const keel_contract_reg *reg, keel_contract_launch_fn launch, keel_contract_gate_result *gr) {
    char why[256];
    for (int si = 1; si < reg->n_shapes && gr->pass; si++) {
        const keel_contract_shape *s = &reg->shapes[si];
        const int M = s->m_hi;
        if (M < 2) continue;
        rcase c = gen(reg, s->n, s->k, M, D_NORMAL, (uint64_t)(4000 + si));
        void *y = ybuf(reg, &c);
        launch_case(reg, launch, &c, y, false, why, sizeof why);
        for (int m = 1; m < M && gr->pass; m++)
            for (int pos = 0; pos < (m == 1 ? M : 2) && gr->pass; pos++) {
                const int r0 = m == 1 ? pos : pos ? M - m : 0;
                int item_of[MAX_E];
                rcase p = sub_tokens(&c, r0, m, item_of);
                void *ym = ybuf(reg, &p);
                launch_case(reg, launch, &p, ym, false, why, sizeof why);
                for (int i = 0; i < (c.down ? 1 : p.n_items) && gr->pass; i++)
                    for (int t = 0; t < m && gr->pass; t++) {
                        if (!c.down && !((p.items[i].mask >> t) & 1u)) continue;
                        for (int j = 0; j < s->n && gr->pass; j++) {
                            const size_t a = ((size_t)i * (size_t)m + (size_t)t) * (size_t)s->n + (size_t)j;
                            const size_t b = ((size_t)(c.down ? 0 : item_of[i]) * (size_t)M + (size_t)(r0 + t)) *
                                                 (size_t)s->n + (size_t)j;
                            if (!same_elem(reg, ym, a, y, b))
                                FAIL(gr, "n=%d k=%d: tokens %d..%d launched as m=%d differ from the same tokens of an "
                                         "m=%d launch at token %d column %d%s: %.9g vs %.9g",
                                     s->n, s->k, r0, r0 + m - 1, m, M, r0 + t, j, c.down ? "" : " of an item",
                                     yget(reg, ym, a), yget(reg, y, b));
                        }
                    }
                free(ym);
                free(p.x);
            }
        free(y);
        rcase_free(&c);
    }
}

/* relu2 registration `ew` in place over cnt outputs of y (host), launched on the backend. */
static bool relu2_in_place(const keel_contract_reg *ew, void *y, size_t cnt, char *why, size_t cap) {
    const size_t bytes = cnt * keel_dtype_size(ew->ydt);
    void *dev = ew->be->alloc(bytes);
    ew->be->upload(dev, y, bytes);
    const keel_contract_args a = {.y = dev, .m = 1, .count = cnt};
    ew->launch(ew, &a);
    const bool ok = ew->be->sync(why, cap);
    ew->be->download(y, dev, bytes);
    ew->be->release(dev);
    return ok;
}

/* The sequence a routed launch replaces, on the same operands: per item a launch of the replaced plain stream
 * registration on that expert's matrix (then the relu2 registration for fused fc1); for fc2 the weighted sum
 * fma(w, y_i, tot) over the items in list order in fp32 on the host, rounded once to the output dtype. */
static bool replaced(const keel_contract_table *t, const keel_contract_reg *reg, const rcase *c, void *ys,
                     keel_contract_gate_result *gr) {
    const keel_contract_reg *plain = keel_contract_table_find(t, reg->replaces[0]);
    const keel_contract_reg *ew = reg->n_replaces > 1 ? keel_contract_table_find(t, reg->replaces[1]) : NULL;
    if (!plain || (reg->n_replaces > 1 && !ew)) {
        FAIL(gr, "replaces %s, which is not registered", !plain ? reg->replaces[0] : reg->replaces[1]);
        return false;
    }
    KEEL_ASSERT(plain->family == KEEL_CF_STREAM && (!ew || ew->family == KEEL_CF_RELU2));
    KEEL_ASSERT(plain->bits == reg->bits && plain->group == reg->group && plain->sdt == reg->sdt);
    const int n = c->n, m = c->m, k = c->k, ng = k / reg->group;
    const size_t words = keel_quant_row_words(k, reg->bits), ss = keel_dtype_size(reg->sdt);
    const size_t xrow = (size_t)k * keel_dtype_size(c->xdt), pes = keel_dtype_size(plain->ydt);
    float *tot = keel_xcalloc((size_t)m * (size_t)n, sizeof(float));
    char why[256];
    bool ok = true;
    for (int i = 0; ok && i < c->n_items; i++) {
        const int e = c->items[i].expert;
        rcase one = *c; /* that expert's matrix and the item's activations, every token: a plain tile's case */
        one.E = 1, one.n_items = 1, one.down = false;
        one.items[0] = (keel_cuda_route){.expert = 0, .mask = (1u << m) - 1u};
        one.w = c->w + (size_t)e * (size_t)n * words;
        one.s = (uint8_t *)c->s + (size_t)e * (size_t)n * (size_t)ng * ss;
        one.b = (uint8_t *)c->b + (size_t)e * (size_t)n * (size_t)ng * ss;
        one.x = (uint8_t *)c->x + (c->down ? (size_t)i * (size_t)m * xrow : 0);
        one.W.n = n, one.W.w = one.w, one.W.scales = one.s, one.W.biases = one.b;
        uint8_t *yi = keel_xcalloc((size_t)m * (size_t)n + 1, pes);
        ok = launch_case(plain, plain->launch, &one, yi, false, why, sizeof why);
        if (ok && ew) ok = relu2_in_place(ew, yi, (size_t)m * (size_t)n, why, sizeof why);
        if (!ok) FAIL(gr, "the replaced sequence (%s on expert %d) reported an error: %s", plain->name, e, why);
        for (int r = 0; ok && r < m; r++) {
            if (!((c->items[i].mask >> r) & 1u)) continue;
            for (int j = 0; j < n; j++) {
                const size_t src = (size_t)r * (size_t)n + (size_t)j;
                if (c->down)
                    tot[src] = fmaf(c->wts[i * 8 + r], keel_dtype_get_f32(plain->ydt, yi, src), tot[src]);
                else
                    memcpy((uint8_t *)ys + (((size_t)i * (size_t)m + (size_t)r) * (size_t)n + (size_t)j) * pes,
                           yi + src * pes, pes);
            }
        }
        free(yi);
    }
    if (ok && c->down)
        for (size_t o = 0; o < (size_t)m * (size_t)n; o++) keel_dtype_set_f32(reg->ydt, ys, o, tot[o]);
    free(tot);
    return ok;
}

/* Whether a launch of this shape and its replaced sequence add in the same order: the same k-split on both
 * sides (the routed split follows the stack's launch-width hint, the plain tile's the hint of one; fc2 adds each
 * item's slices in order, then the items in list order, as the sequence does). */
static bool same_order_at(const keel_contract_reg *reg, int n, int k) {
    if (reg->epi == KEEL_EPI_RELU2 && reg->ydt != KEEL_DT_F32) return false; /* the sequence rounds y, then squares */
    if (!reg->splits) return true;
    return reg->splits(n, k, KEEL_CONTRACT_ITEMS_OF(reg)) == reg->splits(n, k, 1);
}

static void gate4_fused(const keel_contract_table *t, const keel_contract_reg *reg, keel_contract_launch_fn launch,
                        keel_contract_gate_result *gr) {
    char why[256];
    for (int si = 1; si < reg->n_shapes && gr->pass; si++) {
        const keel_contract_shape *s = &reg->shapes[si];
        for (int d = 0; d < 2 && gr->pass; d++) {
            const int dist = d ? D_NEGGROUPS : D_NORMAL;
            rcase c = gen(reg, s->n, s->k, s->m_hi, dist, (uint64_t)(5000 + 10 * si + d));
            void *yf = ybuf(reg, &c), *ys = ybuf(reg, &c);
            launch_case(reg, launch, &c, yf, false, why, sizeof why);
            if (!replaced(t, reg, &c, ys, gr)) {
                free(yf), free(ys);
                rcase_free(&c);
                return;
            }
            const size_t cnt = y_elems(&c), per = (size_t)c.m * (size_t)c.n;
            if (same_order_at(reg, s->n, s->k)) {
                for (size_t o = 0; o < cnt && gr->pass; o++) {
                    if (!c.down && !((c.items[o / per].mask >> (o % per / (size_t)c.n)) & 1u)) continue;
                    if (!same_elem(reg, yf, o, ys, o))
                        FAIL(gr, "differs from what it replaces (%s then %s; %s, n=%d k=%d m=%d, %d items) at "
                                 "output %zu: %.9g vs %.9g", reg->replaces[0],
                             reg->n_replaces > 1 ? reg->replaces[1] : c.down ? "the weighted sum in list order" : "nothing",
                             DIST_NAMES[dist], c.n, c.k, c.m, c.n_items, o, yget(reg, yf, o), yget(reg, ys, o));
                }
            } else {
                keel_contract_gate_result tmp = {.pass = true};
                if (!within_bound(reg, &c, ys, "the replaced sequence", &tmp) || !within_bound(reg, &c, yf, "routed", &tmp))
                    FAIL(gr, "%s", tmp.detail);
            }
            free(yf), free(ys);
            rcase_free(&c);
        }
    }
}

static void gate4(const keel_contract_table *t, const keel_contract_reg *reg, keel_contract_launch_fn launch,
                  keel_contract_gate_result *gr) {
    char why[256];
    const keel_contract_shape *s = &reg->shapes[reg->n_shapes - 1];
    rcase c = gen(reg, s->n, s->k, s->m_hi, D_NORMAL, 3131);
    void *y1 = ybuf(reg, &c), *y2 = ybuf(reg, &c);
    launch_case(reg, launch, &c, y1, false, why, sizeof why);
    launch_case(reg, launch, &c, y2, false, why, sizeof why);
    for (size_t o = 0; o < y_elems(&c) && gr->pass; o++)
        if (!same_elem(reg, y1, o, y2, o))
            FAIL(gr, "two launches differ at output %zu: %.9g vs %.9g", o, yget(reg, y1, o), yget(reg, y2, o));
    free(y1), free(y2);
    rcase_free(&c);
    if (gr->pass) gate4_rows(reg, launch, gr);
    if (gr->pass) gate4_fused(t, reg, launch, gr);
}

void keel_contract_run_routed(const keel_contract_table *t, const keel_contract_reg *reg,
                              keel_contract_launch_fn launch, int max_gate, keel_contract_result *res) {
    memset(res, 0, sizeof *res);
    KEEL_ASSERT(reg->n_shapes >= 1 && launch != NULL && reg->experts >= 2 && reg->experts <= MAX_E);
    KEEL_ASSERT(reg->rows_max <= 8 && reg->n_replaces >= 1);
    for (int g = 1; g <= KEEL_MIN(max_gate, 4); g++) {
        keel_contract_gate_result *gr = &res->gate[g];
        gr->ran = gr->pass = true;
        if (g == 1) gate1(reg, launch, gr);
        if (g == 2) gate2(reg, launch, gr);
        if (g == 3) gate3(reg, launch, gr);
        if (g == 4) gate4(t, reg, launch, gr);
        if (!gr->pass) {
            res->first_red = g;
            return;
        }
    }
}
