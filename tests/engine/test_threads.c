/* engine: on a synthesized model wide enough that the Mamba heads and attention heads run in parallel, results
 * are the same bits for any thread count, and a prompt equals one-token decodes bit for bit (MTP head too). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <cmocka.h>

#include "engine/engine.h"
#include "kernels/cpu/cpu.h"

/* Mamba 16 heads x 64 x state 64 (65536 state values per token) and 8 attention heads of 128: both past the
 * engine's threshold for parallel heads. */
static const char *CONFIG =
    "{\"model_type\": \"nemotron_h\", \"hidden_size\": 512, \"vocab_size\": 512, \"max_position_embeddings\": 512,"
    " \"layer_norm_epsilon\": 1e-5, \"tie_word_embeddings\": false, \"hybrid_override_pattern\": \"M*E\","
    " \"num_hidden_layers\": 3, \"mamba_num_heads\": 16, \"mamba_head_dim\": 64, \"n_groups\": 2,"
    " \"ssm_state_size\": 64, \"conv_kernel\": 4, \"use_conv_bias\": true, \"mamba_proj_bias\": false,"
    " \"num_attention_heads\": 8, \"num_key_value_heads\": 2, \"head_dim\": 128, \"attention_bias\": false,"
    " \"intermediate_size\": 256, \"mlp_bias\": false, \"n_routed_experts\": 8, \"n_shared_experts\": 1,"
    " \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 128, \"moe_shared_expert_intermediate_size\": 128,"
    " \"n_group\": 2, \"topk_group\": 1, \"norm_topk_prob\": true, \"routed_scaling_factor\": 2.5,"
    " \"num_nextn_predict_layers\": 1, \"bos_token_id\": 1, \"eos_token_id\": 2, \"pad_token_id\": 0}";

enum { N = 80, V = 512, H = 512 };

static keel_model g_model;

static int setup(void **state) {
    (void)state;
    const char *tmp = getenv("KEEL_TMP");
    if (!tmp) {
        print_message("KEEL_TMP is not set\n");
        return -1;
    }
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/engine_threads_model", tmp);
    keel_synth_opts o = {.bits = 4, .group = 64, .sdt = KEEL_DT_BF16, .mtp_bits = 6, .seed = 11};
    keel_err err = {0};
    if (keel_synth_write(CONFIG, dir, &o, &err) != KEEL_OK || keel_model_load(&g_model, dir, NULL, &err) != KEEL_OK) {
        print_message("synth: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    keel_model_free(&g_model);
    return 0;
}

/* All logits and hidden states, then the MTP head's logits, for the tokens in steps of `step`. */
static void run(int threads, int step, float *lg, float *hd, float *ml) {
    keel_cpu_set_threads(threads);
    keel_engine e;
    keel_err err = {0};
    int toks[N];
    for (int i = 0; i < N; i++) toks[i] = (i * 131 + 17) % V;
    assert_int_equal(keel_engine_init(&e, &g_model, N, &err), KEEL_OK);
    for (int at = 0; at < N; at += step) {
        int m = KEEL_MIN(step, N - at);
        assert_int_equal(keel_engine_forward(&e, toks + at, m, lg + (size_t)at * V, KEEL_LOGITS_ALL,
                                             hd + (size_t)at * H, &err),
                         KEEL_OK);
    }
    for (int at = 0; at < N - 1; at += step) {
        int m = KEEL_MIN(step, N - 1 - at);
        assert_int_equal(keel_engine_mtp(&e, hd + (size_t)at * H, toks + at + 1, m, ml + (size_t)at * V, NULL, &err),
                         KEEL_OK);
    }
    keel_engine_free(&e);
}

static void test_threads_and_steps(void **state) {
    (void)state;
    assert_true(g_model.has_mtp);
    size_t nl = (size_t)N * V, nh = (size_t)N * H;
    float *l1 = malloc(nl * 4), *h1 = malloc(nh * 4), *m1 = malloc(nl * 4);
    float *l2 = malloc(nl * 4), *h2 = malloc(nh * 4), *m2 = malloc(nl * 4);
    run(1, N, l1, h1, m1);
    run(2, N, l2, h2, m2);
    assert_memory_equal(l1, l2, nl * 4);
    assert_memory_equal(m1, m2, (nl - V) * 4);
    run(2, 1, l2, h2, m2);
    assert_memory_equal(l1, l2, nl * 4);
    assert_memory_equal(h1, h2, nh * 4);
    assert_memory_equal(m1, m2, (nl - V) * 4);
    run(2, 7, l2, h2, m2);
    assert_memory_equal(l1, l2, nl * 4);
    float mx = 0.0f;
    for (size_t i = 0; i < nl; i++) mx = KEEL_MAX(mx, l1[i] < 0 ? -l1[i] : l1[i]);
    assert_true(mx > 0.0f && mx < 1e4f); /* a live computation, not zeros or overflow */
    free(l1);
    free(h1);
    free(m1);
    free(l2);
    free(h2);
    free(m2);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_threads_and_steps)};
    return cmocka_run_group_tests(tests, setup, teardown);
}
