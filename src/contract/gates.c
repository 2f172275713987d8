/* contract: gates 1-4 for one registration (or one of its twins), backend-neutral: operands are generated on the
 * host, copied to the backend between canary guards, launched, copied back and checked there.
 *
 * Gate 3's bound (the derivation of tests/kernels/cpu/test_stream.c): every output is a sum of terms x*s*q and
 * x*b whose magnitudes add up to A; each term passes at most L roundings (G/8 in its group's lane chain or the
 * group sum of x, 1 for the scale or bias fma, ng-1 over groups, 3 in the lane reduction, 1 in the final add:
 * L = G/8 + ng + 4; float matrices ceil(k/8) + 3), so |y - ref| <= 1.01*L*2^-24*A (+1e-30 for underflow), plus
 * the output dtype's rounding. relu^2 adds e*(2|y|+e) and one rounding of the square.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "contract.h"

#define U32 0x1p-24

/* ---- operands -------------------------------------------------------------------------------------- */


typedef enum dist { D_NORMAL, D_LARGE, D_NEGGROUPS, D_ZERORANGE, D_COUNT } dist;
static const char *const DIST_NAMES[D_COUNT] = {"normal", "large-magnitude", "all-negative-groups", "zero-range-groups"};

/* Host operands of one launch: W's arrays, x (m, k) in xdt, and y's initial content for in-place kernels. */
typedef struct hcase {
    int m, n, k;
    keel_qmat W; /* host pointers */
    uint32_t *w;
    void *s, *b, *x, *y0;
} hcase;

static size_t w_bytes(const keel_contract_reg *reg, int n, int k) {
    if (reg->family == KEEL_CF_STREAM) return (size_t)n * keel_quant_row_words(k, reg->bits) * 4u;
    if (reg->family == KEEL_CF_FLOAT) return (size_t)n * (size_t)k * keel_dtype_size(reg->sdt);
    return 0;
}
static size_t s_bytes(const keel_contract_reg *reg, int n, int k) {
    return reg->family == KEEL_CF_STREAM ? (size_t)n * (size_t)(k / reg->group) * keel_dtype_size(reg->sdt) : 0;
}
static size_t x_bytes(const keel_contract_reg *reg, int m, int k) {
    return reg->family == KEEL_CF_RELU2 ? 0 : (size_t)m * (size_t)k * keel_dtype_size(reg->xdt);
}
static size_t y_count(const keel_contract_reg *reg, int m, int n) {
    return reg->family == KEEL_CF_RELU2 ? (size_t)n : (size_t)m * (size_t)n;
}

static void hcase_free(hcase *h) {
    free(h->w), free(h->s), free(h->b), free(h->x), free(h->y0);
    memset(h, 0, sizeof *h);
}

/* Operands of distribution d: normal values; large magnitude (x1000); groups (or chunks of 8) whose weights
 * and activations are all negative; zero-range groups (scale 0, or one code for the whole group). */
