/* kernels/cuda: the GPU backend's C-callable surface. Launchers are extern "C"; this header is plain C. */
#ifndef KEEL_KERNELS_CUDA_H
#define KEEL_KERNELS_CUDA_H

#include "../../core/core.h"
#ifdef __cplusplus
extern "C" { /* format.h and cpu.h are plain C without their own guards */
#endif
#include "../cpu/cpu.h"
#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Number of usable CUDA devices (0 when there is no driver or no device); never aborts. */
int keel_cuda_device_count(void);
/* Describes device 0 ("NVIDIA H200, sm_90, 132 SMs, 139.8 GiB") into buf; false when there is none. */
bool keel_cuda_device_name(char *buf, size_t cap);
/* SMs of the current device, asked once and cached (launch sizing); aborts if the runtime cannot answer. */
int keel_cuda_sm_count(void);

/* ---- device memory (tests, benchmarks and the engine's uploads); failures abort via KEEL_CUDA_CHECK ---- */
void *keel_cuda_malloc(size_t bytes);
void keel_cuda_free(void *p); /* accepts NULL */
void keel_cuda_upload(void *dst, const void *src, size_t bytes);
void keel_cuda_download(void *dst, const void *src, size_t bytes);
void keel_cuda_memset(void *dst, int byte, size_t bytes);
void keel_cuda_sync(void);

/* ---- stream tiles: y (m, n) = epi(x (m, k) . dequant(W)^T) for m = 1..8 rows, read straight from the packed
 * MLX affine codes (docs/stream-tiles.md). Per group: scale*sum(x*q) + bias*sum(x), fp32 accumulation.
 * Row r of an m-row launch is bit-identical to a 1-row launch of row r; repeated launches are bit-identical.
 * All pointers are device pointers; `stream` is a cudaStream_t (NULL: the default stream). Shapes are the
 * caller's invariants (checked by KEEL_ASSERT): bits 2..8 valid, group 32/64/128, k % group == 0. ---- */

#define KEEL_CUDA_STREAM_MAX_ROWS 8
#define KEEL_CUDA_STREAM_ROWS_MAX 256 /* keel_cuda_stream_matmul_rows: rows in one launch */

/* A packed matrix on the device, or a stack of E experts (E, n, k) with the given strides between experts. */
typedef struct keel_cuda_qw {
    const uint32_t *w;      /* (n, k*bits/32) codes per expert */
    const void *scales;     /* (n, k/group) per expert */
    const void *biases;
    int n, k, bits, group;
    keel_dtype sdt;         /* BF16, F16 or F32 */
    int64_t expert_words;   /* words between experts' codes (0 for a single matrix) */
    int64_t expert_groups;  /* scale elements between experts */
    int items;              /* items a routed launch of this stack brings (the router's top-k), which its k-split is
                             * chosen for; 0 or 1: one. A property of the matrix, never of one launch's item list. */
} keel_cuda_qw;

/* One routed item: an expert and the tokens (bits of rows 0..m-1) that selected it. */
typedef struct keel_cuda_route {
    int32_t expert;
    uint32_t mask;
} keel_cuda_route;

/* x: (m, k) BF16 or F16, row-major; y: (m, n) F32 or BF16. */
void keel_cuda_stream_matmul(const keel_cuda_qw *W, const void *x, keel_dtype xdt, int m, void *y, keel_dtype ydt,
                             keel_epilogue epi, void *stream);
/* The unfused epilogue: y[i] = relu(y[i])^2 in place (F32 or BF16, computed in fp32). */
void keel_cuda_relu2(void *y, keel_dtype ydt, size_t count, void *stream);
/* Routed fc1 in one launch: for item i (device array), h[i] (m, n) rows in items[i].mask = epi(x . W1[e]^T);
 * other rows of h[i] are left untouched. h: (n_items, m, n) of dtype hdt. */
void keel_cuda_stream_experts_up(const keel_cuda_qw *W1, const void *x, keel_dtype xdt, int m,
                                 const keel_cuda_route *items, int n_items, void *h, keel_dtype hdt,
                                 keel_epilogue epi, void *stream);
/* Routed fc2 in one launch: y[r] = sum over items i in list order with r in mask of weights[i*8+r] * (h[i][r] .
 * W2[e]^T); each output element is owned by one thread, so the sum order is fixed. h: (n_items, m, k). */
void keel_cuda_stream_experts_down(const keel_cuda_qw *W2, const void *h, keel_dtype hdt, int m,
                                   const keel_cuda_route *items, const float *weights, int n_items, void *y,
                                   keel_dtype ydt, void *stream);
/* Up to KEEL_CUDA_STREAM_ROWS_MAX rows in one launch (the prompt path): x (m, k), y (m, n) as above; the rows go
 * in groups of 8 (grid items), and every row's bits equal its 1-row keel_cuda_stream_matmul. */
void keel_cuda_stream_matmul_rows(const keel_cuda_qw *W, const void *x, keel_dtype xdt, int m, void *y,
                                  keel_dtype ydt, keel_epilogue epi, void *stream);
/* The k-split a launch of a matrix of this shape uses (1 = none), for `items` its keel_cuda_qw.items (0 or 1: a
 * plain matrix). It depends on n, k, that hint and the device's SM count only: never on m nor on the item list of
 * a launch, so a routed launch over a window's union of experts rounds every item as a launch of one token's would. */
int keel_cuda_stream_splits(int n, int k, int items);
/* Benchmark knobs of the stream tiles (scheduling only, never the arithmetic): whether the weight copies ask L2 for
 * whole 256-byte blocks (0 or 1), and the cap on the shared-memory ring's depth (2..8); (-1, -1) restores the
 * defaults, the measured best (docs/stream-tiles.md). False, and nothing changed, when out of range. */
bool keel_cuda_stream_tune(int l2_block, int max_stages);
/* Benchmark diagnosis only (`keel bench stream --sweep`): 1 leaves the tiles' arithmetic out (the memory pipeline
 * alone), 2 their weight copies (the arithmetic alone, on stale shared memory); outputs are wrong while it is set.
 * 0 (the default) restores the tiles. */
void keel_cuda_stream_diag(int mode);
/* Scheduling knobs (never the arithmetic): each warp asks L2 for its rows' next chunk of `chunk_stages` stages ahead of
 * its ring (0, the default: none; docs/stream-tiles.md has what it measured); false, and nothing changed,
 * outside 0..64. keel_cuda_stream_pdl(1), the default, launches the tiles as programmatic dependents on sm_90+: a tile
 * starts its weight prefetch while the previous kernel on the stream still runs and waits for it before reading x. */
bool keel_cuda_stream_prefetch(int chunk_stages);
void keel_cuda_stream_pdl(int on);
/* Whether launches go out as programmatic dependents now (keel_cuda_stream_pdl on and an sm_90+ device): the engine's
 * kernels that start with loads of weights launch the same way. */
bool keel_cuda_stream_pdl_active(void);
#define KEEL_CUDA_STREAM_PREFETCH_DEFAULT 0
#define KEEL_CUDA_STREAM_PDL_DEFAULT 1
/* The k-split's target (keel_cuda_stream_splits): split a shape whose row tiles give fewer than quarters / 4 blocks an
 * SM into that many blocks; 1..64 (default 4), false outside. It changes the slices' sums, so set it before any launch
 * whose bits must match another's (a captured graph, an exact window). */
bool keel_cuda_stream_split_target(int quarters);
#define KEEL_CUDA_STREAM_SPLIT_TARGET_DEFAULT 4
/* keel_cuda_stream_split_long(1): a shape with enough row tiles but a slice of 2048+ codes splits in two when both
 * halves' blocks still fit the SMs at once (docs/stream-tiles.md); 0, the default: it does not. Like the target, it
 * changes the slices' sums: set it before any launch whose bits must match another's. */
void keel_cuda_stream_split_long(int on);
#define KEEL_CUDA_STREAM_SPLIT_LONG_DEFAULT 0
/* keel_cuda_stream_split_round(1): the k-split's slice count rounds down, so a split shape never gives more than the
 * target's quarters / 4 blocks an SM; 0, the default: it rounds up (at least that many). Like the target, it changes
 * the slices' sums: set it before any launch whose bits must match another's. */
void keel_cuda_stream_split_round(int down);
#define KEEL_CUDA_STREAM_SPLIT_ROUND_DEFAULT 0

/* Changes whenever the tiles' scratch (k-split partials, arrival counters) is reallocated, which a launch does only
 * the first time it needs more: a CUDA graph captured before a change holds freed memory and must be captured again. */
unsigned keel_cuda_stream_scratch_epoch(void);
/* The tiles keep that scratch per stream (launches on different streams may overlap): this frees the scratch of the
 * stream `owner` (a cudaStream_t; it launches nothing), after its work is done, before the stream is destroyed.
 * Nothing happens for a stream that has none. */
void keel_cuda_stream_scratch_release(void *owner);
/* That scratch of `stream`, grown to at least part_bytes of partials and `counters` arrival counters (zero between
 * launches; a launch that counts to its total sets the counter back to zero): for the packed tile's k parts. Growing
 * synchronizes the device and moves keel_cuda_stream_scratch_epoch, so not while a graph is being captured. */
void keel_cuda_stream_scratch_get(void *stream, size_t part_bytes, size_t counters, float **part, unsigned **cnt);

/* ---- packed stream tiles (src/kernels/cuda/packed.cu): the stream tile's arithmetic on a matrix repacked once
 * into mma fragment order (docs/stream-tiles.md, "The packed tile"). A launch equals keel_cuda_stream_matmul on the
 * source matrix bit for bit wherever neither splits k (keel_cuda_stream_splits(n, k, 0) == 1 and
 * keel_cuda_packed_splits(n, k) == 1). Row r of an m-row launch is bit-identical to a 1-row launch of row r. ---- */
typedef struct keel_cuda_pw {
    const uint8_t *w;       /* keel_cuda_pack's bytes on the device, 16-byte aligned */
    int n, k, bits, group;
    keel_dtype sdt;         /* BF16 or F16 */
    bool span_major;        /* keel_cuda_pack's layout; span-major only where keel_cuda_packed_splits(n, k) > 1 */
} keel_cuda_pw;
/* Shared memory of a packed launch: x fragments (at most KEEL_CUDA_PACKED_XBYTES; longer k goes in chunks) and
 * their per-group sums (group 32 at most); the kernels' attribute is set to the largest. */
#define KEEL_CUDA_PACKED_XBYTES 49152
#define KEEL_CUDA_PACKED_SMEM_FOR(xbytes) ((xbytes) + (xbytes) / 2 / 32 * 4)
#define KEEL_CUDA_PACKED_SMEM KEEL_CUDA_PACKED_SMEM_FOR(KEEL_CUDA_PACKED_XBYTES)
/* The x budget (scheduling only, never the bits: x-chunks split the walk, not its sums' order): the x fragments a
 * packed launch may stage, in bytes, a multiple of 1024 from KEEL_CUDA_PACKED_XBYTES_MIN up to what the device lets
 * one block have (KEEL_CUDA_PACKED_SMEM_FOR of it), or KEEL_CUDA_PACKED_XBUDGET_AUTO, the default (0 restores it):
 * per kernel, the largest that keeps the blocks an SM that KEEL_CUDA_PACKED_XBYTES (what every device takes) gives
 * it, which the gate-5 records' dsmem follows (keel_audit_dsmem). False, and nothing changed, outside that range. A
 * process-wide setting, like the ring's knobs. */
#define KEEL_CUDA_PACKED_XBYTES_MIN 16384
#define KEEL_CUDA_PACKED_XBUDGET_AUTO (-1)
bool keel_cuda_packed_xbudget(int bytes);
/* The budget packed launches use now (bytes, or KEEL_CUDA_PACKED_XBUDGET_AUTO). */
int keel_cuda_packed_xbudget_now(void);
/* The layout: tiles of KEEL_CUDA_PACK_ROWS rows (their count rounded up to even: a zero tile pads an odd one, which
 * a pair walk's second tile reads) by spans of KEEL_CUDA_PACK_SPAN codes (k padded with zeros), one record of
 * KEEL_CUDA_PACK_REC bytes each, tile-major (record (t, s) at t * spans + s) or span-major (at s * tiles + t: the
 * warps walking different tiles at one span read neighbouring bytes); keel_cuda_pack_at gives a record's index. A
 * record holds the 32 lanes' codes, then per row pair g and group of the span the halves scale(g), bias(g),
 * scale(g + 8), bias(g + 8). Lane 4g + t holds 8 items of `bits` bytes, item 2b + h the bytes of codes 8t..8t+7 of
 * block b of row g + 8h; byte q of item i (j = bits * i + q) is the lane's byte KEEL_CUDA_PACK_BYTE(bits, j), kept at
 * KEEL_CUDA_PACK_AT in chunks of KEEL_CUDA_PACK_CHUNK bytes, chunk-major so a warp's load of one chunk is contiguous.
 * At 2 bits a block's two items interleave their bytes (a0 b0 a1 b1), the order the decode's operand halves take. */
#define KEEL_CUDA_PACK_ROWS 16
#define KEEL_CUDA_PACK_SPAN 128
#define KEEL_CUDA_PACK_REC(bits, group) (256 * (bits) + 64 * (KEEL_CUDA_PACK_SPAN / (group)))
#define KEEL_CUDA_PACK_CHUNK(bits) ((bits) % 2 ? 8 : 16)
#define KEEL_CUDA_PACK_BYTE(bits, j) ((bits) == 2 ? ((j) & ~3) | ((j) & 1) << 1 | ((j) >> 1 & 1) : (j))
#define KEEL_CUDA_PACK_AT(bits, lane, j)                                                                              \
    ((j) / KEEL_CUDA_PACK_CHUNK(bits) * 32 * KEEL_CUDA_PACK_CHUNK(bits) + (lane) * KEEL_CUDA_PACK_CHUNK(bits) +      \
     (j) % KEEL_CUDA_PACK_CHUNK(bits))
/* Bytes the packed form of an (n, k) matrix takes; 0 for an invalid shape. Host code (pack.c), no device needed. */
size_t keel_cuda_pack_bytes(int n, int k, int bits, int group);
/* The index of tile t's record of span s (records of KEEL_CUDA_PACK_REC bytes) in the packed form of an (n, k)
 * matrix. */
size_t keel_cuda_pack_at(int n, int k, bool span_major, int t, int s);
/* Whether the packed tile takes scales and biases of this dtype (BF16 only; the ring tile takes every one). */
bool keel_cuda_pack_scales_ok(keel_dtype sdt);
/* Writes the packed form of W (host memory, one matrix, BF16 scales) into dst (host, cap bytes), span-major or
 * tile-major, to be uploaded 16-byte aligned and described by a keel_cuda_pw of that layout; false with the reason in
 * why (nothing written) for F16 or F32 scales (the ring tile takes those), a shape that does not pack, or a short
 * destination. */
bool keel_cuda_pack(const keel_qmat *W, bool span_major, void *dst, size_t cap, char *why, size_t why_cap);
/* keel_cuda_pack of W (host memory) into a new device allocation described by out (owner: the caller, who frees
 * out->w with keel_cuda_free), span-major where keel_cuda_packed_splits(n, k) > 1 (the unsplit walk takes tile-major
 * matrices only); false with the reason, nothing allocated, where keel_cuda_pack refuses. */
bool keel_cuda_pack_upload(const keel_qmat *W, keel_cuda_pw *out, char *why, size_t why_cap);
/* keel_cuda_pack_upload of a matrix already on the device (of a stack, the first n rows): read back, packed on the
 * host, uploaded; the same ownership and refusals (and out of host memory). */
bool keel_cuda_pack_upload_qw(const keel_cuda_qw *W, keel_cuda_pw *out, char *why, size_t why_cap);
/* y (m, n) = epi(x (m, k) . dequant(W)^T), m = 1..8, as keel_cuda_stream_matmul. */
void keel_cuda_stream_matmul_packed(const keel_cuda_pw *W, const void *x, keel_dtype xdt, int m, void *y,
                                    keel_dtype ydt, keel_epilogue epi, void *stream);
/* The parts the packed tile sums k in: 2 (few row tiles, k of 64 spans or more, an even count of spans), 4 (the same
 * with a count of 128 spans or more that divides by 4), else 1; the parts add in order (((first + second) + third)
 * + fourth). A function of the shape and the chip's SM count, never of m. */
int keel_cuda_packed_splits(int n, int k);
/* How this host thread's last packed launch walked (for tests): two tiles a warp, and/or k in parts, with the parts
 * on blocks of their own (m > 1: each block stages its part of x alone; the parts' sums meet in the stream's scratch). */
#define KEEL_CUDA_PK_WALK_PAIRS 1
#define KEEL_CUDA_PK_WALK_SPLIT 2
#define KEEL_CUDA_PK_WALK_PARTS 4
int keel_cuda_packed_last_walk(void);
/* The packed tiles' kernels by audit symbol ("stream_packed<4,false>"); NULL if unknown. */
const void *keel_cuda_packed_kernel_fn(const char *symbol);

/* `keel bench stream`: the stream tiles against the chip's read bandwidth and cuBLAS (src/kernels/cuda). */
int keel_cuda_bench_stream(int argc, char **argv);
/* The chip's read bandwidth (GB/s) measured now by a plain 16-byte streaming read of 1 GiB (benchmarks' yardstick). */
double keel_cuda_read_gbs(void);

/* The device function of a __global__ kernel by its audit symbol ("stream_tile<4,false>", "stream_finish",
 * "relu2_kernel", the benchmark's "fill_kernel" and "read_kernel"), for cudaFuncGetAttributes; NULL if unknown. */
const void *keel_cuda_kernel_fn(const char *symbol);
/* The benchmark's kernels only (keel_cuda_kernel_fn asks it for names it does not know). */
const void *keel_cuda_bench_kernel_fn(const char *symbol);

#ifdef __cplusplus
}
#endif

#endif
