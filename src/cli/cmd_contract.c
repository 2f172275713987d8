/* keel contract: runs the kernel contract (gates 1-4 and planted controls) and, on a CUDA chip, gate 5's live check.
 * Exit status: 0 nothing failed and no control missed; 1 a registration failed, a control was missed, a known
 * finding is stale or the live check found a limit problem; 2 bad arguments or an unreadable known-findings list;
 * 3 the requested backend is not available (a build without CUDA, or no GPU). */
#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "contract/audit.h"
#include "contract/contract.h"
#include "contract/engine_regs_cuda.h"

#define EXIT_UNAVAILABLE 3

static void usage(FILE *f) {
    fprintf(f, "usage: keel contract [--backend cpu|cuda|all] [--filter REGEX] [--json FILE] [--list]\n"
               "                     [--known-findings FILE]\n"
               "  --backend   chips to check (default all: every backend this build and host have)\n"
               "  --filter    only registrations whose name matches this POSIX extended regex\n"
               "  --json      write every registration's result, gate by gate, to FILE\n"
               "  --list      print the registrations and their controls without running them\n"
               "  --known-findings  the list of understood failures (default: contract/known_findings of the\n"
               "              source tree: $KEEL_SRC, the working directory, or beside the keel binary's build dir)\n"
               "exit status: 0 pass, 1 a failure or a missed control, 2 bad arguments, 3 backend not available\n");
}

/* The default list: $KEEL_SRC, then ./, then the parent of the binary's directory (build dirs sit in the tree). */
static bool find_known(char *out, size_t cap) {
    const char *src = getenv("KEEL_SRC");
    if (src && *src) {
        snprintf(out, cap, "%s/contract/known_findings", src);
        if (access(out, R_OK) == 0) return true;
    }
    snprintf(out, cap, "contract/known_findings");
    if (access(out, R_OK) == 0) return true;
    char exe[PATH_MAX - 64];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = '\0';
            if (snprintf(out, cap, "%s/../contract/known_findings", exe) < (int)cap && access(out, R_OK) == 0)
                return true;
        }
    }
    return false;
}

static const char *family_label(const keel_contract_reg *r) {
    return r->family == KEEL_CF_STREAM        ? "stream"
           : r->family == KEEL_CF_FLOAT       ? "stream-float"
           : r->family == KEEL_CF_ROUTED_UP   ? "routed-up"
           : r->family == KEEL_CF_ROUTED_DOWN ? "routed-down"
                                              : "relu2";
}

static void list_table(const keel_contract_table *t, const char *filter_unused) {
    (void)filter_unused;
    for (int i = 0; i < t->n; i++) {
        const keel_contract_reg *r = &t->regs[i];
        printf("%s  entry=%s family=%s rows=%d-%d tile=%dx%d shapes=", r->name, r->entry, family_label(r),
               r->rows_min, r->rows_max, r->tile_rows, r->tile_cols);
        for (int s = 0; s < r->n_shapes; s++)
            printf("%s(n=%d,k=%d,m=%d-%d)", s ? "," : "", r->shapes[s].n, r->shapes[s].k, r->shapes[s].m_lo,
                   r->shapes[s].m_hi);
        if (r->n_replaces) {
            printf(" replaces=");
            for (int k = 0; k < r->n_replaces; k++) printf("%s%s", k ? "+" : "", r->replaces[k]);
            printf(r->same_order ? "(bitwise)" : "(within bound)");
        }
        printf(" controls=");
        for (int c = 0; c < r->n_controls; c++)
            printf("%s%s@%d", c ? "," : "", r->controls[c].name, r->controls[c].gate);
        printf("\n");
    }
}

/* Gate 5's live check on the chip in hand: every kernel of the audit's launch table, its loaded attributes against
 * contract/records/<chip> (docs/gate5.md). LIMIT lines go to out; returns the count. */
static int live_check(FILE *out) {
#if defined(KEEL_HAVE_CUDA)
    char chip[KEEL_AUDIT_CHIP_MAX], dir[1024], path[1100];
    if (!keel_audit_live_chip(chip, sizeof chip)) {
        fprintf(out, "LIMIT cuda - live: the CUDA runtime does not name the chip in hand\n");
        return 1;
    }
    keel_audit_records_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/%s", dir, chip);
    keel_audit_records recs;
    keel_audit_records_init(&recs);
    keel_err err = {0};
    char *text = NULL;
    int problems;
    if (access(path, F_OK) != 0) {
        problems = keel_audit_live_check(NULL, path, chip, keel_audit_live_fn, keel_audit_live_attrs, out);
    } else if (keel_read_file(path, &text, NULL, &err) != KEEL_OK ||
               keel_audit_records_parse(&recs, text, path, &err) != KEEL_OK) {
        fprintf(out, "LIMIT %s - records: %s\n", chip, err.msg);
        problems = 1;
    } else {
        problems = keel_audit_live_check(&recs, path, chip, keel_audit_live_fn, keel_audit_live_attrs, out);
    }
    free(text);
    keel_audit_records_free(&recs);
    return problems;
#else
    (void)out;
    return 0;
#endif
}

/* Copies the captured run to stdout; the chip's LIMIT lines go just before its SUMMARY line, which counts them. */
static void echo_with_limits(const char *text, const char *chip, const char *limits, int n_limits) {
    bool placed = false;
    for (const char *line = text; line && *line;) {
        const char *nl = strchr(line, '\n');
        const size_t len = nl ? (size_t)(nl - line) + 1 : strlen(line);
        char *l = keel_xstrdup(line), fixed[512];
        l[nl ? len - 1 : len] = 0;
        if (!placed && keel_audit_summary_add(l, chip, n_limits, fixed, sizeof fixed)) {
            fputs(limits, stdout);
            printf("%s\n", fixed);
            placed = true;
        } else {
            fwrite(line, 1, len, stdout);
        }
        free(l);
        line += len;
    }
    if (!placed && n_limits) { /* no SUMMARY line for the chip (no registration ran): the problems still show */
        fputs(limits, stdout);
        printf("SUMMARY %s live check: %d limit problems\n", chip, n_limits);
    }
}

