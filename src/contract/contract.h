/* contract: keel's kernel contract. Every kernel variant keel launches is registered here (one table per backend)
 * with its parameters, edge shapes, float64 reference, error bound, what it replaces, and planted controls
 * (compiled twins with one deliberate fault each). A run puts every registration through gates 1-4:
 *   1 builds and launches   2 stays in bounds   3 matches the reference   4 equals what it replaces and itself
 * and each control through the gates up to the one it is planted for, which must go red (docs/kernel-contract.md).
 *
 * Buffers go through backend hooks (alloc, upload, download, free, sync), so a device backend runs the same gates:
 * every buffer sits between canary guards on the device and is checked after download.
 */
#ifndef KEEL_CONTRACT_H
#define KEEL_CONTRACT_H

#include <math.h>
#include <stdio.h>

#include "../format/format.h"
#include "../kernels/cpu/cpu.h"

#define KEEL_CONTRACT_NAME_MAX 96
#define KEEL_CONTRACT_MAX_SHAPES 8
#define KEEL_CONTRACT_MAX_CONTROLS 8
#define KEEL_CONTRACT_MAX_REPLACES 2
#define KEEL_CONTRACT_GUARD 256 /* canary bytes before and after every buffer */

/* A backend: where buffers live and how a launch is finished. CPU hooks are malloc/memcpy. */
typedef struct keel_contract_backend {
    const char *name;                                            /* "cpu", "cuda" */
    char chip[64];                                               /* "cpu-avx2", "sm_90" */
    void *(*alloc)(size_t bytes);
    void (*release)(void *p);
    void (*upload)(void *dst, const void *src, size_t bytes);   /* host -> backend */
    void (*download)(void *dst, const void *src, size_t bytes); /* backend -> host */
    /* Waits for launches; false with a reason when the last launch or the device reported an error. */
    bool (*sync)(char *why, size_t cap);
} keel_contract_backend;

/* The cases' generator, one for every table: xorshift64 (13, 7, 17); uniforms in (0, 1) from the top 53 bits;
 * normals by Box-Muller (two uniforms each). A seed gives the same cases on every backend and build. */
typedef struct keel_contract_rng {
    uint64_t s;
} keel_contract_rng;
static inline uint64_t keel_contract_rnext(keel_contract_rng *r) {
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return r->s;
}
static inline double keel_contract_runif(keel_contract_rng *r) {
    return ((double)(keel_contract_rnext(r) >> 11) + 0.5) * 0x1p-53;
}
static inline double keel_contract_rnorm(keel_contract_rng *r) {
    return sqrt(-2.0 * log(keel_contract_runif(r))) * cos(6.283185307179586 * keel_contract_runif(r));
}

/* One operand on a backend between canary guards: host image guard|data|guard, and its backend copy. Without
 * data the bytes are KEEL_CONTRACT_UNWRITTEN (an all-ones NaN no kernel produces), so unwritten outputs show. */
#define KEEL_CONTRACT_UNWRITTEN 0xFFu
typedef struct keel_contract_gbuf {
    const char *name;
    size_t bytes;
    uint8_t *img;
    void *dev;
} keel_contract_gbuf;
void keel_contract_gbuf_make(keel_contract_gbuf *g, const keel_contract_backend *be, const char *name,
                             const void *data, size_t bytes, int salt);
/* Compares a downloaded image with the uploaded one: the guards always, the data too for an input. */
bool keel_contract_gbuf_check(const keel_contract_gbuf *g, const uint8_t *back, bool input, char *why, size_t cap);
void keel_contract_gbuf_free(keel_contract_gbuf *g, const keel_contract_backend *be);

typedef enum keel_contract_family {
    KEEL_CF_STREAM = 0, /* quantized stream tile: y (m, n) = epi(x (m, k) . dequant(W)^T) */
    KEEL_CF_FLOAT,      /* the same entry on a float matrix (BF16, F16, F32 weights) */
    KEEL_CF_RELU2,      /* y[i] = relu(y[i])^2 in place */
    KEEL_CF_ROUTED_UP,  /* routed fc1: h[i] (m, n) rows in item i's mask = epi(x . W[expert i]^T) (cuda_routed.c) */
    KEEL_CF_ROUTED_DOWN,/* routed fc2: y[r] = sum over items in list order of w[i][r] * (h[i][r] . W[expert i]^T) */
    KEEL_CF_COUNT
} keel_contract_family;

/* Pointers a launch receives: backend addresses of the operands (inside their guards). */
typedef struct keel_contract_args {
    keel_qmat W; /* w, scales, biases are backend pointers; n, k, bits, group, sdt as registered */
    const void *x;
    void *y;
    int m;
    size_t count; /* elementwise kernels: elements of y */
    /* Routed kernels: W holds the experts stacked (E*n rows); items and weights are backend pointers. */
    const void *items;    /* n_items {int32 expert, uint32 token mask} in list order */
    const float *weights; /* [item][8] routing weights (fc2) */
    int n_items;
} keel_contract_args;

