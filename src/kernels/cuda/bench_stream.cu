/* `keel bench stream`: times the stream tiles on Nemotron 3 Nano's real shapes against the chip's read bandwidth
 * (a plain streaming-read kernel, measured in the same run) and cuBLAS bf16 (cublasGemmEx). Every launch reads
 * from DRAM: weight copies are rotated so that they total more than 4x the L2. Medians of CUDA-event times. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "cuda.h"
#include "port.h"
#if !defined(__HIPCC__) /* the cuBLAS comparison is CUDA-only */
#include <cublas_v2.h>
#define KEEL_BENCH_CUBLAS 1
#endif

#define KEEL_CUBLAS_CHECK(call)                                                                    \
    do {                                                                                           \
        cublasStatus_t kb_s_ = (call);                                                             \
        if (kb_s_ != CUBLAS_STATUS_SUCCESS) keel_panic(__FILE__, __LINE__, "%s: status %d", #call, (int)kb_s_); \
    } while (0)

namespace {

__device__ __forceinline__ uint32_t hash32(uint64_t i, uint32_t seed) {
    uint64_t x = i * 0x9e3779b97f4a7c15ull + seed;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    return (uint32_t)x;
}

/* Random codes, small bf16 scales and biases, bf16 values in [-1, 1) (kind 0: words, 1: scales, 2: bias/x). */
__global__ void fill_kernel(uint32_t *w, size_t words, uint32_t seed, int kind) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = hash32(i, seed);
        if (kind == 0) {
            w[i] = h;
        } else {
            float a = kind == 1 ? 0.001f + 0.004f * (float)(h & 0xffff) / 65536.f : ((float)(h & 0xffff) / 32768.f - 1.f);
            float b = kind == 1 ? 0.001f + 0.004f * (float)(h >> 16) / 65536.f : ((float)(h >> 16) / 32768.f - 1.f);
            w[i] = (uint32_t)kp_f32_to_bf16(a) | (uint32_t)kp_f32_to_bf16(b) << 16;
        }
    }
}

__global__ void read_kernel(const uint4 *p, size_t n, uint32_t *out) {
    uint32_t acc = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = kp_ld_stream16(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc; /* keeps the loads alive */
}

void fill(void *p, size_t bytes, uint32_t seed, int kind) {
    fill_kernel<<<1024, 256>>>((uint32_t *)p, bytes / 4, seed, kind);
    KEEL_CUDA_CHECK_LAUNCH();
}

struct Timer {
    cudaEvent_t a, b;
    Timer() {
        KEEL_CUDA_CHECK(cudaEventCreate(&a));
        KEEL_CUDA_CHECK(cudaEventCreate(&b));
    }
    ~Timer() {
        cudaEventDestroy(a);
        cudaEventDestroy(b);
    }
};

/* Median microseconds per launch of f(i): `reps` samples, each a batch of kBatch launches between two events,
 * so that host launch overhead (about 17 us per event-wrapped launch on the device VM) stays out. */
const int kBatch = 10;
template <class F> double median_us(int reps, F f) {
    for (int i = 0; i < 3; i++) f(i);
    std::vector<cudaEvent_t> ev(2 * reps);
    for (auto &e : ev) KEEL_CUDA_CHECK(cudaEventCreate(&e));
    for (int i = 0; i < reps; i++) {
        KEEL_CUDA_CHECK(cudaEventRecord(ev[2 * i]));
        for (int j = 0; j < kBatch; j++) f(i * kBatch + j);
        KEEL_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1]));
    }
    KEEL_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> t(reps);
    for (int i = 0; i < reps; i++) {
        float ms = 0;
        KEEL_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
        t[i] = ms * 1000.0 / kBatch;
    }
    for (auto &e : ev) cudaEventDestroy(e);
    std::sort(t.begin(), t.end());
    return t[reps / 2];
}

const size_t kRotateBytes = 256ull << 20; /* > 4 x 60 MB of L2 */

double g_read_gbs = 0;
#if defined(KEEL_BENCH_CUBLAS)
cublasHandle_t g_blas;
#endif

struct Shape {
    const char *name;
    int n, k;
};

