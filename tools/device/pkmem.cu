/* pkmem: the memory side of the packed tile's walk on its own (docs/stream-tiles.md, "Span-major records"), against
 * a plain streaming read in the same run. Each warp walks span records (NV 512-byte code chunks, then 128 bytes of
 * scales: 2, 4 and 8 bits at group 64) of T tiles' k parts through a register ring of D steps, with R rounds of
 * decode-like arithmetic a code word (0: memory only), at MINB blocks of 8 warps an SM (shared memory holds it
 * there), optionally asking L2 for the span PF steps ahead. Layout tile: a tile's spans contiguous; span: span s of
 * every tile adjacent. Shapes: 16384^2 (1024 tiles of 128 spans, k in 2 or 4 parts) and lm_head (8192 tiles of 21).
 * nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/pkmem tools/device/pkmem.cu && /tmp/pkmem */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <algorithm>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

__device__ __forceinline__ uint4 ldg16(const void *p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint32_t ldg4h(const void *p) {
    uint32_t v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
    return v;
}

template <int NV> struct Sp { uint32_t c[4 * NV]; uint32_t s; };

struct Geo {
    const uint8_t *w;
    int tiles, ns, parts, rec;
    long long sstr, tstr; /* bytes between a tile's spans, between tiles */
};

__device__ __forceinline__ void pf_l2(const void *p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

template <int NV, int D, int R, int MINB, int PF = 0, int T = 1>
__global__ void __launch_bounds__(256, MINB) walk_kernel(Geo G, float *out) {
    const int lane = threadIdx.x & 31;
    const int nw = gridDim.x * 8, wid = (threadIdx.x >> 5) * gridDim.x + blockIdx.x;
    const int walks = G.tiles / T * G.parts, nsp = G.ns / G.parts;
    float acc[4] = {0, 0, 0, 0};
    const float xv = 1.0001f + lane * 1e-6f;
    int nmine = walks > wid ? (walks - wid + nw - 1) / nw : 0;
    const int total = nmine * nsp;
    if (total == 0) return;
    /* load cursor */
    int lwalk = wid, lleft = nsp;
    auto base = [&](int wk) { return G.w + (long long)(wk / G.parts) * T * G.tstr + (long long)(wk % G.parts) * nsp * G.sstr; };
    const uint8_t *lp = base(lwalk);
    auto load = [&](Sp<NV> (&SS)[T]) {
#pragma unroll
        for (int u = 0; u < T; u++) {
            Sp<NV> &S = SS[u];
            const uint8_t *lt = lp + u * G.tstr;
            if (PF > 0) {
                const uint8_t *pp = lt + (long long)PF * G.sstr;
                for (int o = 32 * lane; o < G.rec; o += 1024) pf_l2(pp + o);
            }
#pragma unroll
            for (int i = 0; i < NV; i++) {
                uint4 v = ldg16(lt + 512 * i + 16 * lane);
                S.c[4 * i] = v.x, S.c[4 * i + 1] = v.y, S.c[4 * i + 2] = v.z, S.c[4 * i + 3] = v.w;
            }
            S.s = ldg4h(lt + 512 * NV + 4 * lane);
        }
        lp += G.sstr;
        if (--lleft == 0) { lwalk += nw; lleft = nsp; lp = base(lwalk); }
    };
    Sp<NV> buf[D][T];
#pragma unroll
    for (int d = 0; d < D - 1; d++) if (d < total) load(buf[d]);
    for (int q0 = 0; q0 < total; q0 += D) {
#pragma unroll
        for (int d = 0; d < D; d++) {
            const int q = q0 + d;
            if (q >= total) break;
            if (q + D - 1 < total) load(buf[(d + D - 1) % D]);
#pragma unroll
          for (int u = 0; u < T; u++) {
            const Sp<NV> &S = buf[d][u];
#pragma unroll
            for (int i = 0; i < 4 * NV; i++) {
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const uint32_t h = (S.c[i] >> (2 * r)) & 0x00030003u | 0x43004300u;
                    acc[(i + r) & 3] = __fmaf_rn(__uint_as_float(h), xv, acc[(i + r) & 3]);
                }
                if (R == 0) acc[i & 3] += __uint_as_float(S.c[i] & 0x3f7fffffu);
            }
            acc[0] = __fmaf_rn(__uint_as_float(S.s & 0x3f7fffffu), xv, acc[0]);
          }
        }
    }
    const float v = acc[0] + acc[1] + acc[2] + acc[3];
    if (v == 1.2345f) out[wid * 32 + lane] = v; /* keeps the loads alive, never true in practice */
}

__global__ void read_kernel(const uint4 *p, long long n, float *out) {
    uint32_t a = 0;
    const long long st = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += 8 * st) {
        uint4 v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = i + j * st < n ? ldg16(p + i + j * st) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < 8; j++) a ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    if (a == 0x12345678u) out[0] = (float)a;
}

