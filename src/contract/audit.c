/* contract/audit: gate-5 records, launch declarations, known findings, limit checks and comparisons. The
 * compiling half of the audit is audit_compile.c. */
#include "audit.h"
#include "../engine/cuda/ecuda.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/stat.h>

/* ---- records ------------------------------------------------------------------------------------------ */

void keel_audit_records_init(keel_audit_records *r) { memset(r, 0, sizeof *r); }

void keel_audit_records_free(keel_audit_records *r) {
    if (!r) return;
    free(r->items);
    memset(r, 0, sizeof *r);
}

keel_audit_record *keel_audit_records_add(keel_audit_records *r, const char *chip, const char *kernel) {
    if (r->n == r->cap) {
        r->cap = r->cap ? 2 * r->cap : 64;
        r->items = keel_xrealloc(r->items, (size_t)r->cap * sizeof *r->items);
    }
    keel_audit_record *rec = &r->items[r->n++];
    memset(rec, 0, sizeof *rec);
    snprintf(rec->chip, sizeof rec->chip, "%s", chip);
    snprintf(rec->kernel, sizeof rec->kernel, "%s", kernel);
    return rec;
}

void keel_audit_record_set(keel_audit_record *rec, const char *key, long long v) {
    for (int i = 0; i < rec->n; i++)
        if (!strcmp(rec->key[i], key)) {
            rec->val[i] = v;
            return;
        }
    KEEL_ASSERTF(rec->n < KEEL_AUDIT_MAX_FIELDS, "record %s %s: more than %d fields", rec->chip, rec->kernel,
                 KEEL_AUDIT_MAX_FIELDS);
    snprintf(rec->key[rec->n], sizeof rec->key[0], "%s", key);
    rec->val[rec->n++] = v;
}

long long keel_audit_record_get(const keel_audit_record *rec, const char *key) {
    for (int i = 0; i < rec->n; i++)
        if (!strcmp(rec->key[i], key)) return rec->val[i];
    return -1;
}

const keel_audit_record *keel_audit_records_find(const keel_audit_records *r, const char *chip, const char *kernel) {
    for (int i = 0; i < r->n; i++)
        if (!strcmp(r->items[i].chip, chip) && !strcmp(r->items[i].kernel, kernel)) return &r->items[i];
    return NULL;
}

const char *keel_audit_records_compiler(const keel_audit_records *r, const char *chip) {
    for (int i = 0; i < r->n_chips; i++)
        if (!strcmp(r->chip[i], chip)) return r->compiler[i];
    return NULL;
}

/* Splits the next whitespace-delimited token off *p; NULL at the end of the line. */
static char *next_tok(char **p) {
    char *s = *p;
    while (*s == ' ' || *s == '\t') s++;
    if (!*s) return NULL;
    char *e = s;
    while (*e && *e != ' ' && *e != '\t') e++;
    if (*e) *e++ = 0;
    *p = e;
    return s;
}

static bool parse_count(const char *s, long long *v) {
    if (!*s || strlen(s) > 12) return false;
    for (const char *c = s; *c; c++)
        if (!isdigit((unsigned char)*c)) return false;
    *v = strtoll(s, NULL, 10);
    return true;
}

