/* CUDA stream tiles against a float64 reference built from the quantizer's output, the shared fixture vectors,
 * row independence, run-to-run bit equality, fused vs unfused relu^2, and the routed tiles. Skips (77) with a
 * reason when the build has no CUDA or the machine has no GPU. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>
#include <math.h>

#include "format/format.h"
#include "kernels/cpu/cpu.h"
#include "common/testkit.h"
#include "contract/contract.h"

#ifdef KEEL_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda.h"
#include "kernels/cuda/qm.h"

/* Runs one plain launch and checks every element against the reference; returns the host copy of y. */
static void *check_plain(const qm *q, const uint16_t *x, void *dx, keel_dtype xdt, int m, keel_dtype ydt,
                         keel_epilogue epi) {
    size_t ny = (size_t)m * q->n, es = keel_dtype_size(ydt);
    void *dy = keel_cuda_malloc(ny * es), *y = keel_xmalloc(ny * es);
    keel_cuda_memset(dy, 0xff, ny * es); /* NaN poison: every element must be written */
    keel_cuda_stream_matmul(&q->d, dx, xdt, m, dy, ydt, epi, NULL);
    keel_cuda_download(y, dy, ny * es);
    check_y(q, x, xdt, m, ydt, epi, y);
    keel_cuda_free(dy);
    return y;
}

static const int kBits[] = {2, 3, 4, 5, 6, 8};
static const int kGroups[] = {32, 64, 128};
static const keel_dtype kSdt[] = {KEEL_DT_BF16, KEEL_DT_F16, KEEL_DT_F32};

static void test_widths_groups_dtypes(void **state) {
    (void)state;
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(kBits); bi++)
        for (size_t gi = 0; gi < KEEL_ARRAY_LEN(kGroups); gi++)
            for (size_t si = 0; si < KEEL_ARRAY_LEN(kSdt); si++) {
                qm q;
                int n = 37 + (int)(bi * 13), k = kGroups[gi] * (3 + (int)si);
                qm_make(&q, n, k, kBits[bi], kGroups[gi], kSdt[si]);
                for (int m = 1; m <= 8; m += (m == 1 ? 2 : 5)) { /* 1, 3, 8 */
                    keel_dtype xdt = (si == 1) ? KEEL_DT_F16 : KEEL_DT_BF16;
                    void *dx;
                    uint16_t *x = make_x(m, k, xdt, &dx);
                    free(check_plain(&q, x, dx, xdt, m, (gi == 2) ? KEEL_DT_BF16 : KEEL_DT_F32, KEEL_EPI_NONE));
                    keel_cuda_free(dx);
                    free(x);
                }
                qm_free(&q);
            }
}

/* One group per row, odd n, negative scales, every m in 1..8, the long-k path (several x-chunks, k-split). */
static void test_edges(void **state) {
    (void)state;
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(kBits); bi++) {
        qm q;
        qm_make(&q, 33, 32, kBits[bi], 32, KEEL_DT_BF16);
        for (int m = 1; m <= 8; m++) {
            void *dx;
            uint16_t *x = make_x(m, q.k, KEEL_DT_BF16, &dx);
            free(check_plain(&q, x, dx, KEEL_DT_BF16, m, KEEL_DT_F32, KEEL_EPI_NONE));
            keel_cuda_free(dx);
            free(x);
        }
        qm_free(&q);
        qm_make_signed(&q, 71, 128 * 3, kBits[bi], 128, KEEL_DT_F32);
        void *dx;
        uint16_t *x = make_x(5, q.k, KEEL_DT_BF16, &dx);
        free(check_plain(&q, x, dx, KEEL_DT_BF16, 5, KEEL_DT_F32, KEEL_EPI_RELU2));
        keel_cuda_free(dx);
        free(x);
        qm_free(&q);
        qm_make(&q, 129, 64 * 41, kBits[bi], 64, KEEL_DT_BF16); /* k = 2624: 3 x-chunks, last partial */
        x = make_x(8, q.k, KEEL_DT_BF16, &dx);
        free(check_plain(&q, x, dx, KEEL_DT_BF16, 8, KEEL_DT_F32, KEEL_EPI_NONE));
        keel_cuda_free(dx);
        free(x);
        qm_free(&q);
    }
}

