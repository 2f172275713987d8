/* contract: the CUDA engine's own kernels (src/engine/cuda/kernels.cu) under gates 1-4 with float64 references and
 * planted controls from their compiled twin (twin_engine_cuda.cu). The kernels are not matrix tiles, so each
 * registration brings its own `run`; the gates mean what they mean for the tiles:
 *   1 a launch on the smallest shape reports no error and its outputs are finite
 *   2 every buffer sits between canary guards; after a launch on every shape the guards and the inputs are intact
 *   3 every output within its bound of the float64 reference (derived per kernel below, in units of 2^-24 of the
 *     magnitudes summed, plus the output's own rounding), two seeds and two distributions; integer outputs (chosen
 *     experts, argmax) exactly; float outputs that are all equal fail
 *   4 two launches give the same bits; each row launched alone gives the bits of the window (row-wise kernels), and
 *     m one-token launches give the bits of one m-token launch (the Mamba conv and scan, whose state carries)
 * None fuses a sequence another registration covers except add_rmsnorm, which replaces the residual add and then
 * rmsnorm (compared at gate 3 against the float64 sequence). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_regs_cuda.h"

const char *const keel_contract_cuda_engine_entries[] = {
    "keel_ecu_embed", "keel_ecu_rmsnorm", "keel_ecu_add_rmsnorm", "keel_ecu_add_bias", "keel_ecu_matvec",
    "keel_ecu_conv",  "keel_ecu_ssm",     "keel_ecu_gate_norm",   "keel_ecu_route",
    "keel_ecu_argmax", "keel_ecu_matvec_routed", "keel_ecu_combine", "keel_ecu_route_union", NULL};

#if !defined(KEEL_HAVE_CUDA)
int keel_contract_register_cuda_engine(keel_contract_table *t) {
    (void)t;
    return 0;
}
#else
#include "../engine/cuda/ecuda.h"

#define U 0x1p-24
#define GUARD KEEL_CONTRACT_GUARD
#define MAXB 8
/* The quantized fp32 matvec's roundings on one output: a 32-code unit's sums as four sequential partials of 8 and a
 * two-level tree (10), its scale and bias terms (2), the lane's units in order (one per 1024 codes), the warp's
 * five-level tree (5). */
#define QMV_HOPS(k) (17 + ((k) + 1023) / 1024)
#define BF16_UNIT 0x1p-8 /* bf16 keeps 8 significant bits: rounding to nearest errs by at most 2^-8 |v| */

enum { K_EMBED, K_RMSNORM, K_ADDNORM, K_ADDBIAS, K_MATVEC_F, K_MATVEC_Q, K_CONV, K_SSM, K_GATENORM, K_ROUTE,
       K_ARGMAX, K_ROUTED_UP, K_ROUTED_DOWN, K_COMBINE, K_UNION, K_N };
enum { R_IN, R_OUT, R_STATE, R_SCRATCH };

typedef struct buf {
    keel_dtype dt;
    size_t n, row; /* elements; elements per row when row-wise (0: one block for every row) */
    int role;
    void *h;       /* host values */
    keel_contract_gbuf g; /* its guarded backend copy */
} buf;

typedef struct ecase {
    int kind, m, n, k; /* n, k: the shape's widths (meaning per kind) */
    int nb;
    buf b[MAXB];
} ecase;


/* ---- cases ---- */

/* Per kind: the Mamba geometry used at every shape, the router's and the routed matvec's counts. */
enum { S_P = 16, S_N = 48, S_G = 2, C_K = 4, R_K1 = 6, R_K2 = 4, X_E = 4, X_K = 2 };

static void add(ecase *c, keel_dtype dt, size_t n, size_t row, int role) {
    KEEL_ASSERT(c->nb < MAXB);
    c->b[c->nb++] = (buf){.dt = dt, .n = n, .row = row, .role = role, .h = keel_xcalloc(n + 1, 8)};
}

static void case_free(ecase *c) {
    for (int i = 0; i < c->nb; i++) free(c->b[i].h);
    memset(c, 0, sizeof *c);
}

static double hget(const buf *b, size_t i) {
    if (b->dt == KEEL_DT_I32) return ((const int32_t *)b->h)[i];
    if (b->dt == KEEL_DT_U32) return ((const uint32_t *)b->h)[i];
    return keel_dtype_get_f32(b->dt, b->h, i);
}
static void hset(buf *b, size_t i, double v) {
    if (b->dt == KEEL_DT_I32) ((int32_t *)b->h)[i] = (int32_t)v;
    else if (b->dt == KEEL_DT_U32) ((uint32_t *)b->h)[i] = (uint32_t)v;
    else keel_dtype_set_f32(b->dt, b->h, i, (float)v);
}

