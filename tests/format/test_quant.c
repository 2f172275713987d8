/* format/quant: MLX affine quantizer bit for bit against the shared fixture, packing layout, error bounds. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "format/format.h"
#include "common/testkit.h"

static const int BITS[] = {2, 3, 4, 5, 6, 8};
static const int GROUPS[] = {32, 64, 128};
static const keel_dtype SDTS[] = {KEEL_DT_BF16, KEEL_DT_F16, KEEL_DT_F32};

/* xorshift64*: deterministic test data without libc rand's platform differences. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng_u64(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ull;
}
static double rng_unit(void) { return (double)(rng_u64() >> 11) * 0x1p-53; } /* [0, 1) */
static float rng_sym(float a) { return (float)((2.0 * rng_unit() - 1.0) * a); }

static const keel_st_tensor *need(const keel_st *st, const char *prefix, const char *suffix, keel_dtype dt,
                                  int64_t d0, int64_t d1) {
    char name[256];
    snprintf(name, sizeof name, "%s%s", prefix, suffix);
    return tk_st_need(st, name, dt, 2, (const int64_t[]){d0, d1});
}

/* All 18 fixture entries: quantizing .w_float reproduces MLX's .weight/.scales/.biases exactly, and the fixture's
 * own quantized matrix dequantized and multiplied by .x reproduces the float64 product .y within a derived bound. */
static void test_fixture_bit_exact(void **state) {
    (void)state;
    assert_non_null(getenv("KEEL_FIXTURES"));
    char path[1024];
    tk_fixture(path, sizeof path, "stream_tiles_shared.safetensors");
    keel_st st;
    keel_err err = {0};
    keel_code rc = keel_st_open(&st, path, &err);
    if (rc != KEEL_OK) fail_msg("open %s: %s", path, err.msg);
    const int n = 48, k = 256, m = 3;
    int entries = 0;
    double worst_ratio = 0;
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(BITS); bi++)
        for (size_t gi = 0; gi < KEEL_ARRAY_LEN(GROUPS); gi++) {
            int bits = BITS[bi], group = GROUPS[gi], ng = k / group;
            char pre[64];
            snprintf(pre, sizeof pre, "n48_k256_m3_b%d_g%d", bits, group);
            keel_dtype sdt = bits == 6 ? KEEL_DT_F16 : KEEL_DT_BF16;
            const keel_st_tensor *wf = need(&st, pre, ".w_float", KEEL_DT_F32, n, k);
            const keel_st_tensor *wq = need(&st, pre, ".weight", KEEL_DT_U32, n, (int64_t)k * bits / 32);
            const keel_st_tensor *sc = need(&st, pre, ".scales", sdt, n, ng);
            const keel_st_tensor *bs = need(&st, pre, ".biases", sdt, n, ng);
            const keel_st_tensor *xt = need(&st, pre, ".x", KEEL_DT_BF16, m, k);
            const keel_st_tensor *yt = need(&st, pre, ".y", KEEL_DT_F64, m, n);
            const keel_st_tensor *yr = need(&st, pre, ".y_relu2", KEEL_DT_F64, m, n);

            float *w = malloc(sizeof(float) * n * k);
            memcpy(w, wf->data, sizeof(float) * n * k);
            uint32_t *codes = malloc(wq->nbytes);
            void *scales = malloc(sc->nbytes), *biases = malloc(bs->nbytes);
            keel_quant_quantize(w, n, k, bits, group, sdt, codes, scales, biases);
            for (size_t i = 0; i < wq->nbytes / 4; i++)
                if (codes[i] != ((const uint32_t *)wq->data)[i])
                    fail_msg("%s.weight word %zu: keel %08x, MLX %08x", pre, i, codes[i],
                             ((const uint32_t *)wq->data)[i]);
            for (size_t i = 0; i < (size_t)n * ng; i++) {
                uint16_t a, b;
                memcpy(&a, (const uint8_t *)scales + 2 * i, 2);
                memcpy(&b, (const uint8_t *)sc->data + 2 * i, 2);
                if (a != b) fail_msg("%s.scales[%zu]: keel %04x, MLX %04x", pre, i, a, b);
                memcpy(&a, (const uint8_t *)biases + 2 * i, 2);
                memcpy(&b, (const uint8_t *)bs->data + 2 * i, 2);
                if (a != b) fail_msg("%s.biases[%zu]: keel %04x, MLX %04x", pre, i, a, b);
            }
            if (bits == 5) { /* row 0 is the zero-range case: every code 0, |scale| tiny, bias the constant */
                for (int c = 0; c < k; c++) assert_int_equal(keel_quant_code(codes, bits, c), 0);
                assert_true(fabsf(keel_dtype_get_f32(sdt, scales, 0)) < 1e-6f);
                assert_true(keel_dtype_get_f32(sdt, biases, 0) == w[0]);
            }

            /* Bound for |y - y_ref|, y = sum_i x_i * wd_i in float64 with wd_i = fl32(fl32(s*q_i) + b):
             * each fl32 has relative error <= u = 2^-24, so |wd_i - (s q_i + b)| <= u(2+u)|s q_i| + u|b|.
             * x_i (bf16) * wd_i (f32) needs 8+24 bits, so products are exact in float64; naive summation of k
             * terms adds <= (k-1) 2^-53 sum|x_i wd_i|. The reference's own float64 evaluation is allowed the same
             * (k+1) 2^-53 sum|x_i|(|s q_i|+|b|). Then |relu(y)^2 - relu(y_ref)^2| <= e (2|y_ref| + e). */
            keel_qmat qm = {.n = n, .k = k, .bits = bits, .group = group, .sdt = sdt, .w = wq->data,
                            .scales = sc->data, .biases = bs->data};
            float *wd = malloc(sizeof(float) * n * k);
            keel_quant_dequantize(&qm, wd);
            const double u = 0x1p-24, ud = 0x1p-53;
            for (int r = 0; r < m; r++)
                for (int o = 0; o < n; o++) {
                    double y = 0, bound = 0, mag = 0;
                    for (int c = 0; c < k; c++) {
                        double x = keel_dtype_get_f32(KEEL_DT_BF16, xt->data, (size_t)r * k + c);
                        double s = keel_dtype_get_f32(sdt, sc->data, (size_t)o * ng + c / group);
                        double b = keel_dtype_get_f32(sdt, bs->data, (size_t)o * ng + c / group);
                        double sq = fabs(s * keel_quant_code((const uint32_t *)wq->data + (size_t)o * k * bits / 32,
                                                             bits, c));
                        y += x * wd[(size_t)o * k + c];
                        bound += fabs(x) * (u * (2 + u) * sq + u * fabs(b));
                        mag += fabs(x) * (sq + fabs(b) + fabs(wd[(size_t)o * k + c]));
                    }
                    bound += (double)(k + 1) * ud * mag;
                    double yref = ((const double *)yt->data)[r * n + o];
                    double e = fabs(y - yref);
                    if (!(e <= bound))
                        fail_msg("%s: y[%d,%d] = %.17g, reference %.17g, |diff| %.3g > bound %.3g", pre, r, o, y,
                                 yref, e, bound);
                    if (bound > 0 && e / bound > worst_ratio) worst_ratio = e / bound;
                    double rl = y > 0 ? y * y : 0, rref = ((const double *)yr->data)[r * n + o];
                    double e2 = bound * (2 * fabs(yref) + bound);
                    if (!(fabs(rl - rref) <= e2 + 4 * ud * fabs(rref)))
                        fail_msg("%s: y_relu2[%d,%d] = %.17g, reference %.17g", pre, r, o, rl, rref);
                }
            free(wd);
            free(w);
            free(codes);
            free(scales);
            free(biases);
            entries++;
        }
    assert_int_equal(entries, 18);
    printf("fixture: 18 entries bit-exact; worst |y - y_ref| / bound = %.3g\n", worst_ratio);
    keel_st_free(&st);
}

