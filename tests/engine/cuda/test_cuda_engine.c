/* engine/cuda: the GPU engine on nemotron_h_tiny against the float64 reference and the CPU engine: teacher-forced
 * logits within the bf16-activation bound, top-1 at every position, greedy tokens, the MTP head; with fp32
 * activations within 1e-3; windows of 1..8 rows bit-identical to one-token decodes; errors for bad tokens, a context that is too long and a checkpoint that
 * does not fit. Skips (77) without CUDA or a device.
 *
 * The bound: activations into the stream tiles are rounded to bf16 (relative error <= 2^-8 each: 8 significant
 * bits). A logit's error is at most about hops * 2^-8 * S, S = max over the vocabulary of sum_i |h_i W_vi| (the lm_head product's
 * magnitude), hops = the bf16 roundings on the deepest path (two per layer: the mixer input and its inner
 * activation, plus the lm_head input); the norms keep each layer's gain near one. The MTP head adds its own four. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/engine.h"
#include "kernels/cpu/cpu.h"
#include "common/testkit.h"

#ifdef KEEL_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#include "engine/cuda/ecuda.h"
#include "contract/audit.h"

typedef tk_ref fx;

/* S of each row of h (n, hidden): max over the vocabulary of sum_i |h_i W_vi| with W the dequantized lm_head. */
static void lm_magnitude(const keel_model *m, const float *h, int n, double *S) {
    const int H = m->cfg.hidden, V = m->cfg.vocab;
    float *row = malloc((size_t)H * sizeof(float));
    for (int p = 0; p < n; p++) S[p] = 0.0;
    for (int v = 0; v < V; v++) {
        keel_quant_dequantize_row(&m->lm_head, v, row);
        for (int p = 0; p < n; p++) {
            double s = 0.0;
            for (int i = 0; i < H; i++) s += fabs((double)h[(size_t)p * H + i] * row[i]);
            if (s > S[p]) S[p] = s;
        }
    }
    free(row);
}

/* Checks got against want within hops * 2^-8 * S per position; prints the worst fraction of the bound used. */
static void within_bound(const char *what, const keel_model *m, const float *got, const float *want,
                         const float *h, int n, int hops) {
    const int V = m->cfg.vocab;
    double *S = malloc((size_t)n * sizeof(double));
    lm_magnitude(m, h, n, S);
    double worst = 0.0, maxd = 0.0, sum = 0.0;
    for (int p = 0; p < n; p++) {
        const double bound = hops * ldexp(1.0, -8) * S[p];
        for (int v = 0; v < V; v++) {
            double d = fabs((double)got[(size_t)p * V + v] - want[(size_t)p * V + v]);
            assert_false(d != d);
            sum += d;
            if (d > maxd) maxd = d;
            if (d / bound > worst) worst = d / bound;
        }
    }
    print_message("%s: max |d| %.4g, mean |d| %.4g, worst %.1f%% of the bound (%d hops x 2^-8 x S)\n", what, maxd,
                  sum / ((double)n * V), 100.0 * worst, hops);
    assert_true(worst <= 1.0);
    free(S);
}

static void test_teacher_forced(void **state) {
    fx *f = *state;
    const keel_config *c = &f->model.cfg;
    const int n = f->n_tok, V = c->vocab, H = c->hidden, hops = 2 * c->n_layer + 1;
    keel_cuda_engine *e = NULL;
    keel_err err = {0};
    assert_int_equal(keel_cuda_engine_init(&e, &f->model, 64, &err), KEEL_OK);
    float *lg = malloc((size_t)n * V * sizeof(float)), *hd = malloc((size_t)n * H * sizeof(float));
    keel_engine ce;
    assert_int_equal(keel_engine_init(&ce, &f->model, 64, &err), KEEL_OK);
    float *cl = malloc((size_t)n * V * sizeof(float));
    assert_int_equal(keel_engine_forward(&ce, f->tokens, n, cl, KEEL_LOGITS_ALL, NULL, &err), KEEL_OK);
    /* exact windows of 8 rows, then 64-row prompt chunks (the chunked Mamba scan): the same bound and top-1 */
    const int rows[2] = {8, 64};
    for (int w = 0; w < 2; w++) {
        keel_cuda_engine_reset(e);
        keel_cuda_engine_set_window(e, rows[w]);
        assert_int_equal(keel_cuda_engine_forward(e, f->tokens, n, lg, KEEL_LOGITS_ALL, hd, &err), KEEL_OK);
        char what[96];
        snprintf(what, sizeof what, "teacher-forced logits, %d-row windows, vs reference", rows[w]);
        within_bound(what, &f->model, lg, f->logits, f->hidden, n, hops);
        snprintf(what, sizeof what, "teacher-forced logits, %d-row windows, vs CPU engine", rows[w]);
        within_bound(what, &f->model, lg, cl, f->hidden, n, hops);
        for (int i = 0; i < n; i++)
            assert_int_equal(keel_argmax(lg + (size_t)i * V, V), keel_argmax(f->logits + (size_t)i * V, V));
    }
    keel_engine_free(&ce);
    free(cl);
    free(lg);
    free(hd);
    keel_cuda_engine_free(e);
}

