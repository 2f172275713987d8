/* Every kernel keel launches is registered with the contract: scans src/ for launch sites and checks each against
 * the tables (docs/kernel-contract.md, "Launch sites"). Launch entry points: keel_cpu_matmul (per epilogue used,
 * every width, group, dtype and code path must be registered), keel_cpu_relu2, every CUDA launcher (a function
 * of src/kernels/cuda/cuda.h with a `void *stream` parameter), and every CUDA engine launcher (a KEEL_ECU_FN function
 * defined in src/engine/cuda/kernels.cu whose body launches with `<<<` or port.h's KP_LAUNCH). Both kinds of launch
 * may appear only inside those kernel files, behind their launchers. A kernel's own file or folder (definitions, benches) is not a
 * launch site. */
#define _DEFAULT_SOURCE
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "contract/contract.h"
#include "contract/engine_regs_cuda.h"
#include "common/testkit.h"

#define MAX_LAUNCHERS 64
#define ENGINE_KERNELS "src/engine/cuda/" /* the CUDA engine's kernel files: its .cu files */

typedef struct scan {
    const keel_contract_table *t;
    char launchers[MAX_LAUNCHERS][64];
    int n_launchers;
    int sites, unregistered;
    char report[4096];
    const char *const *cuda_entries;   /* the CUDA table's entry points (keel_contract_cuda_entries) */
    const char *const *engine_entries[3]; /* the CUDA engine tables' (engine, attention, scan entries) */
} scan;

static void note(scan *s, const char *fmt, ...) {
    const size_t used = strlen(s->report);
    va_list ap;
    va_start(ap, fmt);
    if (used + 1 < sizeof s->report) vsnprintf(s->report + used, sizeof s->report - used, fmt, ap);
    va_end(ap);
}

/* Blanks comments and string literals (keeping newlines) so only code is scanned. */
static void strip(char *p) {
    while (*p) {
        if (p[0] == '/' && p[1] == '/') {
            while (*p && *p != '\n') *p++ = ' ';
        } else if (p[0] == '/' && p[1] == '*') {
            *p++ = ' ', *p++ = ' ';
            for (; *p && !(p[0] == '*' && p[1] == '/'); p++)
                if (*p != '\n') *p = ' ';
            if (*p) *p++ = ' ', *p++ = ' ';
        } else if (*p == '"' || *p == '\'') {
            const char q = *p++;
            for (; *p && *p != q; p++) {
                if (*p == '\\' && p[1]) *p++ = ' ';
                if (*p != '\n') *p = ' ';
            }
            if (*p) p++;
        } else {
            p++;
        }
    }
}

static bool ident(char c) { return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }

/* The launchers of cuda.h: declarations "void keel_cuda_<x>(... void *stream ...);". */
static void read_launchers(scan *s, char *header) {
    strip(header);
    for (char *p = header; (p = strstr(p, "keel_cuda_")) != NULL; p++) {
        if (p > header && ident(p[-1])) continue;
        size_t len = 0;
        while (ident(p[len])) len++;
        const char *q = p + len;
        while (*q == ' ') q++;
        if (*q != '(') continue;
        const char *end = strchr(q, ';');
        if (!end) continue;
        char args[1024];
        snprintf(args, sizeof args, "%.*s", (int)(end - q), q);
        if (strstr(args, "void *stream") && s->n_launchers < MAX_LAUNCHERS && len < 64)
            snprintf(s->launchers[s->n_launchers++], 64, "%.*s", (int)len, p);
    }
}

/* The CUDA engine's launchers: functions defined in its kernel files as KEEL_<X>_FN(name)(...) { ... } (named
 * keel_ecu_<name> in the real build) whose body holds a <<< launch. */
