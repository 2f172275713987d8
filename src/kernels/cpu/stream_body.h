/* kernels/cpu stream tile body, compiled twice: by stream.c as keel_cpu_matmul and keel_cpu_relu2, and by the
 * contract's twins (src/contract/twin_*.c) with one KEEL_STREAM_* hook redefined to plant one fault under another
 * name. The includer defines KEEL_STREAM_MATMUL, KEEL_STREAM_RELU2 and KEEL_STREAM_USE_AVX2(); every hook
 * defaults to the identity, so the production kernel is the code below exactly.
 *
 * Arithmetic of one output element y[r][j] (identical on every path, for every m, pass and thread count):
 *   per group g: two sets of 8 float lanes: e[l] = fma(x[c], q[c], e[l]) over the group's even chunks of 8
 *                columns (c = 8i + l, i even) in order, o[l] likewise over the odd chunks; d[l] = e[l] + o[l];
 *                acc[l] = fma(scale_g, d[l], acc[l]);  bacc = fma(bias_g, sx[r][g], bacc)
 *   y = hsum(acc) + bacc, hsum(a) = ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
 *   sx[r][g] (sum of x over the group) uses 8 lanes of plain adds and the same hsum.
 *   Float matrices: acc[l] = fma(x[c], w[c], acc[l]) over all k (zero-padded tail), y = hsum(acc).
 * The AVX2 path and the portable path are bit-identical: both use single-rounding fma for every multiply-add and
 * the same lane assignment and hsum tree; the project builds with -std=c11, which implies -ffp-contract=off,
 * so no plain multiply and add is fused behind our back. Only the float order above determines the result.
 */
#ifndef KEEL_STREAM_MATMUL
#error "define KEEL_STREAM_MATMUL, KEEL_STREAM_RELU2 and KEEL_STREAM_USE_AVX2() before including stream_body.h"
#endif

#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "cpu.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define KEEL_STREAM_X86 1
#define KEEL_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the stream tile reads little-endian packed codes with native loads"
#endif

/* Fault hooks for the contract's twins (identity here): code width read, group index, bias, final sums, stores. */
#ifndef KEEL_STREAM_BITS
#define KEEL_STREAM_BITS(bits) (bits)
#endif
#ifndef KEEL_STREAM_GI
#define KEEL_STREAM_GI(gi, g, ng) (gi)
#endif
#ifndef KEEL_STREAM_BIAS
#define KEEL_STREAM_BIAS(b) (b)
#endif
#ifndef KEEL_STREAM_QFINAL
#define KEEL_STREAM_QFINAL(t, hs, lanes, bacc) ((hs) + (bacc))
#endif
#ifndef KEEL_STREAM_QFINAL_AVX2
#define KEEL_STREAM_QFINAL_AVX2(t, hs, lanes, bacc) ((hs) + (bacc))
#endif
#ifndef KEEL_STREAM_FFINAL
#define KEEL_STREAM_FFINAL(t, hs, lanes) (hs)
#endif
#ifndef KEEL_STREAM_FFINAL_AVX2
#define KEEL_STREAM_FFINAL_AVX2(t, hs, lanes) (hs)
#endif
#ifndef KEEL_STREAM_STORE
#define KEEL_STREAM_STORE(t, r, j, v) store(t, r, j, v)
#endif
#ifndef KEEL_STREAM_EW_STORE
#define KEEL_STREAM_EW_STORE(y, i, n, v) ((y)[i] = (v))
#endif

#define PASS 8  /* rows of x sharing one decode of a weight row */
#define LANES 8 /* float lanes of the reduction, on every path */

typedef struct tile {
    const keel_qmat *W;
    const float *x;
    float *y;
    const float *sx;    /* (m, ng) group sums of x, quantized matrices only */
    int m, ng;
    size_t row_bytes;   /* bytes of one packed (or float) weight row */
    size_t total_bytes; /* bytes of all n weight rows */
    keel_epilogue epi;
    uint8_t ctl[32];    /* AVX2 byte shuffle: lane i gets bytes (i*bits)/8 and the next of 8 codes' u64 */
    int32_t sh[8];      /* AVX2 per-lane right shift: (i*bits) % 8, or i*bits when 8 codes fit one u32 */
} tile;