int keel_cli_contract(int argc, char **argv) {
    const char *backend = "all", *filter = NULL, *json_path = NULL, *known_path = NULL;
    bool list = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const bool has = i + 1 < argc;
        if (strcmp(a, "--backend") == 0 && has) {
            backend = argv[++i];
        } else if (strcmp(a, "--filter") == 0 && has) {
            filter = argv[++i];
        } else if (strcmp(a, "--json") == 0 && has) {
            json_path = argv[++i];
        } else if (strcmp(a, "--known-findings") == 0 && has) {
            known_path = argv[++i];
        } else if (strcmp(a, "--list") == 0) {
            list = true;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        } else {
            usage(stderr);
            keel_cli_fail("contract", "unknown or incomplete argument \"%s\"", a);
            return 2;
        }
    }
    const bool want_cpu = strcmp(backend, "cpu") == 0 || strcmp(backend, "all") == 0;
    const bool want_cuda = strcmp(backend, "cuda") == 0 || strcmp(backend, "all") == 0;
    if (!want_cpu && !want_cuda) {
        keel_cli_fail("contract", "--backend expects cpu, cuda or all, found \"%s\"", backend);
        return 2;
    }

    keel_contract_table t;
    keel_contract_table_init(&t);
    if (want_cpu) keel_contract_register_cpu(&t);
    const keel_contract_backend *cuda = NULL; /* a chip with no registrations still gets its SUMMARY line */
    int n_cuda = 0;
    if (want_cuda) {
        char why[256] = "";
        if (!(cuda = keel_contract_cuda_backend(why, sizeof why))) {
            if (!want_cpu) {
                keel_contract_table_free(&t);
                fprintf(stderr, "keel contract: the cuda backend is not available: %s\n", why);
                return EXIT_UNAVAILABLE;
            }
            printf("NOTE cuda: not checked: %s\n", why);
        } else {
            n_cuda = keel_contract_register_cuda(&t);
            n_cuda += keel_contract_register_cuda_engine(&t);
            n_cuda += keel_contract_register_cuda_attn(&t);
            n_cuda += keel_contract_register_cuda_scan(&t);
        }
    }
    if (list) {
        list_table(&t, filter);
        printf("%d registrations\n", t.n);
        keel_contract_table_free(&t);
        return 0;
    }

    keel_contract_findings known;
    memset(&known, 0, sizeof known);
    keel_err err = {0};
    char found[PATH_MAX];
    if (!known_path && find_known(found, sizeof found)) known_path = found;
    if (known_path) {
        if (keel_contract_findings_load(&known, known_path, &err) != KEEL_OK) {
            keel_contract_table_free(&t);
            keel_cli_fail("contract", "known findings: %s", err.msg);
            return 2;
        }
    } else {
        printf("NOTE no contract/known_findings found (set KEEL_SRC or pass --known-findings); none assumed\n");
    }

    cJSON *json = json_path ? cJSON_CreateArray() : NULL;
    keel_contract_report rep;
    /* with CUDA the run is captured so the chip's SUMMARY can count gate 5's live check, read after the launches
     * set their attributes */
    char *run_text = NULL, *lim_text = NULL;
    size_t run_len = 0, lim_len = 0;
    FILE *run_out = cuda ? open_memstream(&run_text, &run_len) : NULL;
    KEEL_ASSERTF(run_out || !cuda, "open_memstream: %s", strerror(errno));
    const keel_code c = keel_contract_run_all(&t, filter, &known, run_out ? run_out : stdout, json, &rep, &err);
    int status = 0;
    if (c == KEEL_OK && cuda && n_cuda == 0) {
        keel_contract_report none;
        memset(&none, 0, sizeof none);
        char line[384];
        keel_contract_summary(cuda->chip, &none, line, sizeof line);
        fprintf(run_out ? run_out : stdout, "%s\n", line);
    }
    int live = 0;
    if (run_out) {
        fclose(run_out);
        FILE *lim = c == KEEL_OK ? open_memstream(&lim_text, &lim_len) : NULL;
        if (lim) {
            live = live_check(lim);
            fclose(lim);
        }
        echo_with_limits(run_text, cuda->chip, lim_text ? lim_text : "", live);
        free(run_text);
        free(lim_text);
    }
    if (c != KEEL_OK) {
        keel_cli_fail("contract", "%s", err.msg);
        status = 2;
    } else {
        if (rep.kernels == 0) printf("NOTE no registration matched\n");
        status = rep.fail || rep.missed || live ? 1 : 0;
    }
    if (json && c == KEEL_OK) {
        char *text = cJSON_Print(json);
        char tmp[PATH_MAX];
        snprintf(tmp, sizeof tmp, "%s.tmp", json_path);
        FILE *f = fopen(tmp, "w");
        bool ok = f && fputs(text, f) >= 0;
        if (f) ok = fclose(f) == 0 && ok;
        if (!ok || rename(tmp, json_path) != 0) {
            keel_cli_fail("contract", "cannot write --json file %s", json_path);
            status = 2;
        }
        free(text);
    }
    cJSON_Delete(json);
    keel_contract_findings_free(&known);
    keel_contract_table_free(&t);
    return status;
}