static void read_engine_launchers(scan *s, char *text) {
    strip(text);
    for (char *p = text; (p = strstr(p, "_FN(")) != NULL; p++) {
        char *st = p;
        while (st > text && ident(st[-1])) st--;
        if (strncmp(st, "KEEL_", 5) != 0) continue;
        bool upper = true;
        for (char *q = st; q < p; q++) upper &= (*q >= 'A' && *q <= 'Z') || *q == '_';
        if (!upper) continue;
        char *nm = p + 4;
        size_t len = 0;
        while (ident(nm[len])) len++;
        char *q = nm + len;
        if (*q != ')') continue; /* the macro's own definition */
        q++;
        while (*q == ' ' || *q == '\n') q++;
        if (*q != '(') continue;
        int depth = 0;
        char *e = q;
        do depth += (*e == '(') - (*e == ')');
        while (depth > 0 && *++e);
        if (!*e) break;
        char *b = e + 1;
        while (*b == ' ' || *b == '\n') b++;
        if (*b != '{') continue; /* a declaration, not a definition */
        char *end = b;
        depth = 0;
        do depth += (*end == '{') - (*end == '}');
        while (depth > 0 && *++end);
        const char save = *end;
        *end = 0;
        const bool launches = strstr(b, "<<<") != NULL || strstr(b, "KP_LAUNCH(") != NULL;
        *end = save;
        if (launches && s->n_launchers < MAX_LAUNCHERS && len < 50)
            snprintf(s->launchers[s->n_launchers++], 64, "keel_ecu_%.*s", (int)len, nm);
        p = end;
        if (!*p) break;
    }
}

static bool cpu_matmul_registered(const scan *s, keel_epilogue epi, const char *path) {
    const int bits[] = {0, 2, 3, 4, 5, 6, 8}, groups[] = {32, 64, 128};
    const keel_dtype sdts[] = {KEEL_DT_BF16, KEEL_DT_F16, KEEL_DT_F32};
    for (int b = 0; b < 7; b++)
        for (int g = 0; g < (bits[b] ? 3 : 1); g++)
            for (int d = 0; d < 3; d++) {
                bool found = false;
                for (int i = 0; i < s->t->n && !found; i++) {
                    const keel_contract_reg *r = &s->t->regs[i];
                    found = strcmp(r->entry, "keel_cpu_matmul") == 0 && strcmp(r->path, path) == 0 && r->epi == epi &&
                            r->bits == bits[b] && (bits[b] == 0 || r->group == groups[g]) && r->sdt == sdts[d] &&
                            r->n_controls > 0;
                }
                if (!found) return false;
            }
    return true;
}

static bool entry_registered(const scan *s, const char *backend, const char *entry) {
    for (int i = 0; i < s->t->n; i++)
        if (strcmp(s->t->regs[i].be->name, backend) == 0 && strcmp(s->t->regs[i].entry, entry) == 0) return true;
    if (strcmp(backend, "cuda") == 0) {
        for (int i = 0; s->cuda_entries[i]; i++)
            if (strcmp(s->cuda_entries[i], entry) == 0) return true;
        for (int t = 0; t < 3; t++)
            for (int i = 0; s->engine_entries[t] && s->engine_entries[t][i]; i++)
                if (strcmp(s->engine_entries[t][i], entry) == 0) return true;
    }
    return false;
}

static int line_of(const char *text, const char *p) {
    int l = 1;
    for (const char *q = text; q < p; q++) l += *q == '\n';
    return l;
}