/* Windows of every size from 1 to 8 rows, and one-token decodes, give the same bits, model and MTP head. */
static void test_windows_bit_identical(void **state) {
    fx *f = *state;
    const keel_config *c = &f->model.cfg;
    const int n = f->n_tok, V = c->vocab, H = c->hidden;
    keel_cuda_engine *e = NULL;
    keel_err err = {0};
    assert_int_equal(keel_cuda_engine_init(&e, &f->model, 64, &err), KEEL_OK);
    const size_t nl = (size_t)n * V;
    float *ref = malloc(nl * sizeof(float)), *got = malloc(nl * sizeof(float));
    float *h = malloc((size_t)n * H * sizeof(float)), *mref = malloc(nl * sizeof(float));
    float *mgot = malloc(nl * sizeof(float));
    keel_cuda_engine_set_window(e, 1);
    for (int i = 0; i < n; i++)
        assert_int_equal(keel_cuda_engine_forward(e, f->tokens + i, 1, ref + (size_t)i * V, KEEL_LOGITS_LAST,
                                                  h + (size_t)i * H, &err), KEEL_OK);
    for (int i = 0; i < n - 1; i++)
        assert_int_equal(keel_cuda_engine_mtp(e, h + (size_t)i * H, f->tokens + 1 + i, 1, mref + (size_t)i * V, NULL,
                                              &err), KEEL_OK);
    for (int w = 2; w <= 8; w++) {
        keel_cuda_engine_reset(e);
        keel_cuda_engine_set_window(e, w);
        memset(got, 0, nl * sizeof(float));
        assert_int_equal(keel_cuda_engine_forward(e, f->tokens, n, got, KEEL_LOGITS_ALL, NULL, &err), KEEL_OK);
        assert_memory_equal(got, ref, nl * sizeof(float));
        assert_int_equal(keel_cuda_engine_mtp(e, h, f->tokens + 1, n - 1, mgot, NULL, &err), KEEL_OK);
        assert_memory_equal(mgot, mref, (size_t)(n - 1) * V * sizeof(float));
    }
    print_message("windows of 1..8 rows: logits and MTP logits bit-identical to one-token steps\n");
    free(ref), free(got), free(h), free(mref), free(mgot);
    keel_cuda_engine_free(e);
}

typedef struct collect {
    int ids[64];
    int64_t pos[64];
    int n;
} collect;

static int on_token(void *user, int tok, int64_t pos) {
    collect *c = user;
    if (c->n < 64) c->ids[c->n] = tok, c->pos[c->n] = pos;
    c->n++;
    return 0;
}

