/* Device pieces the stream tiles share (stream.cu's ring tile, packed.cu's fragment-order tile): the epilogue and
 * store, the codes' decode under a magic exponent, and x staged in mma fragment order with its per-group sums.
 * Both tiles call these, so a code, an x fragment and a group sum have the same bits in either. */
#ifndef KEEL_KERNELS_CUDA_TILE_CUH
#define KEEL_KERNELS_CUDA_TILE_CUH

#include "port.h"

namespace {

__device__ __forceinline__ float relu2(float v) { return v > 0.f ? __fmul_rn(v, v) : 0.f; }

__device__ __forceinline__ void store_out(void *y, long long i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)y)[i] = kp_f32_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* The offset the decoded codes of a width keep (q + kOffset): bf16 activations at 2-6 bits leave the magic 128
 * in (the group end takes 128 sum(x) off S); f16 (magic 1024) and 8 bits remove it per code pair. */
template <int B, bool XF16> constexpr float kOffset = (!XF16 && B != 8) ? 128.f : 0.f;

/* Codes c0..c3 at bits B*i of w and c4..c7 at 16 + B*i (B <= 4) as codes_to_pairs's four operand words. */
template <int B, bool XF16> __device__ __forceinline__ void halves_to_pairs(uint32_t w, uint32_t p[4]) {
    constexpr uint32_t magic = XF16 ? 0x64006400u : 0x43004300u, mm = ((1u << B) - 1u) * 0x00010001u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t q = kp_and_or(w >> (B * i), mm, magic);
        p[i] = XF16 ? kp_sub_f16x2(q, magic) : q; /* bf16: 128 + c kept */
    }
}

/* Two words of B-bit codes (B = 5, 6) at bits 0, B | 16, 16 + B: w1 codes 0, 1 | 4, 5 and w2 codes 2, 3 | 6, 7, as
 * codes_to_pairs's four operand words. */
template <int B, bool XF16> __device__ __forceinline__ void wide_to_pairs(uint32_t w1, uint32_t w2, uint32_t p[4]) {
    constexpr uint32_t magic = XF16 ? 0x64006400u : 0x43004300u, mm = ((1u << B) - 1u) * 0x00010001u;
    const uint32_t q[4] = {kp_and_or(w1, mm, magic), kp_and_or(w1 >> B, mm, magic), kp_and_or(w2, mm, magic),
                           kp_and_or(w2 >> B, mm, magic)};
#pragma unroll
    for (int i = 0; i < 4; i++) p[i] = XF16 ? kp_sub_f16x2(q[i], magic) : q[i]; /* bf16: 128 + c kept */
}

/* The 8 codes c0..c7 of one thread (bits B each, LSB first in v) as four operand words, word i holding
 * (c_i + kOffset, c_{i+4} + kOffset) as exact bf16 or f16 integers: or-ed under a magic exponent. */
template <int B, bool XF16> __device__ __forceinline__ void codes_to_pairs(unsigned long long v, uint32_t p[4]) {
    constexpr uint32_t magic = XF16 ? 0x64006400u : 0x43004300u;
    if constexpr (B == 8) {
        const uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if constexpr (XF16) {
                const uint32_t two = __byte_perm(lo, hi, 0x0040u | (uint32_t)i | ((uint32_t)(i + 4) << 8));
                p[i] = kp_sub_f16x2(kp_and_or(two, 0x00ff00ffu, magic), magic);
            } else { /* bf16 cannot hold 128 + q for q >= 128: through fp32 */
                const float a = __uint_as_float(__byte_perm(lo, 0x4b000000u, 0x7540u | (uint32_t)i)) - 8388608.f;
                const float b = __uint_as_float(__byte_perm(hi, 0x4b000000u, 0x7540u | (uint32_t)i)) - 8388608.f;
                p[i] = kp_pack_bf16x2(a, b);
            }
        }
        return;
    } else {
        if constexpr (B == 2 || B == 3 || B == 4) { /* c0..c3 fit a half: one word, codes i and i+4 side by side */
            constexpr uint32_t lowm = (1u << (4 * B)) - 1u;
            const uint32_t u = (uint32_t)v;
            halves_to_pairs<B, XF16>(B == 4 ? u : (u & lowm) | ((u << (16 - 4 * B)) & (lowm << 16)), p);
        } else { /* 5, 6 bits: two words, codes (0,1 | 4,5) and (2,3 | 6,7) */
            constexpr uint32_t m2 = (1u << (2 * B)) - 1u;
            const uint32_t w1 = ((uint32_t)v & m2) | (((uint32_t)(v >> (4 * B)) & m2) << 16);
            const uint32_t w2 = ((uint32_t)(v >> (2 * B)) & m2) | (((uint32_t)(v >> (6 * B)) & m2) << 16);
            wide_to_pairs<B, XF16>(w1, w2, p);
        }
    }
}