/* Checks one file's launch sites (text is modified). `rel` is its path under the repository root. */
static void scan_text(scan *s, const char *rel, char *text) {
    strip(text);
    const bool cpu_dir = strncmp(rel, "src/kernels/cpu/", 16) == 0;
    const size_t el = strlen(rel);
    const bool cuda_dir = strncmp(rel, "src/kernels/cuda/", 17) == 0 ||
                          (strncmp(rel, ENGINE_KERNELS, strlen(ENGINE_KERNELS)) == 0 && el > 3 && !strcmp(rel + el - 3, ".cu"));
    const bool host_avx2 = strcmp(keel_contract_cpu_backend()->chip, "cpu-avx2") == 0;
    if (!cuda_dir)
        for (int k = 0; k < 2; k++) { /* a <<< launch or port.h's launch macro */
            const char *how = k ? "KP_LAUNCH(" : "<<<";
            for (char *p = text; (p = strstr(p, how)) != NULL; p += strlen(how)) {
                s->sites++, s->unregistered++;
                note(s, "%s:%d: a %s launch outside src/kernels/cuda (launch kernels through a registered launcher)\n",
                     rel, line_of(text, p), k ? "KP_LAUNCH" : "<<<");
            }
        }
    for (char *p = text; *p; p++) {
        if (!(p[0] == 'k' && strncmp(p, "keel_", 5) == 0) || (p > text && ident(p[-1]))) continue;
        size_t len = 0;
        while (ident(p[len])) len++;
        char *q = p + len;
        while (*q == ' ' || *q == '\n') q++;
        if (*q != '(') continue;
        char name[64];
        snprintf(name, sizeof name, "%.*s", (int)KEEL_MIN(len, 63), p);
        const char *b = p; /* a definition or declaration has a type just before the name */
        while (b > text && b[-1] == ' ') b--;
        if (b - text >= 4 && strncmp(b - 4, "void", 4) == 0) continue;
        int depth = 0;
        char *e = q;
        do depth += (*e == '(') - (*e == ')');
        while (depth > 0 && *++e);
        const int line = line_of(text, p);
        if (strcmp(name, "keel_cpu_matmul") == 0 && !cpu_dir) {
            s->sites++;
            bool epis[2] = {false, false}, any = false;
            for (char *k = q; k < e; k++)
                if (strncmp(k, "KEEL_EPI_NONE", 13) == 0) epis[0] = any = true;
                else if (strncmp(k, "KEEL_EPI_RELU2", 14) == 0) epis[1] = any = true;
            if (!any) epis[0] = epis[1] = true; /* an epilogue chosen at run time needs both */
            for (int ep = 0; ep < 2; ep++)
                for (int pa = host_avx2 ? 0 : 1; pa < 2; pa++)
                    if (epis[ep] && !cpu_matmul_registered(s, (keel_epilogue)ep, pa ? "portable" : "avx2")) {
                        s->unregistered++;
                        note(s, "%s:%d: keel_cpu_matmul with %s on the %s path is not registered for every width, "
                                "group and dtype\n", rel, line, ep ? "relu2" : "no epilogue", pa ? "portable" : "avx2");
                    }
        } else if (strcmp(name, "keel_cpu_relu2") == 0 && !cpu_dir) {
            s->sites++;
            if (!entry_registered(s, "cpu", name)) {
                s->unregistered++;
                note(s, "%s:%d: keel_cpu_relu2 is not registered\n", rel, line);
            }
        } else if (!cuda_dir) {
            for (int i = 0; i < s->n_launchers; i++)
                if (strcmp(name, s->launchers[i]) == 0) {
                    s->sites++;
                    if (!entry_registered(s, "cuda", name)) {
                        s->unregistered++;
                        note(s, "%s:%d: CUDA launcher %s is launched but not registered\n", rel, line, name);
                    }
                }
        }
        p = q;
    }
}

static void scan_dir(scan *s, const char *root, const char *rel) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    DIR *d = opendir(path);
    if (!d) fail_msg("cannot open %s", path);
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        char sub[768], full[1024];
        snprintf(sub, sizeof sub, "%s/%s", rel, de->d_name);
        snprintf(full, sizeof full, "%s/%s", root, sub);
        struct stat st;
        if (stat(full, &st) != 0) continue;
        if (S_ISDIR(st.st_mode)) {
            scan_dir(s, root, sub);
            continue;
        }
        const char *dot = strrchr(de->d_name, '.');
        if (!dot || !(strcmp(dot, ".c") == 0 || strcmp(dot, ".h") == 0 || strcmp(dot, ".cu") == 0 ||
                      strcmp(dot, ".cuh") == 0))
            continue;
        char *text = tk_read_text(full);
        scan_text(s, sub, text);
        free(text);
    }
    closedir(d);
}

