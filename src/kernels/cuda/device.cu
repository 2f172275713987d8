/* Device discovery: never aborts, so hosts without a GPU can ask. */
#include <cuda_runtime.h>
#include <stdio.h>

#include "cuda.h"

extern "C" int keel_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" bool keel_cuda_device_name(char *buf, size_t cap) {
    if (keel_cuda_device_count() < 1) return false;
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return false;
    snprintf(buf, cap, "%s, sm_%d%d, %d SMs, %.1f GiB", p.name, p.major, p.minor, p.multiProcessorCount,
             (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    return true;
}
