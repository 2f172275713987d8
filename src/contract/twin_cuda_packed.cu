/* contract twin of the packed stream tiles: src/kernels/cuda/packed.cu compiled again under other launcher names
 * with its KEEL_PK_PLANT_* hooks redefined. One fault is armed at a time (a device flag of this file, set before
 * each launch); unarmed, the twin computes what the kernel does. Faults: width-as-4 (gate 3), bias-dropped (3),
 * write-past-end (2), row-leak (4). Gate 1's probe of the real kernels is here too. */
#define keel_cuda_stream_matmul_packed keel_contract_twin_cuda_stream_matmul_packed

#include "../kernels/cuda/cuda.h"
#include "../kernels/cuda/port.h"
#include "../kernels/cuda/tile.cuh"
#include "twin_plants.cuh"

__device__ int g_pk_plant; /* the armed fault (KEEL_CONTRACT_PLANT_*) */

#define KEEL_PK_PLANT_DECODE(B, XF16, v, p) KEEL_TWIN_DECODE(g_pk_plant, B, XF16, v, p)
#define KEEL_PK_PLANT_FAST() (g_pk_plant != KEEL_CONTRACT_PLANT_WIDTH4)
#define KEEL_PK_PLANT_BIAS(b) KEEL_TWIN_BIAS(g_pk_plant, b)
/* Row 2t+1 of a thread's columns gets a trace (2^-22) of row 2t. */
#define KEEL_PK_PLANT_ROWS(acc)                                                                                \
    do {                                                                                                       \
        if (g_pk_plant == KEEL_CONTRACT_PLANT_ROWLEAK) twin_leak_rows(acc, 0x1p-22f);                          \
    } while (0)
#define KEEL_PK_PLANT_STORE(y, i, v, bf16, last) KEEL_TWIN_STORE(g_pk_plant, y, i, v, bf16, last)
/* the contract runs the twin on a few tiles, never enough for the launcher to pair them: pair walks left out (build time) */
#define KEEL_PK_PAIRS(B, ONE, LG) 0
/* and never splits k: the controls go red on the unsplit walk, which shares every hook with the split one and, built
 * so, steps by P's strides (the split shapes' packs are span-major) */
#define KEEL_PK_SPLIT_KERNEL 0

#include "../kernels/cuda/packed.cu"

#if !defined(KEEL_PACKED_PLANT_HOOKS)
#error "src/kernels/cuda/packed.cu lost its KEEL_PK_PLANT_* hooks: the contract's packed controls would plant nothing"
#endif

extern "C" void keel_contract_cuda_twin_packed_arm(int fault) {
    KEEL_CUDA_CHECK(cudaDeviceSynchronize());
    KEEL_CUDA_CHECK(cudaMemcpyToSymbol(g_pk_plant, &fault, sizeof fault));
}

extern "C" bool keel_contract_cuda_packed_probe(int bits, int xf16, char *why, size_t cap) {
    static const char *const kernels[] = {"stream_packed", "stream_packed_split", "stream_packed_parts"};
    for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++) { /* unsplit, k in parts at m = 1 and at m > 1 */
        char sym[48];
        snprintf(sym, sizeof sym, "%s<%d,%s>", kernels[i], bits, xf16 ? "true" : "false");
        if (!twin_probe(keel_cuda_packed_kernel_fn(sym), sym, kPkThreads, (size_t)KEEL_CUDA_PACKED_SMEM, why, cap))
            return false;
    }
    return true;
}
