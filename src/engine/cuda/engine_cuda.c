/* engine/cuda: the Nemotron-H forward on the GPU, prompt and decode, the MTP head and generation.
 *
 * Weights: every safetensors shard (model and MTP head) is uploaded once, packed as stored, into one device
 * allocation; a host pointer into a mapping becomes base + its offset. The packed tile's copies of the matrices it
 * serves (pk_plan) follow the shards in that allocation. State and scratch: a second allocation.
 * Tokens go through in windows of up to 8 rows (the stream tiles' rows); every kernel gives a row the same bits
 * whatever window it is in, and routed tiles launch one row at a time (their k-split depends on the item count),
 * so a prompt and one-token decodes agree bit for bit. Activations into the tiles are bf16 (or, in fp32 mode, every
 * matrix goes through the fp32 matvec); the residual stream, the Mamba state and the KV cache (fp32: it keeps the
 * projections as computed, and Nemotron-H's few 2-head attention layers make it small) stay fp32. */
#ifdef KEEL_HAVE_CUDA
#include <math.h>
#include <stdlib.h>

#include "../engine.h"
#include "ecuda.h"

#define WIN KEEL_CUDA_STREAM_MAX_ROWS /* rows of an exact window (each row's bits as alone) */
#define ROWS 64                       /* rows of a prompt chunk (chunked Mamba scan; within bound of stepping) */
#define PROF_PAIRS 4096
#define MARGIN_BYTES ((size_t)512 << 20) /* CUDA context, stream-tile partials, allocator slack */

typedef struct dmamba {
    keel_cuda_qw in_proj, out_proj;
    keel_ecu_vec in_bias, conv_w, conv_b, dt_bias, A_log, D, norm, out_bias;
} dmamba;

typedef struct dattn {
    keel_cuda_qw q, k, v, o;
    keel_ecu_vec qb, kb, vb, ob;
} dattn;

typedef struct dmlp {
    keel_cuda_qw up, down;
} dmlp;

typedef struct dmoe {
    keel_cuda_qw gate, fc1, fc2;
    keel_ecu_vec corr;
    dmlp shared;
} dmoe;

typedef struct dlayer {
    keel_mixer kind;
    keel_ecu_vec norm;
    dmamba mamba;
    dattn attn;
    dmlp mlp;
    dmoe moe;
} dlayer;

typedef struct region {
    const uint8_t *host;
    size_t size;
    uint8_t *dev;
    size_t pad; /* bytes before the shard on the device, so that its data section starts 256-byte aligned */
} region;

struct keel_cuda_engine {
    const keel_model *model;
    const keel_config *cfg;
    int max_ctx, pos, mtp_pos, window;
    int n_mamba, n_attn, *slot;
    region reg[64];
    int n_reg;
    void *weights, *arena;
    size_t weight_bytes, arena_bytes;
    keel_cuda_qw embed, lm_head;
    keel_ecu_vec norm_f;
    dlayer *layers;
    struct {
        keel_ecu_vec enorm, hnorm, norm0, norm1, final_norm;
        keel_cuda_qw eh_proj;
        dattn attn;
        dmoe moe;
    } mtp;
    void *st;      /* the engine's stream: every launch, copy and graph capture */
    void *side;    /* a second stream for a layer's independent launches, forked from and joined to st */
    void *fork, *join; /* events: side waits for st's fork; st waits for side's join */
    int side_mode; /* keel_cuda_engine_set_side */
    bool fused_router; /* keel_cuda_engine_set_fused_router */
    bool fused_mamba;  /* keel_cuda_engine_set_fused_mamba */
    bool packed;       /* keel_cuda_engine_set_packed */
    int n_pk;
    struct pk_copy {           /* a packed copy: planned before the allocation (pk_plan), bound after it (pk_bind) */
        const keel_qmat *src;  /* the host matrix */
        const uint32_t *w;     /* its ring-layout codes on the device: the key mm() looks it up by */
        size_t off, bytes;     /* where in the packed part of the weight allocation */
        keel_cuda_pw pw;
    } *pk; /* (n_pk) */
    bool route_window; /* keel_cuda_engine_set_route_window */
    bool fused_norm;   /* keel_cuda_engine_set_fused_norm */
    struct {           /* the add and norm the next layer's launches take in (run_window) */
        bool on;
        const float *a, *b;
        const keel_ecu_vec *bias, *w;
    } pend;
    unsigned *mcnt;    /* (n_groups) the fused Mamba step's arrival counters, zero between launches */
    void *graph;   /* the captured one-token decode step, or NULL */
    bool graphs;   /* decode steps replay the captured graph (on by default) */
    bool warm;     /* one eager step has run: every launch's attributes and scratch are in place */
    int start;     /* generate's first position (benchmarks of long-context decode; 0 normally) */
    int prompt_rows; /* rows per chunk of generate's prompt (ROWS: the chunked scan; <= WIN: exact windows) */
    keel_sampler_cfg graph_cfg; /* the draw the captured step ends with */
    unsigned graph_epoch;       /* the stream tiles' scratch epoch at the capture */
    int *hpin;     /* (4) page-locked: the step's position and the next, the sampled token */
    /* device state and scratch */
    float *conv, *ssm, *kc, *vc, *mtp_k, *mtp_v;
    int *tok, *sel;
    int *dpos;     /* (4) the window's first position, the position after it, the MTP head's position */
    float *kn, *vn;        /* (WIN, kvd) this window's k and v before they enter the cache */
    float *ascratch;       /* attention's split-K partials */
    void *sscratch;        /* the sampler's scratch */
    float *x;                   /* (ROWS, hidden) the residual: one of xr[2], the other the next layer's */
    float *xr[2];
    float *xnf, *mix, *mix2, *proj, *xbc, *ymid, *router, *rweights, *logits, *hin, *catf;
    float *midf, *hexpf, *yexp; /* fp32 activations mode */
    bool f32;                   /* activations into the matrices in fp32 (the fp32 matvec) instead of bf16 tiles */
    uint16_t *xnb, *midb, *hexp, *catb;
    keel_cuda_route *items, *items1; /* routed items: per 8-row group's union; one row's own (the router's) */
    float *rw1;                      /* (ROWS*K*8) the router's one-row weights */
    int wide, midw;
    /* profiling */
    bool prof;
    void *ev[2 * PROF_PAIRS];
    int ev_fam[PROF_PAIRS], n_ev;
    double fam_ms[KEEL_CUF_N];
    long fam_n[KEEL_CUF_N];
};

const char *keel_cuda_family_name(keel_cuda_family f) {
    static const char *const names[KEEL_CUF_N] = {"embed", "norm+residual", "projections (stream tiles)",
                                                  "mamba conv+scan", "attention", "router", "routed experts",
                                                  "lm_head", "sampling"};
    return f >= 0 && f < KEEL_CUF_N ? names[f] : "?";
}

/* ---- profiling ---- */

static void prof_flush(keel_cuda_engine *e) {
    for (int i = 0; i < e->n_ev; i++) {
        e->fam_ms[e->ev_fam[i]] += keel_ecu_event_ms(e->ev[2 * i], e->ev[2 * i + 1]);
        e->fam_n[e->ev_fam[i]]++;
    }
    e->n_ev = 0;
}

static void fam_begin(keel_cuda_engine *e, int fam) {
    if (!e->prof) return;
    if (e->n_ev == PROF_PAIRS) prof_flush(e);
    e->ev_fam[e->n_ev] = fam;
    keel_ecu_event_record(e->ev[2 * e->n_ev], e->st);
}

static void fam_end(keel_cuda_engine *e) {
    if (!e->prof) return;
    keel_ecu_event_record(e->ev[2 * e->n_ev + 1], e->st);
    e->n_ev++;
}

void keel_cuda_engine_profile(keel_cuda_engine *e, bool on) {
    if (on && !e->ev[0])
        for (int i = 0; i < 2 * PROF_PAIRS; i++) e->ev[i] = keel_ecu_event_new();
    if (e->prof) prof_flush(e);
    if (e->prof && !on) e->warm = false; /* profiled steps ran one stream: warm the side stream's scratch again */
    e->prof = on;
    memset(e->fam_ms, 0, sizeof e->fam_ms);
    memset(e->fam_n, 0, sizeof e->fam_n);
}

