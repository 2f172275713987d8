/* cli: `keel quantize IN OUT --bits B --group G [--scales bf16|f16|f32] [--plan PLAN.json]`: quantizes the float
 * matrices of a safetensors checkpoint with MLX's affine quantizer, per-module widths from an optional plan. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "format/format.h"

#define CMD "quantize"

/* What happens to one input tensor. */
typedef struct qplan {
    bool matrix;  /* a 2-D or 3-D float ".weight" tensor */
    bool quant;   /* quantized (else copied as-is) */
    bool planned; /* named in the plan */
    int bits, group;
} qplan;

/* One plan entry: module path -> {bits, group_size} or false. */
typedef struct plan_entry {
    char *path;
    bool keep;
    int bits, group;
} plan_entry;

static bool is_float(keel_dtype dt) { return dt == KEEL_DT_F32 || dt == KEEL_DT_BF16 || dt == KEEL_DT_F16; }

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* 2-D matrices and 3-D stacks of them (E, out, in); a 3-D tensor whose last dim is below the smallest group is a
 * convolution kernel such as Mamba's conv1d (C, K, 1), not a matrix. */
static bool is_matrix(const keel_st_tensor *t) {
    if (!is_float(t->dtype) || !ends_with(t->name, ".weight") || t->numel == 0) return false;
    if (t->ndim == 2) return true;
    return t->ndim == 3 && t->shape[2] >= 32;
}

static void shape_str(const keel_st_tensor *t, char *buf, size_t cap) {
    size_t o = 0;
    buf[0] = 0;
    for (int d = 0; d < t->ndim && o < cap; d++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%lld", d ? " x " : "", (long long)t->shape[d]);
}

static bool parse_int(const char *s, int *out) {
    long v;
    if (!keel_cli_parse_long(s, -1000000, 1000000, &v)) return false;
    *out = (int)v;
    return true;
}

static const char *BITS_ALLOWED = "2, 3, 4, 5, 6 or 8";
static const char *GROUPS_ALLOWED = "32, 64 or 128";

/* Reads one integer field of a plan entry; absent keeps *out. */
static keel_code plan_int(const cJSON *obj, const char *key, const char *file, const char *path, int *out,
                          keel_err *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v) return KEEL_OK;
    if (!cJSON_IsNumber(v) || v->valuedouble != (double)(int)v->valuedouble)
        return keel_err_set(err, KEEL_E_FORMAT, "plan %s: entry '%s': \"%s\" must be an integer", file, path, key);
    *out = (int)v->valuedouble;
    return KEEL_OK;
}

static keel_code load_plan(const char *file, int gbits, int ggroup, plan_entry **out, int *n_out, keel_err *err) {
    *out = NULL;
    *n_out = 0;
    char *text = NULL;
    size_t len = 0;
    keel_code rc = keel_read_file(file, &text, &len, err);
    if (rc != KEEL_OK) return keel_err_prefix(err, "plan: ");
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!root) return keel_err_set(err, KEEL_E_FORMAT, "plan %s: not valid JSON", file);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return keel_err_set(err, KEEL_E_FORMAT, "plan %s: expected a JSON object of module path -> "
                                                "{\"bits\": B, \"group_size\": G} or false", file);
    }
    int n = cJSON_GetArraySize(root);
    plan_entry *pe = keel_xcalloc((size_t)(n > 0 ? n : 1), sizeof *pe);
    int i = 0;
    rc = KEEL_OK;
    for (const cJSON *c = root->child; c && rc == KEEL_OK; c = c->next, i++) {
        plan_entry *e = &pe[i];
        e->path = keel_xstrdup(c->string);
        e->bits = gbits;
        e->group = ggroup;
        if (cJSON_IsFalse(c)) {
            e->keep = true;
        } else if (cJSON_IsTrue(c)) {
            /* true: the global width, as mlx-lm writes it */
        } else if (cJSON_IsObject(c)) {
            for (const cJSON *f = c->child; f && rc == KEEL_OK; f = f->next)
                if (strcmp(f->string, "bits") && strcmp(f->string, "group_size") && strcmp(f->string, "mode"))
                    rc = keel_err_set(err, KEEL_E_FORMAT,
                                      "plan %s: entry '%s': unknown key \"%s\" (expected bits, group_size, mode)",
                                      file, c->string, f->string);
            const cJSON *mode = cJSON_GetObjectItemCaseSensitive(c, "mode");
            if (rc == KEEL_OK && mode && !(cJSON_IsString(mode) && strcmp(mode->valuestring, "affine") == 0))
                rc = keel_err_set(err, KEEL_E_UNSUPPORTED, "plan %s: entry '%s': mode must be \"affine\"", file,
                                  c->string);
            if (rc == KEEL_OK) rc = plan_int(c, "bits", file, c->string, &e->bits, err);
            if (rc == KEEL_OK) rc = plan_int(c, "group_size", file, c->string, &e->group, err);
            if (rc == KEEL_OK && !keel_quant_bits_ok(e->bits))
                rc = keel_err_set(err, KEEL_E_ARG, "plan %s: entry '%s': bits %d, expected %s", file, c->string,
                                  e->bits, BITS_ALLOWED);
            if (rc == KEEL_OK && !keel_quant_group_ok(e->group))
                rc = keel_err_set(err, KEEL_E_ARG, "plan %s: entry '%s': group_size %d, expected %s", file,
                                  c->string, e->group, GROUPS_ALLOWED);
        } else {
            rc = keel_err_set(err, KEEL_E_FORMAT,
                              "plan %s: entry '%s': expected {\"bits\": B, \"group_size\": G}, true or false", file,
                              c->string);
        }
    }
    cJSON_Delete(root);
    *out = pe;
    *n_out = i;
    return rc;
}

