/* Gate 5 on the host: records and findings parsing (every error path), the findings list held to the records in
 * the repository, limit checks, record comparison, and the live check (its comparison, kernel lookup and SUMMARY
 * count) on crafted attributes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <cmocka.h>

#include "contract/audit.h"
#include "kernels/cuda/cuda.h"
#include "format/format.h"
#include "common/testkit.h"

#if defined(KEEL_HAVE_CUDA)
/* keelcore and keelcuda are static libraries linked once each, in that order: naming keel_dtype_name here pulls
 * format/dtype.c in before stream.cu.o (reached through keel_audit_live_fn) needs it for its error messages. */
const char *(*const keel_test_audit_dtype_name)(keel_dtype) = keel_dtype_name;
#endif

/* Runs fn-printed output into a string for matching. */
static char *capture_buf;
static size_t capture_len;
static FILE *cap_open(void) { return open_memstream(&capture_buf, &capture_len); }
static void cap_close(FILE *f) { fclose(f); }

static const char good[] = "# c\nCOMPILER sm_90 Cuda compilation tools, release 13.0, V13.0.88\n"
                           "RECORD sm_90 k<1,false> regs=40 spill_st=0 spill_ld=0 stack=0 smem=0 block=256 dsmem=8192\n";

static void test_records_parse(void **st) {
    (void)st;
    keel_audit_records r;
    keel_audit_records_init(&r);
    keel_err err = {0};
    assert_int_equal(keel_audit_records_parse(&r, good, "f", &err), KEEL_OK);
    const keel_audit_record *rec = keel_audit_records_find(&r, "sm_90", "k<1,false>");
    assert_non_null(rec);
    assert_int_equal(keel_audit_record_get(rec, "regs"), 40);
    assert_int_equal(keel_audit_record_get(rec, "dsmem"), 8192);
    assert_int_equal(keel_audit_record_get(rec, "nope"), -1);
    assert_string_equal(keel_audit_records_compiler(&r, "sm_90"), "Cuda compilation tools, release 13.0, V13.0.88");
    keel_audit_records_free(&r);
    keel_audit_records_free(NULL);
}

static void expect_bad(const char *text, const char *needle) {
    keel_audit_records r;
    keel_audit_records_init(&r);
    keel_err err = {0};
    assert_int_equal(keel_audit_records_parse(&r, text, "recs", &err), KEEL_E_FORMAT);
    if (!strstr(err.msg, needle)) fail_msg("reason '%s' lacks '%s'", err.msg, needle);
    keel_audit_records_free(&r);
}

static void test_records_errors(void **st) {
    (void)st;
    expect_bad("RECORD sm_90 k regs=1\n", "before the COMPILER");
    expect_bad("# only\n", "no COMPILER line");
    expect_bad("COMPILER sm_90\n", "expected 'COMPILER");
    expect_bad("COMPILER sm_90 v\nCOMPILER sm_80 v\n", "second COMPILER");
    expect_bad("COMPILER sm_90 v\nRECORD sm_80 k regs=1\n", "chip sm_80 in the file of chip sm_90");
    expect_bad("COMPILER sm_90 v\nRECORD sm_90 k regs=1\nRECORD sm_90 k regs=2\n", "second record of k");
    expect_bad("COMPILER sm_90 v\nRECORD sm_90 k regs=-1\n", "field 'regs=-1'");
    expect_bad("COMPILER sm_90 v\nRECORD sm_90 k regs\n", "expected name=count");
    expect_bad("COMPILER sm_90 v\nRECORD sm_90 k regs=1 regs=2\n", "regs given twice");
    expect_bad("COMPILER sm_90 v\nRECORD sm_90 k\n", "has no fields");
    expect_bad("COMPILER sm_90 v\nRECORD sm_90\n", "expected 'RECORD");
    expect_bad("COMPILER sm_90 v\nBOGUS x\n", "found 'BOGUS'");
    /* the same chip in two files */
    keel_audit_records r;
    keel_audit_records_init(&r);
    keel_err err = {0};
    assert_int_equal(keel_audit_records_parse(&r, good, "a", &err), KEEL_OK);
    assert_int_equal(keel_audit_records_parse(&r, good, "b", &err), KEEL_E_FORMAT);
    assert_non_null(strstr(err.msg, "another file"));
    keel_audit_records_free(&r);
}