/* Row independence, run-to-run equality, fused relu^2 == tile then relu^2, bit for bit. */
static void test_bits_equal(void **state) {
    (void)state;
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(kBits); bi++) {
        qm q;
        qm_make(&q, 300, 2688, kBits[bi], 64, KEEL_DT_BF16);
        const int m = 8, n = q.n;
        void *dx;
        uint16_t *x = make_x(m, q.k, KEEL_DT_BF16, &dx);
        float *dy = keel_cuda_malloc((size_t)m * n * 4), *y8 = keel_xmalloc((size_t)m * n * 4);
        float *y1 = keel_xmalloc((size_t)n * 4), *again = keel_xmalloc((size_t)m * n * 4);
        keel_cuda_stream_matmul(&q.d, dx, KEEL_DT_BF16, m, dy, KEEL_DT_F32, KEEL_EPI_NONE, NULL);
        keel_cuda_download(y8, dy, (size_t)m * n * 4);
        for (int r = 0; r < m; r++) {
            keel_cuda_memset(dy, 0xff, (size_t)n * 4);
            keel_cuda_stream_matmul(&q.d, (uint16_t *)dx + (size_t)r * q.k, KEEL_DT_BF16, 1, dy, KEEL_DT_F32,
                                    KEEL_EPI_NONE, NULL);
            keel_cuda_download(y1, dy, (size_t)n * 4);
            assert_memory_equal(y1, y8 + (size_t)r * n, (size_t)n * 4);
        }
        for (int rep = 0; rep < 3; rep++) {
            keel_cuda_memset(dy, 0xff, (size_t)m * n * 4);
            keel_cuda_stream_matmul(&q.d, dx, KEEL_DT_BF16, m, dy, KEEL_DT_F32, KEEL_EPI_NONE, NULL);
            keel_cuda_download(again, dy, (size_t)m * n * 4);
            assert_memory_equal(again, y8, (size_t)m * n * 4);
        }
        /* fused vs unfused, fp32 out */
        keel_cuda_relu2(dy, KEEL_DT_F32, (size_t)m * n, NULL);
        keel_cuda_download(again, dy, (size_t)m * n * 4);
        keel_cuda_stream_matmul(&q.d, dx, KEEL_DT_BF16, m, dy, KEEL_DT_F32, KEEL_EPI_RELU2, NULL);
        keel_cuda_download(y8, dy, (size_t)m * n * 4);
        assert_memory_equal(again, y8, (size_t)m * n * 4);
        /* bf16 out: fused rounds relu^2 of the fp32 sum once */
        uint16_t *hb = keel_xmalloc((size_t)m * n * 2);
        keel_cuda_stream_matmul(&q.d, dx, KEEL_DT_BF16, m, dy, KEEL_DT_BF16, KEEL_EPI_RELU2, NULL);
        keel_cuda_download(hb, dy, (size_t)m * n * 2);
        for (size_t i = 0; i < (size_t)m * n; i++) assert_int_equal(hb[i], keel_f32_to_bf16(again[i]));
        free(hb);
        keel_cuda_free(dy);
        keel_cuda_free(dx);
        free(x);
        free(y8);
        free(y1);
        free(again);
        qm_free(&q);
    }
}

/* The fixture products: x (3 x 256) . dequant(W)^T against the independent float64 y and y_relu2. */
static void test_fixtures(void **state) {
    (void)state;
    char path[1024];
    tk_fixture(path, sizeof path, "stream_tiles_shared.safetensors");
    keel_st st;
    keel_err err;
    if (keel_st_open(&st, path, &err) != KEEL_OK) {
        print_error("%s\n", err.msg);
        fail();
    }
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(kBits); bi++)
        for (size_t gi = 0; gi < KEEL_ARRAY_LEN(kGroups); gi++) {
            char name[128];
            const keel_st_tensor *t[6];
            const char *suf[6] = {"weight", "scales", "biases", "x", "y", "y_relu2"};
            for (int i = 0; i < 6; i++) {
                snprintf(name, sizeof name, "n48_k256_m3_b%d_g%d.%s", kBits[bi], kGroups[gi], suf[i]);
                t[i] = keel_st_find(&st, name);
                assert_non_null(t[i]);
            }
            qm q = {.n = 48, .k = 256, .bits = kBits[bi], .group = kGroups[gi], .sdt = t[1]->dtype};
            q.codes = keel_xmalloc(t[0]->nbytes);
            memcpy(q.codes, t[0]->data, t[0]->nbytes);
            q.scales = keel_xmalloc(t[1]->nbytes);
            memcpy(q.scales, t[1]->data, t[1]->nbytes);
            q.biases = keel_xmalloc(t[2]->nbytes);
            memcpy(q.biases, t[2]->data, t[2]->nbytes);
            qm_upload(&q);
            assert_int_equal(t[3]->dtype, KEEL_DT_BF16);
            void *dx = keel_cuda_malloc(t[3]->nbytes);
            keel_cuda_upload(dx, t[3]->data, t[3]->nbytes);
            float *dy = keel_cuda_malloc(3 * 48 * 4), y[3 * 48], yr[3 * 48];
            keel_cuda_stream_matmul(&q.d, dx, KEEL_DT_BF16, 3, dy, KEEL_DT_F32, KEEL_EPI_NONE, NULL);
            keel_cuda_download(y, dy, sizeof y);
            keel_cuda_stream_matmul(&q.d, dx, KEEL_DT_BF16, 3, dy, KEEL_DT_F32, KEEL_EPI_RELU2, NULL);
            keel_cuda_download(yr, dy, sizeof yr);
            const uint16_t *x = t[3]->data;
            for (int r = 0; r < 3; r++)
                for (int j = 0; j < 48; j++) {
                    double mag, mine = ref_dot(&q, x, KEEL_DT_BF16, r, j, &mag);
                    double ref = keel_dtype_get_f32(KEEL_DT_F64, t[4]->data, (size_t)r * 48 + j);
                    double refr = keel_dtype_get_f32(KEEL_DT_F64, t[5]->data, (size_t)r * 48 + j);
                    double b = bound(256, mag, ref, false);
                    (void)mine;
                    if (!(fabs(y[r * 48 + j] - ref) <= b) ||
                        !(fabs(yr[r * 48 + j] - refr) <= 2 * (fabs(ref) + b) * b + ldexp(refr, -23))) {
                        print_error("%s b%d g%d y[%d][%d] = %.9g / relu2 %.9g, fixture %.9g / %.9g, bound %.3g\n",
                                    path, kBits[bi], kGroups[gi], r, j, y[r * 48 + j], yr[r * 48 + j], ref, refr, b);
                        fail();
                    }
                }
            keel_cuda_free(dy);
            keel_cuda_free(dx);
            qm_free(&q);
        }
    keel_st_free(&st);
}

