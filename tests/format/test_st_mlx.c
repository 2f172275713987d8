/* format: interchange with MLX's own safetensors code, an independent implementation: MLX loads what keel writes
 * and saves it again in its own layout, and keel reads that back to the same dtypes, shapes, bytes and metadata. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "format/format.h"
#include "common/testkit.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[512];

/* Loads argv[1] with MLX, checks its metadata, and saves every array plus `f32 + 1` computed by MLX to argv[2]. */
static const char script[] =
    "import sys\n"
    "import mlx.core as mx\n"
    "arrays, meta = mx.load(sys.argv[1], return_metadata=True)\n"
    "assert meta == {'format': 'mlx', 'note': 'k\\u00e9el \"x\"'}, meta\n"
    "arrays['plus1'] = arrays['t.F32'] + 1\n"
    "mx.save_safetensors(sys.argv[2], arrays, metadata={'from': 'mlx'})\n";

static const keel_dtype mlx_dtypes[] = {KEEL_DT_BOOL, KEEL_DT_U8,  KEEL_DT_I8,  KEEL_DT_U16, KEEL_DT_I16,
                                        KEEL_DT_F16,  KEEL_DT_BF16, KEEL_DT_U32, KEEL_DT_I32, KEEL_DT_F32,
                                        KEEL_DT_U64,  KEEL_DT_I64};

static void test_mlx_interchange(void **state) {
    (void)state;
    enum { N = KEEL_ARRAY_LEN(mlx_dtypes) };
    uint8_t *bufs[N];
    char names[N][32];
    int64_t shapes[N][3];
    int ndims[N];
    keel_st_writer w;
    keel_st_writer_init(&w);
    for (int k = 0; k < N; k++) {
        keel_dtype dt = mlx_dtypes[k];
        ndims[k] = 1 + k % 3;
        for (int d = 0; d < 3; d++) shapes[k][d] = 1 + (k + d) % 4;
        size_t numel = 1;
        for (int d = 0; d < ndims[k]; d++) numel *= (size_t)shapes[k][d];
        size_t nb = numel * keel_dtype_size(dt);
        bufs[k] = malloc(nb);
        for (size_t i = 0; i < numel; i++) {
            uint8_t *e = bufs[k] + i * keel_dtype_size(dt);
            if (dt == KEEL_DT_BOOL) e[0] = (uint8_t)(i % 2);
            else if (dt == KEEL_DT_F16 || dt == KEEL_DT_BF16 || dt == KEEL_DT_F32)
                keel_dtype_set_f32(dt, bufs[k], i, (float)i * 0.75f - 2.0f);
            else
                for (size_t b = 0; b < keel_dtype_size(dt); b++) e[b] = (uint8_t)(i * 37 + b * 11 + (size_t)k);
        }
        snprintf(names[k], sizeof names[k], "t.%s", keel_dtype_name(dt));
        assert_int_equal(keel_st_writer_add(&w, names[k], dt, ndims[k], shapes[k], bufs[k], NULL), KEEL_OK);
    }
    keel_st_writer_meta(&w, "format", "mlx");
    keel_st_writer_meta(&w, "note", "k\xc3\xa9" "el \"x\"");
    char in[700], out[700], py[700], cmd[2200];
    snprintf(in, sizeof in, "%s/keel.safetensors", g_dir);
    snprintf(out, sizeof out, "%s/mlx.safetensors", g_dir);
    snprintf(py, sizeof py, "%s/roundtrip.py", g_dir);
    keel_err err = {0};
    assert_int_equal(keel_st_writer_write(&w, in, &err), KEEL_OK);
    FILE *f = fopen(py, "w");
    assert_non_null(f);
    fputs(script, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "python3 '%s' '%s' '%s'", py, in, out);
    assert_int_equal(system(cmd), 0);

    keel_st st;
    keel_code rc = keel_st_open(&st, out, &err);
    if (rc) print_error("%s\n", err.msg);
    assert_int_equal(rc, KEEL_OK);
    assert_int_equal(st.n_tensors, N + 1);
    assert_string_equal(keel_st_meta_get(&st, "from"), "mlx");
    for (int k = 0; k < N; k++) {
        const keel_st_tensor *t = keel_st_find(&st, names[k]);
        assert_non_null(t);
        assert_int_equal(t->dtype, mlx_dtypes[k]);
        assert_int_equal(t->ndim, ndims[k]);
        for (int d = 0; d < ndims[k]; d++) assert_int_equal(t->shape[d], shapes[k][d]);
        assert_memory_equal(t->data, bufs[k], t->nbytes);
    }
    const keel_st_tensor *p = keel_st_find(&st, "plus1");
    assert_non_null(p);
    assert_int_equal(p->dtype, KEEL_DT_F32);
    for (int64_t i = 0; i < p->numel; i++)
        assert_true(keel_dtype_get_f32(KEEL_DT_F32, p->data, (size_t)i) == (float)i * 0.75f - 2.0f + 1.0f);
    keel_st_free(&st);
    keel_st_writer_free(&w);
    for (int k = 0; k < N; k++) free(bufs[k]);
}

static int setup(void **state) {
    (void)state;
    return tk_tmpdir(g_dir, sizeof g_dir, "test_st_mlx");
}

static int teardown(void **state) {
    (void)state;
    return tk_rmtree(g_dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_mlx_interchange)};
    return cmocka_run_group_tests(tests, setup, teardown);
}