static hcase gen_case(const keel_contract_reg *reg, int n, int k, int m, dist d, uint64_t seed) {
    hcase h = {.m = m, .n = n, .k = k};
    keel_contract_rng r = {.s = 0x9e3779b97f4a7c15ull ^ (seed * 0x2545f4914f6cdd1dull + (uint64_t)d * 977u + 1u)};
    for (int i = 0; i < 4; i++) keel_contract_rnext(&r);
    const double mag = d == D_LARGE ? 1000.0 : 1.0;
    if (reg->family == KEEL_CF_RELU2) { /* y0 in the kernel's dtype (F32, or BF16 on the GPU) */
        h.y0 = keel_xmalloc((size_t)n * keel_dtype_size(reg->ydt) + 1);
        for (int i = 0; i < n; i++) {
            double v = mag * keel_contract_rnorm(&r);
            if (d == D_NEGGROUPS && (i / 4) % 2 == 1) v = -fabs(v);
            if (d == D_ZERORANGE && i % 3 == 0) v = 0.0;
            keel_dtype_set_f32(reg->ydt, h.y0, (size_t)i, (float)v);
        }
        return h;
    }
    const int G = reg->family == KEEL_CF_STREAM ? reg->group : 8; /* negative / zero-range runs */
    h.x = keel_xmalloc(x_bytes(reg, m, k) + 1);
    for (int i = 0; i < m; i++)
        for (int c = 0; c < k; c++) {
            double v = mag * keel_contract_rnorm(&r);
            if (d == D_NEGGROUPS && (c / G) % 3 == 1) v = -fabs(v);
            keel_dtype_set_f32(reg->xdt, h.x, (size_t)i * (size_t)k + (size_t)c, (float)v);
        }
    h.w = keel_xmalloc(w_bytes(reg, n, k) + 4);
    if (reg->family == KEEL_CF_FLOAT) {
        for (int j = 0; j < n; j++)
            for (int c = 0; c < k; c++) {
                double v = mag * keel_contract_rnorm(&r);
                if (d == D_NEGGROUPS && (c / G) % 2 == 1) v = -fabs(v);
                if (d == D_ZERORANGE && (c / G) % 3 == 0) v = 0.0;
                keel_dtype_set_f32(reg->sdt, h.w, (size_t)j * (size_t)k + (size_t)c, (float)v);
            }
        h.W = (keel_qmat){.n = n, .k = k, .bits = 0, .group = 0, .sdt = reg->sdt, .w = h.w};
        return h;
    }
    const int ng = k / G, bits = reg->bits, qmax = (1 << bits) - 1;
    const size_t words = keel_quant_row_words(k, bits);
    h.s = keel_xmalloc(s_bytes(reg, n, k) + 1);
    h.b = keel_xmalloc(s_bytes(reg, n, k) + 1);
    uint8_t *codes = keel_xmalloc((size_t)k);
    for (int j = 0; j < n; j++) {
        for (int g = 0; g < ng; g++) {
            double s = mag * keel_contract_rnorm(&r) / (double)(1 << bits), b = 0.5 * mag * keel_contract_rnorm(&r);
            const uint8_t c0 = (uint8_t)(keel_contract_rnext(&r) % (uint64_t)(qmax + 1));
            const bool one_code = d == D_ZERORANGE && (j + g) % 2 == 1;
            for (int c = 0; c < G; c++) codes[g * G + c] = one_code ? c0 : (uint8_t)(keel_contract_rnext(&r) % (uint64_t)(qmax + 1));
            if (d == D_ZERORANGE && (j + g) % 2 == 0) s = 0.0;
            if (d == D_NEGGROUPS && (j + g) % 2 == 1) { /* every dequantized weight of the group < 0 */
                s = fabs(s);
                b = -(fabs(b) + s * qmax) - 1e-3 * mag;
            }
            keel_dtype_set_f32(reg->sdt, h.s, (size_t)j * (size_t)ng + (size_t)g, (float)s);
            keel_dtype_set_f32(reg->sdt, h.b, (size_t)j * (size_t)ng + (size_t)g, (float)b);
        }
        keel_quant_pack_row(codes, k, bits, h.w + (size_t)j * words);
    }
    free(codes);
    h.W = (keel_qmat){.n = n, .k = k, .bits = bits, .group = G, .sdt = reg->sdt, .w = h.w, .scales = h.s,
                      .biases = h.b};
    return h;
}

/* A case whose x holds rows [r0, r0+m) of h (sharing h's weights); free only its x. */
static hcase sub_rows(const keel_contract_reg *reg, const hcase *h, int r0, int m) {
    hcase s = *h;
    s.m = m;
    s.y0 = NULL;
    const size_t row = x_bytes(reg, 1, h->k);
    s.x = keel_xmalloc(row * (size_t)m + 1);
    memcpy(s.x, (const uint8_t *)h->x + row * (size_t)r0, row * (size_t)m);
    return s;
}

/* ---- reference ------------------------------------------------------------------------------------- */

