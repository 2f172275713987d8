/* CUDA packed stream tiles: every width, group, 16-bit scale dtype and activation dtype against the float64
 * reference; bit for bit against the ring tile (keel_cuda_stream_matmul) wherever neither splits k; row
 * independence, repeated launches, fused relu^2, the chunked long-k path, k in halves, the x budget's bits, x written
 * by the launch just before (the layout itself: test_pack.c). Skips (77) with a
 * reason when the build has no CUDA or the machine has no GPU. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

#define CK(call) assert_int_equal((int)(call), (int)cudaSuccess)

/* A packed copy of q on the device (owned: free pw.w). */
static keel_cuda_pw pack(const qm *q) {
    const keel_qmat m = {q->n, q->k, q->bits, q->group, q->sdt, q->codes, q->scales, q->biases};
    keel_cuda_pw pw;
    char why[256] = "";
    if (!keel_cuda_pack_upload(&m, &pw, why, sizeof why)) fail_msg("pack: %s", why);
    return pw;
}

/* One launch of each tile into fresh NaN-poisoned outputs; host copies. */
static void *run_packed(const keel_cuda_pw *pw, void *dx, keel_dtype xdt, int m, keel_dtype ydt, keel_epilogue epi) {
    const size_t bytes = (size_t)m * pw->n * keel_dtype_size(ydt);
    void *dy = keel_cuda_malloc(bytes + 64), *y = keel_xmalloc(bytes + 64);
    keel_cuda_memset(dy, 0xff, bytes + 64);
    keel_cuda_stream_matmul_packed(pw, dx, xdt, m, dy, ydt, epi, NULL);
    keel_cuda_download(y, dy, bytes + 64);
    for (size_t i = bytes; i < bytes + 64; i++) assert_int_equal(((uint8_t *)y)[i], 0xff); /* nothing past y */
    keel_cuda_free(dy);
    return y;
}
static void *run_ring(const qm *q, void *dx, keel_dtype xdt, int m, keel_dtype ydt, keel_epilogue epi) {
    const size_t bytes = (size_t)m * q->n * keel_dtype_size(ydt);
    void *dy = keel_cuda_malloc(bytes), *y = keel_xmalloc(bytes);
    keel_cuda_memset(dy, 0xff, bytes);
    keel_cuda_stream_matmul(&q->d, dx, xdt, m, dy, ydt, epi, NULL);
    keel_cuda_download(y, dy, bytes);
    keel_cuda_free(dy);
    return y;
}

static const int kBits[] = {2, 3, 4, 5, 6, 8};
static const int kGroups[] = {32, 64, 128};

/* Every width x group x activation dtype, positive and negative BF16 scales, on a shape the ring tile does not split
 * (k < 512): within the float64 bound and equal to the ring tile bit for bit at m = 1..8, both outputs, both
 * epilogues. */
static void test_against_ring_and_reference(void **state) {
    (void)state;
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(kBits); bi++)
        for (size_t gi = 0; gi < KEEL_ARRAY_LEN(kGroups); gi++)
            for (size_t si = 0; si < 2; si++) {
                const int G = kGroups[gi], n = 37 + 16 * (int)bi, k = G * (G == 128 ? 3 : 5); /* k past whole spans */
                qm q;
                if (si == 0)
                    qm_make(&q, n, k, kBits[bi], G, KEEL_DT_BF16);
                else
                    qm_make_signed(&q, n, k, kBits[bi], G, KEEL_DT_BF16); /* negative scales */
                assert_int_equal(keel_cuda_stream_splits(n, k, 0), 1);
                keel_cuda_pw pw = pack(&q);
                for (int m = 1; m <= 8; m++) {
                    const keel_dtype xdt = (m & 1) ? KEEL_DT_BF16 : KEEL_DT_F16;
                    const keel_dtype ydt = (m % 3 == 0) ? KEEL_DT_BF16 : KEEL_DT_F32;
                    const keel_epilogue epi = (m % 4 == 1) ? KEEL_EPI_RELU2 : KEEL_EPI_NONE;
                    void *dx;
                    uint16_t *x = make_x(m, k, xdt, &dx);
                    void *yp = run_packed(&pw, dx, xdt, m, ydt, epi), *yr = run_ring(&q, dx, xdt, m, ydt, epi);
                    check_y(&q, x, xdt, m, ydt, epi, yp);
                    if (memcmp(yp, yr, (size_t)m * n * keel_dtype_size(ydt)))
                        fail_msg("bits %d group %d %s scales m %d: packed and ring tiles differ", kBits[bi], G,
                                 si ? "signed" : "plain", m);
                    free(yp), free(yr), free(x);
                    keel_cuda_free(dx);
                }
                keel_cuda_free((void *)pw.w);
                qm_free(&q);
            }
}

