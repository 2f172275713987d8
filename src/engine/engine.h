/* engine: the CPU reference engine for Nemotron-H: the forward pass (prompt and one-token decode share their
 * per-token arithmetic, so both give the same bits), the MTP head, sampling and generation.
 *
 * Per token: x = embed(t); for each layer x += mixer(rmsnorm(x)); logits = lm_head(norm_f(x)). Every matrix
 * product goes through keel_cpu_matmul (row-independent), every other step is computed token by token in a
 * fixed order, so a prompt of n tokens and n one-token decodes leave the same state and logits bit for bit.
 * All scratch comes from one arena allocated at init: nothing is allocated per token.
 */
#ifndef KEEL_ENGINE_H
#define KEEL_ENGINE_H

#include "../model/model.h"

#define KEEL_ENGINE_CHUNK 64 /* tokens per pass of prompt processing (rows of each matmul) */

typedef enum keel_logits_mode {
    KEEL_LOGITS_NONE = 0, /* no logits */
    KEEL_LOGITS_LAST = 1, /* logits of the last token only: (vocab) */
    KEEL_LOGITS_ALL = 2,  /* logits of every token: (n, vocab) */
} keel_logits_mode;

typedef struct keel_engine {
    const keel_model *model;
    const keel_config *cfg;
    int max_ctx; /* tokens the caches hold */
    int pos;     /* tokens consumed so far (the next token's position) */
    int mtp_pos; /* positions the MTP head has consumed */

    int n_mamba, n_attn;  /* layers of each kind with state */
    int *slot;            /* (n_layer) index of a layer among those of its kind, -1 when stateless */
    float *conv_state;    /* (n_mamba, conv_kernel-1, conv_dim) last inputs of the conv, oldest first */
    float *ssm_state;     /* (n_mamba, mamba_heads, mamba_head_dim, ssm_state) */
    float *k_cache;       /* (n_attn, max_ctx, n_kv_head*head_dim) */
    float *v_cache;       /* (n_attn, max_ctx, n_kv_head*head_dim) */
    float *mtp_k, *mtp_v; /* (max_ctx, n_kv_head*head_dim) the MTP head's own cache, NULL without a head */

    /* scratch, carved from one arena; C = KEEL_ENGINE_CHUNK */
    void *arena;
    float *x;       /* (C, hidden) residual stream */
    float *xn;      /* (C, hidden) normalized input of a mixer */
    float *mix;     /* (C, hidden) mixer output */
    float *wide;    /* (C, wide_dim) projections: in_proj, q|k|v, up, eh_proj input */
    float *mid;     /* (C, mid_dim) mamba y, attention heads */
    float *conv_out; /* (conv_dim) one token's conv output */
    float *scores;  /* (n_head, max_ctx) attention probabilities */
    float *router;  /* (C, n_experts) router logits */
    int *sel;       /* (C, top_k) chosen experts per token, in slot order */
    float *sel_w;   /* (C, top_k) their weights */
    int *ex_rows;   /* (n_experts, C) tokens routed to each expert */
    int *ex_slot;   /* (n_experts, C) the slot each of those came from */
    int *ex_count;  /* (n_experts) */
    float *ex_in;   /* (C, hidden) gathered rows for one expert */
    float *ex_mid;  /* (C, max(moe_inter, shared_inter, mlp_inter)) */
    float *ex_out;  /* (C, hidden) one expert's output rows */
    float *slots;   /* (C, top_k, hidden) each token's expert outputs, summed in slot order */
    float *hid;     /* (C, hidden) hidden after norm_f */
    int wide_dim, mid_dim;
} keel_engine;

/* Binds the engine to a loaded model with caches for max_ctx tokens (1 <= max_ctx). */
keel_code keel_engine_init(keel_engine *e, const keel_model *m, int max_ctx, keel_err *err);
void keel_engine_free(keel_engine *e); /* accepts NULL and a zeroed struct */
/* Forgets every token: position 0, zero states, empty caches (model and MTP head). */
void keel_engine_reset(keel_engine *e);

/* Runs n tokens from the current position (a prompt when n > 1, a decode step when n == 1): logits per mode
 * (NULL with KEEL_LOGITS_NONE), hidden (n, hidden) after norm_f when non-NULL. Token ids are checked against
 * the vocabulary and the context against max_ctx before anything runs (KEEL_E_RANGE). */