/* Packed matrices (copies rotated), bytes per launch, and the launch. */
struct Packed {
    std::vector<keel_cuda_qw> w;
    std::vector<void *> mem;
    size_t bytes = 0; /* codes + scales + biases of one copy */
    void make(int n, int k, int bits, int group, int experts, size_t min_total) {
        size_t cw = (size_t)experts * n * ((size_t)k * bits / 32) * 4, sb = (size_t)experts * n * (k / group) * 2;
        bytes = cw + 2 * sb;
        int copies = (int)std::max<size_t>(2, (min_total + bytes - 1) / bytes);
        for (int c = 0; c < copies; c++) {
            void *a = keel_cuda_malloc(cw), *s = keel_cuda_malloc(sb), *b = keel_cuda_malloc(sb);
            fill(a, cw, 17u + c, 0);
            fill(s, sb, 91u + c, 1);
            fill(b, sb, 333u + c, 2);
            keel_cuda_qw q = {};
            q.w = (const uint32_t *)a;
            q.scales = s;
            q.biases = b;
            q.n = n;
            q.k = k;
            q.bits = bits;
            q.group = group;
            q.sdt = KEEL_DT_BF16;
            q.expert_words = (int64_t)n * k * bits / 32;
            q.expert_groups = (int64_t)n * (k / group);
            w.push_back(q);
            mem.push_back(a);
            mem.push_back(s);
            mem.push_back(b);
        }
    }
    /* The packed tile's copies of the same matrices; false (with the reason) if it has none. */
    std::vector<keel_cuda_pw> pw;
    bool pack(char *why, size_t cap) {
        for (const keel_cuda_qw &q : w) {
            keel_cuda_pw o;
            if (!keel_cuda_pack_upload_qw(&q, &o, why, cap)) return false;
            mem.push_back((void *)o.w);
            pw.push_back(o);
        }
        return true;
    }
    ~Packed() {
        for (void *p : mem) keel_cuda_free(p);
    }
};

/* Median us of cuBLAS bf16 y = W x (0 where there is no cuBLAS). */
double cublas_us(int n, int k, int m, const void *x, float *y) {
#if !defined(KEEL_BENCH_CUBLAS)
    (void)n, (void)k, (void)m, (void)x, (void)y;
    return 0;
#else
    size_t bytes = (size_t)n * k * 2;
    int copies = (int)std::max<size_t>(2, (kRotateBytes + bytes - 1) / bytes);
    std::vector<void *> w(copies);
    for (int c = 0; c < copies; c++) {
        w[c] = keel_cuda_malloc(bytes);
        fill(w[c], bytes, 7u + c, 2);
    }
    const float one = 1.f, zero = 0.f;
    double us = median_us(10, [&](int i) {
        KEEL_CUBLAS_CHECK(cublasGemmEx(g_blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w[i % copies], CUDA_R_16BF, k,
                                       x, CUDA_R_16BF, k, &zero, y, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT));
    });
    for (void *p : w) keel_cuda_free(p);
    return us;
#endif
}

/* One table row; floor_us is the bytes at the read bandwidth, the time no launch can beat. */
void row(const char *name, int bits, int group, int m, double us, double bytes, double blas) {
    double gbs = bytes / us / 1e3;
    printf("%-14s %2d %4d %2d %10.2f %9.2f %9.1f %6.1f%%", name, bits, group, m, us, bytes / g_read_gbs / 1e3, gbs,
           100.0 * gbs / g_read_gbs);
    if (blas > 0)
        printf(" %10.2f %7.2fx\n", blas, us / blas);
    else
        printf(" %10s %8s\n", "-", "-");
    fflush(stdout);
}

/* Whether `name` is one of the comma-separated names of `list`. */
bool listed(const char *list, const char *name) {
    const size_t n = strlen(name);
    for (const char *c = list; *c;) {
        const char *e = strchr(c, ',');
        const size_t len = e ? (size_t)(e - c) : strlen(c);
        if (len == n && !strncmp(c, name, n)) return true;
        if (!e) break;
        c = e + 1;
    }
    return false;
}

} // namespace

extern "C" const void *keel_cuda_bench_kernel_fn(const char *symbol) {
    if (symbol && !strcmp(symbol, "fill_kernel")) return (const void *)fill_kernel;
    if (symbol && !strcmp(symbol, "read_kernel")) return (const void *)read_kernel;
    return NULL;
}