keel_code keel_audit_records_parse(keel_audit_records *r, const char *text, const char *path, keel_err *err) {
    char *buf = keel_xstrdup(text);
    keel_code rc = KEEL_OK;
    int chip_i = -1, lineno = 0;
    for (char *line = buf, *next; line && rc == KEEL_OK; line = next) {
        lineno++;
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        size_t len = strlen(line);
        if (len && line[len - 1] == '\r') line[--len] = 0;
        char *p = line, *kw = next_tok(&p);
        if (!kw || kw[0] == '#') continue;
        if (!strcmp(kw, "COMPILER")) {
            char *chip = next_tok(&p);
            while (*p == ' ') p++;
            if (!chip || !*p || strlen(chip) >= KEEL_AUDIT_CHIP_MAX) {
                rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: expected 'COMPILER <chip> <version line>'", path, lineno);
            } else if (chip_i >= 0) {
                rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: a second COMPILER line (one chip per file)", path, lineno);
            } else if (keel_audit_records_compiler(r, chip)) {
                rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: chip %s is recorded in another file too", path, lineno,
                                  chip);
            } else if (r->n_chips == KEEL_AUDIT_MAX_CHIPS) {
                rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: more than %d chips", path, lineno, KEEL_AUDIT_MAX_CHIPS);
            } else {
                chip_i = r->n_chips++;
                snprintf(r->chip[chip_i], sizeof r->chip[0], "%s", chip);
                snprintf(r->compiler[chip_i], sizeof r->compiler[0], "%s", p);
            }
        } else if (!strcmp(kw, "RECORD")) {
            char *chip = next_tok(&p), *kernel = next_tok(&p);
            if (chip_i < 0) {
                rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: RECORD before the COMPILER line", path, lineno);
            } else if (!chip || !kernel || strlen(kernel) >= KEEL_AUDIT_NAME_MAX) {
                rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: expected 'RECORD <chip> <kernel> field=value ...'", path,
                                  lineno);
            } else if (strcmp(chip, r->chip[chip_i])) {
                rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: RECORD for chip %s in the file of chip %s", path, lineno,
                                  chip, r->chip[chip_i]);
            } else if (keel_audit_records_find(r, chip, kernel)) {
                rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: a second record of %s on %s", path, lineno, kernel, chip);
            } else {
                keel_audit_record *rec = keel_audit_records_add(r, chip, kernel);
                rec->line = lineno;
                for (char *f; rc == KEEL_OK && (f = next_tok(&p));) {
                    char *eq = strchr(f, '=');
                    long long v;
                    if (!eq || eq == f || eq - f >= (long)sizeof rec->key[0] || !parse_count(eq + 1, &v)) {
                        rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: field '%s': expected name=count", path, lineno, f);
                        break;
                    }
                    *eq = 0;
                    if (keel_audit_record_get(rec, f) >= 0)
                        rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: field %s given twice", path, lineno, f);
                    else if (rec->n == KEEL_AUDIT_MAX_FIELDS)
                        rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: more than %d fields", path, lineno,
                                          KEEL_AUDIT_MAX_FIELDS);
                    else
                        keel_audit_record_set(rec, f, v);
                }
                if (rc == KEEL_OK && rec->n == 0)
                    rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: record of %s has no fields", path, lineno, kernel);
            }
        } else {
            rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: expected COMPILER or RECORD, found '%s'", path, lineno, kw);
        }
    }
    if (rc == KEEL_OK && chip_i < 0)
        rc = keel_err_set(err, KEEL_E_FORMAT, "%s: no COMPILER line (which compiler made these records?)", path);
    free(buf);
    return rc;
}

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

keel_code keel_audit_records_load(keel_audit_records *r, const char *dir, keel_err *err) {
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT) return KEEL_OK;
        return keel_err_set(err, KEEL_E_IO, "records dir %s: %s", dir, strerror(errno));
    }
    char **names = NULL;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        names = keel_xrealloc(names, (size_t)(n + 1) * sizeof *names);
        names[n++] = keel_xstrdup(e->d_name);
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, cmp_names);
    keel_code rc = KEEL_OK;
    for (int i = 0; i < n; i++) {
        char path[1024];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        if (rc == KEEL_OK && stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
            char *text = NULL;
            rc = keel_read_file(path, &text, NULL, err);
            if (rc == KEEL_OK) rc = keel_audit_records_parse(r, text, path, err);
            free(text);
        }
        free(names[i]);
    }
    free(names);
    return rc;
}

/* ---- launch declarations ------------------------------------------------------------------------------- */

/* Block and dynamic shared memory as stream.cu launches them (kThreads; smem_bytes<B>() = 64 KB); min_blocks is
 * the smallest second __launch_bounds__ argument of the chips with 164+ KB of shared memory (sm_80's 2; sm_90/100
 * declare 3), min_blocks_100k the 100 KB chips' 1. The live check compares dsmem with the attribute the launch set. */
