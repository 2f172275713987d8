/* keel info: a checkpoint's architecture and every matrix's width, group, scale dtype and bytes (text or JSON). */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "model/model.h"

static int count_kind(const keel_config *c, char k) {
    int n = 0;
    for (int i = 0; i < c->n_layer; i++) n += c->pattern[i] == k;
    return n;
}

static bool has_mtp_mat(const keel_model *m, int i) { return !strncmp(m->mats[i].path, "mtp.", 4); }

static void shape_text(const keel_mat_info *mi, char *buf, size_t n) {
    if (mi->ndim == 3)
        snprintf(buf, n, "%lldx%lldx%lld", (long long)mi->shape[0], (long long)mi->shape[1], (long long)mi->shape[2]);
    else
        snprintf(buf, n, "%lldx%lld", (long long)mi->shape[0], (long long)mi->shape[1]);
}

static void print_text(const keel_model *m) {
    const keel_config *c = &m->cfg;
    printf("model     %s\n", m->dir);
    printf("arch      nemotron_h, %d layers, pattern %s (%d Mamba-2, %d attention, %d MLP, %d MoE)\n", c->n_layer,
           c->pattern, count_kind(c, 'M'), count_kind(c, '*'), count_kind(c, '-'), count_kind(c, 'E'));
    printf("dims      hidden %d, vocab %d, max context %d, norm eps %g, tied embeddings %s\n", c->hidden, c->vocab,
           c->max_ctx, (double)c->norm_eps, c->tie_embeddings ? "yes" : "no");
    if (c->mamba_heads)
        printf("mamba     %d heads x %d (d_inner %d), %d groups, state %d, conv %d (bias %s), in_proj %d, proj bias %s\n",
               c->mamba_heads, c->mamba_head_dim, c->d_inner, c->n_groups, c->ssm_state, c->conv_kernel,
               c->conv_bias ? "yes" : "no", c->in_proj_dim, c->mamba_bias ? "yes" : "no");
    if (c->n_head)
        printf("attention %d heads, %d kv heads, head dim %d, no RoPE, bias %s\n", c->n_head, c->n_kv_head,
               c->head_dim, c->attn_bias ? "yes" : "no");
    if (c->mlp_inter) printf("mlp       intermediate %d, relu2\n", c->mlp_inter);
    if (c->n_experts)
        printf("moe       %d experts, top %d, intermediate %d, shared %d, groups %d (top %d), scaling %g, "
               "normalized top-k %s\n",
               c->n_experts, c->top_k, c->moe_inter, c->shared_inter, c->n_group, c->topk_group,
               (double)c->routed_scaling, c->norm_topk_prob ? "yes" : "no");
    printf("tokens    bos %d, pad %d, eos", c->bos_id, c->pad_id);
    for (int i = 0; i < c->n_eos; i++) printf(" %d", c->eos_ids[i]);
    printf("%s\n", c->n_eos ? "" : " none");
    if (m->qmap.present)
        printf("quant     global bits=%d group=%d, %d per-module entries\n", m->qmap.bits, m->qmap.group, m->qmap.n);
    else
        printf("quant     none (float checkpoint)\n");
    printf("\n%-56s %-16s %5s %5s %6s %12s\n", "matrix", "shape", "bits", "group", "scales", "bytes");
    for (int i = 0; i < m->n_mats; i++) {
        const keel_mat_info *mi = &m->mats[i];
        char shape[64], bits[8], group[8];
        shape_text(mi, shape, sizeof shape);
        snprintf(bits, sizeof bits, "%d", mi->bits);
        snprintf(group, sizeof group, "%d", mi->group);
        printf("%-56s %-16s %5s %5s %6s %12zu\n", mi->path, shape, mi->bits ? bits : "float", mi->group ? group : "-",
               keel_dtype_name(mi->sdt), mi->bytes);
    }
    size_t by, by_all;
    double bpw, bpw_all;
    keel_model_totals(m, false, &by, &bpw);
    keel_model_totals(m, true, &by_all, &bpw_all);
    printf("\ntotal     %zu bytes (%.3f GiB), %.3f bits per weight\n", by, (double)by / (1024.0 * 1024 * 1024), bpw);
    if (m->has_mtp)
        printf("mtp       present: %s, bits=%d group=%d, %zu bytes; with the model %zu bytes, %.3f bits per weight\n",
               m->mtp_path, m->mtp.bits, m->mtp.group, by_all - by, by_all, bpw_all);
    else
        printf("mtp       absent\n");
}

