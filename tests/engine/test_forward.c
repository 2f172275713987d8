/* engine: the CPU forward pass, the MTP head and greedy generation against the independent float64 reference
 * (../shared/fixtures/nemotron_h_tiny/reference.safetensors, made with transformers), plus prefill against
 * decode bit for bit, and the context and eos stops. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <cmocka.h>

#include "engine/engine.h"
#include "kernels/cpu/cpu.h"
#include "common/testkit.h"

typedef tk_ref fx;

static int setup(void **state) {
    keel_cpu_set_threads(1); /* results do not depend on it; test machines are small and shared */
    return tk_ref_setup(state);
}

static void test_teacher_forced(void **state) {
    fx *f = *state;
    const keel_config *c = &f->model.cfg;
    keel_engine e;
    keel_err err = {0};
    assert_int_equal(keel_engine_init(&e, &f->model, 64, &err), KEEL_OK);
    float *lg = malloc((size_t)f->n_tok * c->vocab * sizeof(float));
    float *hd = malloc((size_t)f->n_tok * c->hidden * sizeof(float));
    assert_int_equal(keel_engine_forward(&e, f->tokens, f->n_tok, lg, KEEL_LOGITS_ALL, hd, &err), KEEL_OK);
    float dl = tk_max_abs_diff(lg, f->logits, (size_t)f->n_tok * c->vocab);
    float dh = tk_max_abs_diff(hd, f->hidden, (size_t)f->n_tok * c->hidden);
    print_message("teacher-forced: max |logits - ref| %.3g, max |hidden - ref| %.3g\n", dl, dh);
    assert_true(dl <= 1e-3f);
    assert_true(dh <= 1e-3f);
    for (int i = 0; i < f->n_tok; i++)
        assert_int_equal(keel_argmax(lg + (size_t)i * c->vocab, c->vocab),
                         keel_argmax(f->logits + (size_t)i * c->vocab, c->vocab));
    free(lg);
    free(hd);
    keel_engine_free(&e);
}

/* Runs the tokens in pieces of the given sizes (cycled) and returns all logits and hidden states. */
static void run_split(fx *f, keel_engine *e, const int *sizes, int n_sizes, float *lg, float *hd) {
    const keel_config *c = &f->model.cfg;
    keel_err err = {0};
    keel_engine_reset(e);
    for (int at = 0, s = 0; at < f->n_tok; s++) {
        int m = KEEL_MIN(sizes[s % n_sizes], f->n_tok - at);
        assert_int_equal(keel_engine_forward(e, f->tokens + at, m, lg + (size_t)at * c->vocab, KEEL_LOGITS_ALL,
                                             hd + (size_t)at * c->hidden, &err),
                         KEEL_OK);
        at += m;
    }
    assert_int_equal(e->pos, f->n_tok);
}

static void test_prefill_equals_decode(void **state) {
    fx *f = *state;
    const keel_config *c = &f->model.cfg;
    keel_engine e;
    keel_err err = {0};
    assert_int_equal(keel_engine_init(&e, &f->model, 64, &err), KEEL_OK);
    size_t nl = (size_t)f->n_tok * c->vocab, nh = (size_t)f->n_tok * c->hidden;
    float *l1 = malloc(nl * sizeof(float)), *h1 = malloc(nh * sizeof(float));
    float *l2 = malloc(nl * sizeof(float)), *h2 = malloc(nh * sizeof(float));
    const int whole[] = {48}, ones[] = {1}, mixed[] = {5, 1, 30, 2, 7};
    run_split(f, &e, whole, 1, l1, h1);
    run_split(f, &e, ones, 1, l2, h2);
    print_message("prefill vs decode: max |diff| %.3g\n", tk_max_abs_diff(l1, l2, nl));
    assert_true(tk_max_abs_diff(l1, l2, nl) <= 1e-4f);
    assert_memory_equal(l1, l2, nl * sizeof(float)); /* bit-identical: same per-token arithmetic */
    assert_memory_equal(h1, h2, nh * sizeof(float));
    run_split(f, &e, mixed, 5, l2, h2);
    assert_memory_equal(l1, l2, nl * sizeof(float));
    /* the last-logits mode gives the last row of the full computation */
    float *last = malloc((size_t)c->vocab * sizeof(float));
    keel_engine_reset(&e);
    assert_int_equal(keel_engine_forward(&e, f->tokens, f->n_tok, last, KEEL_LOGITS_LAST, NULL, &err), KEEL_OK);
    assert_memory_equal(last, l1 + (size_t)(f->n_tok - 1) * c->vocab, (size_t)c->vocab * sizeof(float));
    free(last);
    free(l1);
    free(h1);
    free(l2);
    free(h2);
    keel_engine_free(&e);
}

typedef struct collect {
    int ids[256];
    int64_t pos[256];
    int n;
} collect;

static int on_token(void *user, int tok, int64_t pos) {
    collect *c = user;
    if (c->n < 256) {
        c->ids[c->n] = tok;
        c->pos[c->n] = pos;
    }
    c->n++;
    return 0;
}

