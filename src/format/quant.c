/* format: MLX affine quantization of float matrices, code packing, and dequantization. */
#include <math.h>
#include <stdlib.h>

#include "format.h"

void keel_quant_pack_row(const uint8_t *codes, int k, int bits, uint32_t *out) {
    KEEL_ASSERT(keel_quant_bits_ok(bits) && k >= 0 && ((size_t)k * (size_t)bits) % 32u == 0);
    memset(out, 0, keel_quant_row_words(k, bits) * sizeof *out);
    for (int c = 0; c < k; c++) {
        uint32_t v = codes[c];
        KEEL_ASSERTF(v < (1u << bits), "code %u at column %d does not fit %d bits", v, c, bits);
        size_t bit = (size_t)c * (size_t)bits, wi = bit >> 5;
        unsigned sh = (unsigned)(bit & 31u);
        out[wi] |= v << sh;
        if (sh + (unsigned)bits > 32u) out[wi + 1] |= v >> (32u - sh); /* the code straddles two words */
    }
}

void keel_quant_unpack_row(const uint32_t *row, int k, int bits, uint8_t *codes) {
    KEEL_ASSERT(keel_quant_bits_ok(bits) && k >= 0 && ((size_t)k * (size_t)bits) % 32u == 0);
    for (int c = 0; c < k; c++) codes[c] = (uint8_t)keel_quant_code(row, bits, c);
}

/* One group as MLX's CPU quantizer does it, all in float32: range, signed scale chosen so the larger-magnitude
 * edge is exactly representable (bias = that edge), codes rint((w - bias) / scale) clipped; the stored scale and
 * bias are rounded to their dtype only afterwards, so codes come from the unrounded float32 scale. */
static void quantize_group(const float *w, int group, int bits, uint8_t *codes, float *scale_out, float *bias_out) {
    const float n_bins = (float)((1 << bits) - 1);
    const float eps = 1e-7f;
    float w_min = INFINITY, w_max = -INFINITY;
    for (int j = 0; j < group; j++) {
        float x = w[j];
        w_max = (w_max < x) ? x : w_max; /* std::max(w_max, x) */
        w_min = (x < w_min) ? x : w_min; /* std::min(w_min, x) */
    }
    bool mask = fabsf(w_min) > fabsf(w_max);
    float range = (w_max - w_min) / n_bins;
    float scale = (range < eps) ? eps : range; /* std::max(range, eps) */
    scale = mask ? scale : -scale;
    float edge = mask ? w_min : w_max;
    float q0 = rintf(edge / scale);
    float bias = 0.0f;
    if (q0 != 0.0f) {
        scale = edge / q0;
        bias = edge;
    }
    for (int j = 0; j < group; j++) {
        float q = rintf((w[j] - bias) / scale);
        q = (q < 0.0f) ? 0.0f : q;       /* std::max(q, 0) */
        q = (n_bins < q) ? n_bins : q;   /* std::min(q, n_bins) */
        codes[j] = isnan(q) ? 0 : (uint8_t)q; /* NaN input gives code 0 instead of an undefined conversion */
    }
    *scale_out = scale;
    *bias_out = bias;
}

void keel_quant_quantize(const float *w, int n, int k, int bits, int group, keel_dtype sdt, uint32_t *codes,
                         void *scales, void *biases) {
    KEEL_ASSERT(keel_quant_bits_ok(bits) && keel_quant_group_ok(group) && n >= 0 && k >= 0 && k % group == 0);
    KEEL_ASSERT(sdt == KEEL_DT_BF16 || sdt == KEEL_DT_F16 || sdt == KEEL_DT_F32);
    const int ng = k / group;
    const size_t rw = keel_quant_row_words(k, bits);
#pragma omp parallel
    {
        uint8_t *rc = keel_xmalloc((size_t)k > 0 ? (size_t)k : 1);
#pragma omp for schedule(static)
        for (int r = 0; r < n; r++) {
            const float *wr = w + (size_t)r * (size_t)k;
            for (int g = 0; g < ng; g++) {
                float s, b;
                quantize_group(wr + (size_t)g * group, group, bits, rc + (size_t)g * group, &s, &b);
                keel_dtype_set_f32(sdt, scales, (size_t)r * ng + g, s);
                keel_dtype_set_f32(sdt, biases, (size_t)r * ng + g, b);
            }
            keel_quant_pack_row(rc, k, bits, codes + (size_t)r * rw);
        }
        free(rc);
    }
}

void keel_quant_dequantize_row(const keel_qmat *m, int row, float *out) {
    KEEL_ASSERT(m && row >= 0 && row < m->n);
    KEEL_ASSERT(m->sdt == KEEL_DT_BF16 || m->sdt == KEEL_DT_F16 || m->sdt == KEEL_DT_F32);
    const size_t k = (size_t)m->k;
    if (m->bits == 0) {
        for (size_t c = 0; c < k; c++) out[c] = keel_dtype_get_f32(m->sdt, (const void *)m->w, (size_t)row * k + c);
        return;
    }
    KEEL_ASSERT(keel_quant_bits_ok(m->bits) && keel_quant_group_ok(m->group) && m->k % m->group == 0);
    const int ng = m->k / m->group;
    const uint32_t *rw = m->w + (size_t)row * keel_quant_row_words(m->k, m->bits);
    for (int g = 0; g < ng; g++) {
        float s = keel_dtype_get_f32(m->sdt, m->scales, (size_t)row * ng + g);
        float b = keel_dtype_get_f32(m->sdt, m->biases, (size_t)row * ng + g);
        for (int j = 0; j < m->group; j++) {
            int c = g * m->group + j;
            float sq = s * (float)keel_quant_code(rw, m->bits, c); /* two float32 roundings: product, then sum */
            out[c] = sq + b;
        }
    }
}

void keel_quant_dequantize(const keel_qmat *m, float *out) {
    KEEL_ASSERT(m);
    for (int r = 0; r < m->n; r++) keel_quant_dequantize_row(m, r, out + (size_t)r * (size_t)m->k);
}
