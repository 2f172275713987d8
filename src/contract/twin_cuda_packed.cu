/* contract twin of the packed stream tiles: src/kernels/cuda/packed.cu compiled again under other launcher names
 * with its KEEL_PK_PLANT_* hooks redefined. One fault is armed at a time (a device flag of this file, set before
 * each launch); unarmed, the twin computes what the kernel does. Faults: width-as-4 (gate 3), bias-dropped (3),
 * write-past-end (2), row-leak (4). Gate 1's probe of the real kernels is here too. */
#define keel_cuda_stream_matmul_packed keel_contract_twin_cuda_stream_matmul_packed

#include <stdio.h>

#include "../kernels/cuda/cuda.h"
#include "../kernels/cuda/port.h"
#include "cuda_twin.h"

__device__ int g_pk_plant; /* the armed fault (KEEL_CONTRACT_PLANT_*) */

#define KEEL_PK_PLANT_DECODE(B, XF16, v, p)                                                                    \
    do {                                                                                                       \
        if ((B) > 4 && g_pk_plant == KEEL_CONTRACT_PLANT_WIDTH4)                                               \
            codes_to_pairs<4, XF16>(v, p);                                                                     \
        else                                                                                                   \
            codes_to_pairs<B, XF16>(v, p);                                                                     \
    } while (0)
#define KEEL_PK_PLANT_BIAS(b) (g_pk_plant == KEEL_CONTRACT_PLANT_NOBIAS ? 0.f : (b))
#define KEEL_PK_PLANT_ROWS(acc) pk_plant_rows(acc)
#define KEEL_PK_PLANT_STORE(y, i, v, bf16, last)                                                              \
    do {                                                                                                       \
        store_out(y, i, v, bf16);                                                                              \
        if (g_pk_plant == KEEL_CONTRACT_PLANT_PASTEND && (i) == (last)) store_out(y, (i) + 1, v, bf16);         \
    } while (0)

/* Row 2t+1 of a thread's columns gets a trace of row 2t (2^-22 of the smaller magnitude): inside the gate-3 bound,
 * visible in the bits. */
static __device__ __forceinline__ void pk_plant_rows(float acc[4]) {
    if (g_pk_plant != KEEL_CONTRACT_PLANT_ROWLEAK) return;
    for (int e = 1; e < 4; e += 2)
        acc[e] = acc[e] + copysignf(fminf(fabsf(acc[e]), fabsf(acc[e - 1])) * 0x1p-22f, acc[e - 1]);
}

#include "../kernels/cuda/packed.cu"

#if !defined(KEEL_PACKED_PLANT_HOOKS)
#error "src/kernels/cuda/packed.cu lost its KEEL_PK_PLANT_* hooks: the contract's packed controls would plant nothing"
#endif

extern "C" void keel_contract_cuda_twin_packed_arm(int fault) {
    KEEL_CUDA_CHECK(cudaDeviceSynchronize());
    KEEL_CUDA_CHECK(cudaMemcpyToSymbol(g_pk_plant, &fault, sizeof fault));
}

extern "C" bool keel_contract_cuda_packed_probe(int bits, int xf16, char *why, size_t cap) {
    char sym[48];
    snprintf(sym, sizeof sym, "stream_packed<%d,%s>", bits, xf16 ? "true" : "false");
    const void *fn = keel_cuda_packed_kernel_fn(sym);
    if (!fn) {
        snprintf(why, cap, "keel_cuda_packed_kernel_fn does not know %s", sym);
        return false;
    }
    cudaFuncAttributes fa;
    cudaError_t e = cudaFuncGetAttributes(&fa, fn);
    if (e != cudaSuccess) {
        cudaGetLastError();
        snprintf(why, cap, "no image of %s for this device: %s", sym, cudaGetErrorString(e));
        return false;
    }
    int dev = 0, optin = 0;
    KEEL_CUDA_CHECK(cudaGetDevice(&dev));
    KEEL_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    if (fa.maxThreadsPerBlock < kPkThreads) {
        snprintf(why, cap, "%s allows %d threads a block, it launches %d", sym, fa.maxThreadsPerBlock, kPkThreads);
        return false;
    }
    if ((size_t)optin < (size_t)KEEL_CUDA_PACKED_SMEM + fa.sharedSizeBytes) {
        snprintf(why, cap, "%s needs %zu bytes of shared memory, the device allows %d a block", sym,
                 (size_t)KEEL_CUDA_PACKED_SMEM + fa.sharedSizeBytes, optin);
        return false;
    }
    return true;
}