static double out_unit(keel_dtype dt) { return dt == KEEL_DT_BF16 ? 0x1p-8 : dt == KEEL_DT_F16 ? 0x1p-11 : 0.0; }

/* float64 reference and gate-3 bound of every output of h under reg's arithmetic and epilogue. */
static void reference(const keel_contract_reg *reg, const hcase *h, double *ref, double *bound) {
    if (reg->family == KEEL_CF_RELU2) {
        for (int i = 0; i < h->n; i++) {
            const double v = keel_dtype_get_f32(reg->ydt, h->y0, (size_t)i), r = v > 0 ? v * v : 0.0;
            ref[i] = r;
            bound[i] = U32 * r + out_unit(reg->ydt) * r * (1 + U32) + 1e-44;
        }
        return;
    }
    const int n = h->n, k = h->k;
    const int splits = reg->splits ? reg->splits(n, k, KEEL_CONTRACT_ITEMS_OF(reg)) : 1; /* the tile's k-split */
    for (int i = 0; i < h->m; i++)
        for (int j = 0; j < n; j++) {
            double acc = 0, A = 0;
            int L;
            if (reg->family == KEEL_CF_FLOAT) {
                for (int c = 0; c < k; c++) {
                    const double x = keel_dtype_get_f32(reg->xdt, h->x, (size_t)i * k + c);
                    const double w = keel_dtype_get_f32(reg->sdt, h->w, (size_t)j * k + c);
                    acc += x * w;
                    A += fabs(x * w);
                }
                L = (k + 7) / 8 + 3;
            } else {
                const int ng = k / reg->group;
                const uint32_t *row = h->w + (size_t)j * keel_quant_row_words(k, reg->bits);
                const double off = reg->arith == KEEL_CA_MMA ? keel_contract_mma_offset(reg->bits, reg->xdt) : 0;
                for (int c = 0; c < k; c++) {
                    const size_t gi = (size_t)j * ng + (size_t)(c / reg->group);
                    const double s = keel_dtype_get_f32(reg->sdt, h->s, gi), b = keel_dtype_get_f32(reg->sdt, h->b, gi);
                    const double sq = s * (double)keel_quant_code(row, reg->bits, c);
                    const double x = keel_dtype_get_f32(reg->xdt, h->x, (size_t)i * k + c);
                    acc += x * (sq + b);
                    A += fabs(x) * (fabs(sq) + fabs(b) + 2 * off * fabs(s));
                }
                L = reg->arith == KEEL_CA_MMA ? keel_contract_mma_roundings(reg->group, k, splits)
                                              : reg->group / 8 + ng + 4;
            }
            double e = 1.01 * L * U32 * A + 1e-30;
            if (reg->epi == KEEL_EPI_RELU2) {
                /* compared within the bound with a sequence that stores y before squaring: that rounding too */
                if (reg->n_replaces > 0 && !reg->same_order) e += out_unit(reg->ydt) * (fabs(acc) + e);
                const double r = acc > 0 ? acc : 0;
                e = e * (2 * r + e) + U32 * (r + e) * (r + e);
                acc = r * r;
            }
            e += out_unit(reg->ydt) * (fabs(acc) + e);
            ref[(size_t)i * n + j] = acc;
            bound[(size_t)i * n + j] = e;
        }
}

/* Roundings each term of a tensor-core stream tile passes (docs/kernel-contract.md, gate 3), in units of 2^-24:
 * 9*G/8 in its group's mma chains (G/32 chained mma per accumulator, each aligning 17 addends to the largest and
 * normalizing, each step truncating by at most one fp32 ulp, 2^-23, of the largest: 18 ulps per mma; the bias
 * term's G-long sum of x is less), 5 for S0+S1, the offset's removal, the scale product, the bias fma and a spare,
 * ng - 1 group adds, and one per k-split slice (the partials added in slice order). */
int keel_contract_mma_roundings(int group, int k, int splits) { return 9 * group / 8 + k / group + splits + 5; }