/* Many tiles (several a warp), the chunked x path (m = 8 past 3072 codes), rows of an 8-row launch equal to 1-row
 * launches, repeated launches equal, fused relu^2 equal to the tile then keel_cuda_relu2 (fp32). */
static void test_bits_and_chunks(void **state) {
    (void)state;
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(kBits); bi++) {
        qm q;
        const int n = 333, k = bi % 2 ? 4160 : 2688; /* 4160: two x-chunks at m = 8, the last partial */
        qm_make(&q, n, k, kBits[bi], 64, KEEL_DT_BF16);
        keel_cuda_pw pw = pack(&q);
        const int m = 8;
        void *dx;
        uint16_t *x = make_x(m, k, KEEL_DT_BF16, &dx);
        float *y8 = run_packed(&pw, dx, KEEL_DT_BF16, m, KEEL_DT_F32, KEEL_EPI_NONE);
        check_y(&q, x, KEEL_DT_BF16, m, KEEL_DT_F32, KEEL_EPI_NONE, y8);
        for (int r = 0; r < m; r++) {
            float *y1 = run_packed(&pw, (uint16_t *)dx + (size_t)r * k, KEEL_DT_BF16, 1, KEEL_DT_F32, KEEL_EPI_NONE);
            assert_memory_equal(y1, y8 + (size_t)r * n, (size_t)n * 4);
            free(y1);
        }
        for (int rep = 0; rep < 2; rep++) {
            float *again = run_packed(&pw, dx, KEEL_DT_BF16, m, KEEL_DT_F32, KEEL_EPI_NONE);
            assert_memory_equal(again, y8, (size_t)m * n * 4);
            free(again);
        }
        float *dy = keel_cuda_malloc((size_t)m * n * 4);
        keel_cuda_upload(dy, y8, (size_t)m * n * 4);
        keel_cuda_relu2(dy, KEEL_DT_F32, (size_t)m * n, NULL);
        keel_cuda_download(y8, dy, (size_t)m * n * 4);
        float *fused = run_packed(&pw, dx, KEEL_DT_BF16, m, KEEL_DT_F32, KEEL_EPI_RELU2);
        assert_memory_equal(fused, y8, (size_t)m * n * 4);
        free(fused);
        keel_cuda_free(dy);
        free(y8), free(x);
        keel_cuda_free(dx);
        keel_cuda_free((void *)pw.w);
        qm_free(&q);
    }
}

