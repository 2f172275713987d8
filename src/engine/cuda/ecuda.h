/* engine/cuda: launchers of the GPU engine's own kernels (everything but the stream tiles) and the runtime calls
 * the host engine needs without aborting (allocation, memory info, events). Plain C; device pointers; `st` is a
 * cudaStream_t (NULL: the default stream). Every kernel computes each row of a window with the same arithmetic
 * whatever the window's row count, so a row launched alone gives the same bits. */
#ifndef KEEL_ENGINE_CUDA_ECUDA_H
#define KEEL_ENGINE_CUDA_ECUDA_H

#include "../../kernels/cuda/cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A float vector on the device (norm weights, biases, A_log, ...); n == 0 means absent. */
typedef struct keel_ecu_vec {
    const void *p;
    keel_dtype dt; /* BF16, F16 or F32 */
    int n;
} keel_ecu_vec;

/* ---- runtime: failures return false with a reason instead of aborting ---- */
bool keel_ecu_malloc(void **p, size_t bytes, char *why, size_t cap);
bool keel_ecu_mem_info(size_t *free_b, size_t *total_b);
void keel_ecu_free(void *p);
void keel_ecu_upload(void *dst, const void *src, size_t bytes, void *st);
void keel_ecu_download(void *dst, const void *src, size_t bytes, void *st);
void keel_ecu_sync(void *st);
void *keel_ecu_event_new(void);
void keel_ecu_event_free(void *ev);
void keel_ecu_event_record(void *ev, void *st);
float keel_ecu_event_ms(void *a, void *b); /* elapsed between two recorded events (synchronizes on b) */
void *keel_ecu_stream_new(void);  /* a non-blocking stream: the engine's launches and graph captures */
void *keel_ecu_stream_new_low(void); /* the same at the device's lowest priority */
void keel_ecu_stream_wait(void *st, void *ev); /* st's later work waits for ev's last record (captured as an edge) */
void keel_ecu_stream_free(void *st); /* accepts NULL */
void *keel_ecu_host_alloc(size_t bytes); /* page-locked host memory (copies a graph can capture) */
void keel_ecu_host_free(void *p);    /* accepts NULL */
void keel_ecu_memset(void *dst, int byte, size_t bytes, void *st);
void keel_ecu_download_async(void *dst, const void *src, size_t bytes, void *st); /* no sync */
/* CUDA graphs: capture the launches queued on st between begin and end into an instantiated graph (*exec). */
bool keel_ecu_capture_begin(void *st, char *why, size_t cap);
bool keel_ecu_capture_end(void *st, void **exec, char *why, size_t cap);
void keel_ecu_graph_launch(void *exec, void *st);
void keel_ecu_graph_free(void *exec); /* accepts NULL */
/* Whether the engine's kernels launch as programmatic dependents (sm_90, with the stream tiles' PDL active): each
 * waits for the previous kernel at its start, then releases the next, so its launch and setup overlap that kernel's
 * tail. Scheduling only, the bits never change; a graph captured before a change keeps its launches. */
void keel_ecu_set_pdl(int on);
bool keel_ecu_pdl_on(void);
#define KEEL_ECU_PDL_DEFAULT 1
/* Every engine kernel prefers all of L1 as shared memory, as the stream tiles do: kernels with different carveouts
 * cannot share an SM, so a change between launches drains it (measured in docs/performance.md). Once per process. */
void keel_ecu_prefer_shared(void);

/* The host function pointer of an engine kernel by its gate-5 audit symbol ("matvec_kernel"); NULL if unknown. The
 * _at forms walk the same tables by index (NULL past the end): kernels.cu's, attn.cu's, scan.cu's then sample.cu's. */
const void *keel_ecu_kernel_fn(const char *symbol);
const void *keel_ecu_kernel_at(int i);
const void *keel_ecu_attn_kernel_at(int i);
const void *keel_ecu_scan_kernel_at(int i);
/* A kernel's preferred shared-memory carveout as the runtime holds it (percent; -1 where the runtime has none). */
int keel_ecu_kernel_carveout(const void *fn);

/* ---- kernels ---- */
/* x (m, hidden) = rows tok[0..m) of the embedding table (quantized: scale*q + bias; or float, bits == 0). */
void keel_ecu_embed(const keel_cuda_qw *t, const int *tok, int m, float *x, void *st);
/* Row-wise RMSNorm of x (m, n; row stride ldx) times w into yf (fp32, stride ldy) and/or yb (bf16, stride ldy). */
void keel_ecu_rmsnorm(const float *x, int ldx, const keel_ecu_vec *w, int m, int n, float eps, float *yf,
                      uint16_t *yb, int ldy, void *st);
