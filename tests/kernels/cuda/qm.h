/* Test helpers of the CUDA stream tiles (test_stream_cuda.c, test_packed_cuda.c): quantized matrices on host and
 * device through the quantizer, random activations, and the float64 reference with its error bound. Include after
 * cmocka.h, format.h, cpu.h, contract.h and kernels/cuda/cuda.h. */
#ifndef KEEL_TESTS_KERNELS_CUDA_QM_H
#define KEEL_TESTS_KERNELS_CUDA_QM_H

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static inline double urand(void) { /* [0, 1) */
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (double)(g_rng >> 11) / 9007199254740992.0;
}
static inline double nrand(void) { return sqrt(-2.0 * log(urand() + 1e-300)) * cos(6.283185307179586 * urand()); }

/* A quantized matrix on host and device. */
typedef struct qm {
    int n, k, bits, group;
    keel_dtype sdt;
    uint32_t *codes;
    void *scales, *biases;
    float *deq; /* (n, k) dequantized, float32 as the quantizer defines w */
    keel_cuda_qw d;
} qm;

static inline void qm_upload(qm *q) {
    size_t cw = (size_t)q->n * keel_quant_row_words(q->k, q->bits) * 4;
    size_t sb = (size_t)q->n * (q->k / q->group) * keel_dtype_size(q->sdt);
    q->d = (keel_cuda_qw){0};
    void *w = keel_cuda_malloc(cw), *s = keel_cuda_malloc(sb), *b = keel_cuda_malloc(sb);
    keel_cuda_upload(w, q->codes, cw);
    keel_cuda_upload(s, q->scales, sb);
    keel_cuda_upload(b, q->biases, sb);
    q->d.w = w;
    q->d.scales = s;
    q->d.biases = b;
    q->d.n = q->n;
    q->d.k = q->k;
    q->d.bits = q->bits;
    q->d.group = q->group;
    q->d.sdt = q->sdt;
    keel_qmat m = {q->n, q->k, q->bits, q->group, q->sdt, q->codes, q->scales, q->biases};
    q->deq = keel_xmalloc((size_t)q->n * q->k * sizeof(float));
    keel_quant_dequantize(&m, q->deq);
}

/* Random weights through the quantizer; row 0 constant (a zero-range row) when n > 1. */
static inline void qm_make(qm *q, int n, int k, int bits, int group, keel_dtype sdt) {
    *q = (qm){.n = n, .k = k, .bits = bits, .group = group, .sdt = sdt};
    float *w = keel_xmalloc((size_t)n * k * sizeof(float));
    for (size_t i = 0; i < (size_t)n * k; i++) w[i] = (float)(0.05 * nrand() + 0.01);
    if (n > 1)
        for (int j = 0; j < k; j++) w[j] = 0.03f;
    q->codes = keel_xmalloc((size_t)n * keel_quant_row_words(k, bits) * 4);
    q->scales = keel_xmalloc((size_t)n * (k / group) * keel_dtype_size(sdt));
    q->biases = keel_xmalloc((size_t)n * (k / group) * keel_dtype_size(sdt));
    keel_quant_quantize(w, n, k, bits, group, sdt, q->codes, q->scales, q->biases);
    free(w);
    qm_upload(q);
}

/* Hand-made codes with scales of both signs (a quantizer never writes negative scales; a kernel must not care). */
static inline void qm_make_signed(qm *q, int n, int k, int bits, int group, keel_dtype sdt) {
    *q = (qm){.n = n, .k = k, .bits = bits, .group = group, .sdt = sdt};
    uint8_t *c = keel_xmalloc((size_t)k);
    size_t rw = keel_quant_row_words(k, bits), ng = (size_t)n * (k / group);
    q->codes = keel_xmalloc((size_t)n * rw * 4);
    for (int r = 0; r < n; r++) {
        for (int j = 0; j < k; j++) c[j] = (uint8_t)(urand() * (1 << bits));
        keel_quant_pack_row(c, k, bits, q->codes + r * rw);
    }
    free(c);
    q->scales = keel_xmalloc(ng * keel_dtype_size(sdt));
    q->biases = keel_xmalloc(ng * keel_dtype_size(sdt));
    for (size_t i = 0; i < ng; i++) {
        keel_dtype_set_f32(sdt, q->scales, i, (float)((urand() < 0.5 ? -1 : 1) * (0.001 + 0.01 * urand())));
        keel_dtype_set_f32(sdt, q->biases, i, (float)(0.05 * nrand()));
    }
    qm_upload(q);
}

