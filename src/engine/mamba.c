/* engine: the Mamba-2 mixer, one token at a time through the causal conv window and the SSM recurrence, so a
 * prompt and a run of decodes perform the same arithmetic. */
#include <math.h>

#include "../kernels/cpu/cpu.h"
#include "engine.h"

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* softplus(v) = log(1 + exp(v)), written to neither overflow nor lose small values. */
static inline float softplus(float v) { return v > 0.0f ? v + log1pf(expf(-v)) : log1pf(expf(v)); }

/* Causal depthwise conv of one token: window (K-1, C) oldest first plus the current input, then SiLU; then the
 * window shifts to take the current input. */
static void conv_step(const keel_mamba_w *w, int K, int C, bool bias, float *win, const float *in, float *out) {
    for (int c = 0; c < C; c++) {
        float acc = bias ? keel_vec_get(&w->conv_b, c) : 0.0f;
        for (int k = 0; k < K - 1; k++) acc += keel_vec_get(&w->conv_w, c * K + k) * win[(size_t)k * (size_t)C + c];
        acc += keel_vec_get(&w->conv_w, c * K + K - 1) * in[c];
        out[c] = silu(acc);
    }
    if (K > 1) {
        memmove(win, win + C, (size_t)(K - 2) * (size_t)C * sizeof(float));
        memcpy(win + (size_t)(K - 2) * (size_t)C, in, (size_t)C * sizeof(float));
    }
}

/* The SSM recurrence of one token for head h: state = exp(A dt) state + dt x B; y = state.C + D x. */
static void ssm_head(const keel_config *g, const keel_mamba_w *w, int h, float *st, const float *xs, const float *B,
                     const float *Cm, float dt_raw, float *y) {
    const int P = g->mamba_head_dim, N = g->ssm_state;
    const int grp = h / (g->mamba_heads / g->n_groups);
    const float dt = softplus(dt_raw + keel_vec_get(&w->dt_bias, h));
    const float A = -expf(keel_vec_get(&w->A_log, h));
    const float dA = expf(A * dt), Dh = keel_vec_get(&w->D, h);
    const float *Bg = B + (size_t)grp * (size_t)N, *Cg = Cm + (size_t)grp * (size_t)N;
    for (int p = 0; p < P; p++) {
        const float xv = xs[h * P + p];
        const float xdt = xv * dt;
        float *s = st + ((size_t)h * (size_t)P + (size_t)p) * (size_t)N;
        float acc = 0.0f;
        for (int n = 0; n < N; n++) {
            s[n] = dA * s[n] + xdt * Bg[n];
            acc += s[n] * Cg[n];
        }
        y[h * P + p] = acc + Dh * xv;
    }
}

void keel_engine_mamba(keel_engine *e, const keel_mamba_w *w, int slot, const float *xn, int m, float *out) {
    const keel_config *g = e->cfg;
    const int DI = g->d_inner, CD = g->conv_dim, K = g->conv_kernel, NH = g->mamba_heads;
    const int GN = g->n_groups * g->ssm_state, PD = g->in_proj_dim;
    float *proj = e->wide; /* (m, in_proj_dim): z | xBC | dt */
    float *y = e->mid;     /* (m, d_inner) after the gated norm */
    keel_cpu_matmul(&w->in_proj, xn, m, proj, KEEL_EPI_NONE);
    if (w->in_bias.n)
        for (int r = 0; r < m; r++)
            for (int i = 0; i < PD; i++) proj[(size_t)r * PD + i] += keel_vec_get(&w->in_bias, i);
    float *win = e->conv_state + (size_t)slot * (size_t)(K - 1) * (size_t)CD;
    float *st = e->ssm_state + (size_t)slot * (size_t)NH * (size_t)g->mamba_head_dim * (size_t)g->ssm_state;
    float *xbc = e->conv_out; /* (conv_dim) one token's conv output */
    const int gs = DI / g->n_groups;
    for (int r = 0; r < m; r++) {
        const float *pr = proj + (size_t)r * PD;
        float *yr = y + (size_t)r * DI;
        conv_step(w, K, CD, g->conv_bias, win, pr + DI, xbc);
        const float *xs = xbc, *B = xbc + DI, *Cm = xbc + DI + GN;
        const float *dt = pr + DI + CD;
        const int nh = NH, big = NH * g->mamba_head_dim * g->ssm_state >= 65536;
#pragma omp parallel for num_threads(keel_cpu_threads()) if (big) schedule(static)
        for (int h = 0; h < nh; h++) ssm_head(g, w, h, st, xs, B, Cm, dt[h], yr);
        /* gated RMSNorm: y * silu(z), normalised within each group of d_inner / n_groups channels */
        const float *z = pr;
        for (int i = 0; i < DI; i++) yr[i] *= silu(z[i]);
        for (int q = 0; q < g->n_groups; q++) {
            float *v = yr + (size_t)q * gs;
            float ss = 0.0f;
            for (int i = 0; i < gs; i++) ss += v[i] * v[i];
            float inv = 1.0f / sqrtf(ss / (float)gs + g->norm_eps);
            for (int i = 0; i < gs; i++) v[i] = v[i] * inv * keel_vec_get(&w->norm, q * gs + i);
        }
    }
    keel_cpu_matmul(&w->out_proj, y, m, out, KEEL_EPI_NONE);
    if (w->out_bias.n)
        for (int r = 0; r < m; r++)
            for (int i = 0; i < g->hidden; i++) out[(size_t)r * g->hidden + i] += keel_vec_get(&w->out_bias, i);
}
