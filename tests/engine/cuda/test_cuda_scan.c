/* engine/cuda: the chunked Mamba-2 scan (keel_ecu_ssm_chunked) and the router's group filter under the contract
 * (src/contract/engine_regs_scan.c: gate 3 against float64 within the derived bounds, gate 4 against the
 * token-by-token keel_ecu_ssm it replaces, controls red as planted); at Nano-30B's Mamba shape (64 heads x 64, state
 * 128, 8 groups) the chunked scan follows the token-by-token one over 256 tokens, and both are timed for m = 1..256.
 * The entry list is checked against ecuda.h without a device; the rest skips (77) without CUDA or a device. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "contract/engine_regs_cuda.h"
#include "common/tk_contract.h"
#include "core/core.h"

#ifdef KEEL_HAVE_CUDA
#include "engine/cuda/ecuda.h"
#endif

/* Every entry the registrations name is a launcher declared in ecuda.h (a `void keel_ecu_<x>(... void *st)`). */
static void test_entries_are_launchers(void **state) {
    (void)state;
    const char *src = getenv("KEEL_SRC");
    assert_non_null(src);
    char path[1024];
    snprintf(path, sizeof path, "%s/src/engine/cuda/ecuda.h", src);
    char *text = NULL;
    keel_err err = {0};
    assert_int_equal(keel_read_file(path, &text, NULL, &err), KEEL_OK);
    int n = 0;
    for (; keel_contract_cuda_scan_entries[n]; n++) {
        char want[96];
        snprintf(want, sizeof want, "void %s(", keel_contract_cuda_scan_entries[n]);
        const char *p = strstr(text, want), *end = p ? strchr(p, ';') : NULL;
        if (!p || !end) fail_msg("%s is not declared in ecuda.h", keel_contract_cuda_scan_entries[n]);
        char decl[800];
        snprintf(decl, sizeof decl, "%.*s", (int)(end - p), p);
        if (!strstr(decl, "void *st)")) fail_msg("%s takes no stream: not a launcher", keel_contract_cuda_scan_entries[n]);
    }
    assert_int_equal(n, 3);
    free(text);
}

#ifdef KEEL_HAVE_CUDA
static void *dev_alloc(size_t bytes) {
    void *p = NULL;
    char why[256];
    if (!keel_ecu_malloc(&p, bytes, why, sizeof why)) fail_msg("cudaMalloc %zu bytes: %s", bytes, why);
    return p;
}

static uint64_t g_rng = 88172645463325252ull;
static double unif(void) {
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return ((double)(g_rng >> 11) + 0.5) * 0x1p-53;
}
static float gauss(void) { return (float)(sqrt(-2.0 * log(unif())) * cos(6.283185307179586 * unif())); }

enum { NH = 64, HP = 64, NS = 128, NG = 8, DI = NH * HP, CD = DI + 2 * NG * NS, LD = NH + 4, MMAX = 256 };

/* Nano's Mamba shape: the chunked scan against the token-by-token scan over 256 tokens (outputs and final state,
 * within 1e-4 of each output's scale: the contract holds the derived bound on smaller shapes), then both timed. */