static void init_scan(scan *s, const keel_contract_table *t) {
    memset(s, 0, sizeof *s);
    s->t = t;
    s->cuda_entries = keel_contract_cuda_entries;
    s->engine_entries[0] = keel_contract_cuda_engine_entries;
    s->engine_entries[1] = keel_contract_cuda_attn_entries;
    s->engine_entries[2] = keel_contract_cuda_scan_entries;
    char path[1024];
    snprintf(path, sizeof path, "%s/src/kernels/cuda/cuda.h", tk_src());
    char *h = tk_read_text(path);
    read_launchers(s, h);
    free(h);
    snprintf(path, sizeof path, "%s/%s", tk_src(), ENGINE_KERNELS);
    DIR *d = opendir(path);
    if (!d) fail_msg("cannot open %s", path);
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        const size_t l = strlen(de->d_name);
        if (l < 4 || strcmp(de->d_name + l - 3, ".cu")) continue;
        char full[sizeof path + 260]; /* the folder, a slash and any file name */
        snprintf(full, sizeof full, "%s/%s", path, de->d_name);
        char *k = tk_read_text(full);
        read_engine_launchers(s, k);
        free(k);
    }
    closedir(d);
}

static void test_source_tree_launches_are_registered(void **state) {
    (void)state;
    keel_contract_table t;
    keel_contract_table_init(&t);
    keel_contract_register_cpu(&t);
    keel_contract_register_cuda(&t);
    scan s;
    init_scan(&s, &t);
    assert_true(s.n_launchers >= 1); /* keel_cuda_stream_matmul at least: the header parse works */
    bool engine_parsed = false; /* the engine kernel file's parse works */
    for (int i = 0; i < s.n_launchers; i++) engine_parsed = engine_parsed || !strcmp(s.launchers[i], "keel_ecu_ssm");
    assert_true(engine_parsed);
    scan_dir(&s, tk_src(), "src");
    if (s.unregistered) fail_msg("%d of %d launch sites are not registered:\n%s", s.unregistered, s.sites, s.report);
    assert_true(s.sites >= 10); /* the engine's matmuls: the scan found them */
    keel_contract_table_free(&t);
}

/* The rule catches what it should: crafted sources with unregistered launches. */
static void test_scan_catches_unregistered(void **state) {
    (void)state;
    keel_contract_table t;
    keel_contract_table_init(&t);
    keel_contract_register_cpu(&t);
    scan s;
    init_scan(&s, &t);
    char ok[] = "/* keel_cuda_stream_matmul(&W) in a comment */ static void f(void) {\n"
                "  const char *s = \"keel_cuda_relu2(y)\";\n  keel_cpu_matmul(&w->up, x, m, y, KEEL_EPI_RELU2);\n}\n";
    scan_text(&s, "src/engine/x.c", ok);
    assert_int_equal(s.sites, 1);
    assert_int_equal(s.unregistered, 0);

    static const char *const no_cuda_entries[] = {NULL}; /* as if the CUDA tables registered nothing */
    s.cuda_entries = no_cuda_entries;
    s.engine_entries[0] = s.engine_entries[1] = s.engine_entries[2] = no_cuda_entries;
    char cuda[] = "void g(void) {\n  keel_cuda_stream_matmul(&W, x, KEEL_DT_BF16, m, y, KEEL_DT_F32, KEEL_EPI_NONE, 0);\n"
                  "  k_tile<<<grid, 128>>>(a);\n  KP_LAUNCH(1, k_tile, grid, 128, 0, st, a);\n}\n";
    scan_text(&s, "src/engine/cuda/forward.c", cuda);
    assert_int_equal(s.unregistered, 3);
    assert_non_null(strstr(s.report, "src/engine/cuda/forward.c:2: CUDA launcher keel_cuda_stream_matmul"));
    assert_non_null(strstr(s.report, "src/engine/cuda/forward.c:3: a <<< launch outside src/kernels/cuda"));
    assert_non_null(strstr(s.report, "src/engine/cuda/forward.c:4: a KP_LAUNCH launch outside src/kernels/cuda"));
    char eng[] = "void h(void) {\n  keel_ecu_rmsnorm(x, n, &w, m, n, eps, y, NULL, n, st);\n}\n";
    scan_text(&s, "src/engine/cuda/engine_cuda.c", eng);
    assert_int_equal(s.unregistered, 4); /* an engine launcher is a launch site too */
    assert_non_null(strstr(s.report, "engine_cuda.c:2: CUDA launcher keel_ecu_rmsnorm"));

    /* A table that lost the fused relu2 registrations: a relu2 launch site is unregistered, a plain one is not. */
    keel_contract_table part;
    keel_contract_table_init(&part);
    for (int i = 0; i < t.n; i++)
        if (t.regs[i].epi != KEEL_EPI_RELU2) *keel_contract_table_add(&part) = t.regs[i];
    scan p;
    init_scan(&p, &part);
    char fused[] = "void h(void) { keel_cpu_matmul(W, x, m, y, KEEL_EPI_NONE); keel_cpu_matmul(W, x, m, y, epi); }";
    scan_text(&p, "src/engine/moe.c", fused);
    assert_int_equal(p.sites, 2);
    assert_true(p.unregistered >= 1);
    assert_non_null(strstr(p.report, "keel_cpu_matmul with relu2"));
    keel_contract_table_free(&part);
    keel_contract_table_free(&t);
}

