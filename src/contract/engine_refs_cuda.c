/* contract: the CUDA engine registrations' cases and float64 references (engine_cases_cuda.h): per kernel kind its
 * buffers, their generated inputs, and the reference and bound of every output element. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_cases_cuda.h"

#if defined(KEEL_HAVE_CUDA)
#include "../engine/cuda/ecuda.h"

/* ---- cases ---- */


void keel_contract_ecase_add(ecase *c, keel_dtype dt, size_t n, size_t row, int role) {
    KEEL_ASSERT(c->nb < MAXB);
    c->b[c->nb++] = (buf){.dt = dt, .n = n, .row = row, .role = role, .h = keel_xcalloc(n + 1, 8)};
}

void keel_contract_ecase_free(ecase *c) {
    for (int i = 0; i < c->nb; i++) free(c->b[i].h);
    memset(c, 0, sizeof *c);
}

double keel_contract_ecase_get(const buf *b, size_t i) {
    if (b->dt == KEEL_DT_I32) return ((const int32_t *)b->h)[i];
    if (b->dt == KEEL_DT_U32) return ((const uint32_t *)b->h)[i];
    return keel_dtype_get_f32(b->dt, b->h, i);
}
void keel_contract_ecase_set(buf *b, size_t i, double v) {
    if (b->dt == KEEL_DT_I32) ((int32_t *)b->h)[i] = (int32_t)v;
    else if (b->dt == KEEL_DT_U32) ((uint32_t *)b->h)[i] = (uint32_t)v;
    else keel_dtype_set_f32(b->dt, b->h, i, (float)v);
}