/* Buffers of each kind, in the order the launch and the reference read them. */
static void layout(ecase *c) {
    const size_t m = (size_t)c->m, n = (size_t)c->n, k = (size_t)c->k;
    switch (c->kind) {
    case K_EMBED: /* n = vocab, k = hidden; 6-bit g64 */
        add(c, KEEL_DT_U32, n * k * 6 / 32, 0, R_IN), add(c, KEEL_DT_BF16, n * k / 64, 0, R_IN);
        add(c, KEEL_DT_BF16, n * k / 64, 0, R_IN), add(c, KEEL_DT_I32, m, 1, R_IN);
        add(c, KEEL_DT_F32, m * k, k, R_OUT);
        break;
    case K_RMSNORM:
        add(c, KEEL_DT_F32, m * n, n, R_IN), add(c, KEEL_DT_BF16, n, 0, R_IN);
        add(c, KEEL_DT_F32, m * n, n, R_OUT), add(c, KEEL_DT_BF16, m * n, n, R_OUT);
        break;
    case K_ADDNORM:
        add(c, KEEL_DT_F32, m * n, n, R_STATE), add(c, KEEL_DT_F32, m * n, n, R_IN);
        add(c, KEEL_DT_F32, m * n, n, R_IN), add(c, KEEL_DT_BF16, n, 0, R_IN), add(c, KEEL_DT_BF16, n, 0, R_IN);
        add(c, KEEL_DT_F32, m * n, n, R_OUT), add(c, KEEL_DT_BF16, m * n, n, R_OUT);
        break;
    case K_ADDBIAS: add(c, KEEL_DT_F32, m * n, n, R_STATE), add(c, KEEL_DT_BF16, n, 0, R_IN); break;
    case K_MATVEC_F: /* n outputs over k, BF16 weights */
        add(c, KEEL_DT_BF16, n * k, 0, R_IN), add(c, KEEL_DT_F32, m * k, k, R_IN), add(c, KEEL_DT_F32, m * n, n, R_OUT);
        break;
    case K_MATVEC_Q: /* 4-bit g64, BF16 scales */
        add(c, KEEL_DT_U32, n * k * 4 / 32, 0, R_IN), add(c, KEEL_DT_BF16, n * k / 64, 0, R_IN);
        add(c, KEEL_DT_BF16, n * k / 64, 0, R_IN), add(c, KEEL_DT_F32, m * k, k, R_IN);
        add(c, KEEL_DT_F32, m * n, n, R_OUT);
        break;
    case K_CONV: /* n channels; proj rows n + 8 wide, the conv input at column 8 */
        add(c, KEEL_DT_F32, m * (n + 8), n + 8, R_IN), add(c, KEEL_DT_F32, (C_K - 1) * n, 0, R_STATE);
        add(c, KEEL_DT_BF16, n * C_K, 0, R_IN), add(c, KEEL_DT_BF16, n, 0, R_IN), add(c, KEEL_DT_F32, m * n, n, R_OUT);
        break;
    case K_SSM: { /* n heads of S_P, state S_N, S_G groups; xbc = x | B | C; proj rows n + 4, dt at column 4 */
        const size_t di = n * S_P, cd = di + 2 * S_G * S_N;
        add(c, KEEL_DT_F32, m * cd, cd, R_IN), add(c, KEEL_DT_F32, m * (n + 4), n + 4, R_IN);
        add(c, KEEL_DT_F32, n * S_P * S_N, 0, R_STATE), add(c, KEEL_DT_BF16, n, 0, R_IN);
        add(c, KEEL_DT_F32, n, 0, R_IN), add(c, KEEL_DT_BF16, n, 0, R_IN), add(c, KEEL_DT_F32, m * di, di, R_OUT);
        break;
    }
    case K_GATENORM: /* n = d_inner in S_G groups; bf16 and fp32 outputs */
        add(c, KEEL_DT_F32, m * n, n, R_IN), add(c, KEEL_DT_F32, m * n, n, R_IN), add(c, KEEL_DT_BF16, n, 0, R_IN);
        add(c, KEEL_DT_BF16, m * n, n, R_OUT), add(c, KEEL_DT_F32, m * n, n, R_OUT);
        break;
    case K_ROUTED_UP:
    case K_ROUTED_DOWN: { /* X_E experts of (n, k) at 4 bits g64, X_K items a row; down reads one x row per item */
        const size_t xr = c->kind == K_ROUTED_DOWN ? X_K * k : k;
        add(c, KEEL_DT_U32, X_E * n * k * 4 / 32, 0, R_IN), add(c, KEEL_DT_BF16, X_E * n * k / 64, 0, R_IN);
        add(c, KEEL_DT_BF16, X_E * n * k / 64, 0, R_IN), add(c, KEEL_DT_F32, m * xr, xr, R_IN);
        add(c, KEEL_DT_I32, m * X_K, X_K, R_IN), add(c, KEEL_DT_F32, m * X_K * n, X_K * n, R_OUT);
        break;
    }
    case K_COMBINE: /* n wide, R_K1 slots */
        add(c, KEEL_DT_F32, m * R_K1 * n, R_K1 * n, R_IN), add(c, KEEL_DT_F32, m * R_K1 * 8, R_K1 * 8, R_IN);
        add(c, KEEL_DT_F32, m * n, n, R_OUT);
        break;
    case K_ROUTE: { /* n experts, k = top_k in one group (the group filter's sums tie in float where they do not in
                     * float64, so the filter is covered by tests/engine/test_route.c's definition, not here) */
        add(c, KEEL_DT_F32, m * n, n, R_IN), add(c, KEEL_DT_F32, n, 0, R_IN);
        add(c, KEEL_DT_U32, m * k * 2, k * 2, R_OUT), add(c, KEEL_DT_F32, m * k * 8, k * 8, R_OUT);
        add(c, KEEL_DT_I32, m * k, k, R_OUT);
        break;
    }
    case K_ARGMAX: add(c, KEEL_DT_F32, n, 0, R_IN), add(c, KEEL_DT_I32, 1, 0, R_OUT); break;
    case K_UNION: { /* n experts, k = top_k; per group of 8 rows cap = min(n, 8k) items */
        const size_t cap = (size_t)KEEL_MIN(n, 8 * k), groups = (m + 7) / 8;
        add(c, KEEL_DT_I32, m * k, k, R_IN), add(c, KEEL_DT_F32, m * k * 8, k * 8, R_IN);
        add(c, KEEL_DT_U32, groups * cap * 2, 0, R_OUT), add(c, KEEL_DT_F32, groups * cap * 8, 0, R_OUT);
        break;
    }
    }
}

/* Inputs: dist 0 normal, 1 large magnitude (x 64); integers, codes and routing logits on grids with ties. */
static void generate(ecase *c, uint64_t seed, int dist) {
    keel_contract_rng r = {seed * 0x9e3779b97f4a7c15ull + 0x1234567ull + (uint64_t)c->kind};
    const double big = dist ? 64.0 : 1.0;
    for (int i = 0; i < c->nb; i++) {
        buf *b = &c->b[i];
        if (b->role == R_OUT || b->role == R_SCRATCH) continue;
        for (size_t j = 0; j < b->n; j++) {
            double v;
            if (b->dt == KEEL_DT_U32) v = (double)(uint32_t)(keel_contract_runif(&r) * 4294967296.0);
            else if (b->dt == KEEL_DT_I32) v = (double)(int)(keel_contract_runif(&r) * c->n);
            else v = keel_contract_rnorm(&r) * big;
            hset(b, j, v);
        }
    }
    switch (c->kind) {
    case K_ROUTED_UP:
    case K_ROUTED_DOWN:
        for (size_t j = 0; j < c->b[4].n; j++) hset(&c->b[4], j, (double)(int)(keel_contract_runif(&r) * X_E));
        /* fall through */
    case K_EMBED:
    case K_MATVEC_Q: /* scales positive and small, biases negative: dequantized values of both signs */
        for (size_t j = 0; j < c->b[1].n; j++) hset(&c->b[1], j, 0.01 + 0.02 * keel_contract_runif(&r)), hset(&c->b[2], j, -0.1 * keel_contract_runif(&r));
        break;
    case K_RMSNORM:
    case K_GATENORM: hset(&c->b[c->kind == K_RMSNORM ? 1 : 2], 0, 1.5); break;
    case K_CONV:
        for (size_t j = 0; j < c->b[2].n; j++) hset(&c->b[2], j, 0.5 * keel_contract_rnorm(&r));
        break;
    case K_SSM: /* dt raw around 0, A_log in [-1, 1], the state from earlier tokens */
        for (size_t j = 0; j < (size_t)c->n; j++)
            hset(&c->b[3], j, 0.5 * keel_contract_rnorm(&r)), hset(&c->b[4], j, 2.0 * keel_contract_runif(&r) - 1.0), hset(&c->b[5], j, keel_contract_rnorm(&r));
        for (size_t j = 0; j < c->b[1].n; j++) hset(&c->b[1], j, keel_contract_rnorm(&r));
        break;
    case K_ROUTE: /* logits on a grid of 1/16 in [-2, 2] and correction bias on 1/8: exact ties occur */
        for (size_t j = 0; j < c->b[0].n; j++) hset(&c->b[0], j, floor(keel_contract_runif(&r) * 65.0) / 16.0 - 2.0);
        for (size_t j = 0; j < c->b[1].n; j++) hset(&c->b[1], j, floor(keel_contract_runif(&r) * 3.0) / 8.0 - 0.125);
        break;
    case K_UNION: /* each row's k experts distinct, as the router picks them */
        for (int row = 0; row < c->m; row++) {
            int perm[1024];
            for (int i = 0; i < c->n; i++) perm[i] = i;
            for (int j = 0; j < c->k; j++) {
                const int pick = j + (int)(keel_contract_runif(&r) * (c->n - j)), t = perm[j];
                perm[j] = perm[pick], perm[pick] = t;
                hset(&c->b[0], (size_t)row * c->k + j, perm[j]);
            }
        }
        break;
    case K_ARGMAX: { /* the maximum twice, a NaN first */
        const size_t n = (size_t)c->n, a = n / 3, b = 2 * n / 3;
        hset(&c->b[0], a, 1000.0), hset(&c->b[0], b, 1000.0), ((float *)c->b[0].h)[0] = NAN;
        break;
    }
    }
}