static void test_greedy_generation(void **state) {
    fx *f = *state;
    const int n_greedy = 24;
    const int32_t *want = tk_st_tensor(&f->ref, "greedy_tokens", KEEL_DT_I32, n_greedy);
    assert_true(f->prompt_len > 0 && f->prompt_len < f->n_tok);
    keel_engine e;
    keel_err err = {0};
    assert_int_equal(keel_engine_init(&e, &f->model, 128, &err), KEEL_OK);
    keel_gen_opts o = {.n_predict = n_greedy, .samp = {.temp = 0.0f}};
    collect got = {0};
    keel_gen_result res;
    assert_int_equal(keel_generate(&e, f->tokens, f->prompt_len, &o, on_token, &got, &res, &err), KEEL_OK);
    assert_int_equal(res.stop, KEEL_STOP_LENGTH);
    assert_int_equal(res.n_gen, n_greedy);
    assert_int_equal(got.n, n_greedy);
    for (int i = 0; i < n_greedy; i++) {
        assert_int_equal(got.ids[i], want[i]);
        assert_int_equal(got.pos[i], f->prompt_len + i);
    }
    keel_engine_free(&e);
}

static void test_eos_stop(void **state) {
    fx *f = *state;
    const int32_t *greedy = tk_st_tensor(&f->ref, "greedy_tokens", KEEL_DT_I32, 24);
    keel_engine e;
    keel_err err = {0};
    assert_int_equal(keel_engine_init(&e, &f->model, 128, &err), KEEL_OK);
    /* treat the 6th greedy token as end of sequence: five tokens come out, the sixth stops it */
    int eos[2] = {9999, greedy[5]};
    int first = 0;
    while (greedy[first] != greedy[5]) first++;
    keel_gen_opts o = {.n_predict = 24, .samp = {.temp = 0.0f}, .eos = eos, .n_eos = 2};
    collect got = {0};
    keel_gen_result res;
    assert_int_equal(keel_generate(&e, f->tokens, f->prompt_len, &o, on_token, &got, &res, &err), KEEL_OK);
    assert_int_equal(res.stop, KEEL_STOP_EOS);
    assert_int_equal(res.stop_token, greedy[5]);
    assert_int_equal(res.n_gen, first);
    assert_int_equal(got.n, first);
    keel_engine_free(&e);
}

static void test_context_limit(void **state) {
    fx *f = *state;
    const int32_t *greedy = tk_st_tensor(&f->ref, "greedy_tokens", KEEL_DT_I32, 24);
    keel_engine e;
    keel_err err = {0};
    const int ctx = f->prompt_len + 4;
    assert_int_equal(keel_engine_init(&e, &f->model, ctx, &err), KEEL_OK);
    keel_gen_opts o = {.n_predict = 24, .samp = {.temp = 0.0f}};
    collect got = {0};
    keel_gen_result res;
    assert_int_equal(keel_generate(&e, f->tokens, f->prompt_len, &o, on_token, &got, &res, &err), KEEL_OK);
    assert_int_equal(res.stop, KEEL_STOP_CONTEXT);
    assert_int_equal(res.n_gen, 4); /* the sequence fills the context exactly */
    for (int i = 0; i < 4; i++) assert_int_equal(got.ids[i], greedy[i]);
    /* a prompt longer than the context is refused, naming both numbers */
    assert_int_equal(keel_generate(&e, f->tokens, ctx + 1, &o, on_token, &got, &res, &err), KEEL_E_RANGE);
    char a[32], b[32];
    snprintf(a, sizeof a, "%d", ctx + 1);
    snprintf(b, sizeof b, "%d", ctx);
    assert_non_null(strstr(err.msg, a));
    assert_non_null(strstr(err.msg, b));
    /* forward past the context is refused before anything runs */
    keel_engine_reset(&e);
    assert_int_equal(keel_engine_forward(&e, f->tokens, ctx, NULL, KEEL_LOGITS_NONE, NULL, &err), KEEL_OK);
    assert_int_equal(keel_engine_forward(&e, f->tokens, 1, NULL, KEEL_LOGITS_NONE, NULL, &err), KEEL_E_RANGE);
    assert_int_equal(e.pos, ctx);
    keel_engine_free(&e);
}

static void test_bad_token(void **state) {
    fx *f = *state;
    keel_engine e;
    keel_err err = {0};
    assert_int_equal(keel_engine_init(&e, &f->model, 16, &err), KEEL_OK);
    int toks[3] = {5, f->model.cfg.vocab, 7};
    assert_int_equal(keel_engine_forward(&e, toks, 3, NULL, KEEL_LOGITS_NONE, NULL, &err), KEEL_E_RANGE);
    assert_non_null(strstr(err.msg, "512"));
    assert_int_equal(e.pos, 0);
    toks[1] = -3;
    assert_int_equal(keel_engine_forward(&e, toks, 3, NULL, KEEL_LOGITS_NONE, NULL, &err), KEEL_E_RANGE);
    assert_non_null(strstr(err.msg, "-3"));
    keel_engine e0;
    assert_int_equal(keel_engine_init(&e0, &f->model, 0, &err), KEEL_E_ARG);
    keel_engine_free(&e0);
    keel_engine_free(&e);
}

