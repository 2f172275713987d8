/* contract: the CUDA engine's own kernels (src/engine/cuda/kernels.cu) under gates 1-4 with float64 references and
 * planted controls from their compiled twin (twin_engine_cuda.cu). The kernels are not matrix tiles, so each
 * registration brings its own `run`; the gates mean what they mean for the tiles:
 *   1 a launch on the smallest shape reports no error and its outputs are finite
 *   2 every buffer sits between canary guards; after a launch on every shape the guards and the inputs are intact
 *   3 every output within its bound of the float64 reference (derived per kernel in engine_refs_cuda.c, in units of
 *     2^-24 of the magnitudes summed, plus the output's own rounding), two seeds and two distributions; integer
 *     outputs (chosen experts, argmax) exactly; float outputs that are all equal fail
 *   4 two launches give the same bits; each row launched alone gives the bits of the window (row-wise kernels), and
 *     m one-token launches give the bits of one m-token launch (the Mamba conv and scan, whose state carries)
 * Fused sequences: add_rmsnorm (the residual add, then rmsnorm) is compared at gate 3 against the float64 sequence.
 * The fused router, the route window and the fused Mamba step are checked at gate 3 stage by stage (each stage
 * against the float64 reference of the inputs it was given), and at gate 4 against the launches each replaces, bit
 * for bit. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_regs_cuda.h"

const char *const keel_contract_cuda_engine_entries[] = {
    "keel_ecu_embed", "keel_ecu_rmsnorm", "keel_ecu_add_rmsnorm", "keel_ecu_add_bias", "keel_ecu_matvec",
    "keel_ecu_conv",  "keel_ecu_ssm",     "keel_ecu_gate_norm",   "keel_ecu_route",
    "keel_ecu_argmax", "keel_ecu_matvec_routed", "keel_ecu_combine", "keel_ecu_route_union", "keel_ecu_router", "keel_ecu_mamba_step",
    "keel_ecu_route_window", "keel_ecu_matvec_norm", NULL};

#if !defined(KEEL_HAVE_CUDA)
int keel_contract_register_cuda_engine(keel_contract_table *t) {
    (void)t;
    return 0;
}
#else
#include "../engine/cuda/ecuda.h"
#include "engine_cases_cuda.h"

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
    void (*add_rmsnorm)(float *, const float *, const float *, const float *, const keel_ecu_vec *,
                        const keel_ecu_vec *, int, int, float, float *, uint16_t *, void *);
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
    void (*router)(const keel_cuda_qw *, const float *, int, float *, const keel_ecu_vec *, int, int, int, bool, float,
                   keel_cuda_route *, float *, int *, int, keel_cuda_route *, float *, void *);
    void (*mamba_step)(const float *, int, float *, const keel_ecu_vec *, const keel_ecu_vec *, int, float *,
                       const keel_ecu_vec *, const keel_ecu_vec *, const keel_ecu_vec *, int, int, int, int, int,
                       const keel_ecu_vec *, float, float *, float *, unsigned *, uint16_t *, float *, void *);
    void (*route_window)(const float *, const keel_ecu_vec *, int, int, int, int, bool, float, int, keel_cuda_route *,
                         float *, int *, int, keel_cuda_route *, float *, void *);
    void (*matvec_norm)(const keel_cuda_qw *, float *, const float *, const float *, const float *,
                        const keel_ecu_vec *, const keel_ecu_vec *, int, float, float *, uint16_t *, float *, void *);
} ekernel;

static const ekernel REAL = {keel_ecu_embed, keel_ecu_rmsnorm, keel_ecu_add_rmsnorm, keel_ecu_add_bias,
                             keel_ecu_matvec, keel_ecu_conv, keel_ecu_ssm, keel_ecu_gate_norm,
                             keel_ecu_route, keel_ecu_argmax, keel_ecu_matvec_routed, keel_ecu_combine,
                             keel_ecu_route_union, keel_ecu_router, keel_ecu_mamba_step, keel_ecu_route_window,
                             keel_ecu_matvec_norm};
static const ekernel TWIN = {keel_contract_twin_ecu_embed, keel_contract_twin_ecu_rmsnorm,
                             keel_contract_twin_ecu_add_rmsnorm, keel_contract_twin_ecu_add_bias,
                             keel_contract_twin_ecu_matvec, keel_contract_twin_ecu_conv, keel_contract_twin_ecu_ssm,
                             keel_contract_twin_ecu_gate_norm,
                             keel_contract_twin_ecu_route, keel_contract_twin_ecu_argmax,
                             keel_contract_twin_ecu_matvec_routed, keel_contract_twin_ecu_combine,
                             keel_contract_twin_ecu_route_union, keel_contract_twin_ecu_router,
                             keel_contract_twin_ecu_mamba_step, keel_contract_twin_ecu_route_window,
                             keel_contract_twin_ecu_matvec_norm};

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
        K->add_rmsnorm(p[0], p[0], p[1], p[2], &bias, &w, m, n, 1e-5f, p[5], p[6], NULL);
        break;
    }
    case K_NORMMV: {
        keel_ecu_vec bias = vec(c, 3), w = vec(c, 4);
        keel_cuda_qw W = {p[5], NULL, NULL, n, k, 0, 0, KEEL_DT_BF16, 0, 0, 0};
        K->matvec_norm(&W, p[6], p[0], p[1], p[2], &bias, &w, m, 1e-5f, p[7], p[8], p[9], NULL);
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
    case K_RWIN: {
        keel_ecu_vec corr = vec(c, 1);
        K->route_window(p[0], &corr, n, k, 1, 1, true, 2.5f, m, p[2], p[3], p[4], KEEL_MIN(n, 8 * k), p[5], p[6], NULL);
        break;
    }
    case K_MAMBA: {
        keel_ecu_vec cw = vec(c, 2), cb = vec(c, 3), dtb = vec(c, 5), al = vec(c, 6), D = vec(c, 7), w = vec(c, 8);
        const int di = n * S_P, cd = di + 2 * S_G * S_N;
        K->mamba_step(p[0], di + cd + n, p[1], &cw, &cb, C_K, p[4], &dtb, &al, &D, n, S_P, S_N, S_G, m, &w, 1e-5f, p[10],
                      p[11], p[9], p[12], p[13], NULL);
        break;
    }
    case K_ROUTER: {
        keel_cuda_qw W = {p[0], NULL, NULL, n, k, 0, 0, KEEL_DT_BF16, 0, 0, 0};
        keel_ecu_vec corr = vec(c, 1);
        K->router(&W, p[2], m, p[3], &corr, R_K1, 1, 1, true, 2.5f, p[4], p[5], p[6], KEEL_MIN(n, 8 * R_K1), p[7], p[8],
                  NULL);
        break;
    }
    }
}

/* The sequence the fused Mamba step replaces: conv, scan and gated norm as three launches (gate 4). */
static void launch_mamba_sequence(const keel_contract_reg *reg, const keel_contract_args *a) {
    (void)reg;
    const ecase *c = a->x;
    const int m = c->m, n = c->n, di = n * S_P, cd = di + 2 * S_G * S_N, ld = di + cd + n;
    void *p[MAXB];
    for (int i = 0; i < c->nb; i++) p[i] = dptr(&c->b[i]);
    keel_ecu_vec cw = vec(c, 2), cb = vec(c, 3), dtb = vec(c, 5), al = vec(c, 6), D = vec(c, 7), w = vec(c, 8);
    keel_ecu_conv(p[0], ld, di, p[1], &cw, &cb, C_K, cd, m, p[10], NULL);
    keel_ecu_ssm(p[10], cd, p[0], ld, di + cd, p[4], &dtb, &al, &D, n, S_P, S_N, S_G, m, p[11], NULL);
    keel_ecu_gate_norm(p[11], p[0], ld, &w, S_G, di, 1e-5f, m, p[12], p[13], NULL);
}