/* ---- float64 references and bounds (ref[i], bnd[i] per output element; outputs in buffer order) ---- */

static double vget(const buf *b, size_t i) { return hget(b, i); }
static int ceil_log2(int n) {
    int l = 0;
    while ((1 << l) < n) l++;
    return l;
}

static double silu(double v) { return v / (1.0 + exp(-v)); }
static double softplus(double v) { return v > 0 ? v + log1p(exp(-v)) : log1p(exp(v)); }
/* The output's own rounding: relative to its magnitude, plus the smallest normal for values under fp32's range. */
static double out_round(keel_dtype dt, double v, double err) {
    return dt == KEEL_DT_BF16 ? BF16_UNIT * (fabs(v) + err) + 0x1p-126
         : dt == KEEL_DT_F32  ? U * (fabs(v) + err) + 0x1p-126
                              : 0.0;
}

/* Row-wise RMSNorm of x (n) times w into ref; err_in: the bound on each x's error. */
static void norm_ref(const double *x, const double *err_in, const buf *w, int n, double eps, double *ref,
                     double *bnd, keel_dtype dt) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const double inv = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) {
        ref[i] = x[i] * inv * vget(w, (size_t)i);
        double e = (ceil_log2(n) + 10) * U * fabs(ref[i]) + 2.0 * (err_in ? err_in[i] : 0.0) * inv * fabs(vget(w, (size_t)i));
        bnd[i] = e + out_round(dt, ref[i], e);
    }
}

static size_t n_out(const ecase *c) {
    size_t t = 0;
    for (int i = 0; i < c->nb; i++)
        if (c->b[i].role == R_OUT || c->b[i].role == R_STATE) t += c->b[i].n;
    return t;
}