/* Routed tiles: fc1 for several experts in one launch, fc2 weighted and summed, vs per-expert launches. */
static void test_routed(void **state) {
    (void)state;
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(kBits); bi++) {
        const int E = 5, inter = 96, hid = 128, m = 3;
        qm up, down;
        qm_make(&up, E * inter, hid, kBits[bi], 64, KEEL_DT_BF16);  /* stacked (E, inter, hid) */
        qm_make(&down, E * hid, inter, kBits[bi], 32, KEEL_DT_F16); /* stacked (E, hid, inter) */
        keel_cuda_qw u = up.d, d = down.d;
        u.n = inter;
        u.expert_words = (int64_t)inter * keel_quant_row_words(hid, u.bits);
        u.expert_groups = (int64_t)inter * (hid / 64);
        d.n = hid;
        d.expert_words = (int64_t)hid * keel_quant_row_words(inter, d.bits);
        d.expert_groups = (int64_t)hid * (inter / 32);
        u.items = d.items = 3; /* the stacks' launch-width hint: their k-split, and the copies' below */
        keel_cuda_route items[3] = {{0, 0x5u}, {2, 0x3u}, {4, 0x6u}};
        float wts[3 * 8] = {0};
        for (int i = 0; i < 3; i++)
            for (int r = 0; r < m; r++)
                if (items[i].mask >> r & 1u) wts[i * 8 + r] = (float)(0.2 + urand());
        void *ditems = keel_cuda_malloc(sizeof items), *dw = keel_cuda_malloc(sizeof wts), *dx;
        keel_cuda_upload(ditems, items, sizeof items);
        keel_cuda_upload(dw, wts, sizeof wts);
        uint16_t *x = make_x(m, hid, KEEL_DT_BF16, &dx);
        size_t hn = (size_t)3 * m * inter;
        uint16_t *dh = keel_cuda_malloc(hn * 2), *h = keel_xmalloc(hn * 2), *h1 = keel_xmalloc((size_t)m * inter * 2);
        keel_cuda_memset(dh, 0, hn * 2);
        keel_cuda_stream_experts_up(&u, dx, KEEL_DT_BF16, m, ditems, 3, dh, KEEL_DT_BF16, KEEL_EPI_RELU2, NULL);
        keel_cuda_download(h, dh, hn * 2);
        /* each item against a plain launch of its expert (same split: same n, k and hint) */
        uint16_t *dh1 = keel_cuda_malloc((size_t)m * inter * 2);
        for (int i = 0; i < 3; i++) {
            keel_cuda_qw one = u;
            one.w += (size_t)items[i].expert * u.expert_words;
            one.scales = (const uint16_t *)u.scales + (size_t)items[i].expert * u.expert_groups;
            one.biases = (const uint16_t *)u.biases + (size_t)items[i].expert * u.expert_groups;
            keel_cuda_stream_matmul(&one, dx, KEEL_DT_BF16, m, dh1, KEEL_DT_BF16, KEEL_EPI_RELU2, NULL);
            keel_cuda_download(h1, dh1, (size_t)m * inter * 2);
            for (int r = 0; r < m; r++)
                for (int j = 0; j < inter; j++) {
                    uint16_t got = h[((size_t)i * m + r) * inter + j];
                    if (items[i].mask >> r & 1u) {
                        assert_int_equal(got, h1[(size_t)r * inter + j]);
                        double mag, ref = ref_dot(&up, x, KEEL_DT_BF16, r, items[i].expert * inter + j, &mag);
                        double b = bound(hid, mag, ref, true);
                        b = 2 * (fabs(ref) + b) * b + ldexp(ref * ref, -8);
                        assert_true(fabs(keel_bf16_to_f32(got) - relu2d(ref)) <= b);
                    } else {
                        assert_int_equal(got, 0); /* rows outside the mask stay untouched */
                    }
                }
        }
        /* fc2: h rows are the inputs; y = sum_i w * (h_i . W2[e_i]^T), against float64 */
        float *dy = keel_cuda_malloc((size_t)m * hid * 4), y[3 * 128];
        keel_cuda_memset(dy, 0xff, (size_t)m * hid * 4);
        keel_cuda_stream_experts_down(&d, dh, KEEL_DT_BF16, m, ditems, dw, 3, dy, KEEL_DT_F32, NULL);
        keel_cuda_download(y, dy, sizeof y);
        float again[3 * 128];
        keel_cuda_stream_experts_down(&d, dh, KEEL_DT_BF16, m, ditems, dw, 3, dy, KEEL_DT_F32, NULL);
        keel_cuda_download(again, dy, sizeof again);
        assert_memory_equal(y, again, sizeof y);
        /* per-expert plain launches, weighted sum in float64 */
        float *dyo = keel_cuda_malloc((size_t)m * hid * 4), yo[3 * 128];
        double sum[3 * 128] = {0}, mags[3 * 128] = {0};
        for (int i = 0; i < 3; i++) {
            keel_cuda_qw one = d;
            one.w += (size_t)items[i].expert * d.expert_words;
            one.scales = (const uint16_t *)d.scales + (size_t)items[i].expert * d.expert_groups;
            one.biases = (const uint16_t *)d.biases + (size_t)items[i].expert * d.expert_groups;
            keel_cuda_stream_matmul(&one, dh + (size_t)i * m * inter, KEEL_DT_BF16, m, dyo, KEEL_DT_F32, KEEL_EPI_NONE,
                                    NULL);
            keel_cuda_download(yo, dyo, sizeof yo);
            for (int r = 0; r < m; r++) {
                if (!(items[i].mask >> r & 1u)) continue;
                for (int j = 0; j < hid; j++) {
                    double mag, ref = ref_dot(&down, h + (size_t)i * m * inter, KEEL_DT_BF16, r,
                                              items[i].expert * hid + j, &mag);
                    assert_true(fabs(yo[r * hid + j] - ref) <= bound(inter, mag, ref, false));
                    sum[r * hid + j] += wts[i * 8 + r] * ref;
                    mags[r * hid + j] += wts[i * 8 + r] * (mag + fabs(ref));
                }
            }
        }
        for (int i = 0; i < m * hid; i++) {
            double b = bound(inter, mags[i], sum[i], false) * 2;
            if (!(fabs(y[i] - sum[i]) <= b)) {
                print_error("bits %d routed fc2 y[%d] = %.9g, reference %.9g, bound %.3g\n", kBits[bi], i, y[i],
                            sum[i], b);
                fail();
            }
        }
        /* row independence of the routed fc2: token 1 alone, its items in the same order */
        keel_cuda_route solo[2] = {{2, 0x1u}, {4, 0x1u}};
        float sw[2 * 8] = {0};
        sw[0] = wts[1 * 8 + 1];
        sw[8] = wts[2 * 8 + 1];
        uint16_t *dhs = keel_cuda_malloc((size_t)2 * inter * 2);
        keel_cuda_upload(dhs, h + ((size_t)1 * m + 1) * inter, (size_t)inter * 2);
        keel_cuda_upload(dhs + inter, h + ((size_t)2 * m + 1) * inter, (size_t)inter * 2);
        keel_cuda_upload(ditems, solo, sizeof solo);
        keel_cuda_upload(dw, sw, sizeof sw);
        float ys[128];
        keel_cuda_stream_experts_down(&d, dhs, KEEL_DT_BF16, 1, ditems, dw, 2, dy, KEEL_DT_F32, NULL);
        keel_cuda_download(ys, dy, sizeof ys);
        assert_memory_equal(ys, y + hid, sizeof ys); /* the same stack: the same split whatever the item list */
        keel_cuda_free(dhs);
        keel_cuda_free(dy);
        keel_cuda_free(dyo);
        keel_cuda_free(dh1);
        keel_cuda_free(dh);
        keel_cuda_free(dx);
        keel_cuda_free(ditems);
        keel_cuda_free(dw);
        free(h);
        free(h1);
        free(x);
        qm_free(&up);
        qm_free(&down);
    }
}


