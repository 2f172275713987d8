/* core: status reasons, panics, allocation helpers, file reading, fp16 conversion. */
#define _POSIX_C_SOURCE 200809L
#include "core.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static const char *const code_names[KEEL_CODE_COUNT] = {
    [KEEL_OK] = "ok",
    [KEEL_E_IO] = "io",
    [KEEL_E_FORMAT] = "format",
    [KEEL_E_UNSUPPORTED] = "unsupported",
    [KEEL_E_SHAPE] = "shape",
    [KEEL_E_MISSING] = "missing",
    [KEEL_E_UNUSED] = "unused",
    [KEEL_E_ARG] = "argument",
    [KEEL_E_RANGE] = "range",
    [KEEL_E_NOMEM] = "out of memory",
    [KEEL_E_DEVICE] = "device",
};

const char *keel_code_name(keel_code c) {
    return (c >= 0 && c < KEEL_CODE_COUNT) ? code_names[c] : "unknown";
}

keel_code keel_err_set(keel_err *err, keel_code c, const char *fmt, ...) {
    if (err) {
        err->code = c;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return c;
}

keel_code keel_err_prefix(keel_err *err, const char *fmt, ...) {
    if (!err) return KEEL_E_FORMAT;
    char pre[512], old[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    size_t n = strlen(pre);
    if (n >= sizeof err->msg) n = sizeof err->msg - 1;
    memcpy(err->msg, pre, n);
    size_t rest = strnlen(old, sizeof old - 1);
    if (rest > sizeof err->msg - 1 - n) rest = sizeof err->msg - 1 - n;
    memcpy(err->msg + n, old, rest);
    err->msg[n + rest] = 0;
    return err->code;
}

void keel_panic(const char *file, int line, const char *fmt, ...) {
    fflush(stdout);
    fprintf(stderr, "keel: internal error at %s:%d: ", file, line);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    abort();
}

void *keel_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    KEEL_ASSERTF(p, "out of memory allocating %zu bytes", n);
    return p;
}

void *keel_xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    KEEL_ASSERTF(p, "out of memory allocating %zu x %zu bytes", n, size);
    return p;
}

void *keel_xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    KEEL_ASSERTF(q, "out of memory reallocating %zu bytes", n);
    return q;
}

char *keel_xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = keel_xmalloc(n);
    memcpy(d, s, n);
    return d;
}

keel_code keel_read_file(const char *path, char **out, size_t *len, keel_err *err) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return keel_err_set(err, KEEL_E_IO, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = keel_xmalloc(cap);
    for (;;) {
        if (n + 1 >= cap) buf = keel_xrealloc(buf, cap *= 2);
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
        if (r == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return keel_err_set(err, KEEL_E_IO, "%s: read error", path);
    }
    buf[n] = 0;
    *out = buf;
    if (len) *len = n;
    return KEEL_OK;
}

double keel_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

float keel_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return keel_u32_as_f32(sign | 0x7f800000u | (man << 13)); /* inf / NaN */
    if (exp == 0) {
        float v = (float)man * 0x1p-24f; /* subnormal (or zero), exact */
        return sign ? -v : v;
    }
    return keel_u32_as_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t keel_f32_to_f16(float f) {
    uint32_t u = keel_f32_as_u32(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN stays NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to or beyond infinity */
    if (a < 0x38800000u) {                                   /* below the smallest normal: subnormal */
        if (a < 0x33000000u) return sign;                    /* below half the smallest subnormal */
        uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* value = m * 2^(e-150); subnormal unit is 2^-24 */
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u); /* nearest even on the 13 dropped bits */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}