static void reference(const ecase *c, double *ref, double *bnd) {
    const int m = c->m, n = c->n, k = c->k;
    const double eps = 1e-5;
    memset(bnd, 0, n_out(c) * sizeof(double));
    switch (c->kind) {
    case K_EMBED: {
        const uint32_t *w = c->b[0].h;
        const int *tok = c->b[3].h;
        for (int r = 0; r < m; r++)
            for (int j = 0; j < k; j++) {
                const uint32_t *row = w + (size_t)tok[r] * keel_quant_row_words(k, 6);
                const size_t g = (size_t)tok[r] * (k / 64) + j / 64;
                const double sq = vget(&c->b[1], g) * keel_quant_code(row, 6, j), b = vget(&c->b[2], g);
                ref[(size_t)r * k + j] = sq + b;
                bnd[(size_t)r * k + j] = 2 * U * (fabs(sq) + fabs(b));
            }
        break;
    }
    case K_RMSNORM: {
        double *x = keel_xmalloc((size_t)n * sizeof(double));
        for (int r = 0; r < m; r++) {
            for (int i = 0; i < n; i++) x[i] = vget(&c->b[0], (size_t)r * n + i);
            norm_ref(x, NULL, &c->b[1], n, eps, ref + (size_t)r * n, bnd + (size_t)r * n, KEEL_DT_F32);
            norm_ref(x, NULL, &c->b[1], n, eps, ref + (size_t)(m + r) * n, bnd + (size_t)(m + r) * n, KEEL_DT_BF16);
        }
        free(x);
        break;
    }
    case K_ADDNORM: { /* state x first, then yf, yb */
        double *x = keel_xmalloc((size_t)n * sizeof(double)), *e = keel_xmalloc((size_t)n * sizeof(double));
        for (int r = 0; r < m; r++) {
            for (int i = 0; i < n; i++) {
                const size_t j = (size_t)r * n + i;
                const double x0 = vget(&c->b[0], j), a = vget(&c->b[1], j), b = vget(&c->b[2], j), bi = vget(&c->b[3], i);
                x[i] = x0 + (a + b + bi);
                e[i] = 3 * U * (fabs(x0) + fabs(a) + fabs(b) + fabs(bi));
                ref[j] = x[i], bnd[j] = e[i];
            }
            norm_ref(x, e, &c->b[4], n, eps, ref + (size_t)(m + r) * n, bnd + (size_t)(m + r) * n, KEEL_DT_F32);
            norm_ref(x, e, &c->b[4], n, eps, ref + (size_t)(2 * m + r) * n, bnd + (size_t)(2 * m + r) * n, KEEL_DT_BF16);
        }
        free(x), free(e);
        break;
    }
    case K_ADDBIAS:
        for (int r = 0; r < m; r++)
            for (int i = 0; i < n; i++) {
                const size_t j = (size_t)r * n + i;
                ref[j] = vget(&c->b[0], j) + vget(&c->b[1], i);
                bnd[j] = U * (fabs(vget(&c->b[0], j)) + fabs(vget(&c->b[1], i)));
            }
        break;
    case K_MATVEC_F:
    case K_MATVEC_Q: {
        const bool q = c->kind == K_MATVEC_Q;
        const int xb = q ? 3 : 1;
        for (int r = 0; r < m; r++)
            for (int o = 0; o < n; o++) {
                double acc = 0, mag = 0;
                for (int g = 0; g < k / 64; g++) {
                    double sxq = 0, sx = 0, ax = 0, axq = 0;
                    for (int j = g * 64; j < g * 64 + 64; j++) {
                        const double xv = vget(&c->b[xb], (size_t)r * k + j);
                        const double wv = q ? keel_quant_code((const uint32_t *)c->b[0].h + (size_t)o * (k / 8), 4, j)
                                            : vget(&c->b[0], (size_t)o * k + j);
                        sxq += xv * wv, sx += xv, axq += fabs(xv * wv), ax += fabs(xv);
                    }
                    if (q) {
                        const double s = vget(&c->b[1], (size_t)o * (k / 64) + g), b = vget(&c->b[2], (size_t)o * (k / 64) + g);
                        acc += s * sxq + b * sx, mag += fabs(s) * axq + fabs(b) * ax;
                    } else {
                        acc += sxq, mag += axq;
                    }
                }
                const size_t j = (size_t)r * n + o;
                ref[j] = acc;
                bnd[j] = (q ? QMV_HOPS(k) : (k / 32 + 6)) * U * mag + U * fabs(acc);
            }
        break;
    }
    case K_CONV: { /* state first ((K-1) x n), then out (m x n) */
        const int ld = n + 8;
        for (int ch = 0; ch < n; ch++) {
            double h[C_K], w[C_K];
            for (int j = 0; j < C_K - 1; j++) h[j] = vget(&c->b[1], (size_t)j * n + ch);
            for (int j = 0; j < C_K; j++) w[j] = vget(&c->b[2], (size_t)ch * C_K + j);
            const double b = vget(&c->b[3], ch);
            for (int r = 0; r < m; r++) {
                const double in = vget(&c->b[0], (size_t)r * ld + 8 + ch);
                double acc = b, mag = fabs(b);
                for (int j = 0; j < C_K - 1; j++) acc += w[j] * h[j], mag += fabs(w[j] * h[j]);
                acc += w[C_K - 1] * in, mag += fabs(w[C_K - 1] * in);
                const size_t o = (size_t)(C_K - 1) * n + (size_t)r * n + ch;
                ref[o] = silu(acc);
                bnd[o] = 1.1 * (2 * C_K + 2) * U * mag + 8 * U * fabs(ref[o]);
                for (int j = 0; j + 1 < C_K - 1; j++) h[j] = h[j + 1];
                h[C_K - 2] = in;
            }
            for (int j = 0; j < C_K - 1; j++) ref[(size_t)j * n + ch] = h[j];
        }
        break;
    }
    case K_SSM: { /* state first (NH x P x N), then y (m x NH*P) */
        const int NH = n, DI = NH * S_P, CD = DI + 2 * S_G * S_N, ld = NH + 4;
        const size_t ns = (size_t)NH * S_P * S_N;
        double *es = keel_xcalloc(ns, sizeof(double));
        for (size_t i = 0; i < ns; i++) ref[i] = vget(&c->b[2], i);
        for (int r = 0; r < m; r++) {
            const size_t xr = (size_t)r * CD;
            for (int h = 0; h < NH; h++) {
                const int grp = h / (NH / S_G);
                const double dt = softplus(vget(&c->b[1], (size_t)r * ld + 4 + h) + vget(&c->b[3], h));
                const double A = -exp(vget(&c->b[4], h)), dA = exp(A * dt), D = vget(&c->b[5], h);
                const double edA = dA * (fabs(A * dt) * 10 * U + 4 * U);
                for (int p = 0; p < S_P; p++) {
                    const double xv = vget(&c->b[0], xr + (size_t)h * S_P + p), xdt = xv * dt;
                    double acc = 0, mag = 0, eacc = 0;
                    for (int q = 0; q < S_N; q++) {
                        const size_t si = ((size_t)h * S_P + p) * S_N + q;
                        const double B = vget(&c->b[0], xr + DI + (size_t)grp * S_N + q);
                        const double Cq = vget(&c->b[0], xr + DI + (size_t)S_G * S_N + (size_t)grp * S_N + q);
                        const double s0 = ref[si];
                        ref[si] = dA * s0 + xdt * B;
                        es[si] = dA * es[si] + edA * fabs(s0) + 8 * U * (fabs(dA * s0) + fabs(xdt * B));
                        acc += ref[si] * Cq, mag += fabs(ref[si] * Cq), eacc += es[si] * fabs(Cq);
                    }
                    const size_t yo = ns + (size_t)r * DI + (size_t)h * S_P + p;
                    ref[yo] = acc + D * xv;
                    bnd[yo] = eacc + (S_N / 32 + 8) * U * mag + 3 * U * fabs(D * xv) + U * fabs(ref[yo]);
                }
            }
        }
        for (size_t i = 0; i < ns; i++) bnd[i] = es[i] + U * fabs(ref[i]);
        free(es);
        break;
    }
    case K_GATENORM: {
        const int gs = n / S_G;
        double *v = keel_xmalloc((size_t)gs * sizeof(double)), *e = keel_xmalloc((size_t)gs * sizeof(double));
        for (int r = 0; r < m; r++)
            for (int q = 0; q < S_G; q++) {
                for (int i = 0; i < gs; i++) {
                    const size_t j = (size_t)r * n + (size_t)q * gs + i;
                    const double z = vget(&c->b[1], j);
                    v[i] = vget(&c->b[0], j) * silu(z);
                    /* fp32 silu is z / (1 + expf(-z)): once expf overflows (z below -88.7) it is 0, not z*e^z */
                    e[i] = 8 * U * fabs(v[i]) + (z < -88.0 ? fabs(v[i]) : 0.0) + 0x1p-126;
                }
                buf w = c->b[2];
                w.h = (uint16_t *)c->b[2].h + (size_t)q * gs;
                norm_ref(v, e, &w, gs, eps, ref + (size_t)r * n + (size_t)q * gs, bnd + (size_t)r * n + (size_t)q * gs,
                         KEEL_DT_BF16);
                norm_ref(v, e, &w, gs, eps, ref + (size_t)(m + r) * n + (size_t)q * gs,
                         bnd + (size_t)(m + r) * n + (size_t)q * gs, KEEL_DT_F32);
            }
        free(v), free(e);
        break;
    }
    case K_ROUTE: { /* items (expert, mask) pairs, weights [item][8], sel */
        const int E = n, K = k, G = K == R_K1 ? 1 : 4, TG = K == R_K1 ? 1 : 2;
        double *sg = keel_xmalloc((size_t)E * sizeof(double)), *b = keel_xmalloc((size_t)E * sizeof(double));
        const size_t o_items = 0, o_w = (size_t)m * K * 2, o_sel = o_w + (size_t)m * K * 8;
        for (int r = 0; r < m; r++) {
            for (int i = 0; i < E; i++) {
                sg[i] = 1.0 / (1.0 + exp(-vget(&c->b[0], (size_t)r * E + i)));
                b[i] = sg[i] + vget(&c->b[1], i);
            }
            if (G > 1) {
                const int per = E / G;
                double gs[64];
                bool keep[64] = {false};
                for (int q = 0; q < G; q++) {
                    double t1 = -INFINITY, t2 = -INFINITY;
                    for (int i = q * per; i < (q + 1) * per; i++)
                        if (b[i] > t1) t2 = t1, t1 = b[i];
                        else if (b[i] > t2) t2 = b[i];
                    gs[q] = t1 + t2;
                }
                for (int t = 0; t < TG; t++) {
                    int best = -1;
                    for (int q = 0; q < G; q++)
                        if (!keep[q] && (best < 0 || gs[q] > gs[best])) best = q;
                    keep[best] = true;
                }
                for (int i = 0; i < E; i++)
                    if (!keep[i / per]) b[i] = 0.0;
            }
            bool *used = keel_xcalloc((size_t)E, sizeof(bool)); /* one flag an expert: E may exceed 64 */
            int sel[64];
            double sum = 0;
            for (int t = 0; t < K; t++) {
                int best = -1;
                for (int i = 0; i < E; i++)
                    if (!used[i] && (best < 0 || b[i] > b[best])) best = i;
                used[best] = true, sel[t] = best, sum += sg[best];
            }
            for (int t = 0; t < K; t++) {
                const size_t it = (size_t)r * K + t;
                ref[o_items + it * 2] = sel[t], ref[o_items + it * 2 + 1] = 1, ref[o_sel + it] = sel[t];
                for (int j = 0; j < 8; j++) {
                    const double w = j == 0 ? sg[sel[t]] / (sum + 1e-20) * 2.5 : 0.0;
                    ref[o_w + it * 8 + j] = w, bnd[o_w + it * 8 + j] = (K + 12) * U * fabs(w);
                }
            }
            free(used);
        }
        free(sg), free(b);
        break;
    }
    case K_ROUTED_UP:
    case K_ROUTED_DOWN: {
        const bool down = c->kind == K_ROUTED_DOWN;
        const int *sel = c->b[4].h;
        const size_t xrow = down ? (size_t)X_K * k : (size_t)k;
        for (int r = 0; r < m; r++)
            for (int it = 0; it < X_K; it++)
                for (int o = 0; o < n; o++) {
                    const int ex = sel[r * X_K + it];
                    const size_t row = (size_t)ex * n + o, x0 = (size_t)r * xrow + (down ? (size_t)it * k : 0);
                    double acc = 0, mag = 0;
                    for (int g = 0; g < k / 64; g++) {
                        double sxq = 0, sx = 0, ax = 0, axq = 0;
                        for (int j = g * 64; j < g * 64 + 64; j++) {
                            const double xv = vget(&c->b[3], x0 + j);
                            const double qv = keel_quant_code((const uint32_t *)c->b[0].h + row * (k / 8), 4, j);
                            sxq += xv * qv, sx += xv, axq += fabs(xv * qv), ax += fabs(xv);
                        }
                        const double sc = vget(&c->b[1], row * (k / 64) + g), bi = vget(&c->b[2], row * (k / 64) + g);
                        acc += sc * sxq + bi * sx, mag += fabs(sc) * axq + fabs(bi) * ax;
                    }
                    const size_t j = ((size_t)r * X_K + it) * n + o;
                    ref[j] = down ? acc : (acc > 0 ? acc * acc : 0.0);
                    const double e = QMV_HOPS(k) * U * mag + U * fabs(acc);
                    bnd[j] = down ? e : acc > -e ? (2 * fmax(acc, 0.0) + e) * e + U * ref[j] : 0.0;
                }
        break;
    }
    case K_COMBINE:
        for (int r = 0; r < m; r++)
            for (int i = 0; i < n; i++) {
                double acc = 0, mag = 0;
                for (int s = 0; s < R_K1; s++) {
                    const double w = vget(&c->b[1], ((size_t)r * R_K1 + s) * 8), y = vget(&c->b[0], ((size_t)r * R_K1 + s) * n + i);
                    acc += w * y, mag += fabs(w * y);
                }
                ref[(size_t)r * n + i] = acc, bnd[(size_t)r * n + i] = 2 * R_K1 * U * mag;
            }
        break;
    case K_UNION: { /* exact: items (expert, mask) in ascending expert order, then (0, 0); weights [item][row] */
        const int K = k, cap = KEEL_MIN(n, 8 * K), groups = (m + 7) / 8;
        const int *sel = c->b[0].h;
        const size_t o_w = (size_t)groups * cap * 2;
        for (int g = 0; g < groups; g++) {
            int at = 0;
            for (int ex = 0; ex < n; ex++) {
                uint32_t mask = 0;
                double w[8] = {0};
                for (int r = 0; r < 8 && 8 * g + r < m; r++)
                    for (int j = 0; j < K; j++)
                        if (sel[(8 * g + r) * K + j] == ex) mask |= 1u << r, w[r] = vget(&c->b[1], ((size_t)(8 * g + r) * K + j) * 8);
                if (!mask) continue;
                const size_t it = (size_t)g * cap + at++;
                ref[it * 2] = ex, ref[it * 2 + 1] = mask;
                for (int r = 0; r < 8; r++) ref[o_w + it * 8 + r] = w[r];
            }
            for (; at < cap; at++) {
                const size_t it = (size_t)g * cap + at;
                ref[it * 2] = ref[it * 2 + 1] = 0;
                for (int r = 0; r < 8; r++) ref[o_w + it * 8 + r] = 0;
            }
        }
        break;
    }
    case K_ARGMAX: {
        int best = -1;
        for (int i = 0; i < n; i++) {
            const double v = vget(&c->b[0], i);
            if (v == v && (best < 0 || v > vget(&c->b[0], best))) best = i;
        }
        ref[0] = best;
        break;
    }
    }
}

