/* model: `keel synth`: a random nemotron_h checkpoint of any geometry, deterministic from a seed, streamed to disk.
 *
 * Every tensor's shape is known from the config, so each safetensors header is computed first; then the tensors are
 * cut into units of a few MB of output that threads generate (element i of a tensor is a hash of the seed, the
 * tensor's name and i), quantize and write at their offsets of a temporary file, renamed into place when complete.
 * Memory stays at one unit per thread, and the bytes do not depend on the thread count.
 * Scales keep a forward pass sane: matrices ~ N(0, 1/in), norms ~ 1, A_log = log U(1, 16), dt_bias the inverse
 * softplus of a log-uniform dt in [0.001, 0.1], D ~ 1, a float router and a small correction bias.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "kernels/cpu/cpu.h"
#include "model.h"

#define SYNTH_UNIT_BYTES ((size_t)4 << 20) /* output bytes per unit of work: one large pwrite per tensor */
#define SYNTH_BATCH_FLOATS ((size_t)1 << 18) /* floats generated per quantize call: one thread's float buffer */

typedef enum init_kind { INIT_NORMAL, INIT_ALOG, INIT_DTBIAS } init_kind;

typedef struct tspec {
    char name[160];
    keel_dtype dt;
    int ndim;
    int64_t shape[3];
    size_t nbytes, off;
} tspec;

/* One generated object: a matrix (quantized: weight, scales, biases; or float) or a float vector. */
typedef struct gjob {
    char path[160];  /* seeds the stream */
    int64_t rows;    /* all rows, experts stacked: E * out (1 for a vector) */
    int cols;        /* input width (the length for a vector) */
    int bits, group; /* 0 for float */
    keel_dtype sdt;  /* scales dtype, or the float tensor's dtype */
    init_kind init;
    float mean, std;
    int tw, ts, tb; /* tspec indices (ts, tb = -1 when float) */
} gjob;

typedef struct plan {
    int nt, ct, nj, cj;
    tspec *t;
    gjob *j;
} plan;

static int add_t(plan *p, const char *name, keel_dtype dt, int ndim, const int64_t *shape) {
    if (p->nt == p->ct) p->t = keel_xrealloc(p->t, (size_t)(p->ct = p->ct ? 2 * p->ct : 64) * sizeof *p->t);
    tspec *t = &p->t[p->nt];
    memset(t, 0, sizeof *t);
    fmt(t->name, sizeof t->name, "%s", name);
    t->dt = dt;
    t->ndim = ndim;
    size_t n = keel_dtype_size(dt);
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i];
        n *= (size_t)shape[i];
    }
    t->nbytes = n;
    return p->nt++;
}

static gjob *add_j(plan *p) {
    if (p->nj == p->cj) p->j = keel_xrealloc(p->j, (size_t)(p->cj = p->cj ? 2 * p->cj : 64) * sizeof *p->j);
    gjob *j = &p->j[p->nj++];
    memset(j, 0, sizeof *j);
    j->ts = j->tb = -1;
    return j;
}

/* A matrix (n_expert?, out, in): quantized at bits/group (bits 0: float BF16) with weights ~ N(0, std^2). */
static keel_code add_mat(plan *p, const char *path, int n_expert, int out, int in, int bits, int group,
                         keel_dtype sdt, float std, keel_err *err) {
    if (bits && in % group)
        return keel_err_set(err, KEEL_E_ARG, "synth: matrix %s has input width %d, not a multiple of group %d", path,
                            in, group);
    gjob *j = add_j(p);
    fmt(j->path, sizeof j->path, "%s", path);
    j->rows = (int64_t)(n_expert ? n_expert : 1) * out;
    j->cols = in;
    j->bits = bits;
    j->group = bits ? group : 0;
    j->sdt = bits ? sdt : KEEL_DT_BF16;
    j->init = INIT_NORMAL;
    j->std = std;
    int nd = n_expert ? 3 : 2;
    int64_t sh[3], *l = sh;
    if (n_expert) *l++ = n_expert;
    l[0] = out;
    char name[200];
    if (bits) {
        l[1] = (int64_t)keel_quant_row_words(in, bits);
        fmt(name, sizeof name, "%s.weight", path);
        j->tw = add_t(p, name, KEEL_DT_U32, nd, sh);
        l[1] = in / group;
        fmt(name, sizeof name, "%s.scales", path);
        j->ts = add_t(p, name, sdt, nd, sh);
        fmt(name, sizeof name, "%s.biases", path);
        j->tb = add_t(p, name, sdt, nd, sh);
    } else {
        l[1] = in;
        fmt(name, sizeof name, "%s.weight", path);
        j->tw = add_t(p, name, KEEL_DT_BF16, nd, sh);
    }
    return KEEL_OK;
}