/* xo = x + (a [+ b] [+ bias]) row by row (xo may be x), then, with w, the RMSNorm of xo into yf / yb (stride n). */
void keel_ecu_add_rmsnorm(float *xo, const float *x, const float *a, const float *b, const keel_ecu_vec *bias,
                          const keel_ecu_vec *w, int m, int n, float eps, float *yf, uint16_t *yb, void *st);
/* keel_ecu_add_rmsnorm (xo never x; yf required), then keel_ecu_matvec of yf (F32) into y (m, W->n, F32), in one
 * launch where the rows fit a block's shared memory, else as those two: the same bits either way. */
void keel_ecu_matvec_norm(const keel_cuda_qw *W, float *xo, const float *x, const float *a, const float *b,
                          const keel_ecu_vec *bias, const keel_ecu_vec *w, int m, float eps, float *yf, uint16_t *yb,
                          float *y, void *st);
/* keel_ecu_matvec_norm's rows in dynamic shared memory at most: with its 1 KB static, 48 KB (no opt-in needed). */
#define KEEL_ECU_MATVEC_NORM_SMEM (47 * 1024)
/* y (m, n; stride ld) += bias. */
void keel_ecu_add_bias(float *y, int m, int n, int ld, const keel_ecu_vec *b, void *st);
/* y (m, n) = epi(x (m, k) . dequant(W)^T) in fp32 arithmetic (router, float matrices): per group
 * scale*sum(x*q) + bias*sum(x). x F32 or BF16, y F32 or BF16. */
void keel_ecu_matvec(const keel_cuda_qw *W, const void *x, keel_dtype xdt, int m, void *y, keel_dtype ydt,
                     keel_epilogue epi, void *st);
/* Routed fp32 matvec: for each of m*K items i, y (m*K, n) row i = epi(x row . W[sel[i]]^T) with x row i when
 * x_per_item, else row i / K; W a stack of experts (expert_words / expert_groups apart). */
void keel_ecu_matvec_routed(const keel_cuda_qw *W, const float *x, bool x_per_item, int m, const int *sel, int K,
                            float *y, keel_epilogue epi, void *st);
/* out (m, n) = sum over slots k in order of w[(r*K+k)*8] * y (m*K, n) row r*K+k, from 0 (the CPU engine's order). */
void keel_ecu_combine(const float *y, const float *w, int m, int K, int n, float *out, void *st);
/* Mamba causal conv + SiLU of m consecutive tokens: input columns [off, off+C) of proj (m, ld), window win
 * (K-1, C) oldest first (updated), weights cw (C, K), bias cb; out (m, C). */
void keel_ecu_conv(const float *proj, int ld, int off, float *win, const keel_ecu_vec *cw, const keel_ecu_vec *cb,
                   int K, int C, int m, float *out, void *st);
/* Mamba SSM recurrence of m consecutive tokens: xbc (m, CD) = x | B | C, dt raw at proj (m, ld) column dt_off,
 * state (NH, P, N) updated; y (m, NH*P) = state.C + D x. */
void keel_ecu_ssm(const float *xbc, int CD, const float *proj, int ld, int dt_off, float *state,
                  const keel_ecu_vec *dt_bias, const keel_ecu_vec *A_log, const keel_ecu_vec *D, int NH, int P,
                  int N, int G, int m, float *y, void *st);
/* The same scan of m tokens (any m; ssm_state N <= 128) in the chunked (SSD) form (src/engine/cuda/scan.cu): chunk
 * outputs as masked products, chunk states passed in order. Its outputs and final state equal keel_ecu_ssm's within
 * the bound derived in src/contract/engine_regs_scan.c, not bit for bit. */
void keel_ecu_ssm_chunked(const float *xbc, int CD, const float *proj, int ld, int dt_off, float *state,
                          const keel_ecu_vec *dt_bias, const keel_ecu_vec *A_log, const keel_ecu_vec *D, int NH, int P,
                          int N, int G, int m, float *y, void *st);
/* The seeded sampler's token for logits (V, 1 <= V <= 2^21) into *out_tok: the same token as keel_sampler_sample
 * (src/engine/sample.c) for the same configuration, seed and the absolute position *d_pos (read on the device, so
 * a captured graph replays it). One launch, no allocation, no host sync; scratch: keel_ecu_sample_scratch_bytes(V). */