/* route then route_union as two launches, from the logits in buffer il (corr in buffer 1), top K, into the five
 * buffers at o (items1, w1, sel, items, weights): the tail of the fused router's sequence, the route window's whole. */
static void route_then_union(const ecase *c, int il, int K, void *const *o) {
    const int m = c->m, n = c->n;
    keel_ecu_vec corr = vec(c, 1);
    keel_ecu_route(dptr(&c->b[il]), &corr, n, K, 1, 1, true, 2.5f, m, o[0], o[1], o[2], NULL);
    keel_ecu_route_union(o[2], o[1], m, K, n, KEEL_MIN(n, 8 * K), o[3], o[4], NULL);
}

/* The sequence the fused router replaces: the fp32 matvec, route, route_union as three launches (gate 4). */
static void launch_router_sequence(const keel_contract_reg *reg, const keel_contract_args *a) {
    (void)reg;
    const ecase *c = a->x;
    const int m = c->m, n = c->n, k = c->k;
    void *p[MAXB];
    for (int i = 0; i < c->nb; i++) p[i] = dptr(&c->b[i]);
    keel_cuda_qw W = {p[0], NULL, NULL, n, k, 0, 0, KEEL_DT_BF16, 0, 0, 0};
    keel_ecu_matvec(&W, p[2], KEEL_DT_F32, m, p[3], KEEL_DT_F32, KEEL_EPI_NONE, NULL);
    route_then_union(c, 3, R_K1, p + 4);
}