/* A float tensor of n elements with the given shape. */
static void add_vec(plan *p, const char *name, keel_dtype dt, int ndim, const int64_t *shape, init_kind init,
                    float mean, float std) {
    gjob *j = add_j(p);
    fmt(j->path, sizeof j->path, "%s", name);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    j->rows = 1;
    j->cols = (int)n;
    j->sdt = dt;
    j->init = init;
    j->mean = mean;
    j->std = std;
    j->tw = add_t(p, name, dt, ndim, shape);
}

static void add_vec1(plan *p, const char *name, int n, keel_dtype dt, init_kind init, float mean, float std) {
    int64_t s[1] = {n};
    add_vec(p, name, dt, 1, s, init, mean, std);
}

typedef struct widths {
    int bits, group;
    keel_dtype sdt;
} widths;

static float inv_sqrt(int n) { return 1.0f / sqrtf((float)n); }

static keel_code plan_attn(plan *p, const keel_config *c, const char *pre, widths w, keel_err *err) {
    const char *names[4] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    int outs[4] = {c->n_head * c->head_dim, c->n_kv_head * c->head_dim, c->n_kv_head * c->head_dim, c->hidden};
    int ins[4] = {c->hidden, c->hidden, c->hidden, c->n_head * c->head_dim};
    char q[200];
    keel_code rc;
    for (int i = 0; i < 4; i++) {
        fmt(q, sizeof q, "%s.%s", pre, names[i]);
        if ((rc = add_mat(p, q, 0, outs[i], ins[i], w.bits, w.group, w.sdt, inv_sqrt(ins[i]), err))) return rc;
        if (c->attn_bias) {
            fmt(q, sizeof q, "%s.%s.bias", pre, names[i]);
            add_vec1(p, q, outs[i], KEEL_DT_BF16, INIT_NORMAL, 0, 0.02f);
        }
    }
    return KEEL_OK;
}

static keel_code plan_mlp(plan *p, const char *pre, int hidden, int inter, widths w, keel_err *err) {
    char q[200];
    keel_code rc;
    fmt(q, sizeof q, "%s.up_proj", pre);
    if ((rc = add_mat(p, q, 0, inter, hidden, w.bits, w.group, w.sdt, inv_sqrt(hidden), err))) return rc;
    fmt(q, sizeof q, "%s.down_proj", pre);
    return add_mat(p, q, 0, hidden, inter, w.bits, w.group, w.sdt, inv_sqrt(inter), err);
}

static keel_code plan_moe(plan *p, const keel_config *c, const char *pre, widths w, keel_err *err) {
    char q[200];
    keel_code rc;
    fmt(q, sizeof q, "%s.gate", pre);
    if ((rc = add_mat(p, q, 0, c->n_experts, c->hidden, 0, 0, KEEL_DT_BF16, inv_sqrt(c->hidden), err))) return rc;
    fmt(q, sizeof q, "%s.gate.e_score_correction_bias", pre);
    add_vec1(p, q, c->n_experts, KEEL_DT_F32, INIT_NORMAL, 0, 0.01f);
    fmt(q, sizeof q, "%s.switch_mlp.fc1", pre);
    if ((rc = add_mat(p, q, c->n_experts, c->moe_inter, c->hidden, w.bits, w.group, w.sdt, inv_sqrt(c->hidden), err)))
        return rc;
    fmt(q, sizeof q, "%s.switch_mlp.fc2", pre);
    if ((rc = add_mat(p, q, c->n_experts, c->hidden, c->moe_inter, w.bits, w.group, w.sdt, inv_sqrt(c->moe_inter),
                      err)))
        return rc;
    fmt(q, sizeof q, "%s.shared_experts", pre);
    return plan_mlp(p, q, c->hidden, c->shared_inter, w, err);
}

