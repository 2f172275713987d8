/* model: small text helpers private to src/model (load.c, synth.c). */
#ifndef KEEL_MODEL_INTERNAL_H
#define KEEL_MODEL_INTERNAL_H

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "model.h"

/* snprintf through a va_list: names are bounded by the buffers, and truncation only shortens a message. */
static inline void fmt(char *buf, size_t n, const char *f, ...) __attribute__((format(printf, 3, 4)));
static inline void fmt(char *buf, size_t n, const char *f, ...) {
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, n, f, ap);
    va_end(ap);
}

/* "dir/name", malloc'd (keel_xmalloc). */
static inline char *path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = keel_xmalloc(n);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

#endif