#define KA_STREAM(B, X, DS, MB, MBS) {"stream_tile<" #B "," #X ">", "src/kernels/cuda/stream.cu", 128, DS, MB, MBS, false}
static const keel_audit_kernel kernels[] = {
    KA_STREAM(2, false, 65536, 2, 1), KA_STREAM(3, false, 65536, 2, 1), KA_STREAM(4, false, 65536, 2, 1),
    KA_STREAM(5, false, 65536, 2, 1), KA_STREAM(6, false, 65536, 2, 1), KA_STREAM(8, false, 65536, 2, 1),
    KA_STREAM(2, true, 65536, 2, 1),  KA_STREAM(3, true, 65536, 2, 1),  KA_STREAM(4, true, 65536, 2, 1),
    KA_STREAM(5, true, 65536, 2, 1),  KA_STREAM(6, true, 65536, 2, 1),  KA_STREAM(8, true, 65536, 2, 1),
#define KA_PACKED(K, B, X) {K "<" #B "," #X ">", "src/kernels/cuda/packed.cu", 256, KEEL_AUDIT_DSMEM_XBUDGET, 2, 1, false}
#define KA_PACKED_ALL(K)                                                                                           \
    KA_PACKED(K, 2, false), KA_PACKED(K, 3, false), KA_PACKED(K, 4, false), KA_PACKED(K, 5, false),                \
        KA_PACKED(K, 6, false), KA_PACKED(K, 8, false), KA_PACKED(K, 2, true), KA_PACKED(K, 3, true),              \
        KA_PACKED(K, 4, true), KA_PACKED(K, 5, true), KA_PACKED(K, 6, true), KA_PACKED(K, 8, true)
    KA_PACKED_ALL("stream_packed"), KA_PACKED_ALL("stream_packed_split"), KA_PACKED_ALL("stream_packed_parts"),
#undef KA_PACKED_ALL
#undef KA_PACKED
    {"stream_finish", "src/kernels/cuda/stream.cu", 256, 0, 1, 0, false},
    {"relu2_kernel", "src/kernels/cuda/stream.cu", 256, 0, 1, 0, false},
    {"fill_kernel", "src/kernels/cuda/bench_stream.cu", 256, 0, 1, 0, false}, /* keel bench stream */
    {"read_kernel", "src/kernels/cuda/bench_stream.cu", 512, 0, 1, 0, false},
    /* the CUDA engine's kernels as kernels.cu launches them: no __launch_bounds__, so one block per SM */
#define KA_ECU(S, B) {S, "src/engine/cuda/kernels.cu", B, 0, 1, 0, false}
    KA_ECU("embed_kernel", 256),     KA_ECU("rmsnorm_kernel", 256),   KA_ECU("add_rmsnorm_kernel", 256),
    KA_ECU("add_bias_kernel", 256),  KA_ECU("matvec_kernel", 256),    KA_ECU("combine_kernel", 256),
    KA_ECU("conv_kernel", 128),      KA_ECU("ssm_kernel", 128),       KA_ECU("gate_norm_kernel", 256),
    KA_ECU("route_kernel", 32),      KA_ECU("argmax_kernel", 1024),
    KA_ECU("union_kernel", 32),      KA_ECU("router_kernel", 256),    KA_ECU("mamba_step_kernel", 256),
    KA_ECU("route_window_kernel", 256),
    {"matvec_norm_kernel", "src/engine/cuda/kernels.cu", 256, KEEL_ECU_MATVEC_NORM_SMEM, 1, 0, false}, /* its rows */
#undef KA_ECU
    /* the graph-ready attention (src/engine/cuda/attn.cu): the tile kernels may use the 64 KiB of dynamic shared
     * memory their launch allows (cudaFuncSetAttribute), two blocks per SM (one on 100 KB chips) */
    {"attn_tile_kernel<1>", "src/engine/cuda/attn.cu", 128, 65536, 2, 1, false},
    {"attn_tile_kernel<2>", "src/engine/cuda/attn.cu", 128, 65536, 2, 1, false},
    {"attn_tile_kernel<4>", "src/engine/cuda/attn.cu", 128, 65536, 2, 1, false},
    {"attn_combine_kernel", "src/engine/cuda/attn.cu", 128, 0, 1, 0, false},
    {"kv_append_kernel", "src/engine/cuda/attn.cu", 256, 0, 1, 0, false},
    /* the GPU sampler and the chunked Mamba-2 scan (sample.cu, scan.cu): __launch_bounds__(block), one block per SM */
    {"sample_kernel", "src/engine/cuda/sample.cu", 1024, 0, 1, 0, false},
    {"ssm_chunk_kernel", "src/engine/cuda/scan.cu", 256, 0, 1, 0, false},
    /* planted twin: a run-time-indexed local array (stack frame) under a 32-register cap (spills) */
    {"gate5_local_array", "src/contract/gate5_twin.cu", 128, 0, 16, 0, true},
};

