/* keel info: --json on the fixture agrees with its README.txt row by row; text output, MTP options and bad
 * arguments. */
#include <cjson/cJSON.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>

#include "common/testkit.h"

#include "core/core.h"

static const char *fixdir(void) {
    static char p[1024];
    return tk_fixture(p, sizeof p, "nemotron_h_tiny");
}

static const cJSON *row(const cJSON *mats, const char *path) {
    const cJSON *it;
    cJSON_ArrayForEach(it, mats) if (!strcmp(cJSON_GetObjectItem(it, "path")->valuestring, path)) return it;
    return NULL;
}

static void test_json_vs_readme(void **state) {
    (void)state;
    char cmd[2300];
    int st;
    snprintf(cmd, sizeof cmd, "'%s' info '%s' --json 2>&1", tk_bin(), fixdir());
    char *out = tk_run(cmd, &st);
    assert_int_equal(st, 0);
    cJSON *root = cJSON_Parse(out);
    if (!root) fail_msg("not JSON: %.300s", out);
    free(out);
    const cJSON *mats = cJSON_GetObjectItem(root, "matrices");
    assert_true(cJSON_IsArray(mats));

    char path[1100], line[512], pattern[64] = "";
    snprintf(path, sizeof path, "%s/README.txt", fixdir());
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    int rows = 0;
    size_t sum = 0;
    while (fgets(line, sizeof line, f)) {
        char name[256], bits[16], group[16], sc[16];
        if (sscanf(line, "pattern %63s", pattern) == 1) continue;
        if (sscanf(line, "%255s bits=%15s group=%15s scales=%15s", name, bits, group, sc) != 4) continue;
        const cJSON *r = row(mats, name);
        if (!r) fail_msg("README row %s absent from keel info --json", name);
        bool fl = !strcmp(bits, "float");
        assert_int_equal(cJSON_IsTrue(cJSON_GetObjectItem(r, "quantized")), !fl);
        assert_int_equal(cJSON_GetObjectItem(r, "bits")->valueint, fl ? 0 : atoi(bits));
        assert_int_equal(cJSON_GetObjectItem(r, "group")->valueint, strcmp(group, "-") ? atoi(group) : 0);
        assert_string_equal(cJSON_GetObjectItem(r, "scales")->valuestring, sc);
        rows++;
    }
    fclose(f);
    assert_int_equal(rows, 30);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(root, "config"), "pattern")->valuestring, pattern);
    /* every listed matrix's bytes: codes + scales + biases as the shapes imply */
    const cJSON *it;
    cJSON_ArrayForEach(it, mats) {
        const cJSON *sh = cJSON_GetObjectItem(it, "shape");
        double n = 1;
        const cJSON *d;
        cJSON_ArrayForEach(d, sh) n *= d->valuedouble;
        int bits = cJSON_GetObjectItem(it, "bits")->valueint, group = cJSON_GetObjectItem(it, "group")->valueint;
        const char *sc = cJSON_GetObjectItem(it, "scales")->valuestring;
        double ss = !strcmp(sc, "F32") ? 4 : 2;
        double want = bits ? n * bits / 8 + 2 * ss * n / group : n * ss;
        assert_true(cJSON_GetObjectItem(it, "bytes")->valuedouble == want);
        if (strncmp(cJSON_GetObjectItem(it, "path")->valuestring, "mtp.", 4)) sum += (size_t)want;
    }
    const cJSON *tot = cJSON_GetObjectItem(root, "totals");
    assert_true(cJSON_GetObjectItem(tot, "bytes")->valuedouble == (double)sum);
    const cJSON *mtp = cJSON_GetObjectItem(root, "mtp");
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(mtp, "present")));
    assert_int_equal(cJSON_GetObjectItem(mtp, "bits")->valueint, 6);
    assert_int_equal(cJSON_GetObjectItem(mtp, "group_size")->valueint, 64);
    assert_non_null(row(mats, "mtp.layers.0.eh_proj"));
    cJSON_Delete(root);
}

static void test_text_and_options(void **state) {
    (void)state;
    char cmd[2300];
    int st;
    snprintf(cmd, sizeof cmd, "'%s' info '%s' 2>&1", tk_bin(), fixdir());
    char *out = tk_run(cmd, &st);
    assert_int_equal(st, 0);
    assert_non_null(strstr(out, "pattern MEM*E-M*E"));
    assert_non_null(strstr(out, "backbone.layers.7.mixer.v_proj"));
    assert_non_null(strstr(out, "bits per weight"));
    assert_non_null(strstr(out, "present"));
    free(out);
    snprintf(cmd, sizeof cmd, "'%s' info '%s' --mtp '' --json 2>&1", tk_bin(), fixdir());
    out = tk_run(cmd, &st);
    assert_int_equal(st, 0);
    cJSON *root = cJSON_Parse(out);
    assert_non_null(root);
    assert_false(cJSON_IsTrue(cJSON_GetObjectItem(cJSON_GetObjectItem(root, "mtp"), "present")));
    cJSON_Delete(root);
    free(out);
    snprintf(cmd, sizeof cmd, "'%s' info /nonexistent/dir 2>&1", tk_bin());
    out = tk_run(cmd, &st);
    assert_int_equal(st, 1);
    assert_non_null(strstr(out, "/nonexistent/dir/config.json"));
    free(out);
    snprintf(cmd, sizeof cmd, "'%s' info '%s' --bogus 2>&1", tk_bin(), fixdir());
    out = tk_run(cmd, &st);
    assert_int_equal(st, 1);
    assert_non_null(strstr(out, "--bogus"));
    free(out);
    snprintf(cmd, sizeof cmd, "'%s' info '%s' --mtp 2>&1", tk_bin(), fixdir());
    out = tk_run(cmd, &st);
    assert_int_equal(st, 1);
    free(out);
    snprintf(cmd, sizeof cmd, "'%s' info 2>&1", tk_bin());
    out = tk_run(cmd, &st);
    assert_int_equal(st, 1);
    assert_non_null(strstr(out, "MODEL_DIR"));
    free(out);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_vs_readme),
        cmocka_unit_test(test_text_and_options),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
