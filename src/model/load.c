/* model: binding every tensor of a nemotron_h checkpoint (and its MTP head) to its place, every shape checked.
 *
 * A matrix is quantized exactly when <path>.scales exists; its (bits, group) come from the quantization map and
 * must agree with the packed shapes and the input width the architecture implies. A float matrix (no .scales)
 * must be marked false in the map, except the MoE router (gate.weight), which MLX never quantizes and lists
 * nowhere; without any map every matrix must be float.
 */
#include <cjson/cJSON.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"
#include "model.h"

typedef struct binder {
    keel_model *m;
    const keel_st *st;
    const keel_qmap *qm;
    const char *file;    /* the checkpoint file, for tensors that are missing */
    const char *prefix;  /* prefix of the listed paths: "" or "mtp." */
    const char *mapname; /* where the map came from, for messages */
    const char *layer;   /* what the current tensors belong to, for missing-tensor messages */
    bool *used;          /* (st->n_tensors) */
    int cap_mats;
    keel_err *err;
} binder;

static void shape_str(int ndim, const int64_t *shape, char *buf, size_t n) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, n - o, "[");
    for (int i = 0; i < ndim && o < n; i++) o += (size_t)snprintf(buf + o, n - o, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (o < n) snprintf(buf + o, n - o, "]");
}

static bool shape_eq(const keel_st_tensor *t, int ndim, const int64_t *shape) {
    if (t->ndim != ndim) return false;
    for (int i = 0; i < ndim; i++)
        if (t->shape[i] != shape[i]) return false;
    return true;
}

static bool is_float_dt(keel_dtype dt) { return dt == KEEL_DT_BF16 || dt == KEEL_DT_F16 || dt == KEEL_DT_F32; }

static const keel_st_tensor *find(binder *b, const char *name) {
    const keel_st_tensor *t = keel_st_find(b->st, name);
    if (t) b->used[t - b->st->tensors] = true;
    return t;
}

static keel_code missing(binder *b, const char *name) {
    return keel_err_set(b->err, KEEL_E_MISSING, "%s: tensor %s is missing (needed by %s)", b->file, name, b->layer);
}

static keel_code shape_err(binder *b, const keel_st_tensor *t, int ndim, const int64_t *want, const char *what) {
    char w[96], f[96];
    shape_str(ndim, want, w, sizeof w);
    shape_str(t->ndim, t->shape, f, sizeof f);
    return keel_err_set(b->err, KEEL_E_SHAPE, "%s: tensor %s: expected shape %s%s, found %s",
                        keel_st_tensor_file(b->st, t), t->name, w, what, f);
}

/* A float tensor of the given shape bound as a vector of all its elements. */
static keel_code bind_vec(binder *b, const char *name, int ndim, const int64_t *shape, keel_vec *v) {
    const keel_st_tensor *t = find(b, name);
    if (!t) return missing(b, name);
    if (!is_float_dt(t->dtype))
        return keel_err_set(b->err, KEEL_E_FORMAT, "%s: tensor %s: expected BF16, F16 or F32, found %s",
                            keel_st_tensor_file(b->st, t), name, keel_dtype_name(t->dtype));
    if (!shape_eq(t, ndim, shape)) return shape_err(b, t, ndim, shape, "");
    v->data = t->data;
    v->dt = t->dtype;
    v->n = (int)t->numel;
    return KEEL_OK;
}

static keel_code bind_vec1(binder *b, const char *name, int n, keel_vec *v) {
    int64_t s[1] = {n};
    return bind_vec(b, name, 1, s, v);
}