typedef void (*pass_fn)(const tile *t, int j, int r0, int R);

/* ---- shared scalar pieces -------------------------------------------------------------------------------- */

static inline float sb_get(keel_dtype dt, const void *p, size_t i) {
    if (dt == KEEL_DT_BF16) return keel_bf16_to_f32(((const uint16_t *)p)[i]);
    if (dt == KEEL_DT_F16) return keel_f16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static inline float hsum8(const float a[LANES]) {
    float a0 = a[0] + a[4], a1 = a[1] + a[5], a2 = a[2] + a[6], a3 = a[3] + a[7];
    float b0 = a0 + a2, b1 = a1 + a3;
    return b0 + b1;
}

/* relu(v)^2; the fused epilogue and keel_cpu_relu2 share it so the two agree bit for bit. */
static inline float relu2(float v) {
    float r = v > 0.0f ? v : 0.0f;
    return r * r;
}

static inline void store(const tile *t, int r, int j, float v) {
    t->y[(size_t)r * (size_t)t->W->n + (size_t)j] = t->epi == KEEL_EPI_RELU2 ? relu2(v) : v;
}

void KEEL_STREAM_RELU2(float *y, size_t n) {
    for (size_t i = 0; i < n; i++) KEEL_STREAM_EW_STORE(y, i, n, relu2(y[i]));
}

/* The 8 codes starting at byte p (they fill exactly `bits` bytes); near the matrix's end, read only those. */
static inline uint64_t load_codes(const uint8_t *p, int bits, bool full) {
    uint64_t v = 0;
    if (full)
        memcpy(&v, p, 8);
    else
        memcpy(&v, p, (size_t)bits);
    return v;
}

/* ---- portable path ------------------------------------------------------------------------------------- */

static void sumx_portable(const float *x, int k, int group, float *sx) {
    for (int g = 0; g < k / group; g++) {
        float a[LANES] = {0};
        for (int c0 = g * group; c0 < (g + 1) * group; c0 += LANES)
            for (int l = 0; l < LANES; l++) a[l] = a[l] + x[c0 + l];
        sx[g] = hsum8(a);
    }
}

static void q_pass_portable(const tile *t, int j, int r0, int R) {
    const keel_qmat *W = t->W;
    const int k = W->k, G = W->group, bits = KEEL_STREAM_BITS(W->bits), ng = t->ng;
    const uint8_t *row = (const uint8_t *)W->w + (size_t)j * t->row_bytes;
    const size_t avail = t->total_bytes - (size_t)j * t->row_bytes;
    const uint64_t mask = (1u << bits) - 1u;
    float acc[PASS][LANES] = {{0}}, bacc[PASS] = {0}, q[128];
    for (int g = 0; g < ng; g++) {
        const size_t gi = KEEL_STREAM_GI((size_t)j * (size_t)ng + (size_t)g, g, ng);
        const float s = sb_get(W->sdt, W->scales, gi), b = KEEL_STREAM_BIAS(sb_get(W->sdt, W->biases, gi));
        for (int i = 0; i < G; i += LANES) { /* decode the group once for all rows of the pass */
            const size_t off = (size_t)(g * G + i) * (size_t)bits / 8u;
            const uint64_t v = load_codes(row + off, bits, off + 8u <= avail);
            for (int l = 0; l < LANES; l++) q[i + l] = (float)(uint32_t)((v >> (l * bits)) & mask);
        }
        for (int r = 0; r < R; r++) {
            const float *xr = t->x + (size_t)(r0 + r) * (size_t)k + (size_t)g * (size_t)G;
            float e[LANES] = {0}, o[LANES] = {0};
            for (int i = 0; i < G; i += 2 * LANES)
                for (int l = 0; l < LANES; l++) {
                    e[l] = fmaf(xr[i + l], q[i + l], e[l]);
                    o[l] = fmaf(xr[i + LANES + l], q[i + LANES + l], o[l]);
                }
            for (int l = 0; l < LANES; l++) acc[r][l] = fmaf(s, e[l] + o[l], acc[r][l]);
            bacc[r] = fmaf(b, t->sx[(size_t)(r0 + r) * (size_t)ng + (size_t)g], bacc[r]);
        }
    }
    for (int r = 0; r < R; r++) KEEL_STREAM_STORE(t, r0 + r, j, KEEL_STREAM_QFINAL(t, hsum8(acc[r]), acc[r], bacc[r]));
}

static void f_pass_portable(const tile *t, int j, int r0, int R) {
    const keel_qmat *W = t->W;
    const int k = W->k;
    const size_t base = (size_t)j * (size_t)k;
    float acc[PASS][LANES] = {{0}};
    for (int c0 = 0; c0 < k; c0 += LANES) {
        const int nl = KEEL_MIN(LANES, k - c0);
        float w8[LANES] = {0};
        for (int l = 0; l < nl; l++) w8[l] = sb_get(W->sdt, W->w, base + (size_t)(c0 + l));
        for (int r = 0; r < R; r++) {
            const float *xr = t->x + (size_t)(r0 + r) * (size_t)k + (size_t)c0;
            float x8[LANES] = {0};
            for (int l = 0; l < nl; l++) x8[l] = xr[l];
            for (int l = 0; l < LANES; l++) acc[r][l] = fmaf(x8[l], w8[l], acc[r][l]);
        }
    }
    for (int r = 0; r < R; r++) KEEL_STREAM_STORE(t, r0 + r, j, KEEL_STREAM_FFINAL(t, hsum8(acc[r]), acc[r]));
}

/* ---- AVX2 path ----------------------------------------------------------------------------------------- */

#if defined(KEEL_STREAM_X86)

KEEL_AVX2 static inline float hsum8_avx2(__m256 v) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* a0+a4 .. a3+a7 */
    __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));                                /* b0, b1 */
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));                      /* b0 + b1 */
}

