/* The CPU stream tile against a float64 reference, plus its bitwise contracts: row independence, determinism,
 * thread-count independence, AVX2 == portable, fused relu^2 == matmul then relu2.
 *
 * Error bound. The kernel forms every output from terms x_c*s*q_c and x_c*b (their magnitudes sum to
 * A = sum_c |x_c| (|s q_c| + |b|)); each term passes through at most L roundings: G/8 in its group's lane chain
 * (or the group sum of x), 1 for the scale (or bias) fma, ng-1 more in the chain over groups, 3 in the lane
 * reduction and 1 in the final add, so L = G/8 + ng + 4 (float matrices: ceil(k/8) + 3). Standard summation
 * analysis gives |y - y_ref| <= gamma_L * A with gamma_L = L*u/(1 - L*u) <= 1.01*L*u for u = 2^-24 here, so
 * the bound is 1.01*L*u*A (+1e-30 for underflow). A reference dequantized in float32 (the fixture's may be)
 * adds one rounding per weight: L + 1 there. relu^2 adds |a^2-b^2| <= e*(2|y|+e) plus one rounding of y^2.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

#include "format/format.h"
#include "kernels/cpu/cpu.h"

static const int BITS[] = {2, 3, 4, 5, 6, 8};
static const int GROUPS[] = {32, 64, 128};
static const keel_dtype SDTS[] = {KEEL_DT_BF16, KEEL_DT_F16, KEEL_DT_F32};
#define U 0x1p-24

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static double unif(void) { return (double)(rnd() >> 11) * 0x1p-53; } /* [0, 1) */
static float sym(float a) { return (float)((2.0 * unif() - 1.0) * a); }

/* A quantized (bits > 0) or float matrix with owned storage. */
typedef struct mat {
    keel_qmat q;
    uint32_t *w;
    void *s, *b;
} mat;

/* Random codes; signed scales; every 5th group zero-range (scale 0 or +-1e-7, one code); `mag` scales it all. */
static mat make_q(int n, int k, int bits, int group, keel_dtype sdt, float mag) {
    mat M = {0};
    const int ng = k / group;
    const size_t words = keel_quant_row_words(k, bits);
    M.w = malloc((size_t)n * words * 4);
    M.s = malloc((size_t)n * ng * 4);
    M.b = malloc((size_t)n * ng * 4);
    uint8_t *codes = malloc((size_t)k);
    for (int j = 0; j < n; j++) {
        for (int g = 0; g < ng; g++) {
            const bool flat = (j * ng + g) % 5 == 3;
            const uint8_t c0 = (uint8_t)(rnd() % (1u << bits));
            for (int c = 0; c < group; c++) codes[g * group + c] = flat ? c0 : (uint8_t)(rnd() % (1u << bits));
            float s = flat ? ((j + g) % 3 == 0 ? 0.0f : ((j & 1) ? 1e-7f : -1e-7f)) : sym(mag / (float)(1 << bits));
            keel_dtype_set_f32(sdt, M.s, (size_t)j * ng + g, s);
            keel_dtype_set_f32(sdt, M.b, (size_t)j * ng + g, sym(mag));
        }
        keel_quant_pack_row(codes, k, bits, M.w + (size_t)j * words);
    }
    free(codes);
    M.q = (keel_qmat){.n = n, .k = k, .bits = bits, .group = group, .sdt = sdt, .w = M.w, .scales = M.s, .biases = M.b};
    return M;
}

static mat make_f(int n, int k, keel_dtype sdt) {
    mat M = {0};
    M.w = malloc((size_t)n * k * 4 + 4);
    for (size_t i = 0; i < (size_t)n * k; i++) keel_dtype_set_f32(sdt, M.w, i, sym(2.0f));
    M.q = (keel_qmat){.n = n, .k = k, .bits = 0, .group = 0, .sdt = sdt, .w = M.w};
    return M;
}

static void mat_free(mat *M) {
    free(M->w);
    free(M->s);
    free(M->b);
}

static float *make_x(int m, int k, float mag) {
    float *x = malloc((size_t)m * k * sizeof *x);
    for (size_t i = 0; i < (size_t)m * k; i++) x[i] = sym(mag);
    return x;
}