static void add_info(binder *b, const char *path, int n_expert, int out, int in, const keel_qmat *q, size_t bytes) {
    keel_model *m = b->m;
    if (m->n_mats == b->cap_mats) {
        b->cap_mats = b->cap_mats ? 2 * b->cap_mats : 64;
        m->mats = keel_xrealloc(m->mats, (size_t)b->cap_mats * sizeof *m->mats);
    }
    keel_mat_info *mi = &m->mats[m->n_mats++];
    memset(mi, 0, sizeof *mi);
    size_t n = strlen(b->prefix) + strlen(path) + 1;
    mi->path = keel_xmalloc(n);
    snprintf(mi->path, n, "%s%s", b->prefix, path);
    mi->ndim = n_expert ? 3 : 2;
    int64_t shp[3] = {n_expert, out, in};
    memcpy(mi->shape, n_expert ? shp : shp + 1, (size_t)mi->ndim * sizeof(int64_t));
    mi->bits = q->bits;
    mi->group = q->group;
    mi->sdt = q->sdt;
    mi->bytes = bytes;
}

/* Binds matrix `path` of logical shape (n_expert?, out, in); router: float without a map entry is allowed. */
static keel_code bind_mat(binder *b, const char *path, int n_expert, int out, int in, bool router, keel_qmat *q,
                          size_t *w_stride, size_t *s_stride) {
    char wn[256], sn[256], bn[256];
    fmt(wn, sizeof wn, "%s.weight", path);
    fmt(sn, sizeof sn, "%s.scales", path);
    fmt(bn, sizeof bn, "%s.biases", path);
    const keel_st_tensor *tw = find(b, wn), *ts = find(b, sn), *tb = find(b, bn);
    if (!tw) return missing(b, wn);
    const char *file = keel_st_tensor_file(b->st, tw);
    int quant, bits, group;
    keel_qmap_lookup(b->qm, path, &quant, &bits, &group);
    int nd = n_expert ? 3 : 2, E = n_expert ? n_expert : 1;
    int64_t want[3];
    int64_t *lead = want;
    if (n_expert) *lead++ = n_expert;
    lead[0] = out;
    memset(q, 0, sizeof *q);
    q->n = out;
    q->k = in;
    size_t bytes = tw->nbytes;
    if (ts) {
        if (!b->qm->present)
            return keel_err_set(b->err, KEEL_E_MISSING, "%s: matrix %s is quantized (%s exists) but %s has no quantization map",
                                file, path, sn, b->mapname);
        if (!quant)
            return keel_err_set(b->err, KEEL_E_FORMAT,
                                "%s: matrix %s is quantized (%s exists) but the quantization map in %s says false (float)",
                                file, path, sn, b->mapname);
        if (!tb) return missing(b, bn);
        if (in % group)
            return keel_err_set(b->err, KEEL_E_SHAPE,
                                "%s: matrix %s: input width %d is not a multiple of group %d from the quantization map",
                                file, path, in, group);
        if (tw->dtype != KEEL_DT_U32)
            return keel_err_set(b->err, KEEL_E_FORMAT, "%s: tensor %s: expected U32 packed codes, found %s", file, wn,
                                keel_dtype_name(tw->dtype));
        lead[1] = (int64_t)keel_quant_row_words(in, bits);
        if (!shape_eq(tw, nd, want)) {
            char what[160] = "";
            int64_t cols = tw->ndim >= 1 ? tw->shape[tw->ndim - 1] : 0;
            if (tw->ndim == nd && (cols * 32) % in == 0 && cols * 32 / in != bits)
                fmt(what, sizeof what, " (bits=%d from the map for %d inputs; the file's width means bits=%lld)",
                         bits, in, (long long)(cols * 32 / in));
            else
                fmt(what, sizeof what, " (bits=%d from the map for %d inputs)", bits, in);
            return shape_err(b, tw, nd, want, what);
        }
        if (!is_float_dt(ts->dtype))
            return keel_err_set(b->err, KEEL_E_FORMAT, "%s: tensor %s: expected BF16, F16 or F32 scales, found %s",
                                keel_st_tensor_file(b->st, ts), sn, keel_dtype_name(ts->dtype));
        if (tb->dtype != ts->dtype)
            return keel_err_set(b->err, KEEL_E_FORMAT, "%s: tensor %s: expected %s like %s, found %s",
                                keel_st_tensor_file(b->st, tb), bn, keel_dtype_name(ts->dtype), sn,
                                keel_dtype_name(tb->dtype));
        lead[1] = in / group;
        for (int i = 0; i < 2; i++) {
            const keel_st_tensor *t = i ? tb : ts;
            if (!shape_eq(t, nd, want)) {
                char what[160] = "";
                int64_t cols = t->ndim >= 1 ? t->shape[t->ndim - 1] : 0;
                if (t->ndim == nd && cols > 0 && in % cols == 0 && in / cols != group)
                    fmt(what, sizeof what, " (group=%d from the map for %d inputs; the file's means group=%lld)",
                             group, in, (long long)(in / cols));
                else
                    fmt(what, sizeof what, " (group=%d from the map for %d inputs)", group, in);
                return shape_err(b, t, nd, want, what);
            }
        }
        q->bits = bits;
        q->group = group;
        q->sdt = ts->dtype;
        q->scales = ts->data;
        q->biases = tb->data;
        bytes += ts->nbytes + tb->nbytes;
        if (s_stride) *s_stride = ts->nbytes / (size_t)E;
    } else {
        if (tb)
            return keel_err_set(b->err, KEEL_E_MISSING, "%s: tensor %s exists but %s is missing", file, bn, sn);
        if (b->qm->present && quant && !router)
            return keel_err_set(b->err, KEEL_E_FORMAT,
                                "%s: matrix %s is stored in float (%s, no %s) but the quantization map in %s says "
                                "bits=%d group=%d; a float matrix must be marked false",
                                file, path, keel_dtype_name(tw->dtype), sn, b->mapname, bits, group);
        if (!is_float_dt(tw->dtype))
            return keel_err_set(b->err, KEEL_E_FORMAT,
                                "%s: tensor %s: a float matrix must be BF16, F16 or F32, found %s (no %s)", file, wn,
                                keel_dtype_name(tw->dtype), sn);
        lead[1] = in;
        if (!shape_eq(tw, nd, want)) return shape_err(b, tw, nd, want, " (float matrix)");
        q->sdt = tw->dtype;
        if (s_stride) *s_stride = 0;
    }
    q->w = tw->data;
    if (w_stride) *w_stride = tw->nbytes / (size_t)E;
    add_info(b, path, n_expert, out, in, q, bytes);
    return KEEL_OK;
}

