/* Device discovery: never aborts, so hosts without a GPU can ask (keel_cuda_sm_count aside: launchers only). */
#include <cuda_runtime.h>
#include <stdio.h>

#include "cuda.h"
#include "port.h"

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

extern "C" int keel_cuda_sm_count(void) {
    static int sms = 0; /* the current device's, asked once: launchers call this on every launch */
    if (sms == 0) {
        int dev = 0;
        KEEL_CUDA_CHECK(cudaGetDevice(&dev));
        KEEL_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    }
    return sms;
}