static keel_code plan_mamba(plan *p, const keel_config *c, const char *pre, widths w, keel_err *err) {
    char q[200];
    keel_code rc;
    fmt(q, sizeof q, "%s.in_proj", pre);
    if ((rc = add_mat(p, q, 0, c->in_proj_dim, c->hidden, w.bits, w.group, w.sdt, inv_sqrt(c->hidden), err))) return rc;
    if (c->mamba_bias) {
        fmt(q, sizeof q, "%s.in_proj.bias", pre);
        add_vec1(p, q, c->in_proj_dim, KEEL_DT_BF16, INIT_NORMAL, 0, 0.02f);
    }
    int64_t cs[3] = {c->conv_dim, c->conv_kernel, 1};
    fmt(q, sizeof q, "%s.conv1d.weight", pre);
    add_vec(p, q, KEEL_DT_BF16, 3, cs, INIT_NORMAL, 0, inv_sqrt(c->conv_kernel));
    if (c->conv_bias) {
        fmt(q, sizeof q, "%s.conv1d.bias", pre);
        add_vec1(p, q, c->conv_dim, KEEL_DT_BF16, INIT_NORMAL, 0, 0.02f);
    }
    fmt(q, sizeof q, "%s.dt_bias", pre);
    add_vec1(p, q, c->mamba_heads, KEEL_DT_BF16, INIT_DTBIAS, 0, 0);
    fmt(q, sizeof q, "%s.A_log", pre);
    add_vec1(p, q, c->mamba_heads, KEEL_DT_F32, INIT_ALOG, 0, 0);
    fmt(q, sizeof q, "%s.D", pre);
    add_vec1(p, q, c->mamba_heads, KEEL_DT_BF16, INIT_NORMAL, 1, 0.05f);
    fmt(q, sizeof q, "%s.norm.weight", pre);
    add_vec1(p, q, c->d_inner, KEEL_DT_BF16, INIT_NORMAL, 1, 0.05f);
    fmt(q, sizeof q, "%s.out_proj", pre);
    if ((rc = add_mat(p, q, 0, c->hidden, c->d_inner, w.bits, w.group, w.sdt, inv_sqrt(c->d_inner), err))) return rc;
    if (c->mamba_bias) {
        fmt(q, sizeof q, "%s.out_proj.bias", pre);
        add_vec1(p, q, c->hidden, KEEL_DT_BF16, INIT_NORMAL, 0, 0.02f);
    }
    return KEEL_OK;
}

static keel_code plan_model(plan *p, const keel_config *c, widths w, keel_err *err) {
    char pre[96];
    keel_code rc;
    if ((rc = add_mat(p, "backbone.embeddings", 0, c->vocab, c->hidden, w.bits, w.group, w.sdt, 1.0f, err))) return rc;
    for (int i = 0; i < c->n_layer; i++) {
        fmt(pre, sizeof pre, "backbone.layers.%d.norm.weight", i);
        add_vec1(p, pre, c->hidden, KEEL_DT_BF16, INIT_NORMAL, 1, 0.05f);
        fmt(pre, sizeof pre, "backbone.layers.%d.mixer", i);
        switch (c->pattern[i]) {
        case KEEL_MIXER_MAMBA: rc = plan_mamba(p, c, pre, w, err); break;
        case KEEL_MIXER_ATTN: rc = plan_attn(p, c, pre, w, err); break;
        case KEEL_MIXER_MLP: rc = plan_mlp(p, pre, c->hidden, c->mlp_inter, w, err); break;
        default: rc = plan_moe(p, c, pre, w, err); break;
        }
        if (rc) return rc;
    }
    add_vec1(p, "backbone.norm_f.weight", c->hidden, KEEL_DT_BF16, INIT_NORMAL, 1, 0.05f);
    if (!c->tie_embeddings)
        rc = add_mat(p, "lm_head", 0, c->vocab, c->hidden, w.bits, w.group, w.sdt, inv_sqrt(c->hidden), err);
    return rc;
}

static keel_code plan_mtp(plan *p, const keel_config *c, widths w, keel_err *err) {
    keel_code rc;
    add_vec1(p, "layers.0.enorm.weight", c->hidden, KEEL_DT_BF16, INIT_NORMAL, 1, 0.05f);
    add_vec1(p, "layers.0.hnorm.weight", c->hidden, KEEL_DT_BF16, INIT_NORMAL, 1, 0.05f);
    if ((rc = add_mat(p, "layers.0.eh_proj", 0, c->hidden, 2 * c->hidden, w.bits, w.group, w.sdt,
                      inv_sqrt(2 * c->hidden), err)))
        return rc;
    add_vec1(p, "layers.0.norm.weight", c->hidden, KEEL_DT_BF16, INIT_NORMAL, 1, 0.05f);
    if ((rc = plan_attn(p, c, "layers.0.mixer", w, err))) return rc;
    add_vec1(p, "layers.1.norm.weight", c->hidden, KEEL_DT_BF16, INIT_NORMAL, 1, 0.05f);
    if ((rc = plan_moe(p, c, "layers.1.mixer", w, err))) return rc;
    add_vec1(p, "layers.1.final_layernorm.weight", c->hidden, KEEL_DT_BF16, INIT_NORMAL, 1, 0.05f);
    return KEEL_OK;
}

static void plan_free(plan *p) {
    free(p->t);
    free(p->j);
    memset(p, 0, sizeof *p);
}

/* ---- random numbers: counter-based, value i of a job = f(seed, job path, i) ------------------------------ */

