/* engine/cuda: the GPU sampler (keel_ecu_sample) draws the CPU sampler's token (keel_sampler_sample) on thousands of
 * cases (every logit distribution of sample_cases.h: ties, NaN, infinities, signed zeros; greedy, top-k 1, tiny
 * top-p, min-p, huge and tiny temperatures; vocabularies 1 to 256000), launched back to back on one stream with one
 * scratch; replays of one captured graph draw the CPU's token at each position written to device memory; the
 * contract's registrations of it pass and their controls go red as planted. Times a draw at Nano's vocabulary.
 * Skips (77) without CUDA or a device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "contract/engine_regs_cuda.h"
#include "common/tk_contract.h"
#include "engine/sample_cases.h"

#ifdef KEEL_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "engine/cuda/ecuda.h"

static void *dev_alloc(size_t bytes) {
    void *p = NULL;
    char why[256];
    if (!keel_ecu_malloc(&p, bytes, why, sizeof why)) fail_msg("cudaMalloc %zu bytes: %s", bytes, why);
    return p;
}

/* Every case of the generator, drawn on the GPU in one stream, equals the CPU sampler's draw. */
static void test_gpu_equals_cpu(void **state) {
    (void)state;
    enum { NC = 4000 };
    sc_rng r = {2024};
    int *V = malloc(NC * sizeof(int)), *pos = malloc(NC * sizeof(int)), *got = malloc(NC * sizeof(int));
    size_t *off = malloc(NC * sizeof(size_t)), total = 0;
    keel_sampler_cfg *cfg = malloc(NC * sizeof(keel_sampler_cfg));
    int vmax = 1;
    for (int i = 0; i < NC; i++) {
        V[i] = i < 40 ? 131072 : i < 48 ? 256000 : i < 60 ? 1 : 1 + sc_below(&r, i % 4 ? 300 : 5000);
        off[i] = total, total += (size_t)V[i];
        vmax = V[i] > vmax ? V[i] : vmax;
    }
    float *l = malloc(total * sizeof(float));
    for (int i = 0; i < NC; i++) {
        sc_logits(&r, l + off[i], V[i], i % SC_DISTS);
        cfg[i] = sc_cfg(&r, V[i]);
        pos[i] = (int)(sc_next(&r) % 2000000);
    }
    float *dl = dev_alloc(total * sizeof(float));
    int *dpos = dev_alloc(NC * sizeof(int)), *dout = dev_alloc(NC * sizeof(int));
    void *scr = dev_alloc(keel_ecu_sample_scratch_bytes(vmax));
    keel_ecu_upload(dl, l, total * sizeof(float), NULL);
    keel_ecu_upload(dpos, pos, NC * sizeof(int), NULL);
    for (int i = 0; i < NC; i++)
        keel_ecu_sample(dl + off[i], V[i], cfg[i].temp, cfg[i].top_k, cfg[i].top_p, cfg[i].min_p, cfg[i].seed,
                        dpos + i, dout + i, scr, NULL);
    keel_ecu_download(got, dout, NC * sizeof(int), NULL);
    int bad = 0, varied = 0;
    for (int i = 0; i < NC; i++) {
        keel_sampler s;
        keel_sampler_init(&s, &cfg[i], V[i]);
        const int want = keel_sampler_sample(&s, l + off[i], pos[i]);
        varied += keel_sampler_filter(&s, l + off[i]) > 1;
        keel_sampler_free(&s);
        if (got[i] != want && bad++ < 10)
            print_error("case %d: V %d dist %d temp %g top_k %d top_p %g min_p %g pos %d: GPU %d, CPU %d\n", i, V[i],
                        i % SC_DISTS, (double)cfg[i].temp, cfg[i].top_k, (double)cfg[i].top_p, (double)cfg[i].min_p,
                        pos[i], got[i], want);
    }
    print_message("%d cases (%d with more than one survivor): %d GPU tokens differ from the CPU's\n", NC, varied, bad);
    assert_int_equal(bad, 0);
    assert_true(varied > NC / 4);
    keel_ecu_free(dl), keel_ecu_free(dpos), keel_ecu_free(dout), keel_ecu_free(scr);
    free(V), free(pos), free(got), free(off), free(cfg), free(l);
}