static float median(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

static uint8_t *g_buf;
static size_t g_bytes;
static float *g_out;
static int g_sms;

template <typename F> static float time_rot(size_t mbytes, F launch) {
    const int copies = (int)std::max<size_t>(1, (g_bytes - (1 << 20)) / mbytes);
    std::vector<float> t;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    for (int it = 0; it < 3; it++) launch(g_buf);
    for (int it = 0; it < 30; it++) {
        const uint8_t *p = g_buf + (size_t)(it % copies) * mbytes;
        CK(cudaEventRecord(a));
        launch(p);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms; CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms * 1000.f);
    }
    CK(cudaGetLastError());
    CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
    return median(t);
}

static double g_peak;

template <int NV, int D, int R, int MINB, int PF = 0, int T = 1> static void run(const char *shape, int tiles, int ns, int parts, int layout) {
    const int rec = 512 * NV + 128;
    Geo G;
    G.tiles = tiles, G.ns = ns, G.parts = parts, G.rec = rec;
    if (layout == 0) G.sstr = rec, G.tstr = (long long)ns * rec;
    else G.sstr = (long long)tiles * rec, G.tstr = rec;
    const size_t mbytes = (size_t)tiles * ns * rec, span = (size_t)tiles * (layout == 0 ? G.tstr : ns * rec);
    int nb = 0;
    const int smem = (220 << 10) / MINB - 2048;
    CK(cudaFuncSetAttribute(walk_kernel<NV, D, R, MINB, PF, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, walk_kernel<NV, D, R, MINB, PF, T>, 256, smem));
    const int grid = nb * g_sms;
    const float us = time_rot(span, [&](const uint8_t *p) { Geo g = G; g.w = p; walk_kernel<NV, D, R, MINB, PF, T><<<grid, 256, smem>>>(g, g_out); });
    const double gbs = mbytes / (us * 1e3);
    printf("%-8s T %d PF %d rec %4d D %d R %d blk/SM %d parts %d layout %s: %7.1f us %7.1f GB/s %5.1f %%\n", shape, T, PF, rec, D, R,
           nb, parts, layout ? "span" : "tile", us, gbs, 100.0 * gbs / g_peak);
}

template <int NV, int D, int R, int MINB, int PF, int T = 1> static void pf() {
    run<NV, D, R, MINB, PF, T>("sq16k", 1024, 128, T == 1 ? 2 : T == 2 ? 4 : 8, 0);
    run<NV, D, R, MINB, PF, T>("lm_head", 8192, 21, 1, 0);
}

template <int NV, int D, int T> static void lay() {
    for (int layout = 0; layout < 2; layout++) {
        run<NV, D, 0, 2, 0, T>("sq16k", 1024, 128, T == 1 ? 2 : 4, layout);
        run<NV, D, 0, 2, 0, T>("lm_head", 8192, 21, 1, layout);
    }
}

int main() {
    CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
    g_bytes = (size_t)1 << 30;
    CK(cudaMalloc(&g_buf, g_bytes));
    CK(cudaMemset(g_buf, 0x11, g_bytes));
    CK(cudaMalloc(&g_out, 1 << 24));
    const size_t pb = (size_t)1000 << 20;
    float us = time_rot(pb, [&](const uint8_t *p) { read_kernel<<<g_sms * 8, 256>>>((const uint4 *)p, pb / 16, g_out); });
    g_peak = pb / (us * 1e3);
    printf("read: %.1f us, %.1f GB/s (%d SMs)\n", us, g_peak, g_sms);
    printf("-- ring depth and tiles a step (tile-major)\n");
    pf<1, 3, 0, 2, 0, 1>(); pf<1, 4, 0, 2, 0, 1>(); pf<1, 8, 0, 2, 0, 1>();
    pf<1, 2, 0, 2, 0, 2>(); pf<1, 3, 0, 2, 0, 2>(); pf<1, 4, 0, 2, 0, 2>(); pf<1, 2, 0, 2, 0, 4>();
    pf<2, 3, 0, 2, 0, 1>(); pf<2, 2, 0, 2, 0, 2>(); pf<2, 3, 0, 2, 0, 2>(); pf<4, 2, 0, 2, 0, 1>();
    printf("-- 4 blocks an SM (k in 4 parts)\n");
    run<1, 3, 0, 4>("sq16k", 1024, 128, 4, 0); run<2, 3, 0, 4>("sq16k", 1024, 128, 4, 0);
    printf("-- L2 prefetch of the span PF steps ahead\n");
    pf<1, 3, 0, 2, 2>(); pf<1, 3, 0, 2, 4>(); pf<1, 3, 0, 2, 8>(); pf<2, 3, 0, 2, 4>();
    printf("-- tile-major against span-major\n");
    lay<1, 3, 1>(); lay<1, 3, 2>(); lay<2, 3, 1>(); lay<2, 2, 2>(); lay<2, 3, 2>(); lay<4, 2, 1>(); lay<4, 2, 2>();
    return 0;
}
