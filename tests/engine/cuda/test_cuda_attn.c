/* engine/cuda: the graph-ready attention (src/engine/cuda/attn.cu) on the device: its contract registrations
 * (src/contract/engine_regs_attn.c: every one passes gates 1-4, every planted control red); at Nemotron-3-Nano's
 * attention shape (32 query heads over 2 KV heads of 128) over a 2000-row cache, each row's bits alone, in split-K
 * and walking windows, in a larger cache allocation (another grid) and replayed from a captured CUDA graph at two
 * positions; agreement with a float64 reference within the derived bound; and the kernels' times (printed).
 * Skips (77) without a CUDA build or device. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "contract/engine_regs_cuda.h"
#include "common/tk_contract.h"
#include "core/core.h"

#ifdef KEEL_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "engine/cuda/ecuda.h"

enum { NH = 32, NKV = 2, HD = 128, QD = NH * HD, KVD = NKV * HD, CTX = 2000, POS = 1900, WIN = 40 };

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static float rnd(void) { /* normal, Box-Muller over xorshift */
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    const double u1 = ((double)(g_rng >> 11) + 0.5) * 0x1p-53;
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    const double u2 = ((double)(g_rng >> 11) + 0.5) * 0x1p-53;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* Host data: q for WIN rows at POS.., caches of CTX rows; device copies in a cache of `alloc` rows (rows past CTX
 * NaN), and outputs. */
typedef struct fixture {
    float *q, *kc, *vc;
    int alloc;
    float *dq, *dkc, *dvc, *dscr, *dof;
    uint16_t *dob;
    int *dpos;
} fixture;

static void fx_make(fixture *f, int alloc) {
    memset(f, 0, sizeof *f);
    f->alloc = alloc;
    f->q = malloc((size_t)WIN * QD * sizeof(float));
    f->kc = malloc((size_t)CTX * KVD * sizeof(float));
    f->vc = malloc((size_t)CTX * KVD * sizeof(float));
    g_rng = 0x2545f4914f6cdd1dull;
    for (size_t i = 0; i < (size_t)WIN * QD; i++) f->q[i] = rnd();
    for (size_t i = 0; i < (size_t)CTX * KVD; i++) f->kc[i] = rnd(), f->vc[i] = rnd();
    const size_t cb = (size_t)alloc * KVD * sizeof(float);
    float *nan = malloc(cb);
    for (size_t i = 0; i < (size_t)alloc * KVD; i++) nan[i] = NAN;
    f->dq = keel_cuda_malloc((size_t)WIN * QD * sizeof(float));
    f->dkc = keel_cuda_malloc(cb), f->dvc = keel_cuda_malloc(cb);
    keel_cuda_upload(f->dkc, nan, cb), keel_cuda_upload(f->dvc, nan, cb);
    keel_cuda_upload(f->dq, f->q, (size_t)WIN * QD * sizeof(float));
    keel_cuda_upload(f->dkc, f->kc, (size_t)CTX * KVD * sizeof(float));
    keel_cuda_upload(f->dvc, f->vc, (size_t)CTX * KVD * sizeof(float));
    f->dscr = keel_cuda_malloc(keel_ecu_attn_scratch_max_bytes(WIN, NH, HD, alloc));
    f->dof = keel_cuda_malloc((size_t)WIN * QD * sizeof(float));
    f->dob = keel_cuda_malloc((size_t)WIN * QD * sizeof(uint16_t));
    f->dpos = keel_cuda_malloc(sizeof(int));
    free(nan);
}

static void fx_free(fixture *f) {
    free(f->q), free(f->kc), free(f->vc);
    keel_cuda_free(f->dq), keel_cuda_free(f->dkc), keel_cuda_free(f->dvc), keel_cuda_free(f->dscr);
    keel_cuda_free(f->dof), keel_cuda_free(f->dob), keel_cuda_free(f->dpos);
}