#define SYNTH_GOLDEN 0x9e3779b97f4a7c15ull

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t fnv1a(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

/* Element i of a job is mix64(k + (i + 1) * golden), k = mix64(seed ^ fnv1a(path)): splitmix64 at a counter. */
static uint64_t job_key(uint64_t seed, const gjob *j) { return mix64(seed ^ fnv1a(j->path)) + SYNTH_GOLDEN; }

/* Wider vectors where the CPU has them: the 64-bit multiplies of mix64 dominate generation. */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define SYNTH_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#endif
#endif
#ifndef SYNTH_CLONES
#define SYNTH_CLONES
#endif

/* Normal values: Irwin-Hall, four 16-bit uniforms of one hash summed, centred and scaled to unit variance. */
SYNTH_CLONES static void gen_normal(uint64_t key, uint64_t base, size_t n, float mean, float std, float *out) {
    const float k = 1.7320508f / 65536.0f;
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        uint64_t h = mix64(key + (base + i) * SYNTH_GOLDEN);
        int32_t s = (int32_t)(h & 0xffff) + (int32_t)((h >> 16) & 0xffff) + (int32_t)((h >> 32) & 0xffff) +
                    (int32_t)(h >> 48);
        float z = (float)(s - 131070) * k; /* separate statements: no FMA contraction, same bytes on every CPU */
        float y = std * z;
        out[i] = mean + y;
    }
}

/* Elements [base, base + n) of job j into out: any split of a job into ranges gives the same values. */
static void gen_range(const gjob *j, uint64_t key, uint64_t base, size_t n, float *out) {
    if (j->init == INIT_NORMAL) {
        gen_normal(key, base, n, j->mean, j->std, out);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        double u = ((double)(mix64(key + (base + i) * SYNTH_GOLDEN) >> 11) + 0.5) * 0x1p-53; /* in (0, 1) */
        if (j->init == INIT_ALOG) {
            out[i] = (float)log(1.0 + 15.0 * u);
        } else {
            double dt = exp(log(0.001) + (log(0.1) - log(0.001)) * u);
            out[i] = (float)(dt + log(-expm1(-dt))); /* softplus(dt_bias) = dt */
        }
    }
}

static keel_code pwrite_all(int fd, const void *buf, size_t n, size_t off, const char *path, keel_err *err) {
    const uint8_t *p = buf;
    while (n) {
        ssize_t w = pwrite(fd, p, n, (off_t)off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return keel_err_set(err, KEEL_E_IO, "%s: write failed: %s", path, w < 0 ? strerror(errno) : "no space");
        p += w;
        n -= (size_t)w;
        off += (size_t)w;
    }
    return KEEL_OK;
}

/* A unit of work: rows [r0, r0 + nr) of one job, generated, quantized and written by one thread. */
typedef struct unit {
    int job;
    int64_t r0, nr;
} unit;

static size_t row_wbytes(const gjob *j) {
    return j->bits ? keel_quant_row_words(j->cols, j->bits) * 4 : (size_t)j->cols * keel_dtype_size(j->sdt);
}

static size_t row_sbytes(const gjob *j) { return j->bits ? (size_t)(j->cols / j->group) * keel_dtype_size(j->sdt) : 0; }

/* Splits every job into units of about SYNTH_UNIT_BYTES of output, so writes are large and threads stay busy. */
static unit *plan_units(const plan *p, int *n_out) {
    int n = 0, cap = 64;
    unit *u = keel_xmalloc((size_t)cap * sizeof *u);
    for (int i = 0; i < p->nj; i++) {
        const gjob *j = &p->j[i];
        int64_t per = KEEL_MAX(1, (int64_t)(SYNTH_UNIT_BYTES / (row_wbytes(j) + 2 * row_sbytes(j))));
        for (int64_t r0 = 0; r0 < j->rows; r0 += per) {
            if (n == cap) u = keel_xrealloc(u, (size_t)(cap *= 2) * sizeof *u);
            u[n++] = (unit){i, r0, KEEL_MIN(per, j->rows - r0)};
        }
    }
    *n_out = n;
    return u;
}

typedef struct tbuf {
    float *f;
    uint8_t *w, *s, *b;
    size_t nf, nw, ns, nb;
} tbuf;

static void *grow(void *p, size_t *cap, size_t need) {
    if (need <= *cap) return p;
    free(p);
    *cap = need;
    return keel_xmalloc(need);
}

/* One unit: rows in batches of about SYNTH_BATCH_FLOATS floats, quantized into the unit's buffers, then written
 * with one pwrite per tensor at its offset. */
static keel_code run_unit(const plan *p, const unit *u, uint64_t seed, int fd, size_t data0, const char *path,
                          tbuf *t, keel_err *err) {
    const gjob *j = &p->j[u->job];
    const uint64_t key = job_key(seed, j);
    const size_t cols = (size_t)j->cols, wrow = row_wbytes(j), srow = row_sbytes(j);
    const int64_t batch = KEEL_MIN(u->nr, KEEL_MAX(1, (int64_t)(SYNTH_BATCH_FLOATS / KEEL_MAX(cols, 1))));
    t->f = grow(t->f, &t->nf, (size_t)batch * cols * sizeof(float));
    t->w = grow(t->w, &t->nw, (size_t)u->nr * wrow);
    if (j->bits) {
        t->s = grow(t->s, &t->ns, (size_t)u->nr * srow);
        t->b = grow(t->b, &t->nb, (size_t)u->nr * srow);
    }
    for (int64_t r = 0; r < u->nr; r += batch) {
        int64_t nb = KEEL_MIN(batch, u->nr - r);
        gen_range(j, key, (uint64_t)(u->r0 + r) * cols, (size_t)nb * cols, t->f);
        if (j->bits) {
            keel_quant_quantize(t->f, (int)nb, j->cols, j->bits, j->group, j->sdt,
                                (uint32_t *)(t->w + (size_t)r * wrow), t->s + (size_t)r * srow,
                                t->b + (size_t)r * srow);
        } else {
            size_t n = (size_t)nb * cols, at = (size_t)r * cols;
            for (size_t i = 0; i < n; i++) keel_dtype_set_f32(j->sdt, t->w, at + i, t->f[i]);
        }
    }
    keel_code rc = pwrite_all(fd, t->w, (size_t)u->nr * wrow, data0 + p->t[j->tw].off + (size_t)u->r0 * wrow, path, err);
    if (!rc && j->bits)
        rc = pwrite_all(fd, t->s, (size_t)u->nr * srow, data0 + p->t[j->ts].off + (size_t)u->r0 * srow, path, err);
    if (!rc && j->bits)
        rc = pwrite_all(fd, t->b, (size_t)u->nr * srow, data0 + p->t[j->tb].off + (size_t)u->r0 * srow, path, err);
    return rc;
}

/* Every unit on keel_cpu_threads() threads in any order: values depend on indices only, so bytes never depend on
 * the thread count; each thread writes its own units, overlapping one thread's I/O with the others' compute. */
static keel_code run_jobs(const plan *p, uint64_t seed, int fd, size_t data0, const char *path, keel_err *err) {
    int nu = 0;
    unit *units = plan_units(p, &nu);
    keel_code rc = KEEL_OK;
#pragma omp parallel num_threads(keel_cpu_threads())
    {
        tbuf t = {0};
        keel_err e = {0};
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < nu; i++) {
            keel_code cur;
#pragma omp atomic read
            cur = rc;
            if (cur) continue;
            keel_code r = run_unit(p, &units[i], seed, fd, data0, path, &t, &e);
            if (r) {
#pragma omp critical(keel_synth_err)
                if (!rc) {
                    if (err) *err = e;
#pragma omp atomic write
                    rc = r;
                }
            }
        }
        free(t.f);
        free(t.w);
        free(t.s);
        free(t.b);
    }
    free(units);
    return rc;
}

