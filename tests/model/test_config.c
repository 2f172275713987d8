/* config.json parsing: the fixture and the Nano geometry accepted with their documented values, every refusal
 * naming its field, and the layer pattern from either field in either vocabulary. */
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

static char *read_text(const char *rel, bool fixture) {
    char path[1024];
    if (fixture) tk_fixture(path, sizeof path, rel);
    else snprintf(path, sizeof path, "./%s", rel);
    return tk_read_text(path);
}

/* The fixture's config is the base every crafted config edits. */
static cJSON *base(void) {
    char *t = read_text("nemotron_h_tiny/config.json", true);
    cJSON *c = cJSON_Parse(t);
    free(t);
    assert_non_null(c);
    return c;
}

static keel_code parse_json(cJSON *c, keel_config *cfg, keel_err *err) {
    char *s = cJSON_PrintUnformatted(c);
    keel_code rc = keel_config_parse(cfg, s, "crafted/config.json", err);
    free(s);
    return rc;
}

static void test_fixture(void **state) {
    (void)state;
    char *t = read_text("nemotron_h_tiny/config.json", true);
    keel_config c;
    keel_err err = {0};
    assert_int_equal(keel_config_parse(&c, t, "config.json", &err), KEEL_OK);
    free(t);
    /* values as the fixture README documents them */
    assert_string_equal(c.pattern, "MEM*E-M*E");
    assert_int_equal(c.n_layer, 9);
    assert_int_equal(c.hidden, 256);
    assert_int_equal(c.vocab, 512);
    assert_int_equal(c.mamba_heads, 8);
    assert_int_equal(c.mamba_head_dim, 32);
    assert_int_equal(c.n_groups, 2);
    assert_int_equal(c.ssm_state, 16);
    assert_int_equal(c.conv_kernel, 4);
    assert_int_equal(c.d_inner, 256);
    assert_int_equal(c.conv_dim, 256 + 2 * 2 * 16);
    assert_int_equal(c.in_proj_dim, 2 * 256 + 2 * 2 * 16 + 8);
    assert_int_equal(c.n_head, 4);
    assert_int_equal(c.n_kv_head, 2);
    assert_int_equal(c.head_dim, 64);
    assert_int_equal(c.n_experts, 8);
    assert_int_equal(c.top_k, 2);
    assert_int_equal(c.moe_inter, 128);
    assert_int_equal(c.shared_inter, 192);
    assert_true(c.routed_scaling == 2.5f);
    assert_int_equal(c.n_eos, 2);
    assert_int_equal(c.eos_ids[0], 2);
    assert_int_equal(c.eos_ids[1], 11);
    assert_int_equal(c.bos_id, 1);
    assert_true(c.conv_bias);
    assert_false(c.tie_embeddings);
}

static void test_nano(void **state) {
    (void)state;
    char *t = read_text("configs/nano-30b-a3b.json", false);
    keel_config c;
    keel_err err = {0};
    assert_int_equal(keel_config_parse(&c, t, "nano-30b-a3b.json", &err), KEEL_OK);
    free(t);
    int n[256] = {0};
    for (int i = 0; i < c.n_layer; i++) n[(unsigned char)c.pattern[i]]++;
    assert_int_equal(c.n_layer, 52);
    assert_int_equal(n['M'], 23);
    assert_int_equal(n['E'], 23);
    assert_int_equal(n['*'], 6);
    assert_int_equal(c.hidden, 2688);
    assert_int_equal(c.d_inner, 64 * 64);
    assert_int_equal(c.in_proj_dim, 2 * 4096 + 2 * 8 * 128 + 64);
    assert_int_equal(c.n_experts, 128);
    assert_int_equal(c.top_k, 6);
    assert_int_equal(c.head_dim, 128);
}

typedef struct refusal {
    const char *field;  /* to set (or delete when value is NULL) */
    const char *value;  /* JSON text */
    keel_code code;
    const char *named;  /* the message must contain this */
} refusal;

