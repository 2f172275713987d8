/* engine: the seeded sampler's exact arithmetic, one definition for the CPU sampler (sample.c) and the GPU one
 * (cuda/sample.cu), so both draw the same token for the same (logits, configuration, seed, position).
 *
 * A candidate is a non-NaN logit l; candidates are ordered by (l descending, id ascending), -0 equal to +0. Its
 * weight is an integer, a function of l, the largest candidate logit lmax and the temperature only:
 *   Y = 0 when l == lmax, else the float product fl(fl(lmax - l) * fl(K / temp)) truncated to an integer
 *       (K = 4096 log2(e) in float; Y >= YCAP, an infinite or NaN product included, means weight 0)
 *   w = (T1[(Y >> 6) & 63] * T2[Y & 63]) >> (20 + (Y >> 12)),  T1[i] = round(2^31 2^(-i/64)),
 *       T2[j] = round(2^31 2^(-j/4096)),  so w ~ 2^42 2^(-Y/4096) ~ 2^42 exp(-(lmax - l) / temp)
 * Three IEEE operations with explicit rounding, then integers only: no libm, no contraction, and w never grows
 * as l falls (checked for every Y by tests/engine/test_sample.c). Sums of weights are exact (below 2^63 for up to
 * KEEL_SAMP_VMAX candidates), so every cut below is a prefix of the order located by exact integer sums:
 *   top-k: the first k; min-p: w >= ceil(min_p 2^42); top-p: i stays while the weight before it (among the top-k)
 *   is below ceil(top_p * that top-k total); weight 0 never stays; the first candidate always stays.
 * The draw over the n survivors of total T: t = floor(r T / 2^53) with r the 53-bit hash of (seed, position),
 * the first survivor whose inclusive prefix sum exceeds t (u = r / 2^53 < C_i / T: the inverse CDF). */
#ifndef KEEL_ENGINE_SAMPLE_FIXED_H
#define KEEL_ENGINE_SAMPLE_FIXED_H

#include <stdbool.h>
#include <stdint.h>

#define KEEL_SAMP_S 42                                   /* the most likely candidate weighs 2^42 */
#define KEEL_SAMP_F 12                                   /* fractional bits of Y (units of 2^-12 octave) */
#define KEEL_SAMP_YCAP ((KEEL_SAMP_S + 1) << KEEL_SAMP_F) /* from here on the weight is 0 */
#define KEEL_SAMP_VMAX (1 << 21)                         /* candidates: 2^21 x 2^42 stays below 2^63 */
#define KEEL_SAMP_K 0x1.715476p+12f                      /* 4096 log2(e), rounded to float */

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KEEL_SAMP_FN static __device__ __forceinline__
#define KEEL_SAMP_SUB(a, b) __fsub_rn(a, b)
#define KEEL_SAMP_MUL(a, b) __fmul_rn(a, b)
#define KEEL_SAMP_DIV(a, b) __fdiv_rn(a, b)
#define KEEL_SAMP_FBITS(x) __float_as_uint(x)
#define KEEL_SAMP_TABLE static __constant__ const uint32_t
#else
#include <math.h>
#include <string.h>
#define KEEL_SAMP_FN static inline
#define KEEL_SAMP_SUB(a, b) ((a) - (b))
#define KEEL_SAMP_MUL(a, b) ((a) * (b))
#define KEEL_SAMP_DIV(a, b) ((a) / (b))
static inline uint32_t keel_samp_fbits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}
#define KEEL_SAMP_FBITS(x) keel_samp_fbits(x)
#define KEEL_SAMP_TABLE static const uint32_t
#endif

/* round(2^31 * 2^(-i/64)) and round(2^31 * 2^(-j/4096)), i, j = 0..63 (exact decimal arithmetic, no tie near) */
KEEL_SAMP_TABLE keel_samp_t1[64] = {
    2147483648u, 2124350982u, 2101467502u, 2078830522u, 2056437387u, 2034285470u, 2012372174u, 1990694927u,
    1969251188u, 1948038440u, 1927054196u, 1906295993u, 1885761398u, 1865448001u, 1845353420u, 1825475297u,
    1805811301u, 1786359126u, 1767116489u, 1748081133u, 1729250827u, 1710623359u, 1692196547u, 1673968228u,
    1655936265u, 1638098541u, 1620452965u, 1602997467u, 1585730000u, 1568648537u, 1551751076u, 1535035634u,
    1518500250u, 1502142985u, 1485961921u, 1469955159u, 1454120821u, 1438457051u, 1422962010u, 1407633882u,
    1392470869u, 1377471191u, 1362633090u, 1347954824u, 1333434672u, 1319070932u, 1304861917u, 1290805962u,
    1276901417u, 1263146652u, 1249540052u, 1236080024u, 1222764986u, 1209593378u, 1196563654u, 1183674286u,
    1170923762u, 1158310587u, 1145833280u, 1133490379u, 1121280436u, 1109202018u, 1097253708u, 1085434106u};