keel_code keel_engine_forward(keel_engine *e, const int *tokens, int n, float *logits, keel_logits_mode mode,
                              float *hidden, keel_err *err);

/* Runs the MTP head on n positions from e->mtp_pos: row i takes h (n, hidden), the model's hidden after norm_f
 * at that position, and next[i], the token that follows it. Writes logits (n, vocab) when non-NULL, the
 * prediction of the token after next[i], and out_hidden (n, hidden) when non-NULL: the head's state after its
 * final_layernorm, the lm_head input, which a chained draft feeds back as the next h. */
keel_code keel_engine_mtp(keel_engine *e, const float *h, const int *next, int n, float *logits, float *out_hidden,
                          keel_err *err);

/* ---- sampling ------------------------------------------------------------------------------------------ */

typedef struct keel_sampler_cfg {
    float temp;   /* <= 0: greedy (argmax, ties to the lower id) */
    int top_k;    /* keep the k most likely; <= 0: all */
    float top_p;  /* keep the smallest most-likely prefix whose mass reaches p; >= 1: all */
    float min_p;  /* keep tokens with p >= min_p * p_max; <= 0: all */
    uint64_t seed;
} keel_sampler_cfg;

typedef struct keel_sampler {
    keel_sampler_cfg c;
    int vocab;
    int *idx;     /* (vocab) candidate ids, most likely first */
    float *prob;  /* (vocab) their probabilities after filtering */
    void *tmp;    /* (vocab) (logit, id) pairs being sorted */
} keel_sampler;

void keel_sampler_init(keel_sampler *s, const keel_sampler_cfg *c, int vocab);
void keel_sampler_free(keel_sampler *s); /* accepts NULL */
/* The candidates after temperature, top-k, top-p and min-p, in that order: s->idx[0..n) sorted by logit
 * descending (ties: lower id first) with s->prob their renormalized probabilities. Returns n >= 1. */
int keel_sampler_filter(keel_sampler *s, const float *logits);
/* The uniform in [0, 1) that the draw at this absolute position uses: a hash of (seed, pos) only. */
double keel_sampler_uniform(uint64_t seed, int64_t pos);
/* Draws the token at absolute position pos: a function of (cfg, pos, logits) only. */
int keel_sampler_sample(keel_sampler *s, const float *logits, int64_t pos);
/* Index of the largest value, ties to the lower index. */
int keel_argmax(const float *v, int n);

/* ---- generation ---------------------------------------------------------------------------------------- */

typedef enum keel_stop {
    KEEL_STOP_NONE = 0,
    KEEL_STOP_EOS,      /* an end-of-sequence id was drawn (not passed to the callback) */
    KEEL_STOP_LENGTH,   /* n_predict tokens were generated */
    KEEL_STOP_CONTEXT,  /* the sequence reached the engine's max_ctx */
    KEEL_STOP_CALLBACK, /* the callback asked to stop */
} keel_stop;

/* Called with each generated token and its absolute position; nonzero stops generation. */
typedef int (*keel_token_fn)(void *user, int token, int64_t pos);

typedef struct keel_gen_opts {
    int n_predict;          /* most tokens to generate; < 0: until eos or the context limit */
    keel_sampler_cfg samp;
    const int *eos;         /* stop ids; NULL: the model's eos_token_id */
    int n_eos;              /* with eos non-NULL; 0 disables stopping on eos */
} keel_gen_opts;

typedef struct keel_gen_result {
    int n_prompt, n_gen;   /* tokens processed as prompt, tokens generated (eos excluded) */
    keel_stop stop;
    int stop_token;        /* the eos id drawn, with KEEL_STOP_EOS */
    double prompt_s, gen_s; /* wall time of prompt processing and of generation */
} keel_gen_result;

/* Resets the engine, runs the prompt, then samples and decodes until a stop. A prompt longer than max_ctx
 * is KEEL_E_RANGE naming both numbers; reaching max_ctx later is a normal stop (KEEL_STOP_CONTEXT). */
keel_code keel_generate(keel_engine *e, const int *prompt, int n_prompt, const keel_gen_opts *o, keel_token_fn fn,
                        void *user, keel_gen_result *res, keel_err *err);

/* ---- the CUDA engine (src/engine/cuda, docs/cuda-engine.md) --------------------------------------------- */

/* Which engine runs a command. */
typedef enum keel_backend {
    KEEL_BACKEND_CPU = 0,
    KEEL_BACKEND_CUDA = 1,
} keel_backend;