static void test_findings_parse(void **st) {
    (void)st;
    keel_audit_findings f = {0};
    keel_err err = {0};
    assert_int_equal(keel_audit_findings_parse(&f, "# c\ncpu/x 3 other gate\nsm_90/k<1,false> 5 spills\n", "kf", &err),
                     KEEL_OK);
    assert_int_equal(f.n, 1);
    assert_true(keel_audit_findings_has(&f, "sm_90", "k<1,false>"));
    assert_false(keel_audit_findings_has(&f, "sm_80", "k<1,false>"));
    keel_audit_findings_free(&f);
    keel_audit_findings_free(NULL);
    const char *bad[][2] = {{"sm_90/k 7 why\n", "gate 1-5"}, {"sm_90/k 5\n", "gate 1-5"},
                            {"k 5 no chip\n", "expected <chip>/<kernel>"}, {"a/k 5 x\na/k 5 y\n", "listed twice"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        keel_audit_findings g = {0};
        assert_int_equal(keel_audit_findings_parse(&g, bad[i][0], "kf", &err), KEEL_E_FORMAT);
        if (!strstr(err.msg, bad[i][1])) fail_msg("'%s' lacks '%s'", err.msg, bad[i][1]);
        keel_audit_findings_free(&g);
    }
}

/* The repository's findings list matches its records: both directions. */
static void test_repo_findings_match_records(void **st) {
    (void)st;
    char rdir[1024], fpath[1024];
    snprintf(rdir, sizeof rdir, "%s/contract/records", tk_src());
    snprintf(fpath, sizeof fpath, "%s/contract/known_findings_gate5", tk_src());
    keel_audit_records r;
    keel_audit_records_init(&r);
    keel_audit_findings f = {0};
    keel_err err = {0};
    if (keel_audit_records_load(&r, rdir, &err) != KEEL_OK) fail_msg("%s", err.msg);
    if (keel_audit_findings_load(&f, fpath, &err) != KEEL_OK) fail_msg("%s", err.msg);
    assert_true(r.n > 0);
    FILE *o = cap_open();
    int p = keel_audit_findings_check(&r, &f, o);
    cap_close(o);
    if (p) fail_msg("%s", capture_buf);
    free(capture_buf);
    /* every record's kernel has a launch declaration, and its block/dsmem agree with it */
    for (int i = 0; i < r.n; i++) {
        const keel_audit_kernel *k = keel_audit_kernel_find(r.items[i].kernel);
        if (!k) fail_msg("%s %s: no launch declaration", r.items[i].chip, r.items[i].kernel);
        assert_int_equal(keel_audit_record_get(&r.items[i], "block"), k->block);
        assert_int_equal(keel_audit_record_get(&r.items[i], "dsmem"),
                         keel_audit_dsmem(k, r.items[i].chip, keel_audit_record_get(&r.items[i], "regs"),
                                          keel_audit_record_get(&r.items[i], "smem")));
    }
    keel_audit_records_free(&r);
    keel_audit_findings_free(&f);
}

/* The packed tiles' dynamic shared memory follows the chip: the largest KiB step of x budget keeping the blocks an SM
 * that 48 KB gives (hand-computed here), the default budget's off NVIDIA; a fixed declaration is itself. */
static void test_dsmem_xbudget(void **st) {
    (void)st;
    keel_audit_kernel k = {"k", "x.cu", 256, KEEL_AUDIT_DSMEM_XBUDGET, 2, 1, false};
    /* 128 regs x 256 threads: 2 blocks; 2 x (cap + 1024) <= 233472 -> cap <= 115712 -> 106 KiB, cap 115328 */
    assert_int_equal(keel_audit_dsmem(&k, "sm_90", 128, 0), 106 * 1024 + 106 * 1024 / 16);
    /* sm_80: 2 x (cap + 1024) <= 167936 -> cap <= 82944 -> 76 KiB */
    assert_int_equal(keel_audit_dsmem(&k, "sm_80", 128, 0), 76 * 1024 + 76 * 1024 / 16);
    /* 152 regs: 1 block by registers on sm_86, so one block's most: cap <= 101376 -> 93 KiB */
    assert_int_equal(keel_audit_dsmem(&k, "sm_86", 152, 0), 93 * 1024 + 93 * 1024 / 16);
    /* 64 regs: 4 blocks by registers, 48 KB gives 4 on sm_90: 4 x (cap + 1024) <= 233472 -> cap <= 57344 -> 52 KiB */
    assert_int_equal(keel_audit_dsmem(&k, "sm_90", 64, 0), 52 * 1024 + 52 * 1024 / 16);
    assert_int_equal(keel_audit_dsmem(&k, "gfx1030", 128, 0), KEEL_CUDA_PACKED_SMEM);
    k.dsmem = 4096;
    assert_int_equal(keel_audit_dsmem(&k, "sm_90", 128, 0), 4096);
}

/* The check itself goes red both ways on crafted lists. */
static void test_findings_check_both_ways(void **st) {
    (void)st;
    keel_audit_records r;
    keel_audit_records_init(&r);
    keel_err err = {0};
    assert_int_equal(keel_audit_records_parse(&r,
                                              "COMPILER sm_90 v\nRECORD sm_90 a regs=1 spill_st=4 stack=0\n"
                                              "RECORD sm_90 b regs=1 spill_st=0 stack=0\n",
                                              "r", &err),
                     KEEL_OK);
    keel_audit_findings none = {0}, stale = {0};
    assert_int_equal(keel_audit_findings_parse(&stale, "sm_90/a 5 x\nsm_90/b 5 y\nsm_90/gone 5 z\n", "f", &err), KEEL_OK);
    FILE *o = cap_open();
    assert_int_equal(keel_audit_findings_check(&r, &none, o), 1);
    cap_close(o);
    assert_non_null(strstr(capture_buf, "LIMIT sm_90 a findings"));
    free(capture_buf);
    o = cap_open();
    assert_int_equal(keel_audit_findings_check(&r, &stale, o), 2);
    cap_close(o);
    assert_non_null(strstr(capture_buf, "LIMIT sm_90 b findings"));
    assert_non_null(strstr(capture_buf, "LIMIT sm_90 gone findings"));
    free(capture_buf);
    keel_audit_findings_free(&stale);
    keel_audit_records_free(&r);
}

static void test_limits_and_compare(void **st) {
    (void)st;
    keel_audit_records r;
    keel_audit_records_init(&r);
    keel_audit_record *a = keel_audit_records_add(&r, "sm_90", "k");
    keel_audit_record_set(a, "regs", 200);
    keel_audit_record_set(a, "spill_st", 0);
    keel_audit_record_set(a, "stack", 0);
    keel_audit_record_set(a, "smem", 0);
    keel_audit_kernel k = {"k", "x.cu", 128, 0, 4, 0, false};
    FILE *o = cap_open();
    /* 200 regs x 128 threads: 6400 per warp -> 10 warps -> 2 blocks < 4 */
    assert_int_equal(keel_audit_limits(a, &k, NULL, o), 1);
    cap_close(o);
    assert_non_null(strstr(capture_buf, "LIMIT sm_90 k regs: 200 registers x 128 threads allow 2 blocks per SM"));
    free(capture_buf);
    keel_audit_record_set(a, "regs", 128); /* 4096 a warp -> 16 warps -> 4 blocks */
    k.dsmem = 30000; /* 4 x (30000 + 1024) fits sm_90's 233472 */
    o = cap_open();
    assert_int_equal(keel_audit_limits(a, &k, NULL, o), 0);
    cap_close(o);
    free(capture_buf);
    keel_audit_record *b = keel_audit_records_add(&r, "sm_86", "k");
    keel_audit_record_set(b, "regs", 64);
    keel_audit_record_set(b, "stack", 16);
    o = cap_open();
    assert_int_equal(keel_audit_limits(b, &k, NULL, o), 2); /* a stack frame, and 4 x 31 KB > 100 KB */
    cap_close(o);
    assert_non_null(strstr(capture_buf, "LIMIT sm_86 k stack: 16"));
    assert_non_null(strstr(capture_buf, "LIMIT sm_86 k smem"));
    free(capture_buf);
    assert_int_equal(keel_audit_limits(b, NULL, NULL, stderr), 1); /* no launch declaration */

    keel_audit_records c;
    keel_audit_records_init(&c);
    keel_audit_record *x = keel_audit_records_add(&c, "sm_90", "k");
    keel_audit_record_set(x, "regs", 127);
    keel_audit_record_set(x, "smem", 0);
    keel_audit_record_set(x, "gone", 1);
    o = cap_open();
    assert_int_equal(keel_audit_compare(x, a, o), 4); /* regs differ; spill_st, stack unrecorded; gone missing */
    cap_close(o);
    assert_non_null(strstr(capture_buf, "LIMIT sm_90 k regs: recorded 127, compiled 128"));
    assert_non_null(strstr(capture_buf, "LIMIT sm_90 k gone: recorded 1"));
    free(capture_buf);
    keel_audit_records_free(&c);
    keel_audit_records_free(&r);
}

static void test_live_compare(void **st) {
    (void)st;
    keel_audit_records r;
    keel_audit_records_init(&r);
    keel_err err = {0};
    assert_int_equal(keel_audit_records_parse(&r, good, "f", &err), KEEL_OK);
    keel_audit_live same = {40, 0, 0, 8192}, off = {41, 16, 0, -1};
    assert_int_equal(keel_audit_live_compare(&r, "sm_90", "k<1,false>", &same, stderr), 0);
    FILE *o = cap_open();
    assert_int_equal(keel_audit_live_compare(&r, "sm_90", "k<1,false>", &off, o), 2);
    assert_int_equal(keel_audit_live_compare(&r, "sm_80", "k<1,false>", &same, o), 1);
    cap_close(o);
    assert_non_null(strstr(capture_buf, "LIMIT sm_90 k<1,false> regs: recorded 40, loaded numRegs 41"));
    assert_non_null(strstr(capture_buf, "LIMIT sm_90 k<1,false> stack: recorded 0, loaded localSizeBytes 16"));
    assert_non_null(strstr(capture_buf, "LIMIT sm_80 k<1,false> live: loaded, but there is no record"));
    free(capture_buf);
    keel_audit_records_free(&r);
}

static void test_symbols_for(void **st) {
    (void)st;
    const char *s[4];
    assert_int_equal(keel_audit_symbols_for(0, 4, true, s, 4), 2);
    assert_string_equal(s[0], "stream_tile<4,true>");
    assert_string_equal(s[1], "stream_finish");
    assert_int_equal(keel_audit_symbols_for(0, 7, false, s, 4), 0);
    assert_int_equal(keel_audit_symbols_for(2, 0, false, s, 4), 1);
    assert_string_equal(s[0], "relu2_kernel");
}

/* The live check's fakes: a kernel's "function pointer" is its symbol string; the attributes read back are its
 * record's on g_chip, with g_bump added to the registers of g_bumped; g_missing resolves to nothing. */
static const keel_audit_records *g_recs;
static const char *g_chip, *g_bumped, *g_missing, *g_unreadable;
static int g_bump;

static const void *fake_lookup(const char *symbol) {
    if (g_missing && !strcmp(symbol, g_missing)) return NULL;
    const keel_audit_kernel *k = keel_audit_kernel_find(symbol);
    return k ? k->symbol : NULL;
}

static bool fake_attrs(const void *fn, keel_audit_live *out, char *why, size_t cap) {
    const char *sym = fn;
    if (g_unreadable && !strcmp(sym, g_unreadable)) {
        snprintf(why, cap, "invalid device function");
        return false;
    }
    const keel_audit_record *r = keel_audit_records_find(g_recs, g_chip, sym);
    if (!r) { /* a kernel the chip's records lack: attributes that cannot match */
        *out = (keel_audit_live){1, 0, 0, -1};
        return true;
    }
    out->regs = (int)keel_audit_record_get(r, "regs") + (g_bumped && !strcmp(sym, g_bumped) ? g_bump : 0);
    out->local = (int)keel_audit_record_get(r, "stack");
    out->smem = (int)keel_audit_record_get(r, "smem");
    out->dsmem_max = (int)keel_audit_record_get(r, "dsmem");
    return true;
}

/* Every non-control kernel of the launch table has a record on every recorded CUDA chip that the live comparison
 * accepts; one register more, a kernel no lookup knows, unreadable attributes and a chip without records are each
 * one limit problem naming it. */
static void test_live_check(void **st) {
    (void)st;
    char rdir[1024];
    snprintf(rdir, sizeof rdir, "%s/contract/records", tk_src());
    keel_audit_records r;
    keel_audit_records_init(&r);
    keel_err err = {0};
    if (keel_audit_records_load(&r, rdir, &err) != KEEL_OK) fail_msg("%s", err.msg);
    g_recs = &r;
    int n_nv = 0;
    for (int c = 0; c < r.n_chips; c++) {
        if (strncmp(r.chip[c], "sm_", 3)) continue; /* the live check reads CUDA attributes */
        n_nv++;
        g_chip = r.chip[c];
        g_bumped = g_missing = g_unreadable = NULL;
        FILE *o = cap_open();
        int p = keel_audit_live_check(&r, rdir, g_chip, fake_lookup, fake_attrs, o);
        cap_close(o);
        if (p) fail_msg("%s: %s", g_chip, capture_buf);
        free(capture_buf);
    }
    assert_true(n_nv >= 6);
    g_chip = "sm_90";
    g_bumped = "matvec_kernel", g_bump = 8, g_missing = "route_kernel", g_unreadable = "stream_tile<4,false>";
    FILE *o = cap_open();
    assert_int_equal(keel_audit_live_check(&r, rdir, "sm_90", fake_lookup, fake_attrs, o), 3);
    assert_int_equal(keel_audit_live_check(&r, rdir, "sm_75", fake_lookup, fake_attrs, o), 1);
    assert_int_equal(keel_audit_live_check(NULL, "/x/sm_90", "sm_90", fake_lookup, fake_attrs, o), 1);
    cap_close(o);
    assert_non_null(strstr(capture_buf, "LIMIT sm_90 matvec_kernel regs: recorded "));
    assert_non_null(strstr(capture_buf, "LIMIT sm_90 route_kernel live: the launch table lists it, but no kernel"));
    assert_non_null(strstr(capture_buf, "LIMIT sm_90 stream_tile<4,false> live: attributes unreadable: invalid"));
    assert_non_null(strstr(capture_buf, "LIMIT sm_75 - records: no records for this chip"));
    assert_non_null(strstr(capture_buf, "LIMIT sm_90 - records: no records for this chip in /x/sm_90"));
    assert_null(strstr(capture_buf, "gate5_local_array")); /* the planted twin is not a loaded kernel */
    free(capture_buf);
    keel_audit_records_free(&r);
}

/* In a CUDA build every non-control kernel of the launch table resolves to its own host function pointer through
 * keel_cuda_kernel_fn / keel_ecu_kernel_fn (no device needed to take a kernel's address). */
static void test_live_symbols(void **st) {
    (void)st;
#if defined(KEEL_HAVE_CUDA)
    int n;
    const keel_audit_kernel *k = keel_audit_kernels(&n);
    const void *seen[128];
    int n_seen = 0, n_engine = 0;
    for (int i = 0; i < n; i++) {
        if (k[i].control) {
            assert_null(keel_audit_live_fn(k[i].symbol));
            continue;
        }
        const void *fn = keel_audit_live_fn(k[i].symbol);
        if (!fn) fail_msg("%s: no kernel lookup knows it", k[i].symbol);
        for (int j = 0; j < n_seen; j++)
            if (seen[j] == fn) fail_msg("%s: the same function as another table entry", k[i].symbol);
        assert_true(n_seen < 128);
        seen[n_seen++] = fn;
        n_engine += strstr(k[i].source, "src/engine/cuda/") != NULL;
    }
    assert_int_equal(n_engine, 23); /* kernels.cu 16, attn.cu 5 (three tile widths), scan.cu 1, sample.cu 1 */
    assert_null(keel_audit_live_fn("no_such_kernel"));
    assert_null(keel_audit_live_fn(NULL));
#else
    skip();
#endif
}

static void test_summary_add(void **st) {
    (void)st;
    char buf[512];
    const char *line = "SUMMARY sm_90 602 kernels: 602 pass gates 1-4, 0 fail, 0 known findings; 40 controls: 40 red "
                       "as planted, 0 missed; 2 limit problems";
    assert_true(keel_audit_summary_add(line, "sm_90", 3, buf, sizeof buf));
    assert_non_null(strstr(buf, "40 red as planted, 0 missed; 5 limit problems"));
    assert_int_equal(strncmp(buf, line, strlen(line) - strlen("2 limit problems")), 0);
    assert_false(keel_audit_summary_add(line, "sm_9", 3, buf, sizeof buf));
    assert_false(keel_audit_summary_add(line, "sm_80", 3, buf, sizeof buf));
    assert_false(keel_audit_summary_add("NOTE sm_90 x; 2 limit problems", "sm_90", 1, buf, sizeof buf));
    assert_false(keel_audit_summary_add("SUMMARY sm_90 x; limit problems", "sm_90", 1, buf, sizeof buf));
    assert_false(keel_audit_summary_add("SUMMARY sm_90 2 limit problems", "sm_90", 1, buf, sizeof buf));
    assert_false(keel_audit_summary_add(line, "sm_90", 1, buf, 20)); /* too small */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_records_parse),        cmocka_unit_test(test_records_errors),
        cmocka_unit_test(test_findings_parse),       cmocka_unit_test(test_repo_findings_match_records),
        cmocka_unit_test(test_dsmem_xbudget),
        cmocka_unit_test(test_findings_check_both_ways), cmocka_unit_test(test_limits_and_compare),
        cmocka_unit_test(test_live_compare),         cmocka_unit_test(test_symbols_for),
        cmocka_unit_test(test_live_check),           cmocka_unit_test(test_live_symbols),
        cmocka_unit_test(test_summary_add),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
