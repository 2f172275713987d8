/* engine: the dense squared-ReLU MLP and the mixture of experts (sigmoid router with correction bias and group
 * selection, squared-ReLU routed experts, a shared expert). Tokens are grouped by expert so each expert's
 * matrices stream once per pass; each token's outputs are summed in its own slot order, independent of grouping. */
#include <math.h>

#include "../kernels/cpu/cpu.h"
#include "engine.h"

void keel_engine_mlp(keel_engine *e, const keel_mlp_w *w, const float *xn, int m, float *out) {
    keel_cpu_matmul(&w->up, xn, m, e->ex_mid, KEEL_EPI_RELU2);
    keel_cpu_matmul(&w->down, e->ex_mid, m, out, KEEL_EPI_NONE);
}

/* True when candidate a ranks before b: higher score, ties to the lower id. */
static inline bool better(float sa, int a, float sb, int b) { return sa > sb || (sa == sb && a < b); }

/* Sigmoid scores plus correction bias choose; the unbiased scores weigh. With n_group > 1 only the topk_group
 * groups of best top-2 sum stay eligible (the others' scores become 0, as mlx-lm and transformers do). Weights
 * are normalised by their sum + 1e-20 when norm_topk_prob (transformers' formula), then scaled. */
void keel_engine_route(const keel_config *c, const float *logits, const keel_vec *corr_bias, int *sel, float *w) {
    enum { MAX_E = 1024 };
    const int E = c->n_experts, K = c->top_k;
    KEEL_ASSERT(E <= MAX_E && K <= E && K >= 1);
    float s[MAX_E], b[MAX_E];
    for (int i = 0; i < E; i++) {
        s[i] = 1.0f / (1.0f + expf(-logits[i]));
        b[i] = s[i] + (corr_bias->n ? keel_vec_get(corr_bias, i) : 0.0f);
    }
    if (c->n_group > 1 && c->topk_group < c->n_group) {
        const int G = c->n_group, per = E / G;
        float gs[MAX_E];
        bool keep[MAX_E];
        for (int q = 0; q < G; q++) {
            float t1 = -INFINITY, t2 = -INFINITY;
            for (int i = q * per; i < (q + 1) * per; i++) {
                if (b[i] > t1) { t2 = t1; t1 = b[i]; }
                else if (b[i] > t2) t2 = b[i];
            }
            gs[q] = per >= 2 ? t1 + t2 : t1;
            keep[q] = false;
        }
        for (int t = 0; t < c->topk_group; t++) {
            int best = -1;
            for (int q = 0; q < G; q++)
                if (!keep[q] && (best < 0 || better(gs[q], q, gs[best], best))) best = q;
            keep[best] = true;
        }
        for (int i = 0; i < E; i++)
            if (!keep[i / per]) b[i] = 0.0f;
    }
    bool used[MAX_E] = {false};
    float sum = 0.0f;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int i = 0; i < E; i++)
            if (!used[i] && (best < 0 || better(b[i], i, b[best], best))) best = i;
        used[best] = true;
        sel[k] = best;
        w[k] = s[best];
        sum += s[best];
    }
    const float denom = sum + 1e-20f;
    for (int k = 0; k < K; k++) w[k] = (c->norm_topk_prob ? w[k] / denom : w[k]) * c->routed_scaling;
}

void keel_engine_moe(keel_engine *e, const keel_moe_w *w, const float *xn, int m, float *out) {
    const keel_config *g = e->cfg;
    const int H = g->hidden, E = g->n_experts, K = g->top_k, C = KEEL_ENGINE_CHUNK;
    KEEL_ASSERT(m <= C);
    keel_cpu_matmul(&w->gate, xn, m, e->router, KEEL_EPI_NONE);
    memset(e->ex_count, 0, (size_t)E * sizeof(int));
    for (int r = 0; r < m; r++) {
        int *sel = e->sel + (size_t)r * K;
        keel_engine_route(g, e->router + (size_t)r * E, &w->corr_bias, sel, e->sel_w + (size_t)r * K);
        for (int k = 0; k < K; k++) {
            int x = sel[k], c = e->ex_count[x]++;
            e->ex_rows[(size_t)x * C + c] = r;
            e->ex_slot[(size_t)x * C + c] = k;
        }
    }
    for (int x = 0; x < E; x++) {
        const int cnt = e->ex_count[x];
        if (!cnt) continue;
        const int *rows = e->ex_rows + (size_t)x * C, *slot = e->ex_slot + (size_t)x * C;
        for (int i = 0; i < cnt; i++)
            memcpy(e->ex_in + (size_t)i * H, xn + (size_t)rows[i] * H, (size_t)H * sizeof(float));
        keel_qmat fc1 = keel_qstack_expert(&w->fc1, x), fc2 = keel_qstack_expert(&w->fc2, x);
        keel_cpu_matmul(&fc1, e->ex_in, cnt, e->ex_mid, KEEL_EPI_RELU2);
        keel_cpu_matmul(&fc2, e->ex_mid, cnt, e->ex_out, KEEL_EPI_NONE);
        for (int i = 0; i < cnt; i++)
            memcpy(e->slots + ((size_t)rows[i] * K + slot[i]) * H, e->ex_out + (size_t)i * H,
                   (size_t)H * sizeof(float));
    }
    for (int r = 0; r < m; r++) {
        float *o = out + (size_t)r * H;
        const float *wr = e->sel_w + (size_t)r * K;
        for (int i = 0; i < H; i++) o[i] = 0.0f;
        for (int k = 0; k < K; k++) {
            const float *sv = e->slots + ((size_t)r * K + k) * H;
            for (int i = 0; i < H; i++) o[i] += wr[k] * sv[i];
        }
    }
    if (g->n_shared > 0) {
        keel_engine_mlp(e, &w->shared, xn, m, e->ex_out);
        for (size_t i = 0; i < (size_t)m * H; i++) out[i] += e->ex_out[i];
    }
}