/* On a shape with enough row tiles that the ring tile does not split k, the two tiles agree on every output. */
static void test_large_equal(void **state) {
    (void)state;
    const int n = 64 * 160 + 9, k = 2688; /* more row tiles than a chip has SMs */
    const int splits = keel_cuda_stream_splits(n, k, 0);
    if (splits != 1) { /* the ring tile's bits differ where it splits k: nothing to compare with */
        printf("skip: test_large_equal: the ring tile splits n=%d k=%d %d ways on this device (%d SMs), so its bits are "
               "not the packed tile's\n", n, k, splits, keel_cuda_sm_count());
        skip();
    }
    for (int bits = 2; bits <= 8; bits += 2) {
        qm q;
        qm_make(&q, n, k, bits, 64, KEEL_DT_BF16);
        keel_cuda_pw pw = pack(&q);
        for (int m = 1; m <= 8; m += 7) {
            void *dx;
            uint16_t *x = make_x(m, k, KEEL_DT_BF16, &dx);
            void *yp = run_packed(&pw, dx, KEEL_DT_BF16, m, KEEL_DT_F32, KEEL_EPI_NONE);
            void *yr = run_ring(&q, dx, KEEL_DT_BF16, m, KEEL_DT_F32, KEEL_EPI_NONE);
            assert_memory_equal(yp, yr, (size_t)m * n * 4);
            free(yp), free(yr), free(x);
            keel_cuda_free(dx);
        }
        keel_cuda_free((void *)pw.w);
        qm_free(&q);
    }
}

/* Enough row tiles that a warp walks two side by side (more tile pairs than a full grid has warps, an odd tile count
 * so the last pair is one tile): every width that pairs at m = 1 or m = 8 and groups 64 and 128 (group 32 keeps one
 * tile a warp), bit for bit against the ring tile; the launcher reports it walked pairs exactly where they apply. */
/* Whether the image this device runs has the pair walks (sm_80's has none: KEEL_PK_NO_PAIRS_SM). */
static bool image_has_pairs(void) {
    char desc[128] = "";
    keel_cuda_device_name(desc, sizeof desc);
    return !strstr(desc, "sm_80,");
}

static void test_tile_pairs_equal(void **state) {
    (void)state;
    const int n = 16 * 64 * keel_cuda_sm_count() + 9, k = 256; /* 64 tiles an SM + 1: at most 16 warps an SM */
    const int splits = keel_cuda_stream_splits(n, k, 0);
    if (splits != 1) {
        printf("skip: test_tile_pairs_equal: the ring tile splits n=%d k=%d %d ways on this device, so its bits are not "
               "the packed tile's\n", n, k, splits);
        skip();
    }
    const bool arch_pairs = image_has_pairs();
    for (int bits = 2; bits <= 6; bits++)
        for (int G = 32; G <= 128; G *= 2) {
            qm q;
            qm_make(&q, n, k, bits, G, KEEL_DT_BF16);
            keel_cuda_pw pw = pack(&q);
            for (int m = 1; m <= 8; m += 7) {
                const keel_dtype xdt = bits % 2 ? KEEL_DT_F16 : KEEL_DT_BF16;
                void *dx;
                uint16_t *x = make_x(m, k, xdt, &dx);
                void *yp = run_packed(&pw, dx, xdt, m, KEEL_DT_F32, KEEL_EPI_NONE);
                const bool want = arch_pairs && bits <= (m == 1 ? 5 : 4) && G >= 64;
                if (want != !!(keel_cuda_packed_last_walk() & KEEL_CUDA_PK_WALK_PAIRS))
                    fail_msg("bits %d group %d m %d, %d rows: the launcher %s tile pairs", bits, G, m, n,
                             want ? "did not walk" : "walked");
                void *yr = run_ring(&q, dx, xdt, m, KEEL_DT_F32, KEEL_EPI_NONE);
                if (memcmp(yp, yr, (size_t)m * n * 4))
                    fail_msg("bits %d group %d m %d, %d rows: packed and ring tiles differ", bits, G, m, n);
                free(yp), free(yr), free(x);
                keel_cuda_free(dx);
            }
            keel_cuda_free((void *)pw.w);
            qm_free(&q);
        }
}