/* The sequence the fused norm and matvec replaces: add_rmsnorm (out of place), then the fp32 matvec of its fp32 rows
 * (gate 4). */
static void launch_normmv_sequence(const keel_contract_reg *reg, const keel_contract_args *a) {
    (void)reg;
    const ecase *c = a->x;
    void *p[MAXB];
    for (int i = 0; i < c->nb; i++) p[i] = dptr(&c->b[i]);
    keel_ecu_vec bias = vec(c, 3), w = vec(c, 4);
    keel_ecu_add_rmsnorm(p[6], p[0], p[1], p[2], &bias, &w, c->m, c->k, 1e-5f, p[7], p[8], NULL);
    keel_cuda_qw W = {p[5], NULL, NULL, c->n, c->k, 0, 0, KEEL_DT_BF16, 0, 0, 0};
    keel_ecu_matvec(&W, p[7], KEEL_DT_F32, c->m, p[9], KEEL_DT_F32, KEEL_EPI_NONE, NULL);
}

/* The sequence the route window replaces: route, route_union as two launches (gate 4). */
static void launch_rwin_sequence(const keel_contract_reg *reg, const keel_contract_args *a) {
    (void)reg;
    const ecase *c = a->x;
    void *p[MAXB];
    for (int i = 0; i < c->nb; i++) p[i] = dptr(&c->b[i]);
    route_then_union(c, 0, c->k, p + 2);
}

/* The launches a fused kind replaces (gate 4 holds it to their bits) and their names for a failure; NULL otherwise. */
static keel_contract_launch_fn sequence_of(int kind, const char **what) {
    if (kind == K_MAMBA) {
        *what = "fused Mamba step vs conv, scan, gated norm";
        return launch_mamba_sequence;
    }
    if (kind == K_ROUTER) {
        *what = "fused router vs matvec, route, route_union";
        return launch_router_sequence;
    }
    if (kind == K_RWIN) {
        *what = "route window vs route, route_union";
        return launch_rwin_sequence;
    }
    if (kind == K_NORMMV) {
        *what = "fused norm and matvec vs add_rmsnorm, matvec";
        return launch_normmv_sequence;
    }
    return NULL;
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
    keel_contract_ecase_layout(&c);
    keel_contract_ecase_generate(&c, seed, dist);
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
    return keel_contract_ecase_get(&t, j);
}

/* Gate 3 on one case: every output within its bound, integers exact, float outputs not all equal. */
static bool check_ref(const ecase *c, void **outs, keel_contract_gate_result *gr);

/* Gate 3 of a routing stage and the union stage after it: the routing (o: items1, w1, sel) against the float64
 * router of `logits` (m x n, the correction bias c's buffer 1) at top K, then the unions (o + 3: items, weights)
 * against the exact union of the routing it chose. The fused router and the route window end with these. */
static bool check_routing(const ecase *c, const void *logits, int K, void **o, keel_contract_gate_result *gr) {
    ecase rt = {.kind = K_ROUTE, .m = c->m, .n = c->n, .k = K};
    keel_contract_ecase_layout(&rt);
    memcpy(rt.b[0].h, logits, bytes_of(&rt.b[0])), memcpy(rt.b[1].h, c->b[1].h, bytes_of(&rt.b[1]));
    void *o_rt[MAXB] = {0};
    o_rt[2] = o[0], o_rt[3] = o[1], o_rt[4] = o[2];
    bool ok = check_ref(&rt, o_rt, gr);
    keel_contract_ecase_free(&rt);
    ecase un = {.kind = K_UNION, .m = c->m, .n = c->n, .k = K};
    keel_contract_ecase_layout(&un);
    memcpy(un.b[0].h, o[2], bytes_of(&un.b[0])), memcpy(un.b[1].h, o[1], bytes_of(&un.b[1]));
    void *o_un[MAXB] = {0};
    o_un[2] = o[3], o_un[3] = o[4];
    ok = ok && check_ref(&un, o_un, gr);
    keel_contract_ecase_free(&un);
    return ok;
}

/* Gate 3 of the fused router, stage by stage: the logits against the float64 matvec, then the routing against the
 * float64 router of the logits it computed, then the unions against the exact union of the routing it chose. */