const keel_audit_kernel *keel_audit_kernels(int *n) {
    *n = (int)(sizeof kernels / sizeof kernels[0]);
    return kernels;
}

const keel_audit_kernel *keel_audit_kernel_find(const char *symbol) {
    for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++)
        if (!strcmp(kernels[i].symbol, symbol)) return &kernels[i];
    return NULL;
}

int keel_audit_symbols_for(int family, int bits, bool x_f16, const char **syms, int cap) {
    int n = 0;
    if (family == 0) { /* KEEL_CF_STREAM */
        char want[64];
        snprintf(want, sizeof want, "stream_tile<%d,%s>", bits, x_f16 ? "true" : "false");
        const keel_audit_kernel *k = keel_audit_kernel_find(want);
        if (k && n < cap) syms[n++] = k->symbol;
        if (k && n < cap) syms[n++] = "stream_finish";
    } else if (family == 2) { /* KEEL_CF_RELU2 */
        if (n < cap) syms[n++] = "relu2_kernel";
    }
    return n;
}

/* ---- known findings ------------------------------------------------------------------------------------- */

keel_code keel_audit_findings_parse(keel_audit_findings *f, const char *text, const char *path, keel_err *err) {
    char *buf = keel_xstrdup(text);
    keel_code rc = KEEL_OK;
    int lineno = 0;
    for (char *line = buf, *next; line && rc == KEEL_OK; line = next) {
        lineno++;
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        char *p = line, *name = next_tok(&p);
        if (!name || name[0] == '#') continue;
        char *gate = next_tok(&p);
        while (*p == ' ' || *p == '\t') p++;
        if (!gate || strlen(gate) != 1 || gate[0] < '1' || gate[0] > '5' || !*p) {
            rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: expected '<registration> <gate 1-5> <reason>'", path,
                              lineno);
            break;
        }
        if (gate[0] != '5') continue;
        if (strlen(name) >= sizeof f->name[0] || !strchr(name, '/')) {
            rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: gate-5 entry '%s': expected <chip>/<kernel>", path, lineno,
                              name);
            break;
        }
        for (int i = 0; i < f->n; i++)
            if (!strcmp(f->name[i], name))
                rc = keel_err_set(err, KEEL_E_FORMAT, "%s:%d: %s is listed twice (first on line %d)", path, lineno,
                                  name, f->line[i]);
        if (rc != KEEL_OK) break;
        f->name = keel_xrealloc(f->name, (size_t)(f->n + 1) * sizeof *f->name);
        f->line = keel_xrealloc(f->line, (size_t)(f->n + 1) * sizeof *f->line);
        snprintf(f->name[f->n], sizeof f->name[0], "%s", name);
        f->line[f->n++] = lineno;
    }
    free(buf);
    return rc;
}

keel_code keel_audit_findings_load(keel_audit_findings *f, const char *path, keel_err *err) {
    struct stat st;
    if (stat(path, &st) != 0 && errno == ENOENT) return KEEL_OK;
    char *text = NULL;
    keel_code rc = keel_read_file(path, &text, NULL, err);
    if (rc == KEEL_OK) rc = keel_audit_findings_parse(f, text, path, err);
    free(text);
    return rc;
}

void keel_audit_findings_free(keel_audit_findings *f) {
    if (!f) return;
    free(f->name);
    free(f->line);
    memset(f, 0, sizeof *f);
}

bool keel_audit_findings_has(const keel_audit_findings *f, const char *chip, const char *kernel) {
    if (!f) return false;
    size_t cl = strlen(chip);
    for (int i = 0; i < f->n; i++)
        if (!strncmp(f->name[i], chip, cl) && f->name[i][cl] == '/' && !strcmp(f->name[i] + cl + 1, kernel))
            return true;
    return false;
}

