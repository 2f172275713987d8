/* model: config.json of a nemotron_h checkpoint, every field checked and named when missing or inconsistent. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "model.h"

typedef struct pctx {
    const cJSON *root;
    const char *fname;
    keel_err *err;
} pctx;

/* A field's value, or NULL when absent or JSON null (null counts as absent). */
static const cJSON *field(const pctx *c, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(c->root, key);
    return (v && !cJSON_IsNull(v)) ? v : NULL;
}

static void describe(const cJSON *v, char *buf, size_t n) {
    char *s = cJSON_PrintUnformatted(v);
    snprintf(buf, n, "%.60s", s ? s : "?");
    free(s);
}

/* Reads an integer field >= minv; when absent, required fields fail and optional ones take def. */
static keel_code get_int(const pctx *c, const char *key, bool required, int def, int minv, int *out) {
    const cJSON *v = field(c, key);
    if (!v) {
        if (required) return keel_err_set(c->err, KEEL_E_MISSING, "%s: field %s is missing", c->fname, key);
        *out = def;
        return KEEL_OK;
    }
    char found[64];
    describe(v, found, sizeof found);
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < (double)minv ||
        v->valuedouble > 2147483647.0)
        return keel_err_set(c->err, KEEL_E_FORMAT, "%s: field %s: expected an integer >= %d, found %s", c->fname,
                            key, minv, found);
    *out = (int)v->valuedouble;
    return KEEL_OK;
}

static keel_code get_float(const pctx *c, const char *key, bool required, float def, bool positive, float *out) {
    const cJSON *v = field(c, key);
    if (!v) {
        if (required) return keel_err_set(c->err, KEEL_E_MISSING, "%s: field %s is missing", c->fname, key);
        *out = def;
        return KEEL_OK;
    }
    char found[64];
    describe(v, found, sizeof found);
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || (positive && v->valuedouble <= 0))
        return keel_err_set(c->err, KEEL_E_FORMAT, "%s: field %s: expected a %snumber, found %s", c->fname, key,
                            positive ? "positive " : "", found);
    *out = (float)v->valuedouble;
    return KEEL_OK;
}

static keel_code get_bool(const pctx *c, const char *key, bool def, bool *out) {
    const cJSON *v = field(c, key);
    if (!v) {
        *out = def;
        return KEEL_OK;
    }
    if (!cJSON_IsBool(v)) {
        char found[64];
        describe(v, found, sizeof found);
        return keel_err_set(c->err, KEEL_E_FORMAT, "%s: field %s: expected true or false, found %s", c->fname, key,
                            found);
    }
    *out = cJSON_IsTrue(v);
    return KEEL_OK;
}

/* A string field that, when present, must equal `want` (activation names keel implements). */
static keel_code check_str(const pctx *c, const char *key, const char *want) {
    const cJSON *v = field(c, key);
    if (!v) return KEEL_OK;
    if (!cJSON_IsString(v) || strcmp(v->valuestring, want)) {
        char found[64];
        describe(v, found, sizeof found);
        return keel_err_set(c->err, KEEL_E_UNSUPPORTED, "%s: field %s: keel implements \"%s\", found %s", c->fname,
                            key, want, found);
    }
    return KEEL_OK;
}

static const char *mixer_word(char k) {
    switch (k) {
    case KEEL_MIXER_MAMBA: return "Mamba-2";
    case KEEL_MIXER_ATTN: return "attention";
    case KEEL_MIXER_MLP: return "MLP";
    case KEEL_MIXER_MOE: return "MoE";
    default: return "?";
    }
}

static char block_type_char(const char *s) {
    if (!strcmp(s, "mamba") || !strcmp(s, "linear_attention")) return KEEL_MIXER_MAMBA;
    if (!strcmp(s, "attention") || !strcmp(s, "full_attention")) return KEEL_MIXER_ATTN;
    if (!strcmp(s, "moe")) return KEEL_MIXER_MOE;
    if (!strcmp(s, "mlp")) return KEEL_MIXER_MLP;
    return 0;
}