static void plan_free(plan_entry *pe, int n) {
    for (int i = 0; pe && i < n; i++) free(pe[i].path);
    free(pe);
}

/* Decides every tensor's fate; errors name the tensor, its shape and what the plan or the flags asked for. */
static keel_code make_plan(const keel_st *st, const char *in, int gbits, int ggroup, const plan_entry *pe, int npe,
                           const char *planfile, qplan *qp, keel_err *err) {
    char shp[128];
    for (int i = 0; i < st->n_tensors; i++) {
        const keel_st_tensor *t = &st->tensors[i];
        qp[i] = (qplan){.matrix = is_matrix(t), .bits = gbits, .group = ggroup};
        qp[i].quant = qp[i].matrix;
    }
    for (int p = 0; p < npe; p++) {
        char name[1024];
        int len = snprintf(name, sizeof name, "%s.weight", pe[p].path);
        const keel_st_tensor *t = len < (int)sizeof name ? keel_st_find(st, name) : NULL;
        if (!t)
            return keel_err_set(err, KEEL_E_MISSING, "plan %s: entry '%s': no tensor '%s.weight' in %s", planfile,
                                pe[p].path, pe[p].path, in);
        int i = (int)(t - st->tensors);
        shape_str(t, shp, sizeof shp);
        if (!qp[i].matrix && !pe[p].keep)
            return keel_err_set(err, KEEL_E_ARG,
                                "plan %s: entry '%s': tensor '%s' is %s (%s), not a 2-D or 3-D float matrix", planfile,
                                pe[p].path, t->name, keel_dtype_name(t->dtype), shp);
        qp[i].planned = true;
        qp[i].quant = qp[i].matrix && !pe[p].keep;
        qp[i].bits = pe[p].bits;
        qp[i].group = pe[p].group;
    }
    for (int i = 0; i < st->n_tensors; i++) {
        const keel_st_tensor *t = &st->tensors[i];
        if (!qp[i].quant) continue;
        shape_str(t, shp, sizeof shp);
        int64_t k = t->shape[t->ndim - 1], rows = t->numel / k;
        if (k % qp[i].group)
            return keel_err_set(err, KEEL_E_SHAPE,
                                "tensor '%s' (%s): last dim %lld is not a multiple of group %d%s; pick another "
                                "%s or keep it float with a plan entry \"%.*s\": false",
                                t->name, shp, (long long)k, qp[i].group, qp[i].planned ? " (from the plan)" : "",
                                qp[i].planned ? "group_size" : "--group", (int)(strlen(t->name) - strlen(".weight")),
                                t->name);
        if (rows > INT32_MAX || k > INT32_MAX)
            return keel_err_set(err, KEEL_E_SHAPE, "tensor '%s' (%s): too large to quantize", t->name, shp);
        const char *suffixes[2] = {".scales", ".biases"};
        for (int s = 0; s < 2; s++) {
            char other[1024];
            snprintf(other, sizeof other, "%.*s%s", (int)(strlen(t->name) - strlen(".weight")), t->name, suffixes[s]);
            if (keel_st_find(st, other))
                return keel_err_set(err, KEEL_E_FORMAT, "tensor '%s' is float but %s already holds '%s'", t->name,
                                    in, other);
        }
    }
    return KEEL_OK;
}

/* Buffers that must outlive keel_st_writer_write. */
typedef struct bufs {
    int n, cap;
    void **p;
} bufs;

static void *bufs_add(bufs *b, size_t n) {
    if (b->n == b->cap) {
        b->cap = b->cap ? 2 * b->cap : 64;
        b->p = keel_xrealloc(b->p, (size_t)b->cap * sizeof *b->p);
    }
    return b->p[b->n++] = keel_xmalloc(n);
}