/* `keel bench decode MODEL_DIR [--prompt-tokens P] [--tokens N] [--backend cpu|cuda]`; returns the exit status. */
int keel_engine_bench_decode(int argc, char **argv);

#ifdef KEEL_HAVE_CUDA
/* The whole forward on the GPU: weights uploaded once (packed as stored) into one device allocation, activations
 * into the stream tiles in bf16, residual stream, Mamba state and the KV cache in fp32. Opaque. */
typedef struct keel_cuda_engine keel_cuda_engine;

/* Kernel families that `keel bench decode` times with CUDA events. */
typedef enum keel_cuda_family {
    KEEL_CUF_EMBED = 0, KEEL_CUF_NORM, KEEL_CUF_PROJ, KEEL_CUF_MAMBA, KEEL_CUF_ATTN, KEEL_CUF_ROUTER, KEEL_CUF_EXPERTS,
    KEEL_CUF_LM_HEAD, KEEL_CUF_SAMPLE, KEEL_CUF_N
} keel_cuda_family;
const char *keel_cuda_family_name(keel_cuda_family f);

/* Uploads the model and allocates state for max_ctx tokens. No device, a checkpoint or context that does not fit
 * in free device memory, or a shape the kernels do not take is an error with the numbers, never a crash. */
keel_code keel_cuda_engine_init(keel_cuda_engine **e, const keel_model *m, int max_ctx, keel_err *err);
void keel_cuda_engine_free(keel_cuda_engine *e); /* accepts NULL */
void keel_cuda_engine_reset(keel_cuda_engine *e);
int keel_cuda_engine_pos(const keel_cuda_engine *e);
int keel_cuda_engine_max_ctx(const keel_cuda_engine *e);
size_t keel_cuda_engine_weight_bytes(const keel_cuda_engine *e);
/* As keel_engine_forward, on the GPU; n tokens go through in windows of up to `window` rows. 1..8 rows: exact
 * windows (every row's bits as if it ran alone); 9..64: prompt chunks (the chunked Mamba scan, within its bound of
 * stepping token by token); other values: 8. */
keel_code keel_cuda_engine_forward(keel_cuda_engine *e, const int *tokens, int n, float *logits,
                                   keel_logits_mode mode, float *hidden, keel_err *err);
void keel_cuda_engine_set_window(keel_cuda_engine *e, int rows);
/* Rows per chunk of keel_cuda_generate's prompt: 1..64 (default 64: prompt chunks); other values: 64. */
void keel_cuda_engine_set_prompt_rows(keel_cuda_engine *e, int rows);
/* Decode steps as a captured CUDA graph (default on) or launch by launch; the tokens are the same either way. */
void keel_cuda_engine_set_graphs(keel_cuda_engine *e, bool on);
/* Independent launches of a layer on a second stream beside the first (the shared expert beside the router and the
 * routed experts; k and v beside q): 0 off, 1 on (default), 2 on with the second stream at the lowest priority.
 * Scheduling only: the same bits either way. Other values: 1. Per-family profiling runs with it off. */
void keel_cuda_engine_set_side(keel_cuda_engine *e, int mode);
#define KEEL_CUDA_ENGINE_SIDE_DEFAULT 1
/* The MoE router (logits, top-k, the 8-row groups' unions) as one launch or three (default); the same bits. */
void keel_cuda_engine_set_fused_router(keel_cuda_engine *e, bool on);
#define KEEL_CUDA_ENGINE_FUSED_ROUTER_DEFAULT 0
/* With the router in separate launches: top-k and the groups' unions as one launch (default) or two; the same bits. */
void keel_cuda_engine_set_route_window(keel_cuda_engine *e, bool on);
#define KEEL_CUDA_ENGINE_ROUTE_WINDOW_DEFAULT 1
/* The residual add and norm before a MoE layer in its router's matvec (default) or as a launch of its own; the same
 * bits. */
void keel_cuda_engine_set_fused_norm(keel_cuda_engine *e, bool on);
#define KEEL_CUDA_ENGINE_FUSED_NORM_DEFAULT 1
/* Windows of at most 8 rows through the packed stream tile (default) or the ring tile alone, on the matrices init
 * packed once beside the ring layout: those where the packed tile gives the ring tile's bits (BF16 scales, neither
 * tile splitting k) and is faster, a row tile for every warp of a full grid (lm_head); the same bits either way.
 * keel_cuda_engine_pack_scope(KEEL_CUDA_ENGINE_PACK_ALL), before init, packs every such matrix whatever its size
 * (tests; small matrices are slower on it); keel_cuda_engine_packed_count: how many matrices have a packed copy. */