/* Rows [r0, r0+m) of the window launched as one m-row launch: fp32 and bf16 outputs into of, ob (m rows). */
static void fx_run(fixture *f, int r0, int m, float *of, uint16_t *ob) {
    const int pos = POS + r0;
    keel_cuda_upload(f->dpos, &pos, sizeof pos);
    keel_ecu_attn(f->dq + (size_t)r0 * QD, NULL, f->dkc, f->dvc, KVD, f->dpos, m, NH, NKV, HD, f->alloc, f->dscr,
                  f->dob, f->dof, NULL);
    keel_cuda_sync();
    keel_cuda_download(of, f->dof, (size_t)m * QD * sizeof(float));
    keel_cuda_download(ob, f->dob, (size_t)m * QD * sizeof(uint16_t));
}

/* Every row of the 40-row window (walking) is the bits of itself alone, of an 8-row window and a 32-row window
 * (split-K), of a repeat, and of the same launches in a 4096-row cache allocation (another split-K grid). */
static void test_bit_identity(void **state) {
    (void)state;
    fixture f, g;
    fx_make(&f, CTX);
    fx_make(&g, 4096);
    const size_t n = (size_t)WIN * QD;
    float *wf = malloc(n * 4), *xf = malloc(n * 4);
    uint16_t *wb = malloc(n * 2), *xb = malloc(n * 2);
    fx_run(&f, 0, WIN, wf, wb);
    fx_run(&f, 0, WIN, xf, xb);
    assert_memory_equal(wf, xf, n * 4);
    fx_run(&g, 0, WIN, xf, xb);
    assert_memory_equal(wf, xf, n * 4);
    assert_memory_equal(wb, xb, n * 2);
    for (int r = 0; r < WIN; r++) {
        fixture *h = r % 2 ? &g : &f;
        fx_run(h, r, 1, xf, xb);
        if (memcmp(xf, wf + (size_t)r * QD, QD * 4) || memcmp(xb, wb + (size_t)r * QD, QD * 2))
            fail_msg("row %d (position %d) alone differs from the %d-row window", r, POS + r, WIN);
    }
    static const int sub[][2] = {{16, 8}, {3, 8}, {0, 32}, {8, 32}, {5, 33}};
    for (size_t s = 0; s < sizeof sub / sizeof sub[0]; s++) {
        fx_run(&f, sub[s][0], sub[s][1], xf, xb);
        if (memcmp(xf, wf + (size_t)sub[s][0] * QD, (size_t)sub[s][1] * QD * 4))
            fail_msg("rows %d.. as a %d-row window differ from the %d-row window", sub[s][0], sub[s][1], WIN);
    }
    free(wf), free(xf), free(wb), free(xb);
    fx_free(&f), fx_free(&g);
}

