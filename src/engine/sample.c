/* engine: sampling. A draw depends only on (configuration, seed, absolute position, logits) and is exactly
 * reproducible: weights are integers of the exact definition in sample_fixed.h (which the GPU sampler,
 * cuda/sample.cu, shares), every cut and the inverse-CDF draw are located by exact integer sums over the order
 * (logit descending, id ascending), so no summation order or libm enters the result. Built with
 * -ffp-contract=off (CMakeLists.txt) so no compiler fuses the float steps of the weight. */
#include <math.h>
#include <stdlib.h>

#include "engine.h"
#include "sample_fixed.h"

typedef struct cand {
    uint64_t key; /* order key (sample_fixed.h) << 32 | id: ascending key = the sampler's order */
    uint64_t w;   /* integer weight, > 0 */
} cand;

static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    return (x->key > y->key) - (x->key < y->key);
}

double keel_sampler_uniform(uint64_t seed, int64_t pos) { return (double)keel_samp_r53(seed, pos) * 0x1.0p-53; }

int keel_argmax(const float *v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best] || (v[best] != v[best] && v[i] == v[i])) best = i; /* NaN never wins */
    return best;
}

void keel_sampler_init(keel_sampler *s, const keel_sampler_cfg *c, int vocab) {
    KEEL_ASSERT(s && c && vocab >= 1);
    KEEL_ASSERTF(vocab <= KEEL_SAMP_VMAX, "vocabulary %d above the sampler's %d", vocab, KEEL_SAMP_VMAX);
    memset(s, 0, sizeof *s);
    s->c = *c;
    s->vocab = vocab;
    s->idx = keel_xmalloc((size_t)vocab * sizeof(int));
    s->prob = keel_xmalloc((size_t)vocab * sizeof(float));
    s->tmp = keel_xmalloc((size_t)vocab * sizeof(cand));
}

void keel_sampler_free(keel_sampler *s) {
    if (!s) return;
    free(s->idx);
    free(s->prob);
    free(s->tmp);
    memset(s, 0, sizeof *s);
}

/* The survivors as a prefix of s->tmp (sorted, weights > 0); returns their count n >= 1 and their total. A
 * greedy configuration or one without candidates leaves one survivor of weight 1 in tmp. */
static int survivors(keel_sampler *s, const float *logits, uint64_t *total) {
    const int V = s->vocab;
    cand *cs = s->tmp;
    if (!(s->c.temp > 0.0f)) {
        cs[0] = (cand){(uint64_t)keel_argmax(logits, V), 1};
        *total = 1;
        return 1;
    }
    int n_valid = 0;
    float lmax = -INFINITY;
    for (int i = 0; i < V; i++)
        if (logits[i] == logits[i]) n_valid++, lmax = logits[i] > lmax ? logits[i] : lmax; /* NaN: no candidate */
    if (n_valid == 0) { /* all NaN: id 0 rather than fail */
        cs[0] = (cand){0, 1};
        *total = 1;
        return 1;
    }
    const float scale = keel_samp_scale(s->c.temp);
    int npos = 0; /* weight 0 comes after every positive weight in the order and never stays */
    for (int i = 0; i < V; i++) {
        if (logits[i] != logits[i]) continue;
        const uint64_t w = keel_samp_w(keel_samp_y(logits[i], lmax, scale), keel_samp_t1, keel_samp_t2);
        if (w) cs[npos++] = (cand){(uint64_t)keel_samp_okey(logits[i]) << 32 | (uint64_t)i, w};
    }
    qsort(cs, (size_t)npos, sizeof *cs, cand_cmp);
    const int nk = s->c.top_k > 0 && s->c.top_k < n_valid ? s->c.top_k : n_valid;
    int n = KEEL_MIN(nk, npos);
    const uint64_t thr = keel_samp_thr(s->c.min_p);
    int nm = 0;
    while (nm < n && cs[nm].w >= thr) nm++;
    if (s->c.top_p < 1.0f) {
        uint64_t t1 = 0;
        for (int i = 0; i < n; i++) t1 += cs[i].w; /* the top-k mass (min-p does not change it) */
        const uint64_t need = keel_samp_need(s->c.top_p, t1);
        int np = 1;
        uint64_t cum = cs[0].w;
        while (cum < need) cum += cs[np++].w; /* keep i while the mass before it is below need */
        n = KEEL_MIN(n, np);
    }
    n = KEEL_MAX(1, KEEL_MIN(n, nm));
    uint64_t tot = 0;
    for (int i = 0; i < n; i++) tot += cs[i].w;
    *total = tot;
    return n;
}

int keel_sampler_filter(keel_sampler *s, const float *logits) {
    uint64_t tot;
    const int n = survivors(s, logits, &tot);
    const cand *cs = s->tmp;
    for (int i = 0; i < n; i++) {
        s->idx[i] = (int)(cs[i].key & 0xffffffffu);
        s->prob[i] = (float)((double)cs[i].w / (double)tot);
    }
    return n;
}

int keel_sampler_sample(keel_sampler *s, const float *logits, int64_t pos) {
    uint64_t tot;
    const int n = survivors(s, logits, &tot);
    const cand *cs = s->tmp;
    const uint64_t t = keel_samp_target(keel_samp_r53(s->c.seed, pos), tot);
    uint64_t cum = 0;
    int i = 0;
    while (i < n - 1 && (cum += cs[i].w) <= t) i++;
    return (int)(cs[i].key & 0xffffffffu);
}
