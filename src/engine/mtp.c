/* engine: the multi-token-prediction head. At position i with h_i (the model's hidden after norm_f) and the next
 * token t_{i+1}: x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)]); x += attn(norm0(x)) over the head's own
 * causal cache; x += moe(norm1(x)); out = final_layernorm(x); logits = lm_head(out) predict t_{i+2}. A chained
 * draft feeds `out` back as the next h, the same place (after the last norm) the model's h comes from, as vLLM's
 * Nemotron-H MTP does. */
#include "../kernels/cpu/cpu.h"
#include "engine.h"

keel_code keel_engine_mtp(keel_engine *e, const float *h, const int *next, int n, float *logits, float *out_hidden,
                          keel_err *err) {
    const keel_model *M = e->model;
    const keel_config *g = e->cfg;
    const keel_mtp_w *w = &M->mtp;
    const int H = g->hidden, V = g->vocab;
    if (!M->has_mtp) return keel_err_set(err, KEEL_E_MISSING, "model %s has no MTP head (mtp.safetensors)", M->dir);
    if (n < 1) return keel_err_set(err, KEEL_E_ARG, "mtp: %d positions, expected at least 1", n);
    for (int i = 0; i < n; i++)
        if (next[i] < 0 || next[i] >= V)
            return keel_err_set(err, KEEL_E_RANGE, "token id %d (at index %d) is outside the vocabulary of %d ids",
                                next[i], i, V);
    if ((int64_t)e->mtp_pos + n > e->max_ctx)
        return keel_err_set(err, KEEL_E_RANGE, "mtp: %d positions at position %d do not fit the context of %d tokens",
                            n, e->mtp_pos, e->max_ctx);
    for (int c0 = 0; c0 < n; c0 += KEEL_ENGINE_CHUNK) {
        const int m = KEEL_MIN(KEEL_ENGINE_CHUNK, n - c0);
        float *cat = e->wide; /* (m, 2*hidden) */
        keel_engine_embed(e, next + c0, m, e->xn);
        for (int r = 0; r < m; r++) {
            float *cr = cat + (size_t)r * 2 * H;
            keel_engine_rmsnorm(e->xn + (size_t)r * H, &w->enorm, 1, H, g->norm_eps, cr);
            keel_engine_rmsnorm(h + (size_t)(c0 + r) * H, &w->hnorm, 1, H, g->norm_eps, cr + H);
        }
        keel_cpu_matmul(&w->eh_proj, cat, m, e->x, KEEL_EPI_NONE);
        keel_engine_rmsnorm(e->x, &w->norm0, m, H, g->norm_eps, e->xn);
        keel_engine_attention(e, &w->attn, e->mtp_k, e->mtp_v, e->mtp_pos, e->xn, m, e->mix);
        for (size_t i = 0; i < (size_t)m * H; i++) e->x[i] += e->mix[i];
        keel_engine_rmsnorm(e->x, &w->norm1, m, H, g->norm_eps, e->xn);
        keel_engine_moe(e, &w->moe, e->xn, m, e->mix);
        for (size_t i = 0; i < (size_t)m * H; i++) e->x[i] += e->mix[i];
        e->mtp_pos += m;
        keel_engine_rmsnorm(e->x, &w->final_norm, m, H, g->norm_eps, e->hid);
        if (out_hidden) memcpy(out_hidden + (size_t)c0 * H, e->hid, (size_t)m * H * sizeof(float));
        if (logits) keel_cpu_matmul(&M->lm_head, e->hid, m, logits + (size_t)c0 * V, KEEL_EPI_NONE);
    }
    return KEEL_OK;
}