void keel_cuda_engine_profile_get(const keel_cuda_engine *e, double ms[KEEL_CUF_N], long launches[KEEL_CUF_N]) {
    if (e->prof) prof_flush((keel_cuda_engine *)e);
    for (int i = 0; i < KEEL_CUF_N; i++) {
        ms[i] = e->fam_ms[i];
        launches[i] = e->fam_n[i];
    }
}

/* ---- binding weights to the device ---- */

static const void *tr(const keel_cuda_engine *e, const void *host) {
    if (!host) return NULL;
    const uint8_t *h = host;
    for (int i = 0; i < e->n_reg; i++)
        if (h >= e->reg[i].host && h < e->reg[i].host + e->reg[i].size) return e->reg[i].dev + (h - e->reg[i].host);
    KEEL_ASSERTF(0, "a weight pointer outside every mapped shard");
    return NULL;
}

static keel_ecu_vec dvec(const keel_cuda_engine *e, const keel_vec *v) {
    keel_ecu_vec d = {v->n ? tr(e, v->data) : NULL, v->dt, v->n};
    return d;
}

static keel_cuda_qw dmat(const keel_cuda_engine *e, const keel_qmat *m) {
    keel_cuda_qw q = {tr(e, m->w), tr(e, m->scales), tr(e, m->biases), m->n, m->k, m->bits, m->group, m->sdt, 0, 0, 0};
    return q;
}

static keel_cuda_qw dstack(const keel_cuda_engine *e, const keel_qstack *s) {
    keel_cuda_qw q = dmat(e, &s->m);
    q.expert_words = (int64_t)(s->w_stride / sizeof(uint32_t));
    q.expert_groups = (int64_t)(s->s_stride / keel_dtype_size(s->m.sdt));
    q.items = KEEL_MAX(e->cfg->top_k, 1); /* a routed launch brings at least one token's top-k experts */
    return q;
}

/* ---- packed copies (the packed stream tile, src/kernels/cuda/packed.cu) ---- */

static int g_pack_scope = KEEL_CUDA_ENGINE_PACK_LARGE; /* keel_cuda_engine_pack_scope, read by init */

void keel_cuda_engine_pack_scope(int scope) {
    g_pack_scope = scope == KEEL_CUDA_ENGINE_PACK_ALL ? scope : KEEL_CUDA_ENGINE_PACK_LARGE;
}

/* Bytes rounded up to the 256-byte alignment every tensor of the weight allocation starts on. */
static size_t al256(size_t b) { return (b + 255u) & ~(size_t)255u; }

/* The bytes of m's packed copy where the packed tile computes it with the ring tile's bits (BF16 scales, a
 * packable shape, neither tile splitting k) and, unless the scope is every such matrix, faster: a row tile for every
 * warp of a full grid (16 warps an SM); else 0. */
static size_t pk_eligible(const keel_qmat *m) {
    const size_t b = m->w && keel_cuda_pack_scales_ok(m->sdt)
                         ? keel_cuda_pack_bytes(m->n, m->k, m->bits, m->group) : 0;
    return b && keel_cuda_stream_splits(m->n, m->k, 0) == 1 && keel_cuda_packed_splits(m->n, m->k) == 1 &&
                   (g_pack_scope == KEEL_CUDA_ENGINE_PACK_ALL || (m->n + 15) / 16 >= 16 * keel_cuda_sm_count())
               ? b : 0;
}

/* Plans a packed copy of every eligible plain (not stacked) matrix that mm() launches, of the model and its MTP
 * head, into e->pk; returns their device bytes (each 256-byte aligned). */
static size_t pk_plan(keel_cuda_engine *e) {
    const keel_model *m = e->model;
    e->pk = keel_xcalloc((size_t)(1 + 4 * m->cfg.n_layer + 7), sizeof *e->pk); /* lm_head, 4 a layer, 7 of the head */
    size_t off = 0;
#define PK_ADD(q)                                                                                                  \
    do {                                                                                                           \
        const size_t b_ = pk_eligible(q);                                                                          \
        if (b_) e->pk[e->n_pk++] = (struct pk_copy){.src = (q), .off = off, .bytes = b_}, off += al256(b_);       \
    } while (0)
    PK_ADD(&m->lm_head);
    for (int l = 0; l < m->cfg.n_layer; l++) {
        const keel_layer *L = &m->layers[l];
        switch (L->kind) {
        case KEEL_MIXER_MAMBA: PK_ADD(&L->mamba.in_proj); PK_ADD(&L->mamba.out_proj); break;
        case KEEL_MIXER_ATTN: PK_ADD(&L->attn.q); PK_ADD(&L->attn.k); PK_ADD(&L->attn.v); PK_ADD(&L->attn.o); break;
        case KEEL_MIXER_MLP: PK_ADD(&L->mlp.up); PK_ADD(&L->mlp.down); break;
        case KEEL_MIXER_MOE: PK_ADD(&L->moe.shared.up); PK_ADD(&L->moe.shared.down); break;
        }
    }
    if (m->has_mtp) {
        const keel_mtp_w *w = &m->mtp;
        PK_ADD(&w->eh_proj); PK_ADD(&w->attn.q); PK_ADD(&w->attn.k); PK_ADD(&w->attn.v); PK_ADD(&w->attn.o);
        PK_ADD(&w->moe.shared.up); PK_ADD(&w->moe.shared.down);
    }
#undef PK_ADD
    return off;
}

/* Packs and uploads the planned copies into base (the packed part of the weight allocation), after the ring layout
 * is bound (each copy is keyed by the ring layout's device codes). */
static void pk_bind(keel_cuda_engine *e, uint8_t *base) {
    size_t most = 0;
    for (int i = 0; i < e->n_pk; i++) most = KEEL_MAX(most, e->pk[i].bytes);
    void *host = most ? keel_xmalloc(most) : NULL;
    for (int i = 0; i < e->n_pk; i++) {
        struct pk_copy *c = &e->pk[i];
        const keel_qmat *q = c->src;
        char why[256];
        /* tile-major: eligible matrices never split k, and the unsplit walk takes that layout */
        KEEL_ASSERTF(keel_cuda_pack(q, false, host, c->bytes, why, sizeof why), "packing an eligible matrix: %s", why);
        keel_cuda_upload(base + c->off, host, c->bytes);
        c->w = tr(e, q->w);
        c->pw = (keel_cuda_pw){base + c->off, q->n, q->k, q->bits, q->group, q->sdt, false};
    }
    free(host);
}

/* The packed copy of W (bound by pk_bind), or NULL. */
static const keel_cuda_pw *pk_find(const keel_cuda_engine *e, const keel_cuda_qw *W) {
    for (int i = 0; i < e->n_pk; i++)
        if (e->pk[i].w == W->w) return &e->pk[i].pw;
    return NULL;
}

static void bind_attn(const keel_cuda_engine *e, const keel_attn_w *w, dattn *d) {
    d->q = dmat(e, &w->q), d->k = dmat(e, &w->k), d->v = dmat(e, &w->v), d->o = dmat(e, &w->o);
    d->qb = dvec(e, &w->q_bias), d->kb = dvec(e, &w->k_bias), d->vb = dvec(e, &w->v_bias), d->ob = dvec(e, &w->o_bias);
}

static void bind_moe(const keel_cuda_engine *e, const keel_moe_w *w, dmoe *d) {
    d->gate = dmat(e, &w->gate);
    d->corr = dvec(e, &w->corr_bias);
    d->fc1 = dstack(e, &w->fc1);
    d->fc2 = dstack(e, &w->fc2);
    d->shared.up = dmat(e, &w->shared.up);
    d->shared.down = dmat(e, &w->shared.down);
}

static keel_code add_regions(keel_cuda_engine *e, const keel_st *st, keel_err *err) {
    for (int i = 0; i < st->n_shards; i++) {
        if (!st->shards[i].map || !st->shards[i].size) continue;
        if (e->n_reg == (int)(sizeof e->reg / sizeof e->reg[0]))
            return keel_err_set(err, KEEL_E_UNSUPPORTED, "model %s: more than %d shards", e->model->dir, e->n_reg);
        /* the data section 256-byte aligned, so that tensors at 16-byte offsets in it get the stream tiles' 16-byte
         * copies */
        const size_t pad = (256u - st->shards[i].data_off % 256u) % 256u;
        e->reg[e->n_reg++] = (region){st->shards[i].map, st->shards[i].size, NULL, pad};
    }
    return KEEL_OK;
}