KEEL_AVX2 static void sumx_avx2(const float *x, int k, int group, float *sx) {
    for (int g = 0; g < k / group; g++) {
        __m256 a = _mm256_setzero_ps();
        for (int c0 = g * group; c0 < (g + 1) * group; c0 += LANES) a = _mm256_add_ps(a, _mm256_loadu_ps(x + c0));
        sx[g] = hsum8_avx2(a);
    }
}

/* 8 codes at byte p (they fill exactly `bits` bytes) as floats; `full` allows a plain 8-byte load there. Up to
 * 4 bits the 8 codes fit one u32, so a broadcast and per-lane shifts decode them without a byte shuffle. */
KEEL_AVX2 static inline __m256 decode8_avx2(const uint8_t *p, int bits, bool full, __m256i ctl, __m256i shv,
                                            __m256i mk) {
    if (bits <= 4) {
        uint32_t w = 0;
        if (full)
            memcpy(&w, p, 4);
        else
            memcpy(&w, p, (size_t)bits);
        return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shv), mk));
    }
    const __m256i vb = _mm256_set1_epi64x((long long)load_codes(p, bits, full));
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(vb, ctl), shv), mk));
}

/* Rows [0, R) of a group whose codes sit decoded in q: even/odd chunk chains, then acc = fma(s, e + o, acc). */
KEEL_AVX2 static inline __attribute__((always_inline)) void rows_avx2(const __m256 *q, int G, const float *const *xr,
                                                                     const int R, __m256 sv, __m256 *acc) {
    __m256 e[4], o[4];
    for (int r = 0; r < R; r++) e[r] = o[r] = _mm256_setzero_ps();
    for (int i = 0; i < G / LANES; i += 2)
        for (int r = 0; r < R; r++) {
            e[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[r] + i * LANES), q[i], e[r]);
            o[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[r] + (i + 1) * LANES), q[i + 1], o[r]);
        }
    for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(sv, _mm256_add_ps(e[r], o[r]), acc[r]);
}