/* Exact-math reference in float64 (w = s*q + b from the stored values) and the bound of the header comment. */
static void reference(const keel_qmat *W, const float *x, int m, double *y, double *bound, int extra_roundings) {
    const int n = W->n, k = W->k;
    for (int r = 0; r < m; r++)
        for (int j = 0; j < n; j++) {
            double acc = 0, A = 0;
            int L;
            if (W->bits == 0) {
                for (int c = 0; c < k; c++) {
                    double w = keel_dtype_get_f32(W->sdt, W->w, (size_t)j * k + c);
                    acc += (double)x[(size_t)r * k + c] * w;
                    A += fabs((double)x[(size_t)r * k + c] * w);
                }
                L = (k + 7) / 8 + 3;
            } else {
                const int ng = k / W->group;
                const uint32_t *row = W->w + (size_t)j * keel_quant_row_words(k, W->bits);
                for (int c = 0; c < k; c++) {
                    const size_t gi = (size_t)j * ng + c / W->group;
                    double s = keel_dtype_get_f32(W->sdt, W->scales, gi), b = keel_dtype_get_f32(W->sdt, W->biases, gi);
                    double sq = s * (double)keel_quant_code(row, W->bits, c), xv = x[(size_t)r * k + c];
                    acc += xv * (sq + b);
                    A += fabs(xv) * (fabs(sq) + fabs(b));
                }
                L = W->group / 8 + ng + 4;
            }
            y[(size_t)r * n + j] = acc;
            bound[(size_t)r * n + j] = 1.01 * (L + extra_roundings) * U * A + 1e-30;
        }
}

static void check_close(const float *y, const double *ref, const double *bound, size_t count, bool relu2,
                        const char *what) {
    size_t nonzero = 0, distinct = 0;
    for (size_t i = 0; i < count; i++) {
        double want = ref[i], e = bound[i];
        if (relu2) {
            double r = want > 0 ? want : 0;
            e = e * (2 * fabs(r) + e) + U * (r + e) * (r + e);
            want = r * r;
        }
        if (!(fabs((double)y[i] - want) <= e)) {
            fail_msg("%s: element %zu = %.9g, reference %.9g, bound %.3g", what, i, (double)y[i], want, e);
        }
        nonzero += y[i] != 0.0f;
        distinct += i > 0 && y[i] != y[0];
    }
    if (count > 1 && (nonzero == 0 || distinct == 0)) fail_msg("%s: output is all zero or all equal", what);
}

static void assert_bits_equal(const float *a, const float *b, size_t count, const char *what) {
    if (memcmp(a, b, count * sizeof *a) != 0) {
        for (size_t i = 0; i < count; i++)
            if (keel_f32_as_u32(a[i]) != keel_f32_as_u32(b[i]))
                fail_msg("%s: element %zu differs: %.9g vs %.9g", what, i, (double)a[i], (double)b[i]);
    }
}

/* Everything one matrix must satisfy: reference bound, rows m=1..8 equal to rows of m=13, determinism,
 * fused relu^2, portable == AVX2. */
static void check_matrix(const keel_qmat *W, float xmag, const char *what) {
    const int n = W->n, k = W->k, M = 13;
    float *x = make_x(M, k, xmag);
    float *y = malloc((size_t)M * n * 4), *y2 = malloc((size_t)M * n * 4), *ym = malloc((size_t)M * n * 4);
    double *ref = malloc((size_t)M * n * 8), *bound = malloc((size_t)M * n * 8);
    char msg[160];

    keel_cpu_matmul(W, x, M, y, KEEL_EPI_NONE);
    reference(W, x, M, ref, bound, 0);
    snprintf(msg, sizeof msg, "%s m=13", what);
    check_close(y, ref, bound, (size_t)M * n, false, msg);

    for (int m = 1; m <= 8; m++) { /* rows of an m-row call == the same rows of the 13-row call */
        for (int r0 = 0; r0 + m <= M; r0 += 5) {
            keel_cpu_matmul(W, x + (size_t)r0 * k, m, ym, KEEL_EPI_NONE);
            snprintf(msg, sizeof msg, "%s row independence m=%d from row %d", what, m, r0);
            assert_bits_equal(ym, y + (size_t)r0 * n, (size_t)m * n, msg);
        }
    }
    keel_cpu_matmul(W, x, M, y2, KEEL_EPI_NONE);
    snprintf(msg, sizeof msg, "%s determinism", what);
    assert_bits_equal(y, y2, (size_t)M * n, msg);

    keel_cpu_matmul(W, x, M, ym, KEEL_EPI_RELU2); /* fused == unfused, and within the relu^2 bound */
    memcpy(y2, y, (size_t)M * n * 4);
    keel_cpu_relu2(y2, (size_t)M * n);
    snprintf(msg, sizeof msg, "%s fused relu2", what);
    assert_bits_equal(ym, y2, (size_t)M * n, msg);
    check_close(ym, ref, bound, (size_t)M * n, true, msg);

    keel_cpu_force_portable(true);
    assert_string_equal(keel_cpu_isa(), "portable");
    keel_cpu_matmul(W, x, M, y2, KEEL_EPI_NONE);
    keel_cpu_force_portable(false);
    snprintf(msg, sizeof msg, "%s portable vs %s", what, keel_cpu_isa());
    assert_bits_equal(y, y2, (size_t)M * n, msg);

    free(x), free(y), free(y2), free(ym), free(ref), free(bound);
}

