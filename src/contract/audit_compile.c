/* contract/audit_compile: the offline audit. Compiles each kernel source once per chip with the pinned compiler
 * (nvcc --resource-usage per sm arch, hipcc -Rpass-analysis=kernel-resource-usage per gfx target), in parallel,
 * demangles the reports with c++filt, and checks the kernels against the records and the limits. */
#include "audit.h"

#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define NVCC_DEFAULT "/usr/local/cuda/bin/nvcc"
#define HIPCC_DEFAULT "/usr/bin/hipcc"

/* sm targets from the pinned nvcc; gfx targets that compile with Debian's hipcc (wave32 chips only). */
static const char *const known_chips[] = {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120",
                                          "gfx1010", "gfx1030"};

const char *const *keel_audit_known_chips(int *n) {
    *n = (int)(sizeof known_chips / sizeof known_chips[0]);
    return known_chips;
}

static bool is_nv(const char *chip) { return !strncmp(chip, "sm_", 3); }

/* The source tree: $KEEL_SOURCE_DIR, else the tree this file was compiled in. */
static void source_dir(const char *given, char *out, size_t cap) {
    const char *env = getenv("KEEL_SOURCE_DIR");
    if (given && *given) {
        snprintf(out, cap, "%s", given);
    } else if (env && *env) {
        snprintf(out, cap, "%s", env);
    } else {
        snprintf(out, cap, "%s", __FILE__);
        char *s = strstr(out, "/src/contract/audit_compile.c");
        if (s) *s = 0;
        else snprintf(out, cap, ".");
    }
}

void keel_audit_records_dir(char *out, size_t cap) {
    char src[1024];
    source_dir(NULL, src, sizeof src);
    snprintf(out, cap, "%s/contract/records", src);
}

static const char *tool(const char *env, const char *dflt) {
    const char *v = getenv(env);
    return v && *v ? v : dflt;
}

/* Runs a shell command and returns its first stdout line matching `prefix` (the version line). */
static bool version_line(const char *cmd, const char *prefix, char *out, size_t cap) {
    FILE *p = popen(cmd, "r");
    if (!p) return false;
    char line[512];
    bool found = false;
    while (fgets(line, sizeof line, p))
        if (!found && strstr(line, prefix)) {
            line[strcspn(line, "\r\n")] = 0;
            snprintf(out, cap, "%s", strstr(line, prefix));
            found = true;
        }
    pclose(p);
    return found;
}

/* True when snprintf's result fit its buffer (a path too long for a command is refused, never cut). */
static bool fits(int n, size_t cap) { return n >= 0 && (size_t)n < cap; }

/* The pinned compilers' version lines; empty when the compiler is absent. */
static void compiler_versions(char *nv, char *hip, size_t cap) {
    char cmd[600];
    nv[0] = hip[0] = 0;
    if (fits(snprintf(cmd, sizeof cmd, "'%s' --version 2>/dev/null", tool("KEEL_NVCC", NVCC_DEFAULT)), sizeof cmd))
        version_line(cmd, "Cuda compilation tools", nv, cap);
    char hv[160] = "", cv[160] = "";
    if (fits(snprintf(cmd, sizeof cmd, "'%s' --version 2>/dev/null", tool("KEEL_HIPCC", HIPCC_DEFAULT)), sizeof cmd) &&
        version_line(cmd, "HIP version", hv, sizeof hv) && version_line(cmd, "clang version", cv, sizeof cv) &&
        !fits(snprintf(hip, cap, "%s, %s", hv, cv), cap))
        hip[0] = 0;
}

/* ---- parsing the compilers' reports (already demangled) ------------------------------------------------ */