static void test_greedy(void **state) {
    fx *f = *state;
    const int n_greedy = 24;
    const int32_t *want = tk_st_tensor(&f->ref, "greedy_tokens", KEEL_DT_I32, n_greedy);
    keel_cuda_engine *e = NULL;
    keel_err err = {0};
    assert_int_equal(keel_cuda_engine_init(&e, &f->model, 128, &err), KEEL_OK);
    keel_gen_opts o = {.n_predict = n_greedy, .samp = {.temp = 0.0f}};
    collect got = {0};
    keel_gen_result res;
    assert_int_equal(keel_cuda_generate(e, f->tokens, f->prompt_len, &o, on_token, &got, &res, &err), KEEL_OK);
    assert_int_equal(res.stop, KEEL_STOP_LENGTH);
    assert_int_equal(got.n, n_greedy);
    for (int i = 0; i < n_greedy; i++) {
        assert_int_equal(got.ids[i], want[i]);
        assert_int_equal(got.pos[i], f->prompt_len + i);
    }
    /* the seeded sampler: a replay draws the same tokens; the CPU engine's draws are reported (its logits differ
     * by the bf16 rounding, so a draw near a boundary of the inverse CDF may differ) */
    keel_engine ce;
    assert_int_equal(keel_engine_init(&ce, &f->model, 128, &err), KEEL_OK);
    keel_gen_opts s = {.n_predict = 16, .samp = {.temp = 0.8f, .top_p = 0.95f, .min_p = 0.0f, .seed = 7}};
    collect a = {0}, a2 = {0}, b = {0};
    assert_int_equal(keel_cuda_generate(e, f->tokens, f->prompt_len, &s, on_token, &a, &res, &err), KEEL_OK);
    assert_int_equal(keel_cuda_generate(e, f->tokens, f->prompt_len, &s, on_token, &a2, &res, &err), KEEL_OK);
    assert_int_equal(keel_generate(&ce, f->tokens, f->prompt_len, &s, on_token, &b, &res, &err), KEEL_OK);
    assert_int_equal(a.n, a2.n);
    assert_memory_equal(a.ids, a2.ids, sizeof a.ids);
    int same = 0;
    for (int i = 0; i < a.n && i < b.n; i++) same += a.ids[i] == b.ids[i];
    print_message("seeded sampling: replay identical; %d of %d tokens equal to the CPU engine's draws\n", same, a.n);
    keel_engine_free(&ce);
    keel_cuda_engine_free(e);
}

/* Decode steps replayed from the captured CUDA graph give the tokens of launch-by-launch steps, greedy and seeded,
 * also after the draw changes (a new capture) and in fp32 activations mode. */
static void test_graphs_same_tokens(void **state) {
    fx *f = *state;
    keel_cuda_engine *e = NULL;
    keel_err err = {0};
    assert_int_equal(keel_cuda_engine_init(&e, &f->model, 128, &err), KEEL_OK);
    const keel_gen_opts opts[3] = {
        {.n_predict = 40, .samp = {.temp = 0.0f}},
        {.n_predict = 40, .samp = {.temp = 0.9f, .top_k = 50, .top_p = 0.95f, .seed = 11}},
        {.n_predict = 40, .samp = {.temp = 1.3f, .min_p = 0.02f, .seed = 12}},
    };
    for (int f32 = 0; f32 < 2; f32++) {
        assert_int_equal(keel_cuda_engine_set_activations(e, f32 ? KEEL_DT_F32 : KEEL_DT_BF16, &err), KEEL_OK);
        for (int i = 0; i < 3; i++) {
            collect on = {0}, off = {0};
            keel_gen_result r1, r2;
            keel_cuda_engine_set_graphs(e, true);
            assert_int_equal(keel_cuda_generate(e, f->tokens, f->prompt_len, &opts[i], on_token, &on, &r1, &err), KEEL_OK);
            keel_cuda_engine_set_graphs(e, false);
            assert_int_equal(keel_cuda_generate(e, f->tokens, f->prompt_len, &opts[i], on_token, &off, &r2, &err), KEEL_OK);
            assert_int_equal(on.n, 40);
            assert_int_equal(on.n, off.n);
            assert_memory_equal(on.ids, off.ids, sizeof on.ids);
            assert_memory_equal(on.pos, off.pos, sizeof on.pos);
        }
    }
    print_message("graphs on and off: the same 40 tokens for greedy and two seeded draws, bf16 and f32 activations\n");
    keel_cuda_engine_free(e);
}

/* The second stream and programmatic dependent launch change scheduling only, and the fused router, the route window,
 * the fused Mamba step, the norm in the router's matvec and the packed tile's copies give the bits of the launches
 * they replace: logits of windows and prompt chunks, MTP logits and graph-replayed greedy tokens are bit-identical
 * with the second stream off, on and at low priority, with each fusion off, with the packed tile off and with
 * dependent launch off (the engine's kernels, then the tiles too). */