static inline void qm_free(qm *q) {
    keel_cuda_free((void *)q->d.w);
    keel_cuda_free((void *)q->d.scales);
    keel_cuda_free((void *)q->d.biases);
    free(q->codes);
    free(q->scales);
    free(q->biases);
    free(q->deq);
}

/* Random activations (m, k) of dtype xdt on host (raw halves) and device. */
static inline uint16_t *make_x(int m, int k, keel_dtype xdt, void **dev) {
    uint16_t *x = keel_xmalloc((size_t)m * k * 2);
    for (size_t i = 0; i < (size_t)m * k; i++) {
        float v = (float)nrand();
        x[i] = xdt == KEEL_DT_BF16 ? keel_f32_to_bf16(v) : keel_f32_to_f16(v);
    }
    *dev = keel_cuda_malloc((size_t)m * k * 2);
    keel_cuda_upload(*dev, x, (size_t)m * k * 2);
    return x;
}

static inline double xval(const uint16_t *x, size_t i, keel_dtype xdt) {
    return xdt == KEEL_DT_BF16 ? keel_bf16_to_f32(x[i]) : keel_f16_to_f32(x[i]);
}

/* float64 reference of row r, column j, and the magnitude the kernel's arithmetic sums: sum |x|(|s|(q + 2M) + |b|),
 * M the offset the tile's codes keep at most (keel_contract_mma_offset; the mma sums x(q + M), the group end takes
 * M sum(x) off). */
static inline double ref_dot(const qm *q, const uint16_t *x, keel_dtype xdt, int r, int j, double *mag) {
    const double off = keel_contract_mma_offset(q->bits, xdt);
    double acc = 0, a = 0;
    size_t rw = keel_quant_row_words(q->k, q->bits);
    for (int c = 0; c < q->k; c++) {
        size_t gi = (size_t)j * (q->k / q->group) + c / q->group;
        double s = keel_dtype_get_f32(q->sdt, q->scales, gi), b = keel_dtype_get_f32(q->sdt, q->biases, gi);
        double qq = keel_quant_code(q->codes + (size_t)j * rw, q->bits, c), xv = xval(x, (size_t)r * q->k + c, xdt);
        acc += xv * (s * qq + b);
        a += fabs(xv) * (fabs(s * qq) + fabs(b) + 2 * off * fabs(s));
    }
    *mag = a;
    return acc;
}

/* Error bound: k * 2^-24 * magnitude * 4 (fp32 sums and products, tensor-core accumulation), then the output's
 * rounding: one fp32 ulp, or half a bf16 ulp. */
static inline double bound(int k, double mag, double ref, bool bf16) {
    double b = 4.0 * k * ldexp(1.0, -24) * mag + ldexp(fabs(ref), -23);
    if (bf16) b += ldexp(fabs(ref), -8);
    return b + 1e-30;
}

static inline float out_get(const void *y, size_t i, keel_dtype ydt) {
    return ydt == KEEL_DT_F32 ? ((const float *)y)[i] : keel_bf16_to_f32(((const uint16_t *)y)[i]);
}

static inline double relu2d(double v) { return v > 0 ? v * v : 0; }

/* Checks every element of a host y (m, n) against the float64 reference. */
static inline void check_y(const qm *q, const uint16_t *x, keel_dtype xdt, int m, keel_dtype ydt, keel_epilogue epi,
                    const void *y) {
    for (int r = 0; r < m; r++)
        for (int j = 0; j < q->n; j++) {
            double mag, ref = ref_dot(q, x, xdt, r, j, &mag), got = out_get(y, (size_t)r * q->n + j, ydt);
            double b = bound(q->k, mag, ref, ydt == KEEL_DT_BF16);
            if (epi == KEEL_EPI_RELU2) {
                b = 2 * (fabs(ref) + b) * b + (ydt == KEEL_DT_BF16 ? ldexp(ref * ref, -8) : ldexp(ref * ref, -23));
                ref = relu2d(ref);
            }
            if (!(fabs(got - ref) <= b)) {
                print_error("n %d k %d bits %d group %d sdt %s xdt %s ydt %s m %d epi %d: y[%d][%d] = %.9g, "
                            "reference %.9g, bound %.3g\n",
                            q->n, q->k, q->bits, q->group, keel_dtype_name(q->sdt), keel_dtype_name(xdt),
                            keel_dtype_name(ydt), m, (int)epi, r, j, got, ref, b);
                fail();
            }
        }
}

#endif