/* R and G are compile-time constants at every call site, so the accumulators live in registers and the group's
 * loops unroll completely. Up to 4 rows decode straight into registers; 5..8 rows decode the group once into a
 * small buffer and run two blocks of rows. */
KEEL_AVX2 static inline __attribute__((always_inline)) void q_pass_avx2_r(const tile *t, int j, int r0, const int R,
                                                                      const int G) {
    const keel_qmat *W = t->W;
    const int k = W->k, ng = t->ng, bits = KEEL_STREAM_BITS(W->bits);
    const uint8_t *row = (const uint8_t *)W->w + (size_t)j * t->row_bytes;
    const size_t avail = t->total_bytes - (size_t)j * t->row_bytes;
    const __m256i ctl = _mm256_loadu_si256((const __m256i *)t->ctl);
    const __m256i shv = _mm256_loadu_si256((const __m256i *)t->sh);
    const __m256i mk = _mm256_set1_epi32((int)((1u << bits) - 1u));
    const float *xr[PASS];
    __m256 acc[PASS], q[128 / LANES];
    float bacc[PASS];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        bacc[r] = 0.0f;
    }
    for (int g = 0; g < ng; g++) {
        const size_t gi = KEEL_STREAM_GI((size_t)j * (size_t)ng + (size_t)g, g, ng);
        const float s = sb_get(W->sdt, W->scales, gi), b = KEEL_STREAM_BIAS(sb_get(W->sdt, W->biases, gi));
        const __m256 sv = _mm256_set1_ps(s);
        const int c0 = g * G;
        for (int r = 0; r < R; r++) xr[r] = t->x + (size_t)(r0 + r) * (size_t)k + (size_t)c0;
        const uint8_t *p = row + (size_t)c0 * (size_t)bits / 8u;
        const size_t gend = (size_t)(c0 + G) * (size_t)bits / 8u; /* the group's last 8-byte load ends here */
        const bool full = gend - (size_t)bits + 8u <= avail;
        if (R <= 4) {
            __m256 e[4], o[4];
            for (int r = 0; r < R; r++) e[r] = o[r] = _mm256_setzero_ps();
            for (int i = 0; i < G; i += 2 * LANES) {
                const __m256 qe = decode8_avx2(p, bits, full, ctl, shv, mk);
                const __m256 qo = decode8_avx2(p + bits, bits, full, ctl, shv, mk);
                p += 2 * bits;
                for (int r = 0; r < R; r++) {
                    e[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[r] + i), qe, e[r]);
                    o[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[r] + i + LANES), qo, o[r]);
                }
            }
            for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(sv, _mm256_add_ps(e[r], o[r]), acc[r]);
        } else {
            for (int i = 0; i < G / LANES; i++, p += bits) q[i] = decode8_avx2(p, bits, full, ctl, shv, mk);
            rows_avx2(q, G, xr, 4, sv, acc);
            rows_avx2(q, G, xr + 4, R - 4, sv, acc + 4);
        }
        for (int r = 0; r < R; r++) bacc[r] = fmaf(b, t->sx[(size_t)(r0 + r) * (size_t)ng + (size_t)g], bacc[r]);
    }
    for (int r = 0; r < R; r++)
        KEEL_STREAM_STORE(t, r0 + r, j, KEEL_STREAM_QFINAL_AVX2(t, hsum8_avx2(acc[r]), acc[r], bacc[r]));
}

/* One specialisation per (rows, group size); the group size is one of 32, 64, 128 (asserted by the driver). */
KEEL_AVX2 static void q_pass_avx2_g32(const tile *t, int j, int r0, int R) {
    switch (R) {
    case 1: q_pass_avx2_r(t, j, r0, 1, 32); break;
    case 2: q_pass_avx2_r(t, j, r0, 2, 32); break;
    case 3: q_pass_avx2_r(t, j, r0, 3, 32); break;
    case 4: q_pass_avx2_r(t, j, r0, 4, 32); break;
    case 5: q_pass_avx2_r(t, j, r0, 5, 32); break;
    case 6: q_pass_avx2_r(t, j, r0, 6, 32); break;
    case 7: q_pass_avx2_r(t, j, r0, 7, 32); break;
    default: q_pass_avx2_r(t, j, r0, 8, 32); break;
    }
}