static void test_scheduling_same_bits(void **state) {
    fx *f = *state;
    const keel_config *c = &f->model.cfg;
    const int n = f->n_tok, V = c->vocab, H = c->hidden;
    keel_cuda_engine *e = NULL;
    keel_err err = {0};
    keel_cuda_engine_pack_scope(KEEL_CUDA_ENGINE_PACK_ALL); /* the fixture's matrices are all small */
    assert_int_equal(keel_cuda_engine_init(&e, &f->model, 128, &err), KEEL_OK);
    keel_cuda_engine_pack_scope(KEEL_CUDA_ENGINE_PACK_LARGE);
    const size_t nl = (size_t)n * V;
    /* the fixture's hidden size keeps every plain matrix unsplit: most of them get a packed copy */
    assert_true(keel_cuda_engine_packed_count(e) >= 8);
    enum { NCFG = 9 };
    static const int cfg[NCFG][8] = {{0, 0, 0, 0, 1, 1, 0, 0}, {1, 1, 1, 1, 1, 1, 1, 1}, {2, 1, 1, 1, 1, 1, 1, 1},
                                     {1, 0, 1, 1, 1, 1, 1, 1}, {1, 1, 0, 1, 1, 1, 1, 1}, {1, 0, 0, 1, 1, 1, 1, 1},
                                     {1, 0, 0, 1, 0, 1, 1, 1}, {1, 0, 0, 1, 0, 0, 1, 1}, {1, 0, 0, 1, 1, 1, 1, 0}};
    /* side, fused router, fused Mamba step, route window (top-k and unions in one launch), the engine kernels' and
     * the stream tiles' programmatic dependent launch, the norm in the router's matvec, the packed tile */
    float *logits[NCFG], *mtp[NCFG], *h = malloc((size_t)n * H * sizeof(float));
    collect toks[NCFG];
    memset(toks, 0, sizeof toks);
    const keel_gen_opts o = {.n_predict = 32, .samp = {.temp = 0.0f}};
    for (int mode = 0; mode < NCFG; mode++) {
        logits[mode] = calloc(nl * 2, sizeof(float));
        mtp[mode] = calloc(nl, sizeof(float));
        keel_cuda_engine_set_side(e, cfg[mode][0]);
        keel_cuda_engine_set_fused_router(e, cfg[mode][1]);
        keel_cuda_engine_set_fused_mamba(e, cfg[mode][2]);
        keel_cuda_engine_set_route_window(e, cfg[mode][3]);
        keel_cuda_engine_set_fused_norm(e, cfg[mode][6]);
        keel_cuda_engine_set_packed(e, cfg[mode][7]);
        keel_ecu_set_pdl(cfg[mode][4]);
        keel_cuda_stream_pdl(cfg[mode][5]);
        for (int w = 0; w < 2; w++) { /* exact 8-row windows, then 64-row prompt chunks */
            keel_cuda_engine_reset(e);
            keel_cuda_engine_set_window(e, w ? 64 : 8);
            assert_int_equal(keel_cuda_engine_forward(e, f->tokens, n, logits[mode] + (size_t)w * nl, KEEL_LOGITS_ALL,
                                                      w ? NULL : h, &err), KEEL_OK);
        }
        assert_int_equal(keel_cuda_engine_mtp(e, h, f->tokens + 1, n - 1, mtp[mode], NULL, &err), KEEL_OK);
        keel_gen_result r;
        keel_cuda_engine_set_graphs(e, false); /* a new capture: the launch knobs are global, not the engine's */
        keel_cuda_engine_set_graphs(e, true);
        assert_int_equal(keel_cuda_generate(e, f->tokens, f->prompt_len, &o, on_token, &toks[mode], &r, &err), KEEL_OK);
        assert_int_equal(toks[mode].n, 32);
    }
    keel_ecu_set_pdl(KEEL_ECU_PDL_DEFAULT);
    keel_cuda_stream_pdl(KEEL_CUDA_STREAM_PDL_DEFAULT);
    for (int mode = 1; mode < NCFG; mode++) {
        assert_memory_equal(logits[mode], logits[0], nl * 2 * sizeof(float));
        assert_memory_equal(mtp[mode], mtp[0], (size_t)(n - 1) * V * sizeof(float));
        assert_memory_equal(toks[mode].ids, toks[0].ids, sizeof toks[0].ids);
    }
    print_message("second stream off, on and at low priority, fused router, route window, Mamba step, the norm in "
                  "the router, the packed tile (%d matrices) and dependent launches on and off: logits (8-row windows, "
                  "64-row chunks), MTP logits and 32 graph-replayed greedy tokens bit-identical\n",
                  keel_cuda_engine_packed_count(e));
    for (int mode = 0; mode < NCFG; mode++) free(logits[mode]), free(mtp[mode]);
    free(h);
    keel_cuda_engine_free(e);
}

