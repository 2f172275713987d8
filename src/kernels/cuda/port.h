/* kernels/cuda: CUDA/HIP portability for the .cu sources: runtime names, half types, warp shuffles, the
 * tensor-core instruction and the asynchronous copies the stream tile uses (each with a portable twin), and
 * KEEL_CUDA_CHECK. Wave size 32. */
#ifndef KEEL_KERNELS_CUDA_PORT_H
#define KEEL_KERNELS_CUDA_PORT_H

#include <stdint.h>

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaGetErrorString hipGetErrorString
#define cudaGetLastError hipGetLastError
#define cudaMalloc hipMalloc
#define cudaFree hipFree
#define cudaMemcpy hipMemcpy
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemset hipMemset
#define cudaMemsetAsync hipMemsetAsync
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define cudaDeviceSynchronize hipDeviceSynchronize
#define cudaStream_t hipStream_t
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaStreamCreate hipStreamCreate
#define cudaStreamDestroy hipStreamDestroy
#define cudaStreamCreateWithFlags hipStreamCreateWithFlags
#define cudaStreamCreateWithPriority hipStreamCreateWithPriority
#define cudaStreamNonBlocking hipStreamNonBlocking
#define cudaDeviceGetStreamPriorityRange hipDeviceGetStreamPriorityRange
#define cudaStreamWaitEvent hipStreamWaitEvent
#define cudaMemGetInfo hipMemGetInfo
#define cudaGetErrorName hipGetErrorName
#define cudaMemcpyToSymbol hipMemcpyToSymbol
#define cudaMemcpyFromSymbol hipMemcpyFromSymbol
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaDeviceProp hipDeviceProp_t
#define cudaGetDeviceProperties hipGetDeviceProperties
#define cudaFuncAttributes hipFuncAttributes
#define cudaFuncGetAttributes(a, f) hipFuncGetAttributes(a, (const void *)(f))
#define cudaEventSynchronize hipEventSynchronize
#define cudaEvent_t hipEvent_t
#define cudaEventCreate hipEventCreate
#define cudaEventDestroy hipEventDestroy
#define cudaEventRecord hipEventRecord
#define cudaEventElapsedTime hipEventElapsedTime
#define cudaGetDevice hipGetDevice
#define cudaDeviceGetAttribute hipDeviceGetAttribute
#define cudaDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
/* HIP's opt-in attribute is CUDA-only; an AMD block may use the plain per-block maximum */
#define cudaDevAttrMaxSharedMemoryPerBlockOptin hipDeviceAttributeMaxSharedMemoryPerBlock
#define cudaFuncSetAttribute(f, a, v) hipFuncSetAttribute((const void *)(f), a, v)
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#if defined(__AMDGCN_WAVEFRONT_SIZE)
static_assert(__AMDGCN_WAVEFRONT_SIZE == 32, "keel kernels assume 32-wide waves (build with -mwavefrontsize32)");
#endif
#else
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef __nv_bfloat162 kp_bf162;
#endif

#include "../../core/core.h"