KEEL_AVX2 static void q_pass_avx2_g64(const tile *t, int j, int r0, int R) {
    switch (R) {
    case 1: q_pass_avx2_r(t, j, r0, 1, 64); break;
    case 2: q_pass_avx2_r(t, j, r0, 2, 64); break;
    case 3: q_pass_avx2_r(t, j, r0, 3, 64); break;
    case 4: q_pass_avx2_r(t, j, r0, 4, 64); break;
    case 5: q_pass_avx2_r(t, j, r0, 5, 64); break;
    case 6: q_pass_avx2_r(t, j, r0, 6, 64); break;
    case 7: q_pass_avx2_r(t, j, r0, 7, 64); break;
    default: q_pass_avx2_r(t, j, r0, 8, 64); break;
    }
}

KEEL_AVX2 static void q_pass_avx2_g128(const tile *t, int j, int r0, int R) {
    switch (R) {
    case 1: q_pass_avx2_r(t, j, r0, 1, 128); break;
    case 2: q_pass_avx2_r(t, j, r0, 2, 128); break;
    case 3: q_pass_avx2_r(t, j, r0, 3, 128); break;
    case 4: q_pass_avx2_r(t, j, r0, 4, 128); break;
    case 5: q_pass_avx2_r(t, j, r0, 5, 128); break;
    case 6: q_pass_avx2_r(t, j, r0, 6, 128); break;
    case 7: q_pass_avx2_r(t, j, r0, 7, 128); break;
    default: q_pass_avx2_r(t, j, r0, 8, 128); break;
    }
}

KEEL_AVX2 static void q_pass_avx2(const tile *t, int j, int r0, int R) {
    if (t->W->group == 32)
        q_pass_avx2_g32(t, j, r0, R);
    else if (t->W->group == 64)
        q_pass_avx2_g64(t, j, r0, R);
    else
        q_pass_avx2_g128(t, j, r0, R);
}

/* 8 weights of a float row as float32; the tail is zero-padded exactly as the portable path pads it. */
KEEL_AVX2 static inline __m256 f_load_avx2(const keel_qmat *W, size_t base, int c0, int nl) {
    if (nl < LANES) {
        float w8[LANES] = {0};
        for (int l = 0; l < nl; l++) w8[l] = sb_get(W->sdt, W->w, base + (size_t)(c0 + l));
        return _mm256_loadu_ps(w8);
    }
    const size_t i = base + (size_t)c0;
    if (W->sdt == KEEL_DT_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)W->w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (W->sdt == KEEL_DT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)W->w + i)));
    return _mm256_loadu_ps((const float *)W->w + i);
}