static int cmp_name(const void *a, const void *b) {
    return strcmp(((const tspec *)a)->name, ((const tspec *)b)->name);
}

/* Writes the planned tensors to `path` through a temporary file: header first, then each job at its offsets. */
static keel_code write_st(plan *p, const char *path, const char *const *meta, int n_meta, uint64_t seed,
                          keel_err *err) {
    /* offsets in name order; jobs refer to tensors by name, so remap their indices after sorting */
    char **names = keel_xmalloc((size_t)p->nj * 3 * sizeof *names);
    for (int i = 0; i < p->nj; i++) {
        names[3 * i] = keel_xstrdup(p->t[p->j[i].tw].name);
        names[3 * i + 1] = p->j[i].ts >= 0 ? keel_xstrdup(p->t[p->j[i].ts].name) : NULL;
        names[3 * i + 2] = p->j[i].tb >= 0 ? keel_xstrdup(p->t[p->j[i].tb].name) : NULL;
    }
    qsort(p->t, (size_t)p->nt, sizeof *p->t, cmp_name);
    for (int i = 0; i < p->nj * 3; i++) {
        int *slot = i % 3 == 0 ? &p->j[i / 3].tw : i % 3 == 1 ? &p->j[i / 3].ts : &p->j[i / 3].tb;
        if (names[i]) {
            tspec key;
            fmt(key.name, sizeof key.name, "%s", names[i]);
            const tspec *t = bsearch(&key, p->t, (size_t)p->nt, sizeof *p->t, cmp_name);
            KEEL_ASSERT(t);
            *slot = (int)(t - p->t);
        }
        free(names[i]);
    }
    free(names);
    cJSON *h = cJSON_CreateObject();
    cJSON *md = cJSON_AddObjectToObject(h, "__metadata__");
    for (int i = 0; i < n_meta; i++) cJSON_AddStringToObject(md, meta[2 * i], meta[2 * i + 1]);
    size_t off = 0;
    for (int i = 0; i < p->nt; i++) {
        tspec *t = &p->t[i];
        t->off = off;
        off += t->nbytes;
        cJSON *e = cJSON_AddObjectToObject(h, t->name);
        cJSON_AddStringToObject(e, "dtype", keel_dtype_name(t->dt));
        cJSON *sh = cJSON_AddArrayToObject(e, "shape");
        for (int d = 0; d < t->ndim; d++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->shape[d]));
        cJSON *o = cJSON_AddArrayToObject(e, "data_offsets");
        cJSON_AddItemToArray(o, cJSON_CreateNumber((double)t->off));
        cJSON_AddItemToArray(o, cJSON_CreateNumber((double)(t->off + t->nbytes)));
    }
    char *hs = cJSON_PrintUnformatted(h);
    cJSON_Delete(h);
    size_t hl = strlen(hs), hpad = (hl + 7) / 8 * 8;
    uint8_t *head = keel_xmalloc(8 + hpad);
    uint64_t hlen = hpad;
    for (int i = 0; i < 8; i++) head[i] = (uint8_t)(hlen >> (8 * i));
    memcpy(head + 8, hs, hl);
    memset(head + 8 + hl, ' ', hpad - hl);
    free(hs);

    size_t tn = strlen(path) + 32;
    char *tmp = keel_xmalloc(tn);
    snprintf(tmp, tn, "%s.tmp.%ld", path, (long)getpid());
    keel_code rc = KEEL_OK;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        rc = keel_err_set(err, KEEL_E_IO, "%s: cannot create: %s", tmp, strerror(errno));
    } else {
        rc = pwrite_all(fd, head, 8 + hpad, 0, tmp, err);
        if (!rc && ftruncate(fd, (off_t)(8 + hpad + off)))
            rc = keel_err_set(err, KEEL_E_IO, "%s: cannot size to %zu bytes: %s", tmp, 8 + hpad + off, strerror(errno));
        if (!rc) rc = run_jobs(p, seed, fd, 8 + hpad, tmp, err);
        if (!rc && fsync(fd)) rc = keel_err_set(err, KEEL_E_IO, "%s: fsync failed: %s", tmp, strerror(errno));
        if (close(fd) && !rc) rc = keel_err_set(err, KEEL_E_IO, "%s: close failed: %s", tmp, strerror(errno));
        if (!rc && rename(tmp, path)) rc = keel_err_set(err, KEEL_E_IO, "%s: cannot rename to %s: %s", tmp, path, strerror(errno));
        if (rc) unlink(tmp);
    }
    free(tmp);
    free(head);
    return rc;
}