static keel_code bind_attn(binder *b, const keel_config *c, const char *pre, keel_attn_w *a) {
    char p[256], n[272];
    const char *names[4] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    keel_qmat *mats[4] = {&a->q, &a->k, &a->v, &a->o};
    keel_vec *bias[4] = {&a->q_bias, &a->k_bias, &a->v_bias, &a->o_bias};
    int outs[4] = {c->n_head * c->head_dim, c->n_kv_head * c->head_dim, c->n_kv_head * c->head_dim, c->hidden};
    int ins[4] = {c->hidden, c->hidden, c->hidden, c->n_head * c->head_dim};
    keel_code rc;
    for (int i = 0; i < 4; i++) {
        fmt(p, sizeof p, "%s.%s", pre, names[i]);
        if ((rc = bind_mat(b, p, 0, outs[i], ins[i], false, mats[i], NULL, NULL))) return rc;
        if (c->attn_bias) {
            fmt(n, sizeof n, "%s.bias", p);
            if ((rc = bind_vec1(b, n, outs[i], bias[i]))) return rc;
        }
    }
    return KEEL_OK;
}

static keel_code bind_mlp(binder *b, const char *pre, int hidden, int inter, keel_mlp_w *w) {
    char p[256];
    keel_code rc;
    fmt(p, sizeof p, "%s.up_proj", pre);
    if ((rc = bind_mat(b, p, 0, inter, hidden, false, &w->up, NULL, NULL))) return rc;
    fmt(p, sizeof p, "%s.down_proj", pre);
    return bind_mat(b, p, 0, hidden, inter, false, &w->down, NULL, NULL);
}