/* Packing: every code lands at bit c*bits of the row's little-endian word stream, LSB first, straddling words. */
static void test_pack_roundtrip(void **state) {
    (void)state;
    const int ks[] = {32, 64, 128, 3 * 64, 4 * 128, 32 * 7};
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(BITS); bi++)
        for (size_t ki = 0; ki < KEEL_ARRAY_LEN(ks); ki++) {
            int bits = BITS[bi], k = ks[ki];
            size_t nw = keel_quant_row_words(k, bits);
            assert_int_equal(nw * 32, (size_t)k * bits);
            uint8_t *codes = malloc((size_t)k), *back = malloc((size_t)k);
            assert_non_null(codes);
            assert_non_null(back);
            uint32_t *row = malloc((nw + 1) * 4);
            for (int c = 0; c < k; c++) /* all-ones in the last code reaches the last bit */
                codes[c] = (uint8_t)(c == k - 1 ? (1u << bits) - 1 : rng_u64() & ((1u << bits) - 1));
            row[nw] = 0xdeadbeefu;                       /* guard word past the row */
            keel_quant_pack_row(codes, k, bits, row);
            assert_int_equal(row[nw], 0xdeadbeefu);
            for (int c = 0; c < k; c++)
                for (int t = 0; t < bits; t++) {
                    size_t bit = (size_t)c * bits + t;
                    uint32_t got = (row[bit / 32] >> (bit % 32)) & 1u;
                    if (got != ((codes[c] >> t) & 1u))
                        fail_msg("bits %d k %d: code %d bit %d is %u in the stream", bits, k, c, t, got);
                }
            keel_quant_unpack_row(row, k, bits, back);
            assert_memory_equal(codes, back, k);
            for (int c = 0; c < k; c++) assert_int_equal(keel_quant_code(row, bits, c), codes[c]);
            free(codes);
            free(back);
            free(row);
        }
}