/* Shapes the kernels do not take are refused here, by name. */
static keel_code check_shapes(const keel_model *m, keel_err *err) {
    const keel_config *g = &m->cfg;
    const bool moe = strchr(g->pattern, KEEL_MIXER_MOE) != NULL || m->has_mtp;
    if (g->hidden % 2)
        return keel_err_set(err, KEEL_E_UNSUPPORTED, "model %s: hidden_size %d: the CUDA engine needs it even", m->dir,
                            g->hidden);
    if (strchr(g->pattern, KEEL_MIXER_MAMBA) &&
        (g->conv_kernel < 1 || g->conv_kernel > 8 || g->ssm_state > 256 || g->n_groups < 1 ||
         g->mamba_heads % g->n_groups || g->d_inner % 2))
        return keel_err_set(err, KEEL_E_UNSUPPORTED,
                            "model %s: Mamba conv_kernel %d, ssm_state %d, %d heads in %d groups: the CUDA engine takes "
                            "conv_kernel 1..8, ssm_state up to 256 and heads divisible by groups", m->dir,
                            g->conv_kernel, g->ssm_state, g->mamba_heads, g->n_groups);
    if ((strchr(g->pattern, KEEL_MIXER_ATTN) || m->has_mtp) &&
        (g->head_dim > 256 || g->n_kv_head < 1 || g->n_head % g->n_kv_head || (g->n_head * g->head_dim) % 2))
        return keel_err_set(err, KEEL_E_UNSUPPORTED,
                            "model %s: attention head_dim %d with %d query / %d KV heads: the CUDA engine takes head_dim "
                            "up to 256 and query heads a multiple of KV heads", m->dir, g->head_dim, g->n_head,
                            g->n_kv_head);
    if (moe && (g->n_experts < 1 || g->n_experts > 1024 || g->top_k < 1 || g->top_k > 64 || g->top_k > g->n_experts ||
                g->n_group > 64 || (g->n_group > 1 && g->n_experts % g->n_group)))
        return keel_err_set(err, KEEL_E_UNSUPPORTED,
                            "model %s: %d experts top %d in %d groups: the CUDA engine takes 1..1024 experts, top_k "
                            "1..64 and up to 64 groups", m->dir, g->n_experts, g->top_k, g->n_group);
    for (int l = 0; l < g->n_layer; l++) {
        const keel_layer *L = &m->layers[l];
        if (L->kind == KEEL_MIXER_MOE && (L->moe.fc1.m.bits == 0 || L->moe.fc2.m.bits == 0))
            return keel_err_set(err, KEEL_E_UNSUPPORTED,
                                "model %s: layer %d's routed experts are float: the CUDA engine's routed tiles read "
                                "quantized experts", m->dir, l);
    }
    if (m->has_mtp && (m->mtp.moe.fc1.m.bits == 0 || m->mtp.moe.fc2.m.bits == 0))
        return keel_err_set(err, KEEL_E_UNSUPPORTED, "model %s: the MTP head's routed experts are float", m->dir);
    return KEEL_OK;
}

/* ---- state and scratch ---- */

typedef struct carve {
    uint8_t *base;
    size_t off;
} carve;

static void *take(carve *c, size_t bytes) {
    c->off = al256(c->off);
    void *p = c->base ? c->base + c->off : NULL;
    c->off += bytes;
    return p;
}

static void layout(keel_cuda_engine *e, carve *c) {
    const keel_config *g = e->cfg;
    const size_t H = (size_t)g->hidden, fl = sizeof(float), bf = sizeof(uint16_t), ctx = (size_t)e->max_ctx;
    const size_t kvd = (size_t)g->n_kv_head * (size_t)g->head_dim, K = (size_t)KEEL_MAX(g->top_k, 1);
    const size_t E = (size_t)KEEL_MAX(g->n_experts, 1);
    e->conv = take(c, (size_t)e->n_mamba * (size_t)KEEL_MAX(g->conv_kernel - 1, 0) * (size_t)g->conv_dim * fl);
    e->ssm = take(c, (size_t)e->n_mamba * (size_t)g->mamba_heads * (size_t)g->mamba_head_dim * (size_t)g->ssm_state * fl);
    e->kc = take(c, (size_t)e->n_attn * ctx * kvd * fl);
    e->vc = take(c, (size_t)e->n_attn * ctx * kvd * fl);
    e->mtp_k = e->model->has_mtp ? take(c, ctx * kvd * fl) : NULL;
    e->mtp_v = e->model->has_mtp ? take(c, ctx * kvd * fl) : NULL;
    const size_t cap = KEEL_MIN(E, WIN * K), groups = ROWS / WIN;
    e->tok = take(c, ROWS * sizeof(int));
    e->dpos = take(c, 4 * sizeof(int));
    e->kn = take(c, ROWS * kvd * fl);
    e->vn = take(c, ROWS * kvd * fl);
    e->ascratch = take(c, keel_ecu_attn_scratch_max_bytes(ROWS, KEEL_MAX(g->n_head, 1), KEEL_MAX(g->head_dim, 1), (int)ctx));
    e->sscratch = take(c, keel_ecu_sample_scratch_bytes(g->vocab));
    e->sel = take(c, ROWS * K * sizeof(int));
    e->xr[0] = e->x = take(c, ROWS * H * fl);
    e->xr[1] = take(c, ROWS * H * fl);
    e->xnf = take(c, ROWS * H * fl);
    e->xnb = take(c, ROWS * H * bf);
    e->mix = take(c, ROWS * H * fl);
    e->mix2 = take(c, ROWS * H * fl);
    e->hin = take(c, ROWS * H * fl);
    e->catf = take(c, ROWS * 2 * H * fl);
    e->catb = take(c, ROWS * 2 * H * bf);
    e->proj = take(c, ROWS * (size_t)e->wide * fl);
    e->xbc = take(c, ROWS * (size_t)KEEL_MAX(g->conv_dim, 1) * fl);
    e->mcnt = take(c, (size_t)KEEL_MAX(g->n_groups, 1) * sizeof(unsigned));
    e->ymid = take(c, ROWS * (size_t)KEEL_MAX(g->d_inner, 1) * fl);
    e->midb = take(c, ROWS * (size_t)e->midw * bf);
    e->hexp = take(c, cap * WIN * (size_t)KEEL_MAX(g->moe_inter, 1) * bf);
    e->midf = take(c, ROWS * (size_t)e->midw * fl);
    e->hexpf = take(c, ROWS * K * (size_t)KEEL_MAX(g->moe_inter, 1) * fl);
    e->yexp = take(c, ROWS * K * H * fl);
    e->router = take(c, ROWS * E * fl);
    e->items1 = take(c, ROWS * K * sizeof(keel_cuda_route));
    e->rw1 = take(c, ROWS * K * 8 * fl);
    e->items = take(c, groups * cap * sizeof(keel_cuda_route));
    e->rweights = take(c, groups * cap * 8 * fl);
    e->logits = take(c, ROWS * (size_t)g->vocab * fl);
}

static double gib(size_t b) { return (double)b / (double)(1ull << 30); }