static keel_code bind_moe(binder *b, const keel_config *c, const char *pre, keel_moe_w *w) {
    char p[256];
    keel_code rc;
    fmt(p, sizeof p, "%s.gate", pre);
    if ((rc = bind_mat(b, p, 0, c->n_experts, c->hidden, true, &w->gate, NULL, NULL))) return rc;
    fmt(p, sizeof p, "%s.gate.e_score_correction_bias", pre);
    if ((rc = bind_vec1(b, p, c->n_experts, &w->corr_bias))) return rc;
    keel_qstack *st[2] = {&w->fc1, &w->fc2};
    int outs[2] = {c->moe_inter, c->hidden}, ins[2] = {c->hidden, c->moe_inter};
    for (int i = 0; i < 2; i++) {
        fmt(p, sizeof p, "%s.switch_mlp.fc%d", pre, i + 1);
        st[i]->n_expert = c->n_experts;
        if ((rc = bind_mat(b, p, c->n_experts, outs[i], ins[i], false, &st[i]->m, &st[i]->w_stride,
                           &st[i]->s_stride)))
            return rc;
    }
    fmt(p, sizeof p, "%s.shared_experts", pre);
    return bind_mlp(b, p, c->hidden, c->shared_inter, &w->shared);
}

static keel_code bind_mamba(binder *b, const keel_config *c, const char *pre, keel_mamba_w *w) {
    char p[256];
    keel_code rc;
#define PATH(s) (fmt(p, sizeof p, "%s.%s", pre, s), p)
    if ((rc = bind_mat(b, PATH("in_proj"), 0, c->in_proj_dim, c->hidden, false, &w->in_proj, NULL, NULL))) return rc;
    if (c->mamba_bias && (rc = bind_vec1(b, PATH("in_proj.bias"), c->in_proj_dim, &w->in_bias))) return rc;
    int64_t cs[3] = {c->conv_dim, c->conv_kernel, 1};
    if ((rc = bind_vec(b, PATH("conv1d.weight"), 3, cs, &w->conv_w))) return rc;
    if (c->conv_bias && (rc = bind_vec1(b, PATH("conv1d.bias"), c->conv_dim, &w->conv_b))) return rc;
    if ((rc = bind_vec1(b, PATH("dt_bias"), c->mamba_heads, &w->dt_bias)) ||
        (rc = bind_vec1(b, PATH("A_log"), c->mamba_heads, &w->A_log)) ||
        (rc = bind_vec1(b, PATH("D"), c->mamba_heads, &w->D)) ||
        (rc = bind_vec1(b, PATH("norm.weight"), c->d_inner, &w->norm)))
        return rc;
    if ((rc = bind_mat(b, PATH("out_proj"), 0, c->hidden, c->d_inner, false, &w->out_proj, NULL, NULL))) return rc;
    if (c->mamba_bias && (rc = bind_vec1(b, PATH("out_proj.bias"), c->hidden, &w->out_bias))) return rc;
#undef PATH
    return KEEL_OK;
}

static const char *kind_word(char k) {
    switch (k) {
    case KEEL_MIXER_MAMBA: return "Mamba-2";
    case KEEL_MIXER_ATTN: return "attention";
    case KEEL_MIXER_MLP: return "MLP";
    default: return "MoE";
    }
}

/* Every tensor of the file must have been bound. */
static keel_code check_unused(binder *b, const char *what) {
    for (int i = 0; i < b->st->n_tensors; i++)
        if (!b->used[i])
            return keel_err_set(b->err, KEEL_E_UNUSED, "%s: tensor %s is not used by %s",
                                keel_st_tensor_file(b->st, &b->st->tensors[i]), b->st->tensors[i].name, what);
    return KEEL_OK;
}

