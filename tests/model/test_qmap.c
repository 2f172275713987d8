/* The quantization map: the fixture's entries (dict, true, false) against its README, inheritance of global
 * settings, and refusals of non-affine modes and bad widths, each naming what is wrong. */
#include <cjson/cJSON.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "model/model.h"
#include "common/testkit.h"

static void test_fixture_map(void **state) {
    (void)state;
    char path[1024], *t = NULL;
    tk_fixture(path, sizeof path, "nemotron_h_tiny/config.json");
    keel_err err = {0};
    assert_int_equal(keel_read_file(path, &t, NULL, &err), KEEL_OK);
    cJSON *root = cJSON_Parse(t);
    free(t);
    char *qs = cJSON_PrintUnformatted(cJSON_GetObjectItem(root, "quantization"));
    cJSON_Delete(root);
    keel_qmap q;
    assert_int_equal(keel_qmap_parse(&q, qs, path, &err), KEEL_OK);
    free(qs);
    assert_true(q.present);
    assert_int_equal(q.bits, 4);
    assert_int_equal(q.group, 64);
    int quant, bits, group;
    /* README: v_proj of layer 7 is float; layer 5 up_proj (true) is the global 4/64; layer 2 in_proj 5/128 */
    keel_qmap_lookup(&q, "backbone.layers.7.mixer.v_proj", &quant, &bits, &group);
    assert_int_equal(quant, 0);
    keel_qmap_lookup(&q, "backbone.layers.5.mixer.up_proj", &quant, &bits, &group);
    assert_int_equal(quant, 1);
    assert_int_equal(bits, 4);
    assert_int_equal(group, 64);
    keel_qmap_lookup(&q, "backbone.layers.2.mixer.in_proj", &quant, &bits, &group);
    assert_int_equal(bits, 5);
    assert_int_equal(group, 128);
    keel_qmap_lookup(&q, "backbone.layers.1.mixer.switch_mlp.fc2", &quant, &bits, &group);
    assert_int_equal(bits, 5);
    assert_int_equal(group, 32);
    keel_qmap_lookup(&q, "backbone.layers.8.mixer.switch_mlp.fc1", &quant, &bits, &group); /* not listed */
    assert_int_equal(quant, 1);
    assert_int_equal(bits, 4);
    assert_int_equal(group, 64);
    keel_qmap_free(&q);
    keel_qmap_free(&q); /* twice is harmless */
    keel_qmap_free(NULL);
}

static void test_inherit(void **state) {
    (void)state;
    keel_qmap q;
    keel_err err = {0};
    /* no mode anywhere (the MTP head's metadata), an entry with only bits, one with only group_size */
    assert_int_equal(keel_qmap_parse(&q,
                                     "{\"group_size\": 64, \"bits\": 6, \"a\": {\"bits\": 8}, \"b\": {\"group_size\": "
                                     "32}, \"c\": false, \"d\": true}",
                                     "m", &err),
                     KEEL_OK);
    int quant, bits, group;
    keel_qmap_lookup(&q, "a", &quant, &bits, &group);
    assert_int_equal(bits, 8);
    assert_int_equal(group, 64);
    keel_qmap_lookup(&q, "b", &quant, &bits, &group);
    assert_int_equal(bits, 6);
    assert_int_equal(group, 32);
    keel_qmap_lookup(&q, "c", &quant, &bits, &group);
    assert_int_equal(quant, 0);
    keel_qmap_lookup(&q, "d", &quant, &bits, &group);
    assert_int_equal(quant, 1);
    assert_int_equal(bits, 6);
    keel_qmap_lookup(&q, "zzz", &quant, &bits, &group);
    assert_int_equal(bits, 6);
    assert_int_equal(q.n, 4);
    keel_qmap_free(&q);
    /* an absent map: everything float */
    keel_qmap none = {0};
    keel_qmap_lookup(&none, "x", &quant, &bits, &group);
    assert_int_equal(quant, 0);
}

typedef struct refusal {
    const char *json;
    keel_code code;
    const char *named;
} refusal;

static void test_refusals(void **state) {
    (void)state;
    static const refusal r[] = {
        {"{\"group_size\": 32, \"bits\": 4, \"mode\": \"mxfp4\"}", KEEL_E_UNSUPPORTED, "mxfp4"},
        {"{\"group_size\": 32, \"bits\": 8, \"mode\": \"mxfp8\"}", KEEL_E_UNSUPPORTED, "mxfp8"},
        {"{\"group_size\": 16, \"bits\": 4, \"mode\": \"nvfp4\"}", KEEL_E_UNSUPPORTED, "nvfp4"},
        {"{\"group_size\": 64, \"bits\": 4, \"x.y\": {\"bits\": 4, \"group_size\": 32, \"mode\": \"nvfp4\"}}",
         KEEL_E_UNSUPPORTED, "x.y"},
        {"{\"group_size\": 64, \"bits\": 7}", KEEL_E_UNSUPPORTED, "bits"},
        {"{\"group_size\": 16, \"bits\": 4}", KEEL_E_UNSUPPORTED, "group_size"},
        {"{\"group_size\": 64}", KEEL_E_MISSING, "bits"},
        {"{\"bits\": 4}", KEEL_E_MISSING, "group_size"},
        {"{\"group_size\": 64, \"bits\": 4, \"lm_head\": {\"bits\": 1}}", KEEL_E_UNSUPPORTED, "lm_head"},
        {"{\"group_size\": 64, \"bits\": 4, \"lm_head\": \"8\"}", KEEL_E_FORMAT, "lm_head"},
        {"{\"group_size\": 64, \"bits\": 4, \"mode\": 3}", KEEL_E_FORMAT, "mode"},
        {"{\"quant_method\": \"fp8\"}", KEEL_E_UNSUPPORTED, "fp8"},
        {"[1, 2]", KEEL_E_FORMAT, "object"},
        {"{", KEEL_E_FORMAT, "object"},
    };
    for (size_t i = 0; i < sizeof r / sizeof r[0]; i++) {
        keel_qmap q;
        keel_err err = {0};
        keel_code rc = keel_qmap_parse(&q, r[i].json, "where.json", &err);
        if (rc != r[i].code || !strstr(err.msg, r[i].named) || !strstr(err.msg, "where.json"))
            fail_msg("%s: expected %s naming %s, got %s: %s", r[i].json, keel_code_name(r[i].code), r[i].named,
                     keel_code_name(rc), err.msg);
        assert_false(q.present);
        assert_int_equal(q.n, 0);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixture_map),
        cmocka_unit_test(test_inherit),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