static const char *const finding_fields[] = {"spill_st", "spill_ld", "stack", "vgpr_spill", "sgpr_spill", "scratch"};

bool keel_audit_record_shows_finding(const keel_audit_record *rec) {
    for (size_t i = 0; i < sizeof finding_fields / sizeof finding_fields[0]; i++)
        if (keel_audit_record_get(rec, finding_fields[i]) > 0) return true;
    return false;
}

int keel_audit_findings_check(const keel_audit_records *recs, const keel_audit_findings *f, FILE *out) {
    int problems = 0;
    for (int i = 0; i < recs->n; i++) {
        const keel_audit_record *r = &recs->items[i];
        if (keel_audit_record_shows_finding(r) && !keel_audit_findings_has(f, r->chip, r->kernel)) {
            fprintf(out, "LIMIT %s %s findings: the record shows spills or a stack frame that no known finding names\n",
                    r->chip, r->kernel);
            problems++;
        }
    }
    for (int i = 0; f && i < f->n; i++) {
        char chip[KEEL_AUDIT_CHIP_MAX];
        const char *slash = strchr(f->name[i], '/');
        snprintf(chip, sizeof chip, "%.*s", (int)(slash - f->name[i]), f->name[i]);
        const keel_audit_record *r = keel_audit_records_find(recs, chip, slash + 1);
        if (!keel_audit_records_compiler(recs, chip)) continue; /* a chip not in this set of records */
        if (!r) {
            fprintf(out, "LIMIT %s %s findings: known finding (line %d) names no record\n", chip, slash + 1, f->line[i]);
            problems++;
        } else if (!keel_audit_record_shows_finding(r)) {
            fprintf(out, "LIMIT %s %s findings: known finding (line %d) but the record shows no spill or stack\n",
                    chip, slash + 1, f->line[i]);
            problems++;
        }
    }
    return problems;
}

/* ---- limits and comparisons ----------------------------------------------------------------------------- */

/* Per-chip CUDA limits: shared memory per block (opt-in maximum) and per SM. Registers: 64K per SM, 255 a thread. */
typedef struct nv_chip {
    const char *chip;
    int smem_block, smem_sm;
} nv_chip;
static const nv_chip nv_chips[] = {
    {"sm_80", 166912, 167936}, {"sm_86", 101376, 102400}, {"sm_89", 101376, 102400},
    {"sm_90", 232448, 233472}, {"sm_100", 232448, 233472}, {"sm_120", 101376, 102400},
};

static const nv_chip *nv_find(const char *chip) {
    for (size_t i = 0; i < sizeof nv_chips / sizeof nv_chips[0]; i++)
        if (!strcmp(nv_chips[i].chip, chip)) return &nv_chips[i];
    return NULL;
}

/* Blocks per SM the register file allows: registers rounded to 8 a thread, 256 a warp allocation unit. */
static int nv_blocks_by_regs(long long regs, int block) {
    if (regs <= 0) regs = 1;
    long long per_warp = ((regs + 7) / 8 * 8) * 32;
    per_warp = (per_warp + 255) / 256 * 256;
    long long warps = 65536 / per_warp, wpb = (block + 31) / 32;
    return (int)(warps / wpb);
}

/* Blocks per SM of a launch of per_block shared bytes (static + dynamic): registers and shared memory (+1 KiB reserved
 * a block); 0 where one block does not fit. */
static int nv_blocks(const nv_chip *nv, long long regs, int block, long long per_block) {
    if (per_block > nv->smem_block) return 0;
    const long long by_smem = nv->smem_sm / (per_block + 1024);
    const int by_regs = nv_blocks_by_regs(regs, block);
    return by_smem < by_regs ? (int)by_smem : by_regs;
}

int keel_audit_dsmem(const keel_audit_kernel *k, const char *chip, long long regs, long long smem) {
    if (k->dsmem != KEEL_AUDIT_DSMEM_XBUDGET) return k->dsmem;
    const nv_chip *nv = nv_find(chip);
    if (!nv) return KEEL_CUDA_PACKED_SMEM; /* HIP: the default budget (packed.cu's pk_auto_xbytes) */
    const long long st = smem > 0 ? smem : 0;
    const int want = nv_blocks(nv, regs, k->block, st + KEEL_CUDA_PACKED_SMEM);
    int xb = KEEL_CUDA_PACKED_XBYTES;
    while (want > 0 && nv_blocks(nv, regs, k->block, st + KEEL_CUDA_PACKED_SMEM_FOR(xb + 1024)) >= want) xb += 1024;
    return KEEL_CUDA_PACKED_SMEM_FOR(xb);
}