/* Columns [c0, c0 + kh) of q (kh and c0 whole groups and 32-code words) as a packed matrix of its own. */
static keel_cuda_pw pack_cols(const qm *q, int c0, int kh) {
    const size_t rw = keel_quant_row_words(q->k, q->bits), hw = keel_quant_row_words(kh, q->bits);
    const size_t ng = (size_t)(q->k / q->group), hg = (size_t)(kh / q->group), es = keel_dtype_size(q->sdt);
    uint32_t *c = keel_xmalloc((size_t)q->n * hw * 4);
    uint8_t *sc = keel_xmalloc((size_t)q->n * hg * es), *bi = keel_xmalloc((size_t)q->n * hg * es);
    for (int r = 0; r < q->n; r++) {
        memcpy(c + r * hw, q->codes + r * rw + (size_t)c0 / 32 * q->bits, hw * 4);
        memcpy(sc + r * hg * es, (uint8_t *)q->scales + (r * ng + (size_t)(c0 / q->group)) * es, hg * es);
        memcpy(bi + r * hg * es, (uint8_t *)q->biases + (r * ng + (size_t)(c0 / q->group)) * es, hg * es);
    }
    const keel_qmat m = {q->n, kh, q->bits, q->group, q->sdt, c, sc, bi};
    keel_cuda_pw pw;
    char why[256] = "";
    if (!keel_cuda_pack_upload(&m, &pw, why, sizeof why)) fail_msg("pack: %s", why);
    free(c), free(sc), free(bi);
    return pw;
}

/* The sequence k in S parts replaces: each part of the spans (ns/S of 128 codes each, the last part to the end of k)
 * an unsplit launch of its own (fp32), then the parts added in order and the epilogue on the host; the split launch
 * must equal it bit for bit. */
static void check_parts_sequence(const qm *q, const uint16_t *x, keel_dtype xdt, int m, const float *ys,
                                 keel_epilogue epi, int S) {
    int cut[5];
    for (int h = 0; h < S; h++) cut[h] = h * ((q->k + 127) / 128 / S * 128);
    cut[S] = q->k;
    float *yh[4];
    for (int h = 0; h < S; h++) {
        const int kh = cut[h + 1] - cut[h];
        uint16_t *xh = keel_xmalloc((size_t)m * kh * 2);
        for (int r = 0; r < m; r++) memcpy(xh + (size_t)r * kh, x + (size_t)r * q->k + (size_t)cut[h], (size_t)kh * 2);
        void *dxh = keel_cuda_malloc((size_t)m * kh * 2);
        keel_cuda_upload(dxh, xh, (size_t)m * kh * 2);
        keel_cuda_pw pw = pack_cols(q, cut[h], kh);
        yh[h] = run_packed(&pw, dxh, xdt, m, KEEL_DT_F32, KEEL_EPI_NONE);
        assert_int_equal(keel_cuda_packed_last_walk() & KEEL_CUDA_PK_WALK_SPLIT, 0);
        keel_cuda_free((void *)pw.w);
        keel_cuda_free(dxh);
        free(xh);
    }
    for (size_t i = 0; i < (size_t)m * q->n; i++) {
        float v = yh[0][i];
        for (int h = 1; h < S; h++) v += yh[h][i];
        if (epi == KEEL_EPI_RELU2) v = v > 0.f ? v * v : 0.f;
        if (memcmp(&v, &ys[i], 4))
            fail_msg("bits %d group %d m %d: y[%zu] of k in %d parts %.9g, the parts' sequence %.9g", q->bits, q->group,
                     m, i, S, (double)ys[i], (double)v);
    }
    for (int h = 0; h < S; h++) free(yh[h]);
}

/* Few row tiles and a long k: the tile sums k in two parts (66 spans) or four (128 spans) through whole x (m = 1;
 * quarters walk two tiles a warp where the width allows pairs, an odd tile count) and on blocks of their own (m > 1,
 * each block its part of x, the parts' sums met in the stream's scratch); within the float64 bound at every width and group,
 * equal bit for bit to the parts' sequence, each row of an 8-row launch (one layout) equal to its 1-row launch (the
 * other), repeated launches equal. */