static keel_code bind_model(keel_model *m, const char *file, keel_err *err, int *cap_mats) {
    const keel_config *c = &m->cfg;
    binder b = {m, &m->st, &m->qmap, file, "", "config.json", "the model", NULL, *cap_mats, err};
    b.used = keel_xcalloc((size_t)(m->st.n_tensors ? m->st.n_tensors : 1), sizeof(bool));
    char layer[96], pre[96];
    keel_code rc;
    b.layer = "the embedding table";
    if ((rc = bind_mat(&b, "backbone.embeddings", 0, c->vocab, c->hidden, false, &m->embed, NULL, NULL))) goto out;
    m->layers = keel_xcalloc((size_t)c->n_layer, sizeof *m->layers);
    for (int i = 0; i < c->n_layer && !rc; i++) {
        keel_layer *L = &m->layers[i];
        L->kind = (keel_mixer)c->pattern[i];
        fmt(layer, sizeof layer, "layer %d, '%c' (%s) in the pattern %s", i, c->pattern[i],
                 kind_word(c->pattern[i]), c->pattern);
        b.layer = layer;
        fmt(pre, sizeof pre, "backbone.layers.%d.norm.weight", i);
        if ((rc = bind_vec1(&b, pre, c->hidden, &L->norm))) break;
        fmt(pre, sizeof pre, "backbone.layers.%d.mixer", i);
        switch (L->kind) {
        case KEEL_MIXER_MAMBA: rc = bind_mamba(&b, c, pre, &L->mamba); break;
        case KEEL_MIXER_ATTN: rc = bind_attn(&b, c, pre, &L->attn); break;
        case KEEL_MIXER_MLP: rc = bind_mlp(&b, pre, c->hidden, c->mlp_inter, &L->mlp); break;
        case KEEL_MIXER_MOE: rc = bind_moe(&b, c, pre, &L->moe); break;
        }
    }
    if (rc) goto out;
    b.layer = "the final norm";
    if ((rc = bind_vec1(&b, "backbone.norm_f.weight", c->hidden, &m->norm_f))) goto out;
    if (c->tie_embeddings) {
        m->lm_head = m->embed;
    } else {
        b.layer = "the output head (tie_word_embeddings is false)";
        if ((rc = bind_mat(&b, "lm_head", 0, c->vocab, c->hidden, false, &m->lm_head, NULL, NULL))) goto out;
    }
    fmt(layer, sizeof layer, "a nemotron_h model of pattern %s%s", c->pattern,
             c->tie_embeddings ? " with tied embeddings" : "");
    rc = check_unused(&b, layer);
out:
    free(b.used);
    *cap_mats = b.cap_mats;
    return rc;
}

static keel_code bind_mtp(keel_model *m, keel_err *err, int *cap_mats) {
    const keel_config *c = &m->cfg;
    const char *file = m->mtp_path;
    if (!c->n_head)
        return keel_err_set(err, KEEL_E_MISSING,
                            "config.json: field num_attention_heads is missing (the MTP head %s has an attention layer)",
                            file);
    if (!c->n_experts)
        return keel_err_set(err, KEEL_E_MISSING,
                            "config.json: field n_routed_experts is missing (the MTP head %s has a MoE layer)", file);
    binder b = {m, &m->mtp_st, &m->mtp_qmap, file, "mtp.", file, "the MTP head", NULL, *cap_mats, err};
    b.used = keel_xcalloc((size_t)(m->mtp_st.n_tensors ? m->mtp_st.n_tensors : 1), sizeof(bool));
    keel_mtp_w *w = &m->mtp;
    keel_code rc;
    b.layer = "the MTP head's layer 0 (attention)";
    if ((rc = bind_vec1(&b, "layers.0.enorm.weight", c->hidden, &w->enorm)) ||
        (rc = bind_vec1(&b, "layers.0.hnorm.weight", c->hidden, &w->hnorm)) ||
        (rc = bind_mat(&b, "layers.0.eh_proj", 0, c->hidden, 2 * c->hidden, false, &w->eh_proj, NULL, NULL)) ||
        (rc = bind_vec1(&b, "layers.0.norm.weight", c->hidden, &w->norm0)) ||
        (rc = bind_attn(&b, c, "layers.0.mixer", &w->attn)))
        goto out;
    b.layer = "the MTP head's layer 1 (MoE)";
    if ((rc = bind_vec1(&b, "layers.1.norm.weight", c->hidden, &w->norm1)) ||
        (rc = bind_moe(&b, c, "layers.1.mixer", &w->moe)) ||
        (rc = bind_vec1(&b, "layers.1.final_layernorm.weight", c->hidden, &w->final_norm)))
        goto out;
    w->bits = m->mtp_qmap.bits;
    w->group = m->mtp_qmap.group;
    rc = check_unused(&b, "the nemotron_h MTP head");
out:
    free(b.used);
    *cap_mats = b.cap_mats;
    return rc;
}