/* The layer pattern from hybrid_override_pattern and/or layers_block_type; both present must agree. */
static keel_code parse_pattern(const pctx *c, keel_config *cfg) {
    const cJSON *hp = field(c, "hybrid_override_pattern"), *lb = field(c, "layers_block_type");
    if (!hp && !lb)
        return keel_err_set(c->err, KEEL_E_MISSING,
                            "%s: field hybrid_override_pattern (or layers_block_type) is missing", c->fname);
    char from_hp[KEEL_MAX_LAYERS + 1] = {0}, from_lb[KEEL_MAX_LAYERS + 1] = {0};
    int n_hp = -1, n_lb = -1;
    if (hp) {
        if (!cJSON_IsString(hp))
            return keel_err_set(c->err, KEEL_E_FORMAT, "%s: field hybrid_override_pattern: expected a string",
                                c->fname);
        size_t n = strlen(hp->valuestring);
        if (n == 0 || n > KEEL_MAX_LAYERS)
            return keel_err_set(c->err, KEEL_E_RANGE,
                                "%s: field hybrid_override_pattern: expected 1 to %d layers, found %zu", c->fname,
                                KEEL_MAX_LAYERS, n);
        for (size_t i = 0; i < n; i++) {
            char ch = hp->valuestring[i];
            if (ch != KEEL_MIXER_MAMBA && ch != KEEL_MIXER_ATTN && ch != KEEL_MIXER_MLP && ch != KEEL_MIXER_MOE)
                return keel_err_set(c->err, KEEL_E_FORMAT,
                                    "%s: field hybrid_override_pattern: layer %zu is '%c', expected one of M * - E",
                                    c->fname, i, ch);
            from_hp[i] = ch;
        }
        n_hp = (int)n;
    }
    if (lb) {
        if (!cJSON_IsArray(lb))
            return keel_err_set(c->err, KEEL_E_FORMAT, "%s: field layers_block_type: expected a list of strings",
                                c->fname);
        int n = cJSON_GetArraySize(lb);
        if (n == 0 || n > KEEL_MAX_LAYERS)
            return keel_err_set(c->err, KEEL_E_RANGE, "%s: field layers_block_type: expected 1 to %d layers, found %d",
                                c->fname, KEEL_MAX_LAYERS, n);
        int i = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, lb) {
            char ch = cJSON_IsString(it) ? block_type_char(it->valuestring) : 0;
            if (!ch) {
                char found[64];
                describe(it, found, sizeof found);
                return keel_err_set(c->err, KEEL_E_FORMAT,
                                    "%s: field layers_block_type: layer %d is %s, expected mamba, attention, moe, mlp, "
                                    "linear_attention or full_attention",
                                    c->fname, i, found);
            }
            from_lb[i++] = ch;
        }
        n_lb = n;
    }
    if (hp && lb) {
        int n = KEEL_MIN(n_hp, n_lb);
        for (int i = 0; i < n; i++)
            if (from_hp[i] != from_lb[i])
                return keel_err_set(c->err, KEEL_E_FORMAT,
                                    "%s: hybrid_override_pattern and layers_block_type disagree at layer %d: '%c' (%s) "
                                    "vs \"%s\"",
                                    c->fname, i, from_hp[i], mixer_word(from_hp[i]),
                                    cJSON_GetArrayItem(lb, i)->valuestring);
        if (n_hp != n_lb)
            return keel_err_set(c->err, KEEL_E_FORMAT,
                                "%s: hybrid_override_pattern has %d layers but layers_block_type has %d (first "
                                "differing layer %d)",
                                c->fname, n_hp, n_lb, n);
    }
    memcpy(cfg->pattern, hp ? from_hp : from_lb, sizeof cfg->pattern);
    cfg->n_layer = hp ? n_hp : n_lb;
    return KEEL_OK;
}