struct keel_contract_reg;
struct keel_contract_table;
struct keel_contract_result;
typedef void (*keel_contract_launch_fn)(const struct keel_contract_reg *reg, const keel_contract_args *a);

/* The arithmetic gate 3's bound is derived from (docs/kernel-contract.md, gate 3). */
typedef enum keel_contract_arith {
    KEEL_CA_FP32_LANES = 0, /* CPU: fp32 fma lanes, group sums, a lane reduction (rounding to nearest) */
    KEEL_CA_MMA,            /* tensor cores: exact products summed 16 at a time in fp32 (truncating), fp32 epilogue */
} keel_contract_arith;

/* A planted control: a compiled twin of the kernel with one fault, and the gate at which it must go red. */
typedef struct keel_contract_control {
    const char *name;              /* "width-as-4", "bias-dropped", "write-past-end", "epilogue-order", "row-leak" */
    int gate;                      /* 2, 3 or 4 */
    keel_contract_launch_fn twin;  /* launched in place of reg->launch */
} keel_contract_control;

/* One edge shape: an output of n columns over k inputs, run at every m in [m_lo, m_hi]. */
typedef struct keel_contract_shape {
    int n, k, m_lo, m_hi;
} keel_contract_shape;

typedef struct keel_contract_reg {
    char name[KEEL_CONTRACT_NAME_MAX]; /* "cpu/avx2/stream/q5g64/bf16/relu2" */
    const keel_contract_backend *be;
    const char *entry;                 /* the launch entry point the table covers ("keel_cpu_matmul") */
    const char *path;                  /* code path inside the entry ("avx2", "portable", "scalar") */
    keel_contract_family family;
    int bits, group;                   /* stream: 2..8 and 32/64/128; float and relu2: 0 */
    keel_dtype sdt;                    /* scale/bias dtype, or the float matrix's dtype */
    keel_dtype xdt, ydt;               /* activation and output dtypes (CPU: F32) */
    keel_epilogue epi;
    int rows_min, rows_max;            /* the m the variant serves; every one is run */
    int tile_rows, tile_cols;          /* launch tile (CPU: a pass of 8 rows x 1 weight row) */
    int n_shapes;
    keel_contract_shape shapes[KEEL_CONTRACT_MAX_SHAPES]; /* shapes[0] is the smallest (gate 1) */
    keel_contract_launch_fn launch;
    /* Fusion: the registrations whose sequence this one replaces, and whether the float order is the same. */
    int n_replaces;
    char replaces[KEEL_CONTRACT_MAX_REPLACES][KEEL_CONTRACT_NAME_MAX]; /* in launch order */
    bool same_order;
    int n_controls;
    keel_contract_control controls[KEEL_CONTRACT_MAX_CONTROLS];
    /* Gate 1: the symbol exists for this chip, and the launch configuration fits its limits (false with a reason). */
    bool (*available)(const struct keel_contract_reg *reg, char *why, size_t cap);
    keel_contract_arith arith;
    int experts; /* routed kernels: experts stacked in W */
    int (*splits)(int n, int k, int n_items); /* the k-split a launch of this shape uses (NULL: never splits) */
    /* Families gates.c does not know (routed kernels) bring their own gates 1-4 (same contract as keel_contract_run). */
    void (*run)(const struct keel_contract_table *t, const struct keel_contract_reg *reg,
                keel_contract_launch_fn launch, int max_gate, struct keel_contract_result *res);
} keel_contract_reg;

/* A table of registrations (owned array). */
typedef struct keel_contract_table {
    int n, cap;
    keel_contract_reg *regs;
} keel_contract_table;

void keel_contract_table_init(keel_contract_table *t);
void keel_contract_table_free(keel_contract_table *t); /* accepts NULL */
keel_contract_reg *keel_contract_table_add(keel_contract_table *t);
const keel_contract_reg *keel_contract_table_find(const keel_contract_table *t, const char *name);

/* The CPU backend and its registrations (cpu_regs.c); appends and returns how many were added. */
const keel_contract_backend *keel_contract_cpu_backend(void);
int keel_contract_register_cpu(keel_contract_table *t);
/* The CUDA backend (cuda_regs.c): NULL with a reason when this build has no CUDA or the host has no device. */
const keel_contract_backend *keel_contract_cuda_backend(char *why, size_t cap);
int keel_contract_register_cuda(keel_contract_table *t);

/* The launch entry points the CUDA table covers in every build (for the launch-site check; NULL-terminated). */
extern const char *const keel_contract_cuda_entries[];

