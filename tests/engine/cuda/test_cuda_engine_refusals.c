/* engine/cuda: what the CUDA engine refuses before it touches a device, with crafted configurations of
 * nemotron_h_tiny: shapes its kernels do not take (named, with the numbers), bad arguments, and, on a host without
 * a device, the missing device. Runs in every CUDA build; skips (77) in a build without CUDA. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/engine.h"
#include "common/testkit.h"

#ifdef KEEL_HAVE_CUDA
#include "kernels/cuda/cuda.h"

static keel_model g_model;

static int setup(void **state) {
    (void)state;
    char dir[1024];
    tk_fixture(dir, sizeof dir, "nemotron_h_tiny");
    keel_err err = {0};
    if (keel_model_load(&g_model, dir, NULL, &err) != KEEL_OK) {
        print_message("fixture: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    keel_model_free(&g_model);
    return 0;
}

/* Init with one field of the configuration changed must fail with `code` and a message holding `needle`. */
static void refused(int field, int value, keel_code code, const char *needle) {
    keel_config saved = g_model.cfg;
    int *f[] = {&g_model.cfg.conv_kernel, &g_model.cfg.ssm_state, &g_model.cfg.head_dim, &g_model.cfg.n_experts,
                &g_model.cfg.hidden, &g_model.cfg.top_k};
    *f[field] = value;
    keel_cuda_engine *e = NULL;
    keel_err err = {0};
    assert_int_equal(keel_cuda_engine_init(&e, &g_model, 16, &err), code);
    assert_null(e);
    print_message("refused: %s\n", err.msg);
    assert_non_null(strstr(err.msg, needle));
    g_model.cfg = saved;
}

static void test_shapes(void **state) {
    (void)state;
    refused(0, 9, KEEL_E_UNSUPPORTED, "conv_kernel 9");
    refused(1, 512, KEEL_E_UNSUPPORTED, "ssm_state 512");
    refused(2, 512, KEEL_E_UNSUPPORTED, "head_dim 512");
    refused(3, 2048, KEEL_E_UNSUPPORTED, "2048 experts");
    refused(4, 255, KEEL_E_UNSUPPORTED, "hidden_size 255");
    refused(5, 65, KEEL_E_UNSUPPORTED, "top 65");
}

static void test_arguments(void **state) {
    (void)state;
    keel_cuda_engine *e = NULL;
    keel_err err = {0};
    assert_int_equal(keel_cuda_engine_init(&e, &g_model, 0, &err), KEEL_E_ARG);
    assert_int_equal(keel_cuda_engine_init(&e, &g_model, g_model.cfg.max_ctx + 1, &err), KEEL_E_RANGE);
    assert_non_null(strstr(err.msg, "max_position_embeddings"));
    assert_null(e);
}

static void test_no_device(void **state) {
    (void)state;
    if (keel_cuda_device_count() > 0) {
        print_message("a device is present: the no-device refusal is not reachable here\n");
        return;
    }
    keel_cuda_engine *e = NULL;
    keel_err err = {0};
    assert_int_equal(keel_cuda_engine_init(&e, &g_model, 16, &err), KEEL_E_DEVICE);
    assert_non_null(strstr(err.msg, "--backend cpu"));
    assert_null(e);
}
#endif

int main(void) {
#ifndef KEEL_HAVE_CUDA
    printf("skip: keel was built without CUDA\n");
    return 77;
#else
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_shapes), cmocka_unit_test(test_arguments),
                                       cmocka_unit_test(test_no_device)};
    return cmocka_run_group_tests(tests, setup, teardown);
#endif
}