int keel_audit_limits(const keel_audit_record *rec, const keel_audit_kernel *k, const keel_audit_findings *f,
                      FILE *out) {
    int problems = 0;
    const char *c = rec->chip, *kn = rec->kernel;
    if (!k) {
        fprintf(out, "LIMIT %s %s launch: no launch declaration (add the kernel to the table in audit.c)\n", c, kn);
        return 1;
    }
    bool named = keel_audit_findings_has(f, c, kn);
    for (size_t i = 0; i < sizeof finding_fields / sizeof finding_fields[0]; i++) {
        long long v = keel_audit_record_get(rec, finding_fields[i]);
        if (v > 0 && !named) {
            fprintf(out, "LIMIT %s %s %s: %lld, and no known finding names %s/%s\n", c, kn, finding_fields[i], v, c,
                    kn);
            problems++;
        }
    }
    if (named && !keel_audit_record_shows_finding(rec)) {
        fprintf(out, "LIMIT %s %s findings: a known finding names %s/%s but it compiles without spills or stack\n", c,
                kn, c, kn);
        problems++;
    }
    const nv_chip *nv = nv_find(c);
    if (nv) {
        const int min_blocks = nv->smem_sm <= 102400 && k->min_blocks_100k ? k->min_blocks_100k : k->min_blocks;
        long long regs = keel_audit_record_get(rec, "regs"), smem = keel_audit_record_get(rec, "smem");
        int by_regs = nv_blocks_by_regs(regs, k->block);
        if (regs > 255) {
            fprintf(out, "LIMIT %s %s regs: %lld, above 255 a thread\n", c, kn, regs);
            problems++;
        }
        if (by_regs < min_blocks) {
            fprintf(out, "LIMIT %s %s regs: %lld registers x %d threads allow %d blocks per SM, the launch declares %d\n",
                    c, kn, regs, k->block, by_regs, min_blocks);
            problems++;
        }
        const int dsmem = keel_audit_dsmem(k, c, regs, smem);
        long long per_block = (smem > 0 ? smem : 0) + dsmem;
        if (per_block > nv->smem_block) {
            fprintf(out, "LIMIT %s %s smem: %lld static + %d dynamic bytes, above %d a block\n", c, kn, smem, dsmem,
                    nv->smem_block);
            problems++;
        } else if ((per_block + 1024) * min_blocks > nv->smem_sm) {
            fprintf(out, "LIMIT %s %s smem: %d blocks of %lld bytes (+1 KiB reserved each) exceed %d per SM\n", c, kn,
                    min_blocks, per_block, nv->smem_sm);
            problems++;
        }
    } else {
        long long occ = keel_audit_record_get(rec, "occupancy"), vgprs = keel_audit_record_get(rec, "regs");
        long long lds = keel_audit_record_get(rec, "lds");
        if (occ >= 0 && occ < k->min_blocks) {
            fprintf(out, "LIMIT %s %s occupancy: %lld waves per SIMD with %lld VGPRs, the launch declares %d\n", c, kn,
                    occ, vgprs, k->min_blocks);
            problems++;
        }
        const int dsmem = keel_audit_dsmem(k, c, vgprs, lds);
        if ((lds > 0 ? lds : 0) + dsmem > 65536) {
            fprintf(out, "LIMIT %s %s lds: %lld static + %d dynamic bytes, above 65536 a workgroup\n", c, kn, lds,
                    dsmem);
            problems++;
        }
    }
    return problems;
}