static void test_split_parts(void **state) {
    (void)state;
    for (int S = 2; S <= 4; S += 2)
        for (size_t bi = 0; bi < KEEL_ARRAY_LEN(kBits); bi++)
            for (size_t gi = 0; gi < KEEL_ARRAY_LEN(kGroups); gi++) {
                /* at groups 32 and 64 the last span partial */
                const int G = kGroups[gi], n = 45 + 16 * (int)(bi % 2);
                const int k = S == 2 ? (G == 128 ? 8448 : 8384) : (G == 128 ? 16384 : 16320);
                assert_int_equal(keel_cuda_packed_splits(n, k), S);
                qm q;
                if (gi == 1)
                    qm_make_signed(&q, n, k, kBits[bi], G, KEEL_DT_BF16);
                else
                    qm_make(&q, n, k, kBits[bi], G, KEEL_DT_BF16);
                keel_cuda_pw pw = pack(&q);
                const keel_dtype xdt = bi % 2 ? KEEL_DT_F16 : KEEL_DT_BF16;
                const int m = 8;
                void *dx;
                uint16_t *x = make_x(m, k, xdt, &dx);
                float *y8 = run_packed(&pw, dx, xdt, m, KEEL_DT_F32, KEEL_EPI_NONE);
                assert_true(keel_cuda_packed_last_walk() & KEEL_CUDA_PK_WALK_SPLIT);
                assert_true(keel_cuda_packed_last_walk() & KEEL_CUDA_PK_WALK_PARTS); /* m > 1: blocks a part */
                check_y(&q, x, xdt, m, KEEL_DT_F32, KEEL_EPI_NONE, y8);
                check_parts_sequence(&q, x, xdt, m, y8, KEEL_EPI_NONE, S);
                int pairs1 = 0;
                for (int r = 0; r < m; r++) {
                    float *y1 = run_packed(&pw, (uint16_t *)dx + (size_t)r * k, xdt, 1, KEEL_DT_F32, KEEL_EPI_NONE);
                    pairs1 = keel_cuda_packed_last_walk() & KEEL_CUDA_PK_WALK_PAIRS;
                    assert_int_equal(keel_cuda_packed_last_walk() & KEEL_CUDA_PK_WALK_PARTS, 0); /* m = 1: one block */
                    if (memcmp(y1, y8 + (size_t)r * n, (size_t)n * 4))
                        fail_msg("bits %d group %d parts %d: row %d of an 8-row launch differs from its 1-row launch",
                                 kBits[bi], G, S, r);
                    free(y1);
                }
                /* quarters walk two tiles a warp at m = 1 (whole x) exactly where the width and the image have pairs */
                const bool want = S == 4 && image_has_pairs() && kBits[bi] <= 5 && G >= 64;
                if (want != !!pairs1)
                    fail_msg("bits %d group %d parts %d: the launcher %s tile pairs at m = 1", kBits[bi], G, S,
                             pairs1 ? "walked" : "did not walk");
                float *y1r = run_packed(&pw, dx, xdt, 1, KEEL_DT_F32, KEEL_EPI_RELU2);
                check_parts_sequence(&q, x, xdt, 1, y1r, KEEL_EPI_RELU2, S);
                free(y1r);
                float *again = run_packed(&pw, dx, xdt, m, KEEL_DT_F32, KEEL_EPI_NONE);
                assert_memory_equal(again, y8, (size_t)m * n * 4);
                free(again);
                void *yr = run_packed(&pw, dx, xdt, 3, KEEL_DT_BF16, KEEL_EPI_RELU2);
                check_y(&q, x, xdt, 3, KEEL_DT_BF16, KEEL_EPI_RELU2, yr);
                void *yr1 = run_packed(&pw, dx, xdt, 1, KEEL_DT_BF16, KEEL_EPI_RELU2); /* row 0 of the 3 alone */
                assert_memory_equal(yr1, yr, (size_t)n * 2);
                free(yr1);
                free(yr), free(y8), free(x);
                keel_cuda_free(dx);
                keel_cuda_free((void *)pw.w);
                qm_free(&q);
            }
    assert_int_equal(keel_cuda_packed_splits(131072, 2688), 1); /* lm_head: many tiles, short k */
    assert_int_equal(keel_cuda_packed_splits(45, 8320), 1);     /* 65 spans: no even halves */
    assert_int_equal(keel_cuda_packed_splits(45, 16640), 2);    /* 130 spans: even, not a multiple of 4 */
}