/* ---- device side ---- */

static size_t bytes_of(const buf *b) { return b->n * keel_dtype_size(b->dt); }
static void *dptr(const buf *b) { return (uint8_t *)b->g.dev + GUARD; }

/* Guarded device copies of every buffer (outputs and scratch start unwritten). */
static void upload(const keel_contract_backend *be, ecase *c) {
    static const char *const names[MAXB] = {"buffer 0", "buffer 1", "buffer 2", "buffer 3",
                                            "buffer 4", "buffer 5", "buffer 6", "buffer 7"};
    for (int i = 0; i < c->nb; i++) {
        buf *b = &c->b[i];
        const bool blank = b->role == R_OUT || b->role == R_SCRATCH;
        keel_contract_gbuf_make(&b->g, be, names[i], blank ? NULL : b->h, bytes_of(b), i);
    }
}

static void release(const keel_contract_backend *be, ecase *c) {
    for (int i = 0; i < c->nb; i++) keel_contract_gbuf_free(&c->b[i].g, be);
}

/* Downloads buffer i into out (its elements); with guards (gates 2 and on), checks the guards and, for an input,
 * that it is unchanged. */
static bool fetch(const keel_contract_backend *be, const ecase *c, int i, void *out, bool guards, char *why,
                  size_t cap) {
    const buf *b = &c->b[i];
    const size_t nb = bytes_of(b);
    uint8_t *st = keel_xmalloc(nb + 2 * GUARD);
    be->download(st, b->g.dev, nb + 2 * GUARD);
    const bool ok = !guards || keel_contract_gbuf_check(&b->g, st, b->role == R_IN, why, cap);
    if (out) memcpy(out, st + GUARD, nb);
    free(st);
    return ok;
}