static const refusal refusals[] = {
    {"model_type", NULL, KEEL_E_MISSING, "model_type"},
    {"model_type", "\"llama\"", KEEL_E_UNSUPPORTED, "model_type"},
    {"hidden_size", NULL, KEEL_E_MISSING, "hidden_size"},
    {"hidden_size", "0", KEEL_E_FORMAT, "hidden_size"},
    {"hidden_size", "\"256\"", KEEL_E_FORMAT, "hidden_size"},
    {"vocab_size", NULL, KEEL_E_MISSING, "vocab_size"},
    {"vocab_size", "12.5", KEEL_E_FORMAT, "vocab_size"},
    {"max_position_embeddings", NULL, KEEL_E_MISSING, "max_position_embeddings"},
    {"layer_norm_epsilon", NULL, KEEL_E_MISSING, "layer_norm_epsilon"},
    {"layer_norm_epsilon", "-1", KEEL_E_FORMAT, "layer_norm_epsilon"},
    {"tie_word_embeddings", "1", KEEL_E_FORMAT, "tie_word_embeddings"},
    {"num_hidden_layers", "8", KEEL_E_FORMAT, "num_hidden_layers"},
    {"mamba_num_heads", NULL, KEEL_E_MISSING, "mamba_num_heads"},
    {"mamba_head_dim", NULL, KEEL_E_MISSING, "mamba_head_dim"},
    {"n_groups", NULL, KEEL_E_MISSING, "n_groups"},
    {"n_groups", "3", KEEL_E_FORMAT, "n_groups"},
    {"ssm_state_size", NULL, KEEL_E_MISSING, "ssm_state_size"},
    {"conv_kernel", NULL, KEEL_E_MISSING, "conv_kernel"},
    {"mamba_hidden_act", "\"gelu\"", KEEL_E_UNSUPPORTED, "mamba_hidden_act"},
    {"num_attention_heads", NULL, KEEL_E_MISSING, "num_attention_heads"},
    {"num_key_value_heads", NULL, KEEL_E_MISSING, "num_key_value_heads"},
    {"num_key_value_heads", "3", KEEL_E_FORMAT, "num_key_value_heads"},
    {"intermediate_size", NULL, KEEL_E_MISSING, "intermediate_size"},
    {"mlp_hidden_act", "\"silu\"", KEEL_E_UNSUPPORTED, "mlp_hidden_act"},
    {"mlp_bias", "true", KEEL_E_UNSUPPORTED, "mlp_bias"},
    {"n_routed_experts", NULL, KEEL_E_MISSING, "n_routed_experts"},
    {"num_experts_per_tok", NULL, KEEL_E_MISSING, "num_experts_per_tok"},
    {"num_experts_per_tok", "9", KEEL_E_FORMAT, "num_experts_per_tok"},
    {"moe_intermediate_size", NULL, KEEL_E_MISSING, "moe_intermediate_size"},
    {"moe_shared_expert_intermediate_size", NULL, KEEL_E_MISSING, "moe_shared_expert_intermediate_size"},
    {"n_shared_experts", "2", KEEL_E_UNSUPPORTED, "n_shared_experts"},
    {"topk_group", "2", KEEL_E_FORMAT, "topk_group"},
    {"n_group", "3", KEEL_E_FORMAT, "n_group"},
    {"routed_scaling_factor", "0", KEEL_E_FORMAT, "routed_scaling_factor"},
    {"moe_latent_size", "64", KEEL_E_UNSUPPORTED, "moe_latent_size"},
    {"eos_token_id", "512", KEEL_E_FORMAT, "eos_token_id"},
    {"eos_token_id", "[2, \"x\"]", KEEL_E_FORMAT, "eos_token_id"},
    {"eos_token_id", "[1,2,3,4,5,6,7,8,9]", KEEL_E_RANGE, "eos_token_id"},
    {"bos_token_id", "600", KEEL_E_RANGE, "bos_token_id"},
    {"hybrid_override_pattern", "\"MEM*E-M*X\"", KEEL_E_FORMAT, "hybrid_override_pattern"},
    {"layers_block_type", "[\"mamba\"]", KEEL_E_FORMAT, "layers_block_type"},
};

static void set_field(cJSON *c, const char *field, const char *value) {
    cJSON_DeleteItemFromObjectCaseSensitive(c, field);
    if (value) {
        cJSON *v = cJSON_Parse(value);
        assert_non_null(v);
        cJSON_AddItemToObject(c, field, v);
    }
}