/* Copies of W, scales, biases and x at misaligned device addresses: the 4-byte code copies and the synchronous
 * scale loads must give the same bits as the aligned launch. */
static void test_unaligned(void **state) {
    (void)state;
    const int bits_list[] = {3, 4, 8};
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(bits_list); bi++) {
        qm q;
        qm_make(&q, 50, 384, bits_list[bi], 64, KEEL_DT_BF16);
        const int m = 3;
        void *dx;
        uint16_t *x = make_x(m, q.k, KEEL_DT_BF16, &dx);
        float *y = check_plain(&q, x, dx, KEEL_DT_BF16, m, KEEL_DT_F32, KEEL_EPI_NONE);
        size_t cw = (size_t)q.n * keel_quant_row_words(q.k, q.bits) * 4, sb = (size_t)q.n * (q.k / q.group) * 2;
        uint8_t *w2 = keel_cuda_malloc(cw + 16), *s2 = keel_cuda_malloc(sb + 16), *b2 = keel_cuda_malloc(sb + 16);
        uint8_t *x2 = keel_cuda_malloc((size_t)m * q.k * 2 + 16);
        keel_cuda_upload(w2 + 4, q.codes, cw);
        keel_cuda_upload(s2 + 2, q.scales, sb);
        keel_cuda_upload(b2 + 2, q.biases, sb);
        keel_cuda_upload(x2 + 4, x, (size_t)m * q.k * 2);
        keel_cuda_qw d = q.d;
        d.w = (const uint32_t *)(w2 + 4);
        d.scales = s2 + 2;
        d.biases = b2 + 2;
        float *dy = keel_cuda_malloc((size_t)m * q.n * 4), *y2 = keel_xmalloc((size_t)m * q.n * 4);
        keel_cuda_memset(dy, 0xff, (size_t)m * q.n * 4);
        keel_cuda_stream_matmul(&d, x2 + 4, KEEL_DT_BF16, m, dy, KEEL_DT_F32, KEEL_EPI_NONE, NULL);
        keel_cuda_download(y2, dy, (size_t)m * q.n * 4);
        assert_memory_equal(y, y2, (size_t)m * q.n * 4);
        keel_cuda_free(w2);
        keel_cuda_free(s2);
        keel_cuda_free(b2);
        keel_cuda_free(x2);
        keel_cuda_free(dy);
        keel_cuda_free(dx);
        free(y);
        free(y2);
        free(x);
        qm_free(&q);
    }
}