static void test_quant_all(void **state) {
    (void)state;
    char what[96];
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(BITS); bi++)
        for (size_t gi = 0; gi < KEEL_ARRAY_LEN(GROUPS); gi++)
            for (size_t si = 0; si < KEEL_ARRAY_LEN(SDTS); si++)
                for (int kg = 1; kg <= 3; kg += 2) { /* k of one group and of three */
                    mat W = make_q(37, kg * GROUPS[gi], BITS[bi], GROUPS[gi], SDTS[si], 1.0f);
                    snprintf(what, sizeof what, "b%d g%d %s k=%d", BITS[bi], GROUPS[gi],
                             keel_dtype_name(SDTS[si]), W.q.k);
                    check_matrix(&W.q, 1.0f, what);
                    mat_free(&W);
                }
}

static void test_quant_large(void **state) { /* large magnitudes: weights ~1e4, activations ~1e3 */
    (void)state;
    char what[96];
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(BITS); bi++) {
        mat W = make_q(37, 256, BITS[bi], 64, KEEL_DT_F32, 1e4f);
        snprintf(what, sizeof what, "large b%d", BITS[bi]);
        check_matrix(&W.q, 1e3f, what);
        mat_free(&W);
    }
}

static void test_float_matrices(void **state) {
    (void)state;
    const int ks[] = {8, 37, 64, 300};
    char what[96];
    for (size_t si = 0; si < KEEL_ARRAY_LEN(SDTS); si++)
        for (size_t ki = 0; ki < KEEL_ARRAY_LEN(ks); ki++) {
            mat W = make_f(37, ks[ki], SDTS[si]);
            snprintf(what, sizeof what, "float %s k=%d", keel_dtype_name(SDTS[si]), ks[ki]);
            check_matrix(&W.q, 1.0f, what);
            mat_free(&W);
        }
}

/* Big enough that the kernel really runs two threads; m=1 (decode) and m=13 (prompt). */
static void test_threads(void **state) {
    (void)state;
    const int n = 301, k = 1024;
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(BITS); bi++) {
        mat W = make_q(n, k, BITS[bi], 64, KEEL_DT_BF16, 1.0f);
        float *x = make_x(13, k, 1.0f), *y1 = malloc((size_t)13 * n * 4), *y2 = malloc((size_t)13 * n * 4);
        for (int m = 1; m <= 13; m += 12) {
            keel_cpu_set_threads(1);
            assert_int_equal(keel_cpu_threads(), 1);
            keel_cpu_matmul(&W.q, x, m, y1, KEEL_EPI_NONE);
            keel_cpu_set_threads(2);
            assert_int_equal(keel_cpu_threads(), 2);
            keel_cpu_matmul(&W.q, x, m, y2, KEEL_EPI_NONE);
            assert_bits_equal(y1, y2, (size_t)m * n, "1 vs 2 threads");
        }
        double *ref = malloc((size_t)13 * n * 8), *bound = malloc((size_t)13 * n * 8);
        reference(&W.q, x, 13, ref, bound, 0);
        check_close(y2, ref, bound, (size_t)13 * n, false, "threads m=13");
        free(ref), free(bound), free(x), free(y1), free(y2);
        mat_free(&W);
    }
    keel_cpu_set_threads(0);
    assert_true(keel_cpu_threads() >= 1);
}