static void test_nano_shape(void **state) {
    (void)state;
    float *xbc = malloc((size_t)MMAX * CD * sizeof(float)), *proj = malloc((size_t)MMAX * LD * sizeof(float));
    float *st0 = malloc((size_t)DI * NS * sizeof(float)), vec[3][NH];
    for (size_t i = 0; i < (size_t)MMAX * CD; i++) xbc[i] = gauss();
    for (size_t i = 0; i < (size_t)MMAX * LD; i++) proj[i] = gauss();
    for (size_t i = 0; i < (size_t)DI * NS; i++) st0[i] = gauss();
    for (int h = 0; h < NH; h++) vec[0][h] = 0.5f * gauss(), vec[1][h] = (float)(2.0 * unif() - 1.0), vec[2][h] = gauss();
    float *dx = dev_alloc((size_t)MMAX * CD * 4), *dp = dev_alloc((size_t)MMAX * LD * 4), *dv = dev_alloc(3 * NH * 4);
    float *sa = dev_alloc((size_t)DI * NS * 4), *sb = dev_alloc((size_t)DI * NS * 4);
    float *ya = dev_alloc((size_t)MMAX * DI * 4), *yb = dev_alloc((size_t)MMAX * DI * 4);
    keel_ecu_upload(dx, xbc, (size_t)MMAX * CD * 4, NULL);
    keel_ecu_upload(dp, proj, (size_t)MMAX * LD * 4, NULL);
    keel_ecu_upload(dv, vec, sizeof vec, NULL);
    const keel_ecu_vec dtb = {dv, KEEL_DT_F32, NH}, alog = {dv + NH, KEEL_DT_F32, NH}, D = {dv + 2 * NH, KEEL_DT_F32, NH};
    keel_ecu_upload(sa, st0, (size_t)DI * NS * 4, NULL);
    keel_ecu_upload(sb, st0, (size_t)DI * NS * 4, NULL);
    keel_ecu_ssm(dx, CD, dp, LD, 4, sa, &dtb, &alog, &D, NH, HP, NS, NG, MMAX, ya, NULL);
    keel_ecu_ssm_chunked(dx, CD, dp, LD, 4, sb, &dtb, &alog, &D, NH, HP, NS, NG, MMAX, yb, NULL);
    float *ha = malloc((size_t)MMAX * DI * 4), *hb = malloc((size_t)MMAX * DI * 4);
    const size_t counts[2] = {(size_t)MMAX * DI, (size_t)DI * NS};
    float *dev[2][2] = {{ya, yb}, {sa, sb}};
    for (int k = 0; k < 2; k++) {
        keel_ecu_download(ha, dev[k][0], counts[k] * 4, NULL);
        keel_ecu_download(hb, dev[k][1], counts[k] * 4, NULL);
        double scale = 0, worst = 0;
        for (size_t i = 0; i < counts[k]; i++) scale = fmax(scale, fabs(ha[i]));
        for (size_t i = 0; i < counts[k]; i++) worst = fmax(worst, fabs((double)ha[i] - hb[i]));
        print_message("%s over %d tokens: max |chunked - token by token| %.3g, max |token by token| %.3g\n",
                      k ? "final state" : "outputs", MMAX, worst, scale);
        assert_true(scale > 0 && worst <= 1e-4 * scale);
    }
    void *e0 = keel_ecu_event_new(), *e1 = keel_ecu_event_new();
    const int ms[] = {1, 16, 32, 64, 128, 256};
    for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
        double us[2];
        for (int k = 0; k < 2; k++) {
            enum { REP = 50 };
            keel_ecu_event_record(e0, NULL);
            for (int r = 0; r < REP; r++)
                (k ? keel_ecu_ssm_chunked : keel_ecu_ssm)(dx, CD, dp, LD, 4, k ? sb : sa, &dtb, &alog, &D, NH, HP, NS, NG,
                                                          ms[i], k ? yb : ya, NULL);
            keel_ecu_event_record(e1, NULL);
            us[k] = 1000.0 * keel_ecu_event_ms(e0, e1) / REP;
        }
        print_message("Nano Mamba scan, m = %3d: token by token %8.1f us, chunked %8.1f us (%.2fx)\n", ms[i], us[0],
                      us[1], us[0] / us[1]);
    }
    keel_ecu_event_free(e0), keel_ecu_event_free(e1);
    keel_ecu_free(dx), keel_ecu_free(dp), keel_ecu_free(dv), keel_ecu_free(sa), keel_ecu_free(sb);
    keel_ecu_free(ya), keel_ecu_free(yb);
    free(xbc), free(proj), free(st0), free(ha), free(hb);
}

/* The contract's chunked-scan and router-group registrations: gates 1-4 pass, every control red at its gate. */
static void test_contract(void **state) {
    (void)state;
    keel_contract_report rep;
    assert_true(tk_contract_run(keel_contract_register_cuda_scan, "mamba-scan-chunked|route-groups", &rep) >= 3);
    assert_int_equal(rep.kernels, 2);
    assert_int_equal(rep.fail, 0);
    assert_int_equal(rep.missed, 0);
    assert_int_equal(rep.red_as_planted, rep.controls);
    assert_true(rep.controls >= 4);
}
#endif

int main(void) {
    const struct CMUnitTest host[] = {cmocka_unit_test(test_entries_are_launchers)};
    const int rc = cmocka_run_group_tests(host, NULL, NULL);
    if (rc) return rc;
#ifndef KEEL_HAVE_CUDA
    printf("skip: keel was built without CUDA (the entry list was checked)\n");
    return 77;
#else
    if (keel_cuda_device_count() < 1) {
        printf("skip: no CUDA device (the entry list was checked)\n");
        return 77;
    }
    const struct CMUnitTest dev[] = {cmocka_unit_test(test_nano_shape), cmocka_unit_test(test_contract)};
    return cmocka_run_group_tests(dev, NULL, NULL);
#endif
}