static cJSON *json_config(const keel_config *c) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "hidden_size", c->hidden);
    cJSON_AddNumberToObject(o, "vocab_size", c->vocab);
    cJSON_AddNumberToObject(o, "n_layer", c->n_layer);
    cJSON_AddStringToObject(o, "pattern", c->pattern);
    cJSON_AddNumberToObject(o, "max_position_embeddings", c->max_ctx);
    cJSON_AddNumberToObject(o, "layer_norm_epsilon", (double)c->norm_eps);
    cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_embeddings);
    if (c->mamba_heads) {
        cJSON *x = cJSON_AddObjectToObject(o, "mamba");
        cJSON_AddNumberToObject(x, "layers", count_kind(c, 'M'));
        cJSON_AddNumberToObject(x, "heads", c->mamba_heads);
        cJSON_AddNumberToObject(x, "head_dim", c->mamba_head_dim);
        cJSON_AddNumberToObject(x, "n_groups", c->n_groups);
        cJSON_AddNumberToObject(x, "ssm_state", c->ssm_state);
        cJSON_AddNumberToObject(x, "conv_kernel", c->conv_kernel);
        cJSON_AddNumberToObject(x, "d_inner", c->d_inner);
        cJSON_AddNumberToObject(x, "conv_dim", c->conv_dim);
        cJSON_AddNumberToObject(x, "in_proj_dim", c->in_proj_dim);
        cJSON_AddBoolToObject(x, "conv_bias", c->conv_bias);
        cJSON_AddBoolToObject(x, "proj_bias", c->mamba_bias);
    }
    if (c->n_head) {
        cJSON *x = cJSON_AddObjectToObject(o, "attention");
        cJSON_AddNumberToObject(x, "layers", count_kind(c, '*'));
        cJSON_AddNumberToObject(x, "heads", c->n_head);
        cJSON_AddNumberToObject(x, "kv_heads", c->n_kv_head);
        cJSON_AddNumberToObject(x, "head_dim", c->head_dim);
        cJSON_AddBoolToObject(x, "bias", c->attn_bias);
    }
    if (c->mlp_inter) {
        cJSON *x = cJSON_AddObjectToObject(o, "mlp");
        cJSON_AddNumberToObject(x, "layers", count_kind(c, '-'));
        cJSON_AddNumberToObject(x, "intermediate", c->mlp_inter);
    }
    if (c->n_experts) {
        cJSON *x = cJSON_AddObjectToObject(o, "moe");
        cJSON_AddNumberToObject(x, "layers", count_kind(c, 'E'));
        cJSON_AddNumberToObject(x, "experts", c->n_experts);
        cJSON_AddNumberToObject(x, "top_k", c->top_k);
        cJSON_AddNumberToObject(x, "intermediate", c->moe_inter);
        cJSON_AddNumberToObject(x, "shared_intermediate", c->shared_inter);
        cJSON_AddNumberToObject(x, "n_shared", c->n_shared);
        cJSON_AddNumberToObject(x, "n_group", c->n_group);
        cJSON_AddNumberToObject(x, "topk_group", c->topk_group);
        cJSON_AddBoolToObject(x, "norm_topk_prob", c->norm_topk_prob);
        cJSON_AddNumberToObject(x, "routed_scaling_factor", (double)c->routed_scaling);
    }
    cJSON_AddNumberToObject(o, "bos_token_id", c->bos_id);
    cJSON_AddNumberToObject(o, "pad_token_id", c->pad_id);
    cJSON *eos = cJSON_AddArrayToObject(o, "eos_token_id");
    for (int i = 0; i < c->n_eos; i++) cJSON_AddItemToArray(eos, cJSON_CreateNumber(c->eos_ids[i]));
    return o;
}

