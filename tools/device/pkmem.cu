/* pkmem: the memory side of the packed tile's walk on its own (docs/stream-tiles.md, "Span-major records"), against
 * a plain streaming read in the same run. Each warp walks span records (NV 512-byte code chunks, then 128 bytes of
 * scales: 2, 4 and 8 bits at group 64) of T tiles' k parts through a register ring of D steps, with R rounds of
 * decode-like arithmetic a code word (0: memory only), at MINB blocks of 8 warps an SM (shared memory holds it
 * there), optionally asking L2 for the span PF steps ahead. Layout tile: a tile's spans contiguous; span: span s of
 * every tile adjacent. Shapes: 16384^2 (1024 tiles of 128 spans, k in 2 or 4 parts) and lm_head (8192 tiles of 21).
 * Argument 1: the plain read's bytes in flight and a shared-memory ring of bulk copies; 2: launches back to back (the
 * bench's timing) of the plain read at the tile's sizes and of the register ring; 3: 4 and 8 bits, register ring
 * against bulk ring, with and without arithmetic; none: the register-ring sections.
 * nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/pkmem tools/device/pkmem.cu && /tmp/pkmem [1|2|3] */
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

/* A span's use: R rounds of decode-like arithmetic a code word (0: one add a word), then its scale word. */
template <int NV, int R> __device__ __forceinline__ void consume(const uint32_t *cw, uint32_t sw, float xv, float acc[4]) {
#pragma unroll
    for (int i = 0; i < 4 * NV; i++) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const uint32_t h = (cw[i] >> (2 * r)) & 0x00030003u | 0x43004300u;
            acc[(i + r) & 3] = __fmaf_rn(__uint_as_float(h), xv, acc[(i + r) & 3]);
        }
        if (R == 0) acc[i & 3] += __uint_as_float(cw[i] & 0x3f7fffffu);
    }
    acc[0] = __fmaf_rn(__uint_as_float(sw & 0x3f7fffffu), xv, acc[0]);
}

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
            for (int u = 0; u < T; u++) consume<NV, R>(buf[d][u].c, buf[d][u].s, xv, acc);
        }
    }
    const float v = acc[0] + acc[1] + acc[2] + acc[3];
    if (v == 1.2345f) out[wid * 32 + lane] = v; /* keeps the loads alive, never true in practice */
}

/* The plain read with J 16-byte loads in flight a thread (readj holds MINB blocks of 256 an SM with shared memory;
 * <8, 1> on 8 blocks an SM, no shared memory, is the reference read). */
template <int J, int MINB> __global__ void __launch_bounds__(256, MINB) readj_kernel(const uint4 *p, long long n, float *out) {
    uint32_t a = 0;
    const long long st = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += J * st) {
        uint4 v[J];
#pragma unroll
        for (int j = 0; j < J; j++) v[j] = i + j * st < n ? ldg16(p + i + j * st) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < J; j++) a ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    if (a == 0x12345678u) out[0] = (float)a;
}

/* The same walks (T = 1) through a per-warp shared-memory ring of S slots of C spans (tile-major: a tile's C spans are
 * C * rec contiguous bytes), each slot filled by one cp.async.bulk that lane 0 issues and an mbarrier counts. */