KEEL_SAMP_TABLE keel_samp_t2[64] = {
    2147483648u, 2147120270u, 2146756953u, 2146393698u, 2146030505u, 2145667373u, 2145304302u, 2144941293u,
    2144578345u, 2144215459u, 2143852634u, 2143489870u, 2143127168u, 2142764527u, 2142401948u, 2142039429u,
    2141676973u, 2141314577u, 2140952243u, 2140589970u, 2140227759u, 2139865609u, 2139503520u, 2139141492u,
    2138779525u, 2138417620u, 2138055776u, 2137693994u, 2137332272u, 2136970612u, 2136609013u, 2136247475u,
    2135885998u, 2135524583u, 2135163228u, 2134801935u, 2134440703u, 2134079532u, 2133718422u, 2133357373u,
    2132996386u, 2132635459u, 2132274593u, 2131913789u, 2131553046u, 2131192363u, 2130831742u, 2130471182u,
    2130110682u, 2129750244u, 2129389867u, 2129029550u, 2128669295u, 2128309101u, 2127948967u, 2127588895u,
    2127228883u, 2126868932u, 2126509043u, 2126149214u, 2125789446u, 2125429739u, 2125070092u, 2124710507u};

/* The scale of the log2 weight: K / temp (temp > 0; 0 for an infinite temperature, inf for a tiny one). */
KEEL_SAMP_FN float keel_samp_scale(float temp) { return KEEL_SAMP_DIV(KEEL_SAMP_K, temp); }

/* Y of a candidate l (non-NaN) under the largest candidate lmax. */
KEEL_SAMP_FN uint32_t keel_samp_y(float l, float lmax, float scale) {
    if (l == lmax) return 0u;
    const float yf = KEEL_SAMP_MUL(KEEL_SAMP_SUB(lmax, l), scale);
    if (!(yf < (float)KEEL_SAMP_YCAP)) return (uint32_t)KEEL_SAMP_YCAP;
    return (uint32_t)yf;
}

/* The weight of Y with the tables t1, t2 (keel_samp_t1/t2 or a copy of them). */
KEEL_SAMP_FN uint64_t keel_samp_w(uint32_t y, const uint32_t *t1, const uint32_t *t2) {
    if (y >= (uint32_t)KEEL_SAMP_YCAP) return 0u;
    const uint64_t p = (uint64_t)t1[(y >> 6) & 63u] * (uint64_t)t2[y & 63u];
    return p >> (62u - KEEL_SAMP_S + (y >> KEEL_SAMP_F));
}

/* The order key: ascending key = logit descending (-0 as +0); the candidate's id goes in the low 32 bits. */
KEEL_SAMP_FN uint32_t keel_samp_okey(float l) {
    const uint32_t b = l == 0.0f ? 0u : KEEL_SAMP_FBITS(l);
    const uint32_t u = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ~u;
}

/* The logit an order key came from (+0 for either zero). */
KEEL_SAMP_FN uint32_t keel_samp_okey_bits(uint32_t k) {
    const uint32_t u = ~k;
    return (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
}

/* hi:lo = a * b, exactly. */
KEEL_SAMP_FN void keel_samp_mul64(uint64_t a, uint64_t b, uint64_t *hi, uint64_t *lo) {
    const uint64_t a0 = a & 0xffffffffu, a1 = a >> 32, b0 = b & 0xffffffffu, b1 = b >> 32;
    const uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
    const uint64_t mid = (p00 >> 32) + (p01 & 0xffffffffu) + (p10 & 0xffffffffu);
    *lo = (mid << 32) | (p00 & 0xffffffffu);
    *hi = p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
}

/* ceil(p * tot) exactly, for 0 < p < 1 a float and tot < 2^63 (0 for p <= 0). */
KEEL_SAMP_FN uint64_t keel_samp_need(float p, uint64_t tot) {
    if (!(p > 0.0f)) return 0u;
    const uint32_t b = KEEL_SAMP_FBITS(p), eb = (b >> 23) & 0xffu;
    const uint64_t M = eb ? ((b & 0x7fffffu) | 0x800000u) : (b & 0x7fffffu);
    const int E = eb ? 150 - (int)eb : 149; /* p = M 2^-E, E >= 24 */
    uint64_t hi, lo, q;
    bool rem;
    keel_samp_mul64(M, tot, &hi, &lo);
    if (E >= 128) {
        q = 0u, rem = hi || lo;
    } else if (E >= 64) {
        q = hi >> (E - 64), rem = lo || (hi & ((1ull << (E - 64)) - 1u));
    } else {
        q = (hi << (64 - E)) | (lo >> E), rem = (lo & ((1ull << E) - 1u)) != 0;
    }
    return q + (rem ? 1u : 0u);
}

/* The smallest weight min-p keeps: ceil(min_p 2^42), 1 without min-p, 2^42 + 1 (nothing but the first) above 1. */
KEEL_SAMP_FN uint64_t keel_samp_thr(float min_p) {
    if (!(min_p > 0.0f)) return 1u;
    const double v = ceil((double)min_p * 0x1p42);
    if (v > 0x1p42) return (1ull << KEEL_SAMP_S) + 1u;
    return v < 1.0 ? 1u : (uint64_t)v;
}

/* The 53 random bits of the draw at an absolute position: a hash of (seed, pos) only. */
KEEL_SAMP_FN uint64_t keel_samp_mix(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
KEEL_SAMP_FN uint64_t keel_samp_r53(uint64_t seed, int64_t pos) {
    return keel_samp_mix(keel_samp_mix(seed) ^ (uint64_t)pos) >> 11;
}

/* The draw's target: floor(r tot / 2^53) < tot. */
KEEL_SAMP_FN uint64_t keel_samp_target(uint64_t r53, uint64_t tot) {
    uint64_t hi, lo;
    keel_samp_mul64(r53, tot, &hi, &lo);
    return (hi << 11) | (lo >> 53);
}

#endif
