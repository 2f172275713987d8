/* core: status codes with reasons, invariant checks, half-precision conversions, small allocation helpers.
 *
 * Errors come in two tiers. Anything input or environment can cause (a bad file, a missing tensor, a token id
 * out of range, out of memory for a checkpoint) returns a keel_code and writes a human reason into a keel_err
 * that names the file, tensor or field, what was expected and what was found. A broken invariant (a bug) aborts
 * with file and line through KEEL_ASSERT.
 *
 * bf16 and fp16 conversions live here and only here: round to nearest even, NaN and infinity preserved.
 */
#ifndef KEEL_CORE_H
#define KEEL_CORE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
#define KEEL_NORETURN [[noreturn]]
extern "C" {
#else
#define KEEL_NORETURN _Noreturn
#endif

typedef enum keel_code {
    KEEL_OK = 0,
    KEEL_E_IO,          /* a file cannot be opened, read, mapped or written */
    KEEL_E_FORMAT,      /* a file's content is malformed */
    KEEL_E_UNSUPPORTED, /* well-formed but not supported (FP8 tensors, mxfp4 quantization, ...) */
    KEEL_E_SHAPE,       /* a shape or size disagrees with what is expected */
    KEEL_E_MISSING,     /* something required is absent (tensor, field, shard) */
    KEEL_E_UNUSED,      /* something present that nothing uses (an unexpected tensor) */
    KEEL_E_ARG,         /* a bad command-line or API argument */
    KEEL_E_RANGE,       /* a value out of its range (token id, context length) */
    KEEL_E_NOMEM,       /* host or device memory exhausted */
    KEEL_E_DEVICE,      /* no usable device, or the device failed */
    KEEL_CODE_COUNT
} keel_code;

/* The reason of the last failure; callers may pass NULL when they do not want it. */
typedef struct keel_err {
    keel_code code;
    char msg[1024];
} keel_err;

const char *keel_code_name(keel_code c);
/* Sets err (if non-NULL) and returns c, so callers write `return keel_err_set(err, KEEL_E_IO, "...", ...);`. */
keel_code keel_err_set(keel_err *err, keel_code c, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Prefixes an existing reason with more context ("file x: " + reason); returns err->code. */
keel_code keel_err_prefix(keel_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

KEEL_NORETURN void keel_panic(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#define KEEL_ASSERT(cond)                                                                          \
    do {                                                                                           \
        if (!(cond)) keel_panic(__FILE__, __LINE__, "assertion failed: %s", #cond);                \
    } while (0)
#define KEEL_ASSERTF(cond, ...)                                                                    \
    do {                                                                                           \
        if (!(cond)) keel_panic(__FILE__, __LINE__, __VA_ARGS__);                                  \
    } while (0)

/* Allocation for sizes that come from the program, not from input: aborts on failure. */
void *keel_xmalloc(size_t n);
void *keel_xcalloc(size_t n, size_t size);
void *keel_xrealloc(void *p, size_t n);
char *keel_xstrdup(const char *s);

/* Reads a whole small file (config.json, tokenizer.json) into a NUL-terminated buffer. */
keel_code keel_read_file(const char *path, char **out, size_t *len, keel_err *err);

/* Monotonic wall time in seconds. */
double keel_now(void);

/* ---- half precision ------------------------------------------------------------------------------- */

static inline float keel_u32_as_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t keel_f32_as_u32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float keel_bf16_to_f32(uint16_t h) { return keel_u32_as_f32((uint32_t)h << 16); }

static inline uint16_t keel_f32_to_bf16(float f) {
    uint32_t u = keel_f32_as_u32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN, sign kept */
    u += 0x7fffu + ((u >> 16) & 1u);                                            /* nearest even */
    return (uint16_t)(u >> 16);
}

float keel_f16_to_f32(uint16_t h);
uint16_t keel_f32_to_f16(float f);

#define KEEL_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KEEL_MAX(a, b) ((a) > (b) ? (a) : (b))
#define KEEL_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

#ifdef __cplusplus
}
#endif

#endif