void keel_ecu_sample(const float *logits, int V, float temp, int top_k, float top_p, float min_p, uint64_t seed,
                     const int *d_pos, int *out_tok, void *scratch, void *st);
size_t keel_ecu_sample_scratch_bytes(int V);
/* The host function pointer of a kernel of scan.cu or sample.cu by its gate-5 audit symbol; NULL if unknown. */
const void *keel_ecu_scan_kernel_fn(const char *symbol);
/* Gated grouped RMSNorm: out (m, DI) = groupnorm(y * silu(z)) * w, z = proj (m, ld) columns [0, DI); into out
 * (bf16) and/or outf (fp32), either may be NULL. */
void keel_ecu_gate_norm(const float *y, const float *proj, int ld, const keel_ecu_vec *w, int G, int DI, float eps,
                        int m, uint16_t *out, float *outf, void *st);
/* ---- attention for CUDA graphs (src/engine/cuda/attn.cu): the position is read from device memory at d_pos and
 * no launch configuration depends on it. A row's result depends only on its position and inputs: the same bits
 * alone or in any window of any size, in any grid. ---- */
#define KEEL_ECU_ATTN_CHUNK 64       /* keys per split-K chunk (a fixed part of every row's arithmetic) */
#define KEEL_ECU_ATTN_SPLIT_MAX_M 32 /* up to this many rows a launch splits keys over blocks (needs scratch) */
/* Cache rows *d_pos .. *d_pos+m-1 of kc, vc (ctx, kvd) = rows of k, v (m, kvd) [+ kb, vb; n == 0: absent]. */
void keel_ecu_kv_append(const float *k, const float *v, const keel_ecu_vec *kb, const keel_ecu_vec *vb, float *kc,
                        float *vc, int kvd, const int *d_pos, int m, void *st);
/* Causal GQA without RoPE, flash-style split-K: rows r < m of q (m, nh*hd) fp32 [+ qb] at positions *d_pos + r over
 * caches kc, vc (ctx, kvd) already holding rows up to *d_pos+m-1; o (m, nh*hd) into o (bf16) and/or of (fp32),
 * either may be NULL. scratch: keel_ecu_attn_scratch_bytes(m, ...) bytes (may be NULL where that is 0). */
void keel_ecu_attn(const float *q, const keel_ecu_vec *qb, const float *kc, const float *vc, int kvd,
                   const int *d_pos, int m, int nh, int nkv, int hd, int ctx, float *scratch, uint16_t *o, float *of,
                   void *st);
/* Scratch of an m-row launch: the split-K partials for m <= KEEL_ECU_ATTN_SPLIT_MAX_M, else 0 (not monotone in m:
 * windows of several sizes need the largest over them). */
size_t keel_ecu_attn_scratch_bytes(int m, int nh, int hd, int ctx);
/* Scratch enough for a launch of any row count from 1 to m_max (the largest keel_ecu_attn_scratch_bytes of them). */
size_t keel_ecu_attn_scratch_max_bytes(int m_max, int nh, int hd, int ctx);
/* The host function pointer of an attn.cu kernel by its gate-5 audit symbol ("attn_tile_kernel<2>"); NULL if unknown. */
const void *keel_ecu_attn_kernel_fn(const char *symbol);
/* The contract's twin of attn.cu (src/contract/twin_attn.cu): launchers keel_contract_twin_ecu_*, one fault armed. */
#define KEEL_ECU_ATTN_PLANT_NONE 0
#define KEEL_ECU_ATTN_PLANT_NORESCALE 1 /* attn: a tile does not rescale the running o by alpha (gate 3) */
#define KEEL_ECU_ATTN_PLANT_ROWLEAK 2   /* attn: outputs scaled by 1 + 2^-20 when the launch has several rows (4) */
#define KEEL_ECU_ATTN_PLANT_PASTEND 3   /* attn: fp32 output, kv_append: cache, one element past the last (2) */
#define KEEL_ECU_ATTN_PLANT_NOBIAS 4    /* kv_append: biases dropped (3) */
void keel_contract_twin_ecu_attn_arm(int fault);
void keel_contract_twin_ecu_kv_append(const float *k, const float *v, const keel_ecu_vec *kb, const keel_ecu_vec *vb,
                                      float *kc, float *vc, int kvd, const int *d_pos, int m, void *st);
