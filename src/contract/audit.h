/* contract/audit: gate 5. Every GPU kernel keel launches has, per chip, a record of what it costs (registers,
 * spills, stack frame, shared memory, launch block and dynamic shared memory) compiled by a pinned compiler; the
 * offline audit (`keel audit`) recompiles the kernel sources for every recorded chip and reports each difference
 * and each broken limit as a limit problem; the live check compares a loaded kernel's attributes with the record
 * of the chip in hand (docs/gate5.md). Plain C; the CUDA side of the live check is live.cu. */
#ifndef KEEL_CONTRACT_AUDIT_H
#define KEEL_CONTRACT_AUDIT_H

#include <stdio.h>

#include "../core/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KEEL_AUDIT_NAME_MAX 96
#define KEEL_AUDIT_CHIP_MAX 16
#define KEEL_AUDIT_MAX_FIELDS 12
#define KEEL_AUDIT_MAX_CHIPS 16

/* One RECORD line: a kernel on a chip and its fields (name=value, values are non-negative integers). */
typedef struct keel_audit_record {
    char chip[KEEL_AUDIT_CHIP_MAX];
    char kernel[KEEL_AUDIT_NAME_MAX]; /* demangled, no namespace, no spaces: "stream_tile<4,false>" */
    int n;
    char key[KEEL_AUDIT_MAX_FIELDS][16];
    long long val[KEEL_AUDIT_MAX_FIELDS];
    int line;
} keel_audit_record;

/* The records of a directory (one file per chip, contract/records/<chip>) and each chip's compiler line. */
typedef struct keel_audit_records {
    int n, cap;
    keel_audit_record *items;
    int n_chips;
    char chip[KEEL_AUDIT_MAX_CHIPS][KEEL_AUDIT_CHIP_MAX];
    char compiler[KEEL_AUDIT_MAX_CHIPS][160]; /* the exact version line the records were compiled with */
} keel_audit_records;

void keel_audit_records_init(keel_audit_records *r);
void keel_audit_records_free(keel_audit_records *r); /* accepts NULL */
/* Parses one records file: "COMPILER <chip> <version line>" once, then "RECORD <chip> <kernel> k=v ...";
 * '#' comments and blank lines are ignored. Malformed lines, a chip other than the COMPILER's, duplicate records
 * or fields are KEEL_E_FORMAT naming path and line. */
keel_code keel_audit_records_parse(keel_audit_records *r, const char *text, const char *path, keel_err *err);
/* Loads every regular file of dir (a missing dir is an empty set). */
keel_code keel_audit_records_load(keel_audit_records *r, const char *dir, keel_err *err);
const keel_audit_record *keel_audit_records_find(const keel_audit_records *r, const char *chip, const char *kernel);
const char *keel_audit_records_compiler(const keel_audit_records *r, const char *chip); /* NULL when absent */
/* A field's value, or -1 when the record has no such field. */
long long keel_audit_record_get(const keel_audit_record *rec, const char *key);
/* Appends a record (fields copied); KEEL_ASSERTs on overflow of the fixed field count. */
keel_audit_record *keel_audit_records_add(keel_audit_records *r, const char *chip, const char *kernel);
void keel_audit_record_set(keel_audit_record *rec, const char *key, long long v);

/* ---- launch declarations: the one table from registration to kernel symbol ------------------------------- */

/* How a kernel is launched, as the audit needs it: block size, dynamic shared memory, and the blocks per SM
 * (CUDA) or waves per SIMD (HIP: the second __launch_bounds__ argument's meaning there) the launch relies on. */
typedef struct keel_audit_kernel {
    const char *symbol;  /* "stream_tile<4,false>" */
    const char *source;  /* relative to the source dir */
    int block, dsmem, min_blocks;
    int min_blocks_100k; /* blocks per SM on chips with 100 KB of shared memory per SM; 0: min_blocks */
    bool control;        /* a planted gate-5 twin: audited only when its source is named with --source */
} keel_audit_kernel;

/* keel_audit_kernel.dsmem of a launch whose dynamic shared memory grows with the chip: the packed tiles' x budget */
#define KEEL_AUDIT_DSMEM_XBUDGET (-1)
/* The dynamic shared memory kernel k's launches set on `chip`, compiled to `regs` registers and `smem` static bytes:
 * k->dsmem, or for KEEL_AUDIT_DSMEM_XBUDGET what the packed tiles' auto x budget sets there (keel_cuda_packed_xbudget:
 * the largest KiB step keeping the blocks an SM that KEEL_CUDA_PACKED_XBYTES gives; KEEL_CUDA_PACKED_SMEM off NVIDIA). */
int keel_audit_dsmem(const keel_audit_kernel *k, const char *chip, long long regs, long long smem);
const keel_audit_kernel *keel_audit_kernels(int *n);
const keel_audit_kernel *keel_audit_kernel_find(const char *symbol);
/* The kernel symbols one registered CUDA launch runs, from its family (keel_contract_family: 0 stream, 2 relu2),
 * width and activation dtype: a stream tile, plus stream_finish when the launch splits k. Returns the count. */
int keel_audit_symbols_for(int family, int bits, bool x_f16, const char **syms, int cap);

/* ---- known findings (gate 5 entries of h8's format: "<chip>/<kernel> 5 <reason>") ------------------------- */

