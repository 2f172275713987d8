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

/* The offset the decoded codes of a width keep (q + kOffset): bf16 activations at 3-6 bits leave the magic 128
 * in (the group end takes 128 sum(x) off S); f16 (magic 1024) and 8 bits remove it per code pair; bf16 at 2 bits
 * keeps an offset by the code's place (kPlaceOffset), which the group end takes off as its own x sum. */
template <int B, bool XF16> constexpr float kOffset = (!XF16 && B != 8 && B > 2) ? 128.f : 0.f;
template <int B, bool XF16> constexpr bool kPlaced = !XF16 && B == 2;

/* Floats of a (row, group) entry of the x-sum table: sum(x), then at 2 bits the place-offset sum (stage_xsum). */
template <int B> constexpr int kXsw = B == 2 ? 2 : 1;

/* The bf16 2-bit decode's offset of operand word i's codes (i and i + 4 of 8): a code at mantissa bit p under the
 * exponent 2^(7 - p) reads 2^(7 - p) + c, so each code is one and-or of its place (bits 0, 2, 4 under 128, 32, 8;
 * bits 6 moved to 2 under 32), no shift but one. */
__host__ __device__ constexpr float kPlaceOffset(int i) { return i == 0 ? 128.f : i == 2 ? 8.f : 32.f; }

/* Codes c0..c3 at bits B*i of w and c4..c7 at 16 + B*i (B <= 4) as codes_to_pairs's four operand words. */
template <int B, bool XF16> __device__ __forceinline__ void halves_to_pairs(uint32_t w, uint32_t p[4]) {
    constexpr uint32_t magic = XF16 ? 0x64006400u : 0x43004300u, mm = ((1u << B) - 1u) * 0x00010001u;
    if constexpr (kPlaced<B, XF16>) { /* kPlaceOffset */
        p[0] = kp_and_or(w, 0x00030003u, 0x43004300u);
        p[1] = kp_and_or(w, 0x000c000cu, 0x42004200u);
        p[2] = kp_and_or(w, 0x00300030u, 0x41004100u);
        p[3] = kp_and_or(w >> 4, 0x000c000cu, 0x42004200u);
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t q = kp_and_or(w >> (B * i), mm, magic);
            p[i] = XF16 ? kp_sub_f16x2(q, magic) : q; /* bf16: 128 + c kept */
        }
    }
}

/* The group end's S with the codes' offset out, from the group's sum(x) xs and place-offset sum os (stage_xsum):
 * one rounding either way (kOffset * xs is exact). */
template <int B, bool XF16> __device__ __forceinline__ float offset_out(float S, float xs, float os) {
    if constexpr (kPlaced<B, XF16>) return __fadd_rn(S, -os);
    else if constexpr (kOffset<B, XF16> != 0.f) return __fmaf_rn(-kOffset<B, XF16>, xs, S);
    else return S;
}

/* The row stride of a width's x-sum table (ngc groups of kXsw floats a row): two-float rows padded by 4 floats, so
 * the rows 2t (and 2t + 1) that a quad's four lanes read at once fall in four different bank pairs; one-float rows
 * unpadded (a pad there gained nothing and cost registers: docs/stream-tiles.md). */
template <int B> __host__ __device__ constexpr int xs_stride(int ngc) {
    return kXsw<B> == 1 ? ngc : ngc * kXsw<B> + 4;
}

/* Entry i's place-offset sum in an x-sum table (0 where the width has none). */
template <int B, bool XF16> __device__ __forceinline__ float place_sum(const float *xs, int i) {
    if constexpr (kPlaced<B, XF16>) return xs[i * kXsw<B> + 1];
    else return 0.f;
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
 * (c_i + kOffset, c_{i+4} + kOffset) (bf16 at 2 bits: + kPlaceOffset(i)) as exact bf16 or f16 integers: or-ed
 * under a magic exponent. */
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

/* x[8t..8t+7] of a block, as four words in memory order, in mma fragment order: word i holds x[8t + i] and
 * x[8t + i + 4]. */
__device__ __forceinline__ uint4 xf_order(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
    return make_uint4(__byte_perm(w0, w2, 0x5410), __byte_perm(w0, w2, 0x7632), __byte_perm(w1, w3, 0x5410),
                      __byte_perm(w1, w3, 0x7632));
}

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
                xf[xf_at(r, j, t, nblk)] = xf_order(w[b][0], w[b][1], w[b][2], w[b][3]);
        }
    }
}

template <bool XF16> __device__ __forceinline__ float xval(uint32_t h) {
    return XF16 ? kp_f16_to_f32((uint16_t)h) : kp_bf16_to_f32((uint16_t)h);
}

/* Per-group sums of x of the staged chunk (entry (row, group) at xs[row * xs_stride<B> + group * kXsw<B>]): lane t
 * of four sums the codes 8t..8t+7 of each block of the group (blocks in order, elements in a fixed order), then the
 * four lanes add in a fixed tree; at 2 bits the same for x times its place's offset (exact products). The order
 * depends on the group alone, never on m or the chunking. */
template <int NT, int B, bool XF16>
__device__ __forceinline__ void stage_xsum(int m, int group, int len, const uint4 *xf, float *xs) {
    constexpr int W = kXsw<B>;
    const int ngc = len / group, nsum = ngc * m, bpg = group / 32, nblk = len / 32, rs = xs_stride<B>(ngc);
    for (int base = 0; base < nsum * 4; base += NT) { /* uniform trip count: every lane shuffles */
        const int e = base + threadIdx.x, u = e >> 2, t = e & 3, r = u % m, gl = u / m;
        float acc = 0.f, off = 0.f;
        if (u < nsum) {
            for (int b = 0; b < bpg; b++) {
                const uint4 v = xf[xf_at(r, gl * bpg + b, t, nblk)];
                const uint32_t q[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int i = 0; i < 4; i++) acc = __fadd_rn(acc, xval<XF16>(q[i] & 0xffffu));
#pragma unroll
                for (int i = 0; i < 4; i++) acc = __fadd_rn(acc, xval<XF16>(q[i] >> 16));
                if constexpr (W == 2) {
#pragma unroll
                    for (int i = 0; i < 4; i++) off = __fmaf_rn(kPlaceOffset(i), xval<XF16>(q[i] & 0xffffu), off);
#pragma unroll
                    for (int i = 0; i < 4; i++) off = __fmaf_rn(kPlaceOffset(i), xval<XF16>(q[i] >> 16), off);
                }
            }
        }
        acc = __fadd_rn(acc, __uint_as_float(kp_shfl_xor(__float_as_uint(acc), 1)));
        acc = __fadd_rn(acc, __uint_as_float(kp_shfl_xor(__float_as_uint(acc), 2)));
        if constexpr (W == 2) {
            off = __fadd_rn(off, __uint_as_float(kp_shfl_xor(__float_as_uint(off), 1)));
            off = __fadd_rn(off, __uint_as_float(kp_shfl_xor(__float_as_uint(off), 2)));
        }
        if (u < nsum && t == 0) {
            xs[r * rs + gl * W] = acc;
            if constexpr (W == 2) xs[r * rs + gl * W + 1] = off;
        }
    }
}

} // namespace

#endif