static bool check_router(const ecase *c, void **outs, keel_contract_gate_result *gr) {
    ecase mv = {.kind = K_MATVEC_F, .m = c->m, .n = c->n, .k = c->k};
    keel_contract_ecase_layout(&mv);
    memcpy(mv.b[0].h, c->b[0].h, bytes_of(&c->b[0])), memcpy(mv.b[1].h, c->b[2].h, bytes_of(&c->b[2]));
    void *o_mv[MAXB] = {0};
    o_mv[2] = outs[3];
    bool ok = check_ref(&mv, o_mv, gr);
    keel_contract_ecase_free(&mv);
    return ok && check_routing(c, outs[3], R_K1, outs + 4, gr);
}

/* Gate 3 of the route window, stage by stage: the routing against the float64 router of the logits, then the unions
 * against the exact union of the routing it chose. */
static bool check_rwin(const ecase *c, void **outs, keel_contract_gate_result *gr) {
    return check_routing(c, c->b[0].h, c->k, outs + 2, gr);
}

/* Gate 3 of the fused Mamba step, stage by stage: the conv (outputs and windows) against the float64 conv of the
 * inputs, the scan (outputs and state) against the float64 scan of the conv outputs it computed, the gated norm
 * against the float64 norm of the scan outputs it computed; the counters back at zero. */
static bool check_mamba(const ecase *c, void **outs, keel_contract_gate_result *gr) {
    const int m = c->m, n = c->n, di = n * S_P, cd = di + 2 * S_G * S_N, ld = di + cd + n;
    const float *proj = c->b[0].h;
    ecase cv = {.kind = K_CONV, .m = m, .n = cd};
    keel_contract_ecase_layout(&cv);
    for (int r = 0; r < m; r++)
        for (int j = 0; j < cd; j++) ((float *)cv.b[0].h)[(size_t)r * (cd + 8) + 8 + j] = proj[(size_t)r * ld + di + j];
    memcpy(cv.b[1].h, c->b[1].h, bytes_of(&c->b[1])), memcpy(cv.b[2].h, c->b[2].h, bytes_of(&c->b[2]));
    memcpy(cv.b[3].h, c->b[3].h, bytes_of(&c->b[3]));
    void *o_cv[MAXB] = {0};
    o_cv[1] = outs[1], o_cv[4] = outs[10];
    bool ok = check_ref(&cv, o_cv, gr);
    keel_contract_ecase_free(&cv);
    ecase sc = {.kind = K_SSM, .m = m, .n = n};
    keel_contract_ecase_layout(&sc);
    memcpy(sc.b[0].h, outs[10], bytes_of(&sc.b[0]));
    for (int r = 0; r < m; r++)
        for (int h = 0; h < n; h++) ((float *)sc.b[1].h)[(size_t)r * (n + 4) + 4 + h] = proj[(size_t)r * ld + di + cd + h];
    for (int i = 2; i <= 5; i++) memcpy(sc.b[i].h, c->b[i + 2].h, bytes_of(&c->b[i + 2]));
    void *o_sc[MAXB] = {0};
    o_sc[2] = outs[4], o_sc[6] = outs[11];
    ok = ok && check_ref(&sc, o_sc, gr);
    keel_contract_ecase_free(&sc);
    ecase gn = {.kind = K_GATENORM, .m = m, .n = di};
    keel_contract_ecase_layout(&gn);
    memcpy(gn.b[0].h, outs[11], bytes_of(&gn.b[0]));
    for (int r = 0; r < m; r++)
        for (int j = 0; j < di; j++) ((float *)gn.b[1].h)[(size_t)r * di + j] = proj[(size_t)r * ld + j];
    memcpy(gn.b[2].h, c->b[8].h, bytes_of(&c->b[8]));
    void *o_gn[MAXB] = {0};
    o_gn[3] = outs[12], o_gn[4] = outs[13];
    ok = ok && check_ref(&gn, o_gn, gr);
    keel_contract_ecase_free(&gn);
    for (int q = 0; ok && q < S_G; q++)
        if (((const uint32_t *)outs[9])[q] != 0) {
            snprintf(gr->detail, sizeof gr->detail, "counter %d left at %u, expected 0", q, ((const uint32_t *)outs[9])[q]);
            ok = false;
        }
    return ok;
}

/* The add-norm stage of the fused norm and matvec: c's inputs 0..4 (x, a, b, bias, w) as an add_rmsnorm case, its
 * outputs x, yf, yb checked against add_rmsnorm's float64 reference and bound. */
static bool check_addnorm_stage(const ecase *c, void *xo, void *yf, void *yb, keel_contract_gate_result *gr) {
    ecase an = {.kind = K_ADDNORM, .m = c->m, .n = c->k};
    keel_contract_ecase_layout(&an);
    for (int i = 0; i < 5; i++) memcpy(an.b[i].h, c->b[i].h, bytes_of(&c->b[i]));
    void *o_an[MAXB] = {0};
    o_an[0] = xo, o_an[5] = yf, o_an[6] = yb;
    const bool ok = check_ref(&an, o_an, gr);
    keel_contract_ecase_free(&an);
    return ok;
}

