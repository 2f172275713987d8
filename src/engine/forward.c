/* engine: setup, the scratch arena, and the layer loop shared by prompt processing and decode. */
#include <math.h>
#include <stdlib.h>

#include "../kernels/cpu/cpu.h"
#include "engine.h"

/* A bump allocator over one block; the first pass only measures. */
typedef struct carve {
    uint8_t *base;
    size_t off;
} carve;

static void *take(carve *c, size_t bytes) {
    c->off = (c->off + 63u) & ~(size_t)63u;
    void *p = c->base ? c->base + c->off : NULL;
    c->off += bytes;
    return p;
}

static void layout(keel_engine *e, carve *c) {
    const keel_config *g = e->cfg;
    const size_t C = KEEL_ENGINE_CHUNK, H = (size_t)g->hidden;
    const size_t kvd = (size_t)g->n_kv_head * (size_t)g->head_dim, fl = sizeof(float);
    e->slot = take(c, (size_t)g->n_layer * sizeof(int));
    e->conv_state = take(c, (size_t)e->n_mamba * (size_t)(g->conv_kernel - 1) * (size_t)g->conv_dim * fl);
    e->ssm_state =
        take(c, (size_t)e->n_mamba * (size_t)g->mamba_heads * (size_t)g->mamba_head_dim * (size_t)g->ssm_state * fl);
    e->k_cache = take(c, (size_t)e->n_attn * (size_t)e->max_ctx * kvd * fl);
    e->v_cache = take(c, (size_t)e->n_attn * (size_t)e->max_ctx * kvd * fl);
    e->mtp_k = e->model->has_mtp ? take(c, (size_t)e->max_ctx * kvd * fl) : NULL;
    e->mtp_v = e->model->has_mtp ? take(c, (size_t)e->max_ctx * kvd * fl) : NULL;
    e->x = take(c, C * H * fl);
    e->xn = take(c, C * H * fl);
    e->mix = take(c, C * H * fl);
    e->wide = take(c, C * (size_t)e->wide_dim * fl);
    e->mid = take(c, C * (size_t)e->mid_dim * fl);
    e->conv_out = take(c, (size_t)KEEL_MAX(g->conv_dim, 1) * fl);
    e->scores = take(c, (size_t)KEEL_MAX(g->n_head, 1) * (size_t)e->max_ctx * fl);
    const size_t E = (size_t)KEEL_MAX(g->n_experts, 1), K = (size_t)KEEL_MAX(g->top_k, 1);
    e->router = take(c, C * E * fl);
    e->sel = take(c, C * K * sizeof(int));
    e->sel_w = take(c, C * K * fl);
    e->ex_rows = take(c, E * C * sizeof(int));
    e->ex_slot = take(c, E * C * sizeof(int));
    e->ex_count = take(c, E * sizeof(int));
    e->ex_in = take(c, C * H * fl);
    int inter = KEEL_MAX(KEEL_MAX(g->moe_inter, g->shared_inter), KEEL_MAX(g->mlp_inter, 1));
    e->ex_mid = take(c, C * (size_t)inter * fl);
    e->ex_out = take(c, C * H * fl);
    e->slots = take(c, C * K * H * fl);
    e->hid = take(c, C * H * fl);
}

keel_code keel_engine_init(keel_engine *e, const keel_model *m, int max_ctx, keel_err *err) {
    KEEL_ASSERT(e && m);
    memset(e, 0, sizeof *e);
    if (max_ctx < 1) return keel_err_set(err, KEEL_E_ARG, "context size %d: expected at least 1", max_ctx);
    e->model = m;
    e->cfg = &m->cfg;
    e->max_ctx = max_ctx;
    const keel_config *g = e->cfg;
    for (int l = 0; l < g->n_layer; l++) {
        if (g->pattern[l] == KEEL_MIXER_MAMBA) e->n_mamba++;
        if (g->pattern[l] == KEEL_MIXER_ATTN) e->n_attn++;
    }
    if (strchr(g->pattern, KEEL_MIXER_MOE) && (g->n_experts > 1024 || g->top_k < 1 || g->top_k > g->n_experts))
        return keel_err_set(err, KEEL_E_UNSUPPORTED,
                            "model %s: %d routed experts with top %d: the engine takes 1..1024 experts and top_k in "
                            "1..n_experts", m->dir, g->n_experts, g->top_k);
    int q = g->n_head * g->head_dim, kv = g->n_kv_head * g->head_dim;
    e->wide_dim = KEEL_MAX(KEEL_MAX(g->in_proj_dim, q + 2 * kv), 2 * g->hidden);
    e->mid_dim = KEEL_MAX(KEEL_MAX(g->d_inner, q), 1);
    carve c = {NULL, 0};
    layout(e, &c);
    e->arena = calloc(1, c.off + 64);
    if (!e->arena)
        return keel_err_set(err, KEEL_E_NOMEM, "engine: cannot allocate %zu bytes of state and scratch for %d tokens",
                            c.off, max_ctx);
    c.base = (uint8_t *)(((uintptr_t)e->arena + 63u) & ~(uintptr_t)63u);
    c.off = 0;
    layout(e, &c);
    int nm = 0, na = 0;
    for (int l = 0; l < g->n_layer; l++)
        e->slot[l] = g->pattern[l] == KEEL_MIXER_MAMBA ? nm++ : g->pattern[l] == KEEL_MIXER_ATTN ? na++ : -1;
    keel_engine_reset(e);
    return KEEL_OK;
}

