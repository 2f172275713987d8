/* model: a Nemotron-H checkpoint as keel sees it: config.json, the quantization map, and every weight bound to
 * its place with its shape checked, still packed, still in the file's mapping.
 *
 * Loading validates everything before anything runs: every field the forward pass needs (named when missing or
 * inconsistent), the layer pattern (hybrid_override_pattern and/or layers_block_type, which must agree), each
 * matrix resolved to (bits, group, scale dtype) from the quantization map and checked against its packed shape
 * and the input width the architecture implies, every tensor the model needs present and every tensor present
 * used. The MTP head (mtp.safetensors) has its own quantization, read from its metadata.
 */
#ifndef KEEL_MODEL_H
#define KEEL_MODEL_H

#include "../format/format.h"

#define KEEL_MAX_LAYERS 256
#define KEEL_MAX_EOS 8

typedef enum keel_mixer {
    KEEL_MIXER_MAMBA = 'M',
    KEEL_MIXER_ATTN = '*',
    KEEL_MIXER_MLP = '-',
    KEEL_MIXER_MOE = 'E',
} keel_mixer;

typedef struct keel_config {
    int hidden;                      /* hidden_size */
    int vocab;                       /* vocab_size */
    int n_layer;                     /* length of the pattern */
    char pattern[KEEL_MAX_LAYERS + 1]; /* one keel_mixer char per layer, e.g. "MEM*E-M*E" */
    int max_ctx;                     /* max_position_embeddings */
    float norm_eps;                  /* layer_norm_epsilon, every RMSNorm */
    bool tie_embeddings;             /* tie_word_embeddings: lm_head reads the embedding table */

    /* Mamba-2 */
    int mamba_heads;    /* mamba_num_heads */
    int mamba_head_dim; /* mamba_head_dim */
    int n_groups;       /* n_groups (B and C groups) */
    int ssm_state;      /* ssm_state_size */
    int conv_kernel;    /* conv_kernel */
    int d_inner;        /* mamba_heads * mamba_head_dim */
    int conv_dim;       /* d_inner + 2 * n_groups * ssm_state */
    int in_proj_dim;    /* 2 * d_inner + 2 * n_groups * ssm_state + mamba_heads: z | xBC | dt */
    bool conv_bias;     /* use_conv_bias */
    bool mamba_bias;    /* mamba_proj_bias */

    /* attention (no RoPE) */
    int n_head;    /* num_attention_heads */
    int n_kv_head; /* num_key_value_heads */
    int head_dim;  /* head_dim */
    bool attn_bias; /* attention_bias */

    /* dense MLP */
    int mlp_inter; /* intermediate_size */
    bool mlp_bias; /* mlp_bias */

    /* MoE */
    int n_experts;         /* n_routed_experts */
    int n_shared;          /* n_shared_experts */
    int top_k;             /* num_experts_per_tok */
    int moe_inter;         /* moe_intermediate_size */
    int shared_inter;      /* moe_shared_expert_intermediate_size */
    int n_group;           /* n_group */
    int topk_group;        /* topk_group */
    bool norm_topk_prob;   /* norm_topk_prob */
    float routed_scaling;  /* routed_scaling_factor */

    /* tokens */
    int bos_id, pad_id;
    int n_eos;
    int eos_ids[KEEL_MAX_EOS]; /* eos_token_id: a number or a list */
} keel_config;

/* Parses config.json text (fname names it in errors). */
keel_code keel_config_parse(keel_config *cfg, const char *json, const char *fname, keel_err *err);

/* ---- the quantization map ------------------------------------------------------------------------------ */

typedef struct keel_qentry {
    char *path;  /* module path, e.g. "backbone.layers.3.mixer.k_proj" */
    int quant;   /* 1: quantized with bits/group below; 0: kept in float */
    int bits, group;
} keel_qentry;

typedef struct keel_qmap {
    bool present;      /* a "quantization" (or "quantization_config") object was found */
    int bits, group;   /* global settings */
    int n;
    keel_qentry *entries;
} keel_qmap;

/* Parses a quantization object (JSON text of the object itself); refuses non-affine modes. `where` names the
 * file for errors. */
keel_code keel_qmap_parse(keel_qmap *q, const char *json_object, const char *where, keel_err *err);
void keel_qmap_free(keel_qmap *q);
/* The settings for a module path: an entry if one names it, else the global settings. */
void keel_qmap_lookup(const keel_qmap *q, const char *path, int *quant, int *bits, int *group);

/* ---- bound weights ------------------------------------------------------------------------------------- */

/* A float vector in the file (norm weights, biases, A_log, D, ...). */
typedef struct keel_vec {
    const void *data;
    keel_dtype dt; /* BF16, F16 or F32 */
    int n;
} keel_vec;

static inline float keel_vec_get(const keel_vec *v, int i) { return keel_dtype_get_f32(v->dt, v->data, (size_t)i); }

/* Stacked routed experts (switch_mlp.fc1 / fc2): n_expert matrices of one shape, laid out back to back. */
typedef struct keel_qstack {
    int n_expert;
    keel_qmat m;       /* expert 0 */
    size_t w_stride;   /* bytes between consecutive experts' codes */
    size_t s_stride;   /* bytes between consecutive experts' scales (and biases) */
} keel_qstack;

static inline keel_qmat keel_qstack_expert(const keel_qstack *s, int e) {
    keel_qmat m = s->m;
    m.w = (const uint32_t *)((const uint8_t *)s->m.w + (size_t)e * s->w_stride);
    if (m.scales) m.scales = (const uint8_t *)s->m.scales + (size_t)e * s->s_stride;
    if (m.biases) m.biases = (const uint8_t *)s->m.biases + (size_t)e * s->s_stride;
    return m;
}