static void test_mtp(void **state) {
    fx *f = *state;
    const keel_config *c = &f->model.cfg;
    const int n = f->n_tok - 1, V = c->vocab, H = c->hidden;
    const float *want = tk_st_tensor(&f->ref, "mtp_logits", KEEL_DT_F32, (int64_t)n * V);
    const float *want_h = tk_st_tensor(&f->ref, "mtp_hidden", KEEL_DT_F32, (int64_t)n * H);
    keel_cuda_engine *e = NULL;
    keel_err err = {0};
    assert_int_equal(keel_cuda_engine_init(&e, &f->model, 64, &err), KEEL_OK);
    float *hd = malloc((size_t)f->n_tok * H * sizeof(float));
    assert_int_equal(keel_cuda_engine_forward(e, f->tokens, f->n_tok, NULL, KEEL_LOGITS_NONE, hd, &err), KEEL_OK);
    float *l = malloc((size_t)n * V * sizeof(float));
    assert_int_equal(keel_cuda_engine_mtp(e, hd, f->tokens + 1, n, l, NULL, &err), KEEL_OK);
    within_bound("MTP logits vs reference", &f->model, l, want, want_h, n, 2 * c->n_layer + 1 + 4);
    /* top-1 is held where the reference's top-2 margin is at least 0.044, the smallest margin of the model's own
     * logits (fixture README); the head's smallest margins (0.017, 0.018, 0.025) are below the bf16 deviation */
    int agree = 0, held = 0;
    for (int i = 0; i < n; i++) {
        const float *w = want + (size_t)i * V;
        const int top = keel_argmax(w, V);
        float second = -INFINITY;
        for (int v = 0; v < V; v++)
            if (v != top && w[v] > second) second = w[v];
        const bool same = keel_argmax(l + (size_t)i * V, V) == top;
        agree += same;
        if (w[top] - second >= 0.044f) {
            held++;
            assert_true(same);
        }
    }
    print_message("MTP top-1 equal to the reference at %d of %d positions (all %d with margin >= 0.044)\n", agree, n,
                  held);
    assert_true(held >= n - 3);
    free(l);
    free(hd);
    keel_cuda_engine_free(e);
}

/* fp32 activations: within 1e-3 of the reference (model, hidden and MTP head), top-1 everywhere, windows of 8 rows
 * bit-identical to one-token steps. */
static void test_f32_activations(void **state) {
    fx *f = *state;
    const keel_config *c = &f->model.cfg;
    const int n = f->n_tok, V = c->vocab, H = c->hidden;
    keel_cuda_engine *e = NULL;
    keel_err err = {0};
    assert_int_equal(keel_cuda_engine_init(&e, &f->model, 64, &err), KEEL_OK);
    assert_int_equal(keel_cuda_engine_set_activations(e, KEEL_DT_F16, &err), KEEL_E_ARG);
    assert_int_equal(keel_cuda_engine_set_activations(e, KEEL_DT_F32, &err), KEEL_OK);
    float *lg = malloc((size_t)n * V * sizeof(float)), *hd = malloc((size_t)n * H * sizeof(float));
    float *one = malloc((size_t)n * V * sizeof(float)), *ml = malloc((size_t)n * V * sizeof(float));
    assert_int_equal(keel_cuda_engine_forward(e, f->tokens, n, lg, KEEL_LOGITS_ALL, hd, &err), KEEL_OK);
    const float dl = tk_max_abs_diff(lg, f->logits, (size_t)n * V), dh = tk_max_abs_diff(hd, f->hidden, (size_t)n * H);
    assert_int_equal(keel_cuda_engine_mtp(e, hd, f->tokens + 1, n - 1, ml, NULL, &err), KEEL_OK);
    const float *want = tk_st_tensor(&f->ref, "mtp_logits", KEEL_DT_F32, (int64_t)(n - 1) * V);
    const float dm = tk_max_abs_diff(ml, want, (size_t)(n - 1) * V);
    print_message("f32 activations: max |logits - ref| %.3g, |hidden - ref| %.3g, |mtp - ref| %.3g\n", dl, dh, dm);
    assert_true(dl <= 1e-3f && dh <= 1e-3f && dm <= 1e-3f);
    for (int i = 0; i < n; i++) {
        assert_int_equal(keel_argmax(lg + (size_t)i * V, V), keel_argmax(f->logits + (size_t)i * V, V));
        if (i < n - 1)
            assert_int_equal(keel_argmax(ml + (size_t)i * V, V), keel_argmax(want + (size_t)i * V, V));
    }
    keel_cuda_engine_reset(e);
    keel_cuda_engine_set_window(e, 1);
    for (int i = 0; i < n; i++)
        assert_int_equal(keel_cuda_engine_forward(e, f->tokens + i, 1, one + (size_t)i * V, KEEL_LOGITS_LAST, NULL, &err),
                         KEEL_OK);
    assert_memory_equal(one, lg, (size_t)n * V * sizeof(float));
    free(lg), free(hd), free(one), free(ml);
    keel_cuda_engine_free(e);
}

