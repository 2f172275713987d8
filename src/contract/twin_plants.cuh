/* contract: the plants both CUDA twins (twin_cuda_stream.cu, twin_cuda_packed.cu) put into their tile's hooks, and
 * gate 1's probe of a real kernel. Each twin passes its own armed-fault flag (a __device__ int of its file). */
#ifndef KEEL_CONTRACT_TWIN_PLANTS_CUH
#define KEEL_CONTRACT_TWIN_PLANTS_CUH

#include <stdio.h>

#include "../kernels/cuda/cuda.h"
#include "cuda_twin.h"

/* Codes of wider widths decoded as if they were 4 bits wide (gate 3). */
#define KEEL_TWIN_DECODE(flag, B, XF16, v, p)                                                                  \
    do {                                                                                                       \
        if ((B) > 4 && (flag) == KEEL_CONTRACT_PLANT_WIDTH4)                                                   \
            codes_to_pairs<4, XF16>(v, p);                                                                     \
        else                                                                                                   \
            codes_to_pairs<B, XF16>(v, p);                                                                     \
    } while (0)
/* The bias term dropped (gate 3). */
#define KEEL_TWIN_BIAS(flag, b) ((flag) == KEEL_CONTRACT_PLANT_NOBIAS ? 0.f : (b))
/* The last output written once more, one element further (gate 2). */
#define KEEL_TWIN_STORE(flag, y, i, v, bf16, last)                                                             \
    do {                                                                                                       \
        store_out(y, i, v, bf16);                                                                              \
        if ((flag) == KEEL_CONTRACT_PLANT_PASTEND && (i) == (last)) store_out(y, (i) + 1, v, bf16);             \
    } while (0)

/* Row 2t+1 of a thread's columns gets a trace f of row 2t's smaller magnitude, signed like row 2t (gate 4): inside
 * the gate-3 bound, visible in the bits. */
static __device__ __forceinline__ void twin_leak_rows(float acc[4], float f) {
    for (int e = 1; e < 4; e += 2) acc[e] = acc[e] + copysignf(fminf(fabsf(acc[e]), fabsf(acc[e - 1])) * f, acc[e - 1]);
}

/* Gate 1: kernel fn (sym, NULL if its table does not know it) has an image for this device, allows `threads` a
 * block and fits `dsmem` dynamic shared memory beside its static; false with a reason. */
static inline bool twin_probe(const void *fn, const char *sym, int threads, size_t dsmem, char *why, size_t cap) {
    if (!fn) {
        snprintf(why, cap, "the kernel table does not know %s", sym);
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
    if (fa.maxThreadsPerBlock < threads) {
        snprintf(why, cap, "%s allows %d threads a block, it launches %d", sym, fa.maxThreadsPerBlock, threads);
        return false;
    }
    if ((size_t)optin < dsmem + fa.sharedSizeBytes) {
        snprintf(why, cap, "%s needs %zu bytes of shared memory, the device allows %d a block", sym,
                 dsmem + fa.sharedSizeBytes, optin);
        return false;
    }
    return true;
}

#endif
