/* contract: the CUDA backend's buffer and sync hooks. Buffers come from a pool keyed by size: the contract makes
 * tens of thousands of small guarded buffers, and cudaMalloc/cudaFree (which synchronizes) would dominate. */
#include <stdio.h>
#include <stdlib.h>

#include "../kernels/cuda/port.h"
#include "cuda_twin.h"

namespace {

struct pooled {
    void *p;
    size_t bytes;
    bool used;
    unsigned long long stamp; /* g_clock when it was last handed out or written from the host */
};

pooled *g_pool = nullptr;
int g_n = 0, g_cap = 0;
unsigned long long g_clock = 0;

pooled *owner(const void *p) {
    for (int i = 0; i < g_n; i++)
        if ((const char *)p >= (const char *)g_pool[i].p && (const char *)p < (const char *)g_pool[i].p + g_pool[i].bytes)
            return &g_pool[i];
    return nullptr;
}

} // namespace

extern "C" void *keel_contract_cuda_alloc(size_t bytes) {
    bytes = (bytes + 255) & ~(size_t)255;
    for (int i = 0; i < g_n; i++)
        if (!g_pool[i].used && g_pool[i].bytes == bytes) {
            g_pool[i].used = true;
            g_pool[i].stamp = ++g_clock;
            return g_pool[i].p;
        }
    if (g_n == g_cap) {
        g_cap = g_cap ? 2 * g_cap : 64;
        g_pool = (pooled *)keel_xrealloc(g_pool, (size_t)g_cap * sizeof *g_pool);
    }
    void *p = nullptr;
    KEEL_CUDA_CHECK(cudaMalloc(&p, bytes));
    g_pool[g_n++] = pooled{p, bytes, true, ++g_clock};
    return p;
}

extern "C" void keel_contract_cuda_release(void *p) {
    for (int i = 0; p && i < g_n; i++)
        if (g_pool[i].p == p) {
            g_pool[i].used = false;
            return;
        }
    KEEL_ASSERTF(p == nullptr, "contract: releasing a device buffer the pool did not hand out");
}

extern "C" void keel_contract_cuda_upload(void *dst, const void *src, size_t bytes) {
    KEEL_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    pooled *o = owner(dst);
    if (o) o->stamp = ++g_clock;
}

extern "C" unsigned long long keel_contract_cuda_stamp(const void *p) {
    const pooled *o = owner(p);
    KEEL_ASSERTF(o && o->used, "contract: stamp of a device pointer the pool does not hold");
    return o->stamp;
}

extern "C" void keel_contract_cuda_download(void *dst, const void *src, size_t bytes) {
    KEEL_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

extern "C" bool keel_contract_cuda_sync(char *why, size_t cap) {
    cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess) {
        snprintf(why, cap, "the device reported %s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
        return false;
    }
    return true;
}