/* Blocks of each 4-bit/8-bit tile an SM holds (after a launch has set the tile's shared-memory attribute). */
static void print_occupancy(void) {
    printf("blocks per SM:");
    for (int bits : {2, 3, 4, 5, 6, 8}) {
        char sym[48];
        snprintf(sym, sizeof sym, "stream_tile<%d,false>", bits);
        int nb = 0;
        const void *fn = keel_cuda_kernel_fn(sym);
        if (fn && cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, 128, 65536) == cudaSuccess)
            printf(" %d-bit %d", bits, nb);
        else
            cudaGetLastError();
    }
    printf("\n");
}

/* The scheduling knobs (keel_cuda_stream_tune) on the large shapes: us per launch for each (L2 256-byte blocks,
 * ring depth cap), and the tile with its arithmetic left out (memory alone) or its weight copies left out
 * (arithmetic alone). Returns the knobs fastest on 4-bit lm_head at m = 1, which the table then uses. */
static void sweep(void *x, float *y, int best_cfg[2]) {
    const int cfg[][3] = {{1, 8, 0}, {0, 8, 0}, {1, 3, 0}, {0, 3, 0}, {1, 2, 0}, {0, 2, 0}, {1, 8, 1}, {1, 8, 2}};
    const int ncfg = (int)(sizeof cfg / sizeof cfg[0]);
    printf("sweep: us per launch at (L2 256-byte blocks, ring depth cap, diag: 1 memory alone, 2 arithmetic alone)\n"
           "%-14s %2s %2s", "shape", "b", "m");
    for (int c = 0; c < ncfg; c++) printf("   (%d,%d,%d)", cfg[c][0], cfg[c][1], cfg[c][2]);
    printf("\n");
    const Shape shapes[] = {{"lm_head", 131072, 2688}, {"square16k", 16384, 16384}};
    for (const Shape &sh : shapes)
        for (int bits : {2, 3, 4, 5, 8}) {
            Packed P;
            P.make(sh.n, sh.k, bits, 64, 1, kRotateBytes);
            const size_t copies = P.w.size();
            for (int m : {1, 8}) {
                printf("%-14s %2d %2d", sh.name, bits, m);
                double best = 1e30;
                for (int c = 0; c < ncfg; c++) {
                    keel_cuda_stream_tune(cfg[c][0], cfg[c][1]);
                    keel_cuda_stream_diag(cfg[c][2]);
                    double us = median_us(5, [&](int i) {
                        keel_cuda_stream_matmul(&P.w[i % copies], x, KEEL_DT_BF16, m, y, KEEL_DT_F32, KEEL_EPI_NONE,
                                                NULL);
                    });
                    if (!cfg[c][2] && us < best) {
                        best = us;
                        if (bits == 4 && m == 1 && sh.n == 131072) best_cfg[0] = cfg[c][0], best_cfg[1] = cfg[c][1];
                    }
                    printf(" %10.2f", us);
                }
                const double bytes = (double)P.bytes + (double)m * sh.k * 2 + (double)m * sh.n * 4;
                printf("   best %.1f%% of read\n", 100.0 * bytes / best / 1e3 / g_read_gbs);
                fflush(stdout);
            }
        }
    keel_cuda_stream_diag(0);
}

