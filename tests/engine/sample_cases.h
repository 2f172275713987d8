/* tests/engine: sampler cases shared by test_sample.c (CPU) and cuda/test_cuda_sample.c (GPU against CPU): a
 * deterministic generator of logits (ties, NaN, infinities, signed zeros, huge and tiny spreads) and
 * configurations (greedy, top-k 1, tiny top-p, min-p, huge and tiny temperatures), and a brute-force reference of
 * the sampler's definition (src/engine/sample_fixed.h) written from the definition alone: ranks by counting,
 * every cut as a per-token predicate, exact products in 128 bits. */
#ifndef KEEL_TESTS_ENGINE_SAMPLE_CASES_H
#define KEEL_TESTS_ENGINE_SAMPLE_CASES_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "engine/engine.h"
#include "engine/sample_fixed.h"

__extension__ typedef unsigned __int128 sc_u128;

typedef struct sc_rng {
    uint64_t s;
} sc_rng;

static inline uint64_t sc_next(sc_rng *r) {
    r->s ^= r->s << 13, r->s ^= r->s >> 7, r->s ^= r->s << 17;
    return r->s;
}
static inline double sc_unif(sc_rng *r) { return ((double)(sc_next(r) >> 11) + 0.5) * 0x1p-53; }
static inline double sc_norm(sc_rng *r) { return sqrt(-2.0 * log(sc_unif(r))) * cos(6.283185307179586 * sc_unif(r)); }
static inline int sc_below(sc_rng *r, int n) { return (int)(sc_next(r) % (uint64_t)n); }

enum { SC_DISTS = 9 };

/* Logits of distribution d (0..SC_DISTS-1) into l (V). */
static inline void sc_logits(sc_rng *r, float *l, int V, int d) {
    for (int i = 0; i < V; i++) {
        switch (d) {
        case 0: l[i] = (float)(3.0 * sc_norm(r)); break;                        /* a typical spread */
        case 1: l[i] = (float)(sc_below(r, 9) * 0.5 - 2.0); break;             /* a grid: ties everywhere */
        case 2: l[i] = (float)(64.0 * sc_norm(r)); break;                       /* huge spread */
        case 3: l[i] = sc_below(r, 10) == 0 ? NAN : (float)sc_norm(r); break;  /* NaN-laced */
        case 4: l[i] = (float)(sc_norm(r) * 1e-3); break;                       /* nearly flat */
        case 5: l[i] = 1.5f; break;                                             /* all equal */
        case 6: l[i] = NAN; break;                                              /* no candidate */
        case 7: l[i] = nextafterf(1.0f, 2.0f * (float)sc_below(r, 2)) * (sc_below(r, 3) ? 1.0f : 1.0f + 0x1p-20f); break;
        default: l[i] = (float)(sc_norm(r) * 30.0); break; /* wide, with infinities and zeros planted below */
        }
    }
    if (d == 3 || d == 8) { /* signed zeros, -inf, and at times +inf (tied when twice) */
        for (int k = 0; k < 1 + V / 16; k++) l[sc_below(r, V)] = sc_below(r, 2) ? 0.0f : -0.0f;
        l[sc_below(r, V)] = -INFINITY;
        if (d == 8 && sc_below(r, 2)) l[sc_below(r, V)] = INFINITY, l[sc_below(r, V)] = INFINITY;
    }
}

/* A configuration, from a pool of edge values and random ones. */
static inline keel_sampler_cfg sc_cfg(sc_rng *r, int V) {
    static const float temps[] = {1.0f, 0.7f, 2.5f, 1e-3f, 1e-30f, 1e30f, INFINITY, 0.0f, -1.0f, NAN, 0.25f};
    static const float tops[] = {1.0f, 0.9f, 0.5f, 0.999f, 1e-30f, 0.0f, -1.0f, NAN, 0.95f, 2.0f};
    static const float mins[] = {0.0f, 0.05f, 0.5f, 1.0f, 2.0f, 1e-30f, 0.1f, -1.0f};
    keel_sampler_cfg c = {0};
    c.temp = sc_below(r, 4) ? temps[sc_below(r, 11)] : (float)(0.05 + 3.0 * sc_unif(r));
    const int kk = sc_below(r, 6);
    c.top_k = kk == 0 ? 0 : kk == 1 ? 1 : kk == 2 ? 2 + sc_below(r, 8) : kk == 3 ? V + 3 : kk == 4 ? -5 : 1 + sc_below(r, V);
    c.top_p = sc_below(r, 3) ? tops[sc_below(r, 10)] : (float)sc_unif(r);
    c.min_p = sc_below(r, 3) ? mins[sc_below(r, 8)] : (float)(0.3 * sc_unif(r));
    c.seed = sc_next(r);
    return c;
}