/* Enough rows that k is not split, and k long enough for several x-chunks (at m = 1 and m = 8): every output
 * written, sampled rows against float64, and row 5 of the 8-row launch equal to its 1-row launch. */
static void test_long_chunks(void **state) {
    (void)state;
    const int bits_list[] = {4, 5};
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(bits_list); bi++) {
        qm q;
        qm_make(&q, 14000, 8448, bits_list[bi], 64, KEEL_DT_BF16);
        assert_int_equal(keel_cuda_stream_splits(q.n, q.k, 1), 1);
        const int m = 8, n = q.n;
        void *dx;
        uint16_t *x = make_x(m, q.k, KEEL_DT_BF16, &dx);
        float *dy = keel_cuda_malloc((size_t)m * n * 4), *y = keel_xmalloc((size_t)m * n * 4);
        float *y1 = keel_xmalloc((size_t)n * 4);
        keel_cuda_memset(dy, 0xff, (size_t)m * n * 4);
        keel_cuda_stream_matmul(&q.d, dx, KEEL_DT_BF16, m, dy, KEEL_DT_F32, KEEL_EPI_NONE, NULL);
        keel_cuda_download(y, dy, (size_t)m * n * 4);
        for (size_t i = 0; i < (size_t)m * n; i++) assert_true(isfinite(y[i]));
        for (int j = 0; j < n; j += (j < n - 70 ? 97 : 1))
            for (int r = 0; r < m; r++) {
                double mag, ref = ref_dot(&q, x, KEEL_DT_BF16, r, j, &mag), got = y[(size_t)r * n + j];
                if (!(fabs(got - ref) <= bound(q.k, mag, ref, false))) {
                    print_error("bits %d long k: y[%d][%d] = %.9g, reference %.9g\n", q.bits, r, j, got, ref);
                    fail();
                }
            }
        keel_cuda_memset(dy, 0xff, (size_t)n * 4);
        keel_cuda_stream_matmul(&q.d, (uint16_t *)dx + (size_t)5 * q.k, KEEL_DT_BF16, 1, dy, KEEL_DT_F32,
                                KEEL_EPI_NONE, NULL);
        keel_cuda_download(y1, dy, (size_t)n * 4);
        assert_memory_equal(y1, y + (size_t)5 * n, (size_t)n * 4);
        keel_cuda_free(dy);
        keel_cuda_free(dx);
        free(x);
        free(y);
        free(y1);
        qm_free(&q);
    }
}

/* keel_cuda_stream_matmul_rows: m up to 256 in 8-row groups. Every row against float64 (sampled columns), every
 * output written and nothing past row m, and every row bit-equal to its own 1-row keel_cuda_stream_matmul; on a
 * shape that splits k and one that does not. */
static void test_rows(void **state) {
    (void)state;
    const struct {
        int n, k, bits, m;
    } cases[] = {{300, 2688, 4, 37}, {100, 2176, 3, 20}, {130, 640, 8, 256}, {70, 256, 2, 9}};
    for (size_t ci = 0; ci < KEEL_ARRAY_LEN(cases); ci++) {
        qm q;
        qm_make(&q, cases[ci].n, cases[ci].k, cases[ci].bits, 64, KEEL_DT_BF16);
        const int m = cases[ci].m, n = q.n;
        void *dx;
        uint16_t *x = make_x(m, q.k, KEEL_DT_BF16, &dx);
        const size_t ny = (size_t)(m + 1) * n; /* one row of poison past the end */
        float *dy = keel_cuda_malloc(ny * 4), *y = keel_xmalloc(ny * 4), *y1 = keel_xmalloc((size_t)n * 4);
        keel_cuda_memset(dy, 0xff, ny * 4);
        keel_cuda_stream_matmul_rows(&q.d, dx, KEEL_DT_BF16, m, dy, KEEL_DT_F32, KEEL_EPI_NONE, NULL);
        keel_cuda_download(y, dy, ny * 4);
        for (size_t i = (size_t)m * n; i < ny; i++) assert_true(isnan(y[i]));
        for (int r = 0; r < m; r++) {
            for (int j = 0; j < n; j++) {
                assert_true(isfinite(y[(size_t)r * n + j]));
                if ((j + r) % 7) continue;
                double mag, ref = ref_dot(&q, x, KEEL_DT_BF16, r, j, &mag);
                if (!(fabs(y[(size_t)r * n + j] - ref) <= bound(q.k, mag, ref, false))) {
                    print_error("rows m %d: y[%d][%d] = %.9g, reference %.9g\n", m, r, j, y[(size_t)r * n + j], ref);
                    fail();
                }
            }
            keel_cuda_memset(dy, 0xff, (size_t)n * 4);
            keel_cuda_stream_matmul(&q.d, (uint16_t *)dx + (size_t)r * q.k, KEEL_DT_BF16, 1, dy, KEEL_DT_F32,
                                    KEEL_EPI_NONE, NULL);
            keel_cuda_download(y1, dy, (size_t)n * 4);
            assert_memory_equal(y1, y + (size_t)r * n, (size_t)n * 4);
        }
        keel_cuda_free(dy);
        keel_cuda_free(dx);
        free(x);
        free(y);
        free(y1);
        qm_free(&q);
    }
}