typedef struct ekernel {
    void (*embed)(const keel_cuda_qw *, const int *, int, float *, void *);
    void (*rmsnorm)(const float *, int, const keel_ecu_vec *, int, int, float, float *, uint16_t *, int, void *);
    void (*add_rmsnorm)(float *, const float *, const float *, const keel_ecu_vec *, const keel_ecu_vec *, int, int,
                        float, float *, uint16_t *, void *);
    void (*add_bias)(float *, int, int, int, const keel_ecu_vec *, void *);
    void (*matvec)(const keel_cuda_qw *, const void *, keel_dtype, int, void *, keel_dtype, keel_epilogue, void *);
    void (*conv)(const float *, int, int, float *, const keel_ecu_vec *, const keel_ecu_vec *, int, int, int, float *,
                 void *);
    void (*ssm)(const float *, int, const float *, int, int, float *, const keel_ecu_vec *, const keel_ecu_vec *,
                const keel_ecu_vec *, int, int, int, int, int, float *, void *);
    void (*gate_norm)(const float *, const float *, int, const keel_ecu_vec *, int, int, float, int, uint16_t *,
                      float *, void *);
    void (*route)(const float *, const keel_ecu_vec *, int, int, int, int, bool, float, int, keel_cuda_route *,
                  float *, int *, void *);
    void (*argmax)(const float *, int, int *, void *);
    void (*matvec_routed)(const keel_cuda_qw *, const float *, bool, int, const int *, int, float *, keel_epilogue,
                          void *);
    void (*combine)(const float *, const float *, int, int, int, float *, void *);
    void (*route_union)(const int *, const float *, int, int, int, int, keel_cuda_route *, float *, void *);
} ekernel;

static const ekernel REAL = {keel_ecu_embed, keel_ecu_rmsnorm, keel_ecu_add_rmsnorm, keel_ecu_add_bias,
                             keel_ecu_matvec, keel_ecu_conv, keel_ecu_ssm, keel_ecu_gate_norm,
                             keel_ecu_route, keel_ecu_argmax, keel_ecu_matvec_routed, keel_ecu_combine,
                             keel_ecu_route_union};
static const ekernel TWIN = {keel_contract_twin_ecu_embed, keel_contract_twin_ecu_rmsnorm,
                             keel_contract_twin_ecu_add_rmsnorm, keel_contract_twin_ecu_add_bias,
                             keel_contract_twin_ecu_matvec, keel_contract_twin_ecu_conv, keel_contract_twin_ecu_ssm,
                             keel_contract_twin_ecu_gate_norm,
                             keel_contract_twin_ecu_route, keel_contract_twin_ecu_argmax,
                             keel_contract_twin_ecu_matvec_routed, keel_contract_twin_ecu_combine,
                             keel_contract_twin_ecu_route_union};

static keel_ecu_vec vec(const ecase *c, int i) {
    return (keel_ecu_vec){dptr(&c->b[i]), c->b[i].dt, (int)c->b[i].n};
}

static void launch_with(const ekernel *K, const ecase *c) {
    const int m = c->m, n = c->n, k = c->k;
    void *p[MAXB];
    for (int i = 0; i < c->nb; i++) p[i] = dptr(&c->b[i]);
    switch (c->kind) {
    case K_EMBED: {
        keel_cuda_qw t = {p[0], p[1], p[2], n, k, 6, 64, KEEL_DT_BF16, 0, 0, 0};
        K->embed(&t, p[3], m, p[4], NULL);
        break;
    }
    case K_RMSNORM: {
        keel_ecu_vec w = vec(c, 1);
        K->rmsnorm(p[0], n, &w, m, n, 1e-5f, p[2], NULL, n, NULL); /* fp32 and bf16 outputs are separate launches */
        K->rmsnorm(p[0], n, &w, m, n, 1e-5f, NULL, p[3], n, NULL);
        break;
    }
    case K_ADDNORM: {
        keel_ecu_vec bias = vec(c, 3), w = vec(c, 4);
        K->add_rmsnorm(p[0], p[1], p[2], &bias, &w, m, n, 1e-5f, p[5], p[6], NULL);
        break;
    }
    case K_ADDBIAS: {
        keel_ecu_vec b = vec(c, 1);
        K->add_bias(p[0], m, n, n, &b, NULL);
        break;
    }
    case K_MATVEC_F: {
        keel_cuda_qw W = {p[0], NULL, NULL, n, k, 0, 0, KEEL_DT_BF16, 0, 0, 0};
        K->matvec(&W, p[1], KEEL_DT_F32, m, p[2], KEEL_DT_F32, KEEL_EPI_NONE, NULL);
        break;
    }
    case K_MATVEC_Q: {
        keel_cuda_qw W = {p[0], p[1], p[2], n, k, 4, 64, KEEL_DT_BF16, 0, 0, 0};
        K->matvec(&W, p[3], KEEL_DT_F32, m, p[4], KEEL_DT_F32, KEEL_EPI_NONE, NULL);
        break;
    }
    case K_CONV: {
        keel_ecu_vec cw = vec(c, 2), cb = vec(c, 3);
        K->conv(p[0], n + 8, 8, p[1], &cw, &cb, C_K, n, m, p[4], NULL);
        break;
    }
    case K_SSM: {
        keel_ecu_vec dtb = vec(c, 3), al = vec(c, 4), D = vec(c, 5);
        const int DI = n * S_P;
        K->ssm(p[0], DI + 2 * S_G * S_N, p[1], n + 4, 4, p[2], &dtb, &al, &D, n, S_P, S_N, S_G, m, p[6], NULL);
        break;
    }
    case K_GATENORM: {
        keel_ecu_vec w = vec(c, 2);
        K->gate_norm(p[0], p[1], n, &w, S_G, n, 1e-5f, m, p[3], p[4], NULL);
        break;
    }
    case K_ROUTE: {
        keel_ecu_vec corr = vec(c, 1);
        const bool one = k == R_K1;
        K->route(p[0], &corr, n, k, one ? 1 : 4, one ? 1 : 2, true, 2.5f, m, p[2], p[3], p[4], NULL);
        break;
    }
    case K_ARGMAX: K->argmax(p[0], n, p[1], NULL); break;
    case K_ROUTED_UP:
    case K_ROUTED_DOWN: {
        const bool down = c->kind == K_ROUTED_DOWN;
        keel_cuda_qw W = {p[0], p[1], p[2], n, k, 4, 64, KEEL_DT_BF16, (int64_t)n * k / 8, (int64_t)n * k / 64, 0};
        K->matvec_routed(&W, p[3], down, m, p[4], X_K, p[5], down ? KEEL_EPI_NONE : KEEL_EPI_RELU2, NULL);
        break;
    }
    case K_COMBINE: K->combine(p[0], p[1], m, R_K1, n, p[2], NULL); break;
    case K_UNION: K->route_union(p[0], p[1], m, k, n, KEEL_MIN(n, 8 * k), p[2], p[3], NULL); break;
    }
}

static void launch_real(const keel_contract_reg *reg, const keel_contract_args *a) {
    (void)reg;
    launch_with(&REAL, a->x);
}

#define TWIN_FN(fault)                                                                     \
    static void twin_##fault(const keel_contract_reg *reg, const keel_contract_args *a) { \
        (void)reg;                                                                         \
        keel_contract_twin_ecu_arm(KEEL_ECU_PLANT_##fault);                               \
        launch_with(&TWIN, a->x);                                                          \
    }
TWIN_FN(WIDTH4)
TWIN_FN(PASTEND)
TWIN_FN(NOBIAS)
TWIN_FN(ROWLEAK)
TWIN_FN(NOSHIFT)
TWIN_FN(ORDER)
TWIN_FN(GROUPS)
TWIN_FN(TIES)

