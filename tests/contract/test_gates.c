/* The contract's machinery: every planted control goes red at its gate on registrations of every family and
 * path; a hand-made fault nobody planted (a group index off by one, compiled here from the real stream body) is
 * caught; production registrations pass; known findings are parsed, reported, and held to reality. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "contract/contract.h"

/* Hand-made fault: each group but the last reads the scale and bias of the next group. */
#define KEEL_STREAM_MATMUL handmade_group_off_matmul
#define KEEL_STREAM_RELU2 handmade_group_off_relu2
#define KEEL_STREAM_USE_AVX2() (strcmp(keel_cpu_isa(), "avx2") == 0)
#define KEEL_STREAM_GI(gi, g, ng) ((gi) + ((g) + 1 < (ng) ? 1u : 0u))
#include "kernels/cpu/stream_body.h"

static void handmade_launch(const keel_contract_reg *reg, const keel_contract_args *a) {
    keel_cpu_force_portable(strcmp(reg->path, "portable") == 0);
    handmade_group_off_matmul(&a->W, (const float *)a->x, a->m, (float *)a->y, reg->epi);
    keel_cpu_force_portable(false);
}

/* A faulty kernel the twins do not cover: a zero where its first output belongs (caught by the reference). */
static void zero_first_launch(const keel_contract_reg *reg, const keel_contract_args *a) {
    keel_cpu_matmul(&a->W, (const float *)a->x, a->m, (float *)a->y, reg->epi);
    ((float *)a->y)[0] = 0.0f;
}

static keel_contract_table g_table;

static int setup(void **state) {
    (void)state;
    keel_contract_table_init(&g_table);
    return keel_contract_register_cpu(&g_table) > 0 ? 0 : -1;
}
static int teardown(void **state) {
    (void)state;
    keel_contract_table_free(&g_table);
    return 0;
}

static const keel_contract_reg *reg_named(const char *name) {
    const keel_contract_reg *r = keel_contract_table_find(&g_table, name);
    if (!r) fail_msg("no registration %s", name);
    return r;
}

static bool host_avx2(void) { return strcmp(keel_contract_cpu_backend()->chip, "cpu-avx2") == 0; }

static void test_every_control_red_at_its_gate(void **state) {
    (void)state;
    const char *names[] = {"cpu/scalar/relu2",
                           "cpu/avx2/stream/q8g128/f16/relu2",
                           "cpu/portable/stream/q5g32/bf16/relu2",
                           "cpu/portable/stream/q3g64/f32/none",
                           "cpu/avx2/stream/q6g64/bf16/none",
                           "cpu/avx2/stream/float/f16/relu2",
                           "cpu/portable/stream/float/bf16/none"};
    int seen_gate[5] = {0};
    for (size_t i = 0; i < KEEL_ARRAY_LEN(names); i++) {
        if (strstr(names[i], "/avx2/") && !host_avx2()) continue;
        const keel_contract_reg *r = reg_named(names[i]);
        assert_true(r->n_controls >= 1);
        keel_contract_result res;
        keel_contract_run(&g_table, r, r->launch, 4, &res);
        if (res.first_red) fail_msg("%s: red at gate %d: %s", r->name, res.first_red, res.gate[res.first_red].detail);
        for (int c = 0; c < r->n_controls; c++) {
            keel_contract_run(&g_table, r, r->controls[c].twin, 4, &res);
            if (res.first_red != r->controls[c].gate)
                fail_msg("%s control %s: planted for gate %d, red at %d", r->name, r->controls[c].name,
                         r->controls[c].gate, res.first_red);
            seen_gate[res.first_red]++;
        }
    }
    assert_true(seen_gate[2] > 0 && seen_gate[3] > 0 && seen_gate[4] > 0);
}