void keel_cuda_engine_set_packed(keel_cuda_engine *e, bool on);
int keel_cuda_engine_packed_count(const keel_cuda_engine *e);
#define KEEL_CUDA_ENGINE_PACKED_DEFAULT 1
void keel_cuda_engine_pack_scope(int scope);
#define KEEL_CUDA_ENGINE_PACK_LARGE 1
#define KEEL_CUDA_ENGINE_PACK_ALL 2
/* Mamba's decode step (conv, scan, gated norm) as one launch or three (default); the same bits. */
void keel_cuda_engine_set_fused_mamba(keel_cuda_engine *e, bool on);
#define KEEL_CUDA_ENGINE_FUSED_MAMBA_DEFAULT 0
/* Benchmarks of long-context decode: keel_cuda_generate places its prompt at position pos (0: normal), the KV
 * cache holding zeros before it. */
void keel_cuda_engine_set_start(keel_cuda_engine *e, int pos);
/* Bytes one decode step reads at context ctx: every matrix it streams (top_k experts of each MoE layer), the Mamba
 * states and ctx rows of keys and values per attention layer (the bandwidth floor's numerator). */
size_t keel_cuda_engine_step_bytes(const keel_cuda_engine *e, int ctx);
/* Activations into the matrices: BF16 (the stream tiles; default) or F32 (the fp32 matvec: slower, within float32
 * rounding of the CPU engine). Other dtypes are KEEL_E_ARG. */
keel_code keel_cuda_engine_set_activations(keel_cuda_engine *e, keel_dtype dt, keel_err *err);
/* As keel_engine_mtp, on the GPU. */
keel_code keel_cuda_engine_mtp(keel_cuda_engine *e, const float *h, const int *next, int n, float *logits,
                               float *out_hidden, keel_err *err);
/* As keel_generate, on the GPU: the draw (argmax or the seeded sampler, the same token as the CPU engine's) runs
 * on the device; each decode step after the first replays one captured CUDA graph unless graphs are off. */
keel_code keel_cuda_generate(keel_cuda_engine *e, const int *prompt, int n_prompt, const keel_gen_opts *o,
                             keel_token_fn fn, void *user, keel_gen_result *res, keel_err *err);
/* Per-family timing with CUDA events: on/off, then the milliseconds and launches accumulated since enabling. */
void keel_cuda_engine_profile(keel_cuda_engine *e, bool on);
void keel_cuda_engine_profile_get(const keel_cuda_engine *e, double ms[KEEL_CUF_N],
                                  long launches[KEEL_CUF_N]);
#endif

/* ---- internals shared by the engine's files ------------------------------------------------------------ */

/* y (m, n) = rmsnorm of each row of x (m, n) times w; y may equal x. */
void keel_engine_rmsnorm(const float *x, const keel_vec *w, int m, int n, float eps, float *y);
/* The embedding rows of tokens into x (m, hidden). */
void keel_engine_embed(const keel_engine *e, const int *tokens, int m, float *x);
/* Mamba-2 mixer on m rows of xn at consecutive positions, state slot `slot`; out (m, hidden). */
void keel_engine_mamba(keel_engine *e, const keel_mamba_w *w, int slot, const float *xn, int m, float *out);
/* Attention on m rows at positions pos..pos+m-1 with caches kc, vc (max_ctx, kv_dim); out (m, hidden). */
void keel_engine_attention(keel_engine *e, const keel_attn_w *w, float *kc, float *vc, int pos, const float *xn,
                           int m, float *out);
/* Dense squared-ReLU MLP: out (m, hidden) = down(relu(up(xn))^2). */
void keel_engine_mlp(keel_engine *e, const keel_mlp_w *w, const float *xn, int m, float *out);
/* Routed experts plus the shared expert on m rows; out (m, hidden). */
void keel_engine_moe(keel_engine *e, const keel_moe_w *w, const float *xn, int m, float *out);
/* The router's choice for one token: top_k experts in slot order and their weights, from logits (n_experts). */
void keel_engine_route(const keel_config *c, const float *logits, const keel_vec *corr_bias, int *sel, float *w);

#endif