/* ---- gates ---- */

static int kind_of(const keel_contract_reg *reg) { return reg->tile_cols; } /* the kind rides in tile_cols */

static ecase make(const keel_contract_reg *reg, const keel_contract_shape *s, int m, uint64_t seed, int dist) {
    ecase c = {.kind = kind_of(reg), .m = m, .n = s->n, .k = s->k};
    layout(&c);
    generate(&c, seed, dist);
    return c;
}

/* Launches c (uploaded fresh) and fetches every output and state into out (concatenated, host dtypes); false with
 * a reason when the launch, the guards or the inputs fail. */
static bool run_case(const keel_contract_reg *reg, keel_contract_launch_fn launch, ecase *c, void **outs, bool guards,
                     char *why, size_t cap) {
    upload(reg->be, c);
    keel_contract_args a = {.x = c, .m = c->m};
    launch(reg, &a);
    bool ok = reg->be->sync(why, cap);
    for (int i = 0; ok && i < c->nb; i++) {
        void *o = NULL;
        if (c->b[i].role == R_OUT || c->b[i].role == R_STATE) o = outs[i] = keel_xcalloc(c->b[i].n + 1, 8);
        ok = fetch(reg->be, c, i, o, guards, why, cap);
    }
    release(reg->be, c);
    return ok;
}

static void free_outs(const ecase *c, void **outs) {
    for (int i = 0; i < c->nb; i++) free(outs[i]), outs[i] = NULL;
}

static double oget(const buf *b, const void *o, size_t j) {
    buf t = *b;
    t.h = (void *)o;
    return hget(&t, j);
}

/* Gate 3 on one case: every output within its bound, integers exact, float outputs not all equal. */
static bool check_ref(const ecase *c, void **outs, keel_contract_gate_result *gr) {
    const size_t N = n_out(c);
    double *ref = keel_xcalloc(N + 1, sizeof(double)), *bnd = keel_xcalloc(N + 1, sizeof(double));
    reference(c, ref, bnd);
    size_t at = 0;
    bool ok = true;
    for (int i = 0; i < c->nb && ok; i++) {
        const buf *b = &c->b[i];
        if (b->role != R_OUT && b->role != R_STATE) continue;
        bool varied = b->n < 2 || b->dt == KEEL_DT_I32 || b->dt == KEEL_DT_U32;
        for (size_t j = 0; j < b->n && ok; j++) {
            const double y = oget(b, outs[i], j), d = fabs(y - ref[at + j]);
            if (j && y != oget(b, outs[i], 0)) varied = true;
            const double frac = bnd[at + j] > 0 ? d / bnd[at + j] : (d > 0 ? INFINITY : 0);
            if (frac > gr->frac || gr->bound_at_max == 0) gr->frac = frac, gr->max_err = d, gr->bound_at_max = bnd[at + j];
            if (!(d <= bnd[at + j])) {
                snprintf(gr->detail, sizeof gr->detail,
                         "output %d element %zu: got %.9g, float64 reference %.9g, |d| %.3g, bound %.3g (%.1fx)", i, j, y,
                         ref[at + j], d, bnd[at + j], frac);
                ok = false;
            }
        }
        if (ok && !varied) {
            snprintf(gr->detail, sizeof gr->detail, "output %d: all %zu values equal (a vacuous pass)", i, b->n);
            ok = false;
        }
        at += b->n;
    }
    free(ref), free(bnd);
    return ok;
}

static bool same_bits(const ecase *c, void **a, void **b, int r_only, char *why, size_t cap) {
    for (int i = 0; i < c->nb; i++) {
        const buf *bf = &c->b[i];
        if (bf->role != R_OUT && bf->role != R_STATE) continue;
        const size_t es = keel_dtype_size(bf->dt);
        size_t off = 0, len = bytes_of(bf);
        if (r_only >= 0 && bf->row) off = (size_t)r_only * bf->row * es, len = bf->row * es;
        if (memcmp((uint8_t *)a[i] + off, (uint8_t *)b[i] + (r_only >= 0 && bf->row ? 0 : off), len) != 0) {
            snprintf(why, cap, "output %d%s differs bit for bit", i, r_only >= 0 ? " of a row launched alone" : "");
            return false;
        }
    }
    return true;
}

/* Row r of c as its own case (m = 1): row-wise buffers sliced, others whole. */
static ecase row_case(const ecase *c, int r) {
    ecase s = *c;
    s.m = 1;
    for (int i = 0; i < c->nb; i++) {
        buf *b = &s.b[i];
        const size_t es = keel_dtype_size(b->dt);
        if (b->row) b->n = b->row;
        b->h = keel_xcalloc(b->n + 1, 8);
        memcpy(b->h, (uint8_t *)c->b[i].h + (c->b[i].row ? (size_t)r * b->row * es : 0), b->n * es);
    }
    return s;
}

static bool sequential(int kind) { return kind == K_CONV || kind == K_SSM; }
/* The union of a group's experts depends on every row of the group by definition: no per-row check. */
static bool rowwise(int kind) { return !sequential(kind) && kind != K_UNION; }