static void test_relu2_kernel(void **state) {
    (void)state;
    float v[] = {-3.0f, -0.0f, 0.0f, 1.5f, 1e20f, 1e-30f, NAN, -INFINITY};
    const float want[] = {0.0f, 0.0f, 0.0f, 2.25f, INFINITY, 0.0f, 0.0f, 0.0f};
    keel_cpu_relu2(v, KEEL_ARRAY_LEN(v));
    for (size_t i = 0; i < KEEL_ARRAY_LEN(v); i++) assert_true(keel_f32_as_u32(v[i]) == keel_f32_as_u32(want[i]));
}

/* The shared fixture: MLX-packed matrices, BF16 activations, float64 products. */
static void test_fixture(void **state) {
    (void)state;
    const char *dir = getenv("KEEL_FIXTURES");
    if (!dir) skip();
    char path[1024], name[128];
    snprintf(path, sizeof path, "%s/stream_tiles_shared.safetensors", dir);
    keel_st st = {0};
    keel_err err = {0};
    if (keel_st_open(&st, path, &err) != KEEL_OK) fail_msg("%s", err.msg);
    int checked = 0;
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(BITS); bi++)
        for (size_t gi = 0; gi < KEEL_ARRAY_LEN(GROUPS); gi++) {
            const char *fields[] = {"weight", "scales", "biases", "x", "y", "y_relu2"};
            const keel_st_tensor *t[6];
            for (int f = 0; f < 6; f++) {
                snprintf(name, sizeof name, "n48_k256_m3_b%d_g%d.%s", BITS[bi], GROUPS[gi], fields[f]);
                t[f] = keel_st_find(&st, name);
                if (!t[f]) fail_msg("fixture lacks %s", name);
            }
            const int n = (int)t[0]->shape[0], k = (int)t[3]->shape[1], m = (int)t[3]->shape[0];
            assert_int_equal(t[0]->dtype, KEEL_DT_U32);
            assert_int_equal((size_t)t[0]->shape[1], keel_quant_row_words(k, BITS[bi]));
            assert_int_equal(t[4]->dtype, KEEL_DT_F64);
            keel_qmat W = {.n = n, .k = k, .bits = BITS[bi], .group = GROUPS[gi], .sdt = t[1]->dtype,
                           .w = t[0]->data, .scales = t[1]->data, .biases = t[2]->data};
            float *x = malloc((size_t)m * k * 4), *y = malloc((size_t)m * n * 4), *yr = malloc((size_t)m * n * 4);
            for (size_t i = 0; i < (size_t)m * k; i++) x[i] = keel_dtype_get_f32(t[3]->dtype, t[3]->data, i);
            double *ref = malloc((size_t)m * n * 8), *bound = malloc((size_t)m * n * 8);
            reference(&W, x, m, ref, bound, 1);
            const double *fy = t[4]->data, *fr = t[5]->data;
            for (size_t i = 0; i < (size_t)m * n; i++) { /* the fixture agrees with our exact reference */
                if (!(fabs(fy[i] - ref[i]) <= bound[i]))
                    fail_msg("b%d g%d: fixture y[%zu] %.9g vs reference %.9g", BITS[bi], GROUPS[gi], i, fy[i], ref[i]);
                ref[i] = fy[i];
            }
            keel_cpu_matmul(&W, x, m, y, KEEL_EPI_NONE);
            keel_cpu_matmul(&W, x, m, yr, KEEL_EPI_RELU2);
            snprintf(name, sizeof name, "fixture b%d g%d", BITS[bi], GROUPS[gi]);
            check_close(y, ref, bound, (size_t)m * n, false, name);
            check_close(yr, ref, bound, (size_t)m * n, true, name);
            for (size_t i = 0; i < (size_t)m * n; i++) { /* and its y_relu2 is relu(y)^2 */
                double r = fy[i] > 0 ? fy[i] : 0;
                assert_true(fabs(fr[i] - r * r) <= 1e-12 * (1 + r * r));
            }
            checked++;
            free(x), free(y), free(yr), free(ref), free(bound);
        }
    assert_int_equal(checked, 18);
    keel_st_free(&st);
}

int main(void) {
    printf("stream tile ISA: %s, threads %d\n", keel_cpu_isa(), keel_cpu_threads());
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_relu2_kernel),   cmocka_unit_test(test_quant_all),
        cmocka_unit_test(test_quant_large),    cmocka_unit_test(test_float_matrices),
        cmocka_unit_test(test_threads),        cmocka_unit_test(test_fixture),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