/* Buffers of each kind, in the order the launch and the reference read them. */
void keel_contract_ecase_layout(ecase *c) {
    const size_t m = (size_t)c->m, n = (size_t)c->n, k = (size_t)c->k;
    switch (c->kind) {
    case K_EMBED: /* n = vocab, k = hidden; 6-bit g64 */
        keel_contract_ecase_add(c, KEEL_DT_U32, n * k * 6 / 32, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_BF16, n * k / 64, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_BF16, n * k / 64, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_I32, m, 1, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_F32, m * k, k, R_OUT);
        break;
    case K_RMSNORM:
        keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_IN), keel_contract_ecase_add(c, KEEL_DT_BF16, n, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_OUT), keel_contract_ecase_add(c, KEEL_DT_BF16, m * n, n, R_OUT);
        break;
    case K_ADDNORM:
        keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_STATE), keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_IN), keel_contract_ecase_add(c, KEEL_DT_BF16, n, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_BF16, n, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_OUT), keel_contract_ecase_add(c, KEEL_DT_BF16, m * n, n, R_OUT);
        break;
    case K_ADDBIAS: keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_STATE), keel_contract_ecase_add(c, KEEL_DT_BF16, n, 0, R_IN); break;
    case K_NORMMV: /* add_rmsnorm of k-wide rows, then n outputs of a BF16 matrix: x, a, b, bias, w, W; x_out, yf, yb, y */
        for (int i = 0; i < 3; i++) keel_contract_ecase_add(c, KEEL_DT_F32, m * k, k, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_BF16, k, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_BF16, k, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_BF16, n * k, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_F32, m * k, k, R_OUT), keel_contract_ecase_add(c, KEEL_DT_F32, m * k, k, R_OUT);
        keel_contract_ecase_add(c, KEEL_DT_BF16, m * k, k, R_OUT), keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_OUT);
        break;
    case K_MATVEC_F: /* n outputs over k, BF16 weights */
        keel_contract_ecase_add(c, KEEL_DT_BF16, n * k, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, m * k, k, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_OUT);
        break;
    case K_MATVEC_Q: /* 4-bit g64, BF16 scales */
        keel_contract_ecase_add(c, KEEL_DT_U32, n * k * 4 / 32, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_BF16, n * k / 64, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_BF16, n * k / 64, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, m * k, k, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_OUT);
        break;
    case K_CONV: /* n channels; proj rows n + 8 wide, the conv input at column 8 */
        keel_contract_ecase_add(c, KEEL_DT_F32, m * (n + 8), n + 8, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, (C_K - 1) * n, 0, R_STATE);
        keel_contract_ecase_add(c, KEEL_DT_BF16, n * C_K, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_BF16, n, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_OUT);
        break;
    case K_SSM: { /* n heads of S_P, state S_N, S_G groups; xbc = x | B | C; proj rows n + 4, dt at column 4 */
        const size_t di = n * S_P, cd = di + 2 * S_G * S_N;
        keel_contract_ecase_add(c, KEEL_DT_F32, m * cd, cd, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, m * (n + 4), n + 4, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_F32, n * S_P * S_N, 0, R_STATE), keel_contract_ecase_add(c, KEEL_DT_BF16, n, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_F32, n, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_BF16, n, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, m * di, di, R_OUT);
        break;
    }
    case K_GATENORM: /* n = d_inner in S_G groups; bf16 and fp32 outputs */
        keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_IN), keel_contract_ecase_add(c, KEEL_DT_BF16, n, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_BF16, m * n, n, R_OUT), keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_OUT);
        break;
    case K_ROUTED_UP:
    case K_ROUTED_DOWN: { /* X_E experts of (n, k) at 4 bits g64, X_K items a row; down reads one x row per item */
        const size_t xr = c->kind == K_ROUTED_DOWN ? X_K * k : k;
        keel_contract_ecase_add(c, KEEL_DT_U32, X_E * n * k * 4 / 32, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_BF16, X_E * n * k / 64, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_BF16, X_E * n * k / 64, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, m * xr, xr, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_I32, m * X_K, X_K, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, m * X_K * n, X_K * n, R_OUT);
        break;
    }
    case K_COMBINE: /* n wide, R_K1 slots */
        keel_contract_ecase_add(c, KEEL_DT_F32, m * R_K1 * n, R_K1 * n, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, m * R_K1 * 8, R_K1 * 8, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_OUT);
        break;
    case K_ROUTE: { /* n experts, k = top_k in one group (the group filter's sums tie in float where they do not in
                     * float64, so the filter is covered by tests/engine/test_route.c's definition, not here) */
        keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, n, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_U32, m * k * 2, k * 2, R_OUT), keel_contract_ecase_add(c, KEEL_DT_F32, m * k * 8, k * 8, R_OUT);
        keel_contract_ecase_add(c, KEEL_DT_I32, m * k, k, R_OUT);
        break;
    }
    case K_ARGMAX: keel_contract_ecase_add(c, KEEL_DT_F32, n, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_I32, 1, 0, R_OUT); break;
    case K_MAMBA: { /* n heads of S_P in S_G groups, state S_N, conv C_K: proj rows z (DI) | xBC (CD) | dt (n) */
        const size_t di = n * S_P, cd = di + 2 * S_G * S_N, ld = di + cd + n;
        keel_contract_ecase_add(c, KEEL_DT_F32, m * ld, ld, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, (C_K - 1) * cd, 0, R_STATE);
        keel_contract_ecase_add(c, KEEL_DT_BF16, cd * C_K, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_BF16, cd, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_F32, n * S_P * S_N, 0, R_STATE), keel_contract_ecase_add(c, KEEL_DT_BF16, n, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_F32, n, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_BF16, n, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_BF16, di, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_U32, S_G, 0, R_STATE); /* the counters: zero before, zero after */
        keel_contract_ecase_add(c, KEEL_DT_F32, m * cd, cd, R_OUT), keel_contract_ecase_add(c, KEEL_DT_F32, m * di, di, R_OUT);
        keel_contract_ecase_add(c, KEEL_DT_BF16, m * di, di, R_OUT), keel_contract_ecase_add(c, KEEL_DT_F32, m * di, di, R_OUT);
        break;
    }
    case K_ROUTER: { /* n experts over k inputs (BF16 gate), R_K1 a row: logits, the router's outputs, the unions */
        const size_t K = R_K1, cap = (size_t)KEEL_MIN(n, 8 * R_K1), groups = (m + 7) / 8;
        keel_contract_ecase_add(c, KEEL_DT_BF16, n * k, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, n, 0, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, m * k, k, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_OUT), keel_contract_ecase_add(c, KEEL_DT_U32, m * K * 2, K * 2, R_OUT);
        keel_contract_ecase_add(c, KEEL_DT_F32, m * K * 8, K * 8, R_OUT), keel_contract_ecase_add(c, KEEL_DT_I32, m * K, K, R_OUT);
        keel_contract_ecase_add(c, KEEL_DT_U32, groups * cap * 2, 0, R_OUT), keel_contract_ecase_add(c, KEEL_DT_F32, groups * cap * 8, 0, R_OUT);
        break;
    }
    case K_RWIN: { /* n experts, k = top_k in one group: the route case's buffers, then the union case's outputs */
        const size_t cap = (size_t)KEEL_MIN(n, 8 * k), groups = (m + 7) / 8;
        keel_contract_ecase_add(c, KEEL_DT_F32, m * n, n, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, n, 0, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_U32, m * k * 2, k * 2, R_OUT), keel_contract_ecase_add(c, KEEL_DT_F32, m * k * 8, k * 8, R_OUT);
        keel_contract_ecase_add(c, KEEL_DT_I32, m * k, k, R_OUT);
        keel_contract_ecase_add(c, KEEL_DT_U32, groups * cap * 2, 0, R_OUT), keel_contract_ecase_add(c, KEEL_DT_F32, groups * cap * 8, 0, R_OUT);
        break;
    }
    case K_UNION: { /* n experts, k = top_k; per group of 8 rows cap = min(n, 8k) items */
        const size_t cap = (size_t)KEEL_MIN(n, 8 * k), groups = (m + 7) / 8;
        keel_contract_ecase_add(c, KEEL_DT_I32, m * k, k, R_IN), keel_contract_ecase_add(c, KEEL_DT_F32, m * k * 8, k * 8, R_IN);
        keel_contract_ecase_add(c, KEEL_DT_U32, groups * cap * 2, 0, R_OUT), keel_contract_ecase_add(c, KEEL_DT_F32, groups * cap * 8, 0, R_OUT);
        break;
    }
    }
}