/* k in quarters on as many row tiles as still split (8 a SM), m = 8: the parts on blocks of their own walk several tiles
 * a warp (one tile a warp) or a unit each (pairs), and the last part of each tile to arrive adds them; each row equals
 * its 1-row launch (parts on the warps of one block), row 0 is within the float64 bound, a second launch (the
 * counters back at zero) gives the same bits. */
static void test_parts_many_tiles(void **state) {
    (void)state;
    const int n = 128 * keel_cuda_sm_count() - 8, k = 16384, m = 8;
    assert_int_equal(keel_cuda_packed_splits(n, k), 4);
    const struct { int bits, group; } cases[] = {{4, 64}, {4, 32}, {6, 128}, {2, 128}};
    for (size_t c = 0; c < KEEL_ARRAY_LEN(cases); c++) {
        qm q;
        qm_make_signed(&q, n, k, cases[c].bits, cases[c].group, KEEL_DT_BF16);
        keel_cuda_pw pw = pack(&q);
        void *dx;
        uint16_t *x = make_x(m, k, KEEL_DT_BF16, &dx);
        float *y8 = run_packed(&pw, dx, KEEL_DT_BF16, m, KEEL_DT_F32, KEEL_EPI_NONE);
        assert_true(keel_cuda_packed_last_walk() & KEEL_CUDA_PK_WALK_PARTS);
        check_y(&q, x, KEEL_DT_BF16, 1, KEEL_DT_F32, KEEL_EPI_NONE, y8);
        for (int r = 0; r < m; r++) {
            float *y1 = run_packed(&pw, (uint16_t *)dx + (size_t)r * k, KEEL_DT_BF16, 1, KEEL_DT_F32, KEEL_EPI_NONE);
            if (memcmp(y1, y8 + (size_t)r * n, (size_t)n * 4))
                fail_msg("bits %d group %d n %d: row %d of an 8-row launch (parts on blocks) differs from its 1-row "
                         "launch", cases[c].bits, cases[c].group, n, r);
            free(y1);
        }
        float *again = run_packed(&pw, dx, KEEL_DT_BF16, m, KEEL_DT_F32, KEEL_EPI_NONE);
        assert_memory_equal(again, y8, (size_t)m * n * 4);
        free(again), free(y8), free(x);
        keel_cuda_free(dx);
        keel_cuda_free((void *)pw.w);
        qm_free(&q);
    }
}

/* A launch reads x only once the kernel before it on the stream wrote it: for the unsplit kernel, the m = 1 split
 * kernel and the m = 8 parts kernel (each case checks which walked), x is the bf16 output of a packed launch just
 * before it on the same stream (a programmatic dependent on sm_90: it may start before that launch ends), and the
 * launch gives the bits it gives when x was in place before it started; three chains each, x poisoned (NaN) before
 * each. */