/* "(anonymous namespace)::stream_tile<8, false>((anonymous namespace)::Params)" -> "stream_tile<8,false>". */
static void normalize(const char *in, char *out, size_t cap) {
    static const char anon[] = "(anonymous namespace)::";
    size_t o = 0;
    int depth = 0;
    if (!strncmp(in, "void ", 5)) in += 5; /* function templates demangle with their return type */
    for (const char *s = in; *s && o + 1 < cap;) {
        if (!strncmp(s, anon, sizeof anon - 1)) {
            s += sizeof anon - 1;
            continue;
        }
        if (*s == '<') depth++;
        if (*s == '>') depth--;
        if (*s == '(' && depth == 0) break;
        if (*s != ' ') out[o++] = *s;
        s++;
    }
    out[o] = 0;
}

static long long num_before(const char *line, const char *what) {
    const char *s = strstr(line, what);
    if (!s) return -1;
    while (s > line && s[-1] == ' ') s--;
    while (s > line && s[-1] >= '0' && s[-1] <= '9') s--;
    return strtoll(s, NULL, 10);
}

static long long num_after(const char *line, const char *what) {
    const char *s = strstr(line, what);
    return s ? strtoll(s + strlen(what), NULL, 10) : -1;
}

/* ptxas --resource-usage: "Compiling entry function 'K' for 'sm_90'", "Function properties for K" then
 * "N bytes stack frame, N bytes spill stores, N bytes spill loads", "Used N registers, ..., N bytes smem". */
static void parse_nv(const char *text, const char *chip, keel_audit_records *out) {
    char entry[512] = "", props[512] = "";
    keel_audit_record *rec = NULL;
    for (const char *line = text; line && *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        char l[1024];
        snprintf(l, sizeof l, "%.*s", (int)(len < sizeof l ? len : sizeof l - 1), line);
        const char *q;
        if ((q = strstr(l, "Compiling entry function '"))) {
            q += strlen("Compiling entry function '");
            const char *e = strstr(q, "' for '");
            snprintf(entry, sizeof entry, "%.*s", (int)(e ? e - q : (long)strlen(q)), q);
            char name[KEEL_AUDIT_NAME_MAX];
            normalize(entry, name, sizeof name);
            rec = keel_audit_records_add(out, chip, name);
            props[0] = 0;
        } else if ((q = strstr(l, "Function properties for "))) {
            snprintf(props, sizeof props, "%s", q + strlen("Function properties for "));
        } else if (rec && strstr(l, "bytes stack frame") && !strcmp(props, entry)) {
            keel_audit_record_set(rec, "stack", num_before(l, "bytes stack frame"));
            keel_audit_record_set(rec, "spill_st", num_before(l, "bytes spill stores"));
            keel_audit_record_set(rec, "spill_ld", num_before(l, "bytes spill loads"));
        } else if (rec && (q = strstr(l, "Used ")) && strstr(l, "registers")) {
            long long smem = num_before(l, "bytes smem");
            keel_audit_record_set(rec, "regs", num_after(l, "Used "));
            keel_audit_record_set(rec, "smem", smem < 0 ? 0 : smem);
        }
        line = end ? end + 1 : NULL;
    }
}

/* clang -Rpass-analysis=kernel-resource-usage: "remark: Function Name: K" then one remark per resource. */
static void parse_hip(const char *text, const char *chip, keel_audit_records *out) {
    static const struct {
        const char *tag, *field;
    } map[] = {
        {"remark:     VGPRs: ", "regs"},         {"remark:     SGPRs: ", "sgprs"},
        {"remark:     VGPRs Spill: ", "vgpr_spill"}, {"remark:     SGPRs Spill: ", "sgpr_spill"},
        {"remark:     ScratchSize [bytes/lane]: ", "scratch"}, {"remark:     LDS Size [bytes/block]: ", "lds"},
        {"remark:     Occupancy [waves/SIMD]: ", "occupancy"},
    };
    keel_audit_record *rec = NULL;
    for (const char *line = text; line && *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        char l[1024];
        snprintf(l, sizeof l, "%.*s", (int)(len < sizeof l ? len : sizeof l - 1), line);
        const char *q;
        if ((q = strstr(l, "remark: Function Name: "))) {
            char full[512], name[KEEL_AUDIT_NAME_MAX];
            q += strlen("remark: Function Name: ");
            const char *e = strstr(q, " [-Rpass");
            snprintf(full, sizeof full, "%.*s", (int)(e ? e - q : (long)strlen(q)), q);
            normalize(full, name, sizeof name);
            rec = keel_audit_records_add(out, chip, name);
        } else if (rec) {
            for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
                if ((q = strstr(l, map[i].tag))) keel_audit_record_set(rec, map[i].field, strtoll(q + strlen(map[i].tag), NULL, 10));
        }
        line = end ? end + 1 : NULL;
    }
}