/* Gate 3 of the fused norm and matvec, stage by stage: the add and norm against add_rmsnorm's float64 reference, then
 * the logits against the float64 matvec of the fp32 rows it computed. */
static bool check_normmv(const ecase *c, void **outs, keel_contract_gate_result *gr) {
    bool ok = check_addnorm_stage(c, outs[6], outs[7], outs[8], gr);
    ecase mv = {.kind = K_MATVEC_F, .m = c->m, .n = c->n, .k = c->k};
    keel_contract_ecase_layout(&mv);
    memcpy(mv.b[0].h, c->b[5].h, bytes_of(&c->b[5])), memcpy(mv.b[1].h, outs[7], bytes_of(&mv.b[1]));
    void *o_mv[MAXB] = {0};
    o_mv[2] = outs[9];
    ok = ok && check_ref(&mv, o_mv, gr);
    keel_contract_ecase_free(&mv);
    return ok;
}

static bool check_ref(const ecase *c, void **outs, keel_contract_gate_result *gr) {
    if (c->kind == K_NORMMV) return check_normmv(c, outs, gr);
    if (c->kind == K_ROUTER) return check_router(c, outs, gr);
    if (c->kind == K_MAMBA) return check_mamba(c, outs, gr);
    if (c->kind == K_RWIN) return check_rwin(c, outs, gr);
    const size_t N = keel_contract_ecase_n_out(c);
    double *ref = keel_xcalloc(N + 1, sizeof(double)), *bnd = keel_xcalloc(N + 1, sizeof(double));
    keel_contract_ecase_reference(c, ref, bnd);
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

static bool sequential(int kind) { return kind == K_CONV || kind == K_SSM || kind == K_MAMBA; }
/* The union of a group's experts depends on every row of the group by definition: no per-row check. */
static bool rowwise(int kind) { return !sequential(kind) && kind != K_UNION && kind != K_ROUTER && kind != K_RWIN; }

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
                            const char *what = NULL;
                            const keel_contract_launch_fn seq = sequence_of(c.kind, &what);
                            if (gr->pass && seq) { /* a fused kernel equals the launches it replaces */
                                gr->pass = run_case(reg, seq, &c, o2, true, gr->detail, sizeof gr->detail) &&
                                           same_bits(&c, o1, o2, -1, gr->detail, sizeof gr->detail);
                                if (!gr->pass) {
                                    const size_t at = strlen(gr->detail);
                                    snprintf(gr->detail + at, sizeof gr->detail - at, " (%s)", what);
                                }
                                free_outs(&c, o2);
                            }
                            if (gr->pass && m > 1 && rowwise(c.kind))
                                for (int r = 0; r < m && gr->pass; r++) {
                                    ecase rc = row_case(&c, r);
                                    gr->pass = run_case(reg, launch, &rc, o2, true, gr->detail, sizeof gr->detail) &&
                                               same_bits(&c, o1, o2, r, gr->detail, sizeof gr->detail);
                                    free_outs(&rc, o2);
                                    keel_contract_ecase_free(&rc);
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
                                    keel_contract_ecase_free(&rc);
                                }
                            }
                        }
                        free_outs(&c, o1);
                        keel_contract_ecase_free(&c);
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
        {K_MAMBA, "mamba-step-fused/p16n48g2k4", "keel_ecu_mamba_step", 2, {{2, 0, 1, 3}, {8, 0, 8, 8}}, twin_NOSHIFT, "window-not-shifted", 3},
        {K_ROUTER, "router-fused/bf16/k6", "keel_ecu_router", 2, {{16, 64, 1, 8}, {128, 512, 9, 12}}, twin_ORDER, "descending-order", 3},
        {K_UNION, "route-union/k6", "keel_ecu_route_union", 2, {{16, R_K1, 1, 8}, {128, R_K1, 9, 20}}, twin_ORDER, "descending-order", 3},
        {K_RWIN, "route-window/k6", "keel_ecu_route_window", 3, {{16, R_K1, 1, 8}, {128, R_K1, 9, 20}, {300, R_K1, 1, 10}},
         twin_ORDER, "descending-order", 3},
        {K_NORMMV, "add-rmsnorm-matvec/float/bf16", "keel_ecu_matvec_norm", 3,
         {{16, 64, 1, 3}, {128, 1024, 1, 8}, {8, 5120, 1, 2}}, twin_NOBIAS, "bias-dropped", 3},
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
