/* engine: the sampler (src/engine/sample.c, definition in sample_fixed.h): its tables and weights against exp2,
 * monotone at every Y; draws and kept sets equal to a brute-force reference of the definition over thousands of
 * cases (ties, NaN, infinities, signed zeros, greedy, top-k 1, tiny top-p, min-p, huge and tiny temperatures);
 * probabilities within the weights' quantization of exp; draws that depend on (seed, position) only; and draw
 * frequencies that follow the distribution. */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <cmocka.h>

#include "engine/sample_cases.h"

/* Every table entry is 2^31 2^(-i/64) or 2^31 2^(-j/4096) rounded to nearest. */
static void test_tables_match_exp2(void **state) {
    (void)state;
    for (int i = 0; i < 64; i++) {
        const long double a = 0x1p31L * exp2l(-(long double)i / 64.0L), b = 0x1p31L * exp2l(-(long double)i / 4096.0L);
        assert_true(fabsl((long double)keel_samp_t1[i] - a) <= 0.5L + 1e-6L);
        assert_true(fabsl((long double)keel_samp_t2[i] - b) <= 0.5L + 1e-6L);
    }
}

/* w(Y) never grows with Y, is 2^42 at 0 and 0 from YCAP on, and is 2^42 2^(-Y/4096) within the tables'
 * rounding (3 parts in 2^31) and the final truncation (1). */
static void test_weights_monotone_and_close(void **state) {
    (void)state;
    assert_true(keel_samp_w(0, keel_samp_t1, keel_samp_t2) == (1ull << KEEL_SAMP_S));
    uint64_t prev = keel_samp_w(0, keel_samp_t1, keel_samp_t2);
    for (uint32_t y = 1; y < (uint32_t)KEEL_SAMP_YCAP + 8; y++) {
        const uint64_t w = keel_samp_w(y, keel_samp_t1, keel_samp_t2);
        if (w > prev) fail_msg("w(%u) = %llu above w(%u) = %llu", y, (unsigned long long)w, y - 1, (unsigned long long)prev);
        const long double e = y >= (uint32_t)KEEL_SAMP_YCAP ? 0.0L : 0x1p42L * exp2l(-(long double)y / 4096.0L);
        if (fabsl((long double)w - e) > e * 3.0L * 0x1p-31L + 1.0L)
            fail_msg("w(%u) = %llu, 2^42 2^(-Y/4096) = %.3Lf", y, (unsigned long long)w, e);
        prev = w;
    }
}

