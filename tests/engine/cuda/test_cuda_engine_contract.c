/* engine/cuda: the engine kernels' contract table (src/contract/engine_regs_cuda.c) on the device: every
 * registration passes gates 1-4 and every planted control goes red at its gate; the table covers every launcher
 * the engine declares. Skips (77) without CUDA or a device. */
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
#include "kernels/cuda/cuda.h"
#endif

/* Every "void keel_ecu_<x>(... void *st)" launcher of src/engine/cuda/ecuda.h is in the entries list. */
static void test_entries_cover_launchers(void **state) {
    (void)state;
    const char *src = getenv("KEEL_SRC");
    assert_non_null(src);
    char path[1024];
    snprintf(path, sizeof path, "%s/src/engine/cuda/ecuda.h", src);
    char *text = NULL;
    size_t len = 0;
    keel_err err = {0};
    assert_int_equal(keel_read_file(path, &text, &len, &err), KEEL_OK);
    int launchers = 0;
    char *kern = strstr(text, "/* ---- kernels ---- */"), *twin = strstr(text, "/* ---- the contract's twin");
    assert_non_null(kern); /* only the kernels section declares launchers; the runtime section above does not */
    assert_non_null(twin);
    *twin = 0;
    for (char *p = kern; (p = strstr(p, "void keel_ecu_")) != NULL; p++) {
        char name[64];
        size_t n = 0;
        const char *q = p + 5;
        while (n < sizeof name - 1 && (q[n] == '_' || (q[n] >= 'a' && q[n] <= 'z') || (q[n] >= '0' && q[n] <= '9')))
            name[n] = q[n], n++;
        name[n] = 0;
        const char *end = strchr(q, ';');
        char decl[600];
        snprintf(decl, sizeof decl, "%.*s", (int)(end ? end - q : 0), q);
        if (!strstr(decl, "void *st)")) continue; /* runtime calls, not kernels */
        launchers++;
        bool found = false;
        const char *const *tabs[3] = {keel_contract_cuda_engine_entries, keel_contract_cuda_attn_entries,
                                      keel_contract_cuda_scan_entries};
        for (int tb = 0; tb < 3; tb++)
            for (int i = 0; tabs[tb][i]; i++) found |= !strcmp(tabs[tb][i], name);
        if (!found)
            fail_msg("launcher %s is in none of the engine's entry tables (engine, attn, scan)", name);
    }
    assert_true(launchers >= 11);
    free(text);
}

#ifdef KEEL_HAVE_CUDA
static void test_gates_and_controls(void **state) {
    (void)state;
    keel_contract_report rep;
    const int n = tk_contract_run(keel_contract_register_cuda_engine, NULL, &rep);
    assert_true(n >= 11);
    assert_int_equal(rep.kernels, n);
    assert_int_equal(rep.fail, 0);
    assert_int_equal(rep.missed, 0);
    assert_int_equal(rep.red_as_planted + rep.red_early, rep.controls);
}
#endif

int main(void) {
    const struct CMUnitTest host[] = {cmocka_unit_test(test_entries_cover_launchers)};
    int rc = cmocka_run_group_tests(host, NULL, NULL);
#ifdef KEEL_HAVE_CUDA
    if (keel_cuda_device_count() >= 1) {
        const struct CMUnitTest dev[] = {cmocka_unit_test(test_gates_and_controls)};
        return rc | cmocka_run_group_tests(dev, NULL, NULL);
    }
#endif
    printf("the gates need a CUDA build and device: only the launcher coverage ran\n");
    return rc;
}