/* The offset M a tensor-core tile's operand codes keep at most (q + M; M sum(x) taken off S at each group end, or at
 * 2 bits each code's place offset, at most M, summed with x): 128 with bf16 activations at 2-6 bits, else 0. A
 * term's magnitude is then |x|(|s|(q + 2M) + |b|): the mma sums |x|(q + M), and M |s| times the group's sum of x,
 * whose own roundings the G-long chain already counts. */
double keel_contract_mma_offset(int bits, keel_dtype xdt) { return xdt == KEEL_DT_BF16 && bits != 8 ? 128.0 : 0.0; }

/* ---- guarded launches ------------------------------------------------------------------------------ */

#define GUARD KEEL_CONTRACT_GUARD
#define Y_UNWRITTEN KEEL_CONTRACT_UNWRITTEN

static uint8_t canary(size_t i, int salt) { return (uint8_t)(0xA5u ^ (unsigned)(i * 29u + (size_t)salt * 7u)); }

typedef keel_contract_gbuf gbuf;

void keel_contract_gbuf_make(gbuf *g, const keel_contract_backend *be, const char *name, const void *data,
                             size_t bytes, int salt) {
    g->name = name;
    g->bytes = bytes;
    g->img = keel_xmalloc(bytes + 2 * GUARD);
    for (size_t i = 0; i < GUARD; i++) g->img[i] = canary(i, salt), g->img[GUARD + bytes + i] = canary(i + GUARD, salt);
    if (data)
        memcpy(g->img + GUARD, data, bytes);
    else
        memset(g->img + GUARD, (int)Y_UNWRITTEN, bytes);
    g->dev = be->alloc(bytes + 2 * GUARD);
    be->upload(g->dev, g->img, bytes + 2 * GUARD);
}

bool keel_contract_gbuf_check(const gbuf *g, const uint8_t *back, bool input, char *why, size_t cap) {
    for (size_t i = 0; i < GUARD; i++) {
        if (back[i] != g->img[i]) {
            snprintf(why, cap, "the guard before %s was written (byte %zu before its start)", g->name, GUARD - i);
            return false;
        }
        if (back[GUARD + g->bytes + i] != g->img[GUARD + g->bytes + i]) {
            snprintf(why, cap, "the guard after %s was written (byte %zu past its end of %zu)", g->name, i, g->bytes);
            return false;
        }
    }
    if (input && memcmp(back + GUARD, g->img + GUARD, g->bytes) != 0) {
        size_t i = 0;
        while (back[GUARD + i] == g->img[GUARD + i]) i++;
        snprintf(why, cap, "input %s was modified (byte %zu of %zu)", g->name, i, g->bytes);
        return false;
    }
    return true;
}

void keel_contract_gbuf_free(gbuf *g, const keel_contract_backend *be) {
    be->release(g->dev);
    free(g->img);
}

/* Launches `launch` on h; y receives the output (ydt elements). With `check`, verifies every guard, that inputs
 * are unchanged and that every output was written; returns false with the reason in why. */