/* Y is (lmax - l) / temp in units of 2^-12 octave, within its three roundings; the edge cases are as defined. */
static void test_y_definition(void **state) {
    (void)state;
    sc_rng r = {12345};
    for (int it = 0; it < 200000; it++) {
        const float lmax = (float)(10.0 * sc_norm(&r)), l = lmax - (float)(20.0 * sc_unif(&r));
        const float temp = (float)exp(4.0 * sc_norm(&r));
        const uint32_t y = keel_samp_y(l, lmax, keel_samp_scale(temp));
        const long double e = ((long double)lmax - l) / temp * 4096.0L / logl(2.0L);
        if (e >= KEEL_SAMP_YCAP * (1.0L + 1e-6L)) assert_int_equal(y, KEEL_SAMP_YCAP);
        else if (e < KEEL_SAMP_YCAP * (1.0L - 1e-6L)) assert_true(fabsl((long double)y - e) <= 1.0L + e * 5.0L * 0x1p-24L);
    }
    const float s = keel_samp_scale(1.0f);
    assert_int_equal(keel_samp_y(3.0f, 3.0f, s), 0);
    assert_int_equal(keel_samp_y(-0.0f, 0.0f, s), 0);
    assert_int_equal(keel_samp_y(1.0f, INFINITY, s), KEEL_SAMP_YCAP);
    assert_int_equal(keel_samp_y(INFINITY, INFINITY, s), 0);
    assert_int_equal(keel_samp_y(-INFINITY, 1.0f, s), KEEL_SAMP_YCAP);
    assert_int_equal(keel_samp_y(0.0f, 1.0f, keel_samp_scale(1e-30f)), KEEL_SAMP_YCAP); /* tiny temp: one-hot */
    assert_int_equal(keel_samp_y(-1e30f, 1.0f, keel_samp_scale(INFINITY)), 0);             /* infinite temp: flat */
    assert_int_equal(keel_samp_y(-INFINITY, 1.0f, keel_samp_scale(INFINITY)), KEEL_SAMP_YCAP);
    /* ceil(p tot) and the draw's floor(r tot / 2^53) against 128-bit products */
    for (int it = 0; it < 100000; it++) {
        const uint64_t tot = sc_next(&r) >> (1 + sc_below(&r, 62)), r53 = sc_next(&r) >> 11;
        const float p = it % 7 == 0 ? (float)ldexp(sc_unif(&r), -sc_below(&r, 140)) : (float)sc_unif(&r);
        int e;
        const float m = frexpf(p, &e);
        const sc_u128 X = (sc_u128)(uint64_t)ldexpf(m, 24) * tot;
        const int sh = 24 - e;
        const sc_u128 want = sh >= 128 ? (X != 0) : (X >> sh) + ((X & (((sc_u128)1 << sh) - 1)) != 0);
        assert_true(keel_samp_need(p, tot) == (uint64_t)want);
        assert_true(keel_samp_target(r53, tot) == (uint64_t)(((sc_u128)r53 * tot) >> 53));
    }
    assert_true(keel_samp_need(0.0f, 1000) == 0 && keel_samp_need(-1.0f, 1000) == 0);
    assert_true(keel_samp_thr(0.0f) == 1 && keel_samp_thr(NAN) == 1 && keel_samp_thr(1e-30f) == 1);
    assert_true(keel_samp_thr(0.5f) == 1ull << 41 && keel_samp_thr(1.0f) == 1ull << 42);
    assert_true(keel_samp_thr(1.5f) == (1ull << 42) + 1);
}

/* Draws and kept sets equal the brute-force reference over every distribution and many configurations. */
static void test_draw_matches_reference(void **state) {
    (void)state;
    sc_rng r = {777};
    enum { VM = 300 };
    float l[VM];
    int kept[VM];
    int cases = 0, draws_varied = 0;
    for (int it = 0; it < 20000; it++) {
        const int V = it % 50 == 0 ? 1 : 1 + sc_below(&r, it % 3 ? 40 : VM);
        const int d = it % SC_DISTS;
        sc_logits(&r, l, V, d);
        const keel_sampler_cfg c = sc_cfg(&r, V);
        keel_sampler s;
        keel_sampler_init(&s, &c, V);
        const int64_t pos = (int64_t)(sc_next(&r) % 100000);
        int nk = 0;
        const int want = sc_reference(l, V, &c, pos, kept, &nk);
        const int got = keel_sampler_sample(&s, l, pos);
        if (got != want)
            fail_msg("case %d (V %d dist %d temp %g top_k %d top_p %g min_p %g pos %lld): drew %d, reference %d", it, V,
                     d, (double)c.temp, c.top_k, (double)c.top_p, (double)c.min_p, (long long)pos, got, want);
        const int n = keel_sampler_filter(&s, l);
        assert_int_equal(n, nk);
        double psum = 0.0;
        for (int i = 0; i < n; i++) assert_int_equal(s.idx[i], kept[i]), psum += s.prob[i];
        assert_true(fabs(psum - 1.0) < 1e-5);
        draws_varied += n > 1;
        cases++;
        keel_sampler_free(&s);
    }
    assert_int_equal(cases, 20000);
    assert_true(draws_varied > 1000); /* the cases exercise real draws, not only one-survivor cuts */
}

