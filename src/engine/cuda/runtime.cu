/* engine/cuda: the GPU engine's runtime calls (device memory, copies, streams, events, CUDA graphs), each failure
 * that input or the environment can cause returned with its reason (ecuda.h). */
#include <stdio.h>

#include "../../kernels/cuda/port.h"
#include "ecuda.h"

#if defined(__HIPCC__) /* the runtime calls below that port.h does not map */
#define cudaMallocHost(p, n) hipHostMalloc(p, n, 0)
#define cudaFreeHost hipHostFree
#define cudaGraph_t hipGraph_t
#define cudaGraphExec_t hipGraphExec_t
#define cudaStreamBeginCapture hipStreamBeginCapture
#define cudaStreamCaptureModeThreadLocal hipStreamCaptureModeThreadLocal
#define cudaStreamEndCapture hipStreamEndCapture
#define cudaGraphInstantiate(x, g, f) hipGraphInstantiate(x, g, nullptr, nullptr, 0)
#define cudaGraphDestroy hipGraphDestroy
#define cudaGraphLaunch hipGraphLaunch
#define cudaGraphExecDestroy hipGraphExecDestroy
#endif

static int g_ecu_pdl = KEEL_ECU_PDL_DEFAULT;
extern "C" void keel_ecu_set_pdl(int on) { g_ecu_pdl = on != 0; }
extern "C" bool keel_ecu_pdl_on(void) { return g_ecu_pdl && keel_cuda_stream_pdl_active(); }

extern "C" void keel_ecu_prefer_shared(void) {
#if !defined(__HIPCC__)
    static bool done = false;
    if (done) return;
    const void *(*const tables[])(int) = {keel_ecu_kernel_at, keel_ecu_attn_kernel_at, keel_ecu_scan_kernel_at};
    for (size_t t = 0; t < sizeof tables / sizeof tables[0]; t++)
        for (int i = 0; tables[t](i); i++)
            KEEL_CUDA_CHECK(cudaFuncSetAttribute(tables[t](i), cudaFuncAttributePreferredSharedMemoryCarveout,
                                                 (int)cudaSharedmemCarveoutMaxShared));
    done = true;
#endif
}

extern "C" int keel_ecu_kernel_carveout(const void *fn) {
#if !defined(__HIPCC__)
    cudaFuncAttributes a;
    KEEL_CUDA_CHECK(cudaFuncGetAttributes(&a, fn));
    return a.preferredShmemCarveout;
#else
    (void)fn;
    return -1;
#endif
}

extern "C" bool keel_ecu_malloc(void **p, size_t bytes, char *why, size_t cap) {
    *p = nullptr;
    cudaError_t e = cudaMalloc(p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(why, cap, "%s", cudaGetErrorString(e));
        *p = nullptr;
        return false;
    }
    return true;
}

extern "C" bool keel_ecu_mem_info(size_t *free_b, size_t *total_b) {
    if (cudaMemGetInfo(free_b, total_b) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return true;
}

extern "C" void keel_ecu_free(void *p) {
    if (p) KEEL_CUDA_CHECK(cudaFree(p));
}
extern "C" void keel_ecu_upload(void *dst, const void *src, size_t bytes, void *st) {
    KEEL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, (cudaStream_t)st));
}
extern "C" void keel_ecu_download(void *dst, const void *src, size_t bytes, void *st) {
    KEEL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)st));
    KEEL_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)st));
}
extern "C" void keel_ecu_sync(void *st) { KEEL_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)st)); }
extern "C" void *keel_ecu_event_new(void) {
    cudaEvent_t ev;
    KEEL_CUDA_CHECK(cudaEventCreate(&ev));
    return (void *)ev;
}
extern "C" void keel_ecu_event_free(void *ev) {
    if (ev) KEEL_CUDA_CHECK(cudaEventDestroy((cudaEvent_t)ev));
}
extern "C" void keel_ecu_event_record(void *ev, void *st) {
    KEEL_CUDA_CHECK(cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)st));
}
extern "C" float keel_ecu_event_ms(void *a, void *b) {
    float ms = 0.0f;
    KEEL_CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)b));
    KEEL_CUDA_CHECK(cudaEventElapsedTime(&ms, (cudaEvent_t)a, (cudaEvent_t)b));
    return ms;
}
extern "C" void *keel_ecu_stream_new(void) {
    cudaStream_t st;
    KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    return (void *)st;
}
extern "C" void *keel_ecu_stream_new_low(void) {
    cudaStream_t st;
    int least = 0, greatest = 0;
    KEEL_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    KEEL_CUDA_CHECK(cudaStreamCreateWithPriority(&st, cudaStreamNonBlocking, least));
    return (void *)st;
}
extern "C" void keel_ecu_stream_wait(void *st, void *ev) {
    KEEL_CUDA_CHECK(cudaStreamWaitEvent((cudaStream_t)st, (cudaEvent_t)ev, 0));
}
extern "C" void keel_ecu_stream_free(void *st) {
    if (st) KEEL_CUDA_CHECK(cudaStreamDestroy((cudaStream_t)st));
}
extern "C" void *keel_ecu_host_alloc(size_t bytes) {
    void *p = nullptr;
    KEEL_CUDA_CHECK(cudaMallocHost(&p, bytes ? bytes : 1));
    return p;
}
extern "C" void keel_ecu_host_free(void *p) {
    if (p) KEEL_CUDA_CHECK(cudaFreeHost(p));
}
extern "C" void keel_ecu_memset(void *dst, int byte, size_t bytes, void *st) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, (cudaStream_t)st));
}
extern "C" void keel_ecu_download_async(void *dst, const void *src, size_t bytes, void *st) {
    KEEL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)st));
}
extern "C" bool keel_ecu_capture_begin(void *st, char *why, size_t cap) {
    const cudaError_t e = cudaStreamBeginCapture((cudaStream_t)st, cudaStreamCaptureModeThreadLocal);
    if (e == cudaSuccess) return true;
    (void)cudaGetLastError();
    snprintf(why, cap, "cudaStreamBeginCapture: %s", cudaGetErrorString(e));
    return false;
}
extern "C" bool keel_ecu_capture_end(void *st, void **exec, char *why, size_t cap) {
    cudaGraph_t g = nullptr;
    cudaGraphExec_t x = nullptr;
    *exec = nullptr;
    cudaError_t e = cudaStreamEndCapture((cudaStream_t)st, &g);
    if (e == cudaSuccess) e = cudaGraphInstantiate(&x, g, 0);
    if (g) (void)cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(why, cap, "capturing the decode step as a CUDA graph: %s", cudaGetErrorString(e));
        return false;
    }
    *exec = (void *)x;
    return true;
}
extern "C" void keel_ecu_graph_launch(void *exec, void *st) {
    KEEL_CUDA_CHECK(cudaGraphLaunch((cudaGraphExec_t)exec, (cudaStream_t)st));
}
extern "C" void keel_ecu_graph_free(void *exec) {
    if (exec) KEEL_CUDA_CHECK(cudaGraphExecDestroy((cudaGraphExec_t)exec));
}
