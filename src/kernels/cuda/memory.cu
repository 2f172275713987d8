/* Device memory helpers for C callers (tests, benchmarks, the engine's uploads); failures abort. */
#include "cuda.h"
#include "port.h"

extern "C" void *keel_cuda_malloc(size_t bytes) {
    void *p = NULL;
    KEEL_CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}
extern "C" void keel_cuda_free(void *p) {
    if (p) KEEL_CUDA_CHECK(cudaFree(p));
}
extern "C" void keel_cuda_upload(void *dst, const void *src, size_t bytes) {
    KEEL_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
extern "C" void keel_cuda_download(void *dst, const void *src, size_t bytes) {
    KEEL_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
extern "C" void keel_cuda_memset(void *dst, int byte, size_t bytes) { KEEL_CUDA_CHECK(cudaMemset(dst, byte, bytes)); }
extern "C" void keel_cuda_sync(void) { KEEL_CUDA_CHECK(cudaDeviceSynchronize()); }