static void test_mtp(void **state) {
    fx *f = *state;
    const keel_config *c = &f->model.cfg;
    assert_true(f->model.has_mtp);
    const int n = f->n_tok - 1;
    const float *want = tk_st_tensor(&f->ref, "mtp_logits", KEEL_DT_F32, (int64_t)n * c->vocab);
    const float *want_h = tk_st_tensor(&f->ref, "mtp_hidden", KEEL_DT_F32, (int64_t)n * c->hidden);
    keel_engine e;
    keel_err err = {0};
    assert_int_equal(keel_engine_init(&e, &f->model, 64, &err), KEEL_OK);
    float *hd = malloc((size_t)f->n_tok * c->hidden * sizeof(float));
    assert_int_equal(keel_engine_forward(&e, f->tokens, f->n_tok, NULL, KEEL_LOGITS_NONE, hd, &err), KEEL_OK);
    size_t nl = (size_t)n * c->vocab;
    float *l1 = malloc(nl * sizeof(float)), *l2 = malloc(nl * sizeof(float));
    float *o1 = malloc((size_t)n * c->hidden * sizeof(float));
    assert_int_equal(keel_engine_mtp(&e, hd, f->tokens + 1, n, l1, o1, &err), KEEL_OK);
    float d = tk_max_abs_diff(l1, want, nl), dh = tk_max_abs_diff(o1, want_h, (size_t)n * c->hidden);
    print_message("mtp: max |logits - ref| %.3g, max |hidden - ref| %.3g\n", d, dh);
    assert_true(d <= 1e-3f);
    assert_true(dh <= 1e-3f);
    for (int i = 0; i < n; i++)
        assert_int_equal(keel_argmax(l1 + (size_t)i * c->vocab, c->vocab), keel_argmax(want + (size_t)i * c->vocab, c->vocab));
    /* position by position gives the same bits */
    keel_engine_reset(&e);
    for (int i = 0; i < n; i++)
        assert_int_equal(
            keel_engine_mtp(&e, hd + (size_t)i * c->hidden, f->tokens + 1 + i, 1, l2 + (size_t)i * c->vocab, NULL, &err),
            KEEL_OK);
    assert_memory_equal(l1, l2, nl * sizeof(float));
    free(l1);
    free(l2);
    free(o1);
    free(hd);
    keel_engine_free(&e);
}

/* Prompts longer than one pass (KEEL_ENGINE_CHUNK rows) give the bits of one-token decodes across the seams. */
static void test_long_prompt_chunks(void **state) {
    fx *f = *state;
    const keel_config *c = &f->model.cfg;
    enum { N = 2 * KEEL_ENGINE_CHUNK + 21 };
    int toks[N];
    for (int i = 0; i < N; i++) toks[i] = f->tokens[(i * 7) % f->n_tok] ^ (i & 3);
    keel_engine e;
    keel_err err = {0};
    assert_int_equal(keel_engine_init(&e, &f->model, N, &err), KEEL_OK);
    float *l1 = malloc((size_t)N * c->vocab * sizeof(float)), *l2 = malloc((size_t)N * c->vocab * sizeof(float));
    assert_int_equal(keel_engine_forward(&e, toks, N, l1, KEEL_LOGITS_ALL, NULL, &err), KEEL_OK);
    keel_engine_reset(&e);
    for (int i = 0; i < N; i++)
        assert_int_equal(keel_engine_forward(&e, toks + i, 1, l2 + (size_t)i * c->vocab, KEEL_LOGITS_ALL, NULL, &err),
                         KEEL_OK);
    assert_memory_equal(l1, l2, (size_t)N * c->vocab * sizeof(float));
    free(l1);
    free(l2);
    keel_engine_free(&e);
}

static void test_mtp_absent(void **state) {
    fx *f = *state;
    keel_model m;
    keel_err err = {0};
    assert_int_equal(keel_model_load(&m, f->dir, "", &err), KEEL_OK);
    assert_false(m.has_mtp);
    keel_engine e;
    assert_int_equal(keel_engine_init(&e, &m, 8, &err), KEEL_OK);
    float h[256] = {0}, lg[512];
    int next = 3;
    assert_int_equal(keel_engine_mtp(&e, h, &next, 1, lg, NULL, &err), KEEL_E_MISSING);
    assert_non_null(strstr(err.msg, "MTP"));
    keel_engine_free(&e);
    keel_model_free(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_teacher_forced), cmocka_unit_test(test_prefill_equals_decode),
        cmocka_unit_test(test_greedy_generation), cmocka_unit_test(test_eos_stop),
        cmocka_unit_test(test_context_limit), cmocka_unit_test(test_bad_token),
        cmocka_unit_test(test_mtp), cmocka_unit_test(test_long_prompt_chunks),
        cmocka_unit_test(test_mtp_absent),
    };
    return cmocka_run_group_tests(tests, setup, tk_ref_teardown);
}