/* Probabilities are exp((l - lmax) / temp) renormalized over the kept set, within the weights' quantization. */
static void test_probabilities_follow_exp(void **state) {
    (void)state;
    sc_rng r = {99};
    enum { V = 64 };
    float l[V];
    const keel_sampler_cfg cfgs[] = {
        {.temp = 1.0f, .top_p = 1.0f}, {.temp = 0.7f, .top_k = 5, .top_p = 1.0f}, {.temp = 1.3f, .top_p = 0.6f},
        {.temp = 1.0f, .top_p = 1.0f, .min_p = 0.1f}, {.temp = 0.5f, .top_k = 20, .top_p = 0.9f, .min_p = 0.05f},
    };
    for (size_t ci = 0; ci < sizeof cfgs / sizeof cfgs[0]; ci++)
        for (int rep = 0; rep < 20; rep++) {
            sc_logits(&r, l, V, 0);
            keel_sampler s;
            keel_sampler_init(&s, &cfgs[ci], V);
            const int n = keel_sampler_filter(&s, l);
            double z = 0.0;
            for (int i = 0; i < n; i++) z += exp(((double)l[s.idx[i]] - l[s.idx[0]]) / cfgs[ci].temp);
            for (int i = 0; i < n; i++) {
                const double p = exp(((double)l[s.idx[i]] - l[s.idx[0]]) / cfgs[ci].temp) / z;
                assert_true(fabs(s.prob[i] - p) <= 4e-4 * p + 1e-7); /* 2^(1/4096) - 1 = 1.7e-4, twice */
                if (i) assert_true(l[s.idx[i]] <= l[s.idx[i - 1]]);
            }
            keel_sampler_free(&s);
        }
}

static void test_greedy_is_temperature_zero(void **state) {
    (void)state;
    sc_rng r = {5};
    enum { V = 64 };
    float l[V];
    for (unsigned seed = 0; seed < 20; seed++) {
        sc_logits(&r, l, V, 0);
        l[10] = l[40] = 90.0f; /* a tie at the top goes to the lower id */
        l[3] = NAN;
        keel_sampler_cfg c0 = {.temp = 0.0f, .seed = seed}, c1 = {.temp = 1.0f, .top_k = 1, .seed = seed};
        keel_sampler_cfg c2 = {.temp = 1.0f, .top_p = 1e-30f, .seed = seed}, c3 = {.temp = 1e-30f, .top_p = 1.0f};
        keel_sampler s[4];
        keel_sampler_init(&s[0], &c0, V), keel_sampler_init(&s[1], &c1, V);
        keel_sampler_init(&s[2], &c2, V), keel_sampler_init(&s[3], &c3, V);
        float u[V]; /* a tiny temperature keeps both tied maxima (equal weights): make the maximum unique */
        memcpy(u, l, sizeof u);
        u[40] = 89.0f;
        for (int64_t pos = 0; pos < 10; pos++)
            for (int k = 0; k < 4; k++) assert_int_equal(keel_sampler_sample(&s[k], k == 3 ? u : l, pos), 10);
        assert_int_equal(keel_argmax(l, V), 10);
        for (int k = 0; k < 4; k++) keel_sampler_free(&s[k]);
    }
    float nan3[3] = {NAN, NAN, NAN};
    keel_sampler_cfg c = {.temp = 1.0f, .top_p = 1.0f};
    keel_sampler s;
    keel_sampler_init(&s, &c, 3);
    assert_int_equal(keel_sampler_sample(&s, nan3, 0), 0); /* no candidate: id 0 */
    keel_sampler_free(&s);
}