void keel_contract_twin_ecu_attn(const float *q, const keel_ecu_vec *qb, const float *kc, const float *vc, int kvd,
                                 const int *d_pos, int m, int nh, int nkv, int hd, int ctx, float *scratch,
                                 uint16_t *o, float *of, void *st);
size_t keel_contract_twin_ecu_attn_scratch_bytes(int m, int nh, int hd, int ctx);
size_t keel_contract_twin_ecu_attn_scratch_max_bytes(int m_max, int nh, int hd, int ctx);
/* One Mamba-2 step of m (1..8) tokens in one launch: keel_ecu_conv of proj's xBC columns (proj rows z (DI) | xBC (CD)
 * | dt (NH), CD = DI + 2*G*N) into xbc, keel_ecu_ssm into y, keel_ecu_gate_norm into out or outf; the same bits as
 * the three. cnt: G counters, zero before and after (the launch resets them); launches must not overlap. */
void keel_ecu_mamba_step(const float *proj, int ld, float *win, const keel_ecu_vec *cw, const keel_ecu_vec *cb, int K,
                         float *state, const keel_ecu_vec *dt_bias, const keel_ecu_vec *A_log, const keel_ecu_vec *D,
                         int NH, int P, int N, int G, int m, const keel_ecu_vec *norm, float eps, float *xbc, float *y,
                         unsigned *cnt, uint16_t *out, float *outf, void *st);
/* The router of each of m rows from its logits (m, E): items (m*K) {expert, mask 1} in slot order and weights
 * (m*K*8) [item][row 0] for one-row routed launches; sel (m*K) the experts. */
void keel_ecu_route(const float *logits, const keel_ecu_vec *corr, int E, int K, int n_group, int topk_group,
                    bool norm_topk, float scaling, int m, keel_cuda_route *items, float *weights, int *sel, void *st);
/* Per group of up to 8 consecutive rows g (rows 8g..): the union of the experts in sel (m*K) in ascending order as
 * items[g*cap ..] (expert, mask of the group's rows choosing it) and weights[(g*cap + item)*8 + row] from the one-row
 * weights w (m*K*8, as keel_ecu_route writes them); padded to cap (>= the union's size) with (0, 0) items. */
void keel_ecu_route_union(const int *sel, const float *w, int m, int K, int E, int cap, keel_cuda_route *items,
                          float *weights, void *st);
/* keel_ecu_route then keel_ecu_route_union in one launch (a block per 8-row group): the same outputs and bits. */
void keel_ecu_route_window(const float *logits, const keel_ecu_vec *corr, int E, int K, int n_group, int topk_group,
                           bool norm_topk, float scaling, int m, keel_cuda_route *items1, float *w1, int *sel, int cap,
                           keel_cuda_route *items, float *weights, void *st);
/* The MoE router in one launch: logits (m, E) = x (m, k) fp32 . W^T (keel_ecu_matvec, W a float matrix), then
 * keel_ecu_route into items1, w1, sel, then keel_ecu_route_union into items, weights (cap per group): the same bits
 * as the three. Launches of it must not overlap (one ticket counter). */
void keel_ecu_router(const keel_cuda_qw *W, const float *x, int m, float *logits, const keel_ecu_vec *corr, int K,
                     int n_group, int topk_group, bool norm_topk, float scaling, keel_cuda_route *items1, float *w1,
                     int *sel, int cap, keel_cuda_route *items, float *weights, void *st);
/* out = index of the largest of v (n), ties to the lower index, NaN never wins. */
void keel_ecu_argmax(const float *v, int n, int *out, void *st);

/* ---- the contract's twin of these kernels (src/contract/twin_engine_cuda.cu): same launchers renamed
 * keel_contract_twin_ecu_*, with one planted fault armed at a time ---- */
#define KEEL_ECU_PLANT_NONE 0
#define KEEL_ECU_PLANT_WIDTH4 1  /* embed: codes read as 4-bit (gate 3) */
#define KEEL_ECU_PLANT_PASTEND 2 /* rmsnorm, add_bias: one element written past the last row (gate 2) */
#define KEEL_ECU_PLANT_NOBIAS 3  /* add_rmsnorm: bias dropped; matvec: group bias term dropped; ssm: D skip dropped;
                                  * combine: the last slot dropped */