static void test_dependent_launch(void **state) {
    (void)state;
    const int split = KEEL_CUDA_PK_WALK_SPLIT, parts = KEEL_CUDA_PK_WALK_PARTS;
    const struct { int n, k, bits, group, m, walk; } cases[] = {{1024, 2688, 4, 64, 1, 0},
                                                               {256, 16384, 2, 128, 1, split},
                                                               {256, 16384, 4, 64, 8, split | parts},
                                                               {2048, 4096, 3, 32, 1, 0}};
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    keel_cuda_stream_pdl(1);
    for (size_t c = 0; c < KEEL_ARRAY_LEN(cases); c++) {
        const int n = cases[c].n, k = cases[c].k, m = cases[c].m, ka = 1024;
        qm qa, qb;
        qm_make_signed(&qa, k, ka, 4, 64, KEEL_DT_BF16);
        qm_make_signed(&qb, n, k, cases[c].bits, cases[c].group, KEEL_DT_BF16);
        keel_cuda_pw pa = pack(&qa), pb = pack(&qb);
        void *dxa;
        uint16_t *xa = make_x(m, ka, KEEL_DT_BF16, &dxa);
        void *dmid = keel_cuda_malloc((size_t)m * k * 2), *dy = keel_cuda_malloc((size_t)m * n * 4);
        keel_cuda_stream_matmul_packed(&pa, dxa, KEEL_DT_BF16, m, dmid, KEEL_DT_BF16, KEEL_EPI_NONE, st);
        keel_cuda_sync();
        float *want = run_packed(&pb, dmid, KEEL_DT_BF16, m, KEEL_DT_F32, KEEL_EPI_NONE); /* x in place first */
        float *got = keel_xmalloc((size_t)m * n * 4);
        for (int rep = 0; rep < 3; rep++) {
            keel_cuda_memset(dmid, 0xff, (size_t)m * k * 2);
            keel_cuda_memset(dy, 0xff, (size_t)m * n * 4);
            keel_cuda_sync();
            keel_cuda_stream_matmul_packed(&pa, dxa, KEEL_DT_BF16, m, dmid, KEEL_DT_BF16, KEEL_EPI_NONE, st);
            keel_cuda_stream_matmul_packed(&pb, dmid, KEEL_DT_BF16, m, dy, KEEL_DT_F32, KEEL_EPI_NONE, st);
            assert_int_equal(keel_cuda_packed_last_walk() & (split | parts), cases[c].walk);
            keel_cuda_sync();
            keel_cuda_download(got, dy, (size_t)m * n * 4);
            if (memcmp(got, want, (size_t)m * n * 4))
                fail_msg("bits %d group %d n %d k %d m %d: a dependent launch (chain %d) differs from the launch "
                         "after its x was in place", cases[c].bits, cases[c].group, n, k, m, rep);
        }
        free(got), free(want), free(xa);
        keel_cuda_free(dmid), keel_cuda_free(dy), keel_cuda_free(dxa);
        keel_cuda_free((void *)pa.w), keel_cuda_free((void *)pb.w);
        qm_free(&qa), qm_free(&qb);
    }
    keel_cuda_stream_pdl(KEEL_CUDA_STREAM_PDL_DEFAULT);
    keel_cuda_stream_scratch_release(st); /* the parts kernel's scratch of this stream, before the stream goes */
    CK(cudaStreamDestroy(st));
}

/* The x budget chunks x differently and never moves a bit: the chunked long-k path (m = 8, several chunks at small
 * budgets) and a k split in four (m = 8 parts on blocks, x-chunks at small budgets; m = 1 whole x) at the smallest
 * budget, 48 KB, the largest this device allows, against the default (auto); bad budgets are refused and change
 * nothing. */