__device__ __forceinline__ uint32_t sm32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_wait(uint32_t b, uint32_t ph) {
    uint32_t ok = 0;
    while (!ok)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok) : "r"(b), "r"(ph) : "memory");
}
template <int NV, int C, int S, int R, int MINB>
__global__ void __launch_bounds__(256, MINB) bulk_kernel(Geo G, float *out) {
    extern __shared__ __align__(128) uint8_t sm[];
    constexpr int rec = 512 * NV + 128, slotb = C * rec;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint8_t *ring = sm + 1024 + warp * S * slotb;
    const uint32_t bar0 = sm32(sm + warp * 64);
    const int nw = gridDim.x * 8, wid = warp * gridDim.x + blockIdx.x;
    const int walks = G.tiles * G.parts, nsp = G.ns / G.parts, cpw = nsp / C;
    float acc[4] = {0, 0, 0, 0};
    const float xv = 1.0001f + lane * 1e-6f;
    const int nmine = walks > wid ? (walks - wid + nw - 1) / nw : 0, total = nmine * cpw;
    if (lane == 0)
        for (int s = 0; s < S; s++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * s));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    auto issue = [&](int j) {
        if (lane != 0) return;
        const int wk = wid + (j / cpw) * nw;
        const uint8_t *src = G.w + (long long)(wk / G.parts) * G.tstr + (long long)(wk % G.parts) * nsp * G.sstr +
                             (long long)(j % cpw) * C * G.sstr;
        const uint32_t b = bar0 + 8 * (j % S);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(slotb) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         sm32(ring + (j % S) * slotb)), "l"(src), "r"(slotb), "r"(b) : "memory");
    };
    for (int j = 0; j < S && j < total; j++) issue(j);
    for (int j = 0; j < total; j++) {
        bar_wait(bar0 + 8 * (j % S), (j / S) & 1);
        const uint8_t *slot = ring + (j % S) * slotb;
#pragma unroll
        for (int c = 0; c < C; c++) {
            uint32_t cw[4 * NV];
#pragma unroll
            for (int i = 0; i < NV; i++) {
                const uint4 v = *(const uint4 *)(slot + c * rec + 512 * i + 16 * lane);
                cw[4 * i] = v.x, cw[4 * i + 1] = v.y, cw[4 * i + 2] = v.z, cw[4 * i + 3] = v.w;
            }
            consume<NV, R>(cw, *(const uint32_t *)(slot + c * rec + 512 * NV + 4 * lane), xv, acc);
        }
        __syncwarp();
        if (j + S < total) issue(j + S);
    }
    const float v = acc[0] + acc[1] + acc[2] + acc[3];
    if (v == 1.2345f) out[wid * 32 + lane] = v;
}


static float median(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

static uint8_t *g_buf;
static int g_batch = 1;
static size_t g_bytes;
static float *g_out;
static int g_sms;

template <typename F> static float time_rot(size_t mbytes, F launch) {
    const int copies = (int)std::max<size_t>(1, (g_bytes - (1 << 20)) / mbytes);
    std::vector<float> t;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    for (int it = 0; it < 3; it++) launch(g_buf);
    for (int it = 0; it < 30; it++) { /* batches of g_batch launches between two events (1: one launch, host gap included) */
        CK(cudaEventRecord(a));
        for (int j = 0; j < g_batch; j++) launch(g_buf + (size_t)((it * g_batch + j) % copies) * mbytes);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms; CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms * 1000.f / g_batch);
    }
    CK(cudaGetLastError());
    CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
    return median(t);
}

static double g_peak;

/* Blocks of 256 an SM of kernel fn with smem bytes of dynamic shared memory (set as its attribute). */
static int blocks_an_sm(const void *fn, int smem) {
    int nb = 0;
    CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, 256, smem));
    return nb;
}

template <int NV, int D, int R, int MINB, int PF = 0, int T = 1> static void run(const char *shape, int tiles, int ns, int parts, int layout) {
    const int rec = 512 * NV + 128;
    Geo G;
    G.tiles = tiles, G.ns = ns, G.parts = parts, G.rec = rec;
    if (layout == 0) G.sstr = rec, G.tstr = (long long)ns * rec;
    else G.sstr = (long long)tiles * rec, G.tstr = rec;
    const size_t mbytes = (size_t)tiles * ns * rec, span = (size_t)tiles * (layout == 0 ? G.tstr : ns * rec);
    const int smem = (220 << 10) / MINB - 2048;
    const int nb = blocks_an_sm((const void *)walk_kernel<NV, D, R, MINB, PF, T>, smem);
    const int grid = nb * g_sms;
    const float us = time_rot(span, [&](const uint8_t *p) { Geo g = G; g.w = p; walk_kernel<NV, D, R, MINB, PF, T><<<grid, 256, smem>>>(g, g_out); });
    const double gbs = mbytes / (us * 1e3);
    printf("%-8s T %d PF %d rec %4d D %d R %d blk/SM %d parts %d layout %s: %7.1f us %7.1f GB/s %5.1f %%\n", shape, T, PF, rec, D, R,
           nb, parts, layout ? "span" : "tile", us, gbs, 100.0 * gbs / g_peak);
}