KEEL_AVX2 static void f_pass_avx2(const tile *t, int j, int r0, int R) {
    const keel_qmat *W = t->W;
    const int k = W->k;
    const size_t base = (size_t)j * (size_t)k;
    __m256 acc[PASS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int c0 = 0; c0 < k; c0 += LANES) {
        const int nl = KEEL_MIN(LANES, k - c0);
        const __m256 w = f_load_avx2(W, base, c0, nl);
        for (int r = 0; r < R; r++) {
            const float *xr = t->x + (size_t)(r0 + r) * (size_t)k + (size_t)c0;
            __m256 xv;
            if (nl == LANES) {
                xv = _mm256_loadu_ps(xr);
            } else {
                float x8[LANES] = {0};
                for (int l = 0; l < nl; l++) x8[l] = xr[l];
                xv = _mm256_loadu_ps(x8);
            }
            acc[r] = _mm256_fmadd_ps(xv, w, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) KEEL_STREAM_STORE(t, r0 + r, j, KEEL_STREAM_FFINAL_AVX2(t, hsum8_avx2(acc[r]), acc[r]));
}

#endif

/* ---- driver -------------------------------------------------------------------------------------------- */

static bool float_dtype(keel_dtype dt) { return dt == KEEL_DT_BF16 || dt == KEEL_DT_F16 || dt == KEEL_DT_F32; }

void KEEL_STREAM_MATMUL(const keel_qmat *W, const float *x, int m, float *y, keel_epilogue epi) {
    KEEL_ASSERT(W != NULL && x != NULL && y != NULL && m >= 1 && W->n >= 0 && W->k >= 0);
    KEEL_ASSERT(float_dtype(W->sdt) && (W->w != NULL || W->n == 0));
    KEEL_ASSERT(epi == KEEL_EPI_NONE || epi == KEEL_EPI_RELU2);
    const bool quant = W->bits != 0;
    const int n = W->n, k = W->k;
    if (n == 0) return;
    tile t;
    memset(&t, 0, sizeof t);
    t.W = W;
    t.x = x;
    t.y = y;
    t.m = m;
    t.epi = epi;
    const bool avx = KEEL_STREAM_USE_AVX2();
    float *sx = NULL;
    if (quant) {
        KEEL_ASSERT(keel_quant_bits_ok(W->bits) && keel_quant_group_ok(W->group) && k > 0 && k % W->group == 0);
        KEEL_ASSERT(W->scales != NULL && W->biases != NULL);
        t.ng = k / W->group;
        t.row_bytes = keel_quant_row_words(k, W->bits) * 4u;
        for (int i = 0; i < LANES; i++) {
            const int bit = i * KEEL_STREAM_BITS(W->bits), b0 = bit >> 3;
            const uint8_t c[4] = {(uint8_t)b0, (uint8_t)(b0 + 1 <= 7 ? b0 + 1 : 0x80), 0x80, 0x80};
            memcpy(t.ctl + 4 * i, c, 4); /* lanes 4..7 sit in the high 128 bits, which hold the same u64 */
            t.sh[i] = KEEL_STREAM_BITS(W->bits) <= 4 ? bit : bit & 7;
        }
        sx = keel_xmalloc((size_t)m * (size_t)t.ng * sizeof(float));
        for (int r = 0; r < m; r++) {
#if defined(KEEL_STREAM_X86)
            if (avx) {
                sumx_avx2(x + (size_t)r * (size_t)k, k, W->group, sx + (size_t)r * (size_t)t.ng);
                continue;
            }
#endif
            sumx_portable(x + (size_t)r * (size_t)k, k, W->group, sx + (size_t)r * (size_t)t.ng);
        }
        t.sx = sx;
    } else {
        KEEL_ASSERT(W->group == 0);
        t.row_bytes = (size_t)k * keel_dtype_size(W->sdt);
    }
    t.total_bytes = t.row_bytes * (size_t)n;

    pass_fn fn = quant ? q_pass_portable : f_pass_portable;
#if defined(KEEL_STREAM_X86)
    if (avx) fn = quant ? q_pass_avx2 : f_pass_avx2;
#endif

    /* Blocks of weight rows small enough to stay in L2 while every pass of x walks over them. */
    int T = keel_cpu_threads();
    if ((double)n * (double)k * (double)m < 65536.0) T = 1;
    int J = (int)KEEL_MAX((size_t)1, (size_t)(128 * 1024) / KEEL_MAX(t.row_bytes, (size_t)1));
    J = KEEL_MIN(J, KEEL_MAX(1, (n + 4 * T - 1) / (4 * T)));
    const int nblk = (n + J - 1) / J;
#pragma omp parallel for schedule(static) num_threads(T)
    for (int blk = 0; blk < nblk; blk++) {
        const int j0 = blk * J, j1 = KEEL_MIN(n, j0 + J);
        for (int r0 = 0; r0 < m; r0 += PASS) {
            const int R = KEEL_MIN(PASS, m - r0);
            for (int j = j0; j < j1; j++) fn(&t, j, r0, R);
        }
    }
    free(sx);
}