/* The window against float64 sums, within the bound engine_regs_attn.c derives (its attn_ref). */
static void test_reference(void **state) {
    (void)state;
    fixture f;
    fx_make(&f, CTX);
    const size_t n = (size_t)WIN * QD;
    float *of = malloc(n * 4);
    uint16_t *ob = malloc(n * 2);
    fx_run(&f, 0, WIN, of, ob);
    const double U = 0x1p-24, scale = (double)(1.0f / sqrtf((float)HD));
    const int ls = 4 * ((HD / 4 + 3) / 4) + 4;
    double *w = malloc(CTX * sizeof(double)), *rho = malloc(CTX * sizeof(double)), worst = 0;
    for (int r = 0; r < WIN; r++)
        for (int h = 0; h < NH; h++) {
            const int p = POS + r, kh = h / (NH / NKV), nc = p / KEEL_ECU_ATTN_CHUNK + 1;
            const float *q = f.q + (size_t)r * QD + (size_t)h * HD;
            double M = -INFINITY, esmax = 0, L = 0, wrho = 0;
            for (int j = 0; j <= p; j++) {
                double d = 0, a = 0;
                for (int i = 0; i < HD; i++) {
                    const double t = (double)q[i] * f.kc[(size_t)j * KVD + (size_t)kh * HD + i];
                    d += t, a += fabs(t);
                }
                w[j] = d * scale, rho[j] = 1.01 * ls * U * a * scale;
                M = fmax(M, w[j]), esmax = fmax(esmax, rho[j]);
            }
            for (int j = 0; j <= p; j++) L += exp(w[j] - M);
            for (int j = 0; j <= p; j++) {
                const double e = 1.01 * (rho[j] + U * (M - w[j] + 2 * esmax) + 4 * U * (nc + 5));
                w[j] = exp(w[j] - M) / L, rho[j] = e, wrho += w[j] * e;
            }
            for (int d = 0; d < HD; d++) {
                double o = 0, a = 0, ar = 0;
                for (int j = 0; j <= p; j++) {
                    const double v = f.vc[(size_t)j * KVD + (size_t)kh * HD + d];
                    o += w[j] * v, a += w[j] * fabs(v), ar += w[j] * fabs(v) * rho[j];
                }
                const double e = 1.01 * (ar + fabs(o) * wrho + (KEEL_ECU_ATTN_CHUNK + nc + 8) * U * a + (nc + 11) * U * fabs(o));
                const size_t i = (size_t)r * QD + (size_t)h * HD + d;
                const double bf = keel_bf16_to_f32(ob[i]), df = fabs(of[i] - o), db = fabs(bf - o);
                if (!(df <= e + U * (fabs(o) + e) + 1e-30) || !(db <= e + 0x1p-8 * (fabs(o) + e) + 1e-30))
                    fail_msg("row %d head %d channel %d: fp32 %.9g bf16 %.9g, float64 %.9g, bound %.3g", r, h, d, of[i],
                             bf, o, e);
                worst = fmax(worst, df / e);
            }
        }
    print_message("fp32 outputs use at most %.3f of the bound\n", worst);
    assert_true(worst > 0); /* outputs are not the reference to the last bit everywhere: the bound is exercised */
    free(w), free(rho), free(of), free(ob);
    fx_free(&f);
}

/* kv_append then attn captured once in a CUDA graph, replayed at two positions (1 and 8 rows): the same bits as
 * direct launches, and the cache rows appended. */
