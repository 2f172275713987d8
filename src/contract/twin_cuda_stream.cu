/* contract twins of the CUDA stream tiles: src/kernels/cuda/stream.cu compiled again under other launcher names
 * with its KEEL_PLANT_* hooks redefined. One fault is armed at a time (a device flag set before each launch);
 * unarmed, the twin computes what the kernel does. Faults (docs/kernel-contract.md, "Planted controls"):
 * width-as-4 (gate 3), bias-dropped (3), write-past-end (2), epilogue-order (4), row-leak (4).
 * It also answers gate 1's launch-limit questions about the real kernels (keel_cuda_kernel_fn, defined once in
 * stream.cu) with this copy's launch configuration (same source). */
#define keel_cuda_stream_matmul keel_contract_twin_cuda_stream_matmul
#define keel_cuda_stream_experts_up keel_contract_twin_cuda_stream_experts_up
#define keel_cuda_stream_experts_down keel_contract_twin_cuda_stream_experts_down
#define keel_cuda_relu2 keel_contract_twin_cuda_relu2
#define keel_cuda_stream_splits keel_contract_twin_cuda_stream_splits
#define keel_cuda_stream_matmul_rows keel_contract_twin_cuda_stream_matmul_rows
#define keel_cuda_stream_tune keel_contract_twin_cuda_stream_tune
#define keel_cuda_stream_prefetch keel_contract_twin_cuda_stream_prefetch
#define keel_cuda_stream_pdl keel_contract_twin_cuda_stream_pdl
#define keel_cuda_stream_pdl_active keel_contract_twin_cuda_stream_pdl_active
#define keel_cuda_stream_split_target keel_contract_twin_cuda_stream_split_target
#define keel_cuda_stream_split_long keel_contract_twin_cuda_stream_split_long
#define keel_cuda_stream_split_round keel_contract_twin_cuda_stream_split_round

#include "../kernels/cuda/cuda.h"
#include "../kernels/cuda/port.h"
#include "../kernels/cuda/tile.cuh"
#include "twin_plants.cuh"

__device__ int g_plant; /* the armed fault (KEEL_CONTRACT_PLANT_*) */

#define KEEL_PLANT_DECODE(B, XF16, v, p) KEEL_TWIN_DECODE(g_plant, B, XF16, v, p)
#define KEEL_PLANT_BIAS(b) KEEL_TWIN_BIAS(g_plant, b)
/* Fused relu2: the bias term added to the running sum before the scale term (same roundings, another order). */
#define KEEL_PLANT_GROUP_END(acc, s, S, bi, xsum, epi)                                                        \
    (g_plant == KEEL_CONTRACT_PLANT_EPIORDER && (epi) == KEEL_EPI_RELU2                                        \
         ? __fmaf_rn(s, S, __fmaf_rn(bi, xsum, acc))                                                           \
         : __fmaf_rn(bi, xsum, __fmaf_rn(s, S, acc)))
#define KEEL_PLANT_ROWS(acc, bf16) plant_rows(acc, bf16, P.splits) /* P: the tile's Params where it expands */
#define KEEL_PLANT_STORE(y, i, v, bf16, last) KEEL_TWIN_STORE(g_plant, y, i, v, bf16, last)
#define KEEL_PLANT_EW_STORED(y, bf16, i, count)                                                               \
    do {                                                                                                       \
        if (g_plant == KEEL_CONTRACT_PLANT_PASTEND && (i) == (count) - 1) {                                     \
            if (bf16)                                                                                          \
                ((uint16_t *)(y))[count] = ((uint16_t *)(y))[i];                                               \
            else                                                                                               \
                ((float *)(y))[count] = ((float *)(y))[i];                                                     \
        }                                                                                                      \
    } while (0)

/* Row 2t+1 of a thread's columns gets a trace of row 2t: 2^-22 of the smaller magnitude (2^-10 for a bf16
 * output, whose rounding would hide less), signed like row 2t: inside the gate-3 bound, visible in the bits. A
 * bf16 leak into k-split partials could add up past the bound where the partials cancel, so there it is left out
 * (the shapes that do not split show it). */
static __device__ __forceinline__ void plant_rows(float acc[4], int bf16, int splits) {
    if (g_plant != KEEL_CONTRACT_PLANT_ROWLEAK || (bf16 && splits > 1)) return;
    twin_leak_rows(acc, bf16 ? 0x1p-10f : 0x1p-22f);
}

#include "../kernels/cuda/stream.cu"

#if !defined(KEEL_STREAM_PLANT_HOOKS)
#error "src/kernels/cuda/stream.cu lost its KEEL_PLANT_* hooks: the contract's CUDA controls would plant nothing"
#endif

extern "C" void keel_contract_cuda_twin_arm(int fault) {
    KEEL_CUDA_CHECK(cudaDeviceSynchronize());
    KEEL_CUDA_CHECK(cudaMemcpyToSymbol(g_plant, &fault, sizeof fault));
}

template <int B, bool XF16> static bool probe_t(char *why, size_t cap) {
    char sym[48];
    snprintf(sym, sizeof sym, "stream_tile<%d,%s>", B, XF16 ? "true" : "false");
    return twin_probe(keel_cuda_kernel_fn(sym), sym, kThreads, (size_t)kSmemBytes, why, cap);
}

template <bool XF16> static bool probe_bits(int bits, char *why, size_t cap) {
    switch (bits) {
    case 2: return probe_t<2, XF16>(why, cap);
    case 3: return probe_t<3, XF16>(why, cap);
    case 4: return probe_t<4, XF16>(why, cap);
    case 5: return probe_t<5, XF16>(why, cap);
    case 6: return probe_t<6, XF16>(why, cap);
    case 8: return probe_t<8, XF16>(why, cap);
    default: snprintf(why, cap, "no stream tile of %d bits", bits); return false;
    }
}

extern "C" bool keel_contract_cuda_probe(int bits, int xf16, char *why, size_t cap) {
    return xf16 ? probe_bits<true>(bits, why, cap) : probe_bits<false>(bits, why, cap);
}