static keel_code parse_tokens(const pctx *c, keel_config *cfg) {
    keel_code rc;
    if ((rc = get_int(c, "bos_token_id", false, -1, 0, &cfg->bos_id))) return rc;
    if ((rc = get_int(c, "pad_token_id", false, -1, 0, &cfg->pad_id))) return rc;
    if (cfg->bos_id >= cfg->vocab)
        return keel_err_set(c->err, KEEL_E_RANGE, "%s: field bos_token_id: %d is not below vocab_size %d", c->fname,
                            cfg->bos_id, cfg->vocab);
    if (cfg->pad_id >= cfg->vocab)
        return keel_err_set(c->err, KEEL_E_RANGE, "%s: field pad_token_id: %d is not below vocab_size %d", c->fname,
                            cfg->pad_id, cfg->vocab);
    const cJSON *e = field(c, "eos_token_id");
    cfg->n_eos = 0;
    if (!e) return KEEL_OK;
    const cJSON *single[1] = {e};
    int n = cJSON_IsArray(e) ? cJSON_GetArraySize(e) : 1;
    if (n > KEEL_MAX_EOS)
        return keel_err_set(c->err, KEEL_E_RANGE, "%s: field eos_token_id: at most %d ids, found %d", c->fname,
                            KEEL_MAX_EOS, n);
    for (int i = 0; i < n; i++) {
        const cJSON *v = cJSON_IsArray(e) ? cJSON_GetArrayItem(e, i) : single[0];
        if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 0 ||
            v->valuedouble >= (double)cfg->vocab) {
            char found[64];
            describe(v, found, sizeof found);
            return keel_err_set(c->err, KEEL_E_FORMAT,
                                "%s: field eos_token_id: expected a token id below vocab_size %d (or a list of them), "
                                "found %s",
                                c->fname, cfg->vocab, found);
        }
        cfg->eos_ids[cfg->n_eos++] = (int)v->valuedouble;
    }
    return KEEL_OK;
}

static keel_code parse_mamba(const pctx *c, keel_config *cfg, bool need) {
    keel_code rc;
    if ((rc = get_int(c, "mamba_num_heads", need, 0, 1, &cfg->mamba_heads)) ||
        (rc = get_int(c, "mamba_head_dim", need, 0, 1, &cfg->mamba_head_dim)) ||
        (rc = get_int(c, "n_groups", need, 0, 1, &cfg->n_groups)) ||
        (rc = get_int(c, "ssm_state_size", need, 0, 1, &cfg->ssm_state)) ||
        (rc = get_int(c, "conv_kernel", need, 0, 1, &cfg->conv_kernel)) ||
        (rc = get_bool(c, "use_conv_bias", true, &cfg->conv_bias)) ||
        (rc = get_bool(c, "mamba_proj_bias", false, &cfg->mamba_bias)) ||
        (rc = check_str(c, "mamba_hidden_act", "silu")))
        return rc;
    if (!need) {
        cfg->mamba_heads = cfg->mamba_head_dim = cfg->n_groups = cfg->ssm_state = cfg->conv_kernel = 0;
        return KEEL_OK;
    }
    if (cfg->mamba_heads % cfg->n_groups)
        return keel_err_set(c->err, KEEL_E_FORMAT, "%s: field n_groups: %d does not divide mamba_num_heads %d",
                            c->fname, cfg->n_groups, cfg->mamba_heads);
    int64_t d_inner = (int64_t)cfg->mamba_heads * cfg->mamba_head_dim;
    int64_t in_proj = 2 * d_inner + 2 * (int64_t)cfg->n_groups * cfg->ssm_state + cfg->mamba_heads;
    if (in_proj > (1 << 30))
        return keel_err_set(c->err, KEEL_E_RANGE,
                            "%s: fields mamba_num_heads x mamba_head_dim (%d x %d) and n_groups x ssm_state_size (%d x "
                            "%d) give an in_proj of %lld rows, too large",
                            c->fname, cfg->mamba_heads, cfg->mamba_head_dim, cfg->n_groups, cfg->ssm_state,
                            (long long)in_proj);
    cfg->d_inner = (int)d_inner;
    cfg->conv_dim = cfg->d_inner + 2 * cfg->n_groups * cfg->ssm_state;
    cfg->in_proj_dim = (int)in_proj;
    return KEEL_OK;
}