/* Inputs: dist 0 normal, 1 large magnitude (x 64); integers, codes and routing logits on grids with ties. */
void keel_contract_ecase_generate(ecase *c, uint64_t seed, int dist) {
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
            keel_contract_ecase_set(b, j, v);
        }
    }
    switch (c->kind) {
    case K_ROUTED_UP:
    case K_ROUTED_DOWN:
        for (size_t j = 0; j < c->b[4].n; j++) keel_contract_ecase_set(&c->b[4], j, (double)(int)(keel_contract_runif(&r) * X_E));
        /* fall through */
    case K_EMBED:
    case K_MATVEC_Q: /* scales positive and small, biases negative: dequantized values of both signs */
        for (size_t j = 0; j < c->b[1].n; j++) keel_contract_ecase_set(&c->b[1], j, 0.01 + 0.02 * keel_contract_runif(&r)), keel_contract_ecase_set(&c->b[2], j, -0.1 * keel_contract_runif(&r));
        break;
    case K_RMSNORM:
    case K_GATENORM: keel_contract_ecase_set(&c->b[c->kind == K_RMSNORM ? 1 : 2], 0, 1.5); break;
    case K_CONV:
        for (size_t j = 0; j < c->b[2].n; j++) keel_contract_ecase_set(&c->b[2], j, 0.5 * keel_contract_rnorm(&r));
        break;
    case K_SSM: /* dt raw around 0, A_log in [-1, 1], the state from earlier tokens */
        for (size_t j = 0; j < (size_t)c->n; j++)
            keel_contract_ecase_set(&c->b[3], j, 0.5 * keel_contract_rnorm(&r)), keel_contract_ecase_set(&c->b[4], j, 2.0 * keel_contract_runif(&r) - 1.0), keel_contract_ecase_set(&c->b[5], j, keel_contract_rnorm(&r));
        for (size_t j = 0; j < c->b[1].n; j++) keel_contract_ecase_set(&c->b[1], j, keel_contract_rnorm(&r));
        break;
    case K_ROUTE: /* logits on a grid of 1/16 in [-2, 2] and correction bias on 1/8: exact ties occur */
    case K_RWIN:
        for (size_t j = 0; j < c->b[0].n; j++) keel_contract_ecase_set(&c->b[0], j, floor(keel_contract_runif(&r) * 65.0) / 16.0 - 2.0);
        for (size_t j = 0; j < c->b[1].n; j++) keel_contract_ecase_set(&c->b[1], j, floor(keel_contract_runif(&r) * 3.0) / 8.0 - 0.125);
        break;
    case K_MAMBA: { /* as the conv, scan and norm cases: dt raw around 0, A_log in [-1, 1], norm weights as given */
        const size_t di = (size_t)c->n * S_P, cd = di + 2 * S_G * S_N, ld = di + cd + (size_t)c->n;
        for (int row = 0; row < c->m; row++)
            for (int h = 0; h < c->n; h++) keel_contract_ecase_set(&c->b[0], (size_t)row * ld + di + cd + h, 0.5 * keel_contract_rnorm(&r));
        for (size_t j = 0; j < c->b[2].n; j++) keel_contract_ecase_set(&c->b[2], j, 0.5 * keel_contract_rnorm(&r));
        for (size_t j = 0; j < (size_t)c->n; j++)
            keel_contract_ecase_set(&c->b[5], j, 0.5 * keel_contract_rnorm(&r)), keel_contract_ecase_set(&c->b[6], j, 2.0 * keel_contract_runif(&r) - 1.0), keel_contract_ecase_set(&c->b[7], j, keel_contract_rnorm(&r));
        keel_contract_ecase_set(&c->b[8], 0, 1.5);
        for (int q = 0; q < S_G; q++) keel_contract_ecase_set(&c->b[9], (size_t)q, 0);
        break;
    }
    case K_ROUTER: /* gate in {-1, 0, 1}/4 and x on a grid of 1/16 (1/32): every logit exact in fp32 and distinct
                    * logits' sigmoids many ulps apart, so the float64 router of the kernel's logits makes the kernel's
                    * choices. No correction bias: sigmoid + bias can come within an ulp of another expert's (the
                    * bias is covered by route/e16k6, and gate 4 holds this kernel to route_kernel's bits) */
        for (size_t j = 0; j < c->b[0].n; j++) keel_contract_ecase_set(&c->b[0], j, (floor(keel_contract_runif(&r) * 3.0) - 1.0) * 0.25);
        for (size_t j = 0; j < c->b[2].n; j++)
            keel_contract_ecase_set(&c->b[2], j, (floor(keel_contract_runif(&r) * 33.0) - 16.0) / (dist ? 32.0 : 16.0));
        for (size_t j = 0; j < c->b[1].n; j++) keel_contract_ecase_set(&c->b[1], j, 0.0);
        break;
    case K_UNION: /* each row's k experts distinct, as the router picks them */
        for (int row = 0; row < c->m; row++) {
            int perm[1024];
            for (int i = 0; i < c->n; i++) perm[i] = i;
            for (int j = 0; j < c->k; j++) {
                const int pick = j + (int)(keel_contract_runif(&r) * (c->n - j)), t = perm[j];
                perm[j] = perm[pick], perm[pick] = t;
                keel_contract_ecase_set(&c->b[0], (size_t)row * c->k + j, perm[j]);
            }
        }
        break;
    case K_ARGMAX: { /* the maximum twice, a NaN first */
        const size_t n = (size_t)c->n, a = n / 3, b = 2 * n / 3;
        keel_contract_ecase_set(&c->b[0], a, 1000.0), keel_contract_ecase_set(&c->b[0], b, 1000.0), ((float *)c->b[0].h)[0] = NAN;
        break;
    }
    }
}

/* ---- float64 references and bounds (ref[i], bnd[i] per output element; outputs in buffer order) ---- */

static double vget(const buf *b, size_t i) { return keel_contract_ecase_get(b, i); }
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

size_t keel_contract_ecase_n_out(const ecase *c) {
    size_t t = 0;
    for (int i = 0; i < c->nb; i++)
        if (c->b[i].role == R_OUT || c->b[i].role == R_STATE) t += c->b[i].n;
    return t;
}

void keel_contract_ecase_reference(const ecase *c, double *ref, double *bnd) {
    const int m = c->m, n = c->n, k = c->k;
    const double eps = 1e-5;
    memset(bnd, 0, keel_contract_ecase_n_out(c) * sizeof(double));
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
#endif