/* Aborts with file and line when a runtime call fails: a failing device is a broken environment mid-kernel. */
#define KEEL_CUDA_CHECK(call)                                                                      \
    do {                                                                                           \
        cudaError_t kc_e_ = (call);                                                                \
        if (kc_e_ != cudaSuccess) keel_panic(__FILE__, __LINE__, "%s: %s", #call, cudaGetErrorString(kc_e_)); \
    } while (0)
/* After every launch: launch-configuration errors surface here, not at the next unrelated call. */
#define KEEL_CUDA_CHECK_LAUNCH() KEEL_CUDA_CHECK(cudaGetLastError())

/* A launch, as a programmatic dependent when `pdl_` (sm_90: it may start while the previous kernel on the stream
 * runs; the kernel must kp_grid_wait before it reads what an earlier kernel wrote, and write nothing before that).
 * HIP: a plain launch. */
#if !defined(__HIPCC__)
#define KP_LAUNCH(pdl_, kernel_, grid_, block_, smem_, stream_, ...)                                            \
    do {                                                                                                       \
        cudaLaunchConfig_t kp_cfg_ = {};                                                                       \
        kp_cfg_.gridDim = (grid_);                                                                             \
        kp_cfg_.blockDim = (block_);                                                                           \
        kp_cfg_.dynamicSmemBytes = (smem_);                                                                    \
        kp_cfg_.stream = (cudaStream_t)(stream_);                                                              \
        cudaLaunchAttribute kp_at_[1];                                                                         \
        kp_at_[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;                                     \
        kp_at_[0].val.programmaticStreamSerializationAllowed = 1;                                              \
        kp_cfg_.attrs = kp_at_;                                                                                \
        kp_cfg_.numAttrs = (pdl_) ? 1 : 0;                                                                     \
        KEEL_CUDA_CHECK(cudaLaunchKernelEx(&kp_cfg_, kernel_, __VA_ARGS__));                                   \
    } while (0)
#else
#define KP_LAUNCH(pdl_, kernel_, grid_, block_, smem_, stream_, ...)                                            \
    kernel_<<<(grid_), (block_), (smem_), (hipStream_t)(stream_)>>>(__VA_ARGS__)
#endif

#define KP_FULL_MASK 0xffffffffu

#if defined(__CUDACC__) || defined(__HIPCC__)
/* 32-wide shuffle with an explicit mask on both toolchains. */
static __device__ __forceinline__ uint32_t kp_shfl(uint32_t v, int src) {
#if defined(__HIPCC__)
    return (uint32_t)__shfl((int)v, src, 32);
#else
    return __shfl_sync(KP_FULL_MASK, v, src, 32);
#endif
}

/* Butterfly exchange with lane ^ mask. */
static __device__ __forceinline__ uint32_t kp_shfl_xor(uint32_t v, int mask) {
#if defined(__HIPCC__)
    return (uint32_t)__shfl_xor((int)v, mask, 32);
#else
    return __shfl_xor_sync(KP_FULL_MASK, v, mask, 32);
#endif
}

/* The butterfly on a float or an int: the same 32-bit exchange, the bits unchanged. */
static __device__ __forceinline__ float kp_shfl_xor_f32(float v, int mask) {
    return __uint_as_float(kp_shfl_xor(__float_as_uint(v), mask));
}
static __device__ __forceinline__ int kp_shfl_xor_i32(int v, int mask) { return (int)kp_shfl_xor((uint32_t)v, mask); }
/* Bit l set where lane l's p is true (the 32 lanes of a warp, all calling). */
static __device__ __forceinline__ uint32_t kp_ballot(bool p) {
#if defined(__HIPCC__)
    return (uint32_t)__ballot(p);
#else
    return __ballot_sync(KP_FULL_MASK, p);
#endif
}
/* Every lane gets lane src's float. */
static __device__ __forceinline__ float kp_shfl_idx_f32(float v, int src) {
#if defined(__HIPCC__)
    return __shfl(v, src, 32);
#else
    return __shfl_sync(KP_FULL_MASK, v, src, 32);
#endif
}
/* The largest (MAX) or the smallest of the 32 lanes' v, in every lane (redux.sync on sm_80+, a butterfly elsewhere). */
template <bool MAX> static __device__ __forceinline__ uint32_t kp_warp_reduce_u32(uint32_t v) {
#if !defined(__HIPCC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return MAX ? __reduce_max_sync(KP_FULL_MASK, v) : __reduce_min_sync(KP_FULL_MASK, v);
#else
    for (int o = 16; o > 0; o >>= 1) {
        const uint32_t w = kp_shfl_xor(v, o);
        v = MAX ? max(v, w) : min(v, w);
    }
    return v;
#endif
}
static __device__ __forceinline__ uint32_t kp_warp_max_u32(uint32_t v) { return kp_warp_reduce_u32<true>(v); }
static __device__ __forceinline__ uint32_t kp_warp_min_u32(uint32_t v) { return kp_warp_reduce_u32<false>(v); }
/* Lane i gets lane i + d's float (lanes past 31 keep their own). */
static __device__ __forceinline__ float kp_shfl_down_f32(float v, int d) {
#if defined(__HIPCC__)
    return __shfl_down(v, (unsigned)d, 32);
#else
    return __shfl_down_sync(KP_FULL_MASK, v, (unsigned)d, 32);
#endif
}

static __device__ __forceinline__ void kp_syncwarp(void) {
#if defined(__HIPCC__)
    __builtin_amdgcn_wave_barrier();
#else
    __syncwarp(KP_FULL_MASK);
#endif
}

/* Streaming read of 16 bytes that bypasses L1 allocation where the toolchain offers it. */
static __device__ __forceinline__ uint4 kp_ld_stream16(const uint4 *p) {
#if defined(__HIPCC__)
    return *p;
#else
    return __ldcs(p);
#endif
}
static __device__ __forceinline__ uint32_t kp_ld_stream4(const uint32_t *p) {
#if defined(__HIPCC__)
    return *p;
#else
    return __ldcs(p);
#endif
}

/* Read-only 16- and 8-byte loads (aligned) through the non-coherent cache where the toolchain has one. */
static __device__ __forceinline__ uint4 kp_ldg16(const void *p) {
#if defined(__HIPCC__)
    return *(const uint4 *)p;
#else
    return __ldg((const uint4 *)p);
#endif
}
static __device__ __forceinline__ uint2 kp_ldg8(const void *p) {
#if defined(__HIPCC__)
    return *(const uint2 *)p;
#else
    return __ldg((const uint2 *)p);
#endif
}
/* kp_ldg16/kp_ldg8 for data read once (weights streamed by the packed tile): no L1 allocation, L2 asked to fetch
 * the whole 256-byte block around it (long DRAM bursts); the portable twin is the plain load. */
static __device__ __forceinline__ uint4 kp_ldg16_stream(const void *p) {
#if !defined(__HIPCC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
#else
    return kp_ldg16(p);
#endif
}
static __device__ __forceinline__ uint2 kp_ldg8_stream(const void *p) {
#if !defined(__HIPCC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
#else
    return kp_ldg8(p);
#endif
}

/* A read-only 4-byte load through the non-coherent cache where the toolchain has one. */
static __device__ __forceinline__ uint32_t kp_ldg32(const uint32_t *p) {
#if defined(__HIPCC__)
    return *p;
#else
    return __ldg(p);
#endif
}

/* (a & b) | c in one instruction (a mask and a magic exponent both constant would otherwise take two). */
static __device__ __forceinline__ uint32_t kp_and_or(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__HIPCC__)
    return (a & b) | c;
#else
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#endif
}

/* Exact a - b on packed f16x2 pairs (as raw words); used only on small integers. */
static __device__ __forceinline__ uint32_t kp_sub_f16x2(uint32_t a, uint32_t b) {
    __half2 x, y, r;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    r = __hsub2(x, y);
    uint32_t o;
    memcpy(&o, &r, 4);
    return o;
}

/* Two floats (exact small integers here) to a bf16x2 word, lo in the low half. */
static __device__ __forceinline__ uint32_t kp_pack_bf16x2(float lo, float hi) {
#if defined(__HIPCC__) /* exact: the values are small integers */
    return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u);
#else
    kp_bf162 r = __floats2bfloat162_rn(lo, hi);
    uint32_t o;
    memcpy(&o, &r, 4);
    return o;
#endif
}

