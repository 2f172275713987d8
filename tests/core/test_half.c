/* core: bf16 and fp16 conversions against independent references (the compiler's _Float16, exact double math). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <cmocka.h>

#include "core/core.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rng_u32(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (uint32_t)(z ^ (z >> 31));
}

/* bf16 reference: the nearest of the two neighbouring bf16 values in exact double arithmetic, ties to even. */
static uint16_t bf16_ref(float f) {
    uint32_t u = keel_f32_as_u32(f);
    if (isnan(f)) return 0; /* callers check NaN separately */
    uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1);
    double x = f, a = keel_bf16_to_f32(lo), b = keel_bf16_to_f32(hi);
    if ((u & 0xffffu) == 0) return lo;
    if (isinf(b)) b = ldexp(1.0, 128) * (x < 0 ? -1 : 1); /* the value beyond the largest finite bf16 */
    double da = fabs(x - a), db = fabs(x - b);
    if (da < db) return lo;
    if (db < da) return hi;
    return (lo & 1u) ? hi : lo;
}

static void test_bf16_exhaustive_patterns(void **state) {
    (void)state;
    /* every bf16 value survives a round trip; random floats round as the exact reference says */
    for (uint32_t h = 0; h < 0x10000u; h++) {
        float f = keel_bf16_to_f32((uint16_t)h);
        uint16_t back = keel_f32_to_bf16(f);
        if (isnan(f)) {
            assert_true(isnan(keel_bf16_to_f32(back)));
            assert_int_equal(back & 0x8000u, h & 0x8000u);
        } else {
            assert_int_equal(back, h);
        }
    }
    for (int i = 0; i < 2000000; i++) {
        float f = keel_u32_as_f32(rng_u32());
        if (isnan(f)) {
            assert_true(isnan(keel_bf16_to_f32(keel_f32_to_bf16(f))));
            continue;
        }
        uint16_t got = keel_f32_to_bf16(f), want = bf16_ref(f);
        if (got != want) fail_msg("bf16(%a): got 0x%04x want 0x%04x", (double)f, got, want);
    }
    assert_int_equal(keel_f32_to_bf16(INFINITY), 0x7f80);
    assert_int_equal(keel_f32_to_bf16(-INFINITY), 0xff80);
    assert_int_equal(keel_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);      /* tie to even, down */
    assert_int_equal(keel_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);  /* tie to even, up */
}

static void test_f16_against_compiler(void **state) {
    (void)state;
#if defined(__FLT16_MAX__)
    for (uint32_t h = 0; h < 0x10000u; h++) {
        uint16_t hh = (uint16_t)h;
        _Float16 v;
        memcpy(&v, &hh, 2);
        float want = (float)v, got = keel_f16_to_f32(hh);
        if (isnan(want)) {
            assert_true(isnan(got));
            assert_int_equal(keel_f32_to_f16(got) & 0x8000u, h & 0x8000u);
            assert_true((keel_f32_to_f16(got) & 0x7fffu) > 0x7c00u);
            continue;
        }
        assert_int_equal(keel_f32_as_u32(got), keel_f32_as_u32(want));
        assert_int_equal(keel_f32_to_f16(got), hh);
    }
    for (int i = 0; i < 2000000; i++) {
        uint32_t u = rng_u32();
        if (i & 1) u = (u & 0x87ffffffu) | 0x30000000u; /* half the draws near fp16's range, subnormals included */
        float f = keel_u32_as_f32(u);
        if (isnan(f)) continue;
        _Float16 r = (_Float16)f;
        uint16_t want;
        memcpy(&want, &r, 2);
        uint16_t got = keel_f32_to_f16(f);
        if (got != want) fail_msg("f16(%a): got 0x%04x want 0x%04x", (double)f, got, want);
    }
#else
    skip();
#endif
    assert_int_equal(keel_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(keel_f32_to_f16(65520.0f), 0x7c00); /* rounds to infinity */
    assert_int_equal(keel_f32_to_f16(0x1p-25f), 0x0000); /* tie to even at the smallest subnormal */
    assert_int_equal(keel_f32_to_f16(0x1.8p-24f), 0x0002);
}

static void test_status(void **state) {
    (void)state;
    keel_err e;
    assert_int_equal(keel_err_set(&e, KEEL_E_SHAPE, "tensor %s: expected %d", "w", 3), KEEL_E_SHAPE);
    assert_string_equal(e.msg, "tensor w: expected 3");
    keel_err_prefix(&e, "%s: ", "file.safetensors");
    assert_string_equal(e.msg, "file.safetensors: tensor w: expected 3");
    assert_int_equal(keel_err_set(NULL, KEEL_E_IO, "x"), KEEL_E_IO);
    assert_string_equal(keel_code_name(KEEL_E_RANGE), "range");
    char *buf;
    assert_int_equal(keel_read_file("/nonexistent/keel", &buf, NULL, &e), KEEL_E_IO);
    assert_non_null(strstr(e.msg, "/nonexistent/keel"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16_exhaustive_patterns),
        cmocka_unit_test(test_f16_against_compiler),
        cmocka_unit_test(test_status),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