typedef struct keel_audit_findings {
    int n;
    char (*name)[KEEL_AUDIT_NAME_MAX + KEEL_AUDIT_CHIP_MAX]; /* "gfx1030/stream_tile<3,true>" */
    int *line;
} keel_audit_findings;

/* Parses the gate-5 entries of a known-findings list ("<name> <gate> <reason>"; other gates are skipped). */
keel_code keel_audit_findings_parse(keel_audit_findings *f, const char *text, const char *path, keel_err *err);
keel_code keel_audit_findings_load(keel_audit_findings *f, const char *path, keel_err *err); /* missing: empty */
void keel_audit_findings_free(keel_audit_findings *f); /* accepts NULL */
bool keel_audit_findings_has(const keel_audit_findings *f, const char *chip, const char *kernel);
/* True when a record shows a finding: spill bytes, a stack frame, or (HIP) spilled registers or scratch. */
bool keel_audit_record_shows_finding(const keel_audit_record *rec);
/* Holds the list to the records: prints a limit problem for each record showing a finding the list does not
 * name and each entry whose record shows none or does not exist; returns the count. */
int keel_audit_findings_check(const keel_audit_records *recs, const keel_audit_findings *f, FILE *out);

/* ---- the offline audit ---------------------------------------------------------------------------------- */

typedef struct keel_audit_opts {
    const char *src_dir;      /* NULL: $KEEL_SOURCE_DIR, else the tree this binary was built from */
    const char *records_dir;  /* NULL: <src>/contract/records */
    const char *findings;     /* NULL: <src>/contract/known_findings_gate5 */
    const char *chips;        /* comma list; NULL: the recorded chips (all known chips when none) */
    const char *source;       /* a single .cu to audit instead of the registered kernels (controls) */
    bool print_records, any_compiler;
    int jobs;                 /* parallel compiles; <= 0: the online CPU count */
} keel_audit_opts;

/* The chips the audit knows and their compiler ("nvcc" or "hipcc"). */
const char *const *keel_audit_known_chips(int *n);
/* Limit checks that hold whatever the records say, on one compiled record and its launch declaration;
 * prints each problem and returns the count. */
int keel_audit_limits(const keel_audit_record *rec, const keel_audit_kernel *k, const keel_audit_findings *f,
                      FILE *out);
/* Compares a compiled record with the recorded one field by field; prints and counts each difference. */
int keel_audit_compare(const keel_audit_record *recorded, const keel_audit_record *compiled, FILE *out);
/* Runs the audit: limit problems and the AUDIT line go to out, RECORD lines too with print_records.
 * *problems receives the count; a failure to run (no compiler, a bad records file) is an error code. */
keel_code keel_audit_run(const keel_audit_opts *o, FILE *out, int *problems, keel_err *err);

/* ---- the live check (the CUDA runner reads attributes through live.cu, then compares here) ---------------- */

typedef struct keel_audit_live {
    int regs;      /* cudaFuncAttributes.numRegs */
    int local;     /* localSizeBytes: the stack frame */
    int smem;      /* sharedSizeBytes: static shared memory */
    int dsmem_max; /* maxDynamicSharedSizeBytes after the launch set it; -1: not compared */
} keel_audit_live;

/* Compares a loaded kernel's attributes with its record on chip; prints and counts each difference (a missing
 * record is one). */
int keel_audit_live_compare(const keel_audit_records *recs, const char *chip, const char *kernel,
                            const keel_audit_live *got, FILE *out);
typedef const void *(*keel_audit_fn_lookup)(const char *symbol);
typedef bool (*keel_audit_attrs_reader)(const void *fn, keel_audit_live *out, char *why, size_t cap);
/* The live check on the chip in hand: for each non-control kernel of the launch table, its host function pointer
 * from lookup, its attributes from attrs, compared with the chip's record. A chip with no records (recs NULL or
 * no COMPILER line for chip) is one problem; a kernel lookup cannot find or attrs cannot read is one each.
 * Prints each problem as a LIMIT line and returns the count. */
int keel_audit_live_check(const keel_audit_records *recs, const char *records_dir, const char *chip,
                          keel_audit_fn_lookup lookup, keel_audit_attrs_reader attrs, FILE *out);
/* When line is chip's SUMMARY line ("SUMMARY <chip> ...; N limit problems"), writes it to buf with N + extra
 * limit problems and returns true; false for any other line or when buf is too small. */
bool keel_audit_summary_add(const char *line, const char *chip, int extra, char *buf, size_t cap);
/* The records dir `keel audit` reads by default: <source dir>/contract/records, the source dir being
 * $KEEL_SOURCE_DIR, else the tree this binary was built from. */
void keel_audit_records_dir(char *out, size_t cap);
/* live.cu (CUDA builds only): attributes of a kernel given its host function pointer, and the chip in hand
 * ("sm_90"); false with a reason when the runtime refuses. */
bool keel_audit_live_attrs(const void *fn, keel_audit_live *out, char *why, size_t cap);
bool keel_audit_live_chip(char *buf, size_t cap);
/* live.cu: keel_cuda_kernel_fn, then keel_ecu_kernel_fn (the engine's kernels); NULL when neither knows symbol. */
const void *keel_audit_live_fn(const char *symbol);

#ifdef __cplusplus
}
#endif

#endif
