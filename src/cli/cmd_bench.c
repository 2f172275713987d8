/* keel bench: kernel and decode benchmarks. `keel bench cpu` times the CPU stream tile against the machine's
 * plain streaming-read bandwidth measured in the same run with the same thread count. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "engine/engine.h"
#include "kernels/cpu/cpu.h"
#ifdef KEEL_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#endif

#define BENCH_GROUP 64
#define BENCH_MIN_REPS 3
#define BENCH_MAX_REPS 1000

static bool parse_double(const char *s, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) return false;
    *out = v;
    return true;
}

/* The last-level cache in bytes from sysfs (index3, else the highest index), or 32 MiB when unknown. */
static size_t l3_bytes(void) {
    size_t best = 0;
    for (int idx = 0; idx < 8; idx++) {
        char path[96];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", idx);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        unsigned long v = 0;
        char unit = 0;
        if (fscanf(f, "%lu%c", &v, &unit) >= 1) {
            size_t b = unit == 'K' ? v << 10 : unit == 'M' ? v << 20 : v;
            best = KEEL_MAX(best, b);
        }
        fclose(f);
    }
    return best ? best : (size_t)32 << 20;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* One threaded pass reading every byte of buf; the sum keeps the loads alive. */
static uint64_t read_pass(const uint64_t *buf, size_t words, int threads) {
    uint64_t total = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total)
    for (size_t i = 0; i < words; i += 4) total += buf[i] + buf[i + 1] + buf[i + 2] + buf[i + 3];
    return total;
}

typedef struct bench_cfg {
    int threads;
    double seconds;
    int k;
    int n; /* 0: sized per width so the packed matrix is at least 4x the last-level cache */
} bench_cfg;

/* Median seconds per call over at least BENCH_MIN_REPS repetitions filling `seconds`, after a warm-up. */
static double time_matmul(const keel_qmat *W, const float *x, int m, float *y, double seconds) {
    double t[BENCH_MAX_REPS];
    keel_cpu_matmul(W, x, m, y, KEEL_EPI_NONE);
    int reps = 0;
    const double start = keel_now();
    while (reps < BENCH_MAX_REPS && (reps < BENCH_MIN_REPS || keel_now() - start < seconds)) {
        const double t0 = keel_now();
        keel_cpu_matmul(W, x, m, y, KEEL_EPI_NONE);
        t[reps++] = keel_now() - t0;
    }
    return median(t, reps);
}

static int bench_cpu(const bench_cfg *cfg) {
    static const int widths[] = {2, 3, 4, 5, 6, 8};
    const size_t l3 = l3_bytes();
    const int k = cfg->k;
    int n_max = 0, n_of[KEEL_ARRAY_LEN(widths)];
    for (size_t i = 0; i < KEEL_ARRAY_LEN(widths); i++) {
        const size_t row = keel_quant_row_words(k, widths[i]) * 4u;
        size_t n = cfg->n ? (size_t)cfg->n : (KEEL_MAX((size_t)8192, (4 * l3 + row - 1) / row) + 63) / 64 * 64;
        n = KEEL_MIN(n, (size_t)1 << 24);
        n_of[i] = (int)n;
        n_max = KEEL_MAX(n_max, (int)n);
    }
    size_t words = 0, groups = (size_t)n_max * (size_t)(k / BENCH_GROUP);
    for (size_t i = 0; i < KEEL_ARRAY_LEN(widths); i++)
        words = KEEL_MAX(words, (size_t)n_of[i] * keel_quant_row_words(k, widths[i]));
    words = (words + 7) / 8 * 8; /* the read loop takes 4 u64 (8 words) at a time */
    const double need = (double)words * 4 + (double)groups * 4, phys = (double)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE);
    if (phys > 0 && need > phys) /* overcommit would hand it out and the fill would then exhaust the machine */
        return keel_cli_fail("bench", "cannot allocate %.1f MiB for the bench matrix (k %d, %d rows): the machine has "
                             "%.1f MiB", need / 1048576.0, k, n_max, phys / 1048576.0);
    uint32_t *w = malloc(words * 4);
    uint16_t *sc = malloc(groups * 2), *bi = malloc(groups * 2);
    float *x = malloc((size_t)8 * k * sizeof *x), *y = malloc((size_t)8 * n_max * sizeof *y);
    if (!w || !sc || !bi || !x || !y) {
        free(w), free(sc), free(bi), free(x), free(y);
        return keel_cli_fail("bench", "cannot allocate %.1f MiB for the bench matrix (k %d, %d rows)",
                             (double)words * 4 / 1048576.0, k, n_max);
    }
    uint64_t s = 0x2545f4914f6cdd1dull;
    for (size_t i = 0; i < words; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        w[i] = (uint32_t)(s >> 17);
    }
    for (size_t i = 0; i < groups; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        sc[i] = keel_f32_to_bf16((float)((int)(s % 2001) - 1000) * 1e-5f);
        bi[i] = keel_f32_to_bf16((float)((int)((s >> 20) % 2001) - 1000) * 1e-4f);
    }
    for (size_t i = 0; i < (size_t)8 * k; i++) x[i] = (float)((int)(i * 7919 % 2001) - 1000) * 1e-3f;

    keel_cpu_set_threads(cfg->threads);
    const int T = keel_cpu_threads();
    double bw_t[BENCH_MAX_REPS];
    uint64_t sink = read_pass((const uint64_t *)w, words / 2, T);
    int reps = 0;
    const double bw_start = keel_now();
    while (reps < BENCH_MAX_REPS && (reps < 5 || keel_now() - bw_start < cfg->seconds)) {
        const double t0 = keel_now();
        sink += read_pass((const uint64_t *)w, words / 2, T);
        bw_t[reps++] = keel_now() - t0;
    }
    const double read_gbs = (double)words * 4 / median(bw_t, reps) / 1e9;

    printf("keel bench cpu: isa %s, %d threads, last-level cache %.0f MiB, k %d, group %d, BF16 scales\n",
           keel_cpu_isa(), T, (double)l3 / 1048576.0, k, BENCH_GROUP);
    printf("timing: median of >= %d calls over %.2f s each; GB/s counts packed codes + scales + biases + x + y\n",
           BENCH_MIN_REPS, cfg->seconds);
    printf("read bandwidth (plain streaming read of %.0f MiB, %d threads): %.2f GB/s  [checksum %llu]\n\n",
           (double)words * 4 / 1048576.0, T, read_gbs, (unsigned long long)(sink & 0xff));
    printf("%4s %7s %10s %3s %10s %8s %8s\n", "bits", "n", "packed MiB", "m", "ms/call", "GB/s", "of read");
    for (size_t i = 0; i < KEEL_ARRAY_LEN(widths); i++) {
        const int n = n_of[i], bits = widths[i];
        const keel_qmat W = {.n = n, .k = k, .bits = bits, .group = BENCH_GROUP, .sdt = KEEL_DT_BF16,
                             .w = w, .scales = sc, .biases = bi};
        const double packed = (double)n * (double)keel_quant_row_words(k, bits) * 4;
        const double sb = 2.0 * (double)n * (k / BENCH_GROUP) * 2;
        for (int m = 1; m <= 8; m += 7) {
            const double t = time_matmul(&W, x, m, y, cfg->seconds);
            const double bytes = packed + sb + 4.0 * m * k + 4.0 * m * n;
            const double gbs = bytes / t / 1e9;
            printf("%4d %7d %10.1f %3d %10.3f %8.2f %7.0f%%\n", bits, n, packed / 1048576.0, m, t * 1e3, gbs,
                   100.0 * gbs / read_gbs);
            fflush(stdout);
        }
    }
    free(w), free(sc), free(bi), free(x), free(y);
    return 0;
}

