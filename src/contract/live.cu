/* Gate-5 live check, CUDA side: the attributes of a loaded kernel and the chip in hand. The comparison with the
 * records is plain C (keel_audit_live_compare in audit.c). */
#include <cuda_runtime.h>
#include <stdio.h>

#include "audit.h"
#include "../engine/cuda/ecuda.h"

extern "C" bool keel_audit_live_attrs(const void *fn, keel_audit_live *out, char *why, size_t cap) {
    cudaFuncAttributes a;
    cudaError_t e = cudaFuncGetAttributes(&a, fn);
    if (e != cudaSuccess) {
        snprintf(why, cap, "cudaFuncGetAttributes: %s", cudaGetErrorString(e));
        cudaGetLastError();
        return false;
    }
    out->regs = a.numRegs;
    out->local = (int)a.localSizeBytes;
    out->smem = (int)a.sharedSizeBytes;
    /* the launch's cudaFuncSetAttribute value; the untouched default (48 KiB less static) is not compared */
    out->dsmem_max = a.maxDynamicSharedSizeBytes == 49152 - (int)a.sharedSizeBytes ? -1 : a.maxDynamicSharedSizeBytes;
    return true;
}

extern "C" bool keel_audit_live_chip(char *buf, size_t cap) {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    snprintf(buf, cap, "sm_%d%d", major, minor);
    return true;
}

extern "C" const void *keel_audit_live_fn(const char *symbol) {
    const void *fn = keel_cuda_kernel_fn(symbol);
    if (!fn) fn = keel_ecu_kernel_fn(symbol);
    if (!fn) fn = keel_ecu_attn_kernel_fn(symbol);
    return fn ? fn : keel_ecu_scan_kernel_fn(symbol);
}