/* Known layouts written out by hand: 3-bit codes 0..7 repeating, 6-bit code straddling words 0 and 1. */
static void test_pack_known_words(void **state) {
    (void)state;
    uint8_t codes[32];
    uint32_t row[6];
    for (int c = 0; c < 32; c++) codes[c] = (uint8_t)(c & 7);
    keel_quant_pack_row(codes, 32, 3, row);
    /* codes 0..7 as 3-bit fields = 0xFAC688 per 24 bits; words are this 24-bit pattern repeated */
    assert_int_equal(row[0], 0x88fac688u);
    assert_int_equal(row[1], 0xc688fac6u);
    assert_int_equal(row[2], 0xfac688fau);
    memset(codes, 0, sizeof codes);
    codes[5] = 0x3f; /* bits 30..35: two bits in word 0, four in word 1 */
    keel_quant_pack_row(codes, 32, 6, row);
    assert_int_equal(row[0], 0xc0000000u);
    assert_int_equal(row[1], 0x0000000fu);
    for (int i = 2; i < 6; i++) assert_int_equal(row[i], 0);
}

/* Scale and bias each a value of the dtype, so that the rounding terms of the error bound are known. */
static float round_to(keel_dtype dt, float v) {
    uint8_t buf[4];
    keel_dtype_set_f32(dt, buf, 0, v);
    return keel_dtype_get_f32(dt, buf, 0);
}

enum { DIST_UNIFORM, DIST_NEG, DIST_POS_OFFSET, DIST_CONST, DIST_LARGE, DIST_TINY, DIST_SPIKE, DIST_COUNT };

static void fill_row(float *w, int k, int dist, keel_dtype sdt) {
    float big = sdt == KEEL_DT_F16 ? 2000.0f : 1e30f; /* F16 scales and biases top out at 65504 */
    float c0 = rng_sym(3.0f);
    for (int c = 0; c < k; c++) {
        switch (dist) {
        case DIST_UNIFORM: w[c] = rng_sym(1.0f); break;
        case DIST_NEG: w[c] = -0.5f - (float)rng_unit() * 2.0f; break;
        case DIST_POS_OFFSET: w[c] = 10.0f + (float)rng_unit(); break;
        case DIST_CONST: w[c] = c0; break;
        case DIST_LARGE: w[c] = rng_sym(big); break;
        case DIST_TINY: w[c] = rng_sym(3e-8f); break;
        default: w[c] = (c % 37 == 5) ? 40.0f : rng_sym(0.01f); break;
        }
    }
}

/* Half an ulp of |x| in dt, bounded as a relative part plus a floor for subnormals. */
static double half_ulp(keel_dtype dt, double x) {
    switch (dt) {
    case KEEL_DT_BF16: return fabs(x) * 0x1p-8 + 0x1p-134;
    case KEEL_DT_F16: return fabs(x) * 0x1p-11 + 0x1p-25;
    default: return fabs(x) * 0x1p-24 + 0x1p-150;
    }
}

/* quantize -> dequantize: with s, b the float32 scale and bias the codes were computed from, an element whose code
 * is below 2^bits-1 lies within |s|/2 of s q + b (b is a group edge, so nothing clips at 0 except values within
 * eps/2 of 0); the top code may have been clipped by up to one step because MLX rounds q0 = edge/scale, so |s|
 * there. Storing s and b in the scale dtype adds n_bins halfulp(s) + halfulp(b); dequantizing in float32 adds
 * 2^-24 (2+2^-24) n_bins|s'| + 2^-24|b'|; the float32 subtraction and division feeding rint add
 * (n_bins + 2) 2^-23 |s|. |s| is bounded by the stored |s'| + halfulp. */