static keel_code parse_attn(const pctx *c, keel_config *cfg, bool need) {
    keel_code rc;
    if ((rc = get_int(c, "num_attention_heads", need, 0, 1, &cfg->n_head)) ||
        (rc = get_int(c, "num_key_value_heads", need, 0, 1, &cfg->n_kv_head)) ||
        (rc = get_bool(c, "attention_bias", false, &cfg->attn_bias)))
        return rc;
    if (!cfg->n_head || !cfg->n_kv_head) { /* attention fields absent and not needed */
        cfg->n_head = cfg->n_kv_head = cfg->head_dim = 0;
        return KEEL_OK;
    }
    if (cfg->hidden % cfg->n_head && !field(c, "head_dim"))
        return keel_err_set(c->err, KEEL_E_MISSING,
                            "%s: field head_dim is missing and num_attention_heads %d does not divide hidden_size %d",
                            c->fname, cfg->n_head, cfg->hidden);
    if ((rc = get_int(c, "head_dim", false, cfg->hidden / cfg->n_head, 1, &cfg->head_dim))) return rc;
    if (cfg->n_head % cfg->n_kv_head)
        return keel_err_set(c->err, KEEL_E_FORMAT,
                            "%s: field num_key_value_heads: %d does not divide num_attention_heads %d", c->fname,
                            cfg->n_kv_head, cfg->n_head);
    return KEEL_OK;
}

static keel_code parse_moe(const pctx *c, keel_config *cfg, bool need) {
    keel_code rc;
    if ((rc = get_int(c, "n_routed_experts", need, 0, 1, &cfg->n_experts)) ||
        (rc = get_int(c, "num_experts_per_tok", need, 0, 1, &cfg->top_k)) ||
        (rc = get_int(c, "moe_intermediate_size", need, 0, 1, &cfg->moe_inter)) ||
        (rc = get_int(c, "moe_shared_expert_intermediate_size", need, 0, 1, &cfg->shared_inter)) ||
        (rc = get_int(c, "n_shared_experts", false, 1, 0, &cfg->n_shared)) ||
        (rc = get_int(c, "n_group", false, 1, 1, &cfg->n_group)) ||
        (rc = get_int(c, "topk_group", false, 1, 1, &cfg->topk_group)) ||
        (rc = get_bool(c, "norm_topk_prob", true, &cfg->norm_topk_prob)) ||
        (rc = get_float(c, "routed_scaling_factor", false, 1.0f, true, &cfg->routed_scaling)))
        return rc;
    if (field(c, "moe_latent_size"))
        return keel_err_set(c->err, KEEL_E_UNSUPPORTED, "%s: field moe_latent_size: latent MoE is not supported",
                            c->fname);
    if (!cfg->n_experts || !cfg->top_k || !cfg->moe_inter || !cfg->shared_inter) {
        cfg->n_experts = cfg->top_k = cfg->moe_inter = cfg->shared_inter = 0;
        return KEEL_OK;
    }
    if (cfg->n_shared != 1)
        return keel_err_set(c->err, KEEL_E_UNSUPPORTED, "%s: field n_shared_experts: keel supports 1, found %d",
                            c->fname, cfg->n_shared);
    if (cfg->top_k > cfg->n_experts)
        return keel_err_set(c->err, KEEL_E_FORMAT,
                            "%s: field num_experts_per_tok: %d exceeds n_routed_experts %d", c->fname, cfg->top_k,
                            cfg->n_experts);
    if (cfg->topk_group > cfg->n_group)
        return keel_err_set(c->err, KEEL_E_FORMAT, "%s: field topk_group: %d exceeds n_group %d", c->fname,
                            cfg->topk_group, cfg->n_group);
    if (cfg->n_experts % cfg->n_group)
        return keel_err_set(c->err, KEEL_E_FORMAT, "%s: field n_group: %d does not divide n_routed_experts %d",
                            c->fname, cfg->n_group, cfg->n_experts);
    if (cfg->top_k > cfg->topk_group * (cfg->n_experts / cfg->n_group))
        return keel_err_set(c->err, KEEL_E_FORMAT,
                            "%s: field num_experts_per_tok: %d exceeds the %d experts in topk_group %d groups of %d",
                            c->fname, cfg->top_k, cfg->topk_group * (cfg->n_experts / cfg->n_group), cfg->topk_group,
                            cfg->n_experts / cfg->n_group);
    return KEEL_OK;
}