int keel_audit_compare(const keel_audit_record *recorded, const keel_audit_record *compiled, FILE *out) {
    int problems = 0;
    for (int i = 0; i < compiled->n; i++) {
        long long want = keel_audit_record_get(recorded, compiled->key[i]);
        if (want < 0) {
            fprintf(out, "LIMIT %s %s %s: not recorded, compiled %lld\n", compiled->chip, compiled->kernel,
                    compiled->key[i], compiled->val[i]);
            problems++;
        } else if (want != compiled->val[i]) {
            fprintf(out, "LIMIT %s %s %s: recorded %lld, compiled %lld\n", compiled->chip, compiled->kernel,
                    compiled->key[i], want, compiled->val[i]);
            problems++;
        }
    }
    for (int i = 0; i < recorded->n; i++)
        if (keel_audit_record_get(compiled, recorded->key[i]) < 0) {
            fprintf(out, "LIMIT %s %s %s: recorded %lld, the compiler reports no such field\n", recorded->chip,
                    recorded->kernel, recorded->key[i], recorded->val[i]);
            problems++;
        }
    return problems;
}

int keel_audit_live_compare(const keel_audit_records *recs, const char *chip, const char *kernel,
                            const keel_audit_live *got, FILE *out) {
    const keel_audit_record *r = keel_audit_records_find(recs, chip, kernel);
    if (!r) {
        fprintf(out, "LIMIT %s %s live: loaded, but there is no record for this chip\n", chip, kernel);
        return 1;
    }
    struct {
        const char *field, *attr;
        long long want, have;
    } f[] = {
        {"regs", "numRegs", keel_audit_record_get(r, "regs"), got->regs},
        {"stack", "localSizeBytes", keel_audit_record_get(r, "stack"), got->local},
        {"smem", "sharedSizeBytes", keel_audit_record_get(r, "smem"), got->smem},
        {"dsmem", "maxDynamicSharedSizeBytes", keel_audit_record_get(r, "dsmem"), got->dsmem_max},
    };
    int problems = 0;
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        if (f[i].have < 0 && !strcmp(f[i].field, "dsmem")) continue;
        if (f[i].want != f[i].have) {
            fprintf(out, "LIMIT %s %s %s: recorded %lld, loaded %s %lld\n", chip, kernel, f[i].field, f[i].want,
                    f[i].attr, f[i].have);
            problems++;
        }
    }
    return problems;
}

int keel_audit_live_check(const keel_audit_records *recs, const char *records_dir, const char *chip,
                          keel_audit_fn_lookup lookup, keel_audit_attrs_reader attrs, FILE *out) {
    if (!recs || !keel_audit_records_compiler(recs, chip)) {
        fprintf(out, "LIMIT %s - records: no records for this chip in %s (keel audit --chips %s --print-records)\n",
                chip, records_dir ? records_dir : "(none)", chip);
        return 1;
    }
    int n, problems = 0;
    const keel_audit_kernel *k = keel_audit_kernels(&n);
    for (int i = 0; i < n; i++) {
        if (k[i].control) continue;
        const void *fn = lookup ? lookup(k[i].symbol) : NULL;
        if (!fn) {
            fprintf(out, "LIMIT %s %s live: the launch table lists it, but no kernel lookup returns its function\n",
                    chip, k[i].symbol);
            problems++;
            continue;
        }
        keel_audit_live got;
        char why[256] = "";
        if (!attrs(fn, &got, why, sizeof why)) {
            fprintf(out, "LIMIT %s %s live: attributes unreadable: %s\n", chip, k[i].symbol, why);
            problems++;
            continue;
        }
        problems += keel_audit_live_compare(recs, chip, k[i].symbol, &got, out);
    }
    return problems;
}

bool keel_audit_summary_add(const char *line, const char *chip, int extra, char *buf, size_t cap) {
    static const char tail[] = " limit problems";
    const size_t cl = strlen(chip), ll = strlen(line), tl = sizeof tail - 1;
    if (strncmp(line, "SUMMARY ", 8) || strncmp(line + 8, chip, cl) || line[8 + cl] != ' ' || ll < tl ||
        strcmp(line + ll - tl, tail))
        return false;
    const char *num = line + ll - tl;
    while (num > line && isdigit((unsigned char)num[-1])) num--;
    if (num == line + ll - tl || num - line < 2 || strncmp(num - 2, "; ", 2)) return false;
    const long long had = strtoll(num, NULL, 10);
    const int n = snprintf(buf, cap, "%.*s%lld%s", (int)(num - line), line, had + extra, tail);
    return n >= 0 && (size_t)n < cap;
}