static void test_quantize_error_bound(void **state) {
    (void)state;
    const int n = DIST_COUNT * 2, k = 256;
    float *w = malloc(sizeof(float) * n * k), *wd = malloc(sizeof(float) * n * k);
    uint32_t *codes = malloc((size_t)n * k); /* 8 bits per code at most */
    float *scales = malloc(sizeof(float) * n * 8), *biases = malloc(sizeof(float) * n * 8);
    long clipped = 0, checked = 0;
    double worst = 0;
    for (size_t si = 0; si < KEEL_ARRAY_LEN(SDTS); si++)
        for (size_t bi = 0; bi < KEEL_ARRAY_LEN(BITS); bi++)
            for (size_t gi = 0; gi < KEEL_ARRAY_LEN(GROUPS); gi++) {
                keel_dtype sdt = SDTS[si];
                int bits = BITS[bi], group = GROUPS[gi], ng = k / group;
                double nb = (double)((1 << bits) - 1);
                for (int r = 0; r < n; r++) fill_row(w + (size_t)r * k, k, r % DIST_COUNT, sdt);
                keel_quant_quantize(w, n, k, bits, group, sdt, codes, scales, biases);
                keel_qmat qm = {.n = n, .k = k, .bits = bits, .group = group, .sdt = sdt, .w = codes,
                                .scales = scales, .biases = biases};
                keel_quant_dequantize(&qm, wd);
                for (int r = 0; r < n; r++)
                    for (int g = 0; g < ng; g++) {
                        const float *wg = w + (size_t)r * k + (size_t)g * group;
                        float lo = wg[0], hi = wg[0];
                        for (int j = 1; j < group; j++) {
                            lo = fminf(lo, wg[j]);
                            hi = fmaxf(hi, wg[j]);
                        }
                        double sp = keel_dtype_get_f32(sdt, scales, (size_t)r * ng + g);
                        double bp = keel_dtype_get_f32(sdt, biases, (size_t)r * ng + g);
                        /* the bias is the group's larger-magnitude edge, or 0 when the range is below eps */
                        double edge = fabs(lo) > fabs(hi) ? lo : hi;
                        if (bp != 0 || (hi - lo) >= 1e-6) assert_true(bp == round_to(sdt, (float)edge));
                        double s = fabs(sp) + half_ulp(sdt, sp);
                        for (int j = 0; j < group; j++) {
                            size_t idx = (size_t)r * k + (size_t)g * group + j;
                            const uint32_t *row = codes + (size_t)r * keel_quant_row_words(k, bits);
                            uint32_t q = keel_quant_code(row, bits, g * group + j);
                            bool top = q == (uint32_t)nb;
                            clipped += top;
                            double bound = (top ? s : s / 2) + nb * half_ulp(sdt, s) + half_ulp(sdt, edge) +
                                           0x1p-24 * (2 + 0x1p-24) * nb * fabs(sp) + 0x1p-24 * fabs(bp) +
                                           (nb + 2) * 0x1p-23 * s;
                            double e = fabs((double)wd[idx] - wg[j]);
                            if (!(e <= bound))
                                fail_msg("%s b%d g%d row %d (dist %d) col %d: w %.9g, dequantized %.9g, "
                                         "code %u, scale %.9g, bias %.9g, error %.3g > bound %.3g",
                                         keel_dtype_name(sdt), bits, group, r, r % DIST_COUNT, g * group + j,
                                         wg[j], wd[idx], q, sp, bp, e, bound);
                            if (e / bound > worst) worst = e / bound;
                            checked++;
                        }
                    }
            }
    assert_true(clipped > 0);
    printf("error bound: %ld elements checked, %ld at the top code, worst error/bound %.3f\n", checked, clipped,
           worst);
    free(w);
    free(wd);
    free(codes);
    free(scales);
    free(biases);
}

/* Float matrices (bits 0) dequantize to the stored values, for each float dtype. */
static void test_dequantize_float_rows(void **state) {
    (void)state;
    const uint16_t bf[4] = {0x3f80, 0xc000, 0x3e80, 0x0000};  /* 1, -2, 0.25, 0 */
    const uint16_t hf[4] = {0x3c00, 0xc000, 0x3400, 0x7bff};  /* 1, -2, 0.25, 65504 */
    const float ff[4] = {1.0f, -2.0f, 0.25f, 1e30f};
    const float want_bf[2][2] = {{1.0f, -2.0f}, {0.25f, 0.0f}};
    const float want_hf[2][2] = {{1.0f, -2.0f}, {0.25f, 65504.0f}};
    const float want_ff[2][2] = {{1.0f, -2.0f}, {0.25f, 1e30f}};
    const void *data[3] = {bf, hf, ff};
    const keel_dtype dts[3] = {KEEL_DT_BF16, KEEL_DT_F16, KEEL_DT_F32};
    const float (*want[3])[2] = {want_bf, want_hf, want_ff};
    for (int d = 0; d < 3; d++) {
        keel_qmat qm = {.n = 2, .k = 2, .bits = 0, .group = 0, .sdt = dts[d], .w = data[d]};
        float out[2];
        for (int r = 0; r < 2; r++) {
            keel_quant_dequantize_row(&qm, r, out);
            assert_true(out[0] == want[d][r][0] && out[1] == want[d][r][1]);
        }
        float all[4];
        keel_quant_dequantize(&qm, all);
        assert_true(all[3] == want[d][1][1]);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pack_known_words),
        cmocka_unit_test(test_pack_roundtrip),
        cmocka_unit_test(test_dequantize_float_rows),
        cmocka_unit_test(test_quantize_error_bound),
        cmocka_unit_test(test_fixture_bit_exact),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