extern "C" int keel_cuda_bench_stream(int argc, char **argv) {
    bool quick = false, do_sweep = false, table = true, packed = true;
    const char *only = NULL; /* comma-separated shape names (also "experts", "rows"); NULL: all */
    unsigned bits_mask = 0;  /* bit b: width b only; 0: all */
    std::vector<std::pair<int, int>> dims; /* --dims: (n, k) shapes run instead of the named ones */
    std::vector<int> xbudgets = {0}; /* the packed rows at the default budget (0), then at each --xbudget (bytes) */
    int tune_l2 = -1, tune_st = -1, prefetch = KEEL_CUDA_STREAM_PREFETCH_DEFAULT, pdl = 0,
        split_q = KEEL_CUDA_STREAM_SPLIT_TARGET_DEFAULT;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--quick")) {
            quick = true;
        } else if (!strcmp(argv[a], "--packed") && a + 1 < argc && (!strcmp(argv[a + 1], "on") || !strcmp(argv[a + 1], "off"))) {
            packed = !strcmp(argv[++a], "on");
        } else if (!strcmp(argv[a], "--sweep")) {
            do_sweep = true;
        } else if (!strcmp(argv[a], "--sweep-only")) {
            do_sweep = true, table = false;
        } else if (!strcmp(argv[a], "--prefetch") && a + 1 < argc && sscanf(argv[a + 1], "%d", &prefetch) == 1) {
            a++;
        } else if (!strcmp(argv[a], "--split-target") && a + 1 < argc && sscanf(argv[a + 1], "%d", &split_q) == 1) {
            a++;
        } else if (!strcmp(argv[a], "--shapes") && a + 1 < argc) {
            only = argv[++a];
        } else if (!strcmp(argv[a], "--dims") && a + 1 < argc) {
            for (const char *c = argv[++a]; *c;) {
                int n = 0, k = 0, used = 0;
                if (sscanf(c, "%d:%d%n", &n, &k, &used) != 2 || n < 1 || n > 131072 || k < 128 || k > 16384 || k % 128 ||
                    (c[used] && c[used] != ',')) {
                    fprintf(stderr, "keel bench stream: --dims '%s': expected N:K[,N:K...] with N in 1..131072 and K a "
                                    "multiple of 128 in 128..16384\n", argv[a]);
                    return 2;
                }
                dims.push_back({n, k});
                c += used + (c[used] == ',');
            }
        } else if (!strcmp(argv[a], "--bits") && a + 1 < argc) {
            for (const char *c = argv[++a]; *c; c++) {
                if (*c == ',') continue;
                if (*c < '2' || *c > '8' || *c == '7' || (c[1] && c[1] != ',')) {
                    fprintf(stderr, "keel bench stream: --bits '%s': expected a comma list of 2, 3, 4, 5, 6, 8\n", argv[a]);
                    return 2;
                }
                bits_mask |= 1u << (*c - '0');
            }
        } else if (!strcmp(argv[a], "--pdl")) {
            pdl = 1;
        } else if (!strcmp(argv[a], "--split-round") && a + 1 < argc && (!strcmp(argv[a + 1], "up") || !strcmp(argv[a + 1], "down"))) {
            keel_cuda_stream_split_round(!strcmp(argv[++a], "down"));
        } else if (!strcmp(argv[a], "--split-long") && a + 1 < argc && (!strcmp(argv[a + 1], "on") || !strcmp(argv[a + 1], "off"))) {
            keel_cuda_stream_split_long(!strcmp(argv[++a], "on"));
        } else if (!strcmp(argv[a], "--tune") && a + 1 < argc && sscanf(argv[a + 1], "%d,%d", &tune_l2, &tune_st) == 2) {
            a++;
        } else if (!strcmp(argv[a], "--xbudget") && a + 1 < argc) {
            for (const char *c = argv[++a]; *c;) {
                char *end = (char *)c + 4;
                long v = strncmp(c, "auto", 4) ? strtol(c, &end, 10) : KEEL_CUDA_PACKED_XBUDGET_AUTO;
                if (end == c || v == 0 || v < -1 || v > 1024 || (*end && (*end != ',' || !end[1]))) {
                    fprintf(stderr, "keel bench stream: --xbudget '%s': expected a comma list of KiB or auto (e.g. "
                                    "48,96,auto)\n", argv[a]);
                    return 2;
                }
                xbudgets.push_back(v < 0 ? (int)v : (int)v * 1024);
                c = *end ? end + 1 : end;
            }
        } else {
            fprintf(stderr, "keel bench stream: unknown option '%s' (expected --quick, --sweep, --sweep-only, "
                            "--tune L2BLOCK,STAGES, --packed on|off, --prefetch S, --pdl, --split-target Q, --split-long on|off, --split-round up|down, --shapes A,B, --dims N:K,N:K, --bits B,B, --xbudget KIB,KIB)\n", argv[a]);
            return 2;
        }
    }
    if (tune_l2 >= 0 && !keel_cuda_stream_tune(tune_l2, tune_st)) {
        fprintf(stderr, "keel bench stream: --tune %d,%d out of range (0..1, 2..8)\n", tune_l2, tune_st);
        return 2;
    }
    for (int xb : xbudgets)
        if (keel_cuda_device_count() > 0 && !keel_cuda_packed_xbudget(xb)) {
            fprintf(stderr, "keel bench stream: --xbudget %d KiB: the packed tile takes %d KiB up to what one block of "
                            "this device may use, in whole KiB\n", xb / 1024, KEEL_CUDA_PACKED_XBYTES_MIN / 1024);
            return 2;
        }
    keel_cuda_packed_xbudget(0);
    if (!keel_cuda_stream_prefetch(prefetch)) {
        fprintf(stderr, "keel bench stream: --prefetch %d out of range (0..64 stages)\n", prefetch);
        return 2;
    }
    if (!keel_cuda_stream_split_target(split_q)) {
        fprintf(stderr, "keel bench stream: --split-target %d out of range (1..64)\n", split_q);
        return 2;
    }
    /* one launch at a time unless asked: with programmatic dependents a launch overlaps the next one's start */
    keel_cuda_stream_pdl(pdl);
    if (keel_cuda_device_count() < 1) {
        fprintf(stderr, "keel bench stream: no CUDA device\n");
        return 1;
    }
    char dev[256];
    keel_cuda_device_name(dev, sizeof dev);
