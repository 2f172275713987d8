/* engine: sampling. A draw depends only on (configuration, seed, absolute position, logits): the uniform is a
 * counter-based hash of (seed, position), mapped through the inverse CDF of the filtered distribution sorted by
 * logit (ties to the lower id). No hidden generator state, so a replay or another backend draws the same token. */
#include <math.h>
#include <stdlib.h>

#include "engine.h"

typedef struct cand {
    float l;
    int id;
} cand;

static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->l > y->l) return -1;
    if (x->l < y->l) return 1;
    return (x->id > y->id) - (x->id < y->id);
}

static uint64_t splitmix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double keel_sampler_uniform(uint64_t seed, int64_t pos) {
    uint64_t h = splitmix64(splitmix64(seed) ^ (uint64_t)pos);
    return (double)(h >> 11) * 0x1.0p-53;
}

int keel_argmax(const float *v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best] || (v[best] != v[best] && v[i] == v[i])) best = i; /* NaN never wins */
    return best;
}

void keel_sampler_init(keel_sampler *s, const keel_sampler_cfg *c, int vocab) {
    KEEL_ASSERT(s && c && vocab >= 1);
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

int keel_sampler_filter(keel_sampler *s, const float *logits) {
    const int V = s->vocab;
    if (!(s->c.temp > 0.0f)) {
        s->idx[0] = keel_argmax(logits, V);
        s->prob[0] = 1.0f;
        return 1;
    }
    cand *cs = s->tmp;
    int n = 0;
    for (int i = 0; i < V; i++)
        if (logits[i] == logits[i]) cs[n++] = (cand){logits[i], i}; /* NaN logits are never candidates */
    if (n == 0) { /* all NaN: fall back to id 0 rather than fail */
        s->idx[0] = 0;
        s->prob[0] = 1.0f;
        return 1;
    }
    qsort(cs, (size_t)n, sizeof *cs, cand_cmp);
    if (s->c.top_k > 0 && s->c.top_k < n) n = s->c.top_k;
    /* softmax at temperature over the survivors, the mass summed in double */
    double sum = 0.0;
    const double inv_t = 1.0 / (double)s->c.temp, top = (double)cs[0].l;
    for (int i = 0; i < n; i++) {
        s->idx[i] = cs[i].id;
        s->prob[i] = (float)exp(((double)cs[i].l - top) * inv_t);
        sum += s->prob[i];
    }
    if (s->c.top_p < 1.0f) {
        const double need = (double)s->c.top_p * sum;
        double cum = 0.0;
        int keep = n;
        for (int i = 0; i < n; i++) {
            cum += s->prob[i];
            if (cum >= need) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    }
    if (s->c.min_p > 0.0f) {
        const float floor_p = s->c.min_p * s->prob[0]; /* prob[0] is the largest */
        int keep = 1;
        while (keep < n && s->prob[keep] >= floor_p) keep++;
        n = keep;
    }
    double tot = 0.0;
    for (int i = 0; i < n; i++) tot += s->prob[i];
    for (int i = 0; i < n; i++) s->prob[i] = (float)(s->prob[i] / tot);
    return n;
}

int keel_sampler_sample(keel_sampler *s, const float *logits, int64_t pos) {
    const int n = keel_sampler_filter(s, logits);
    if (n == 1) return s->idx[0];
    const double u = keel_sampler_uniform(s->c.seed, pos);
    double cum = 0.0;
    for (int i = 0; i < n; i++) {
        cum += s->prob[i];
        if (u < cum) return s->idx[i];
    }
    return s->idx[n - 1];
}