/* ---- small files ---------------------------------------------------------------------------------------- */

static keel_code write_text(const char *path, const char *text, keel_err *err) {
    size_t tn = strlen(path) + 32;
    char *tmp = keel_xmalloc(tn);
    snprintf(tmp, tn, "%s.tmp.%ld", path, (long)getpid());
    keel_code rc = KEEL_OK;
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        rc = keel_err_set(err, KEEL_E_IO, "%s: cannot create: %s", tmp, strerror(errno));
    } else {
        size_t n = strlen(text);
        bool bad = fwrite(text, 1, n, f) != n || fflush(f) || fsync(fileno(f));
        if (fclose(f) || bad) rc = keel_err_set(err, KEEL_E_IO, "%s: write failed", tmp);
        if (!rc && rename(tmp, path)) rc = keel_err_set(err, KEEL_E_IO, "%s: cannot rename to %s: %s", tmp, path, strerror(errno));
        if (rc) unlink(tmp);
    }
    free(tmp);
    return rc;
}

static void utf8(unsigned cp, char *out) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
    } else if (cp < 0x800) {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        out[2] = 0;
    } else {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        out[3] = 0;
    }
}

/* A byte-level BPE tokenizer.json: <unk> <s> </s>, the 256 byte tokens in GPT-2's byte-to-unicode mapping, pair
 * merges in a rough English-frequency order, then unreachable padding tokens up to vocab_size. */