static void test_table_covers_every_variant(void **state) {
    (void)state;
    const int bits[] = {2, 3, 4, 5, 6, 8}, groups[] = {32, 64, 128};
    const char *sdts[] = {"bf16", "f16", "f32"}, *paths[] = {"avx2", "portable"}, *epis[] = {"none", "relu2"};
    char name[KEEL_CONTRACT_NAME_MAX];
    for (int p = host_avx2() ? 0 : 1; p < 2; p++)
        for (int e = 0; e < 2; e++)
            for (int s = 0; s < 3; s++) {
                snprintf(name, sizeof name, "cpu/%s/stream/float/%s/%s", paths[p], sdts[s], epis[e]);
                assert_non_null(reg_named(name));
                for (int b = 0; b < 6; b++)
                    for (int g = 0; g < 3; g++) {
                        snprintf(name, sizeof name, "cpu/%s/stream/q%dg%d/%s/%s", paths[p], bits[b], groups[g],
                                 sdts[s], epis[e]);
                        const keel_contract_reg *r = reg_named(name);
                        assert_int_equal(r->bits, bits[b]);
                        assert_int_equal(r->rows_min, 1);
                        assert_int_equal(r->rows_max, 8);
                        bool one_group = false, odd_n = false;
                        for (int i = 0; i < r->n_shapes; i++) {
                            one_group |= r->shapes[i].k == groups[g];
                            odd_n |= r->shapes[i].n % 2 == 1 && r->shapes[i].n > 1;
                            assert_true(r->shapes[i].m_hi >= 1);
                        }
                        assert_true(one_group && odd_n);
                        bool has[5] = {false};
                        for (int c = 0; c < r->n_controls; c++) has[r->controls[c].gate] = true;
                        assert_true(has[2] && has[3] && has[4]);
                        if (e == 1) assert_int_equal(r->n_replaces, 2);
                    }
            }
    assert_int_equal(g_table.n, (host_avx2() ? 2 : 1) * 2 * 3 * (6 * 3 + 1) + 1);
}

/* The hand-made fault is in no control list; the contract must still catch it, at gate 3. */
static void test_unplanted_group_index_fault_caught(void **state) {
    (void)state;
    const char *names[] = {"cpu/portable/stream/q4g64/bf16/none", "cpu/avx2/stream/q5g32/f16/relu2"};
    for (size_t i = 0; i < KEEL_ARRAY_LEN(names); i++) {
        if (strstr(names[i], "/avx2/") && !host_avx2()) continue;
        keel_contract_result res;
        keel_contract_run(&g_table, reg_named(names[i]), handmade_launch, 4, &res);
        if (res.first_red != 3) fail_msg("%s: group-index fault red at gate %d", names[i], res.first_red);
        assert_non_null(strstr(res.gate[3].detail, "outside the bound"));
        assert_non_null(strstr(res.gate[3].detail, "ref"));
        assert_true(res.gate[3].frac > 1.0);
    }
    keel_contract_result res;
    keel_contract_run(&g_table, reg_named("cpu/portable/stream/float/f32/none"), zero_first_launch, 4, &res);
    assert_int_equal(res.first_red, 3);
}

static void test_findings_parse(void **state) {
    (void)state;
    keel_contract_findings f;
    keel_err err = {0};
    assert_int_equal(keel_contract_findings_parse(&f,
                                                  "# comment\n\n  cpu/a 3 slow denormals on old CPUs  \n"
                                                  "cpu/b 5 spills on sm_80\n",
                                                  "kf", &err),
                     KEEL_OK);
    assert_int_equal(f.n, 2);
    assert_string_equal(f.items[0].name, "cpu/a");
    assert_int_equal(f.items[0].gate, 3);
    assert_string_equal(f.items[0].reason, "slow denormals on old CPUs");
    assert_int_equal(f.items[1].line, 4);
    assert_non_null(keel_contract_findings_find(&f, "cpu/b"));
    assert_null(keel_contract_findings_find(&f, "cpu/c"));
    keel_contract_findings_free(&f);
    keel_contract_findings_free(NULL);

    const char *bad[][2] = {{"cpu/a\n", "kf:1: expected"},
                            {"# x\ncpu/a seven reason\n", "kf:2: expected"},
                            {"cpu/a 6 reason\n", "kf:1: expected"},
                            {"cpu/a 0 reason\n", "kf:1: expected"},
                            {"cpu/a 3\n", "kf:1: finding cpu/a has no reason"},
                            {"cpu/a 3 r\ncpu/a 2 r\n", "kf:2: cpu/a is already listed on line 1"}};
    for (size_t i = 0; i < KEEL_ARRAY_LEN(bad); i++) {
        assert_int_equal(keel_contract_findings_parse(&f, bad[i][0], "kf", &err), KEEL_E_FORMAT);
        if (!strstr(err.msg, bad[i][1])) fail_msg("case %zu: \"%s\" lacks \"%s\"", i, err.msg, bad[i][1]);
        assert_int_equal(f.n, 0);
    }
    assert_int_equal(keel_contract_findings_load(&f, "/nonexistent/known_findings", &err), KEEL_E_IO);
}