keel_code keel_cuda_engine_init(keel_cuda_engine **out, const keel_model *m, int max_ctx, keel_err *err) {
    KEEL_ASSERT(out && m);
    *out = NULL;
    const keel_config *g = &m->cfg;
    if (max_ctx < 1) return keel_err_set(err, KEEL_E_ARG, "context size %d: expected at least 1", max_ctx);
    if (max_ctx > g->max_ctx)
        return keel_err_set(err, KEEL_E_RANGE, "context of %d tokens exceeds model %s's max_position_embeddings of %d",
                            max_ctx, m->dir, g->max_ctx);
    keel_code rc = check_shapes(m, err);
    if (rc) return rc;
    if (keel_cuda_device_count() < 1)
        return keel_err_set(err, KEEL_E_DEVICE, "the CUDA engine found no usable CUDA device (use --backend cpu)");
    keel_cuda_engine *e = keel_xcalloc(1, sizeof *e);
    e->model = m;
    e->cfg = g;
    e->max_ctx = max_ctx;
    e->window = WIN;
    e->prompt_rows = ROWS;
    e->slot = keel_xcalloc((size_t)KEEL_MAX(g->n_layer, 1), sizeof(int));
    for (int l = 0; l < g->n_layer; l++)
        e->slot[l] = g->pattern[l] == KEEL_MIXER_MAMBA ? e->n_mamba++ : g->pattern[l] == KEEL_MIXER_ATTN ? e->n_attn++ : -1;
    const int qd = g->n_head * g->head_dim;
    e->wide = KEEL_MAX(KEEL_MAX(g->in_proj_dim, qd), 1);
    e->midw = KEEL_MAX(KEEL_MAX(KEEL_MAX(g->d_inner, qd), KEEL_MAX(g->mlp_inter, g->shared_inter)), 1);
    if ((rc = add_regions(e, &m->st, err)) || (m->has_mtp && (rc = add_regions(e, &m->mtp_st, err)))) {
        keel_cuda_engine_free(e);
        return rc;
    }
    size_t wbytes = 0;
    for (int i = 0; i < e->n_reg; i++) wbytes += al256(e->reg[i].pad + e->reg[i].size);
    const size_t ring_bytes = wbytes;
    wbytes += pk_plan(e); /* the packed copies, after the shards in the same allocation */
    carve c = {NULL, 0};
    layout(e, &c);
    size_t free_b = 0, total_b = 0;
    if (!keel_ecu_mem_info(&free_b, &total_b)) {
        keel_cuda_engine_free(e);
        return keel_err_set(err, KEEL_E_DEVICE, "the CUDA engine cannot query device memory");
    }
    const size_t need = wbytes + c.off + MARGIN_BYTES;
    if (need > free_b) {
        keel_cuda_engine_free(e);
        return keel_err_set(err, KEEL_E_NOMEM,
                            "model %s does not fit the device: %.2f GiB of weights + %.2f GiB of state, KV cache and "
                            "scratch for a context of %d tokens + %.2f GiB reserve, but %.2f GiB of %.2f GiB are free "
                            "(a shorter --ctx, a smaller checkpoint or --backend cpu)",
                            m->dir, gib(wbytes), gib(c.off), max_ctx, gib(MARGIN_BYTES), gib(free_b), gib(total_b));
    }
    char why[256];
    if (!keel_ecu_malloc(&e->weights, wbytes, why, sizeof why) || !keel_ecu_malloc(&e->arena, c.off, why, sizeof why)) {
        keel_cuda_engine_free(e);
        return keel_err_set(err, KEEL_E_NOMEM, "model %s: device allocation of %.2f GiB failed: %s", m->dir,
                            gib(wbytes + c.off), why);
    }
    e->weight_bytes = wbytes;
    e->arena_bytes = c.off;
    keel_ecu_prefer_shared(); /* every kernel the same carveout: no SM reconfiguration between launches */
    e->st = keel_ecu_stream_new();
    e->side = keel_ecu_stream_new();
    e->side_mode = KEEL_CUDA_ENGINE_SIDE_DEFAULT;
    e->fused_norm = KEEL_CUDA_ENGINE_FUSED_NORM_DEFAULT;
    e->fused_router = KEEL_CUDA_ENGINE_FUSED_ROUTER_DEFAULT; /* both fusions are slower than their three launches */
    e->route_window = KEEL_CUDA_ENGINE_ROUTE_WINDOW_DEFAULT;
    e->fused_mamba = KEEL_CUDA_ENGINE_FUSED_MAMBA_DEFAULT;   /* in the decode graph (docs/performance.md) */
    e->fork = keel_ecu_event_new();
    e->join = keel_ecu_event_new();
    e->hpin = keel_ecu_host_alloc(4 * sizeof(int));
    e->graphs = true;
    e->packed = KEEL_CUDA_ENGINE_PACKED_DEFAULT;
    size_t off = 0;
    for (int i = 0; i < e->n_reg; i++) {
        e->reg[i].dev = (uint8_t *)e->weights + off + e->reg[i].pad;
        keel_ecu_upload(e->reg[i].dev, e->reg[i].host, e->reg[i].size, e->st);
        off += al256(e->reg[i].pad + e->reg[i].size);
    }
    c.base = e->arena;
    c.off = 0;
    layout(e, &c);
    e->embed = dmat(e, &m->embed);
    e->lm_head = dmat(e, &m->lm_head);
    e->norm_f = dvec(e, &m->norm_f);
    e->layers = keel_xcalloc((size_t)KEEL_MAX(g->n_layer, 1), sizeof(dlayer));
    for (int l = 0; l < g->n_layer; l++) {
        const keel_layer *L = &m->layers[l];
        dlayer *d = &e->layers[l];
        d->kind = L->kind;
        d->norm = dvec(e, &L->norm);
        switch (L->kind) {
        case KEEL_MIXER_MAMBA: {
            const keel_mamba_w *w = &L->mamba;
            d->mamba = (dmamba){dmat(e, &w->in_proj), dmat(e, &w->out_proj), dvec(e, &w->in_bias), dvec(e, &w->conv_w),
                                dvec(e, &w->conv_b), dvec(e, &w->dt_bias), dvec(e, &w->A_log), dvec(e, &w->D),
                                dvec(e, &w->norm), dvec(e, &w->out_bias)};
            break;
        }
        case KEEL_MIXER_ATTN: bind_attn(e, &L->attn, &d->attn); break;
        case KEEL_MIXER_MLP: d->mlp = (dmlp){dmat(e, &L->mlp.up), dmat(e, &L->mlp.down)}; break;
        case KEEL_MIXER_MOE: bind_moe(e, &L->moe, &d->moe); break;
        }
    }
    if (m->has_mtp) {
        const keel_mtp_w *w = &m->mtp;
        e->mtp.enorm = dvec(e, &w->enorm), e->mtp.hnorm = dvec(e, &w->hnorm), e->mtp.norm0 = dvec(e, &w->norm0);
        e->mtp.norm1 = dvec(e, &w->norm1), e->mtp.final_norm = dvec(e, &w->final_norm);
        e->mtp.eh_proj = dmat(e, &w->eh_proj);
        bind_attn(e, &w->attn, &e->mtp.attn);
        bind_moe(e, &w->moe, &e->mtp.moe);
    }
    pk_bind(e, (uint8_t *)e->weights + ring_bytes);
    keel_cuda_engine_reset(e);
    keel_ecu_sync(e->st);
    *out = e;
    return KEEL_OK;
}

void keel_cuda_engine_free(keel_cuda_engine *e) {
    if (!e) return;
    if (e->st) keel_ecu_sync(e->st);
    keel_ecu_graph_free(e->graph);
    for (int i = 0; i < 2 * PROF_PAIRS; i++) keel_ecu_event_free(e->ev[i]);
    keel_ecu_host_free(e->hpin);
    if (e->side) keel_ecu_sync(e->side);
    keel_ecu_event_free(e->fork);
    keel_ecu_event_free(e->join);
    if (e->st) keel_cuda_stream_scratch_release(e->st);
    if (e->side) keel_cuda_stream_scratch_release(e->side);
    keel_ecu_stream_free(e->side);
    keel_ecu_stream_free(e->st);
    keel_ecu_free(e->weights);
    keel_ecu_free(e->arena);
    free(e->layers);
    free(e->slot);
    free(e->pk);
    free(e);
}

void keel_cuda_engine_reset(keel_cuda_engine *e) {
    const keel_config *g = e->cfg;
    e->pos = 0;
    e->mtp_pos = 0;
    keel_ecu_memset(e->mcnt, 0, (size_t)KEEL_MAX(g->n_groups, 1) * sizeof(unsigned), e->st);
    keel_ecu_memset(e->conv, 0, (size_t)e->n_mamba * (size_t)KEEL_MAX(g->conv_kernel - 1, 0) * (size_t)g->conv_dim * sizeof(float), e->st);
    keel_ecu_memset(e->ssm, 0, (size_t)e->n_mamba * (size_t)g->mamba_heads * (size_t)g->mamba_head_dim *
                                    (size_t)g->ssm_state * sizeof(float), e->st);
}

int keel_cuda_engine_pos(const keel_cuda_engine *e) { return e->pos; }
int keel_cuda_engine_max_ctx(const keel_cuda_engine *e) { return e->max_ctx; }
size_t keel_cuda_engine_weight_bytes(const keel_cuda_engine *e) { return e->weight_bytes; }
void keel_cuda_engine_set_window(keel_cuda_engine *e, int rows) { e->window = rows >= 1 && rows <= ROWS ? rows : WIN; }
void keel_cuda_engine_set_prompt_rows(keel_cuda_engine *e, int rows) {
    e->prompt_rows = rows >= 1 && rows <= ROWS ? rows : ROWS;
}