#define KEEL_ECU_PLANT_ROWLEAK 4 /* matvec (float): a row's bits depend on the window (gate 4) */
#define KEEL_ECU_PLANT_NOSHIFT 5 /* conv: the window never takes the new input (gate 3) */
#define KEEL_ECU_PLANT_GROUPS 6  /* gate_norm: the first group one channel too wide (gate 3) */
#define KEEL_ECU_PLANT_TIES 7    /* route, argmax: ties to the higher id (gate 3) */
#define KEEL_ECU_PLANT_ORDER 8   /* route_union, route_window, router: the union in descending expert order (gate 3) */
void keel_contract_twin_ecu_arm(int fault);
void keel_contract_twin_ecu_embed(const keel_cuda_qw *t, const int *tok, int m, float *x, void *st);
void keel_contract_twin_ecu_rmsnorm(const float *x, int ldx, const keel_ecu_vec *w, int m, int n, float eps, float *yf,
                                    uint16_t *yb, int ldy, void *st);
void keel_contract_twin_ecu_add_rmsnorm(float *xo, const float *x, const float *a, const float *b,
                                        const keel_ecu_vec *bias, const keel_ecu_vec *w, int m, int n, float eps,
                                        float *yf, uint16_t *yb, void *st);
void keel_contract_twin_ecu_matvec_norm(const keel_cuda_qw *W, float *xo, const float *x, const float *a,
                                        const float *b, const keel_ecu_vec *bias, const keel_ecu_vec *w, int m,
                                        float eps, float *yf, uint16_t *yb, float *y, void *st);
void keel_contract_twin_ecu_add_bias(float *y, int m, int n, int ld, const keel_ecu_vec *b, void *st);
void keel_contract_twin_ecu_matvec(const keel_cuda_qw *W, const void *x, keel_dtype xdt, int m, void *y,
                                   keel_dtype ydt, keel_epilogue epi, void *st);
void keel_contract_twin_ecu_conv(const float *proj, int ld, int off, float *win, const keel_ecu_vec *cw,
                                 const keel_ecu_vec *cb, int K, int C, int m, float *out, void *st);
void keel_contract_twin_ecu_ssm(const float *xbc, int CD, const float *proj, int ld, int dt_off, float *state,
                                const keel_ecu_vec *dt_bias, const keel_ecu_vec *A_log, const keel_ecu_vec *D, int NH,
                                int P, int N, int G, int m, float *y, void *st);
void keel_contract_twin_ecu_gate_norm(const float *y, const float *proj, int ld, const keel_ecu_vec *w, int G, int DI,
                                      float eps, int m, uint16_t *out, float *outf, void *st);
void keel_contract_twin_ecu_matvec_routed(const keel_cuda_qw *W, const float *x, bool x_per_item, int m,
                                          const int *sel, int K, float *y, keel_epilogue epi, void *st);
void keel_contract_twin_ecu_combine(const float *y, const float *w, int m, int K, int n, float *out, void *st);
void keel_contract_twin_ecu_route(const float *logits, const keel_ecu_vec *corr, int E, int K, int n_group,
                                  int topk_group, bool norm_topk, float scaling, int m, keel_cuda_route *items,
                                  float *weights, int *sel, void *st);
void keel_contract_twin_ecu_argmax(const float *v, int n, int *out, void *st);
void keel_contract_twin_ecu_route_union(const int *sel, const float *w, int m, int K, int E, int cap,
                                        keel_cuda_route *items, float *weights, void *st);
void keel_contract_twin_ecu_route_window(const float *logits, const keel_ecu_vec *corr, int E, int K, int n_group,
                                         int topk_group, bool norm_topk, float scaling, int m, keel_cuda_route *items1,
                                         float *w1, int *sel, int cap, keel_cuda_route *items, float *weights,
                                         void *st);
void keel_contract_twin_ecu_mamba_step(const float *proj, int ld, float *win, const keel_ecu_vec *cw,
                                       const keel_ecu_vec *cb, int K, float *state, const keel_ecu_vec *dt_bias,
                                       const keel_ecu_vec *A_log, const keel_ecu_vec *D, int NH, int P, int N, int G,
                                       int m, const keel_ecu_vec *norm, float eps, float *xbc, float *y,
                                       unsigned *cnt, uint16_t *out, float *outf, void *st);
void keel_contract_twin_ecu_router(const keel_cuda_qw *W, const float *x, int m, float *logits,
                                   const keel_ecu_vec *corr, int K, int n_group, int topk_group, bool norm_topk,
                                   float scaling, keel_cuda_route *items1, float *w1, int *sel, int cap,
                                   keel_cuda_route *items, float *weights, void *st);

#ifdef __cplusplus
}
#endif

#endif
