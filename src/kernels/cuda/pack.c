/* kernels/cuda: the packed stream tile's layout, made on the host before the upload (docs/stream-tiles.md, "The
 * packed tile"). Plain C, built with or without CUDA, so the layout is tested on any machine. */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "cuda.h"

/* Tiles rounded up to even, and spans. */
static size_t pack_tiles(int n) { return ((size_t)n + 2 * KEEL_CUDA_PACK_ROWS - 1) / (2 * KEEL_CUDA_PACK_ROWS) * 2; }
static size_t pack_spans(int k) { return ((size_t)k + KEEL_CUDA_PACK_SPAN - 1) / KEEL_CUDA_PACK_SPAN; }

size_t keel_cuda_pack_bytes(int n, int k, int bits, int group) {
    if (n <= 0 || k <= 0 || !keel_quant_bits_ok(bits) || !keel_quant_group_ok(group) || k % group) return 0;
    const size_t tiles = pack_tiles(n), spans = pack_spans(k), rec = (size_t)KEEL_CUDA_PACK_REC(bits, group);
    /* the walk steps a span (span-major: tiles records) and a pair (tile-major: 2 spans records) in an int */
    if (tiles * rec > INT_MAX || 2 * spans * rec > INT_MAX) return 0;
    return tiles * spans * rec;
}

size_t keel_cuda_pack_at(int n, int k, bool span_major, int t, int s) {
    const size_t tiles = pack_tiles(n), spans = pack_spans(k);
    return span_major ? (size_t)s * tiles + (size_t)t : (size_t)t * spans + (size_t)s;
}

/* One scale dtype halves the kernel's walks; F16 and F32 take the ring tile. */
bool keel_cuda_pack_scales_ok(keel_dtype sdt) { return sdt == KEEL_DT_BF16; }

bool keel_cuda_pack(const keel_qmat *W, bool span_major, void *dst, size_t cap, char *why, size_t why_cap) {
    KEEL_ASSERT(W && why);
    if (!keel_cuda_pack_scales_ok(W->sdt)) {
        snprintf(why, why_cap, "packed tile: scales and biases must be BF16 (F16 and F32 take the ring tile), found %s",
                 keel_dtype_name(W->sdt));
        return false;
    }
    const size_t need = keel_cuda_pack_bytes(W->n, W->k, W->bits, W->group);
    if (need == 0 || W->k % 32) {
        snprintf(why, why_cap, "packed tile: n %d k %d bits %d group %d is not a packable matrix (k a multiple of the "
                 "group and of 32)", W->n, W->k, W->bits, W->group);
        return false;
    }
    if (!dst || cap < need) {
        snprintf(why, why_cap, "packed tile: the destination needs %zu bytes, has %zu", need, dst ? cap : 0);
        return false;
    }
    const int B = W->bits, G = W->group, gps = KEEL_CUDA_PACK_SPAN / G, rec = KEEL_CUDA_PACK_REC(B, G);
    const int tiles = (int)pack_tiles(W->n);
    const int spans = (int)pack_spans(W->k), blocks = W->k / 32, groups = W->k / G;
    const size_t row_bytes = (size_t)W->k * B / 8;
    const uint8_t *codes = (const uint8_t *)W->w, *sc = W->scales, *bi = W->biases;
    uint8_t *out = dst;
    for (int T = 0; T < tiles; T++)
        for (int s = 0; s < spans; s++) {
            uint8_t *r = out + keel_cuda_pack_at(W->n, W->k, span_major, T, s) * rec;
            /* lane (g, t): item 2b + h holds bytes B*t .. B*t + B-1 of block 4s + b of row 16T + g + 8h; byte j of
             * the items is the lane's byte KEEL_CUDA_PACK_BYTE(B, j), which KEEL_CUDA_PACK_AT puts in its chunk (a
             * chunk's warp load is contiguous) */
            for (int lane = 0; lane < 32; lane++)
                for (int j = 0; j < 8 * B; j++) {
                    const int item = j / B, row = T * KEEL_CUDA_PACK_ROWS + (lane >> 2) + 8 * (item & 1);
                    const int blk = 4 * s + (item >> 1);
                    r[KEEL_CUDA_PACK_AT(B, lane, KEEL_CUDA_PACK_BYTE(B, j))] =
                        row < W->n && blk < blocks
                            ? codes[(size_t)row * row_bytes + (size_t)blk * 4 * B + (size_t)B * (lane & 3) + j % B]
                            : 0;
                }
            /* row pair g: per group of the span, the halves scale(g), bias(g), scale(g + 8), bias(g + 8) */
            uint8_t *q = r + 256 * B;
            for (int g = 0; g < 8; g++)
                for (int gi = 0; gi < gps; gi++)
                    for (int hh = 0; hh < 4; hh++, q += 2) {
                        const int row = T * KEEL_CUDA_PACK_ROWS + g + 8 * (hh >> 1), grp = s * gps + gi;
                        if (row < W->n && grp < groups)
                            memcpy(q, ((hh & 1) ? bi : sc) + ((size_t)row * groups + grp) * 2, 2);
                        else
                            memset(q, 0, 2);
                    }
        }
    return true;
}
