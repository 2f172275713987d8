/* The packed stream tile's layout (keel_cuda_pack, host code: runs on any machine): every code and every scale and
 * bias of random matrices read back from where the layout documented in cuda.h puts it, padding zero, refusals. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "format/format.h"
#include "kernels/cuda/cuda.h"

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static uint32_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 32);
}

/* Code j (0..7) of `bits` bits, LSB first, from the bytes p. */
static int code_at(const uint8_t *p, int bits, int j) {
    int v = 0;
    for (int b = 0; b < bits; b++) {
        const int bit = j * bits + b;
        v |= ((p[bit >> 3] >> (bit & 7)) & 1) << b;
    }
    return v;
}

/* Where record (tile T, span s) sits, in records. */
static size_t rec_index(bool span_major, int tiles, int spans, int T, int s) {
    if (span_major) return (size_t)s * tiles + T;
    return (size_t)T * spans + s;
}

static void check_layout(int n, int k, int bits, int group, bool span_major) {
    const size_t rw = keel_quant_row_words(k, bits), ng = (size_t)n * (k / group);
    uint32_t *w = calloc((size_t)n * rw, 4);
    uint16_t *sc = malloc(ng * 2), *bi = malloc(ng * 2);
    uint8_t *c = malloc((size_t)k);
    for (int r = 0; r < n; r++) {
        for (int j = 0; j < k; j++) c[j] = (uint8_t)(rnd() & ((1u << bits) - 1));
        keel_quant_pack_row(c, k, bits, w + (size_t)r * rw);
    }
    for (size_t i = 0; i < ng; i++) sc[i] = (uint16_t)rnd(), bi[i] = (uint16_t)rnd();
    const keel_qmat m = {n, k, bits, group, KEEL_DT_BF16, w, sc, bi};
    const size_t bytes = keel_cuda_pack_bytes(n, k, bits, group);
    const int spans = (k + 127) / 128, rec = KEEL_CUDA_PACK_REC(bits, group), gps = 128 / group;
    const int tiles = (n + 31) / 32 * 2; /* rounded up to even: a zero tile pads an odd count */
    assert_int_equal(bytes, (size_t)tiles * spans * rec);
    uint8_t *p = malloc(bytes), *seen = calloc(bytes, 1);
    memset(p, 0xa5, bytes);
    char why[256];
    assert_true(keel_cuda_pack(&m, span_major, p, bytes, why, sizeof why));
    for (int r = 0; r < n; r++) {
        const int T = r / 16, h = (r % 16) / 8, g = r % 8;
        for (int j = 0; j < k; j++) {
            const int s = j / 128, b = (j % 128) / 32, t = (j % 32) / 8, e = j % 8;
            /* the lane's item 2b + h: its bytes (2b + h) bits .. + bits - 1, each in its chunk (chunk-major); at 2
             * bits the block's two items interleave, byte q of item 2b + h at 4b + 2q + h */
            const size_t rec0 = rec_index(span_major, tiles, spans, T, s) * rec;
            const int lane = 4 * g + t, chunk = bits % 2 ? 8 : 16;
            uint8_t item[8];
            for (int q = 0; q < bits; q++) {
                const int jb = bits == 2 ? 4 * b + 2 * q + h : (2 * b + h) * bits + q;
                const size_t at = rec0 + (size_t)(jb / chunk) * 32 * chunk + (size_t)lane * chunk + jb % chunk;
                item[q] = p[at];
                seen[at] = 1;
            }
            if (code_at(item, bits, e) != (int)keel_quant_code(w + (size_t)r * rw, bits, j))
                fail_msg("n %d k %d bits %d: code (%d, %d) not where the layout puts it", n, k, bits, r, j);
        }
        for (int gr = 0; gr < k / group; gr++) {
            const int s = gr * group / 128, gi = gr % gps;
            const size_t at =
                rec_index(span_major, tiles, spans, T, s) * rec + 256 * bits + (size_t)(g * gps + gi) * 8 + 4 * h;
            uint16_t vs, vb;
            memcpy(&vs, p + at, 2);
            memcpy(&vb, p + at + 2, 2);
            assert_int_equal(vs, sc[(size_t)r * (k / group) + gr]);
            assert_int_equal(vb, bi[(size_t)r * (k / group) + gr]);
            memset(seen + at, 1, 4);
        }
    }
    for (size_t i = 0; i < bytes; i++) /* rows past n, codes past k: zeros (zero scales: no contribution) */
        if (!seen[i] && p[i] != 0) fail_msg("n %d k %d bits %d: padding byte %zu is %d", n, k, bits, i, p[i]);
    free(w), free(sc), free(bi), free(c), free(p), free(seen);
}