static void engine_run(const keel_contract_table *t, const keel_contract_reg *reg, keel_contract_launch_fn launch,
                       int max_gate, keel_contract_result *res) {
    (void)t;
    memset(res, 0, sizeof *res);
    void *o1[MAXB] = {0}, *o2[MAXB] = {0};
    if (reg->available && !reg->available(reg, res->gate[1].detail, sizeof res->gate[1].detail)) {
        res->gate[1].ran = true;
        res->first_red = 1;
        return;
    }
    for (int g = 1; g <= max_gate && g <= 4; g++) {
        keel_contract_gate_result *gr = &res->gate[g];
        gr->ran = true;
        gr->pass = true;
        for (int s = 0; s < reg->n_shapes && gr->pass; s++) {
            const keel_contract_shape *sh = &reg->shapes[s];
            const int m_lo = sh->m_lo, m_hi = g == 1 ? sh->m_lo : sh->m_hi; /* gate 1: the smallest m */
            for (int m = m_lo; m <= m_hi && gr->pass; m++) {
                const int seeds = g == 3 ? 2 : 1, dists = g == 3 ? 2 : 1;
                for (int sd = 0; sd < seeds && gr->pass; sd++)
                    for (int d = 0; d < dists && gr->pass; d++) {
                        ecase c = make(reg, sh, m, 1 + (uint64_t)sd, d);
                        gr->pass = run_case(reg, launch, &c, o1, g >= 2, gr->detail, sizeof gr->detail);
                        if (gr->pass && g == 1)
                            for (int i = 0; i < c.nb && gr->pass; i++)
                                for (size_t j = 0; o1[i] && j < c.b[i].n && gr->pass; j++)
                                    if (!isfinite(oget(&c.b[i], o1[i], j))) {
                                        snprintf(gr->detail, sizeof gr->detail, "output %d element %zu is not finite", i, j);
                                        gr->pass = false;
                                    }
                        if (gr->pass && g == 3) gr->pass = check_ref(&c, o1, gr);
                        if (gr->pass && g == 4) {
                            gr->pass = run_case(reg, launch, &c, o2, true, gr->detail, sizeof gr->detail) &&
                                       same_bits(&c, o1, o2, -1, gr->detail, sizeof gr->detail);
                            free_outs(&c, o2);
                            if (gr->pass && m > 1 && rowwise(c.kind))
                                for (int r = 0; r < m && gr->pass; r++) {
                                    ecase rc = row_case(&c, r);
                                    gr->pass = run_case(reg, launch, &rc, o2, true, gr->detail, sizeof gr->detail) &&
                                               same_bits(&c, o1, o2, r, gr->detail, sizeof gr->detail);
                                    free_outs(&rc, o2);
                                    case_free(&rc);
                                }
                            if (gr->pass && m > 1 && sequential(c.kind)) { /* m one-token launches, state carried */
                                ecase st = c;
                                for (int r = 0; r < m && gr->pass; r++) {
                                    ecase rc = row_case(&st, r);
                                    gr->pass = run_case(reg, launch, &rc, o2, true, gr->detail, sizeof gr->detail);
                                    for (int i = 0; i < rc.nb && gr->pass; i++) {
                                        const buf *b = &rc.b[i];
                                        const size_t es = keel_dtype_size(b->dt);
                                        if (b->role == R_STATE) memcpy(c.b[i].h, o2[i], bytes_of(b)); /* carry */
                                        if (b->role == R_OUT &&
                                            memcmp((uint8_t *)o1[i] + (size_t)r * b->row * es, o2[i], b->row * es)) {
                                            snprintf(gr->detail, sizeof gr->detail,
                                                     "token %d stepped alone differs from the %d-token launch", r, m);
                                            gr->pass = false;
                                        }
                                    }
                                    if (r == m - 1 && gr->pass)
                                        for (int i = 0; i < rc.nb && gr->pass; i++)
                                            if (rc.b[i].role == R_STATE && memcmp(o1[i], o2[i], bytes_of(&rc.b[i]))) {
                                                snprintf(gr->detail, sizeof gr->detail,
                                                         "state after %d one-token steps differs from one launch", m);
                                                gr->pass = false;
                                            }
                                    free_outs(&rc, o2);
                                    case_free(&rc);
                                }
                            }
                        }
                        free_outs(&c, o1);
                        case_free(&c);
                    }
            }
        }
        if (!gr->pass) {
            res->first_red = g;
            return;
        }
    }
}

/* ---- the table ---- */

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
    const char *name, *entry;
    int n_shapes;
    keel_contract_shape shapes[3];
    keel_contract_launch_fn twin;
    const char *control;
    int gate;
} spec;

int keel_contract_register_cuda_engine(keel_contract_table *t) {
    char why[256];
    const keel_contract_backend *be = keel_contract_cuda_backend(why, sizeof why);
    if (!be) return 0;
    static const spec S[] = {
        {K_EMBED, "embed/q6g64/bf16", "keel_ecu_embed", 2, {{40, 128, 1, 3}, {64, 256, 8, 8}}, twin_WIDTH4, "width-as-4", 3},
        {K_RMSNORM, "rmsnorm/f32-bf16", "keel_ecu_rmsnorm", 2, {{96, 0, 1, 3}, {1000, 0, 8, 8}}, twin_PASTEND, "write-past-end", 2},
        {K_ADDNORM, "add-rmsnorm/f32-bf16", "keel_ecu_add_rmsnorm", 2,
         {{96, 0, 1, 3}, {1000, 0, 8, 8}}, twin_NOBIAS, "bias-dropped", 3},
        {K_ADDBIAS, "add-bias/bf16", "keel_ecu_add_bias", 2, {{33, 0, 1, 3}, {300, 0, 8, 8}}, twin_PASTEND, "write-past-end", 2},
        {K_MATVEC_F, "matvec/float/bf16/xf32-yf32", "keel_ecu_matvec", 2, {{24, 64, 1, 3}, {130, 512, 8, 8}}, twin_ROWLEAK, "row-leak", 4},
        {K_MATVEC_Q, "matvec/q4g64/bf16/xf32-yf32", "keel_ecu_matvec", 2, {{24, 64, 1, 3}, {130, 512, 8, 8}}, twin_NOBIAS, "bias-dropped", 3},
        {K_CONV, "mamba-conv/k4", "keel_ecu_conv", 2, {{40, 0, 1, 3}, {300, 0, 8, 8}}, twin_NOSHIFT, "window-not-shifted", 3},
        {K_SSM, "mamba-scan/p16n48g2", "keel_ecu_ssm", 2, {{2, 0, 1, 3}, {8, 0, 8, 8}}, twin_NOBIAS, "d-skip-dropped", 3},
        {K_GATENORM, "gated-group-rmsnorm/g2", "keel_ecu_gate_norm", 2, {{64, 0, 1, 3}, {512, 0, 8, 8}}, twin_GROUPS, "group-too-wide", 3},
        {K_ROUTE, "route/e16k6", "keel_ecu_route", 1, {{16, R_K1, 1, 8}}, twin_TIES, "ties-to-higher-id", 3},
        {K_ROUTED_UP, "matvec-routed/q4g64/bf16/relu2", "keel_ecu_matvec_routed", 2, {{24, 64, 1, 3}, {130, 256, 8, 8}}, twin_NOBIAS, "bias-dropped", 3},
        {K_ROUTED_DOWN, "matvec-routed/q4g64/bf16/per-item", "keel_ecu_matvec_routed", 2, {{24, 64, 1, 3}, {130, 256, 8, 8}}, twin_NOBIAS, "bias-dropped", 3},
        {K_COMBINE, "combine/k6", "keel_ecu_combine", 2, {{40, 0, 1, 3}, {300, 0, 8, 8}}, twin_NOBIAS, "slot-dropped", 3},
        {K_ARGMAX, "argmax", "keel_ecu_argmax", 2, {{7, 0, 1, 1}, {5000, 0, 1, 1}}, twin_TIES, "ties-to-higher-id", 3},
        {K_UNION, "route-union/k6", "keel_ecu_route_union", 2, {{16, R_K1, 1, 8}, {128, R_K1, 9, 20}}, twin_ORDER, "descending-order", 3},
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
        r->family = KEEL_CF_FLOAT; /* fp32 arithmetic on float data; the `run` below brings the gates */
        r->tile_cols = sp->kind;
        r->sdt = KEEL_DT_BF16, r->xdt = KEEL_DT_F32, r->ydt = KEEL_DT_F32;
        r->rows_min = sp->shapes[0].m_lo, r->rows_max = sp->shapes[sp->n_shapes - 1].m_hi;
        r->n_shapes = sp->n_shapes;
        memcpy(r->shapes, sp->shapes, sizeof sp->shapes[0] * (size_t)sp->n_shapes);
        r->launch = launch_real;
        r->available = available;
        r->run = engine_run;
        r->controls[r->n_controls++] = (keel_contract_control){sp->control, sp->gate, sp->twin};
        added++;
    }
    return added;
}
#endif