static char *tokenizer_json(int vocab) {
    char tok[256][4];
    int order_bytes[256], nb = 0;
    bool seen[256] = {false};
    int n_extra = 0;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        utf8(printable ? (unsigned)b : 256u + (unsigned)n_extra++, tok[b]);
        if (printable) order_bytes[nb++] = b; /* GPT-2 order: printable bytes first */
    }
    for (int b = 0; b < 256; b++)
        if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))) order_bytes[nb++] = b;
    /* merge priority: frequent characters first */
    const char *freq = " etaoinsrhldcumfpgwybvkxjqzETAOINSRHLDCUMFPGWYBVKXJQZ0123456789.,'\"-\n:;!?()";
    int rank[256], nr = 0;
    for (const char *s = freq; *s; s++)
        if (!seen[(uint8_t)*s]) seen[(uint8_t)*s] = true, rank[nr++] = (uint8_t)*s;
    for (int b = 0; b < 256; b++)
        if (!seen[b]) rank[nr++] = b;

    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "version", "1.0");
    cJSON_AddNullToObject(root, "truncation");
    cJSON_AddNullToObject(root, "padding");
    cJSON *added = cJSON_AddArrayToObject(root, "added_tokens");
    const char *special[3] = {"<unk>", "<s>", "</s>"};
    for (int i = 0; i < 3; i++) {
        cJSON *a = cJSON_CreateObject();
        cJSON_AddNumberToObject(a, "id", i);
        cJSON_AddStringToObject(a, "content", special[i]);
        cJSON_AddBoolToObject(a, "single_word", false);
        cJSON_AddBoolToObject(a, "lstrip", false);
        cJSON_AddBoolToObject(a, "rstrip", false);
        cJSON_AddBoolToObject(a, "normalized", false);
        cJSON_AddBoolToObject(a, "special", true);
        cJSON_AddItemToArray(added, a);
    }
    cJSON_AddNullToObject(root, "normalizer");
    cJSON *pre = cJSON_AddObjectToObject(root, "pre_tokenizer");
    cJSON_AddStringToObject(pre, "type", "Sequence");
    cJSON *pres = cJSON_AddArrayToObject(pre, "pretokenizers");
    cJSON *split = cJSON_CreateObject();
    cJSON_AddStringToObject(split, "type", "Split");
    cJSON *pat = cJSON_AddObjectToObject(split, "pattern");
    cJSON_AddStringToObject(pat, "Regex", "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+");
    cJSON_AddStringToObject(split, "behavior", "Isolated");
    cJSON_AddBoolToObject(split, "invert", false);
    cJSON_AddItemToArray(pres, split);
    cJSON *bl = cJSON_CreateObject();
    cJSON_AddStringToObject(bl, "type", "ByteLevel");
    cJSON_AddBoolToObject(bl, "add_prefix_space", false);
    cJSON_AddBoolToObject(bl, "trim_offsets", true);
    cJSON_AddBoolToObject(bl, "use_regex", false);
    cJSON_AddItemToArray(pres, bl);
    cJSON_AddNullToObject(root, "post_processor");
    cJSON *dec = cJSON_AddObjectToObject(root, "decoder");
    cJSON_AddStringToObject(dec, "type", "ByteLevel");
    cJSON_AddBoolToObject(dec, "add_prefix_space", true);
    cJSON_AddBoolToObject(dec, "trim_offsets", true);
    cJSON_AddBoolToObject(dec, "use_regex", true);
    cJSON *model = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddNullToObject(model, "dropout");
    cJSON_AddNullToObject(model, "unk_token");
    cJSON_AddNullToObject(model, "continuing_subword_prefix");
    cJSON_AddNullToObject(model, "end_of_word_suffix");
    cJSON_AddBoolToObject(model, "fuse_unk", false);
    cJSON_AddBoolToObject(model, "byte_fallback", false);
    cJSON_AddBoolToObject(model, "ignore_merges", false);
    cJSON *vo = cJSON_AddObjectToObject(model, "vocab");
    cJSON *merges = cJSON_AddArrayToObject(model, "merges");
    int id = 0;
    for (int i = 0; i < 3; i++) cJSON_AddNumberToObject(vo, special[i], id++);
    for (int i = 0; i < 256; i++) cJSON_AddNumberToObject(vo, tok[order_bytes[i]], id++);
    /* pairs (a, b) by the rarer of the two ranks, so that frequent pairs merge first */
    for (int hi = 0; hi < 256 && id < vocab; hi++)
        for (int k = 0; k <= 2 * hi && id < vocab; k++) {
            int a = k <= hi ? k : hi, b = k <= hi ? hi : k - hi - 1; /* (0..hi, hi) then (hi, 0..hi-1) */
            char m[8];
            snprintf(m, sizeof m, "%s%s", tok[rank[a]], tok[rank[b]]);
            cJSON_AddNumberToObject(vo, m, id++);
            cJSON *pr = cJSON_CreateArray();
            cJSON_AddItemToArray(pr, cJSON_CreateString(tok[rank[a]]));
            cJSON_AddItemToArray(pr, cJSON_CreateString(tok[rank[b]]));
            cJSON_AddItemToArray(merges, pr);
        }
    for (int k = 0; id < vocab; k++) {
        char pad[32];
        snprintf(pad, sizeof pad, "<|pad_%d|>", k);
        cJSON_AddNumberToObject(vo, pad, id++);
    }
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    return s;
}