/* The captured step holds the activation mode and the draw: a change of either captures again. */
static void drop_graph(keel_cuda_engine *e) {
    if (!e->graph) return;
    keel_ecu_sync(e->st);
    keel_ecu_graph_free(e->graph);
    e->graph = NULL;
}

void keel_cuda_engine_set_start(keel_cuda_engine *e, int pos) { e->start = pos > 0 && pos < e->max_ctx ? pos : 0; }

static size_t qw_bytes(const keel_cuda_qw *w) {
    if (!w->w) return 0;
    const size_t nk = (size_t)w->n * (size_t)w->k, ds = keel_dtype_size(w->sdt);
    return w->bits == 0 ? nk * ds : nk * (size_t)w->bits / 8 + 2 * (size_t)w->n * (size_t)(w->k / w->group) * ds;
}

static size_t moe_bytes(const keel_config *g, const dmoe *w) {
    return qw_bytes(&w->gate) + (size_t)g->top_k * (qw_bytes(&w->fc1) + qw_bytes(&w->fc2)) +
           qw_bytes(&w->shared.up) + qw_bytes(&w->shared.down);
}

size_t keel_cuda_engine_step_bytes(const keel_cuda_engine *e, int ctx) {
    const keel_config *g = e->cfg;
    const size_t kvd = (size_t)g->n_kv_head * (size_t)g->head_dim;
    size_t b = qw_bytes(&e->lm_head) + (size_t)g->hidden * 4;
    for (int l = 0; l < g->n_layer; l++) {
        const dlayer *L = &e->layers[l];
        switch (L->kind) {
        case KEEL_MIXER_MAMBA:
            b += qw_bytes(&L->mamba.in_proj) + qw_bytes(&L->mamba.out_proj) +
                 (size_t)g->mamba_heads * (size_t)g->mamba_head_dim * (size_t)g->ssm_state * sizeof(float);
            break;
        case KEEL_MIXER_ATTN:
            b += qw_bytes(&L->attn.q) + qw_bytes(&L->attn.k) + qw_bytes(&L->attn.v) + qw_bytes(&L->attn.o) +
                 2 * (size_t)ctx * kvd * sizeof(float);
            break;
        case KEEL_MIXER_MLP: b += qw_bytes(&L->mlp.up) + qw_bytes(&L->mlp.down); break;
        case KEEL_MIXER_MOE: b += moe_bytes(g, &L->moe); break;
        }
    }
    return b;
}

void keel_cuda_engine_set_graphs(keel_cuda_engine *e, bool on) {
    if (!on) drop_graph(e);
    e->graphs = on;
}

void keel_cuda_engine_set_packed(keel_cuda_engine *e, bool on) {
    if (on != e->packed) drop_graph(e);
    e->packed = on;
}

int keel_cuda_engine_packed_count(const keel_cuda_engine *e) { return e->n_pk; }

void keel_cuda_engine_set_fused_mamba(keel_cuda_engine *e, bool on) {
    if (on != e->fused_mamba) drop_graph(e);
    e->fused_mamba = on;
}

void keel_cuda_engine_set_route_window(keel_cuda_engine *e, bool on) {
    if (on != e->route_window) drop_graph(e);
    e->route_window = on;
}

void keel_cuda_engine_set_fused_norm(keel_cuda_engine *e, bool on) {
    if (on != e->fused_norm) drop_graph(e);
    e->fused_norm = on;
}

void keel_cuda_engine_set_fused_router(keel_cuda_engine *e, bool on) {
    if (on != e->fused_router) drop_graph(e);
    e->fused_router = on;
}

void keel_cuda_engine_set_side(keel_cuda_engine *e, int mode) {
    if (mode < 0 || mode > 2) mode = KEEL_CUDA_ENGINE_SIDE_DEFAULT;
    if (mode == e->side_mode) return;
    drop_graph(e);
    if ((mode == 2) != (e->side_mode == 2)) { /* the stream's priority is fixed at its creation */
        keel_ecu_sync(e->side);
        keel_cuda_stream_scratch_release(e->side);
        keel_ecu_stream_free(e->side);
        e->side = mode == 2 ? keel_ecu_stream_new_low() : keel_ecu_stream_new();
        e->warm = false; /* the new stream's scratch grows on its first launches, outside a capture */
    }
    e->side_mode = mode;
}

keel_code keel_cuda_engine_set_activations(keel_cuda_engine *e, keel_dtype dt, keel_err *err) {
    if (dt != KEEL_DT_BF16 && dt != KEEL_DT_F32)
        return keel_err_set(err, KEEL_E_ARG, "activations %s: the CUDA engine takes BF16 (stream tiles) or F32",
                            keel_dtype_name(dt));
    if (e->f32 != (dt == KEEL_DT_F32)) drop_graph(e);
    e->f32 = dt == KEEL_DT_F32;
    return KEEL_OK;
}

/* ---- the layers ---- */

/* y = x . W^T: a stream tile on bf16 rows (the packed tile on its copy, the same bits, for a window of at most 8
 * rows), or the fp32 matvec for a float matrix (fp32 rows when given) and for every matrix in fp32 activations mode
 * (which always gives fp32 rows). */
static void mm_on(keel_cuda_engine *e, void *st, int fam, const keel_cuda_qw *W, const float *xf, const uint16_t *xb,
                  int m, void *y, keel_dtype ydt, keel_epilogue epi) {
    fam_begin(e, fam);
    KEEL_ASSERT(!e->f32 || xf);
    const keel_cuda_pw *pk = e->packed && m <= KEEL_CUDA_STREAM_MAX_ROWS ? pk_find(e, W) : NULL;
    if (W->bits == 0 || e->f32)
        keel_ecu_matvec(W, xf ? (const void *)xf : (const void *)xb, xf ? KEEL_DT_F32 : KEEL_DT_BF16, m, y, ydt, epi, st);
    else if (pk) keel_cuda_stream_matmul_packed(pk, xb, KEEL_DT_BF16, m, y, ydt, epi, st);
    else keel_cuda_stream_matmul_rows(W, xb, KEEL_DT_BF16, m, y, ydt, epi, st); /* a prompt chunk, one launch */
    fam_end(e);
}

static void mm(keel_cuda_engine *e, int fam, const keel_cuda_qw *W, const float *xf, const uint16_t *xb, int m,
               void *y, keel_dtype ydt, keel_epilogue epi) {
    mm_on(e, e->st, fam, W, xf, xb, m, y, ydt, epi);
}

/* The stream for work independent of what st queues next: side, after everything st has queued (st itself when
 * the side stream is off or families are being timed, which run one stream). */
static void *fork_side(keel_cuda_engine *e) {
    if (!e->side_mode || e->prof) return e->st;
    keel_ecu_event_record(e->fork, e->st);
    keel_ecu_stream_wait(e->side, e->fork);
    return e->side;
}

/* st's later work waits for everything queued on side since fork_side. */
static void join_side(keel_cuda_engine *e, void *side) {
    if (side == e->st) return;
    keel_ecu_event_record(e->join, side);
    keel_ecu_stream_wait(e->st, e->join);
}

/* ---- the add and norm between layers, taken into the next MoE layer's router matvec ---- */

/* The residual buffer the pending add writes: the one x is not. */
static float *x_next(const keel_cuda_engine *e) { return e->x == e->xr[0] ? e->xr[1] : e->xr[0]; }

/* The pending add and norm as add_rmsnorm of its own (into xnf and xnb), for a layer that does not take it in. */
static void flush_norm(keel_cuda_engine *e, int m) {
    if (!e->pend.on) return;
    float *xo = x_next(e);
    fam_begin(e, KEEL_CUF_NORM);
    keel_ecu_add_rmsnorm(xo, e->x, e->pend.a, e->pend.b, e->pend.bias, e->pend.w, m, e->cfg->hidden, e->cfg->norm_eps,
                         e->xnf, e->xnb, e->st);
    fam_end(e);
    e->x = xo;
    e->pend.on = false;
}

/* Every launch that takes the pending norm in is queued: the residual is the buffer they wrote. */
static void took_norm(keel_cuda_engine *e) {
    e->x = x_next(e);
    e->pend.on = false;
}

/* Whether layer L's first launch takes the pending norm in: the router's matvec of a MoE layer (bf16 activations). */
static bool takes_norm(const keel_cuda_engine *e, const dlayer *L) {
    return e->fused_norm && !e->f32 && L->kind == KEEL_MIXER_MOE && !e->fused_router;
}