static __device__ __forceinline__ float kp_bf16_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
static __device__ __forceinline__ float kp_f16_to_f32(uint16_t h) {
    __half x;
    memcpy(&x, &h, 2);
    return __half2float(x);
}
/* Round to nearest even, NaN kept quiet: the same rule as core's keel_f32_to_bf16. */
static __device__ __forceinline__ uint16_t kp_f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if !defined(__HIPCC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define KP_HAVE_MMA 1
#define KP_HAVE_CP_ASYNC 1
#endif

/* Asynchronous global -> shared copies (16 bytes bypassing L1, or 4 bytes) in commit groups, sm_80+; the portable
 * twin copies synchronously, so a wait has nothing left to wait for. */
static __device__ __forceinline__ void kp_cp_async16(void *smem, const void *gmem) {
#if defined(KP_HAVE_CP_ASYNC)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((uint32_t)__cvta_generic_to_shared(smem)),
                 "l"(gmem)
                 : "memory");
#else
    *(uint4 *)smem = *(const uint4 *)gmem;
#endif
}
static __device__ __forceinline__ void kp_cp_async4(void *smem, const void *gmem) {
#if defined(KP_HAVE_CP_ASYNC)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"((uint32_t)__cvta_generic_to_shared(smem)),
                 "l"(gmem)
                 : "memory");
#else
    *(uint32_t *)smem = *(const uint32_t *)gmem;
#endif
}
static __device__ __forceinline__ void kp_cp_commit(void) {
#if defined(KP_HAVE_CP_ASYNC)
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
/* Waits until at most N of this thread's committed groups are still in flight. */
template <int N> static __device__ __forceinline__ void kp_cp_wait(void) {
#if defined(KP_HAVE_CP_ASYNC)
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
/* The same with N known only at run time (0..6; larger waits for all). */
static __device__ __forceinline__ void kp_cp_wait_dyn(int n) {
    switch (n) {
    case 6: kp_cp_wait<6>(); break;
    case 5: kp_cp_wait<5>(); break;
    case 4: kp_cp_wait<4>(); break;
    case 3: kp_cp_wait<3>(); break;
    case 2: kp_cp_wait<2>(); break;
    case 1: kp_cp_wait<1>(); break;
    default: kp_cp_wait<0>(); break;
    }
}
/* kp_cp_async16 asking L2 to fetch the whole 256-byte block around the source (long DRAM bursts for short row
 * pieces); the portable twin copies synchronously. */
static __device__ __forceinline__ void kp_cp_async16_l2(void *smem, const void *gmem) {
#if defined(KP_HAVE_CP_ASYNC)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"((uint32_t)__cvta_generic_to_shared(smem)),
                 "l"(gmem)
                 : "memory");
#else
    *(uint4 *)smem = *(const uint4 *)gmem;
#endif
}
/* Asks L2 to fetch the 16-byte-aligned interior of [p, p + bytes) (one bulk request on sm_90, one per 128-byte
 * line before; a hint that never faults and never changes a result; nothing on HIP). */
static __device__ __forceinline__ void kp_prefetch_l2(const void *p, long long bytes) {
#if !defined(__HIPCC__) && defined(__CUDA_ARCH__)
    const unsigned long long a = ((unsigned long long)p + 15ull) & ~15ull, e = ((unsigned long long)p + bytes) & ~15ull;
    if (bytes <= 0 || e <= a) return;
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(a), "r"((uint32_t)(e - a)) : "memory");
#else
    for (unsigned long long l = a & ~127ull; l < e; l += 128) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(l));