void keel_engine_free(keel_engine *e) {
    if (!e) return;
    free(e->arena);
    memset(e, 0, sizeof *e);
}

void keel_engine_reset(keel_engine *e) {
    const keel_config *g = e->cfg;
    e->pos = 0;
    e->mtp_pos = 0;
    memset(e->conv_state, 0, (size_t)e->n_mamba * (size_t)(g->conv_kernel - 1) * (size_t)g->conv_dim * sizeof(float));
    memset(e->ssm_state, 0,
           (size_t)e->n_mamba * (size_t)g->mamba_heads * (size_t)g->mamba_head_dim * (size_t)g->ssm_state *
               sizeof(float));
    /* caches are written before they are read, position by position: no need to clear them */
}

void keel_engine_rmsnorm(const float *x, const keel_vec *w, int m, int n, float eps, float *y) {
    for (int r = 0; r < m; r++) {
        const float *xr = x + (size_t)r * (size_t)n;
        float *yr = y + (size_t)r * (size_t)n;
        float ss = 0.0f;
        for (int i = 0; i < n; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int i = 0; i < n; i++) yr[i] = xr[i] * inv * keel_vec_get(w, i);
    }
}

void keel_engine_embed(const keel_engine *e, const int *tokens, int m, float *x) {
    for (int r = 0; r < m; r++)
        keel_quant_dequantize_row(&e->model->embed, tokens[r], x + (size_t)r * (size_t)e->cfg->hidden);
}

keel_code keel_engine_forward(keel_engine *e, const int *tokens, int n, float *logits, keel_logits_mode mode,
                              float *hidden, keel_err *err) {
    const keel_config *g = e->cfg;
    const int H = g->hidden, V = g->vocab;
    if (n < 1) return keel_err_set(err, KEEL_E_ARG, "forward: %d tokens, expected at least 1", n);
    if (mode != KEEL_LOGITS_NONE && !logits) return keel_err_set(err, KEEL_E_ARG, "forward: no logits buffer");
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            return keel_err_set(err, KEEL_E_RANGE, "token id %d (at index %d) is outside the vocabulary of %d ids",
                                tokens[i], i, V);
    if ((int64_t)e->pos + n > e->max_ctx)
        return keel_err_set(err, KEEL_E_RANGE, "%d tokens at position %d do not fit the context of %d tokens", n,
                            e->pos, e->max_ctx);
    for (int c0 = 0; c0 < n; c0 += KEEL_ENGINE_CHUNK) {
        const int m = KEEL_MIN(KEEL_ENGINE_CHUNK, n - c0);
        keel_engine_embed(e, tokens + c0, m, e->x);
        for (int l = 0; l < g->n_layer; l++) {
            const keel_layer *L = &e->model->layers[l];
            keel_engine_rmsnorm(e->x, &L->norm, m, H, g->norm_eps, e->xn);
            switch (L->kind) {
            case KEEL_MIXER_MAMBA: keel_engine_mamba(e, &L->mamba, e->slot[l], e->xn, m, e->mix); break;
            case KEEL_MIXER_ATTN: {
                size_t off = (size_t)e->slot[l] * (size_t)e->max_ctx * (size_t)(g->n_kv_head * g->head_dim);
                keel_engine_attention(e, &L->attn, e->k_cache + off, e->v_cache + off, e->pos, e->xn, m, e->mix);
                break;
            }
            case KEEL_MIXER_MLP: keel_engine_mlp(e, &L->mlp, e->xn, m, e->mix); break;
            case KEEL_MIXER_MOE: keel_engine_moe(e, &L->moe, e->xn, m, e->mix); break;
            default: KEEL_ASSERTF(0, "layer %d: unknown mixer '%c'", l, (char)L->kind);
            }
            for (size_t i = 0; i < (size_t)m * (size_t)H; i++) e->x[i] += e->mix[i];
        }
        e->pos += m;
        keel_engine_rmsnorm(e->x, &e->model->norm_f, m, H, g->norm_eps, e->hid);
        if (hidden) memcpy(hidden + (size_t)c0 * (size_t)H, e->hid, (size_t)m * (size_t)H * sizeof(float));
        if (mode == KEEL_LOGITS_ALL)
            keel_cpu_matmul(&e->model->lm_head, e->hid, m, logits + (size_t)c0 * (size_t)V, KEEL_EPI_NONE);
        else if (mode == KEEL_LOGITS_LAST && c0 + m == n)
            keel_cpu_matmul(&e->model->lm_head, e->hid + (size_t)(m - 1) * (size_t)H, 1, logits, KEEL_EPI_NONE);
    }
    return KEEL_OK;
}