template <int NV, int C, int S, int R, int MINB = 2> static void bulk(const char *shape, int tiles, int ns, int parts) {
    const int rec = 512 * NV + 128;
    Geo G;
    G.tiles = tiles, G.ns = ns, G.parts = parts, G.rec = rec, G.sstr = rec, G.tstr = (long long)ns * rec;
    const size_t mbytes = (size_t)tiles * ns * rec;
    const int smem = 1024 + 8 * S * C * rec;
    const int nb = blocks_an_sm((const void *)bulk_kernel<NV, C, S, R, MINB>, smem);
    const int grid = nb * g_sms;
    const float us = time_rot(mbytes, [&](const uint8_t *p) { Geo g = G; g.w = p; bulk_kernel<NV, C, S, R, MINB><<<grid, 256, smem>>>(g, g_out); });
    const double gbs = mbytes / (us * 1e3);
    printf("%-8s bulk rec %4d C %d S %d (%5.1f KB a warp) R %d blk/SM %d parts %d: %7.1f us %7.1f GB/s %5.1f %%\n", shape, rec, C, S,
           S * C * rec / 1024.0, R, nb, parts, us, gbs, 100.0 * gbs / g_peak);
}

/* run and bulk at two blocks an SM, without (R 0) and with (R 2) the decode-like arithmetic */
template <int NV, int D, int T> static void run02(const char *shape, int tiles, int ns, int parts, int layout) {
    run<NV, D, 0, 2, 0, T>(shape, tiles, ns, parts, layout);
    run<NV, D, 2, 2, 0, T>(shape, tiles, ns, parts, layout);
}
template <int NV, int C, int S> static void bulk02(const char *shape, int tiles, int ns, int parts) {
    bulk<NV, C, S, 0>(shape, tiles, ns, parts);
    bulk<NV, C, S, 2>(shape, tiles, ns, parts);
}