static bool launch_case(const keel_contract_reg *reg, keel_contract_launch_fn launch, const hcase *h, void *y,
                        bool check, char *why, size_t cap) {
    const keel_contract_backend *be = reg->be;
    const size_t yb = y_count(reg, h->m, h->n) * keel_dtype_size(reg->ydt);
    gbuf bufs[5];
    int nb = 0;
    gbuf *gw = NULL, *gs = NULL, *gb = NULL, *gx = NULL, *gy;
    if (w_bytes(reg, h->n, h->k)) keel_contract_gbuf_make(gw = &bufs[nb++], be, "W", h->w, w_bytes(reg, h->n, h->k), 1);
    if (s_bytes(reg, h->n, h->k)) {
        keel_contract_gbuf_make(gs = &bufs[nb++], be, "scales", h->s, s_bytes(reg, h->n, h->k), 2);
        keel_contract_gbuf_make(gb = &bufs[nb++], be, "biases", h->b, s_bytes(reg, h->n, h->k), 3);
    }
    if (x_bytes(reg, h->m, h->k)) keel_contract_gbuf_make(gx = &bufs[nb++], be, "x", h->x, x_bytes(reg, h->m, h->k), 4);
    keel_contract_gbuf_make(gy = &bufs[nb++], be, "y", h->y0, yb, 5);

    keel_contract_args a = {.W = h->W, .m = h->m, .count = y_count(reg, h->m, h->n)};
    if (gw) a.W.w = (const uint32_t *)((uint8_t *)gw->dev + GUARD);
    if (gs) a.W.scales = (uint8_t *)gs->dev + GUARD, a.W.biases = (uint8_t *)gb->dev + GUARD;
    if (gx) a.x = (uint8_t *)gx->dev + GUARD;
    a.y = (uint8_t *)gy->dev + GUARD;
    launch(reg, &a);
    bool ok = be->sync(why, cap);
    uint8_t *back = keel_xmalloc(yb + 2 * GUARD);
    be->download(back, gy->dev, yb + 2 * GUARD);
    memcpy(y, back + GUARD, yb);
    if (ok && check) {
        ok = keel_contract_gbuf_check(gy, back, false, why, cap);
        const size_t ys = keel_dtype_size(reg->ydt);
        for (size_t i = 0; ok && !h->y0 && i < yb; i += ys) {
            size_t u = 0;
            while (u < ys && back[GUARD + i + u] == Y_UNWRITTEN) u++;
            if (u == ys) {
                snprintf(why, cap, "output y[%zu] was not written", i / ys);
                ok = false;
            }
        }
        for (int i = 0; ok && i < nb - 1; i++) {
            uint8_t *ib = keel_xmalloc(bufs[i].bytes + 2 * GUARD);
            be->download(ib, bufs[i].dev, bufs[i].bytes + 2 * GUARD);
            ok = keel_contract_gbuf_check(&bufs[i], ib, true, why, cap);
            free(ib);
        }
    }
    free(back);
    for (int i = 0; i < nb; i++) keel_contract_gbuf_free(&bufs[i], be);
    return ok;
}

/* ---- the gates ------------------------------------------------------------------------------------- */

static double yget(const keel_contract_reg *reg, const void *y, size_t i) { return keel_dtype_get_f32(reg->ydt, y, i); }

static void *ybuf(const keel_contract_reg *reg, size_t count) { return keel_xcalloc(count + 1, keel_dtype_size(reg->ydt)); }

#define FAIL(gr, ...)                                                                              \
    do {                                                                                           \
        (gr)->pass = false;                                                                        \
        snprintf((gr)->detail, sizeof (gr)->detail, __VA_ARGS__);                                 \
    } while (0)

static void gate1(const keel_contract_reg *reg, keel_contract_launch_fn launch, keel_contract_gate_result *gr) {
    char why[256] = "";
    if (reg->available && !reg->available(reg, why, sizeof why)) {
        FAIL(gr, "not launchable on %s: %s", reg->be->chip, why);
        return;
    }
    const keel_contract_shape *s = &reg->shapes[0];
    hcase h = gen_case(reg, s->n, s->k, reg->rows_min, D_NORMAL, 1);
    const size_t cnt = y_count(reg, h.m, h.n);
    void *y = ybuf(reg, cnt);
    if (!launch_case(reg, launch, &h, y, false, why, sizeof why))
        FAIL(gr, "the launch on n=%d k=%d m=%d reported an error: %s", s->n, s->k, h.m, why);
    for (size_t i = 0; gr->pass && i < cnt; i++)
        if (!isfinite(yget(reg, y, i))) FAIL(gr, "the launch on n=%d k=%d m=%d left y[%zu] non-finite", s->n, s->k, h.m, i);
    free(y);
    hcase_free(&h);
}