/* The k-split depends on n, k and the stack's launch-width hint only: a hint of 0 is 1, a wider launch never
 * splits more; small n splits, lm_head does not. */
static void test_splits(void **state) {
    (void)state;
    const int shapes[][2] = {{1856, 2688}, {2688, 1856}, {256, 2688}, {9, 2176}, {10304, 2688}, {131072, 2688}};
    for (size_t i = 0; i < KEEL_ARRAY_LEN(shapes); i++) {
        const int n = shapes[i][0], k = shapes[i][1];
        assert_int_equal(keel_cuda_stream_splits(n, k, 0), keel_cuda_stream_splits(n, k, 1));
        for (int items = 2; items <= 64; items *= 2)
            assert_true(keel_cuda_stream_splits(n, k, items) <= keel_cuda_stream_splits(n, k, items / 2));
    }
    assert_true(keel_cuda_stream_splits(9, 2176, 1) >= 2);
    assert_int_equal(keel_cuda_stream_splits(131072, 2688, 1), 1);
    /* a hint of h splits as h such matrices side by side would (Nano's routed fc1: 29 row tiles, top-6) */
    assert_int_equal(keel_cuda_stream_splits(1856, 2688, 6), keel_cuda_stream_splits(6 * 1856, 2688, 1));
    assert_int_equal(keel_cuda_stream_splits(2688, 1856, 6), keel_cuda_stream_splits(6 * 2688, 1856, 1));
    /* the long-slice rule only halves a shape the target left whole, and only a slice of 2048+ codes */
    for (size_t i = 0; i < KEEL_ARRAY_LEN(shapes); i++) {
        const int n = shapes[i][0], k = shapes[i][1];
        keel_cuda_stream_split_long(0);
        const int off = keel_cuda_stream_splits(n, k, 1);
        keel_cuda_stream_split_long(1);
        const int on = keel_cuda_stream_splits(n, k, 1);
        assert_true(on == off || (off == 1 && on == 2 && k >= 2048));
    }
    keel_cuda_stream_split_long(KEEL_CUDA_STREAM_SPLIT_LONG_DEFAULT);
}

/* Routed fc2 with more partials per output than the last block adds itself (a second launch adds them): a token
 * launched alone with its two experts (added by the tile's last block) gives the same bits as in that launch. */
static void test_finish_paths(void **state) {
    (void)state;
    const int E = 8, hid = 64, inter = 2688, m = 2;
    qm down;
    qm_make(&down, E * hid, inter, 4, 64, KEEL_DT_BF16);
    keel_cuda_qw d = down.d;
    d.n = hid;
    d.expert_words = (int64_t)hid * keel_quant_row_words(inter, 4);
    d.expert_groups = (int64_t)hid * (inter / 64);
    const int splits = keel_cuda_stream_splits(hid, inter, 1);
    assert_true(splits >= 2);
    keel_cuda_route items[8];
    float wts[8 * 8] = {0};
    int n_items = 0;
    for (int e = 0; e < E && n_items * splits <= 64; e++) { /* token 0 takes every expert until past the fold */
        items[n_items] = (keel_cuda_route){e, 1u | (e == 1 || e == 4 ? 2u : 0u)};
        wts[n_items * 8] = (float)(0.3 + 0.1 * e);
        wts[n_items * 8 + 1] = (float)(0.9 - 0.05 * e);
        n_items++;
    }
    assert_true(n_items * splits > 64);
    void *dh, *ditems = keel_cuda_malloc(sizeof items), *dw = keel_cuda_malloc(sizeof wts);
    uint16_t *h = make_x(n_items * m, inter, KEEL_DT_BF16, &dh);
    keel_cuda_upload(ditems, items, sizeof items);
    keel_cuda_upload(dw, wts, sizeof wts);
    float *dy = keel_cuda_malloc((size_t)m * hid * 4), y[2 * 64], ys[64];
    keel_cuda_memset(dy, 0xff, sizeof y);
    keel_cuda_stream_experts_down(&d, dh, KEEL_DT_BF16, m, ditems, dw, n_items, dy, KEEL_DT_F32, NULL);
    keel_cuda_download(y, dy, sizeof y);
    for (int j = 0; j < m * hid; j++) { /* float64: sum over items in the token's mask */
        const int r = j / hid, c = j % hid;
        double sum = 0, mags = 0;
        for (int i = 0; i < n_items; i++) {
            if (!(items[i].mask >> r & 1u)) continue;
            double mag, ref = ref_dot(&down, h + (size_t)i * m * inter, KEEL_DT_BF16, r, items[i].expert * hid + c, &mag);
            sum += wts[i * 8 + r] * ref;
            mags += wts[i * 8 + r] * (mag + fabs(ref));
        }
        assert_true(fabs(y[j] - sum) <= 2 * bound(inter, mags, sum, false));
    }
    /* token 1 alone: its experts 1 and 4 in the same order, its h rows moved along */
    keel_cuda_route solo[2] = {{1, 1u}, {4, 1u}};
    float sw[2 * 8] = {0};
    sw[0] = wts[1 * 8 + 1];
    sw[8] = wts[4 * 8 + 1];
    uint16_t *dhs = keel_cuda_malloc((size_t)2 * inter * 2);
    keel_cuda_upload(dhs, h + ((size_t)1 * m + 1) * inter, (size_t)inter * 2);
    keel_cuda_upload(dhs + inter, h + ((size_t)4 * m + 1) * inter, (size_t)inter * 2);
    keel_cuda_upload(ditems, solo, sizeof solo);
    keel_cuda_upload(dw, sw, sizeof sw);
    keel_cuda_stream_experts_down(&d, dhs, KEEL_DT_BF16, 1, ditems, dw, 2, dy, KEEL_DT_F32, NULL);
    keel_cuda_download(ys, dy, sizeof ys);
    assert_memory_equal(ys, y + hid, sizeof ys);
    keel_cuda_free(dhs);
    keel_cuda_free(dy);
    keel_cuda_free(dh);
    keel_cuda_free(ditems);
    keel_cuda_free(dw);
    free(h);
    qm_free(&down);
}