template <int J, int MINB> static void readj() {
    const size_t pb = (size_t)1000 << 20;
    const int smem = (220 << 10) / MINB - 2048;
    const int nb = blocks_an_sm((const void *)readj_kernel<J, MINB>, smem);
    const float us = time_rot(pb, [&](const uint8_t *p) { readj_kernel<J, MINB><<<g_sms * nb, 256, smem>>>((const uint4 *)p, pb / 16, g_out); });
    const double gbs = pb / (us * 1e3);
    printf("read J %d blk/SM %d (%5.1f KB in flight an SM): %7.1f GB/s %5.1f %%\n", J, nb, nb * 256 * 16 * J / 1024.0, gbs, 100.0 * gbs / g_peak);
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

int main(int argc, char **argv) {
    const int sec = argc > 1 ? atoi(argv[1]) : 0; /* the header's sections */
    CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
    g_bytes = (size_t)1 << 30;
    CK(cudaMalloc(&g_buf, g_bytes));
    CK(cudaMemset(g_buf, 0x11, g_bytes));
    CK(cudaMalloc(&g_out, 1 << 24));
    const size_t pb = (size_t)1000 << 20;
    float us = time_rot(pb, [&](const uint8_t *p) { readj_kernel<8, 1><<<g_sms * 8, 256>>>((const uint4 *)p, pb / 16, g_out); });
    g_peak = pb / (us * 1e3);
    printf("read: %.1f us, %.1f GB/s (%d SMs)\n", us, g_peak, g_sms);
    if (sec == 2) { /* launches back to back, as keel bench stream times them: the plain read at the tile's sizes */
        g_batch = 10;
        for (size_t mb : {24, 48, 84, 110, 170, 256}) {
            const size_t b = mb << 20;
            float t = time_rot(b, [&](const uint8_t *p) { readj_kernel<8, 1><<<g_sms * 8, 256>>>((const uint4 *)p, b / 16, g_out); });
            printf("read %4zu MB back to back: %7.2f us, %7.1f GB/s %5.1f %% (floor %.2f us, over %.2f)\n", mb, t, b / (t * 1e3),
                   100.0 * b / (t * 1e3) / g_peak, b / (g_peak * 1e3), t - b / (g_peak * 1e3));
        }
        run<1, 3, 0, 2, 0, 2>("sq16k", 1024, 128, 4, 1); run<2, 3, 0, 2, 0, 2>("sq16k", 1024, 128, 4, 1);
        run<4, 2, 0, 2, 0, 1>("sq16k", 1024, 128, 2, 1);
        run<1, 3, 0, 2, 0, 2>("lm_head", 8192, 21, 1, 0); run<2, 3, 0, 2, 0, 2>("lm_head", 8192, 21, 1, 0);
        return 0;
    }
    if (sec == 3) { /* 4 and 8 bits, the register ring against the bulk ring, each without and with arithmetic */
        printf("-- 4 bits: register ring (two tiles a step, span-major), then bulk rings (tile-major)\n");
        run02<2, 2, 2>("sq16k", 1024, 128, 4, 1); run02<2, 3, 2>("sq16k", 1024, 128, 4, 1);
        bulk02<2, 4, 2>("sq16k", 1024, 128, 2); bulk02<2, 2, 4>("sq16k", 1024, 128, 2);
        bulk02<2, 4, 3>("sq16k", 1024, 128, 2);
        run02<2, 2, 2>("lm_head", 8192, 21, 1, 0); bulk02<2, 3, 3>("lm_head", 8192, 21, 1);
        printf("-- 8 bits: register ring (one tile a step, span-major), then bulk rings (tile-major)\n");
        run02<4, 2, 1>("sq16k", 1024, 128, 2, 1); run02<4, 3, 1>("sq16k", 1024, 128, 2, 1);
        bulk02<4, 2, 3>("sq16k", 1024, 128, 2); bulk02<4, 1, 6>("sq16k", 1024, 128, 2);
        bulk02<4, 4, 2>("sq16k", 1024, 128, 2);
        run02<4, 2, 1>("lm_head", 8192, 21, 1, 0); bulk02<4, 3, 2>("lm_head", 8192, 21, 1);
        return 0;
    }
    if (sec == 1) {
        printf("-- plain read: bytes in flight an SM\n");
        readj<1, 2>(); readj<2, 2>(); readj<4, 2>(); readj<8, 2>(); readj<1, 4>(); readj<2, 4>(); readj<4, 4>();
        readj<1, 8>(); readj<2, 8>(); readj<4, 8>();
        printf("-- register ring, for reference (R 0 and 2)\n");
        run<1, 3, 0, 2, 0, 1>("sq16k", 1024, 128, 2, 0); run<1, 3, 2, 2, 0, 1>("sq16k", 1024, 128, 2, 0);
        run<1, 3, 0, 2, 0, 2>("sq16k", 1024, 128, 4, 1); run<1, 3, 2, 2, 0, 2>("sq16k", 1024, 128, 4, 1);
        run<2, 3, 0, 2, 0, 2>("sq16k", 1024, 128, 4, 1); run<2, 3, 2, 2, 0, 2>("sq16k", 1024, 128, 4, 1);
        run<1, 3, 0, 2, 0, 2>("lm_head", 8192, 21, 1, 0); run<1, 3, 2, 2, 0, 2>("lm_head", 8192, 21, 1, 0);
        printf("-- bulk ring (tile-major), 2 bits\n");
        bulk<1, 4, 4, 0>("sq16k", 1024, 128, 2); bulk<1, 4, 4, 2>("sq16k", 1024, 128, 2);
        bulk<1, 8, 2, 0>("sq16k", 1024, 128, 2); bulk<1, 2, 8, 0>("sq16k", 1024, 128, 2); bulk<1, 2, 8, 2>("sq16k", 1024, 128, 2);
        bulk<1, 4, 5, 0>("sq16k", 1024, 128, 2); bulk<1, 4, 5, 2>("sq16k", 1024, 128, 2);
        bulk<1, 4, 3, 0>("sq16k", 1024, 128, 2); bulk<1, 4, 2, 0>("sq16k", 1024, 128, 2);
        bulk<1, 4, 4, 0>("sq16k", 1024, 128, 4); bulk<1, 4, 4, 2>("sq16k", 1024, 128, 4);
        bulk<1, 3, 5, 0>("lm_head", 8192, 21, 1); bulk<1, 3, 5, 2>("lm_head", 8192, 21, 1); bulk<1, 7, 2, 0>("lm_head", 8192, 21, 1);
        printf("-- bulk ring, 4 and 8 bits\n");
        bulk<2, 4, 2, 0>("sq16k", 1024, 128, 2); bulk<2, 4, 2, 2>("sq16k", 1024, 128, 2); bulk<2, 2, 5, 0>("sq16k", 1024, 128, 2);
        bulk<2, 2, 5, 2>("sq16k", 1024, 128, 2); bulk<2, 3, 3, 0>("lm_head", 8192, 21, 1);
        bulk<4, 2, 3, 0>("sq16k", 1024, 128, 2); bulk<4, 1, 6, 0>("sq16k", 1024, 128, 2); bulk<4, 3, 2, 0>("lm_head", 8192, 21, 1);
        return 0;
    }
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