static void bufs_free(bufs *b) {
    for (int i = 0; i < b->n; i++) free(b->p[i]);
    free(b->p);
}

/* Quantizes tensor t into name.weight / .scales / .biases added to w. */
static keel_code quantize_tensor(const keel_st *st, const keel_st_tensor *t, const qplan *q, bool sdt_set,
                                 keel_dtype sdt_flag, keel_st_writer *w, bufs *b, keel_err *err) {
    keel_dtype sdt = sdt_set ? sdt_flag : t->dtype; /* MLX keeps scales in the weight's dtype */
    int64_t k = t->shape[t->ndim - 1], rows = t->numel / k, ng = k / q->group;
    float *wf = keel_xmalloc((size_t)t->numel * sizeof *wf);
    for (int64_t i = 0; i < t->numel; i++) {
        wf[i] = keel_dtype_get_f32(t->dtype, t->data, (size_t)i);
        if (!isfinite(wf[i])) {
            free(wf);
            return keel_err_set(err, KEEL_E_RANGE, "%s: tensor '%s': element %lld (row %lld, column %lld) is %g, "
                                "expected a finite value", keel_st_tensor_file(st, t), t->name, (long long)i,
                                (long long)(i / k), (long long)(i % k), (double)keel_dtype_get_f32(t->dtype, t->data, (size_t)i));
        }
    }
    uint32_t *codes = bufs_add(b, (size_t)rows * keel_quant_row_words((int)k, q->bits) * sizeof(uint32_t));
    void *scales = bufs_add(b, (size_t)(rows * ng) * keel_dtype_size(sdt));
    void *biases = bufs_add(b, (size_t)(rows * ng) * keel_dtype_size(sdt));
    keel_quant_quantize(wf, (int)rows, (int)k, q->bits, q->group, sdt, codes, scales, biases);
    free(wf);
    for (int64_t i = 0; i < rows * ng; i++) {
        float s = keel_dtype_get_f32(sdt, scales, (size_t)i), bv = keel_dtype_get_f32(sdt, biases, (size_t)i);
        if (!isfinite(s) || !isfinite(bv))
            return keel_err_set(err, KEEL_E_RANGE,
                                "tensor '%s': row %lld group %lld: scale %g and bias %g, expected finite %s values%s",
                                t->name, (long long)(i / ng), (long long)(i % ng), (double)s, (double)bv,
                                keel_dtype_name(sdt), sdt == KEEL_DT_F32 ? "" : " (use --scales f32)");
    }
    size_t base = strlen(t->name) - strlen(".weight");
    char *name = keel_xmalloc(base + 16);
    int64_t shape[KEEL_ST_MAX_DIMS];
    for (int d = 0; d < t->ndim; d++) shape[d] = t->shape[d];
    keel_code rc;
    shape[t->ndim - 1] = (int64_t)keel_quant_row_words((int)k, q->bits);
    snprintf(name, base + 16, "%.*s.weight", (int)base, t->name);
    rc = keel_st_writer_add(w, name, KEEL_DT_U32, t->ndim, shape, codes, err);
    shape[t->ndim - 1] = ng;
    snprintf(name, base + 16, "%.*s.scales", (int)base, t->name);
    if (rc == KEEL_OK) rc = keel_st_writer_add(w, name, sdt, t->ndim, shape, scales, err);
    snprintf(name, base + 16, "%.*s.biases", (int)base, t->name);
    if (rc == KEEL_OK) rc = keel_st_writer_add(w, name, sdt, t->ndim, shape, biases, err);
    free(name);
    return rc;
}

/* The "quantization" metadata: global width plus an entry per matrix that differs from it. */
static char *quant_meta(const keel_st *st, const qplan *qp, int gbits, int ggroup) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "group_size", ggroup);
    cJSON_AddNumberToObject(o, "bits", gbits);
    cJSON_AddStringToObject(o, "mode", "affine");
    for (int i = 0; i < st->n_tensors; i++) {
        if (!qp[i].matrix) continue;
        const char *nm = st->tensors[i].name;
        char path[1024];
        snprintf(path, sizeof path, "%.*s", (int)(strlen(nm) - strlen(".weight")), nm);
        if (!qp[i].quant) {
            if (qp[i].planned) cJSON_AddFalseToObject(o, path);
        } else if (qp[i].bits != gbits || qp[i].group != ggroup) {
            cJSON *e = cJSON_AddObjectToObject(o, path);
            cJSON_AddNumberToObject(e, "group_size", qp[i].group);
            cJSON_AddNumberToObject(e, "bits", qp[i].bits);
        }
    }
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    KEEL_ASSERT(s);
    return s;
}

static int usage_fail(const char *what) {
    return keel_cli_fail(CMD, "%s\nusage: keel quantize IN OUT --bits B --group G [--scales bf16|f16|f32] "
                              "[--plan PLAN.json]", what);
}