typedef struct keel_mamba_w {
    keel_qmat in_proj;  /* (in_proj_dim, hidden) */
    keel_vec in_bias;   /* (in_proj_dim) when mamba_bias, else n = 0 */
    keel_vec conv_w;    /* (conv_dim, conv_kernel): conv1d.weight (C, K, 1) */
    keel_vec conv_b;    /* (conv_dim) when conv_bias */
    keel_vec dt_bias;   /* (mamba_heads) */
    keel_vec A_log;     /* (mamba_heads) */
    keel_vec D;         /* (mamba_heads) */
    keel_vec norm;      /* (d_inner) gated RMSNorm weight */
    keel_qmat out_proj; /* (hidden, d_inner) */
    keel_vec out_bias;  /* (hidden) when mamba_bias */
} keel_mamba_w;

typedef struct keel_attn_w {
    keel_qmat q, k, v; /* (n_head*head_dim, hidden), (n_kv_head*head_dim, hidden) x2 */
    keel_qmat o;       /* (hidden, n_head*head_dim) */
    keel_vec q_bias, k_bias, v_bias, o_bias; /* when attn_bias */
} keel_attn_w;

typedef struct keel_mlp_w {
    keel_qmat up;   /* (inter, hidden) */
    keel_qmat down; /* (hidden, inter) */
} keel_mlp_w;

typedef struct keel_moe_w {
    keel_qmat gate;       /* router (n_experts, hidden); often a float matrix */
    keel_vec corr_bias;   /* e_score_correction_bias (n_experts) */
    keel_qstack fc1;      /* (E, moe_inter, hidden) */
    keel_qstack fc2;      /* (E, hidden, moe_inter) */
    keel_mlp_w shared;    /* shared_experts.up_proj (shared_inter, hidden), down_proj (hidden, shared_inter) */
} keel_moe_w;

typedef struct keel_layer {
    keel_mixer kind;
    keel_vec norm; /* (hidden) pre-mixer RMSNorm */
    keel_mamba_w mamba;
    keel_attn_w attn;
    keel_mlp_w mlp;
    keel_moe_w moe;
} keel_layer;

/* The multi-token-prediction head (one attention step and one MoE step, as the fixture README describes). */
typedef struct keel_mtp_w {
    keel_vec enorm, hnorm;  /* (hidden) */
    keel_qmat eh_proj;      /* (hidden, 2*hidden): input is concat[enorm(embed), hnorm(h)] */
    keel_vec norm0;         /* layers.0.norm (hidden) */
    keel_attn_w attn;
    keel_vec norm1;         /* layers.1.norm (hidden) */
    keel_moe_w moe;
    keel_vec final_norm;    /* layers.1.final_layernorm (hidden) */
    int bits, group;        /* the head's global width from its metadata */
} keel_mtp_w;

/* One matrix as `keel info` lists it. */
typedef struct keel_mat_info {
    char *path;        /* module path, e.g. "backbone.layers.0.mixer.in_proj" or "mtp.layers.0.eh_proj" */
    int ndim;
    int64_t shape[3];  /* logical (unpacked) shape: (out, in) or (E, out, in) */
    int bits, group;   /* 0, 0 for a float matrix */
    keel_dtype sdt;    /* scale dtype, or the float matrix's dtype */
    size_t bytes;      /* codes + scales + biases (or the float data) */
} keel_mat_info;

typedef struct keel_model {
    keel_config cfg;
    keel_qmap qmap;
    char *dir;
    keel_st st;            /* owns the checkpoint's mapping */
    keel_qmat embed;       /* (vocab, hidden) quantized embedding table */
    keel_vec norm_f;       /* (hidden) */
    keel_qmat lm_head;     /* (vocab, hidden); the embedding table when tied */
    keel_layer *layers;    /* (n_layer) */

    bool has_mtp;
    char *mtp_path;
    keel_st mtp_st;        /* owns the MTP file's mapping */
    keel_qmap mtp_qmap;
    keel_mtp_w mtp;

    int n_mats;
    keel_mat_info *mats;   /* every matrix, model first then MTP head, in file order of layers */
} keel_model;

/* Loads MODEL_DIR (config.json + model.safetensors or shards). mtp_path: NULL to use MODEL_DIR/mtp.safetensors
 * when it exists, "" for none, else that file (which must exist). On failure m is safe to free. */
keel_code keel_model_load(keel_model *m, const char *dir, const char *mtp_path, keel_err *err);
void keel_model_free(keel_model *m); /* accepts NULL */

/* Total bytes of all matrices and their mean bits per weight (codes + scales + biases over weights). */
void keel_model_totals(const keel_model *m, bool include_mtp, size_t *bytes, double *bits_per_weight);

/* ---- synthesis ----------------------------------------------------------------------------------------- */

typedef struct keel_synth_opts {
    int bits, group;        /* global width of the model's matrices */
    keel_dtype sdt;         /* scale dtype */
    int mtp_bits;           /* 0: no MTP head; else its width (group 64) */
    uint64_t seed;
} keel_synth_opts;

/* Writes a random checkpoint of the geometry in config_json into out_dir: config.json (with its quantization),
 * model.safetensors, a byte-level tokenizer.json and, when mtp_bits, mtp.safetensors. */
keel_code keel_synth_write(const char *config_json, const char *out_dir, const keel_synth_opts *o, keel_err *err);

#endif
