/* keel synth then keel info: configs/demo.json at the widths asked, with an MTP head; the same bytes under any
 * OMP_NUM_THREADS; bad arguments refused. */
#include <cjson/cJSON.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>

#include "common/testkit.h"

static void test_synth_info(void **state) {
    (void)state;
    char dir[1024], cmd[2300];
    snprintf(dir, sizeof dir, "%s/cli_synth_demo", tk_tmp());
    int st;
    snprintf(cmd, sizeof cmd, "'%s' synth configs/demo.json '%s' --bits 5 --group 32 --scales f32 --mtp-bits 8 --seed 9 2>&1",
             tk_bin(), dir);
    char *out = tk_run(cmd, &st);
    if (st) fail_msg("synth failed: %s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "'%s' info '%s' --json 2>&1", tk_bin(), dir);
    out = tk_run(cmd, &st);
    assert_int_equal(st, 0);
    cJSON *root = cJSON_Parse(out);
    if (!root) fail_msg("not JSON: %.300s", out);
    free(out);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(root, "config"), "pattern")->valuestring, "MEM*E-M*E");
    const cJSON *q = cJSON_GetObjectItem(root, "quantization");
    assert_int_equal(cJSON_GetObjectItem(q, "bits")->valueint, 5);
    assert_int_equal(cJSON_GetObjectItem(q, "group_size")->valueint, 32);
    const cJSON *it;
    int n = 0, n_mtp = 0;
    cJSON_ArrayForEach(it, cJSON_GetObjectItem(root, "matrices")) {
        const char *p = cJSON_GetObjectItem(it, "path")->valuestring;
        bool router = strstr(p, ".gate") != NULL, mtp = !strncmp(p, "mtp.", 4);
        int bits = cJSON_GetObjectItem(it, "bits")->valueint, group = cJSON_GetObjectItem(it, "group")->valueint;
        const char *sc = cJSON_GetObjectItem(it, "scales")->valuestring;
        if (router) {
            assert_int_equal(bits, 0);
            assert_string_equal(sc, "BF16");
        } else {
            assert_int_equal(bits, mtp ? 8 : 5);
            assert_int_equal(group, mtp ? 64 : 32);
            assert_string_equal(sc, "F32");
        }
        n++;
        n_mtp += mtp;
    }
    /* embeddings, 3 Mamba x 2, 2 attention x 4, 1 MLP x 2, 3 MoE x 5, lm_head; MTP eh_proj + 4 + 5 */
    assert_int_equal(n - n_mtp, 1 + 6 + 8 + 2 + 15 + 1);
    assert_int_equal(n_mtp, 10);
    const cJSON *mtp = cJSON_GetObjectItem(root, "mtp");
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(mtp, "present")));
    assert_int_equal(cJSON_GetObjectItem(mtp, "bits")->valueint, 8);
    cJSON_Delete(root);
}

static void test_threads_env(void **state) {
    (void)state;
    char d[3][1024], cmd[4400];
    const char *env[3] = {"OMP_NUM_THREADS=1", "OMP_NUM_THREADS=2", "OMP_NUM_THREADS=2"};
    const int seed[3] = {3, 3, 4};
    for (int i = 0; i < 3; i++) {
        snprintf(d[i], sizeof d[i], "%s/cli_synth_thr%d", tk_tmp(), i);
        snprintf(cmd, sizeof cmd, "%s '%s' synth configs/demo.json '%s' --mtp-bits 6 --seed %d 2>&1", env[i], tk_bin(),
                 d[i], seed[i]);
        int st;
        char *out = tk_run(cmd, &st);
        if (st) fail_msg("synth failed: %s", out);
        free(out);
    }
    const char *files[2] = {"model.safetensors", "mtp.safetensors"};
    for (int f = 0; f < 2; f++)
        for (int i = 1; i < 3; i++) {
            snprintf(cmd, sizeof cmd, "cmp -s '%s/%s' '%s/%s'", d[0], files[f], d[i], files[f]);
            int st = system(cmd);
            assert_true(WIFEXITED(st));
            assert_int_equal(WEXITSTATUS(st), i == 1 ? 0 : 1); /* thread count: same bytes; seed: different */
        }
}

static void test_bad_args(void **state) {
    (void)state;
    char dir[1024], cmd[2300];
    snprintf(dir, sizeof dir, "%s/cli_synth_bad", tk_tmp());
    const char *bad[][2] = {
        {"--bits 7", "bits 7"},          {"--group 48", "group 48"}, {"--scales f8", "f8"},
        {"--mtp-bits 0", "--mtp-bits"},  {"--seed -1", "--seed"},    {"--frobnicate", "--frobnicate"},
        {"--bits", "--bits"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(cmd, sizeof cmd, "'%s' synth configs/demo.json '%s' %s 2>&1", tk_bin(), dir, bad[i][0]);
        int st;
        char *out = tk_run(cmd, &st);
        if (st != 1 || !strstr(out, bad[i][1])) fail_msg("%s: status %d, output %s", bad[i][0], st, out);
        free(out);
    }
    snprintf(cmd, sizeof cmd, "'%s' synth /nonexistent.json '%s' 2>&1", tk_bin(), dir);
    int st;
    char *out = tk_run(cmd, &st);
    assert_int_equal(st, 1);
    assert_non_null(strstr(out, "/nonexistent.json"));
    free(out);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_synth_info),
        cmocka_unit_test(test_threads_env),
        cmocka_unit_test(test_bad_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