static void test_draws_depend_on_seed_and_position_only(void **state) {
    (void)state;
    sc_rng r = {7};
    enum { V = 64 };
    float l[V];
    sc_logits(&r, l, V, 0);
    for (int i = 0; i < V; i++) l[i] *= 0.1f; /* flat enough that draws vary */
    keel_sampler_cfg c = {.temp = 1.0f, .top_p = 1.0f, .seed = 42};
    keel_sampler a, b;
    keel_sampler_init(&a, &c, V);
    keel_sampler_init(&b, &c, V);
    int seen[V] = {0}, distinct = 0, differ_seed = 0;
    int fwd[200];
    for (int64_t pos = 0; pos < 200; pos++) fwd[pos] = keel_sampler_sample(&a, l, pos);
    for (int64_t pos = 199; pos >= 0; pos--) assert_int_equal(keel_sampler_sample(&b, l, pos), fwd[pos]);
    for (int i = 0; i < 200; i++)
        if (!seen[fwd[i]]++) distinct++;
    assert_true(distinct > 10);
    keel_sampler_cfg c2 = c;
    c2.seed = 43;
    keel_sampler d;
    keel_sampler_init(&d, &c2, V);
    for (int64_t pos = 0; pos < 200; pos++) differ_seed += keel_sampler_sample(&d, l, pos) != fwd[pos];
    assert_true(differ_seed > 100);
    /* the draw is the inverse CDF at the documented uniform: u < C_i / T exactly where C_i / T are the kept
     * probabilities' prefix sums (checked in double: the sums' rounding stays far from u here) */
    for (int64_t pos = 0; pos < 200; pos++) {
        const int n = keel_sampler_filter(&a, l);
        const double u = keel_sampler_uniform(42, pos);
        double cum = 0.0;
        int want = a.idx[n - 1];
        for (int i = 0; i < n; i++)
            if (u < (cum += a.prob[i])) {
                if (fabs(u - cum) > 1e-5) want = a.idx[i];
                else want = fwd[pos]; /* too close to call in double */
                break;
            }
        assert_int_equal(fwd[pos], want);
    }
    keel_sampler_free(&a);
    keel_sampler_free(&b);
    keel_sampler_free(&d);
}

static void test_frequencies_follow_probabilities(void **state) {
    (void)state;
    const float l[4] = {0.0f, logf(2.0f), logf(3.0f), logf(4.0f)}; /* p = 0.1, 0.2, 0.3, 0.4 */
    keel_sampler_cfg c = {.temp = 1.0f, .top_p = 1.0f, .seed = 9};
    keel_sampler s;
    keel_sampler_init(&s, &c, 4);
    int cnt[4] = {0};
    const int N = 40000;
    for (int64_t pos = 0; pos < N; pos++) cnt[keel_sampler_sample(&s, l, pos)]++;
    for (int i = 0; i < 4; i++) assert_true(fabs((double)cnt[i] / N - 0.1 * (i + 1)) < 0.012); /* 5 sigma */
    keel_sampler_free(&s);
    /* top-p 0.5 keeps 0.4 (nothing before it) and 0.3 (0.4 before it), not 0.2 (0.7 before): 4/7 and 3/7 */
    c.top_p = 0.5f;
    keel_sampler_init(&s, &c, 4);
    memset(cnt, 0, sizeof cnt);
    for (int64_t pos = 0; pos < N; pos++) cnt[keel_sampler_sample(&s, l, pos)]++;
    assert_int_equal(cnt[0] + cnt[1], 0);
    assert_true(fabs((double)cnt[3] / N - 4.0 / 7.0) < 0.013);
    keel_sampler_free(&s);
    for (int64_t pos = 0; pos < 1000; pos++) {
        const double u = keel_sampler_uniform(123, pos);
        assert_true(u >= 0.0 && u < 1.0);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tables_match_exp2),
        cmocka_unit_test(test_weights_monotone_and_close),
        cmocka_unit_test(test_y_definition),
        cmocka_unit_test(test_draw_matches_reference),
        cmocka_unit_test(test_probabilities_follow_exp),
        cmocka_unit_test(test_greedy_is_temperature_zero),
        cmocka_unit_test(test_draws_depend_on_seed_and_position_only),
        cmocka_unit_test(test_frequencies_follow_probabilities),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