/* config.json and its quantization map ("quantization", else the legacy "quantization_config"). */
static keel_code load_config(keel_model *m, const char *dir, keel_err *err) {
    char *cpath = path_join(dir, "config.json"), *text = NULL;
    keel_code rc = keel_read_file(cpath, &text, NULL, err);
    if (!rc) rc = keel_config_parse(&m->cfg, text, cpath, err);
    if (!rc) {
        cJSON *root = cJSON_Parse(text);
        KEEL_ASSERT(root); /* parsed above */
        const cJSON *q = cJSON_GetObjectItemCaseSensitive(root, "quantization");
        if (!q || cJSON_IsNull(q)) q = cJSON_GetObjectItemCaseSensitive(root, "quantization_config");
        if (q && !cJSON_IsNull(q)) {
            char *qs = cJSON_PrintUnformatted(q);
            rc = keel_qmap_parse(&m->qmap, qs, cpath, err);
            free(qs);
        }
        cJSON_Delete(root);
    }
    free(text);
    free(cpath);
    return rc;
}

static keel_code load_mtp(keel_model *m, const char *path, keel_err *err) {
    m->mtp_path = keel_xstrdup(path);
    keel_code rc = keel_st_open(&m->mtp_st, path, err);
    if (rc) return rc;
    const char *qs = keel_st_meta_get(&m->mtp_st, "quantization");
    if (qs && (rc = keel_qmap_parse(&m->mtp_qmap, qs, path, err))) return rc;
    m->has_mtp = true;
    return KEEL_OK;
}

keel_code keel_model_load(keel_model *m, const char *dir, const char *mtp_path, keel_err *err) {
    memset(m, 0, sizeof *m);
    m->dir = keel_xstrdup(dir);
    int cap = 0;
    keel_code rc = load_config(m, dir, err);
    if (!rc) rc = keel_st_open(&m->st, dir, err);
    if (!rc) {
        const char *file = m->st.n_shards == 1 ? m->st.shards[0].path : dir;
        rc = bind_model(m, file, err, &cap);
    }
    if (!rc) {
        char *def = NULL;
        if (!mtp_path) {
            def = path_join(dir, "mtp.safetensors");
            if (access(def, F_OK) == 0) mtp_path = def;
        }
        if (mtp_path && *mtp_path) {
            rc = load_mtp(m, mtp_path, err);
            if (!rc) rc = bind_mtp(m, err, &cap);
        }
        free(def);
    }
    if (rc) keel_model_free(m);
    return rc;
}

void keel_model_free(keel_model *m) {
    if (!m) return;
    keel_qmap_free(&m->qmap);
    keel_qmap_free(&m->mtp_qmap);
    keel_st_free(&m->st);
    keel_st_free(&m->mtp_st);
    free(m->dir);
    free(m->mtp_path);
    free(m->layers);
    for (int i = 0; i < m->n_mats; i++) free(m->mats[i].path);
    free(m->mats);
    memset(m, 0, sizeof *m);
}

void keel_model_totals(const keel_model *m, bool include_mtp, size_t *bytes, double *bits_per_weight) {
    size_t by = 0;
    double w = 0;
    for (int i = 0; i < m->n_mats; i++) {
        const keel_mat_info *mi = &m->mats[i];
        if (!include_mtp && !strncmp(mi->path, "mtp.", 4)) continue;
        by += mi->bytes;
        double n = 1;
        for (int d = 0; d < mi->ndim; d++) n *= (double)mi->shape[d];
        w += n;
    }
    if (bytes) *bytes = by;
    if (bits_per_weight) *bits_per_weight = w > 0 ? 8.0 * (double)by / w : 0.0;
}