static void mamba(keel_cuda_engine *e, const dmamba *w, int slot, int m) {
    const keel_config *g = e->cfg;
    const int DI = g->d_inner, CD = g->conv_dim, K = g->conv_kernel, PD = g->in_proj_dim;
    mm(e, KEEL_CUF_PROJ, &w->in_proj, e->xnf, e->xnb, m, e->proj, KEEL_DT_F32, KEEL_EPI_NONE);
    fam_begin(e, KEEL_CUF_MAMBA);
    keel_ecu_add_bias(e->proj, m, PD, PD, &w->in_bias, e->st);
    float *win = e->conv + (size_t)slot * (size_t)KEEL_MAX(K - 1, 0) * (size_t)CD;
    float *st = e->ssm + (size_t)slot * (size_t)g->mamba_heads * (size_t)g->mamba_head_dim * (size_t)g->ssm_state;
    const keel_ecu_vec *cb = g->conv_bias ? &w->conv_b : NULL;
    if (m <= WIN && e->fused_mamba) { /* conv, scan and gated norm in one launch: the three's bits */
        keel_ecu_mamba_step(e->proj, PD, win, &w->conv_w, cb, K, st, &w->dt_bias, &w->A_log, &w->D, g->mamba_heads,
                            g->mamba_head_dim, g->ssm_state, g->n_groups, m, &w->norm, g->norm_eps, e->xbc, e->ymid,
                            e->mcnt, e->f32 ? NULL : e->midb, e->f32 ? e->midf : NULL, e->st);
    } else {
        keel_ecu_conv(e->proj, PD, DI, win, &w->conv_w, cb, K, CD, m, e->xbc, e->st);
        if (m <= WIN) /* exact windows: the per-token step, whose bits a row alone gets too */
            keel_ecu_ssm(e->xbc, CD, e->proj, PD, DI + CD, st, &w->dt_bias, &w->A_log, &w->D, g->mamba_heads,
                         g->mamba_head_dim, g->ssm_state, g->n_groups, m, e->ymid, e->st);
        else /* prompt chunks: the chunked scan, within the gate-3 bound of stepping */
            keel_ecu_ssm_chunked(e->xbc, CD, e->proj, PD, DI + CD, st, &w->dt_bias, &w->A_log, &w->D, g->mamba_heads,
                                 g->mamba_head_dim, g->ssm_state, g->n_groups, m, e->ymid, e->st);
        keel_ecu_gate_norm(e->ymid, e->proj, PD, &w->norm, g->n_groups, DI, g->norm_eps, m, e->f32 ? NULL : e->midb,
                           e->f32 ? e->midf : NULL, e->st);
    }
    fam_end(e);
    mm(e, KEEL_CUF_PROJ, &w->out_proj, e->f32 ? e->midf : NULL, e->midb, m, e->mix, KEEL_DT_F32, KEEL_EPI_NONE);
}

/* Rows at the device position *dp: k and v (plus biases) enter the cache, then split-K attention over it. */
static void attention(keel_cuda_engine *e, const dattn *w, float *kc, float *vc, const int *dp, int m) {
    const keel_config *g = e->cfg;
    const int kvd = g->n_kv_head * g->head_dim;
    void *side = fork_side(e); /* k and v beside q */
    mm_on(e, side, KEEL_CUF_PROJ, &w->k, e->xnf, e->xnb, m, e->kn, KEEL_DT_F32, KEEL_EPI_NONE);
    mm_on(e, side, KEEL_CUF_PROJ, &w->v, e->xnf, e->xnb, m, e->vn, KEEL_DT_F32, KEEL_EPI_NONE);
    mm(e, KEEL_CUF_PROJ, &w->q, e->xnf, e->xnb, m, e->proj, KEEL_DT_F32, KEEL_EPI_NONE);
    join_side(e, side);
    fam_begin(e, KEEL_CUF_ATTN);
    keel_ecu_kv_append(e->kn, e->vn, &w->kb, &w->vb, kc, vc, kvd, dp, m, e->st);
    keel_ecu_attn(e->proj, &w->qb, kc, vc, kvd, dp, m, g->n_head, g->n_kv_head, g->head_dim, e->max_ctx, e->ascratch,
                  e->f32 ? NULL : e->midb, e->f32 ? e->midf : NULL, e->st);
    fam_end(e);
    mm(e, KEEL_CUF_PROJ, &w->o, e->f32 ? e->midf : NULL, e->midb, m, e->mix, KEEL_DT_F32, KEEL_EPI_NONE);
}

static void mlp_on(keel_cuda_engine *e, void *st, const dmlp *w, int m, float *out) {
    if (e->f32) {
        mm_on(e, st, KEEL_CUF_PROJ, &w->up, e->xnf, e->xnb, m, e->midf, KEEL_DT_F32, KEEL_EPI_RELU2);
        mm_on(e, st, KEEL_CUF_PROJ, &w->down, e->midf, NULL, m, out, KEEL_DT_F32, KEEL_EPI_NONE);
        return;
    }
    mm_on(e, st, KEEL_CUF_PROJ, &w->up, e->xnf, e->xnb, m, e->midb, KEEL_DT_BF16, KEEL_EPI_RELU2);
    mm_on(e, st, KEEL_CUF_PROJ, &w->down, NULL, e->midb, m, out, KEEL_DT_F32, KEEL_EPI_NONE);
}

static void mlp(keel_cuda_engine *e, const dmlp *w, int m, float *out) { mlp_on(e, e->st, w, m, out); }

/* The shared expert on the side stream (its own scratch: midb or midf, mix2) beside the router and the routed
 * experts (per 8-row group one launch over the union of its experts). */
static void moe(keel_cuda_engine *e, const dmoe *w, int m) {
    const keel_config *g = e->cfg;
    const int H = g->hidden, K = g->top_k, E = g->n_experts;
    const int cap = KEEL_MIN(E, WIN * K);
    void *side = e->st;
    const bool took = e->pend.on; /* the router's matvec takes the norm in, then the shared expert forks */
    if (took) {
        fam_begin(e, KEEL_CUF_ROUTER);
        keel_ecu_matvec_norm(&w->gate, x_next(e), e->x, e->pend.a, e->pend.b, e->pend.bias, e->pend.w, m, g->norm_eps,
                             e->xnf, e->xnb, e->router, e->st);
        fam_end(e);
        took_norm(e);
    }
    if (g->n_shared > 0) {
        side = fork_side(e);
        mlp_on(e, side, &w->shared, m, e->mix2);
    }
    fam_begin(e, KEEL_CUF_ROUTER); /* logits, top-k, then the 8-row groups' unions */
    if (!took && !e->f32 && e->fused_router && w->gate.bits == 0) { /* the three in one launch */
        keel_ecu_router(&w->gate, e->xnf, m, e->router, &w->corr, K, g->n_group, g->topk_group, g->norm_topk_prob,
                        g->routed_scaling, e->items1, e->rw1, e->sel, cap, e->items, e->rweights, e->st);
    } else {
        if (!took) keel_ecu_matvec(&w->gate, e->xnf, KEEL_DT_F32, m, e->router, KEEL_DT_F32, KEEL_EPI_NONE, e->st);
        if (!e->f32 && e->route_window) { /* top-k and the unions in one launch */
            keel_ecu_route_window(e->router, &w->corr, E, K, g->n_group, g->topk_group, g->norm_topk_prob,
                                  g->routed_scaling, m, e->items1, e->rw1, e->sel, cap, e->items, e->rweights, e->st);
        } else {
            keel_ecu_route(e->router, &w->corr, E, K, g->n_group, g->topk_group, g->norm_topk_prob, g->routed_scaling,
                           m, e->items1, e->rw1, e->sel, e->st);
            if (!e->f32) keel_ecu_route_union(e->sel, e->rw1, m, K, E, cap, e->items, e->rweights, e->st);
        }
    }
    fam_end(e);
    fam_begin(e, KEEL_CUF_EXPERTS);
    if (e->f32) { /* every row's items in one launch: the fp32 matvec never splits k */
        keel_ecu_matvec_routed(&w->fc1, e->xnf, false, m, e->sel, K, e->hexpf, KEEL_EPI_RELU2, e->st);
        keel_ecu_matvec_routed(&w->fc2, e->hexpf, true, m, e->sel, K, e->yexp, KEEL_EPI_NONE, e->st);
        keel_ecu_combine(e->yexp, e->rw1, m, K, H, e->mix, e->st);
    } else { /* per 8-row group one launch over the union of its experts (ascending: a row meets its experts in the
              * same order alone or in any window; the tiles' k-split depends on n and k only) */
        for (int r0 = 0; r0 < m; r0 += WIN) {
            const int mg = KEEL_MIN(WIN, m - r0), ni = KEEL_MIN(E, mg * K);
            const keel_cuda_route *it = e->items + (size_t)(r0 / WIN) * cap;
            keel_cuda_stream_experts_up(&w->fc1, e->xnb + (size_t)r0 * H, KEEL_DT_BF16, mg, it, ni, e->hexp,
                                        KEEL_DT_BF16, KEEL_EPI_RELU2, e->st);
            keel_cuda_stream_experts_down(&w->fc2, e->hexp, KEEL_DT_BF16, mg, it, e->rweights + (size_t)(r0 / WIN) * cap * 8,
                                          ni, e->mix + (size_t)r0 * H, KEEL_DT_F32, e->st);
        }
    }
    fam_end(e);
    join_side(e, side);
}

