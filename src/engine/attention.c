/* engine: causal grouped-query attention without RoPE over a KV cache; each row attends to every cached position
 * up to its own with the same per-row arithmetic whether it came in a prompt or alone. */
#include <math.h>

#include "../kernels/cpu/cpu.h"
#include "engine.h"

static void add_bias(float *y, int m, int n, int stride, const keel_vec *b) {
    if (!b->n) return;
    for (int r = 0; r < m; r++)
        for (int i = 0; i < n; i++) y[(size_t)r * stride + i] += keel_vec_get(b, i);
}

/* One query head over cache positions 0..p: softmax(q.k * scale) . v into o (head_dim). */
static void attend_head(const float *q, const float *kc, const float *vc, int p, int kvd, int hd, float scale,
                        float *sc, float *o) {
    float mx = -INFINITY;
    for (int j = 0; j <= p; j++) {
        const float *k = kc + (size_t)j * kvd;
        float d = 0.0f;
        for (int i = 0; i < hd; i++) d += q[i] * k[i];
        sc[j] = d * scale;
        mx = sc[j] > mx ? sc[j] : mx;
    }
    float sum = 0.0f;
    for (int j = 0; j <= p; j++) {
        sc[j] = expf(sc[j] - mx);
        sum += sc[j];
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < hd; i++) o[i] = 0.0f;
    for (int j = 0; j <= p; j++) {
        const float *v = vc + (size_t)j * kvd;
        const float pj = sc[j] * inv;
        for (int i = 0; i < hd; i++) o[i] += pj * v[i];
    }
}

void keel_engine_attention(keel_engine *e, const keel_attn_w *w, float *kc, float *vc, int pos, const float *xn,
                           int m, float *out) {
    const keel_config *g = e->cfg;
    const int hd = g->head_dim, nh = g->n_head, nkv = g->n_kv_head;
    const int qd = nh * hd, kvd = nkv * hd;
    float *q = e->wide; /* (m, qd) */
    float *k = e->wide + (size_t)m * qd;
    float *v = k + (size_t)m * kvd;
    keel_cpu_matmul(&w->q, xn, m, q, KEEL_EPI_NONE);
    keel_cpu_matmul(&w->k, xn, m, k, KEEL_EPI_NONE);
    keel_cpu_matmul(&w->v, xn, m, v, KEEL_EPI_NONE);
    add_bias(q, m, qd, qd, &w->q_bias);
    add_bias(k, m, kvd, kvd, &w->k_bias);
    add_bias(v, m, kvd, kvd, &w->v_bias);
    memcpy(kc + (size_t)pos * kvd, k, (size_t)m * kvd * sizeof(float));
    memcpy(vc + (size_t)pos * kvd, v, (size_t)m * kvd * sizeof(float));
    const float scale = 1.0f / sqrtf((float)hd);
    const int rep = nh / nkv;
    float *o = e->mid; /* (m, qd) */
    for (int r = 0; r < m; r++) {
        const int p = pos + r;
        const int big = (int64_t)(p + 1) * qd >= 65536;
#pragma omp parallel for num_threads(keel_cpu_threads()) if (big) schedule(static)
        for (int h = 0; h < nh; h++) {
            const int kh = h / rep;
            attend_head(q + (size_t)r * qd + (size_t)h * hd, kc + (size_t)kh * hd, vc + (size_t)kh * hd, p, kvd, hd,
                        scale, e->scores + (size_t)h * e->max_ctx, o + (size_t)r * qd + (size_t)h * hd);
        }
    }
    keel_cpu_matmul(&w->o, o, m, out, KEEL_EPI_NONE);
    add_bias(out, m, g->hidden, g->hidden, &w->o_bias);
}