static void test_refusals(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof refusals / sizeof refusals[0]; i++) {
        const refusal *r = &refusals[i];
        cJSON *c = base();
        set_field(c, r->field, r->value);
        keel_config cfg;
        keel_err err = {0};
        keel_code rc = parse_json(c, &cfg, &err);
        cJSON_Delete(c);
        if (rc != r->code || !strstr(err.msg, r->named) || !strstr(err.msg, "crafted/config.json"))
            fail_msg("%s=%s: expected %s naming %s, got %s: %s", r->field, r->value ? r->value : "(deleted)",
                     keel_code_name(r->code), r->named, keel_code_name(rc), err.msg);
    }
    /* topk > the experts the selected groups hold */
    cJSON *c = base();
    set_field(c, "n_group", "4");
    set_field(c, "topk_group", "1");
    set_field(c, "num_experts_per_tok", "3");
    keel_config cfg;
    keel_err err = {0};
    assert_int_equal(parse_json(c, &cfg, &err), KEEL_E_FORMAT);
    assert_non_null(strstr(err.msg, "num_experts_per_tok"));
    cJSON_Delete(c);
    /* neither pattern field */
    c = base();
    set_field(c, "hybrid_override_pattern", NULL);
    set_field(c, "layers_block_type", NULL);
    assert_int_equal(parse_json(c, &cfg, &err), KEEL_E_MISSING);
    assert_non_null(strstr(err.msg, "hybrid_override_pattern"));
    cJSON_Delete(c);
    assert_int_equal(keel_config_parse(&cfg, "{\"model_type\": ", "broken.json", &err), KEEL_E_FORMAT);
    assert_non_null(strstr(err.msg, "broken.json"));
}

/* Fields of absent layer types are optional: no MoE and no MLP layers, their fields deleted. */
static void test_optional_sections(void **state) {
    (void)state;
    cJSON *c = base();
    set_field(c, "hybrid_override_pattern", "\"M*M\"");
    set_field(c, "layers_block_type", NULL);
    const char *gone[] = {"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "moe_shared_expert_intermediate_size", "intermediate_size", "eos_token_id"};
    for (size_t i = 0; i < sizeof gone / sizeof gone[0]; i++) set_field(c, gone[i], NULL);
    keel_config cfg;
    keel_err err = {0};
    assert_int_equal(parse_json(c, &cfg, &err), KEEL_OK);
    assert_int_equal(cfg.n_layer, 3);
    assert_int_equal(cfg.n_experts, 0);
    assert_int_equal(cfg.n_eos, 0);
    /* and no attention: attention fields optional too */
    set_field(c, "hybrid_override_pattern", "\"MM\"");
    set_field(c, "num_attention_heads", NULL);
    assert_int_equal(parse_json(c, &cfg, &err), KEEL_OK);
    assert_int_equal(cfg.n_head, 0);
    /* a single eos id */
    set_field(c, "eos_token_id", "11");
    assert_int_equal(parse_json(c, &cfg, &err), KEEL_OK);
    assert_int_equal(cfg.n_eos, 1);
    assert_int_equal(cfg.eos_ids[0], 11);
    cJSON_Delete(c);
}

static void test_patterns(void **state) {
    (void)state;
    keel_config cfg;
    keel_err err = {0};
    /* layers_block_type alone, in the older vocabulary */
    cJSON *c = base();
    set_field(c, "hybrid_override_pattern", NULL);
    set_field(c, "layers_block_type",
              "[\"mamba\",\"moe\",\"mamba\",\"attention\",\"moe\",\"mlp\",\"mamba\",\"attention\",\"moe\"]");
    assert_int_equal(parse_json(c, &cfg, &err), KEEL_OK);
    assert_string_equal(cfg.pattern, "MEM*E-M*E");
    /* newer vocabulary alongside the pattern */
    cJSON_Delete(c);
    c = base();
    assert_int_equal(parse_json(c, &cfg, &err), KEEL_OK);
    assert_string_equal(cfg.pattern, "MEM*E-M*E");
    /* the pattern alone */
    set_field(c, "layers_block_type", NULL);
    assert_int_equal(parse_json(c, &cfg, &err), KEEL_OK);
    assert_string_equal(cfg.pattern, "MEM*E-M*E");
    /* both, disagreeing at layer 3 */
    set_field(c, "layers_block_type",
              "[\"linear_attention\",\"moe\",\"linear_attention\",\"mlp\",\"moe\",\"mlp\",\"linear_attention\","
              "\"full_attention\",\"moe\"]");
    assert_int_equal(parse_json(c, &cfg, &err), KEEL_E_FORMAT);
    assert_non_null(strstr(err.msg, "hybrid_override_pattern"));
    assert_non_null(strstr(err.msg, "layers_block_type"));
    assert_non_null(strstr(err.msg, "layer 3"));
    /* both, different lengths */
    set_field(c, "layers_block_type", "[\"mamba\",\"moe\",\"mamba\"]");
    assert_int_equal(parse_json(c, &cfg, &err), KEEL_E_FORMAT);
    assert_non_null(strstr(err.msg, "layers_block_type"));
    assert_non_null(strstr(err.msg, "layer 3"));
    cJSON_Delete(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixture),   cmocka_unit_test(test_nano),     cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_optional_sections), cmocka_unit_test(test_patterns),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