#if defined(KEEL_BENCH_CUBLAS)
    KEEL_CUBLAS_CHECK(cublasCreate(&g_blas));
#endif

    /* the chip's read bandwidth: a plain 16-byte streaming read of 4 GiB */
    {
        size_t bytes = 4ull << 30;
        void *p = keel_cuda_malloc(bytes);
        uint32_t *o = (uint32_t *)keel_cuda_malloc(4);
        fill(p, bytes, 5u, 0);
        double us = median_us(20, [&](int) {
            read_kernel<<<132 * 16, 512>>>((const uint4 *)p, bytes / 16, o);
            KEEL_CUDA_CHECK_LAUNCH();
        });
        g_read_gbs = bytes / us / 1e3;
        keel_cuda_free(p);
        keel_cuda_free(o);
    }
    printf("device: %s\nread bandwidth (plain streaming read, 4 GiB): %.0f GB/s\n", dev, g_read_gbs);
    printf("stream tiles: L2 prefetch chunk %d stages, programmatic dependent launch %s, k-split target %d/4 blocks an SM\n",
           prefetch, pdl ? "on" : "off", split_q);
    void *x = keel_cuda_malloc((size_t)8 * 16384 * 2);
    fill(x, (size_t)8 * 16384 * 2, 3u, 2);
    float *y = (float *)keel_cuda_malloc((size_t)8 * 131072 * 4);
    if (do_sweep) {
        int best[2] = {-1, -1};
        sweep(x, y, best);
        print_occupancy();
        if (tune_l2 < 0) tune_l2 = best[0], tune_st = best[1];
        keel_cuda_stream_tune(tune_l2, tune_st); /* the sweep's best, or the --tune values */
        printf("table knobs: L2 256-byte blocks %d, ring depth cap %d\n", tune_l2, tune_st);
    }
    if (!table) {
        keel_cuda_free(x);
        keel_cuda_free(y);
#if defined(KEEL_BENCH_CUBLAS)
        cublasDestroy(g_blas);
#endif
        return 0;
    }
    /* launch overhead: a launch that does nothing (read_kernel over no words), timed like every row below */
    {
        uint32_t *o = (uint32_t *)keel_cuda_malloc(4);
        const int sms = keel_cuda_sm_count();
        const double one = median_us(20, [&](int) {
            read_kernel<<<1, 32>>>((const uint4 *)x, 0, o);
            KEEL_CUDA_CHECK_LAUNCH();
        });
        const double wave = median_us(20, [&](int) {
            read_kernel<<<(unsigned)(2 * sms), 128>>>((const uint4 *)x, 0, o);
            KEEL_CUDA_CHECK_LAUNCH();
        });
        printf("launch overhead (an empty kernel, %d back-to-back launches per event pair): %.2f us at 1 block, "
               "%.2f us at %d blocks of 128", kBatch, one, wave, 2 * sms);
#if !defined(__HIPCC__) /* the engine decodes through CUDA graphs: the same empty launches captured in one */
        cudaStream_t cs;
        cudaGraph_t g;
        cudaGraphExec_t ge;
        KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
        KEEL_CUDA_CHECK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
        for (int j = 0; j < kBatch; j++) read_kernel<<<(unsigned)(2 * sms), 128, 0, cs>>>((const uint4 *)x, 0, o);
        KEEL_CUDA_CHECK(cudaStreamEndCapture(cs, &g));
        KEEL_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
        const double graph = median_us(20, [&](int) { KEEL_CUDA_CHECK(cudaGraphLaunch(ge, 0)); }) / kBatch;
        KEEL_CUDA_CHECK(cudaGraphExecDestroy(ge));
        KEEL_CUDA_CHECK(cudaGraphDestroy(g));
        KEEL_CUDA_CHECK(cudaStreamDestroy(cs));
        printf("; %.2f us at %d blocks inside a CUDA graph", graph, 2 * sms);
#endif
        printf("\n");
        keel_cuda_free(o);
    }
    printf("bytes per launch = packed words + scales + biases + x + y; floor_us = bytes / read bandwidth; medians of "
           "CUDA-event times\n\n");
    printf("%-14s %2s %4s %2s %10s %9s %9s %7s %10s %8s\n", "shape", "b", "grp", "m", "us", "floor_us", "GB/s", "%read",
           "cublas_us", "vs_cublas");

    std::vector<Shape> shapes = {{"lm_head", 131072, 2688}, {"square16k", 16384, 16384}, {"in_proj", 10304, 2688},
                                 {"out_proj", 2688, 4096}, {"q_proj", 4096, 2688},       {"k_proj", 256, 2688},
                                 {"v_proj", 256, 2688},    {"o_proj", 2688, 4096},       {"shared_up", 3712, 2688},
                                 {"shared_down", 2688, 3712}};
    std::vector<std::string> dim_names(dims.size()); /* --dims: only these shapes (named NxK), nothing else */
    if (!dims.empty()) shapes.clear();
    for (size_t i = 0; i < dims.size(); i++) {
        dim_names[i] = std::to_string(dims[i].first) + "x" + std::to_string(dims[i].second);
        shapes.push_back({dim_names[i].c_str(), dims[i].first, dims[i].second});
    }
    const bool named = dims.empty(); /* the named table: --shapes and --quick choose from it */
    const int bits_list[] = {2, 3, 4, 5, 6, 8};
    const int ms[] = {1, 8};
    int reps = quick ? 5 : 20;

    for (const Shape &s : shapes) {
        if (named && (only ? !listed(only, s.name)
                           : quick && strcmp(s.name, "lm_head") && strcmp(s.name, "square16k") && strcmp(s.name, "q_proj")))
            continue;
        double blas[2] = {cublas_us(s.n, s.k, 1, x, y), cublas_us(s.n, s.k, 8, x, y)};
        for (int bits : bits_list) {
            if (bits_mask && !(bits_mask >> bits & 1u)) continue;
            std::vector<int> groups = {64};
            if (!strcmp(s.name, "square16k")) groups = {32, 64, 128};
            for (int group : groups) {
                Packed P;
                P.make(s.n, s.k, bits, group, 1, kRotateBytes);
                for (int mi = 0; mi < 2; mi++) {
                    int m = ms[mi];
                    size_t copies = P.w.size();
                    double us = median_us(reps, [&](int i) {
                        keel_cuda_stream_matmul(&P.w[i % copies], x, KEEL_DT_BF16, m, y, KEEL_DT_F32, KEEL_EPI_NONE,
                                                NULL);
                    });
                    double bytes = (double)P.bytes + (double)m * s.k * 2 + (double)m * s.n * 4;
                    row(s.name, bits, group, m, us, bytes, blas[mi]);
                    if (!packed) continue;
                    if (P.pw.empty()) {
                        char why[256];
                        if (!P.pack(why, sizeof why)) {
                            printf("  packed: %s\n", why);
                            continue;
                        }
                    }
                    /* the packed tile: its bits against the ring tile's (equal where neither splits k) */
                    std::vector<float> a((size_t)m * s.n), b((size_t)m * s.n);
                    keel_cuda_stream_matmul(&P.w[0], x, KEEL_DT_BF16, m, y, KEEL_DT_F32, KEEL_EPI_NONE, NULL);
                    keel_cuda_download(a.data(), y, a.size() * 4);
                    keel_cuda_stream_matmul_packed(&P.pw[0], x, KEEL_DT_BF16, m, y, KEEL_DT_F32, KEEL_EPI_NONE, NULL);
                    keel_cuda_download(b.data(), y, b.size() * 4);
                    size_t diff = 0;
                    for (size_t i = 0; i < a.size(); i++) diff += memcmp(&a[i], &b[i], 4) != 0;
                    for (int xb : xbudgets) {
                        keel_cuda_packed_xbudget(xb);
                        /* the budget schedules, never sums: its bits must be the default budget's */
                        size_t xdiff = 0;
                        if (xb) {
                            keel_cuda_stream_matmul_packed(&P.pw[0], x, KEEL_DT_BF16, m, y, KEEL_DT_F32, KEEL_EPI_NONE,
                                                           NULL);
                            keel_cuda_download(a.data(), y, a.size() * 4);
                            for (size_t i = 0; i < a.size(); i++) xdiff += memcmp(&a[i], &b[i], 4) != 0;
                        }
                        double pus = median_us(reps, [&](int i) {
                            keel_cuda_stream_matmul_packed(&P.pw[i % copies], x, KEEL_DT_BF16, m, y, KEEL_DT_F32,
                                                           KEEL_EPI_NONE, NULL);
                        });
                        char nm[48];
                        if (xb < 0)
                            snprintf(nm, sizeof nm, "%s/packed@auto", s.name);
                        else if (xb)
                            snprintf(nm, sizeof nm, "%s/packed@%dK", s.name, xb / 1024);
                        else
                            snprintf(nm, sizeof nm, "%s/packed", s.name);
                        row(nm, bits, group, m, pus, bytes, blas[mi]);
                        if (xb)
                            printf("  packed at an x budget of %s: %.2fx the ring tile's time; %zu of %zu outputs "
                                   "differ in bits from the default budget's\n", nm + strlen(s.name) + 8, pus / us,
                                   xdiff, a.size());
                        else
                            printf("  packed vs ring tile: %.2fx the time; %zu of %zu outputs differ in bits (k-split: "
                                   "ring tile %d, packed %d)\n", pus / us, diff, a.size(),
                                   keel_cuda_stream_splits(s.n, s.k, 0), keel_cuda_packed_splits(s.n, s.k));
                    }
                    keel_cuda_packed_xbudget(0);
                }
            }
        }
    }

    /* routed experts: 128 experts stacked, fc1 1856x2688 (relu^2) then fc2 2688x1856, 6 per token */
    if (named && (!only || listed(only, "experts"))) {
        const int E = 128, inter = 1856, hid = 2688, topk = 6;
        void *h = keel_cuda_malloc((size_t)E * 8 * inter * 2);
        keel_cuda_route *items = (keel_cuda_route *)keel_cuda_malloc(E * sizeof(keel_cuda_route));
        float *wts = (float *)keel_cuda_malloc((size_t)E * 8 * sizeof(float));
        std::vector<float> hw((size_t)E * 8, 0.1f);
        keel_cuda_upload(wts, hw.data(), hw.size() * sizeof(float));
        for (int bits : bits_list) {
            if (bits_mask ? !(bits_mask >> bits & 1u) : quick && bits != 4) continue;
            Packed up, down;
            up.make(inter, hid, bits, 64, E, 0);
            down.make(hid, inter, bits, 64, E, 0);
            for (auto &q : up.w) q.items = topk; /* the stacks' launch-width hint, as the engine gives them */
            for (auto &q : down.w) q.items = topk;
            for (int m : ms) {
                /* token r picks experts (r * 37 + j * 11) % E: distinct per token, overlapping across tokens */
                std::vector<uint32_t> mask(E, 0);
                for (int r = 0; r < m; r++)
                    for (int j = 0; j < topk; j++) mask[(r * 37 + j * 11) % E] |= 1u << r;
                std::vector<keel_cuda_route> it;
                for (int e = 0; e < E; e++)
                    if (mask[e]) it.push_back({e, mask[e]});
                int ni = (int)it.size();
                keel_cuda_upload(items, it.data(), ni * sizeof(keel_cuda_route));
                double ebytes_up = (double)up.bytes / E * ni, ebytes_dn = (double)down.bytes / E * ni;
                size_t cu = up.w.size();
                double us_up = median_us(reps, [&](int i) {
                    keel_cuda_stream_experts_up(&up.w[i % cu], x, KEEL_DT_BF16, m, items, ni, h, KEEL_DT_BF16,
                                                KEEL_EPI_RELU2, NULL);
                });
                double us_dn = median_us(reps, [&](int i) {
                    keel_cuda_stream_experts_down(&down.w[i % cu], h, KEEL_DT_BF16, m, items, wts, ni, y, KEEL_DT_F32,
                                                  NULL);
                });
                /* the same fc1 as separate launches, one per selected expert */
                double us_sep = median_us(reps, [&](int i) {
                    for (int j = 0; j < ni; j++) {
                        keel_cuda_qw one = up.w[i % cu];
                        one.items = 0; /* one matrix */
                        one.w += (size_t)it[j].expert * one.expert_words;
                        one.scales = (const uint16_t *)one.scales + (size_t)it[j].expert * one.expert_groups;
                        one.biases = (const uint16_t *)one.biases + (size_t)it[j].expert * one.expert_groups;
                        keel_cuda_stream_matmul(&one, x, KEEL_DT_BF16, m, (uint16_t *)h + (size_t)j * m * inter,
                                                KEEL_DT_BF16, KEEL_EPI_RELU2, NULL);
                    }
                });
                char nm[32];
                snprintf(nm, sizeof nm, "experts_fc1x%d", ni);
                row(nm, bits, 64, m, us_up, ebytes_up + m * hid * 2.0 + (double)ni * m * inter * 2, 0);
                snprintf(nm, sizeof nm, "experts_fc2x%d", ni);
                row(nm, bits, 64, m, us_dn, ebytes_dn + (double)ni * m * inter * 2 + m * hid * 4.0, 0);
                printf("%-14s %2d %4d %2d %10.2f   (%d separate fc1 launches; routed tile is %.2fx faster)\n",
                       "  separate", bits, 64, m, us_sep, ni, us_sep / us_up);
            }
        }
        keel_cuda_free(h);
        keel_cuda_free(items);
        keel_cuda_free(wts);
    }
    /* the prompt path: many rows in one launch (8-row groups as grid items) against cuBLAS bf16 */
    if (named && (!only || listed(only, "rows"))) {
        const Shape rs[] = {{"in_proj", 10304, 2688}, {"square16k", 16384, 16384}};
        void *xr = keel_cuda_malloc((size_t)256 * 16384 * 2);
        fill(xr, (size_t)256 * 16384 * 2, 5u, 2);
        float *yr = (float *)keel_cuda_malloc((size_t)256 * 16384 * 4);
        for (const Shape &s : rs)
            for (int m : {64, 256}) {
                if (quick && m == 64) continue;
                Packed P;
                P.make(s.n, s.k, 4, 64, 1, kRotateBytes);
                const size_t copies = P.w.size();
                double us = median_us(reps, [&](int i) {
                    keel_cuda_stream_matmul_rows(&P.w[i % copies], xr, KEEL_DT_BF16, m, yr, KEEL_DT_F32,
                                                 KEEL_EPI_NONE, NULL);
                });
                char nm[32];
                snprintf(nm, sizeof nm, "rows:%s", s.name);
                row(nm, 4, 64, m, us, (double)P.bytes + (double)m * s.k * 2 + (double)m * s.n * 4,
                    cublas_us(s.n, s.k, m, xr, yr));
            }
        keel_cuda_free(xr);
        keel_cuda_free(yr);
    }
    printf("k-split per shape:");
    for (const Shape &s : shapes) printf(" %s %d", s.name, keel_cuda_stream_splits(s.n, s.k, 1));
    printf(" experts_fc1 %d experts_fc2 %d (stacks of top-6 launches)\n", keel_cuda_stream_splits(1856, 2688, 6),
           keel_cuda_stream_splits(2688, 1856, 6));
    print_occupancy();
    keel_cuda_free(x);
    keel_cuda_free(y);
#if defined(KEEL_BENCH_CUBLAS)
    cublasDestroy(g_blas);
#endif
    return 0;
}

/* The chip's read bandwidth in GB/s, as `keel bench stream` measures it (median of 10 reads of 1 GiB). */
extern "C" double keel_cuda_read_gbs(void) {
    const size_t bytes = 1ull << 30;
    void *p = keel_cuda_malloc(bytes);
    uint32_t *o = (uint32_t *)keel_cuda_malloc(4);
    fill(p, bytes, 5u, 0);
    int sms = 0, dev = 0;
    KEEL_CUDA_CHECK(cudaGetDevice(&dev));
    KEEL_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const double us = median_us(10, [&](int) {
        read_kernel<<<(unsigned)(sms * 16), 512>>>((const uint4 *)p, bytes / 16, o);
        KEEL_CUDA_CHECK_LAUNCH();
    });
    keel_cuda_free(p);
    keel_cuda_free(o);
    return (double)bytes / us / 1e3;
}