/* One launch captured in a CUDA graph, replayed with the position rewritten in device memory between replays. */
static void test_graph_replay(void **state) {
    (void)state;
    enum { VV = 131072, R = 24 };
    sc_rng r = {31337};
    float *l = malloc(VV * sizeof(float));
    sc_logits(&r, l, VV, 0);
    const keel_sampler_cfg c = {.temp = 0.9f, .top_k = 0, .top_p = 0.95f, .min_p = 0.02f, .seed = 77};
    float *dl = dev_alloc(VV * sizeof(float));
    int *dpos = dev_alloc(sizeof(int)), *dout = dev_alloc(sizeof(int));
    void *scr = dev_alloc(keel_ecu_sample_scratch_bytes(VV));
    keel_ecu_upload(dl, l, VV * sizeof(float), NULL);
    cudaStream_t st;
    assert_int_equal(cudaStreamCreate(&st), cudaSuccess);
    cudaGraph_t g;
    cudaGraphExec_t ge;
    assert_int_equal(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal), cudaSuccess);
    keel_ecu_sample(dl, VV, c.temp, c.top_k, c.top_p, c.min_p, c.seed, dpos, dout, scr, st);
    assert_int_equal(cudaStreamEndCapture(st, &g), cudaSuccess);
    assert_int_equal(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
    keel_sampler s;
    keel_sampler_init(&s, &c, VV);
    int distinct = 0, prev = -1;
    for (int i = 0; i < R; i++) {
        const int p = 1000 + 7 * i;
        int tok = -1;
        keel_ecu_upload(dpos, &p, sizeof p, st);
        assert_int_equal(cudaGraphLaunch(ge, st), cudaSuccess);
        keel_ecu_download(&tok, dout, sizeof tok, st);
        assert_int_equal(tok, keel_sampler_sample(&s, l, p));
        distinct += tok != prev, prev = tok;
    }
    assert_true(distinct > 1); /* the replays saw the positions */
    keel_sampler_free(&s);
    cudaGraphExecDestroy(ge), cudaGraphDestroy(g), cudaStreamDestroy(st);
    keel_ecu_free(dl), keel_ecu_free(dpos), keel_ecu_free(dout), keel_ecu_free(scr);
    free(l);
}

/* Microseconds a draw at vocabulary 131072, by configuration, for logits of spread 3 (most tokens keep a weight)
 * and of spread 64 (few do); printed. */
static void test_time(void **state) {
    (void)state;
    enum { VV = 131072, REP = 200 };
    sc_rng r = {4};
    float *l = malloc(VV * sizeof(float));
    float *dl = dev_alloc(VV * sizeof(float));
    int *dpos = dev_alloc(sizeof(int)), *dout = dev_alloc(sizeof(int)), zero = 0;
    void *scr = dev_alloc(keel_ecu_sample_scratch_bytes(VV));
    keel_ecu_upload(dpos, &zero, sizeof zero, NULL);
    const struct {
        const char *name;
        keel_sampler_cfg c;
    } C[] = {{"greedy", {.temp = 0.0f}},
             {"temp 1", {.temp = 1.0f, .top_p = 1.0f}},
             {"temp 0.8 top-p 0.95 min-p 0.05", {.temp = 0.8f, .top_p = 0.95f, .min_p = 0.05f}},
             {"temp 0.7 top-k 40 top-p 0.9", {.temp = 0.7f, .top_k = 40, .top_p = 0.9f}}};
    void *e0 = keel_ecu_event_new(), *e1 = keel_ecu_event_new();
    for (size_t k = 0; k < 2 * sizeof C / sizeof C[0]; k++) {
        const keel_sampler_cfg *c = &C[k % 4].c;
        if (k % 4 == 0) sc_logits(&r, l, VV, k ? 2 : 0), keel_ecu_upload(dl, l, VV * sizeof(float), NULL);
        keel_ecu_sample(dl, VV, c->temp, c->top_k, c->top_p, c->min_p, 1, dpos, dout, scr, NULL);
        keel_ecu_event_record(e0, NULL);
        for (int i = 0; i < REP; i++) keel_ecu_sample(dl, VV, c->temp, c->top_k, c->top_p, c->min_p, 1, dpos, dout, scr, NULL);
        keel_ecu_event_record(e1, NULL);
        const double us = 1000.0 * keel_ecu_event_ms(e0, e1) / REP;
        print_message("keel_ecu_sample V %d spread %d %s: %.1f us\n", VV, k < 4 ? 3 : 64, C[k % 4].name, us);
        assert_true(us > 0.0);
    }
    keel_ecu_event_free(e0), keel_ecu_event_free(e1);
    keel_ecu_free(dl), keel_ecu_free(dpos), keel_ecu_free(dout), keel_ecu_free(scr);
    free(l);
}

/* The contract's sampler registration: gates 1-4 pass, every control red at its gate. */
static void test_contract(void **state) {
    (void)state;
    keel_contract_report rep;
    assert_true(tk_contract_run(keel_contract_register_cuda_scan, "/sample/", &rep) >= 3);
    assert_int_equal(rep.kernels, 1);
    assert_int_equal(rep.fail, 0);
    assert_int_equal(rep.missed, 0);
    assert_int_equal(rep.red_as_planted, rep.controls);
    assert_true(rep.controls >= 2);
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
        cmocka_unit_test(test_gpu_equals_cpu),
        cmocka_unit_test(test_graph_replay),
        cmocka_unit_test(test_time),
        cmocka_unit_test(test_contract),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
#endif
}