/* ---- jobs ---------------------------------------------------------------------------------------------- */

typedef struct job {
    char chip[KEEL_AUDIT_CHIP_MAX];
    char source[1024];
    char log[1100];
    pid_t pid;
    int status;
} job;

static bool shell_safe(const char *s) { return !strchr(s, '\''); }

static pid_t start_job(job *j, const char *src, const char *tmp, int idx) {
    char cmd[4096], obj[1100];
    int n;
    if (!fits(snprintf(obj, sizeof obj, "%s/j%d.o", tmp, idx), sizeof obj) ||
        !fits(snprintf(j->log, sizeof j->log, "%s/j%d.log", tmp, idx), sizeof j->log))
        return -1;
    if (is_nv(j->chip))
        n = snprintf(cmd, sizeof cmd,
                 "'%s' -cubin -arch=%s -O3 -DNDEBUG -std=c++17 --resource-usage -I'%s/src' -o '%s' '%s' >'%s.raw' 2>&1"
                 " && c++filt <'%s.raw' >'%s' || { cat '%s.raw' >'%s'; exit 1; }",
                 tool("KEEL_NVCC", NVCC_DEFAULT), j->chip, src, obj, j->source, j->log, j->log, j->log, j->log, j->log);
    else
        n = snprintf(cmd, sizeof cmd,
                 "'%s' -x hip --offload-arch=%s --cuda-device-only -c -O3 -DNDEBUG -std=c++17"
                 " -Rpass-analysis=kernel-resource-usage -I'%s/src' -o '%s' '%s' >'%s.raw' 2>&1"
                 " && c++filt <'%s.raw' >'%s' || { cat '%s.raw' >'%s'; exit 1; }",
                 tool("KEEL_HIPCC", HIPCC_DEFAULT), j->chip, src, obj, j->source, j->log, j->log, j->log, j->log, j->log);
    if (!fits(n, sizeof cmd)) return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* Runs all jobs, at most `par` at a time; fills each job's exit status. */
static void run_jobs(job *jobs, int n, int par, const char *src, const char *tmp) {
    int next = 0, running = 0;
    while (next < n || running > 0) {
        while (running < par && next < n) {
            jobs[next].pid = start_job(&jobs[next], src, tmp, next);
            if (jobs[next].pid < 0) jobs[next].status = -1;
            else running++;
            next++;
        }
        int st;
        pid_t pid = wait(&st);
        if (pid < 0) break;
        for (int i = 0; i < next; i++)
            if (jobs[i].pid == pid) {
                jobs[i].status = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
                jobs[i].pid = 0;
                running--;
            }
    }
}

/* The kernel sources: every .cu with a __global__ under src/kernels/cuda and src/engine/cuda, the most `template <`
 * first (instantiations dominate compile time; ties keep the directory order), so the longest compiles start first. */
static int kernel_sources(const char *src, char (*out)[1024], int cap) {
    static const char *const dirs[] = {"src/kernels/cuda", "src/engine/cuda"};
    int n = 0, weight[64];
    KEEL_ASSERT(cap <= 64);
    for (size_t d = 0; d < 2; d++) {
        char dir[1024];
        if (snprintf(dir, sizeof dir, "%s/%s", src, dirs[d]) >= (int)sizeof dir) continue;
        struct dirent **names = NULL;
        int m = scandir(dir, &names, NULL, alphasort);
        for (int i = 0; i < m; i++) {
            const char *nm = names[i]->d_name;
            size_t l = strlen(nm);
            char path[1024];
            bool fits = snprintf(path, sizeof path, "%s/%s", dir, nm) < (int)sizeof path;
            char *text = NULL;
            if (fits && n < cap && l > 3 && !strcmp(nm + l - 3, ".cu") &&
                keel_read_file(path, &text, NULL, NULL) == KEEL_OK && strstr(text, "__global__")) {
                int w = 0, at = n++;
                for (const char *p = text; (p = strstr(p, "template <")); p++) w++;
                for (; at > 0 && weight[at - 1] < w; at--) { /* insertion, stable */
                    weight[at] = weight[at - 1];
                    memcpy(out[at], out[at - 1], sizeof out[at]);
                }
                weight[at] = w;
                memcpy(out[at], path, sizeof path);
            }
            free(text);
            free(names[i]);
        }
        free(names);
    }
    return n;
}

static int cmp_rec(const void *a, const void *b) {
    const keel_audit_record *x = a, *y = b;
    return strcmp(x->kernel, y->kernel);
}

/* One RECORD line, fields in a fixed order so a regenerated file diffs cleanly. */
static void print_record(FILE *out, const keel_audit_record *r) {
    static const char *const order[] = {"regs", "sgprs", "spill_st", "spill_ld", "vgpr_spill", "sgpr_spill",
                                        "stack", "scratch", "smem", "lds", "occupancy", "block", "dsmem"};
    fprintf(out, "RECORD %s %s", r->chip, r->kernel);
    for (size_t o = 0; o < sizeof order / sizeof order[0]; o++)
        if (keel_audit_record_get(r, order[o]) >= 0) fprintf(out, " %s=%lld", order[o], keel_audit_record_get(r, order[o]));
    for (int i = 0; i < r->n; i++) {
        bool listed = false;
        for (size_t o = 0; o < sizeof order / sizeof order[0]; o++) listed |= !strcmp(order[o], r->key[i]);
        if (!listed) fprintf(out, " %s=%lld", r->key[i], r->val[i]);
    }
    fputc('\n', out);
}

static void rm_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char p[1400];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

keel_code keel_audit_run(const keel_audit_opts *o, FILE *out, int *problems, keel_err *err) {
    char src[1024], rdir[1100], fpath[1100];
    source_dir(o->src_dir, src, sizeof src);
    snprintf(rdir, sizeof rdir, "%s", o->records_dir ? o->records_dir : "");
    if (!o->records_dir) snprintf(rdir, sizeof rdir, "%s/contract/records", src);
    if (o->findings) snprintf(fpath, sizeof fpath, "%s", o->findings);
    else snprintf(fpath, sizeof fpath, "%s/contract/known_findings_gate5", src);
    *problems = 0;
    if (!shell_safe(src)) return keel_err_set(err, KEEL_E_ARG, "source dir %s: a quote in the path", src);

    keel_audit_records recs;
    keel_audit_findings finds = {0};
    keel_audit_records_init(&recs);
    keel_code rc = keel_audit_records_load(&recs, rdir, err);
    if (rc == KEEL_OK) rc = keel_audit_findings_load(&finds, fpath, err);

    /* chips: the list given, else the recorded ones, else all known */
    char chips[KEEL_AUDIT_MAX_CHIPS][KEEL_AUDIT_CHIP_MAX];
    int n_chips = 0, n_known;
    const char *const *known = keel_audit_known_chips(&n_known);
    if (rc == KEEL_OK && o->chips) {
        char *list = keel_xstrdup(o->chips), *save = NULL;
        for (char *c = strtok_r(list, ",", &save); c && rc == KEEL_OK; c = strtok_r(NULL, ",", &save)) {
            bool ok = false;
            for (int i = 0; i < n_known; i++) ok |= !strcmp(known[i], c);
            if (!ok || n_chips == KEEL_AUDIT_MAX_CHIPS)
                rc = keel_err_set(err, KEEL_E_ARG, "--chips: unknown chip '%s' (known: sm_80 sm_86 sm_89 sm_90 sm_100 "
                                  "sm_120 gfx1010 gfx1030)", c);
            else
                snprintf(chips[n_chips++], sizeof chips[0], "%s", c);
        }
        free(list);
    } else if (rc == KEEL_OK) {
        for (int i = 0; i < n_known; i++)
            if (recs.n_chips == 0 || keel_audit_records_compiler(&recs, known[i]))
                snprintf(chips[n_chips++], sizeof chips[0], "%s", known[i]);
    }

    char nv_ver[160], hip_ver[160];
    compiler_versions(nv_ver, hip_ver, sizeof nv_ver);
    for (int i = 0; rc == KEEL_OK && i < n_chips; i++) {
        const char *have = is_nv(chips[i]) ? nv_ver : hip_ver;
        if (!have[0])
            rc = keel_err_set(err, KEEL_E_MISSING, "chip %s needs %s (%s), which is not installed (tools/deps.sh)",
                              chips[i], is_nv(chips[i]) ? "nvcc" : "hipcc",
                              is_nv(chips[i]) ? tool("KEEL_NVCC", NVCC_DEFAULT) : tool("KEEL_HIPCC", HIPCC_DEFAULT));
    }

    /* sources */
    char(*sources)[1024] = keel_xcalloc(64, sizeof *sources);
    int n_src = 0;
    if (rc == KEEL_OK && o->source) {
        struct stat st;
        if (stat(o->source, &st) != 0)
            rc = keel_err_set(err, KEEL_E_IO, "--source %s: %s", o->source, strerror(errno));
        else if (!shell_safe(o->source))
            rc = keel_err_set(err, KEEL_E_ARG, "--source %s: a quote in the path", o->source);
        else
            snprintf(sources[n_src++], sizeof sources[0], "%s", o->source);
    } else if (rc == KEEL_OK) {
        n_src = kernel_sources(src, sources, 64);
        if (n_src == 0)
            rc = keel_err_set(err, KEEL_E_MISSING, "no kernel sources (.cu with __global__) under %s/src/kernels/cuda",
                              src);
    }

    char tmp[1100] = "";
    job *jobs = NULL;
    keel_audit_records got;
    keel_audit_records_init(&got);
    if (rc == KEEL_OK) {
        const char *t = getenv("TMPDIR");
        snprintf(tmp, sizeof tmp, "%s/keel-audit-XXXXXX", t && *t ? t : "/tmp");
        if (!mkdtemp(tmp)) rc = keel_err_set(err, KEEL_E_IO, "temp dir %s: %s", tmp, strerror(errno));
    }
    if (rc == KEEL_OK) {
        int n_jobs = n_src * n_chips, par = o->jobs > 0 ? o->jobs : (int)sysconf(_SC_NPROCESSORS_ONLN);
        jobs = keel_xcalloc((size_t)n_jobs, sizeof *jobs);
        /* longest first, so no long compile starts last with the other cores idle: sources as kernel_sources ordered
         * them, each one's gfx chips (hipcc, slower) before its sm chips */
        int next = 0;
        for (int s = 0; s < n_src; s++)
            for (int nv = 0; nv < 2; nv++)
                for (int c = 0; c < n_chips; c++) {
                    if (is_nv(chips[c]) != (nv == 1)) continue;
                    job *j = &jobs[next++];
                    memcpy(j->chip, chips[c], sizeof j->chip);
                    snprintf(j->source, sizeof j->source, "%s", sources[s]);
                }
        run_jobs(jobs, n_jobs, par < 1 ? 1 : par, src, tmp);
        for (int i = 0; i < n_jobs; i++) {
            char *text = NULL;
            keel_read_file(jobs[i].log, &text, NULL, NULL);
            if (jobs[i].status != 0) {
                const char *tail = text ? text : "";
                if (strlen(tail) > 1500) tail += strlen(tail) - 1500;
                fprintf(o->print_records ? stderr : out, "LIMIT %s %s compile: the pinned compiler failed (status %d):\n%s\n", jobs[i].chip,
                        jobs[i].source, jobs[i].status, tail);
                (*problems)++;
            } else if (text) {
                if (is_nv(jobs[i].chip)) parse_nv(text, jobs[i].chip, &got);
                else parse_hip(text, jobs[i].chip, &got);
            }
            free(text);
        }
        qsort(got.items, (size_t)got.n, sizeof *got.items, cmp_rec);
    }

    FILE *lim = o->print_records ? stderr : out; /* RECORD lines alone on out when printing them */
    /* checks, chip by chip */
    int n_kernels = 0;
    for (int c = 0; rc == KEEL_OK && c < n_chips; c++) {
        const char *chip = chips[c], *ver = is_nv(chip) ? nv_ver : hip_ver;
        const char *rec_ver = keel_audit_records_compiler(&recs, chip);
        if (o->print_records) fprintf(out, "COMPILER %s %s\n", chip, ver);
        bool compare = !o->print_records;
        if (compare && !rec_ver) {
            fprintf(lim, "LIMIT %s - records: no records for this chip in %s\n", chip, rdir);
            (*problems)++;
            compare = false;
        } else if (compare && strcmp(rec_ver, ver)) {
            fprintf(lim, "LIMIT %s - compiler: recorded with '%s', this is '%s'%s\n", chip, rec_ver, ver,
                    o->any_compiler ? " (compared anyway: --any-compiler)" : " (install the pinned one, or --any-compiler)");
            if (!o->any_compiler) {
                (*problems)++;
                compare = false;
            }
        }
        for (int i = 0; i < got.n; i++) {
            keel_audit_record *g = &got.items[i];
            if (strcmp(g->chip, chip)) continue;
            const keel_audit_kernel *k = keel_audit_kernel_find(g->kernel);
            if (k && k->control && !o->source) continue;
            n_kernels++;
            if (k) {
                keel_audit_record_set(g, "block", k->block);
                keel_audit_record_set(g, "dsmem", keel_audit_dsmem(k, chip, keel_audit_record_get(g, "regs"),
                                                                   keel_audit_record_get(g, "smem")));
            }
            if (o->print_records) print_record(out, g);
            *problems += keel_audit_limits(g, k, &finds, lim);
            if (!compare) continue;
            const keel_audit_record *r = keel_audit_records_find(&recs, chip, g->kernel);
            if (!r) {
                fprintf(lim, "LIMIT %s %s record: compiled, but not recorded\n", chip, g->kernel);
                (*problems)++;
            } else {
                *problems += keel_audit_compare(r, g, lim);
            }
        }
        for (int i = 0; compare && !o->source && i < recs.n; i++) { /* one source: the others' records stay */
            const keel_audit_record *r = &recs.items[i];
            bool seen = false;
            for (int j = 0; j < got.n && !seen; j++) seen = !strcmp(got.items[j].chip, chip) && !strcmp(got.items[j].kernel, r->kernel);
            if (!strcmp(r->chip, chip) && !seen) {
                fprintf(lim, "LIMIT %s %s record: recorded (line %d), but no such kernel was compiled\n", chip,
                        r->kernel, r->line);
                (*problems)++;
            }
        }
    }
    if (rc == KEEL_OK && !o->print_records && !o->source) *problems += keel_audit_findings_check(&recs, &finds, lim);
    if (rc == KEEL_OK)
        fprintf(o->print_records ? stderr : out, "AUDIT %d chips, %d kernel records: %d limit problems\n", n_chips,
                n_kernels, *problems);
    if (tmp[0] && rc == KEEL_OK) rm_tree(tmp);
    free(jobs);
    free(sources);
    keel_audit_records_free(&got);
    keel_audit_records_free(&recs);
    keel_audit_findings_free(&finds);
    return rc;
}
