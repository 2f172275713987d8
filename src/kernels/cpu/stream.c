/* kernels/cpu stream tile: the production build of stream_body.h (keel_cpu_matmul, keel_cpu_relu2) and the
 * backend's thread and instruction-set switches. The body is shared with the contract's planted twins.
 */
#include <omp.h>

#include "cpu.h"

#if defined(__x86_64__)
#define KEEL_STREAM_HOST_X86 1
#include <cpuid.h>
#endif

static int g_threads = 0;
static bool g_force_portable = false;

void keel_cpu_set_threads(int n) { g_threads = n > 0 ? n : 0; }

int keel_cpu_threads(void) { return g_threads > 0 ? g_threads : KEEL_MAX(1, omp_get_max_threads()); }

void keel_cpu_force_portable(bool on) { g_force_portable = on; }

static bool cpu_has_avx2(void) {
#if defined(KEEL_STREAM_HOST_X86)
    static int cached = -1;
    if (cached < 0) {
        /* f16c through cpuid leaf 1 (ECX bit 29): clang 14 does not know __builtin_cpu_supports("f16c") */
        unsigned a, b, c, d;
        bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    }
    return cached == 1;
#else
    return false;
#endif
}

static bool use_avx2(void) { return !g_force_portable && cpu_has_avx2(); }

const char *keel_cpu_isa(void) { return use_avx2() ? "avx2" : "portable"; }

#define KEEL_STREAM_MATMUL keel_cpu_matmul
#define KEEL_STREAM_RELU2 keel_cpu_relu2
#define KEEL_STREAM_USE_AVX2() use_avx2()
#include "stream_body.h"