#define CK(call) assert_int_equal((int)(call), (int)cudaSuccess)

/* Warm launches go into a CUDA graph (no allocation, no synchronization inside them): a k-split tile, a routed
 * fc2 and a many-row launch captured once and replayed twice give the bits of the same launches made directly. */
static void test_graph_capture(void **state) {
    (void)state;
    qm q, e;
    qm_make(&q, 300, 2688, 4, 64, KEEL_DT_BF16); /* splits k */
    qm_make(&e, 3 * 256, 1856, 5, 64, KEEL_DT_BF16);
    keel_cuda_qw d = e.d;
    d.n = 256;
    d.expert_words = (int64_t)256 * keel_quant_row_words(1856, 5);
    d.expert_groups = (int64_t)256 * (1856 / 64);
    const int m = 24;
    void *dx, *dh;
    uint16_t *x = make_x(m, q.k, KEEL_DT_BF16, &dx), *h = make_x(3 * 2, 1856, KEEL_DT_BF16, &dh);
    keel_cuda_route items[3] = {{0, 3u}, {1, 1u}, {2, 2u}};
    float wts[3 * 8] = {0.5f, 0.25f, 0, 0, 0, 0, 0, 0, 0.75f, 0, 0, 0, 0, 0, 0, 0, 0, 1.5f};
    void *ditems = keel_cuda_malloc(sizeof items), *dw = keel_cuda_malloc(sizeof wts);
    keel_cuda_upload(ditems, items, sizeof items);
    keel_cuda_upload(dw, wts, sizeof wts);
    const size_t n1 = (size_t)300, n2 = (size_t)m * 300, n3 = (size_t)2 * 256;
    float *dy = keel_cuda_malloc((n1 + n2 + n3) * 4), *want = keel_xmalloc((n1 + n2 + n3) * 4);
    float *got = keel_xmalloc((n1 + n2 + n3) * 4);
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
#define LAUNCHES()                                                                                                \
    do {                                                                                                           \
        keel_cuda_stream_matmul(&q.d, dx, KEEL_DT_BF16, 1, dy, KEEL_DT_F32, KEEL_EPI_RELU2, st);                  \
        keel_cuda_stream_matmul_rows(&q.d, dx, KEEL_DT_BF16, m, dy + n1, KEEL_DT_F32, KEEL_EPI_NONE, st);         \
        keel_cuda_stream_experts_down(&d, dh, KEEL_DT_BF16, 2, ditems, dw, 3, dy + n1 + n2, KEEL_DT_F32, st);      \
    } while (0)
    LAUNCHES(); /* warm: buffers sized */
    CK(cudaStreamSynchronize(st));
    keel_cuda_download(want, dy, (n1 + n2 + n3) * 4);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    LAUNCHES();
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 2; rep++) {
        keel_cuda_memset(dy, 0xff, (n1 + n2 + n3) * 4);
        CK(cudaGraphLaunch(exec, st));
        CK(cudaStreamSynchronize(st));
        keel_cuda_download(got, dy, (n1 + n2 + n3) * 4);
        assert_memory_equal(got, want, (n1 + n2 + n3) * 4);
    }
#undef LAUNCHES
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    keel_cuda_stream_scratch_release(st);
    CK(cudaStreamDestroy(st));
    keel_cuda_free(dy);
    keel_cuda_free(dx);
    keel_cuda_free(dh);
    keel_cuda_free(ditems);
    keel_cuda_free(dw);
    free(x);
    free(h);
    free(want);
    free(got);
    qm_free(&q);
    qm_free(&e);
}

/* The kernel lookup the gate-5 live check uses: every launched kernel by its audit name, NULL otherwise. */
/* Split launches on two streams at once keep their own partials and counters: each stream's outputs equal the
 * same launches run one at a time (with one scratch between them, overlapping launches would mix partials). */