/* The uint4 of (row r, block j, t) in an x-chunk of nblk blocks (nblk even): an odd row's blocks swap in pairs
 * (j ^ 1), so the two rows a quarter-warp's 16-byte fragment loads read (g, g + 1) hit different banks. */
__device__ __forceinline__ int xf_at(int r, int j, int t, int nblk) { return (r * nblk + (j ^ (r & 1))) * 4 + t; }

/* Stages x-chunk [c0, c0 + len) of the item's m rows in mma fragment order: a uint4 per (row, block, t) at
 * xf[xf_at(row, block, t, lenp/32)] holding x[8t + i] and x[8t + i + 4] of the block in word i, zeros up to
 * lenp (whole stages). Rows outside the mask are zeros. Loads go out in batches. */
template <int NT>
__device__ __forceinline__ void stage_x(int m, int k, const uint16_t *__restrict__ x, uint32_t mask, int c0, int len,
                                        int lenp, uint4 *xf) {
    constexpr int kBatch = 8;
    const int nblk = lenp / 32, nunits = nblk * m * 4, nlive = len / 32 * m * 4;
    for (int base = threadIdx.x; base < nunits; base += NT * kBatch) {
        uint32_t w[kBatch][4];
#pragma unroll
        for (int b = 0; b < kBatch; b++) {
            const int e = base + b * NT, t = e & 3, r = (e >> 2) % m, j = (e >> 2) / m;
            w[b][0] = w[b][1] = w[b][2] = w[b][3] = 0u;
            if (e < nlive && ((mask >> r) & 1u)) {
                const uint32_t *p = (const uint32_t *)(x + (long long)r * k + c0 + 32 * j + 8 * t);
#pragma unroll
                for (int i = 0; i < 4; i++) w[b][i] = kp_ldg32(p + i);
            }
        }
#pragma unroll
        for (int b = 0; b < kBatch; b++) {
            const int e = base + b * NT, t = e & 3, r = (e >> 2) % m, j = (e >> 2) / m;
            if (e < nunits)
                xf[xf_at(r, j, t, nblk)] = make_uint4(__byte_perm(w[b][0], w[b][2], 0x5410), __byte_perm(w[b][0], w[b][2], 0x7632),
                                   __byte_perm(w[b][1], w[b][3], 0x5410), __byte_perm(w[b][1], w[b][3], 0x7632));
        }
    }
}

template <bool XF16> __device__ __forceinline__ float xval(uint32_t h) {
    return XF16 ? kp_f16_to_f32((uint16_t)h) : kp_bf16_to_f32((uint16_t)h);
}

/* Per-group sums of x of the staged chunk (xs[row * len/group + group]): lane t of four sums the codes 8t..8t+7
 * of each block of the group (blocks in order, elements in a fixed order), then the four lanes add in a fixed
 * tree. The order depends on the group alone, never on m or the chunking. */
template <int NT, bool XF16>
__device__ __forceinline__ void stage_xsum(int m, int group, int len, const uint4 *xf, float *xs) {
    const int ngc = len / group, nsum = ngc * m, bpg = group / 32, nblk = len / 32;
    for (int base = 0; base < nsum * 4; base += NT) { /* uniform trip count: every lane shuffles */
        const int e = base + threadIdx.x, u = e >> 2, t = e & 3, r = u % m, gl = u / m;
        float acc = 0.f;
        if (u < nsum) {
            for (int b = 0; b < bpg; b++) {
                const uint4 v = xf[xf_at(r, gl * bpg + b, t, nblk)];
                const uint32_t q[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int i = 0; i < 4; i++) acc = __fadd_rn(acc, xval<XF16>(q[i] & 0xffffu));
#pragma unroll
                for (int i = 0; i < 4; i++) acc = __fadd_rn(acc, xval<XF16>(q[i] >> 16));
            }
        }
        acc = __fadd_rn(acc, __uint_as_float(kp_shfl_xor(__float_as_uint(acc), 1)));
        acc = __fadd_rn(acc, __uint_as_float(kp_shfl_xor(__float_as_uint(acc), 2)));
        if (u < nsum && t == 0) xs[r * ngc + gl] = acc;
    }
}

} // namespace

#endif