static void test_graph_replay(void **state) {
    (void)state;
    fixture f;
    fx_make(&f, CTX);
    cudaStream_t st;
    assert_int_equal(cudaStreamCreate(&st), cudaSuccess);
    float *dk = keel_cuda_malloc((size_t)8 * KVD * 4), *dv = keel_cuda_malloc((size_t)8 * KVD * 4);
    float *k = malloc((size_t)8 * KVD * 4), *v = malloc((size_t)8 * KVD * 4), *back = malloc((size_t)8 * KVD * 4);
    for (int i = 0; i < 8 * KVD; i++) k[i] = rnd(), v[i] = rnd();
    keel_cuda_upload(dk, k, (size_t)8 * KVD * 4), keel_cuda_upload(dv, v, (size_t)8 * KVD * 4);
    const size_t n = (size_t)8 * QD;
    float *a = malloc(n * 4), *b = malloc(n * 4);
    const int first = 300;
    keel_cuda_upload(f.dpos, &first, sizeof first);
    for (int m = 1; m <= 8; m += 7) {
        keel_ecu_kv_append(dk, dv, NULL, NULL, f.dkc, f.dvc, KVD, f.dpos, m, st); /* outside capture: first launches */
        keel_ecu_attn(f.dq, NULL, f.dkc, f.dvc, KVD, f.dpos, m, NH, NKV, HD, CTX, f.dscr, f.dob, f.dof, st);
        cudaGraph_t gr;
        cudaGraphExec_t ex;
        assert_int_equal(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        keel_ecu_kv_append(dk, dv, NULL, NULL, f.dkc, f.dvc, KVD, f.dpos, m, st);
        keel_ecu_attn(f.dq, NULL, f.dkc, f.dvc, KVD, f.dpos, m, NH, NKV, HD, CTX, f.dscr, f.dob, f.dof, st);
        assert_int_equal(cudaStreamEndCapture(st, &gr), cudaSuccess);
        assert_int_equal(cudaGraphInstantiate(&ex, gr, 0), cudaSuccess);
        static const int at[] = {300, 1777};
        for (int i = 0; i < 2; i++) {
            keel_cuda_upload(f.dpos, &at[i], sizeof(int));
            keel_ecu_kv_append(dk, dv, NULL, NULL, f.dkc, f.dvc, KVD, f.dpos, m, st);
            keel_ecu_attn(f.dq, NULL, f.dkc, f.dvc, KVD, f.dpos, m, NH, NKV, HD, CTX, f.dscr, f.dob, f.dof, st);
            assert_int_equal(cudaStreamSynchronize(st), cudaSuccess);
            keel_cuda_download(a, f.dof, (size_t)m * QD * 4);
            assert_int_equal(cudaMemsetAsync(f.dof, 0xFF, n * 4, st), cudaSuccess);
            assert_int_equal(cudaGraphLaunch(ex, st), cudaSuccess);
            assert_int_equal(cudaStreamSynchronize(st), cudaSuccess);
            keel_cuda_download(b, f.dof, (size_t)m * QD * 4);
            if (memcmp(a, b, (size_t)m * QD * 4)) fail_msg("graph replay at position %d (%d rows) differs", at[i], m);
            keel_cuda_download(back, f.dkc + (size_t)at[i] * KVD, (size_t)m * KVD * 4);
            assert_memory_equal(back, k, (size_t)m * KVD * 4);
        }
        cudaGraphExecDestroy(ex);
        cudaGraphDestroy(gr);
    }
    cudaStreamDestroy(st);
    keel_cuda_free(dk), keel_cuda_free(dv);
    free(k), free(v), free(back), free(a), free(b);
    fx_free(&f);
}

/* Every registration passes gates 1-4 and every planted control goes red. */
static void test_contract(void **state) {
    (void)state;
    keel_contract_report rep;
    const int n = tk_contract_run(keel_contract_register_cuda_attn, NULL, &rep);
    assert_int_equal(n, 6);
    assert_int_equal(rep.kernels, n);
    assert_int_equal(rep.pass, n);
    assert_int_equal(rep.missed, 0);
    assert_true(rep.controls >= 2 * n);
    assert_int_equal(rep.red_as_planted + rep.red_early, rep.controls);
}

/* Times (printed, not asserted): m = 1 at 1k and 32k positions and m = 128 at 1k, in a 32768-row cache. */
static void test_times(void **state) {
    (void)state;
    const int alloc = 32768;
    const size_t cb = (size_t)alloc * KVD * sizeof(float);
    float *h = malloc(cb);
    for (size_t i = 0; i < (size_t)alloc * KVD; i++) h[i] = rnd();
    float *kc = keel_cuda_malloc(cb), *vc = keel_cuda_malloc(cb);
    keel_cuda_upload(kc, h, cb), keel_cuda_upload(vc, h, cb);
    float *q = keel_cuda_malloc((size_t)128 * QD * 4), *of = keel_cuda_malloc((size_t)128 * QD * 4);
    keel_cuda_upload(q, h, (size_t)128 * QD * 4);
    uint16_t *ob = keel_cuda_malloc((size_t)128 * QD * 2);
    float *scr = keel_cuda_malloc(keel_ecu_attn_scratch_bytes(8, NH, HD, alloc) + 16);
    int *dpos = keel_cuda_malloc(sizeof(int));
    void *e0 = keel_ecu_event_new(), *e1 = keel_ecu_event_new();
    static const struct {
        int m, pos;
    } cs[] = {{1, 1023}, {1, 32767}, {128, 1024}, {8, 1023}, {1, 4095}};
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        keel_cuda_upload(dpos, &cs[c].pos, sizeof(int));
        const int reps = 50;
        for (int i = 0; i < 5; i++) keel_ecu_attn(q, NULL, kc, vc, KVD, dpos, cs[c].m, NH, NKV, HD, alloc, scr, ob, NULL, NULL);
        keel_ecu_event_record(e0, NULL);
        for (int i = 0; i < reps; i++) keel_ecu_attn(q, NULL, kc, vc, KVD, dpos, cs[c].m, NH, NKV, HD, alloc, scr, ob, NULL, NULL);
        keel_ecu_event_record(e1, NULL);
        const float ms = keel_ecu_event_ms(e0, e1);
        print_message("TIME attn m=%d rows at position %d (cache of %d rows, h32 kv2 d128): %.1f us\n", cs[c].m,
                      cs[c].pos, alloc, 1000.0 * ms / reps);
    }
    /* the same launches replayed from one captured graph of 20 (what a graph-captured decode step sees) */
    cudaStream_t st;
    assert_int_equal(cudaStreamCreate(&st), cudaSuccess);
    for (size_t c = 0; c < 2; c++) {
        cudaGraph_t gr;
        cudaGraphExec_t ex;
        assert_int_equal(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        for (int i = 0; i < 20; i++) keel_ecu_attn(q, NULL, kc, vc, KVD, dpos, 1, NH, NKV, HD, alloc, scr, ob, NULL, st);
        assert_int_equal(cudaStreamEndCapture(st, &gr), cudaSuccess);
        assert_int_equal(cudaGraphInstantiate(&ex, gr, 0), cudaSuccess);
        keel_cuda_upload(dpos, &cs[c].pos, sizeof(int));
        assert_int_equal(cudaGraphLaunch(ex, st), cudaSuccess);
        keel_ecu_event_record(e0, st);
        for (int i = 0; i < 5; i++) assert_int_equal(cudaGraphLaunch(ex, st), cudaSuccess);
        keel_ecu_event_record(e1, st);
        print_message("TIME attn m=1 at position %d from a captured graph: %.1f us\n", cs[c].pos,
                      1000.0 * keel_ecu_event_ms(e0, e1) / 100);
        cudaGraphExecDestroy(ex);
        cudaGraphDestroy(gr);
    }
    cudaStreamDestroy(st);
    keel_ecu_event_record(e0, NULL);
    for (int i = 0; i < 50; i++) keel_ecu_kv_append(q, q, NULL, NULL, kc, vc, KVD, dpos, 1, NULL);
    keel_ecu_event_record(e1, NULL);
    print_message("TIME kv_append m=1 (kvd 256): %.1f us\n", 1000.0 * keel_ecu_event_ms(e0, e1) / 50);
    keel_ecu_event_free(e0), keel_ecu_event_free(e1);
    keel_cuda_free(kc), keel_cuda_free(vc), keel_cuda_free(q), keel_cuda_free(of), keel_cuda_free(ob);
    keel_cuda_free(scr), keel_cuda_free(dpos);
    free(h);
}
#endif

int main(int argc, char **argv) {
    /* every build: the entries list names the two launchers */
    if (!keel_contract_cuda_attn_entries[0] || strcmp(keel_contract_cuda_attn_entries[0], "keel_ecu_attn") ||
        !keel_contract_cuda_attn_entries[1] || strcmp(keel_contract_cuda_attn_entries[1], "keel_ecu_kv_append")) {
        printf("keel_contract_cuda_attn_entries does not name keel_ecu_attn and keel_ecu_kv_append\n");
        return 1;
    }
    (void)argc, (void)argv;
#ifdef KEEL_HAVE_CUDA
    /* every CUDA build (no device needed): the scratch for up to m rows covers each row count up to m and is the
     * largest of them */
    for (int mx = 1; mx <= 256; mx++) {
        size_t most = 0;
        for (int m = 1; m <= mx; m++) {
            const size_t b = keel_ecu_attn_scratch_bytes(m, NH, HD, 32768);
            most = b > most ? b : most;
        }
        if (keel_ecu_attn_scratch_max_bytes(mx, NH, HD, 32768) != most) {
            printf("keel_ecu_attn_scratch_max_bytes(%d) is not the largest scratch of 1..%d rows\n", mx, mx);
            return 1;
        }
    }
#endif
#ifndef KEEL_HAVE_CUDA
    printf("skip: this build has no CUDA kernels (configure with -DKEEL_CUDA=ON on a host with nvcc)\n");
    return 77;
#else
    if (keel_cuda_device_count() < 1) {
        printf("skip: no CUDA device on this host\n");
        return 77;
    }
    if (argc > 1) cmocka_set_test_filter(argv[1]); /* one test by name (a device fault ends the process) */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bit_identity), cmocka_unit_test(test_reference), cmocka_unit_test(test_graph_replay),
        cmocka_unit_test(test_contract),     cmocka_unit_test(test_times),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
#endif
}