static char *json_text(const keel_model *m) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "model_dir", m->dir);
    cJSON_AddStringToObject(root, "model_type", "nemotron_h");
    cJSON_AddItemToObject(root, "config", json_config(&m->cfg));
    if (m->qmap.present) {
        cJSON *q = cJSON_AddObjectToObject(root, "quantization");
        cJSON_AddNumberToObject(q, "bits", m->qmap.bits);
        cJSON_AddNumberToObject(q, "group_size", m->qmap.group);
        cJSON_AddNumberToObject(q, "entries", m->qmap.n);
    } else {
        cJSON_AddNullToObject(root, "quantization");
    }
    cJSON *mats = cJSON_AddArrayToObject(root, "matrices");
    int n_model = 0, n_mtp = 0;
    for (int i = 0; i < m->n_mats; i++) {
        const keel_mat_info *mi = &m->mats[i];
        cJSON *r = cJSON_CreateObject();
        cJSON_AddStringToObject(r, "path", mi->path);
        cJSON *sh = cJSON_AddArrayToObject(r, "shape");
        for (int d = 0; d < mi->ndim; d++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)mi->shape[d]));
        cJSON_AddBoolToObject(r, "quantized", mi->bits != 0);
        cJSON_AddNumberToObject(r, "bits", mi->bits);
        cJSON_AddNumberToObject(r, "group", mi->group);
        cJSON_AddStringToObject(r, "scales", keel_dtype_name(mi->sdt));
        cJSON_AddNumberToObject(r, "bytes", (double)mi->bytes);
        cJSON_AddItemToArray(mats, r);
        if (has_mtp_mat(m, i)) n_mtp++;
        else n_model++;
    }
    size_t by, by_all;
    double bpw, bpw_all;
    keel_model_totals(m, false, &by, &bpw);
    keel_model_totals(m, true, &by_all, &bpw_all);
    cJSON *t = cJSON_AddObjectToObject(root, "totals");
    cJSON_AddNumberToObject(t, "matrices", n_model);
    cJSON_AddNumberToObject(t, "bytes", (double)by);
    cJSON_AddNumberToObject(t, "bits_per_weight", bpw);
    cJSON_AddNumberToObject(t, "bytes_with_mtp", (double)by_all);
    cJSON_AddNumberToObject(t, "bits_per_weight_with_mtp", bpw_all);
    cJSON *mt = cJSON_AddObjectToObject(root, "mtp");
    cJSON_AddBoolToObject(mt, "present", m->has_mtp);
    if (m->has_mtp) {
        cJSON_AddStringToObject(mt, "path", m->mtp_path);
        cJSON_AddNumberToObject(mt, "bits", m->mtp.bits);
        cJSON_AddNumberToObject(mt, "group_size", m->mtp.group);
        cJSON_AddNumberToObject(mt, "matrices", n_mtp);
        cJSON_AddNumberToObject(mt, "bytes", (double)(by_all - by));
    }
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    return s;
}

int keel_cli_info(int argc, char **argv) {
    const char *dir = NULL, *mtp = NULL;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) {
            json = true;
        } else if (!strcmp(argv[i], "--mtp")) {
            if (++i >= argc) return keel_cli_fail("info", "--mtp needs a file (or \"\" for none)");
            mtp = argv[i];
        } else if (argv[i][0] == '-' && argv[i][1]) {
            return keel_cli_fail("info", "unknown option %s (usage: keel info MODEL_DIR [--mtp FILE] [--json])", argv[i]);
        } else if (!dir) {
            dir = argv[i];
        } else {
            return keel_cli_fail("info", "unexpected argument %s (usage: keel info MODEL_DIR [--mtp FILE] [--json])",
                                 argv[i]);
        }
    }
    if (!dir) return keel_cli_fail("info", "missing MODEL_DIR (usage: keel info MODEL_DIR [--mtp FILE] [--json])");
    keel_model m;
    keel_err err = {0};
    if (keel_model_load(&m, dir, mtp, &err)) return keel_cli_fail("info", "%s", err.msg);
    if (json) {
        char *s = json_text(&m);
        printf("%s\n", s);
        free(s);
    } else {
        print_text(&m);
    }
    keel_model_free(&m);
    return 0;
}