static const keel_ecu_vec *next_norm(const keel_cuda_engine *e, int l) {
    return l + 1 < e->cfg->n_layer ? &e->layers[l + 1].norm : &e->norm_f;
}

/* One window of m rows whose tokens are in e->tok and whose first position is in e->dpos[0] (device memory, so a
 * captured step replays at any position). Leaves the hidden after norm_f in xnf (fp32) and xnb (bf16). */
static void run_window(keel_cuda_engine *e, int m) {
    const keel_config *g = e->cfg;
    const int H = g->hidden, kvd = g->n_kv_head * g->head_dim;
    e->pend.on = false;
    fam_begin(e, KEEL_CUF_EMBED);
    keel_ecu_embed(&e->embed, e->tok, m, e->x, e->st);
    fam_end(e);
    fam_begin(e, KEEL_CUF_NORM);
    keel_ecu_rmsnorm(e->x, H, g->n_layer ? &e->layers[0].norm : &e->norm_f, m, H, g->norm_eps, e->xnf, e->xnb, H, e->st);
    fam_end(e);
    for (int l = 0; l < g->n_layer; l++) {
        const dlayer *L = &e->layers[l];
        const float *b = NULL;
        const keel_ecu_vec *bias = NULL;
        if (!takes_norm(e, L)) flush_norm(e, m);
        switch (L->kind) {
        case KEEL_MIXER_MAMBA:
            mamba(e, &L->mamba, e->slot[l], m);
            bias = &L->mamba.out_bias;
            break;
        case KEEL_MIXER_ATTN: {
            const size_t at = (size_t)e->slot[l] * (size_t)e->max_ctx * (size_t)kvd;
            attention(e, &L->attn, e->kc + at, e->vc + at, e->dpos, m);
            bias = &L->attn.ob;
            break;
        }
        case KEEL_MIXER_MLP: mlp(e, &L->mlp, m, e->mix); break;
        case KEEL_MIXER_MOE:
            moe(e, &L->moe, m);
            if (g->n_shared > 0) b = e->mix2;
            break;
        }
        e->pend.on = true; /* the add and the next norm, for the next layer's launches to take in */
        e->pend.a = e->mix, e->pend.b = b, e->pend.bias = bias, e->pend.w = next_norm(e, l);
    }
    flush_norm(e, m);
}

/* Queues the window's tokens and positions (from pageable memory: the copy is staged before this returns). */
static void put_window(keel_cuda_engine *e, const int *tokens, int m) {
    const int pos[2] = {e->pos, e->pos + m};
    keel_ecu_upload(e->tok, tokens, (size_t)m * sizeof(int), e->st);
    keel_ecu_upload(e->dpos, pos, sizeof pos, e->st);
}

static keel_code check_tokens(const keel_cuda_engine *e, const int *t, int n, int at, const char *what, keel_err *err) {
    if (n < 1) return keel_err_set(err, KEEL_E_ARG, "%s: %d tokens, expected at least 1", what, n);
    for (int i = 0; i < n; i++)
        if (t[i] < 0 || t[i] >= e->cfg->vocab)
            return keel_err_set(err, KEEL_E_RANGE, "token id %d (at index %d) is outside the vocabulary of %d ids",
                                t[i], i, e->cfg->vocab);
    if ((int64_t)at + n > e->max_ctx)
        return keel_err_set(err, KEEL_E_RANGE,
                            "%s: %d tokens at position %d do not fit the context of %d tokens (the CUDA engine's KV "
                            "cache; raise --ctx)", what, n, at, e->max_ctx);
    return KEEL_OK;
}

/* The forward; with dev_last, the last row's logits stay in e->logits (row 0) and are not downloaded. */
static keel_code forward(keel_cuda_engine *e, const int *tokens, int n, float *logits, keel_logits_mode mode,
                         float *hidden, bool dev_last, int rows, keel_err *err) {
    const keel_config *g = e->cfg;
    const int H = g->hidden, V = g->vocab;
    keel_code rc = check_tokens(e, tokens, n, e->pos, "forward", err);
    if (rc) return rc;
    for (int c0 = 0; c0 < n; c0 += rows) {
        const int m = KEEL_MIN(rows, n - c0);
        put_window(e, tokens + c0, m);
        run_window(e, m);
        e->pos += m;
        if (hidden) keel_ecu_download(hidden + (size_t)c0 * H, e->xnf, (size_t)m * H * sizeof(float), e->st);
        if (mode == KEEL_LOGITS_ALL) {
            mm(e, KEEL_CUF_LM_HEAD, &e->lm_head, e->xnf, e->xnb, m, e->logits, KEEL_DT_F32, KEEL_EPI_NONE);
            keel_ecu_download(logits + (size_t)c0 * V, e->logits, (size_t)m * V * sizeof(float), e->st);
        } else if (mode == KEEL_LOGITS_LAST && c0 + m == n) {
            mm(e, KEEL_CUF_LM_HEAD, &e->lm_head, e->xnf + (size_t)(m - 1) * H, e->xnb + (size_t)(m - 1) * H, 1,
               e->logits, KEEL_DT_F32, KEEL_EPI_NONE);
            if (!dev_last) keel_ecu_download(logits, e->logits, (size_t)V * sizeof(float), e->st);
        }
    }
    if (!dev_last) keel_ecu_sync(e->st);
    if (e->prof) prof_flush(e);
    return KEEL_OK;
}

keel_code keel_cuda_engine_forward(keel_cuda_engine *e, const int *tokens, int n, float *logits,
                                   keel_logits_mode mode, float *hidden, keel_err *err) {
    KEEL_ASSERT(e && tokens && (mode == KEEL_LOGITS_NONE || logits));
    return forward(e, tokens, n, logits, mode, hidden, false, e->window, err);
}