/* config.json: the input config with its quantization (and the legacy copy mlx-lm also writes). */
static char *config_json(const char *in, const keel_synth_opts *o) {
    cJSON *root = cJSON_Parse(in);
    KEEL_ASSERT(root); /* parsed by keel_config_parse already */
    cJSON_DeleteItemFromObjectCaseSensitive(root, "quantization");
    cJSON_DeleteItemFromObjectCaseSensitive(root, "quantization_config");
    for (int i = 0; i < 2; i++) {
        cJSON *q = cJSON_AddObjectToObject(root, i ? "quantization_config" : "quantization");
        cJSON_AddNumberToObject(q, "group_size", o->group);
        cJSON_AddNumberToObject(q, "bits", o->bits);
        cJSON_AddStringToObject(q, "mode", "affine");
    }
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    return s;
}

keel_code keel_synth_write(const char *config_json_text, const char *out_dir, const keel_synth_opts *o,
                           keel_err *err) {
    if (!keel_quant_bits_ok(o->bits))
        return keel_err_set(err, KEEL_E_ARG, "synth: bits %d: expected 2, 3, 4, 5, 6 or 8", o->bits);
    if (!keel_quant_group_ok(o->group))
        return keel_err_set(err, KEEL_E_ARG, "synth: group %d: expected 32, 64 or 128", o->group);
    if (o->sdt != KEEL_DT_BF16 && o->sdt != KEEL_DT_F16 && o->sdt != KEEL_DT_F32)
        return keel_err_set(err, KEEL_E_ARG, "synth: scale dtype %s: expected BF16, F16 or F32", keel_dtype_name(o->sdt));
    if (o->mtp_bits && !keel_quant_bits_ok(o->mtp_bits))
        return keel_err_set(err, KEEL_E_ARG, "synth: MTP bits %d: expected 2, 3, 4, 5, 6 or 8", o->mtp_bits);
    keel_config cfg;
    keel_code rc = keel_config_parse(&cfg, config_json_text, "synth config", err);
    if (rc) return rc;
    if (cfg.vocab < 259)
        return keel_err_set(err, KEEL_E_ARG,
                            "synth config: field vocab_size: %d is below the 259 tokens of a byte-level tokenizer "
                            "(3 special + 256 bytes)",
                            cfg.vocab);
    if (o->mtp_bits && (!cfg.n_head || !cfg.n_experts))
        return keel_err_set(err, KEEL_E_MISSING,
                            "synth config: field %s is missing (an MTP head has an attention and a MoE layer)",
                            !cfg.n_head ? "num_attention_heads" : "n_routed_experts");
    plan pm = {0}, pt = {0};
    widths wm = {o->bits, o->group, o->sdt}, wt = {o->mtp_bits, 64, o->sdt};
    rc = plan_model(&pm, &cfg, wm, err);
    if (!rc && o->mtp_bits) rc = plan_mtp(&pt, &cfg, wt, err);
    if (!rc && mkdir(out_dir, 0755) && errno != EEXIST)
        rc = keel_err_set(err, KEEL_E_IO, "%s: cannot create directory: %s", out_dir, strerror(errno));
    char *cpath = path_join(out_dir, "config.json"), *mpath = path_join(out_dir, "model.safetensors"),
         *tpath = path_join(out_dir, "tokenizer.json"), *tcpath = path_join(out_dir, "tokenizer_config.json"),
         *xpath = path_join(out_dir, "mtp.safetensors");
    if (!rc) {
        const char *meta[2] = {"format", "mlx"};
        rc = write_st(&pm, mpath, meta, 1, o->seed, err);
    }
    if (!rc && o->mtp_bits) {
        char q[64];
        snprintf(q, sizeof q, "{\"group_size\": 64, \"bits\": %d}", o->mtp_bits);
        const char *meta[4] = {"format", "nemotron-h-mtp", "quantization", q};
        rc = write_st(&pt, xpath, meta, 2, o->seed ^ 0x6d7470ull, err);
    } else if (!rc && unlink(xpath) && errno != ENOENT) {
        rc = keel_err_set(err, KEEL_E_IO, "%s: cannot remove a stale MTP head: %s", xpath, strerror(errno));
    }
    if (!rc) {
        char *s = tokenizer_json(cfg.vocab);
        rc = write_text(tpath, s, err);
        free(s);
    }
    if (!rc)
        rc = write_text(tcpath,
                        "{\n  \"bos_token\": \"<s>\",\n  \"eos_token\": \"</s>\",\n  \"unk_token\": \"<unk>\",\n"
                        "  \"add_bos_token\": false\n}\n",
                        err);
    if (!rc) {
        char *s = config_json(config_json_text, o);
        rc = write_text(cpath, s, err);
        free(s);
    }
    free(cpath);
    free(mpath);
    free(tpath);
    free(tcpath);
    free(xpath);
    plan_free(&pm);
    plan_free(&pt);
    return rc;
}