static int bench_cpu_args(int argc, char **argv) {
    bench_cfg cfg = {.threads = 0, .seconds = 1.0, .k = 8192, .n = 0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--threads") && strcmp(a, "--seconds") && strcmp(a, "--k") && strcmp(a, "--n"))
            return keel_cli_fail("bench", "cpu: unknown option '%s' (expected --threads, --seconds, --k, --n)", a);
        if (i + 1 >= argc) return keel_cli_fail("bench", "cpu: %s needs a value", a);
        const char *v = argv[++i];
        long l;
        if (!strcmp(a, "--threads")) {
            if (!keel_cli_parse_long(v, 1, 4096, &l))
                return keel_cli_fail("bench", "cpu: --threads expects an integer in 1..4096, found '%s'", v);
            cfg.threads = (int)l;
        } else if (!strcmp(a, "--seconds")) {
            if (!parse_double(v, 1e-6, 3600.0, &cfg.seconds))
                return keel_cli_fail("bench", "cpu: --seconds expects a number in (0, 3600], found '%s'", v);
        } else if (!strcmp(a, "--k")) {
            if (!keel_cli_parse_long(v, BENCH_GROUP, 1 << 20, &l) || l % BENCH_GROUP)
                return keel_cli_fail("bench", "cpu: --k expects a multiple of %d in %d..%d, found '%s'", BENCH_GROUP,
                                     BENCH_GROUP, 1 << 20, v);
            cfg.k = (int)l;
        } else {
            if (!keel_cli_parse_long(v, 1, 1 << 24, &l))
                return keel_cli_fail("bench", "cpu: --n expects an integer in 1..%d, found '%s'", 1 << 24, v);
            cfg.n = (int)l;
        }
    }
    return bench_cpu(&cfg);
}

int keel_cli_bench(int argc, char **argv) {
    if (argc < 2) return keel_cli_fail("bench", "expected a benchmark: cpu, stream or decode");
    const char *what = argv[1];
    if (!strcmp(what, "cpu")) return bench_cpu_args(argc - 1, argv + 1);
    /* ---- `keel bench stream` (CUDA stream tile): its owner adds it here. ---- */
#ifdef KEEL_HAVE_CUDA
    if (!strcmp(what, "stream")) return keel_cuda_bench_stream(argc - 1, argv + 1);
#else
    if (!strcmp(what, "stream")) return keel_cli_fail("bench stream", "this keel was built without CUDA (KEEL_CUDA=OFF)");
#endif
    /* ---- `keel bench decode` (end-to-end decode): its owner adds it here. ---- */
    if (!strcmp(what, "decode")) return keel_engine_bench_decode(argc - 1, argv + 1);
    return keel_cli_fail("bench", "unknown benchmark '%s' (expected cpu, stream or decode)", what);
}