keel_code keel_cuda_engine_mtp(keel_cuda_engine *e, const float *h, const int *next, int n, float *logits,
                               float *out_hidden, keel_err *err) {
    const keel_model *M = e->model;
    const keel_config *g = e->cfg;
    const int H = g->hidden, V = g->vocab, kvd = g->n_kv_head * g->head_dim;
    (void)kvd;
    if (!M->has_mtp) return keel_err_set(err, KEEL_E_MISSING, "model %s has no MTP head (mtp.safetensors)", M->dir);
    keel_code rc = check_tokens(e, next, n, e->mtp_pos, "mtp", err);
    if (rc) return rc;
    for (int c0 = 0; c0 < n; c0 += e->window) {
        const int m = KEEL_MIN(e->window, n - c0);
        keel_ecu_upload(e->tok, next + c0, (size_t)m * sizeof(int), e->st);
        keel_ecu_upload(e->dpos + 2, &e->mtp_pos, sizeof(int), e->st);
        keel_ecu_upload(e->hin, h + (size_t)c0 * H, (size_t)m * H * sizeof(float), e->st);
        fam_begin(e, KEEL_CUF_EMBED);
        keel_ecu_embed(&e->embed, e->tok, m, e->x, e->st);
        fam_end(e);
        fam_begin(e, KEEL_CUF_NORM);
        keel_ecu_rmsnorm(e->x, H, &e->mtp.enorm, m, H, g->norm_eps, e->catf, e->catb, 2 * H, e->st);
        keel_ecu_rmsnorm(e->hin, H, &e->mtp.hnorm, m, H, g->norm_eps, e->catf + H, e->catb + H, 2 * H, e->st);
        fam_end(e);
        mm(e, KEEL_CUF_PROJ, &e->mtp.eh_proj, e->catf, e->catb, m, e->x, KEEL_DT_F32, KEEL_EPI_NONE);
        fam_begin(e, KEEL_CUF_NORM);
        keel_ecu_rmsnorm(e->x, H, &e->mtp.norm0, m, H, g->norm_eps, e->xnf, e->xnb, H, e->st);
        fam_end(e);
        attention(e, &e->mtp.attn, e->mtp_k, e->mtp_v, e->dpos + 2, m);
        fam_begin(e, KEEL_CUF_NORM);
        keel_ecu_add_rmsnorm(e->x, e->x, e->mix, NULL, &e->mtp.attn.ob, &e->mtp.norm1, m, H, g->norm_eps, e->xnf, e->xnb, e->st);
        fam_end(e);
        moe(e, &e->mtp.moe, m);
        fam_begin(e, KEEL_CUF_NORM);
        keel_ecu_add_rmsnorm(e->x, e->x, e->mix, g->n_shared > 0 ? e->mix2 : NULL, NULL, &e->mtp.final_norm, m, H,
                             g->norm_eps, e->xnf, e->xnb, e->st);
        fam_end(e);
        e->mtp_pos += m;
        if (out_hidden) keel_ecu_download(out_hidden + (size_t)c0 * H, e->xnf, (size_t)m * H * sizeof(float), e->st);
        if (logits) {
            mm(e, KEEL_CUF_LM_HEAD, &e->lm_head, e->xnf, e->xnb, m, e->logits, KEEL_DT_F32, KEEL_EPI_NONE);
            keel_ecu_download(logits + (size_t)c0 * V, e->logits, (size_t)m * V * sizeof(float), e->st);
        }
    }
    keel_ecu_sync(e->st);
    if (e->prof) prof_flush(e);
    return KEEL_OK;
}

/* ---- generation ---- */

static bool is_eos(const int *eos, int n_eos, int tok) {
    for (int i = 0; i < n_eos; i++)
        if (eos[i] == tok) return true;
    return false;
}

/* Queues the draw from the logits in e->logits (row 0) into e->tok[0] at the position in e->dpos[1] (argmax, or the
 * seeded sampler: the same token the CPU engine draws), and its copy to the page-locked e->hpin[2]. */
static void queue_draw(keel_cuda_engine *e, const keel_sampler_cfg *c) {
    const int V = e->cfg->vocab;
    fam_begin(e, KEEL_CUF_SAMPLE);
    if (!(c->temp > 0.0f)) keel_ecu_argmax(e->logits, V, e->tok, e->st);
    else keel_ecu_sample(e->logits, V, c->temp, c->top_k, c->top_p, c->min_p, c->seed, e->dpos + 1, e->tok, e->sscratch, e->st);
    fam_end(e);
    keel_ecu_download_async(e->hpin + 2, e->tok, sizeof(int), e->st);
}

/* One decode step: the token in e->tok[0] at the position in e->hpin[0] (copied to the device by the step itself),
 * through the model and lm_head, ending with the next draw queued. Everything it queues can be captured. */
static void queue_step(keel_cuda_engine *e, const keel_sampler_cfg *c) {
    keel_ecu_upload(e->dpos, e->hpin, 2 * sizeof(int), e->st);
    run_window(e, 1);
    mm(e, KEEL_CUF_LM_HEAD, &e->lm_head, e->xnf, e->xnb, 1, e->logits, KEEL_DT_F32, KEEL_EPI_NONE);
    queue_draw(e, c);
}

static bool same_draw(const keel_sampler_cfg *a, const keel_sampler_cfg *b) {
    if (!(a->temp > 0.0f) && !(b->temp > 0.0f)) return true;
    return a->temp == b->temp && a->top_k == b->top_k && a->top_p == b->top_p && a->min_p == b->min_p &&
           a->seed == b->seed;
}

/* Runs one decode step (replaying the captured graph when graphs are on; the first eager step warms every launch
 * so that the capture allocates nothing) and returns the drawn token. */
static keel_code step(keel_cuda_engine *e, const keel_sampler_cfg *c, int *tok, keel_err *err) {
    e->hpin[0] = e->pos;
    e->hpin[1] = e->pos + 1;
    const bool use = e->graphs && !e->prof;
    if (use && e->graph && (!same_draw(&e->graph_cfg, c) || e->graph_epoch != keel_cuda_stream_scratch_epoch()))
        drop_graph(e);
    if (use && !e->graph && e->warm) {
        char why[256];
        if (!keel_ecu_capture_begin(e->st, why, sizeof why)) return keel_err_set(err, KEEL_E_DEVICE, "%s", why);
        queue_step(e, c);
        if (!keel_ecu_capture_end(e->st, &e->graph, why, sizeof why)) return keel_err_set(err, KEEL_E_DEVICE, "%s", why);
        e->graph_cfg = *c;
        e->graph_epoch = keel_cuda_stream_scratch_epoch();
    }
    if (use && e->graph) keel_ecu_graph_launch(e->graph, e->st);
    else queue_step(e, c);
    e->warm = true;
    keel_ecu_sync(e->st);
    *tok = e->hpin[2];
    e->pos += 1;
    return KEEL_OK;
}

keel_code keel_cuda_generate(keel_cuda_engine *e, const int *prompt, int n_prompt, const keel_gen_opts *o,
                             keel_token_fn fn, void *user, keel_gen_result *res, keel_err *err) {
    KEEL_ASSERT(e && o && res);
    memset(res, 0, sizeof *res);
    if (n_prompt < 1) return keel_err_set(err, KEEL_E_ARG, "the prompt is empty: at least one token is needed");
    if ((int64_t)e->start + n_prompt > e->max_ctx)
        return keel_err_set(err, KEEL_E_RANGE, "the prompt has %d tokens (from position %d), longer than the context "
                            "of %d tokens", n_prompt, e->start, e->max_ctx);
    const int *eos = o->eos ? o->eos : e->cfg->eos_ids;
    const int n_eos = o->eos ? o->n_eos : e->cfg->n_eos;
    keel_cuda_engine_reset(e);
    if (e->start > 0) { /* the positions before the prompt hold zero keys and values */
        const size_t kvd = (size_t)e->cfg->n_kv_head * (size_t)e->cfg->head_dim;
        keel_ecu_memset(e->kc, 0, (size_t)e->n_attn * (size_t)e->max_ctx * kvd * sizeof(float), e->st);
        keel_ecu_memset(e->vc, 0, (size_t)e->n_attn * (size_t)e->max_ctx * kvd * sizeof(float), e->st);
        e->pos = e->start;
    }
    double t0 = keel_now();
    keel_code rc = forward(e, prompt, n_prompt, NULL, KEEL_LOGITS_LAST, NULL, true, e->prompt_rows, err);
    int tok = 0;
    if (rc == KEEL_OK) { /* the first draw, from the prompt's last logits */
        queue_draw(e, &o->samp);
        keel_ecu_sync(e->st);
        tok = e->hpin[2];
    }
    res->n_prompt = n_prompt;
    double t1 = keel_now();
    res->prompt_s = t1 - t0;
    while (rc == KEEL_OK) {
        if (o->n_predict >= 0 && res->n_gen >= o->n_predict) {
            res->stop = KEEL_STOP_LENGTH;
            break;
        }
        const int64_t pos = e->pos;
        if (pos >= e->max_ctx) {
            res->stop = KEEL_STOP_CONTEXT;
            break;
        }
        if (is_eos(eos, n_eos, tok)) {
            res->stop = KEEL_STOP_EOS;
            res->stop_token = tok;
            break;
        }
        res->n_gen++;
        if (fn && fn(user, tok, pos)) {
            res->stop = KEEL_STOP_CALLBACK;
            break;
        }
        if (o->n_predict >= 0 && res->n_gen >= o->n_predict) {
            res->stop = KEEL_STOP_LENGTH;
            break;
        }
        if (pos + 1 >= e->max_ctx) {
            res->stop = KEEL_STOP_CONTEXT;
            break;
        }
        rc = step(e, &o->samp, &tok, err);
    }
    keel_ecu_sync(e->st);
    if (e->prof) prof_flush(e);
    res->gen_s = keel_now() - t1;
    return rc;
}

#else
typedef int keel_engine_cuda_unused; /* a CPU-only build compiles this file to nothing */
#endif