static void test_xbudget_bits(void **state) {
    (void)state;
    assert_int_equal(keel_cuda_packed_xbudget_now(), KEEL_CUDA_PACKED_XBUDGET_AUTO);
    assert_false(keel_cuda_packed_xbudget(KEEL_CUDA_PACKED_XBYTES_MIN - 1024));
    assert_false(keel_cuda_packed_xbudget(KEEL_CUDA_PACKED_XBYTES + 1));
    assert_false(keel_cuda_packed_xbudget(1 << 30));
    assert_false(keel_cuda_packed_xbudget(-2));
    assert_int_equal(keel_cuda_packed_xbudget_now(), KEEL_CUDA_PACKED_XBUDGET_AUTO);
    int most = KEEL_CUDA_PACKED_XBYTES;
    while (keel_cuda_packed_xbudget(most + 1024)) most += 1024;
    assert_true(keel_cuda_packed_xbudget(0));
    const int budgets[] = {KEEL_CUDA_PACKED_XBYTES_MIN, KEEL_CUDA_PACKED_XBYTES, most};
    const struct { int n, k, bits, m; } cases[] = {{333, 4160, 3, 8}, {45, 16320, 4, 8}, {61, 16384, 5, 1}};
    for (size_t c = 0; c < KEEL_ARRAY_LEN(cases); c++) {
        qm q;
        qm_make(&q, cases[c].n, cases[c].k, cases[c].bits, 64, KEEL_DT_BF16);
        keel_cuda_pw pw = pack(&q);
        void *dx;
        uint16_t *x = make_x(cases[c].m, cases[c].k, KEEL_DT_BF16, &dx);
        float *y0 = run_packed(&pw, dx, KEEL_DT_BF16, cases[c].m, KEEL_DT_F32, KEEL_EPI_NONE);
        check_y(&q, x, KEEL_DT_BF16, cases[c].m, KEEL_DT_F32, KEEL_EPI_NONE, y0);
        for (size_t b = 0; b < KEEL_ARRAY_LEN(budgets); b++) {
            assert_true(keel_cuda_packed_xbudget(budgets[b]));
            float *yb = run_packed(&pw, dx, KEEL_DT_BF16, cases[c].m, KEEL_DT_F32, KEEL_EPI_NONE);
            if (memcmp(yb, y0, (size_t)cases[c].m * cases[c].n * 4))
                fail_msg("n %d k %d bits %d m %d: an x budget of %d bytes changed the bits of the default's (auto)",
                         cases[c].n, cases[c].k, cases[c].bits, cases[c].m, budgets[b]);
            free(yb);
        }
        assert_true(keel_cuda_packed_xbudget(0));
        free(y0), free(x);
        keel_cuda_free(dx);
        keel_cuda_free((void *)pw.w);
        qm_free(&q);
    }
    assert_true(keel_cuda_packed_xbudget(KEEL_CUDA_PACKED_XBYTES));
    assert_int_equal(keel_cuda_packed_xbudget_now(), KEEL_CUDA_PACKED_XBYTES);
    assert_true(keel_cuda_packed_xbudget(0));
    assert_int_equal(keel_cuda_packed_xbudget_now(), KEEL_CUDA_PACKED_XBUDGET_AUTO);
    printf("x budgets auto (default), %d, %d and %d bytes give the same bits\n", KEEL_CUDA_PACKED_XBYTES_MIN,
           KEEL_CUDA_PACKED_XBYTES, most);
}

static void test_kernel_fn(void **state) {
    (void)state;
    char sym[48];
    for (int x = 0; x < 2; x++)
        for (size_t bi = 0; bi < KEEL_ARRAY_LEN(kBits); bi++) {
            snprintf(sym, sizeof sym, "stream_packed<%d,%s>", kBits[bi], x ? "true" : "false");
            assert_non_null(keel_cuda_kernel_fn(sym));
        }
    assert_null(keel_cuda_packed_kernel_fn("stream_packed<7,false>"));
}

int main(void) {
    if (keel_cuda_device_count() < 1) {
        printf("skip: no CUDA device on this machine\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_ring_and_reference),
        cmocka_unit_test(test_bits_and_chunks),
        cmocka_unit_test(test_large_equal),
        cmocka_unit_test(test_tile_pairs_equal),
        cmocka_unit_test(test_split_parts),
        cmocka_unit_test(test_parts_many_tiles),
        cmocka_unit_test(test_dependent_launch),
        cmocka_unit_test(test_xbudget_bits),
        cmocka_unit_test(test_kernel_fn),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
#else
int main(void) {
    printf("skip: keel was built without CUDA (KEEL_CUDA=OFF or no nvcc)\n");
    return 77;
}
#endif