static void gate2(const keel_contract_reg *reg, keel_contract_launch_fn launch, keel_contract_gate_result *gr) {
    char why[256];
    for (int si = 0; si < reg->n_shapes && gr->pass; si++) {
        const keel_contract_shape *s = &reg->shapes[si];
        for (int m = s->m_lo; m <= s->m_hi && gr->pass; m++) {
            hcase h = gen_case(reg, s->n, s->k, m, D_NORMAL, (uint64_t)(100 * si + m));
            void *y = ybuf(reg, y_count(reg, m, s->n));
            if (!launch_case(reg, launch, &h, y, true, why, sizeof why))
                FAIL(gr, "n=%d k=%d m=%d: %s", s->n, s->k, m, why);
            free(y);
            hcase_free(&h);
        }
    }
}

/* Compares y with the reference; records the worst fraction of the bound; prints values side by side. */
static bool within_bound(const keel_contract_reg *reg, const hcase *h, const void *y, const char *what,
                         keel_contract_gate_result *gr) {
    const size_t cnt = y_count(reg, h->m, h->n);
    double *ref = keel_xmalloc(cnt * sizeof(double)), *bound = keel_xmalloc(cnt * sizeof(double));
    reference(reg, h, ref, bound);
    size_t bad = 0, worst = 0, nonzero = 0, distinct = 0;
    double wfrac = 0;
    for (size_t i = 0; i < cnt; i++) {
        const double v = yget(reg, y, i), err = fabs(v - ref[i]);
        const double frac = err / bound[i];
        if (!(err <= bound[i])) bad++;
        if (!(frac <= wfrac)) wfrac = frac, worst = i;
        nonzero += v != 0.0;
        distinct += i > 0 && v != yget(reg, y, 0);
    }
    if (wfrac > gr->frac || isnan(wfrac)) {
        gr->frac = wfrac;
        gr->max_err = fabs(yget(reg, y, worst) - ref[worst]);
        gr->bound_at_max = bound[worst];
    }
    bool ok = true;
    if (bad) {
        int o = snprintf(gr->detail, sizeof gr->detail, "%s: %zu of %zu outside the bound, worst y[%zu] at %.3g of it;",
                         what, bad, cnt, worst, wfrac);
        for (size_t i = 0; i < cnt && i < 4 && o > 0 && (size_t)o < sizeof gr->detail; i++)
            o += snprintf(gr->detail + o, sizeof gr->detail - (size_t)o, " y[%zu]=%.7g ref %.7g (%.2g of bound)", i,
                          yget(reg, y, i), ref[i], fabs(yget(reg, y, i) - ref[i]) / bound[i]);
        ok = false;
    } else if (cnt > 1 && (nonzero == 0 || distinct == 0)) {
        snprintf(gr->detail, sizeof gr->detail, "%s: all %zu outputs are %s (a vacuous pass)", what, cnt,
                 nonzero == 0 ? "zero" : "equal");
        ok = false;
    }
    gr->pass = gr->pass && ok;
    free(ref);
    free(bound);
    return ok;
}

static void gate3(const keel_contract_reg *reg, keel_contract_launch_fn launch, keel_contract_gate_result *gr) {
    char why[256], what[160];
    for (int d = 0; d < D_COUNT && gr->pass; d++)
        for (int seed = 1; seed <= 2 && gr->pass; seed++) {
            const keel_contract_shape *s = &reg->shapes[seed == 1 ? reg->n_shapes - 1 : KEEL_MIN(1, reg->n_shapes - 1)];
            const int m = seed == 1 ? KEEL_MIN(2, s->m_hi) : s->m_hi; /* a short launch and the longest */
            hcase h = gen_case(reg, s->n, s->k, m, (dist)d, (uint64_t)(1000 + seed));
            void *y = ybuf(reg, y_count(reg, m, s->n));
            if (!launch_case(reg, launch, &h, y, false, why, sizeof why)) {
                FAIL(gr, "launch error: %s", why);
            } else {
                snprintf(what, sizeof what, "%s seed %d, n=%d k=%d m=%d", DIST_NAMES[d], seed, s->n, s->k, m);
                within_bound(reg, &h, y, what, gr);
            }
            free(y);
            hcase_free(&h);
        }
}

