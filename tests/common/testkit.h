/* tests: helpers the cmocka tests share (environment paths, files, running the keel binary, checked tensors from a
 * safetensors file, the nemotron_h_tiny reference fixture, scratch directories). Header-only: static inline. */
#ifndef KEEL_TESTS_TESTKIT_H
#define KEEL_TESTS_TESTKIT_H

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "model/model.h"

/* The environment variable `name`, or `fallback` where it is unset or empty. */
static inline const char *tk_env(const char *name, const char *fallback) {
    const char *v = getenv(name);
    return v && *v ? v : fallback;
}

/* The keel binary: $KEEL_BIN, or build/keel from the repository root. */
static inline const char *tk_bin(void) { return tk_env("KEEL_BIN", "build/keel"); }

/* The scratch directory: $KEEL_TMP, or /tmp. */
static inline const char *tk_tmp(void) { return tk_env("KEEL_TMP", "/tmp"); }

/* The repository root: $KEEL_SRC, or the working directory the tests run in. */
static inline const char *tk_src(void) { return tk_env("KEEL_SRC", "."); }

/* "$KEEL_FIXTURES/rel" (../shared/fixtures from the repository root where unset) into buf; returns buf. */
static inline char *tk_fixture(char *buf, size_t cap, const char *rel) {
    snprintf(buf, cap, "%s/%s", tk_env("KEEL_FIXTURES", "../shared/fixtures"), rel);
    return buf;
}

/* The whole file at path, NUL-terminated and malloc'd; fails the test where it cannot be read. */
static inline char *tk_read_text(const char *path) {
    char *text = NULL;
    keel_err err = {0};
    if (keel_read_file(path, &text, NULL, &err) != KEEL_OK) fail_msg("%s", err.msg);
    return text;
}

/* Up to cap - 1 bytes of path into buf, NUL-terminated; empty where the file cannot be opened. */
static inline void tk_slurp(const char *path, char *buf, size_t cap) {
    buf[0] = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return;
    size_t n = fread(buf, 1, cap - 1, f);
    buf[n] = 0;
    fclose(f);
}

/* Runs a shell command, returning its output (malloc'd, what the command sends to stdout) and its exit status. */
static inline char *tk_run(const char *cmd, int *status) {
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    size_t r;
    while ((r = fread(buf + n, 1, cap - n - 1, p)) > 0)
        if ((n += r) + 1 >= cap) buf = realloc(buf, cap *= 2);
    buf[n] = 0;
    int st = pclose(p);
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return buf;
}

/* The data of tensor `name` in st, asserted to be of dtype dt with numel elements. */
static inline const void *tk_st_tensor(const keel_st *st, const char *name, keel_dtype dt, int64_t numel) {
    const keel_st_tensor *t = keel_st_find(st, name);
    assert_non_null(t);
    assert_int_equal(t->dtype, dt);
    assert_int_equal(t->numel, numel);
    return t->data;
}

/* Tensor `name` in st, failing the test (naming the tensor) unless it has dtype dt and the shape (ndim dims). */
static inline const keel_st_tensor *tk_st_need(const keel_st *st, const char *name, keel_dtype dt, int ndim,
                                               const int64_t *shape) {
    const keel_st_tensor *t = keel_st_find(st, name);
    if (!t) fail_msg("tensor %s missing", name);
    if (t->dtype != dt || t->ndim != ndim)
        fail_msg("%s: expected %s ndim %d, found %s ndim %d", name, keel_dtype_name(dt), ndim,
                 keel_dtype_name(t->dtype), t->ndim);
    for (int d = 0; d < ndim; d++)
        if (t->shape[d] != shape[d])
            fail_msg("%s: dim %d is %lld, expected %lld", name, d, (long long)t->shape[d], (long long)shape[d]);
    return t;
}

/* max |a - b| over n floats; a NaN anywhere gives NaN. */
static inline float tk_max_abs_diff(const float *a, const float *b, size_t n) {
    float d = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float x = fabsf(a[i] - b[i]);
        if (!(x <= d)) d = x;
    }
    return d;
}

/* nemotron_h_tiny loaded, with its float64 reference (reference.safetensors): tokens, logits and hidden states. */
typedef struct tk_ref {
    keel_model model;
    keel_st ref;
    char dir[1024];
    const int32_t *tokens; /* (n_tok) */
    const float *logits;   /* (n_tok, vocab) */
    const float *hidden;   /* (n_tok, hidden) */
    int n_tok, prompt_len;
} tk_ref;

/* Loads the reference fixture into f; 0, or -1 with the reason printed (a cmocka setup's return). */
static inline int tk_ref_open(tk_ref *f) {
    if (!getenv("KEEL_FIXTURES")) {
        print_message("KEEL_FIXTURES is not set\n");
        return -1;
    }
    tk_fixture(f->dir, sizeof f->dir, "nemotron_h_tiny");
    char path[1200];
    snprintf(path, sizeof path, "%s/reference.safetensors", f->dir);
    keel_err err = {0};
    if (keel_model_load(&f->model, f->dir, NULL, &err) != KEEL_OK || keel_st_open(&f->ref, path, &err) != KEEL_OK) {
        print_message("fixture: %s\n", err.msg);
        return -1;
    }
    const keel_st_tensor *t = keel_st_find(&f->ref, "tokens");
    if (!t) return -1;
    f->n_tok = (int)t->numel;
    f->tokens = t->data;
    const keel_config *c = &f->model.cfg;
    f->logits = tk_st_tensor(&f->ref, "logits", KEEL_DT_F32, (int64_t)f->n_tok * c->vocab);
    f->hidden = tk_st_tensor(&f->ref, "hidden", KEEL_DT_F32, (int64_t)f->n_tok * c->hidden);
    const char *pl = keel_st_meta_get(&f->ref, "prompt_len");
    f->prompt_len = pl ? atoi(pl) : 0;
    return 0;
}

static inline void tk_ref_close(tk_ref *f) {
    keel_st_free(&f->ref);
    keel_model_free(&f->model);
}

/* cmocka group setup and teardown: *state is a loaded tk_ref. */
static inline int tk_ref_setup(void **state) {
    tk_ref *f = calloc(1, sizeof *f);
    if (tk_ref_open(f) != 0) return -1;
    *state = f;
    return 0;
}

static inline int tk_ref_teardown(void **state) {
    tk_ref_close(*state);
    free(*state);
    return 0;
}

/* Makes the scratch directory $KEEL_TMP/<tag>.<pid> (/tmp where unset) into buf; mkdir's result. */
static inline int tk_tmpdir(char *buf, size_t cap, const char *tag) {
    snprintf(buf, cap, "%s/%s.%ld", tk_tmp(), tag, (long)getpid());
    return mkdir(buf, 0755);
}

/* Removes dir and everything under it; 0 on success, -1 otherwise (a cmocka teardown's return). */
static inline int tk_rmtree(const char *dir) {
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? 0 : -1;
}

#endif