/* The CUDA table's entry list names only real launchers of cuda.h, and in a CUDA build each of them has
 * registrations with controls in the table (the list is what launch sites are checked against in every build). */
static void test_cuda_entries_are_launchers_and_registered(void **state) {
    (void)state;
    keel_contract_table t;
    keel_contract_table_init(&t);
    keel_contract_register_cuda(&t);
    scan s;
    init_scan(&s, &t);
    for (int i = 0; keel_contract_cuda_entries[i]; i++) {
        const char *e = keel_contract_cuda_entries[i];
        bool launcher = false;
        for (int l = 0; l < s.n_launchers; l++) launcher = launcher || strcmp(s.launchers[l], e) == 0;
        if (!launcher) fail_msg("keel_contract_cuda_entries names %s, which is not a launcher of cuda.h", e);
        int with_controls = 0;
        for (int r = 0; r < t.n; r++)
            with_controls += strcmp(t.regs[r].entry, e) == 0 && t.regs[r].n_controls > 0;
        if (t.n > 0 && with_controls == 0)
            fail_msg("%s is listed as registered but the CUDA table has no registration of it with a control", e);
    }
    const int n_stream = t.n;
    keel_contract_register_cuda_engine(&t);
    keel_contract_register_cuda_attn(&t);
    keel_contract_register_cuda_scan(&t);
    for (int tb = 0; tb < 3; tb++) {
        for (int j = 0; s.engine_entries[tb][j]; j++) {
            const char *e = s.engine_entries[tb][j];
            bool launcher = false;
            for (int l = 0; l < s.n_launchers; l++) launcher = launcher || strcmp(s.launchers[l], e) == 0;
            if (!launcher) fail_msg("keel_contract_cuda_engine_entries names %s, which launches no kernel", e);
            int with_controls = 0;
            for (int r = n_stream; r < t.n; r++)
                with_controls += strcmp(t.regs[r].entry, e) == 0 && t.regs[r].n_controls > 0;
            if (t.n > n_stream && with_controls == 0)
                fail_msg("%s is listed as registered but the engine table has no registration of it with a control", e);
        }
    }
#if defined(KEEL_HAVE_CUDA)
    assert_true(n_stream > 0); /* the table is built without touching a device */
#endif
    keel_contract_table_free(&t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_entries_are_launchers_and_registered),
        cmocka_unit_test(test_source_tree_launches_are_registered),
        cmocka_unit_test(test_scan_catches_unregistered),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