static void test_two_streams(void **state) {
    (void)state;
    qm a, b;
    qm_make(&a, 300, 2688, 4, 64, KEEL_DT_BF16); /* both split k */
    qm_make(&b, 256, 4096, 3, 64, KEEL_DT_BF16);
    assert_true(keel_cuda_stream_splits(a.d.n, a.d.k, 0) > 1 && keel_cuda_stream_splits(b.d.n, b.d.k, 0) > 1);
    enum { REPS = 48 };
    void *dxa, *dxb;
    uint16_t *xa = make_x(REPS, a.k, KEEL_DT_BF16, &dxa), *xb = make_x(REPS, b.k, KEEL_DT_BF16, &dxb);
    const size_t na = (size_t)REPS * 300, nb = (size_t)REPS * 256;
    float *dya = keel_cuda_malloc(na * 4), *dyb = keel_cuda_malloc(nb * 4);
    float *wa = keel_xmalloc(na * 4), *wb = keel_xmalloc(nb * 4), *ga = keel_xmalloc(na * 4), *gb = keel_xmalloc(nb * 4);
    for (int r = 0; r < REPS; r++) { /* one at a time on the default stream */
        keel_cuda_stream_matmul(&a.d, (const uint16_t *)dxa + (size_t)r * a.k, KEEL_DT_BF16, 1, dya + (size_t)r * 300,
                                KEEL_DT_F32, KEEL_EPI_NONE, NULL);
        keel_cuda_stream_matmul(&b.d, (const uint16_t *)dxb + (size_t)r * b.k, KEEL_DT_BF16, 1, dyb + (size_t)r * 256,
                                KEEL_DT_F32, KEEL_EPI_NONE, NULL);
    }
    keel_cuda_sync();
    keel_cuda_download(wa, dya, na * 4);
    keel_cuda_download(wb, dyb, nb * 4);
    cudaStream_t s1, s2;
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    for (int round = 0; round < 2; round++) { /* the first round grows each stream's scratch, the second reuses it */
        keel_cuda_memset(dya, 0xff, na * 4);
        keel_cuda_memset(dyb, 0xff, nb * 4);
        keel_cuda_sync();
        for (int r = 0; r < REPS; r++) {
            keel_cuda_stream_matmul(&a.d, (const uint16_t *)dxa + (size_t)r * a.k, KEEL_DT_BF16, 1,
                                    dya + (size_t)r * 300, KEEL_DT_F32, KEEL_EPI_NONE, s1);
            keel_cuda_stream_matmul(&b.d, (const uint16_t *)dxb + (size_t)r * b.k, KEEL_DT_BF16, 1,
                                    dyb + (size_t)r * 256, KEEL_DT_F32, KEEL_EPI_NONE, s2);
        }
        CK(cudaStreamSynchronize(s1));
        CK(cudaStreamSynchronize(s2));
        keel_cuda_download(ga, dya, na * 4);
        keel_cuda_download(gb, dyb, nb * 4);
        assert_memory_equal(ga, wa, na * 4);
        assert_memory_equal(gb, wb, nb * 4);
    }
    const unsigned ep = keel_cuda_stream_scratch_epoch();
    keel_cuda_stream_scratch_release(s1);
    keel_cuda_stream_scratch_release(s2);
    assert_true(keel_cuda_stream_scratch_epoch() != ep); /* a graph holding the freed scratch is known stale */
    CK(cudaStreamDestroy(s1));
    CK(cudaStreamDestroy(s2));
    print_message("two streams, %d split launches each at once: the bits of one launch at a time\n", REPS);
    keel_cuda_free(dya), keel_cuda_free(dyb), keel_cuda_free(dxa), keel_cuda_free(dxb);
    free(xa), free(xb), free(wa), free(wb), free(ga), free(gb);
    qm_free(&a), qm_free(&b);
}

static void test_kernel_fn(void **state) {
    (void)state;
    const char *names[] = {"stream_tile<2,false>", "stream_tile<3,false>", "stream_tile<4,false>",
                           "stream_tile<5,false>", "stream_tile<6,false>", "stream_tile<8,false>",
                           "stream_tile<2,true>",  "stream_tile<3,true>",  "stream_tile<4,true>",
                           "stream_tile<5,true>",  "stream_tile<6,true>",  "stream_tile<8,true>",
                           "stream_finish",        "relu2_kernel",         "fill_kernel",
                           "read_kernel"};
    const void *fn[KEEL_ARRAY_LEN(names)];
    for (size_t i = 0; i < KEEL_ARRAY_LEN(names); i++) {
        fn[i] = keel_cuda_kernel_fn(names[i]);
        assert_non_null(fn[i]);
        for (size_t j = 0; j < i; j++) assert_ptr_not_equal(fn[i], fn[j]);
    }
    assert_null(keel_cuda_kernel_fn("stream_tile<7,false>"));
    assert_null(keel_cuda_kernel_fn(NULL));
}

int main(void) {
    if (keel_cuda_device_count() < 1) {
        printf("skip: no CUDA device on this machine\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixtures),
        cmocka_unit_test(test_widths_groups_dtypes),
        cmocka_unit_test(test_edges),
        cmocka_unit_test(test_bits_equal),
        cmocka_unit_test(test_routed),
        cmocka_unit_test(test_unaligned),
        cmocka_unit_test(test_long_chunks),
        cmocka_unit_test(test_rows),
        cmocka_unit_test(test_splits),
        cmocka_unit_test(test_finish_paths),
        cmocka_unit_test(test_graph_capture),
        cmocka_unit_test(test_two_streams),
        cmocka_unit_test(test_kernel_fn),
    };
    const char *filter = getenv("KEEL_TEST_FILTER"); /* opt-in subset (e.g. under compute-sanitizer) */
    if (filter && *filter) cmocka_set_test_filter(filter);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
#else
int main(void) {
    printf("skip: keel was built without CUDA (KEEL_CUDA=OFF or no nvcc)\n");
    return 77;
}
#endif