#endif
#else
    (void)p;
    (void)bytes;
#endif
}
/* Programmatic dependent launch (sm_90): kp_grid_wait blocks until the grid this launch depends on has finished and
 * its writes are visible (returns at once for a plain launch); kp_grid_release lets the next grid on the stream start
 * launching while this one runs. Both are nothing elsewhere. */
static __device__ __forceinline__ void kp_grid_wait(void) {
#if !defined(__HIPCC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
static __device__ __forceinline__ void kp_grid_release(void) {
#if !defined(__HIPCC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}
/* The start of a kernel launched as a programmatic dependent that reads its inputs at once: wait for the previous
 * grid (before any read of an earlier kernel's output and before any write), then release the next one. Released
 * after the wait, a dependent launches only once this kernel runs: launches overlap one deep, never in a cascade of
 * waiting grids. */
static __device__ __forceinline__ void kp_grid_enter(void) {
    kp_grid_wait();
    kp_grid_release();
}
/* A load that skips L1 (data other blocks of the same launch wrote, after their fence). */
static __device__ __forceinline__ float kp_ldcg_f32(const float *p) {
#if defined(__HIPCC__)
    return *(const volatile float *)p;
#else
    return __ldcg(p);
#endif
}

/* D += A(16x16) * B(16x8), A row-major, B column-major, fp32 accumulate; fragments as in PTX m16n8k16. XF16
 * selects f16 operands, else bf16. The portable twin gathers the operands with shuffles and sums in order. */
template <bool XF16>
static __device__ __forceinline__ void kp_mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(KP_HAVE_MMA)
    if (XF16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
#else
    /* thread (g, t): d0,d1 = row g cols 2t,2t+1; d2,d3 = row g+8. A row g slots {2t,2t+1} in a[0], {2t+8,2t+9} in
     * a[2] of lane 4g+t; B column n slots likewise in b[0], b[1] of lane 4n+t. */
    int lane = (int)(threadIdx.x & 31), g = lane >> 2, t = lane & 3;
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    for (int tt = 0; tt < 4; tt++) {
        uint32_t ar[4], bc0[2], bc1[2];
        for (int i = 0; i < 4; i++) ar[i] = kp_shfl(a[i], 4 * g + tt);
        for (int i = 0; i < 2; i++) {
            bc0[i] = kp_shfl(b[i], 4 * (2 * t) + tt);
            bc1[i] = kp_shfl(b[i], 4 * (2 * t + 1) + tt);
        }
        for (int h = 0; h < 2; h++)       /* h: slot pair {2tt,2tt+1} (regs 0/1) or {2tt+8,..} (regs 2/3) */
            for (int e = 0; e < 2; e++) { /* element within the pair */
                int sh = 16 * e;
                float a0, a1, b0, b1;
                uint16_t ua0 = (uint16_t)(ar[2 * h] >> sh), ua1 = (uint16_t)(ar[2 * h + 1] >> sh);
                uint16_t ub0 = (uint16_t)(bc0[h] >> sh), ub1 = (uint16_t)(bc1[h] >> sh);
                if (XF16) {
                    a0 = kp_f16_to_f32(ua0); a1 = kp_f16_to_f32(ua1); b0 = kp_f16_to_f32(ub0); b1 = kp_f16_to_f32(ub1);
                } else {
                    a0 = kp_bf16_to_f32(ua0); a1 = kp_bf16_to_f32(ua1); b0 = kp_bf16_to_f32(ub0); b1 = kp_bf16_to_f32(ub1);
                }
                s[0] = fmaf(a0, b0, s[0]);
                s[1] = fmaf(a0, b1, s[1]);
                s[2] = fmaf(a1, b0, s[2]);
                s[3] = fmaf(a1, b1, s[3]);
            }
    }
    for (int i = 0; i < 4; i++) d[i] += s[i];
#endif
}
#endif /* device code */

#endif