int keel_cli_quantize(int argc, char **argv) {
    const char *in = NULL, *out = NULL, *planfile = NULL, *bits_s = NULL, *group_s = NULL, *sdt_s = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char **slot = !strcmp(a, "--bits")     ? &bits_s
                            : !strcmp(a, "--group")  ? &group_s
                            : !strcmp(a, "--scales") ? &sdt_s
                            : !strcmp(a, "--plan")   ? &planfile
                                                     : NULL;
        if (slot) {
            if (i + 1 >= argc) return keel_cli_fail(CMD, "%s needs a value", a);
            *slot = argv[++i];
        } else if (a[0] == '-' && a[1]) {
            return keel_cli_fail(CMD, "unknown option '%s' (expected --bits, --group, --scales, --plan)", a);
        } else if (!in) {
            in = a;
        } else if (!out) {
            out = a;
        } else {
            return keel_cli_fail(CMD, "unexpected argument '%s' (IN and OUT already given)", a);
        }
    }
    if (!in || !out) return usage_fail("missing IN or OUT");
    if (!bits_s) return usage_fail("missing --bits");
    if (!group_s) return usage_fail("missing --group");
    int gbits, ggroup;
    if (!parse_int(bits_s, &gbits) || !keel_quant_bits_ok(gbits))
        return keel_cli_fail(CMD, "--bits %s: expected %s", bits_s, BITS_ALLOWED);
    if (!parse_int(group_s, &ggroup) || !keel_quant_group_ok(ggroup))
        return keel_cli_fail(CMD, "--group %s: expected %s", group_s, GROUPS_ALLOWED);
    keel_dtype sdt = KEEL_DT_BF16;
    if (sdt_s) {
        if (!strcmp(sdt_s, "bf16") || !strcmp(sdt_s, "BF16")) sdt = KEEL_DT_BF16;
        else if (!strcmp(sdt_s, "f16") || !strcmp(sdt_s, "F16")) sdt = KEEL_DT_F16;
        else if (!strcmp(sdt_s, "f32") || !strcmp(sdt_s, "F32")) sdt = KEEL_DT_F32;
        else return keel_cli_fail(CMD, "--scales %s: expected bf16, f16 or f32", sdt_s);
    }

    keel_err err = {0};
    plan_entry *pe = NULL;
    int npe = 0;
    if (planfile && load_plan(planfile, gbits, ggroup, &pe, &npe, &err) != KEEL_OK) {
        plan_free(pe, npe);
        return keel_cli_fail(CMD, "%s", err.msg);
    }
    keel_st st;
    if (keel_st_open(&st, in, &err) != KEEL_OK) {
        plan_free(pe, npe);
        keel_st_free(&st);
        return keel_cli_fail(CMD, "%s", err.msg);
    }
    qplan *qp = keel_xcalloc((size_t)(st.n_tensors > 0 ? st.n_tensors : 1), sizeof *qp);
    keel_st_writer w;
    keel_st_writer_init(&w);
    bufs b = {0};
    char *meta = NULL;
    keel_code rc = make_plan(&st, in, gbits, ggroup, pe, npe, planfile ? planfile : "", qp, &err);
    int nq = 0, nkept = 0, ncopied = 0;
    int64_t qparams = 0;
    for (int i = 0; rc == KEEL_OK && i < st.n_tensors; i++) {
        const keel_st_tensor *t = &st.tensors[i];
        if (qp[i].quant) {
            rc = quantize_tensor(&st, t, &qp[i], sdt_s != NULL, sdt, &w, &b, &err);
            nq++;
            qparams += t->numel;
        } else {
            rc = keel_st_writer_add(&w, t->name, t->dtype, t->ndim, t->shape, t->data, &err);
            if (qp[i].matrix) nkept++;
            else ncopied++;
        }
    }
    if (rc == KEEL_OK) {
        for (int i = 0; i < st.n_meta; i++)
            if (strcmp(st.meta[i].key, "quantization")) keel_st_writer_meta(&w, st.meta[i].key, st.meta[i].value);
        meta = quant_meta(&st, qp, gbits, ggroup);
        keel_st_writer_meta(&w, "quantization", meta);
        rc = keel_st_writer_write(&w, out, &err);
    }
    if (rc == KEEL_OK)
        printf("quantized %d matrices (%lld parameters) to %d bits, group %d; kept %d float; copied %d other "
               "tensors; wrote %s\n",
               nq, (long long)qparams, gbits, ggroup, nkept, ncopied, out);
    free(meta);
    bufs_free(&b);
    keel_st_writer_free(&w);
    free(qp);
    keel_st_free(&st);
    plan_free(pe, npe);
    return rc == KEEL_OK ? 0 : keel_cli_fail(CMD, "%s", err.msg);
}