static keel_code parse_root(const pctx *c, keel_config *cfg) {
    keel_code rc;
    const cJSON *mt = field(c, "model_type");
    if (!mt) return keel_err_set(c->err, KEEL_E_MISSING, "%s: field model_type is missing", c->fname);
    if (!cJSON_IsString(mt) || strcmp(mt->valuestring, "nemotron_h")) {
        char found[64];
        describe(mt, found, sizeof found);
        return keel_err_set(c->err, KEEL_E_UNSUPPORTED, "%s: field model_type: expected \"nemotron_h\", found %s",
                            c->fname, found);
    }
    if ((rc = get_int(c, "hidden_size", true, 0, 1, &cfg->hidden)) ||
        (rc = get_int(c, "vocab_size", true, 0, 1, &cfg->vocab)) ||
        (rc = get_int(c, "max_position_embeddings", true, 0, 1, &cfg->max_ctx)) ||
        (rc = get_float(c, "layer_norm_epsilon", true, 0, true, &cfg->norm_eps)) ||
        (rc = get_bool(c, "tie_word_embeddings", false, &cfg->tie_embeddings)))
        return rc;
    if ((rc = parse_pattern(c, cfg))) return rc;
    int nl;
    if ((rc = get_int(c, "num_hidden_layers", false, cfg->n_layer, 1, &nl))) return rc;
    if (nl != cfg->n_layer)
        return keel_err_set(c->err, KEEL_E_FORMAT, "%s: field num_hidden_layers: %d, but the layer pattern has %d",
                            c->fname, nl, cfg->n_layer);
    bool has[256] = {false};
    for (int i = 0; i < cfg->n_layer; i++) has[(unsigned char)cfg->pattern[i]] = true;
    if ((rc = parse_mamba(c, cfg, has[KEEL_MIXER_MAMBA])) || (rc = parse_attn(c, cfg, has[KEEL_MIXER_ATTN])) ||
        (rc = parse_moe(c, cfg, has[KEEL_MIXER_MOE])))
        return rc;
    if ((rc = get_int(c, "intermediate_size", has[KEEL_MIXER_MLP], 0, 1, &cfg->mlp_inter)) ||
        (rc = get_bool(c, "mlp_bias", false, &cfg->mlp_bias)) || (rc = check_str(c, "mlp_hidden_act", "relu2")))
        return rc;
    if (cfg->mlp_bias)
        return keel_err_set(c->err, KEEL_E_UNSUPPORTED, "%s: field mlp_bias: true is not supported", c->fname);
    return parse_tokens(c, cfg);
}

keel_code keel_config_parse(keel_config *cfg, const char *json, const char *fname, keel_err *err) {
    memset(cfg, 0, sizeof *cfg);
    cJSON *root = cJSON_Parse(json);
    if (!root) return keel_err_set(err, KEEL_E_FORMAT, "%s: not valid JSON", fname);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return keel_err_set(err, KEEL_E_FORMAT, "%s: expected a JSON object", fname);
    }
    pctx c = {root, fname, err};
    keel_code rc = parse_root(&c, cfg);
    cJSON_Delete(root);
    if (rc) memset(cfg, 0, sizeof *cfg);
    return rc;
}