static bool same_bits(const keel_contract_reg *reg, const void *a, const void *b, size_t cnt, size_t *first) {
    const size_t es = keel_dtype_size(reg->ydt);
    for (size_t i = 0; i < cnt; i++)
        if (memcmp((const uint8_t *)a + i * es, (const uint8_t *)b + i * es, es) != 0) {
            *first = i;
            return false;
        }
    return true;
}

/* Each row of an m-row launch equals that row launched alone; for in-place elementwise kernels, slices. */
static void gate4_rows(const keel_contract_reg *reg, keel_contract_launch_fn launch, keel_contract_gate_result *gr) {
    char why[256];
    size_t at;
    const keel_contract_shape *s = &reg->shapes[reg->n_shapes - 1];
    if (reg->family == KEEL_CF_RELU2) {
        const size_t es = keel_dtype_size(reg->ydt);
        hcase h = gen_case(reg, s->n, 0, 1, D_NORMAL, 4242);
        uint8_t *y = ybuf(reg, (size_t)s->n), *ys = ybuf(reg, (size_t)s->n);
        launch_case(reg, launch, &h, y, false, why, sizeof why);
        const int cuts[3][2] = {{0, 1}, {1, s->n}, {s->n / 2, s->n}};
        for (int c = 0; c < 3 && gr->pass; c++) {
            hcase p = {.m = 1, .n = cuts[c][1] - cuts[c][0], .k = 0};
            p.y0 = keel_xmalloc((size_t)p.n * es + 1);
            memcpy(p.y0, (uint8_t *)h.y0 + (size_t)cuts[c][0] * es, (size_t)p.n * es);
            launch_case(reg, launch, &p, ys, false, why, sizeof why);
            if (!same_bits(reg, ys, y + (size_t)cuts[c][0] * es, (size_t)p.n, &at))
                FAIL(gr, "elements [%d, %d) launched alone differ from the whole launch at element %zu", cuts[c][0],
                     cuts[c][1], cuts[c][0] + at);
            hcase_free(&p);
        }
        free(y), free(ys);
        hcase_free(&h);
        return;
    }
    for (int si = 1; si < reg->n_shapes && gr->pass; si++) {
        s = &reg->shapes[si];
        const int M = s->m_hi;
        if (M < 2) continue;
        hcase h = gen_case(reg, s->n, s->k, M, D_NORMAL, (uint64_t)(4000 + si));
        void *y = ybuf(reg, (size_t)M * s->n), *ym = ybuf(reg, (size_t)M * s->n);
        launch_case(reg, launch, &h, y, false, why, sizeof why);
        const size_t es = keel_dtype_size(reg->ydt);
        for (int m = 1; m < M && gr->pass; m++) /* every row alone; longer runs at the start and the end */
            for (int pos = 0; pos < (m == 1 ? M : 2) && gr->pass; pos++) {
                const int r0 = m == 1 ? pos : pos ? M - m : 0;
                hcase p = sub_rows(reg, &h, r0, m);
                launch_case(reg, launch, &p, ym, false, why, sizeof why);
                if (!same_bits(reg, ym, (uint8_t *)y + (size_t)r0 * s->n * es, (size_t)m * s->n, &at))
                    FAIL(gr, "n=%d k=%d: rows %d..%d launched as m=%d differ from the same rows of an m=%d launch at "
                             "row %zu column %zu: %.9g vs %.9g",
                         s->n, s->k, r0, r0 + m - 1, m, M, r0 + at / s->n, at % s->n, yget(reg, ym, at),
                         yget(reg, y, (size_t)r0 * s->n + at));
                free(p.x);
            }
        free(y), free(ym);
        hcase_free(&h);
    }
}