/* The brute-force reference: the token drawn at pos, and (when kept is non-NULL) the kept ids in order. */
static inline int sc_reference(const float *l, int V, const keel_sampler_cfg *c, int64_t pos, int *kept, int *nkept) {
    if (nkept) *nkept = 1;
    if (!(c->temp > 0.0f)) { /* greedy: the first largest non-NaN, id 0 when every logit is NaN */
        int best = -1;
        for (int i = 0; i < V; i++)
            if (l[i] == l[i] && (best < 0 || l[i] > l[best])) best = i;
        if (kept) kept[0] = best < 0 ? 0 : best;
        return best < 0 ? 0 : best;
    }
    int nvalid = 0;
    float lmax = -INFINITY;
    for (int i = 0; i < V; i++)
        if (l[i] == l[i]) nvalid++, lmax = l[i] > lmax ? l[i] : lmax;
    if (nvalid == 0) {
        if (kept) kept[0] = 0;
        return 0;
    }
    int *rank = malloc((size_t)V * sizeof(int));
    uint64_t *w = malloc((size_t)V * sizeof(uint64_t));
    unsigned char *keep = malloc((size_t)V);
    const float scale = keel_samp_scale(c->temp);
    for (int i = 0; i < V; i++) {
        rank[i] = -1, w[i] = 0, keep[i] = 0;
        if (l[i] != l[i]) continue;
        int rk = 0;
        for (int j = 0; j < V; j++) rk += l[j] == l[j] && (l[j] > l[i] || (l[j] == l[i] && j < i));
        rank[i] = rk;
        w[i] = keel_samp_w(keel_samp_y(l[i], lmax, scale), keel_samp_t1, keel_samp_t2);
    }
    const int nk = c->top_k > 0 && c->top_k < nvalid ? c->top_k : nvalid;
    sc_u128 t1 = 0;
    for (int i = 0; i < V; i++)
        if (rank[i] >= 0 && rank[i] < nk) t1 += w[i];
    int mant_e = 0;
    const float mant = frexpf(c->top_p, &mant_e); /* top_p = M 2^(e-24) */
    const sc_u128 X = (sc_u128)(uint64_t)ldexpf(mant, 24) * t1;
    const int sh = 24 - mant_e;
    for (int i = 0; i < V; i++) {
        if (rank[i] < 0 || rank[i] >= nk || w[i] == 0) continue;
        bool ok = true;
        if (c->top_p < 1.0f && rank[i] > 0) { /* the mass before i below top_p times the top-k mass */
            sc_u128 before = 0;
            for (int j = 0; j < V; j++)
                if (rank[j] >= 0 && rank[j] < rank[i] && rank[j] < nk) before += w[j];
            if (!(c->top_p > 0.0f) || X == 0) ok = false;
            else ok = before <= (sh >= 128 ? 0 : (X - 1) >> sh);
        }
        if (c->min_p > 0.0f && rank[i] > 0) ok = ok && (long double)w[i] >= (long double)c->min_p * 0x1p42L;
        keep[i] = ok;
    }
    sc_u128 tot = 0;
    for (int i = 0; i < V; i++)
        if (keep[i]) tot += w[i];
    const sc_u128 t = ((sc_u128)keel_samp_r53(c->seed, pos) * tot) >> 53;
    int tok = -1, n = 0;
    for (int r = 0; r < nvalid; r++) /* in rank order: the first whose inclusive mass exceeds t */
        for (int i = 0; i < V; i++) {
            if (rank[i] != r || !keep[i]) continue;
            if (kept) kept[n] = i;
            n++;
            sc_u128 cum = 0;
            for (int j = 0; j < V; j++)
                if (keep[j] && rank[j] <= r) cum += w[j];
            if (tok < 0 && cum > t) tok = i;
        }
    if (nkept) *nkept = n;
    free(rank), free(w), free(keep);
    return tok;
}

#endif