static void test_layout(void **state) {
    (void)state;
    const int bits[] = {2, 3, 4, 5, 6, 8}, groups[] = {32, 64, 128};
    for (int b = 0; b < 6; b++)
        for (int g = 0; g < 3; g++) {
            for (int sm = 0; sm < 2; sm++) {
                check_layout(16, 128, bits[b], groups[g], sm);
                check_layout(37, groups[g] * 5, bits[b], groups[g], sm); /* odd tiles, k past whole spans */
                check_layout(1, groups[g], bits[b], groups[g], sm);
                check_layout(80, 3 * 128, bits[b], groups[g], sm); /* 5 tiles by 3 spans: the two orders differ */
            }
        }
}

/* Same bytes as the source when n and k are whole tiles and spans. */
static void test_size(void **state) {
    (void)state;
    assert_int_equal(keel_cuda_pack_bytes(32, 256, 4, 64), 32 * 256 / 2 + 32 * (256 / 64) * 4);
    assert_int_equal(keel_cuda_pack_bytes(131072, 2688, 3, 64), 131072ull * 2688 * 3 / 8 + 131072ull * 42 * 4);
    assert_int_equal(keel_cuda_pack_bytes(48, 256, 4, 64), 4 * 2 * 1152); /* odd tiles: a zero tile more */
    assert_int_equal(keel_cuda_pack_bytes(16, 60000000, 8, 32), 0); /* a pair's step, 2 spans records, past an int */
    assert_int_equal(keel_cuda_pack_bytes(16000000, 128, 8, 32), 0); /* a span's step, tiles records, past an int */
    assert_int_equal(keel_cuda_pack_bytes(20, 128, 7, 64), 0);
    assert_int_equal(keel_cuda_pack_bytes(20, 100, 4, 64), 0);
    assert_int_equal(keel_cuda_pack_bytes(0, 128, 4, 64), 0);
}

static void test_refusals(void **state) {
    (void)state;
    uint32_t w[64] = {0};
    uint32_t s[8] = {0};
    uint8_t out[4096];
    char why[256];
    keel_qmat m = {16, 128, 4, 64, KEEL_DT_F32, w, s, s};
    memset(out, 0x5a, sizeof out);
    assert_false(keel_cuda_pack(&m, false, out, sizeof out, why, sizeof why));
    assert_non_null(strstr(why, "F32"));
    m.sdt = KEEL_DT_F16; /* the ring tile takes F16 scales */
    assert_false(keel_cuda_pack(&m, false, out, sizeof out, why, sizeof why));
    assert_non_null(strstr(why, "must be BF16"));
    assert_non_null(strstr(why, "found F16"));
    m.sdt = KEEL_DT_BF16;
    assert_false(keel_cuda_pack(&m, true, out, 100, why, sizeof why));
    assert_non_null(strstr(why, "needs 2304 bytes, has 100")); /* one tile and the zero tile that pairs it */
    assert_false(keel_cuda_pack(&m, false, NULL, 0, why, sizeof why));
    m.bits = 7;
    assert_false(keel_cuda_pack(&m, false, out, sizeof out, why, sizeof why));
    assert_non_null(strstr(why, "bits 7"));
    for (size_t i = 0; i < sizeof out; i++) assert_int_equal(out[i], 0x5a); /* nothing written */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout),
        cmocka_unit_test(test_size),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