static void test_errors(void **state) {
    fx *f = *state;
    keel_cuda_engine *e = NULL;
    keel_err err = {0};
    /* a context beyond the model's limit, then one the device cannot hold */
    assert_int_equal(keel_cuda_engine_init(&e, &f->model, f->model.cfg.max_ctx + 1, &err), KEEL_E_RANGE);
    assert_null(e);
    const int saved = f->model.cfg.max_ctx;
    f->model.cfg.max_ctx = 1 << 30;
    assert_int_equal(keel_cuda_engine_init(&e, &f->model, 1 << 30, &err), KEEL_E_NOMEM);
    f->model.cfg.max_ctx = saved;
    assert_null(e);
    print_message("too large: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "does not fit the device"));
    /* tokens past the context, and outside the vocabulary */
    assert_int_equal(keel_cuda_engine_init(&e, &f->model, 4, &err), KEEL_OK);
    float *lg = malloc((size_t)f->model.cfg.vocab * sizeof(float));
    assert_int_equal(keel_cuda_engine_forward(e, f->tokens, 5, lg, KEEL_LOGITS_LAST, NULL, &err), KEEL_E_RANGE);
    assert_non_null(strstr(err.msg, "context of 4 tokens"));
    int bad[2] = {1, f->model.cfg.vocab};
    assert_int_equal(keel_cuda_engine_forward(e, bad, 2, lg, KEEL_LOGITS_LAST, NULL, &err), KEEL_E_RANGE);
    assert_int_equal(keel_cuda_engine_pos(e), 0);
    assert_int_equal(keel_cuda_engine_forward(e, f->tokens, 4, lg, KEEL_LOGITS_LAST, NULL, &err), KEEL_OK);
    assert_int_equal(keel_cuda_engine_forward(e, f->tokens, 1, lg, KEEL_LOGITS_LAST, NULL, &err), KEEL_E_RANGE);
    free(lg);
    keel_cuda_engine_free(e);
    keel_cuda_engine_free(NULL);
}
/* After an engine's init every engine kernel the audit declares (its sources under src/engine/cuda/) prefers all of
 * L1 as shared memory, the carveout of the stream tiles: one carveout for the whole decode step. */
static void test_carveout(void **state) {
    fx *f = *state;
    keel_cuda_engine *e = NULL;
    keel_err err = {0};
    assert_int_equal(keel_cuda_engine_init(&e, &f->model, 16, &err), KEEL_OK);
    int n = 0, checked = 0;
    const keel_audit_kernel *k = keel_audit_kernels(&n);
    for (int i = 0; i < n; i++) {
        if (k[i].control || !strstr(k[i].source, "src/engine/cuda/")) continue;
        const void *fn = keel_audit_live_fn(k[i].symbol);
        if (!fn) fail_msg("%s: no kernel lookup knows it", k[i].symbol);
        const int c = keel_ecu_kernel_carveout(fn);
        if (c != 100) fail_msg("%s: preferred shared-memory carveout %d%%, expected 100 (all shared)", k[i].symbol, c);
        checked++;
    }
    assert_int_equal(checked, 23);
    keel_cuda_engine_free(e);
}
#endif

int main(void) {
#ifndef KEEL_HAVE_CUDA
    printf("skip: keel was built without CUDA\n");
    return 77;
#else
    if (keel_cuda_device_count() < 1) {
        printf("skip: no CUDA device\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_teacher_forced), cmocka_unit_test(test_windows_bit_identical),
        cmocka_unit_test(test_greedy),         cmocka_unit_test(test_graphs_same_tokens),
        cmocka_unit_test(test_scheduling_same_bits), cmocka_unit_test(test_mtp),
        cmocka_unit_test(test_f32_activations), cmocka_unit_test(test_errors),
        cmocka_unit_test(test_carveout),
    };
    return cmocka_run_group_tests(tests, tk_ref_setup, tk_ref_teardown);
#endif
}