/* A table of one production registration and one "registration" that is a faulty twin, with findings lists. */
static void run_small(const char *findings, keel_contract_report *rep, char *out, size_t cap) {
    keel_contract_table t;
    keel_contract_table_init(&t);
    keel_contract_register_cpu(&t);
    keel_contract_reg *bad = keel_contract_table_add(&t);
    *bad = *keel_contract_table_find(&t, "cpu/portable/stream/q4g32/f32/none");
    snprintf(bad->name, sizeof bad->name, "cpu/portable/stream/handmade-group-off");
    bad->launch = handmade_launch;
    keel_contract_findings f;
    keel_err err = {0};
    assert_int_equal(keel_contract_findings_parse(&f, findings, "kf", &err), KEEL_OK);
    FILE *mem = fmemopen(out, cap, "w");
    assert_non_null(mem);
    assert_int_equal(keel_contract_run_all(&t, "q4g32/f32/none$|handmade", &f, mem, NULL, rep, &err), KEEL_OK);
    fclose(mem);
    keel_contract_findings_free(&f);
    keel_contract_table_free(&t);
}

static void test_known_findings_held_to_reality(void **state) {
    (void)state;
    static char out[8192];
    keel_contract_report rep;
    run_small("cpu/portable/stream/handmade-group-off 3 a test fault\n", &rep, out, sizeof out);
    assert_int_equal(rep.kernels, host_avx2() ? 3 : 2); /* avx2 and portable q4g32/f32/none, the faulty one */
    assert_int_equal(rep.known, 1);
    assert_int_equal(rep.fail, 0);
    assert_int_equal(rep.missed, 0);
    assert_non_null(strstr(out, "KNOWN cpu/portable/stream/handmade-group-off gate 3: a test fault"));
    assert_non_null(strstr(out, "SUMMARY cpu-"));

    run_small("", &rep, out, sizeof out); /* not listed: a failure */
    assert_int_equal(rep.fail, 1);
    assert_non_null(strstr(out, "FAIL cpu/portable/stream/handmade-group-off gate 3"));

    run_small("cpu/portable/stream/handmade-group-off 2 wrong gate\n", &rep, out, sizeof out);
    assert_int_equal(rep.fail, 1);
    assert_int_equal(rep.stale_findings, 1);

    run_small("cpu/portable/stream/handmade-group-off 3 a test fault\n"
              "cpu/portable/stream/q4g32/f32/none 3 it passes now\n"
              "cpu/portable/stream/q7g32/f32/none 3 no such kernel\n",
              &rep, out, sizeof out);
    assert_int_equal(rep.known, 1);
    assert_int_equal(rep.stale_findings, 2);
    assert_int_equal(rep.fail, 2);
    assert_non_null(strstr(out, "STALE cpu/portable/stream/q4g32/f32/none: listed in kf:2"));
    assert_non_null(strstr(out, "STALE cpu/portable/stream/q7g32/f32/none: listed in kf:3, but no such registration"));
}

static void test_bad_filter(void **state) {
    (void)state;
    keel_contract_report rep;
    keel_err err = {0};
    assert_int_equal(keel_contract_run_all(&g_table, "([", NULL, stdout, NULL, &rep, &err), KEEL_E_ARG);
    assert_non_null(strstr(err.msg, "--filter"));
}

static void test_summary_format(void **state) {
    (void)state;
    keel_contract_report r = {.kernels = 162, .pass = 160, .fail = 0, .known = 2, .controls = 44,
                              .red_as_planted = 44, .missed = 0};
    char buf[256];
    keel_contract_summary("cpu-avx2", &r, buf, sizeof buf);
    assert_string_equal(buf, "SUMMARY cpu-avx2 162 kernels: 160 pass gates 1-4, 0 fail, 2 known findings; 44 controls: "
                             "44 red as planted, 0 missed; 0 limit problems");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_control_red_at_its_gate),
        cmocka_unit_test(test_table_covers_every_variant),
        cmocka_unit_test(test_unplanted_group_index_fault_caught),
        cmocka_unit_test(test_findings_parse),
        cmocka_unit_test(test_known_findings_held_to_reality),
        cmocka_unit_test(test_bad_filter),
        cmocka_unit_test(test_summary_format),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