/* CPU twins of the stream tile, one planted fault each (twin_*.c, compiled from stream_body.h). */
void keel_contract_twin_width4_matmul(const keel_qmat *W, const float *x, int m, float *y, keel_epilogue epi);
void keel_contract_twin_nobias_matmul(const keel_qmat *W, const float *x, int m, float *y, keel_epilogue epi);
void keel_contract_twin_pastend_matmul(const keel_qmat *W, const float *x, int m, float *y, keel_epilogue epi);
void keel_contract_twin_pastend_relu2(float *y, size_t n);
void keel_contract_twin_epiorder_matmul(const keel_qmat *W, const float *x, int m, float *y, keel_epilogue epi);
void keel_contract_twin_rowleak_matmul(const keel_qmat *W, const float *x, int m, float *y, keel_epilogue epi);

/* ---- results ----------------------------------------------------------------------------------------- */

typedef struct keel_contract_gate_result {
    bool ran, pass;
    double max_err, bound_at_max; /* gate 3: worst |y - ref| relative to its bound, and that bound */
    double frac;                  /* worst |y - ref| / bound over every checked output */
    char detail[512];             /* why it failed (first values side by side for gate 3) */
} keel_contract_gate_result;

typedef struct keel_contract_result {
    int first_red;                       /* 0: passed gates 1-4; else the first gate that failed */
    keel_contract_gate_result gate[5];   /* index 1..4 */
} keel_contract_result;

/* Gates 1-4 of a routed registration (cuda_routed.c, the `run` of the CUDA routed tiles; backend-neutral). */
void keel_contract_run_routed(const keel_contract_table *t, const keel_contract_reg *reg,
                              keel_contract_launch_fn launch, int max_gate, keel_contract_result *res);

/* Gate 3: roundings (units of 2^-24 of the summed magnitudes) a term of a tensor-core stream tile passes. */
int keel_contract_mma_roundings(int group, int k, int splits);
/* Gate 3: the offset M a tensor-core tile's operand codes keep (a term's magnitude |x|(|s|(q + 2M) + |b|)). */
double keel_contract_mma_offset(int bits, keel_dtype xdt);
/* The launch-width hint (keel_cuda_qw.items) the contract gives routed stacks: above one, so the hint's k-split is
 * the one checked, small enough that the registrations' k-split shapes still split. */
#define KEEL_CONTRACT_ROUTED_ITEMS 2
/* The hint of a registration's matrix: KEEL_CONTRACT_ROUTED_ITEMS for routed stacks, else 1. */
#define KEEL_CONTRACT_ITEMS_OF(reg) ((reg)->experts > 1 ? KEEL_CONTRACT_ROUTED_ITEMS : 1)

/* Runs gates 1..max_gate on reg, launching `launch` (reg->launch, or a twin); stops at the first red gate. */
void keel_contract_run(const keel_contract_table *t, const keel_contract_reg *reg, keel_contract_launch_fn launch,
                       int max_gate, keel_contract_result *res);

/* ---- known findings ----------------------------------------------------------------------------------- */

typedef struct keel_contract_finding {
    char name[KEEL_CONTRACT_NAME_MAX];
    int gate;
    char reason[256];
    int line;
} keel_contract_finding;

typedef struct keel_contract_findings {
    int n;
    keel_contract_finding *items;
    char path[512];
} keel_contract_findings;

/* Parses a list: one entry a line, "<registration> <gate 1-5> <reason>", '#' comments and blank lines ignored.
 * A malformed line or a duplicate entry is KEEL_E_FORMAT naming the file and line. */
keel_code keel_contract_findings_parse(keel_contract_findings *f, const char *text, const char *path,
                                       keel_err *err);
keel_code keel_contract_findings_load(keel_contract_findings *f, const char *path, keel_err *err);
void keel_contract_findings_free(keel_contract_findings *f); /* accepts NULL */
const keel_contract_finding *keel_contract_findings_find(const keel_contract_findings *f, const char *name);

/* ---- a whole run ------------------------------------------------------------------------------------- */

typedef struct keel_contract_report {
    int kernels, pass, fail, known;
    int controls, red_as_planted, red_early, missed;
    int limit_problems;         /* gate 5 (issue 6); 0 until then */
    int stale_findings;         /* entries that no longer fail as listed, or name no registration */
} keel_contract_report;

/* Runs every registration of t whose name matches `filter` (POSIX extended regex; NULL for all) and its controls.
 * Lines for failing or notable registrations go to out; the SUMMARY line per chip too. `json` (may be NULL)
 * receives a cJSON array of per-registration results. Returns KEEL_E_ARG for a bad regex. */
keel_code keel_contract_run_all(const keel_contract_table *t, const char *filter,
                                const keel_contract_findings *known, FILE *out, void *json,
                                keel_contract_report *rep, keel_err *err);
/* The SUMMARY line for one chip (no newline). */
void keel_contract_summary(const char *chip, const keel_contract_report *rep, char *buf, size_t cap);

#endif