/* A fused launch equals the sequence of registrations it replaces, run on the same operands. */
static void gate4_fused(const keel_contract_table *t, const keel_contract_reg *reg, keel_contract_launch_fn launch,
                        keel_contract_gate_result *gr) {
    if (reg->n_replaces == 0) return;
    const keel_contract_reg *seq[KEEL_CONTRACT_MAX_REPLACES];
    for (int i = 0; i < reg->n_replaces; i++) {
        seq[i] = keel_contract_table_find(t, reg->replaces[i]);
        if (!seq[i]) {
            FAIL(gr, "replaces %s, which is not registered", reg->replaces[i]);
            return;
        }
    }
    char why[256];
    const keel_contract_shape *s = &reg->shapes[reg->n_shapes - 1];
    const dist ds[2] = {D_NORMAL, D_NEGGROUPS};
    for (int di = 0; di < 2 && gr->pass; di++) {
        hcase h = gen_case(reg, s->n, s->k, s->m_hi, ds[di], (uint64_t)(5000 + di));
        const size_t cnt = y_count(reg, h.m, h.n);
        void *yf = ybuf(reg, cnt), *ys = ybuf(reg, cnt);
        launch_case(reg, launch, &h, yf, false, why, sizeof why);
        launch_case(seq[0], seq[0]->launch, &h, ys, false, why, sizeof why);
        for (int i = 1; i < reg->n_replaces; i++) { /* later steps are in-place elementwise kernels on y */
            KEEL_ASSERT(seq[i]->family == KEEL_CF_RELU2 && seq[i]->ydt == reg->ydt);
            hcase e = {.m = 1, .n = (int)cnt, .k = 0};
            e.y0 = keel_xmalloc(cnt * keel_dtype_size(reg->ydt) + 1);
            memcpy(e.y0, ys, cnt * keel_dtype_size(reg->ydt));
            launch_case(seq[i], seq[i]->launch, &e, ys, false, why, sizeof why);
            hcase_free(&e);
        }
        size_t at;
        if (reg->same_order && !same_bits(reg, yf, ys, cnt, &at))
            FAIL(gr, "fused differs from %s then %s (%s, n=%d k=%d m=%d) at y[%zu]: %.9g vs %.9g", reg->replaces[0],
                 reg->replaces[1], DIST_NAMES[ds[di]], h.n, h.k, h.m, at, yget(reg, yf, at), yget(reg, ys, at));
        if (!reg->same_order) {
            keel_contract_gate_result tmp = {.pass = true};
            if (!within_bound(reg, &h, ys, "the replaced sequence", &tmp) || !within_bound(reg, &h, yf, "fused", &tmp))
                FAIL(gr, "%s", tmp.detail);
        }
        free(yf), free(ys);
        hcase_free(&h);
    }
}

static void gate4(const keel_contract_table *t, const keel_contract_reg *reg, keel_contract_launch_fn launch,
                  keel_contract_gate_result *gr) {
    char why[256];
    const keel_contract_shape *s = &reg->shapes[reg->n_shapes - 1];
    hcase h = gen_case(reg, s->n, s->k, s->m_hi, D_NORMAL, 3131);
    const size_t cnt = y_count(reg, h.m, h.n);
    void *y1 = ybuf(reg, cnt), *y2 = ybuf(reg, cnt);
    launch_case(reg, launch, &h, y1, false, why, sizeof why);
    launch_case(reg, launch, &h, y2, false, why, sizeof why);
    size_t at;
    if (!same_bits(reg, y1, y2, cnt, &at))
        FAIL(gr, "two launches differ at y[%zu]: %.9g vs %.9g", at, yget(reg, y1, at), yget(reg, y2, at));
    free(y1), free(y2);
    hcase_free(&h);
    if (gr->pass) gate4_rows(reg, launch, gr);
    if (gr->pass) gate4_fused(t, reg, launch, gr);
}

void keel_contract_run(const keel_contract_table *t, const keel_contract_reg *reg, keel_contract_launch_fn launch,
                       int max_gate, keel_contract_result *res) {
    if (reg->run) { /* a family with its own gates (routed kernels) */
        reg->run(t, reg, launch, max_gate, res);
        return;
    }
    memset(res, 0, sizeof *res);
    KEEL_ASSERT(reg->n_shapes >= 1 && launch != NULL);
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
