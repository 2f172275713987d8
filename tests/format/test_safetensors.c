/* format: safetensors writer -> reader round trips, the fixture checkpoint, shards, atomic writes, dtype helpers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "format/format.h"
#include "common/testkit.h"

#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[512];

static const char *tpath(const char *name) {
    static char buf[8][1024];
    static int k;
    char *b = buf[k++ % 8];
    snprintf(b, sizeof buf[0], "%s/%s", g_dir, name);
    return b;
}

static void write_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static uint8_t *read_bytes(const char *path, size_t *n) {
    char *s = NULL;
    assert_int_equal(keel_read_file(path, &s, n, NULL), KEEL_OK);
    return (uint8_t *)s;
}

/* A safetensors file from a literal header (length computed) followed by `data_len` bytes i & 0xff. */
static void write_st(const char *path, const char *header, size_t data_len) {
    size_t h = strlen(header), n = 8 + h + data_len;
    uint8_t *b = malloc(n);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(b + 8, header, h);
    for (size_t i = 0; i < data_len; i++) b[8 + h + i] = (uint8_t)i;
    write_bytes(path, b, n);
    free(b);
}

/* Opening `path` fails with `code`, the reason names `path` and (when given) `what`, and st is left empty. */
static void expect_open_fail(const char *path, keel_code code, const char *what) {
    keel_st st;
    keel_err err = {0};
    keel_code rc = keel_st_open(&st, path, &err);
    if (rc != code || !strstr(err.msg, path) || (what && !strstr(err.msg, what)))
        print_error("open %s: got %s '%s', expected %s naming '%s'\n", path, keel_code_name(rc), err.msg,
                    keel_code_name(code), what ? what : "");
    assert_int_equal(rc, code);
    assert_non_null(strstr(err.msg, path));
    if (what) assert_non_null(strstr(err.msg, what));
    assert_int_equal(st.n_tensors, 0);
    assert_null(st.tensors);
    assert_int_equal(st.n_shards, 0);
    keel_st_free(&st);
}

static void expect_st_fail(const char *name, const char *header, size_t data_len, keel_code code, const char *what) {
    const char *p = tpath(name);
    write_st(p, header, data_len);
    expect_open_fail(p, code, what);
}

/* ---- dtypes ------------------------------------------------------------------------------------------------ */

static void test_dtype_table(void **state) {
    (void)state;
    /* names and sizes as the safetensors specification lists them */
    static const struct {
        const char *name;
        size_t size;
    } want[] = {{"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"U16", 2},     {"I16", 2},     {"F16", 2},
                {"BF16", 2}, {"U32", 4}, {"I32", 4}, {"F32", 4},     {"U64", 8},     {"I64", 8},
                {"F64", 8},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1}};
    assert_int_equal(KEEL_ARRAY_LEN(want), KEEL_DT_COUNT);
    for (size_t i = 0; i < KEEL_ARRAY_LEN(want); i++) {
        keel_dtype dt = KEEL_DT_COUNT;
        assert_int_equal(keel_dtype_parse(want[i].name, &dt), KEEL_OK);
        assert_string_equal(keel_dtype_name(dt), want[i].name);
        assert_int_equal(keel_dtype_size(dt), want[i].size);
    }
    keel_dtype dt;
    assert_int_equal(keel_dtype_parse("F17", &dt), KEEL_E_FORMAT);
    assert_int_equal(keel_dtype_parse("bf16", &dt), KEEL_E_FORMAT);
    assert_int_equal(keel_dtype_parse("", &dt), KEEL_E_FORMAT);
}

static void test_dtype_f32(void **state) {
    (void)state;
    uint16_t h[3] = {0x3f80, 0xc040, 0x3c00}; /* bf16 1.0, bf16 -3.0, f16 1.0 */
    assert_true(keel_dtype_get_f32(KEEL_DT_BF16, h, 0) == 1.0f);
    assert_true(keel_dtype_get_f32(KEEL_DT_BF16, h, 1) == -3.0f);
    assert_true(keel_dtype_get_f32(KEEL_DT_F16, h, 2) == 1.0f);
    double d[2] = {0.25, -1e300};
    assert_true(keel_dtype_get_f32(KEEL_DT_F64, d, 0) == 0.25f);
    assert_true(keel_dtype_get_f32(KEEL_DT_F64, d, 1) < -1e38f); /* beyond float range: -inf */
    uint8_t buf[16];
    keel_dtype_set_f32(KEEL_DT_BF16, buf, 1, 1.00390625f); /* halfway between bf16 1.0 and 1.0078125: even */
    uint16_t got;
    memcpy(&got, buf + 2, 2);
    assert_int_equal(got, 0x3f80);
    keel_dtype_set_f32(KEEL_DT_F16, buf, 3, 65504.0f);
    memcpy(&got, buf + 6, 2);
    assert_int_equal(got, 0x7bff);
    keel_dtype_set_f32(KEEL_DT_F32, buf, 2, -2.5f);
    assert_true(keel_dtype_get_f32(KEEL_DT_F32, buf, 2) == -2.5f);
}

/* ---- round trip ------------------------------------------------------------------------------------------- */

static void test_roundtrip_all_dtypes(void **state) {
    (void)state;
    keel_st_writer w;
    keel_st_writer_init(&w);
    uint8_t *bufs[KEEL_DT_COUNT];
    char names[KEEL_DT_COUNT][32];
    int64_t shapes[KEEL_DT_COUNT][3];
    int ndims[KEEL_DT_COUNT];
    /* added in reverse dtype order so that added order differs from name order */
    for (int k = KEEL_DT_COUNT - 1; k >= 0; k--) {
        keel_dtype dt = (keel_dtype)k;
        ndims[k] = k % 4; /* scalars, vectors, matrices, 3-d */
        for (int d = 0; d < 3; d++) shapes[k][d] = 2 + (k + d) % 3;
        if (k == KEEL_DT_I16) shapes[k][0] = 0; /* an empty tensor */
        size_t numel = 1;
        for (int d = 0; d < ndims[k]; d++) numel *= (size_t)shapes[k][d];
        size_t nb = numel * keel_dtype_size(dt);
        bufs[k] = malloc(nb ? nb : 1);
        for (size_t i = 0; i < nb; i++) bufs[k][i] = (uint8_t)(i * 7 + (size_t)k);
        snprintf(names[k], sizeof names[k], "t.%s \"q\"", keel_dtype_name(dt));
        keel_err err = {0};
        assert_int_equal(keel_st_writer_add(&w, names[k], dt, ndims[k], shapes[k], bufs[k], &err), KEEL_OK);
    }
    keel_st_writer_meta(&w, "format", "mlx");
    keel_st_writer_meta(&w, "note", "tab\there \"quoted\" \\");
    keel_st_writer_meta(&w, "format", "pt"); /* a repeated key replaces */
    const char *p = tpath("roundtrip.safetensors");
    keel_err err = {0};
    assert_int_equal(keel_st_writer_write(&w, p, &err), KEEL_OK);

    /* layout: header length a multiple of 8, padded with spaces */
    size_t n;
    uint8_t *raw = read_bytes(p, &n);
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++) hl |= (uint64_t)raw[i] << (8 * i);
    assert_int_equal(hl % 8, 0);
    assert_true(8 + hl <= n);
    size_t last = 8 + hl - 1;
    while (raw[last] == ' ') last--;
    assert_int_equal(raw[last], '}');
    free(raw);

    keel_st st;
    assert_int_equal(keel_st_open(&st, p, &err), KEEL_OK);
    assert_int_equal(st.n_tensors, KEEL_DT_COUNT);
    assert_int_equal(st.n_shards, 1);
    assert_string_equal(keel_st_meta_get(&st, "format"), "pt");
    assert_string_equal(keel_st_meta_get(&st, "note"), "tab\there \"quoted\" \\");
    assert_null(keel_st_meta_get(&st, "absent"));
    const uint8_t *prev = NULL;
    for (int k = KEEL_DT_COUNT - 1; k >= 0; k--) {
        const keel_st_tensor *t = keel_st_find(&st, names[k]);
        assert_non_null(t);
        assert_int_equal(t->dtype, k);
        assert_int_equal(t->ndim, ndims[k]);
        int64_t numel = 1;
        for (int d = 0; d < ndims[k]; d++) {
            assert_int_equal(t->shape[d], shapes[k][d]);
            numel *= shapes[k][d];
        }
        assert_int_equal(t->numel, numel);
        assert_int_equal(t->nbytes, (size_t)numel * keel_dtype_size((keel_dtype)k));
        if (t->nbytes) assert_memory_equal(t->data, bufs[k], t->nbytes);
        /* data in the order added */
        if (prev) assert_true((const uint8_t *)t->data >= prev);
        prev = t->data;
        assert_string_equal(keel_st_tensor_file(&st, t), p);
    }
    for (int i = 1; i < st.n_tensors; i++) assert_true(strcmp(st.tensors[i - 1].name, st.tensors[i].name) < 0);
    assert_null(keel_st_find(&st, "t.nope"));
    keel_st_free(&st);
    keel_st_free(&st);
    keel_st_free(NULL);
    keel_st zero = {0};
    keel_st_free(&zero);
    for (int k = 0; k < KEEL_DT_COUNT; k++) free(bufs[k]);
    keel_st_writer_free(&w);
    keel_st_writer_free(&w);
    keel_st_writer_free(NULL);
}

static void test_roundtrip_no_meta_no_tensors(void **state) {
    (void)state;
    keel_st_writer w;
    keel_st_writer_init(&w);
    const char *p = tpath("empty.safetensors");
    assert_int_equal(keel_st_writer_write(&w, p, NULL), KEEL_OK);
    size_t n;
    uint8_t *raw = read_bytes(p, &n);
    assert_int_equal(n, 16); /* "{}" padded with spaces to 8 bytes, as the reference writer does */
    assert_memory_equal(raw, "\x08\0\0\0\0\0\0\0{}      ", 16);
    free(raw);
    keel_st st;
    keel_err err = {0};
    assert_int_equal(keel_st_open(&st, p, &err), KEEL_OK);
    assert_int_equal(st.n_tensors, 0);
    assert_int_equal(st.n_meta, 0);
    assert_null(keel_st_find(&st, "x"));
    assert_null(keel_st_meta_get(&st, "format"));
    keel_st_free(&st);
    keel_st_writer_free(&w);
}

static void test_parse_buffer(void **state) {
    (void)state;
    static const char hdr[] = "{\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2,4]},"
                              "\"a\":{\"dtype\":\"I16\",\"shape\":[1],\"data_offsets\":[0,2]}}";
    uint8_t buf[8 + sizeof hdr - 1 + 4];
    size_t h = sizeof hdr - 1;
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(buf + 8, hdr, h);
    memcpy(buf + 8 + h, "\x01\x02\x03\x04", 4);
    keel_st st;
    keel_err err = {0};
    assert_int_equal(keel_st_parse(&st, buf, sizeof buf, "mem", &err), KEEL_OK);
    assert_int_equal(st.n_shards, 0);
    const keel_st_tensor *b = keel_st_find(&st, "b");
    assert_non_null(b);
    assert_ptr_equal(b->data, buf + 8 + h + 2);
    assert_string_equal(st.tensors[0].name, "a");
    assert_string_equal(keel_st_tensor_file(&st, b), "(in memory)");
    keel_st_free(&st);
    assert_int_equal(keel_st_parse(&st, buf, sizeof buf - 1, "mem", &err), KEEL_E_FORMAT);
    assert_non_null(strstr(err.msg, "mem"));
}

/* ---- the fixture checkpoint -------------------------------------------------------------------------------- */

static void test_fixture(void **state) {
    (void)state;
    assert_non_null(getenv("KEEL_FIXTURES"));
    char path[1024], dir[512];
    tk_fixture(dir, sizeof dir, "nemotron_h_tiny");
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    keel_st st;
    keel_err err = {0};
    keel_code rc = keel_st_open(&st, path, &err);
    if (rc) print_error("%s\n", err.msg);
    assert_int_equal(rc, KEEL_OK);
    assert_string_equal(keel_st_meta_get(&st, "format"), "mlx");
    const keel_st_tensor *t = keel_st_find(&st, "backbone.embeddings.weight");
    assert_non_null(t);
    assert_int_equal(t->dtype, KEEL_DT_U32);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], 512);
    assert_int_equal(t->shape[1], 48);
    assert_int_equal(t->nbytes, 512 * 48 * 4);
    /* the mapping holds the file's bytes at the header's offsets */
    size_t n;
    uint8_t *raw = read_bytes(path, &n);
    assert_int_equal(n, st.shards[0].size);
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++) hl |= (uint64_t)raw[i] << (8 * i);
    assert_memory_equal(t->data, raw + 8 + hl + 8192, t->nbytes);
    assert_int_equal(st.shards[0].data_off, 8 + hl); /* where the data section starts (the CUDA engine aligns it) */
    free(raw);
    t = keel_st_find(&st, "backbone.layers.0.mixer.A_log");
    assert_non_null(t);
    assert_int_equal(t->dtype, KEEL_DT_F32);
    assert_int_equal(t->ndim, 1);
    assert_int_equal(t->shape[0], 8);
    t = keel_st_find(&st, "backbone.embeddings.scales");
    assert_non_null(t);
    assert_int_equal(t->dtype, KEEL_DT_BF16);
    assert_int_equal(t->shape[0], 512);
    assert_int_equal(t->shape[1], 4);
    assert_non_null(keel_st_find(&st, "lm_head.weight"));
    keel_st_free(&st);

    /* the directory opens its model.safetensors */
    assert_int_equal(keel_st_open(&st, dir, &err), KEEL_OK);
    t = keel_st_find(&st, "backbone.embeddings.weight");
    assert_non_null(t);
    assert_non_null(strstr(keel_st_tensor_file(&st, t), "model.safetensors"));
    keel_st_free(&st);

    snprintf(path, sizeof path, "%s/mtp.safetensors", dir);
    assert_int_equal(keel_st_open(&st, path, &err), KEEL_OK);
    assert_string_equal(keel_st_meta_get(&st, "format"), "nemotron-h-mtp");
    keel_st_free(&st);
}

/* ---- shards ------------------------------------------------------------------------------------------------ */

static void make_shard_dir(const char *dir, const char *index_json, bool with_second) {
    mkdir(dir, 0755);
    char p[1024];
    float a[4] = {1, 2, 3, 4}, c[2] = {5, 6};
    uint16_t b[3] = {7, 8, 9};
    keel_st_writer w;
    keel_st_writer_init(&w);
    int64_t s4[1] = {4}, s3[1] = {3}, s12[2] = {1, 2};
    assert_int_equal(keel_st_writer_add(&w, "a", KEEL_DT_F32, 1, s4, a, NULL), KEEL_OK);
    assert_int_equal(keel_st_writer_add(&w, "b", KEEL_DT_BF16, 1, s3, b, NULL), KEEL_OK);
    keel_st_writer_meta(&w, "format", "first");
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
    assert_int_equal(keel_st_writer_write(&w, p, NULL), KEEL_OK);
    keel_st_writer_free(&w);
    if (with_second) {
        keel_st_writer_init(&w);
        assert_int_equal(keel_st_writer_add(&w, "c", KEEL_DT_F32, 2, s12, c, NULL), KEEL_OK);
        keel_st_writer_meta(&w, "format", "second");
        snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
        assert_int_equal(keel_st_writer_write(&w, p, NULL), KEEL_OK);
        keel_st_writer_free(&w);
    }
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    write_bytes(p, index_json, strlen(index_json));
}

#define IDX_OK                                                                                                    \
    "{\"metadata\":{\"total_size\":30},\"weight_map\":{\"c\":\"model-00002-of-00002.safetensors\","             \
    "\"a\":\"model-00001-of-00002.safetensors\",\"b\":\"model-00001-of-00002.safetensors\"}}"

static void test_sharded(void **state) {
    (void)state;
    const char *dir = tpath("sharded");
    make_shard_dir(dir, IDX_OK, true);
    char idx[1024];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
    const char *opens[2] = {dir, idx};
    for (int o = 0; o < 2; o++) {
        keel_st st;
        keel_err err = {0};
        keel_code rc = keel_st_open(&st, opens[o], &err);
        if (rc) print_error("%s\n", err.msg);
        assert_int_equal(rc, KEEL_OK);
        assert_int_equal(st.n_shards, 2);
        assert_int_equal(st.n_tensors, 3);
        const keel_st_tensor *a = keel_st_find(&st, "a"), *b = keel_st_find(&st, "b"), *c = keel_st_find(&st, "c");
        assert_non_null(a);
        assert_non_null(b);
        assert_non_null(c);
        assert_true(keel_dtype_get_f32(a->dtype, a->data, 3) == 4.0f);
        assert_int_equal(b->dtype, KEEL_DT_BF16);
        assert_true(keel_dtype_get_f32(c->dtype, c->data, 1) == 6.0f);
        assert_int_equal(c->ndim, 2);
        assert_non_null(strstr(keel_st_tensor_file(&st, a), "model-00001-of-00002.safetensors"));
        assert_non_null(strstr(keel_st_tensor_file(&st, c), "model-00002-of-00002.safetensors"));
        assert_string_equal(keel_st_meta_get(&st, "format"), "first");
        keel_st_free(&st);
    }
}

static void test_shard_errors(void **state) {
    (void)state;
    char idx[1024];
    /* a shard the index names is missing: the error names the shard file and a tensor mapped to it */
    const char *d = tpath("shard_missing");
    make_shard_dir(d, IDX_OK, false);
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", d);
    expect_open_fail(d, KEEL_E_MISSING, "model-00002-of-00002.safetensors");
    keel_st st;
    keel_err err = {0};
    assert_int_equal(keel_st_open(&st, d, &err), KEEL_E_MISSING);
    assert_non_null(strstr(err.msg, "'c'"));

    /* a tensor in two shards */
    d = tpath("shard_twice");
    make_shard_dir(d,
                   "{\"weight_map\":{\"c\":\"model-00002-of-00002.safetensors\","
                   "\"a\":\"model-00001-of-00002.safetensors\",\"b\":\"model-00001-of-00002.safetensors\"}}",
                   true);
    char p[1024];
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", d);
    float one = 1;
    int64_t s1[1] = {1};
    keel_st_writer w;
    keel_st_writer_init(&w);
    assert_int_equal(keel_st_writer_add(&w, "c", KEEL_DT_F32, 1, s1, &one, NULL), KEEL_OK);
    assert_int_equal(keel_st_writer_add(&w, "a", KEEL_DT_F32, 1, s1, &one, NULL), KEEL_OK);
    assert_int_equal(keel_st_writer_write(&w, p, NULL), KEEL_OK);
    keel_st_writer_free(&w);
    expect_open_fail(d, KEEL_E_FORMAT, "'a'");
    assert_int_equal(keel_st_open(&st, d, &err), KEEL_E_FORMAT);
    assert_non_null(strstr(err.msg, "both"));
    assert_non_null(strstr(err.msg, "model-00002-of-00002.safetensors"));

    /* the index maps a tensor to a shard that does not hold it */
    d = tpath("shard_absent");
    make_shard_dir(d,
                   "{\"weight_map\":{\"c\":\"model-00002-of-00002.safetensors\",\"z\":\"model-00002-of-00002."
                   "safetensors\",\"a\":\"model-00001-of-00002.safetensors\",\"b\":\"model-00001-of-00002."
                   "safetensors\"}}",
                   true);
    expect_open_fail(d, KEEL_E_MISSING, "'z'");
    assert_int_equal(keel_st_open(&st, d, &err), KEEL_E_MISSING);
    assert_non_null(strstr(err.msg, "model-00002-of-00002.safetensors"));

    /* a tensor in a shard that the index does not list */
    d = tpath("shard_unlisted");
    make_shard_dir(d,
                   "{\"weight_map\":{\"c\":\"model-00002-of-00002.safetensors\","
                   "\"a\":\"model-00001-of-00002.safetensors\"}}",
                   true);
    expect_open_fail(d, KEEL_E_UNUSED, "'b'");
    assert_int_equal(keel_st_open(&st, d, &err), KEEL_E_UNUSED);
    assert_non_null(strstr(err.msg, "model-00001-of-00002.safetensors"));

    /* the index maps a tensor to the other shard */
    d = tpath("shard_wrong");
    make_shard_dir(d,
                   "{\"weight_map\":{\"c\":\"model-00001-of-00002.safetensors\","
                   "\"a\":\"model-00001-of-00002.safetensors\",\"b\":\"model-00002-of-00002.safetensors\"}}",
                   true);
    expect_open_fail(d, KEEL_E_FORMAT, "'b'");

    /* a bad shard's error names the shard file and its tensor */
    d = tpath("shard_bad");
    make_shard_dir(d, IDX_OK, true);
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", d);
    write_st(p, "{\"c\":{\"dtype\":\"F99\",\"shape\":[1,2],\"data_offsets\":[0,8]}}", 8);
    assert_int_equal(keel_st_open(&st, d, &err), KEEL_E_FORMAT);
    assert_non_null(strstr(err.msg, p));
    assert_non_null(strstr(err.msg, "'c'"));

    /* malformed index files */
    d = tpath("index_json");
    make_shard_dir(d, "{\"weight_map\":{\"a\":", true);
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", d);
    expect_open_fail(idx, KEEL_E_FORMAT, NULL);
    d = tpath("index_nomap");
    make_shard_dir(d, "{\"metadata\":{}}", true);
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", d);
    expect_open_fail(idx, KEEL_E_FORMAT, "weight_map");
    d = tpath("index_value");
    make_shard_dir(d, "{\"weight_map\":{\"a\":3}}", true);
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", d);
    expect_open_fail(idx, KEEL_E_FORMAT, "'a'");
    d = tpath("index_dup");
    make_shard_dir(d,
                   "{\"weight_map\":{\"c\":\"model-00002-of-00002.safetensors\",\"a\":\"model-00001-of-00002."
                   "safetensors\",\"b\":\"model-00001-of-00002.safetensors\",\"a\":\"model-00001-of-00002."
                   "safetensors\"}}",
                   true);
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", d);
    expect_open_fail(idx, KEEL_E_FORMAT, "'a'");

    /* a directory with neither file, and a path that does not exist */
    d = tpath("empty_dir");
    mkdir(d, 0755);
    expect_open_fail(d, KEEL_E_MISSING, NULL);
    expect_open_fail(tpath("no_such_file.safetensors"), KEEL_E_IO, NULL);
}

/* ---- crafted single files, one per error path --------------------------------------------------------------- */

#define TENSOR(name, dt, shape, b, e)                                                                             \
    "\"" name "\":{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":[" #b "," #e "]}"

static void test_file_errors(void **state) {
    (void)state;
    /* shorter than 8 bytes */
    const char *p = tpath("short.safetensors");
    write_bytes(p, "\x02\0\0\0\0", 5);
    expect_open_fail(p, KEEL_E_FORMAT, NULL);
    p = tpath("zero.safetensors");
    write_bytes(p, "", 0);
    expect_open_fail(p, KEEL_E_FORMAT, NULL);

    /* header length beyond the file */
    p = tpath("hlen.safetensors");
    write_bytes(p, "\x40\0\0\0\0\0\0\0{}", 10);
    expect_open_fail(p, KEEL_E_FORMAT, "beyond");
    p = tpath("hlen_huge.safetensors");
    write_bytes(p, "\xff\xff\xff\xff\xff\xff\xff\xff{}", 10);
    expect_open_fail(p, KEEL_E_FORMAT, "beyond");

    /* header length absurd though inside the (sparse) file */
    p = tpath("absurd.safetensors");
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    uint64_t big = 100000001;
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)(big >> (8 * i));
    fwrite(le, 1, 8, f);
    fclose(f);
    assert_int_equal(truncate(p, (off_t)(8 + big + 16)), 0);
    expect_open_fail(p, KEEL_E_FORMAT, "absurd");
    unlink(p);

    expect_st_fail("json.safetensors", "{\"a\":{\"dtype\":", 0, KEEL_E_FORMAT, "parse");
    expect_st_fail("notobj.safetensors", "[1,2]", 0, KEEL_E_FORMAT, "object");
    expect_st_fail("trailing.safetensors", "{} x", 0, KEEL_E_FORMAT, "after the JSON header");
    expect_st_fail("meta_type.safetensors", "{\"__metadata__\":[\"x\"]}", 0, KEEL_E_FORMAT, "__metadata__");
    expect_st_fail("meta_value.safetensors", "{\"__metadata__\":{\"fmt\":1}}", 0, KEEL_E_FORMAT, "'fmt'");
    expect_st_fail("meta_dup.safetensors", "{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}", 0, KEEL_E_FORMAT, "'k'");
    expect_st_fail("meta_twice.safetensors", "{\"__metadata__\":{},\"__metadata__\":{}}", 0, KEEL_E_FORMAT,
                   "twice");
    expect_st_fail("entry.safetensors", "{\"w.x\":[1]}", 0, KEEL_E_FORMAT, "'w.x'");
    expect_st_fail("no_dtype.safetensors", "{\"w.x\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, KEEL_E_FORMAT,
                   "'w.x'");
    expect_st_fail("dtype_type.safetensors", "{\"w.x\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
                   KEEL_E_FORMAT, "'w.x'");
    expect_st_fail("dtype_unknown.safetensors", "{" TENSOR("w.x", "F17", "[1]", 0, 4) "}", 4, KEEL_E_FORMAT,
                   "'w.x'");
    expect_st_fail("field_dup.safetensors",
                   "{\"w.x\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
                   KEEL_E_FORMAT, "'w.x'");
    expect_st_fail("no_shape.safetensors", "{\"w.x\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, KEEL_E_FORMAT,
                   "'w.x'");
    expect_st_fail("shape_type.safetensors", "{" TENSOR("w.x", "F32", "{}", 0, 4) "}", 4, KEEL_E_FORMAT, "'w.x'");
    expect_st_fail("dim_neg.safetensors", "{" TENSOR("w.x", "F32", "[-1]", 0, 4) "}", 4, KEEL_E_FORMAT, "'w.x'");
    expect_st_fail("dim_frac.safetensors", "{" TENSOR("w.x", "F32", "[1.5]", 0, 4) "}", 4, KEEL_E_FORMAT, "'w.x'");
    expect_st_fail("dim_str.safetensors", "{" TENSOR("w.x", "F32", "[\"1\"]", 0, 4) "}", 4, KEEL_E_FORMAT, "'w.x'");
    expect_st_fail("ndim.safetensors", "{" TENSOR("w.x", "U8", "[1,1,1,1,1,1,1,1,1]", 0, 1) "}", 1,
                   KEEL_E_UNSUPPORTED, "'w.x'");
    expect_st_fail("no_offsets.safetensors", "{\"w.x\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, KEEL_E_FORMAT,
                   "'w.x'");
    expect_st_fail("offsets_three.safetensors",
                   "{\"w.x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8, KEEL_E_FORMAT, "'w.x'");
    expect_st_fail("offsets_neg.safetensors", "{" TENSOR("w.x", "F32", "[1]", -4, 0) "}", 4, KEEL_E_FORMAT,
                   "'w.x'");
    expect_st_fail("offsets_beyond.safetensors", "{" TENSOR("w.x", "F32", "[2]", 0, 8) "}", 4, KEEL_E_FORMAT,
                   "'w.x'");
    expect_st_fail("begin_gt_end.safetensors", "{" TENSOR("w.x", "F32", "[0]", 4, 0) "}", 4, KEEL_E_FORMAT,
                   "'w.x'");
    expect_st_fail("size.safetensors", "{" TENSOR("w.x", "F32", "[3]", 0, 8) "}", 8, KEEL_E_SHAPE, "'w.x'");
    expect_st_fail("overflow.safetensors",
                   "{" TENSOR("w.x", "F32", "[4294967296,4294967296,4294967296]", 0, 8) "}", 8, KEEL_E_SHAPE,
                   "'w.x'");
    expect_st_fail("overflow_bytes.safetensors", "{" TENSOR("w.x", "F64", "[1125899906842624,4096]", 0, 8) "}", 8,
                   KEEL_E_SHAPE, "'w.x'");
    expect_st_fail("overlap.safetensors",
                   "{" TENSOR("w.a", "U8", "[4]", 0, 4) "," TENSOR("w.b", "U8", "[4]", 2, 6) "}", 6, KEEL_E_FORMAT,
                   "'w.b'");
    expect_st_fail("hole.safetensors", "{" TENSOR("w.a", "U8", "[2]", 0, 2) "," TENSOR("w.b", "U8", "[2]", 4, 6) "}",
                   6, KEEL_E_FORMAT, "'w.b'");
    expect_st_fail("hole_start.safetensors", "{" TENSOR("w.a", "U8", "[2]", 2, 4) "}", 4, KEEL_E_FORMAT, "'w.a'");
    expect_st_fail("trailing_data.safetensors", "{" TENSOR("w.a", "U8", "[2]", 0, 2) "}", 5, KEEL_E_FORMAT, "'w.a'");
    expect_st_fail("data_no_tensors.safetensors", "{}", 5, KEEL_E_FORMAT, NULL);
    expect_st_fail("dup.safetensors", "{" TENSOR("w.a", "U8", "[2]", 0, 2) "," TENSOR("w.a", "U8", "[2]", 2, 4) "}",
                   4, KEEL_E_FORMAT, "'w.a'");
    /* a file that is not a regular file */
    expect_open_fail("/dev/null", KEEL_E_IO, NULL);
}

static void test_file_valid_edges(void **state) {
    (void)state;
    /* header keys in any order, data tiled out of key order, zero-size tensors, unknown fields ignored */
    const char *p = tpath("edges.safetensors");
    write_st(p,
             "{\"z\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2],\"extra\":1},"
             "\"e\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[2,2]},"
             "\"a\":{\"dtype\":\"I16\",\"shape\":[],\"data_offsets\":[2,4]}}   \n",
             4);
    keel_st st;
    keel_err err = {0};
    keel_code rc = keel_st_open(&st, p, &err);
    if (rc) print_error("%s\n", err.msg);
    assert_int_equal(rc, KEEL_OK);
    assert_string_equal(st.tensors[0].name, "a");
    assert_string_equal(st.tensors[1].name, "e");
    assert_string_equal(st.tensors[2].name, "z");
    assert_int_equal(st.tensors[0].ndim, 0);
    assert_int_equal(st.tensors[0].numel, 1);
    assert_int_equal(st.tensors[1].numel, 0);
    assert_int_equal(st.tensors[1].nbytes, 0);
    assert_int_equal(((const uint8_t *)st.tensors[0].data)[0], 2);
    keel_st_free(&st);
}

/* ---- writer ------------------------------------------------------------------------------------------------ */

static void test_writer_add_errors(void **state) {
    (void)state;
    keel_st_writer w;
    keel_st_writer_init(&w);
    float x[4] = {0};
    int64_t s[KEEL_ST_MAX_DIMS + 1] = {2, 2, 1, 1, 1, 1, 1, 1, 1};
    keel_err err = {0};
    assert_int_equal(keel_st_writer_add(&w, "x", KEEL_DT_F32, 2, s, x, &err), KEEL_OK);
    assert_int_equal(keel_st_writer_add(&w, "x", KEEL_DT_F32, 2, s, x, &err), KEEL_E_ARG);
    assert_non_null(strstr(err.msg, "'x'"));
    assert_non_null(strstr(err.msg, "twice"));
    assert_int_equal(keel_st_writer_add(&w, "y", KEEL_DT_F32, KEEL_ST_MAX_DIMS + 1, s, x, &err), KEEL_E_ARG);
    assert_non_null(strstr(err.msg, "'y'"));
    assert_int_equal(keel_st_writer_add(&w, "y", KEEL_DT_F32, -1, s, x, &err), KEEL_E_ARG);
    int64_t neg[2] = {2, -2};
    assert_int_equal(keel_st_writer_add(&w, "y", KEEL_DT_F32, 2, neg, x, &err), KEEL_E_ARG);
    assert_non_null(strstr(err.msg, "negative"));
    int64_t huge[3] = {INT64_C(1) << 40, INT64_C(1) << 40, INT64_C(1) << 40};
    assert_int_equal(keel_st_writer_add(&w, "y", KEEL_DT_F32, 3, huge, x, &err), KEEL_E_ARG);
    assert_non_null(strstr(err.msg, "overflow"));
    assert_int_equal(keel_st_writer_add(&w, "y", KEEL_DT_F32, 2, s, NULL, &err), KEEL_E_ARG);
    assert_int_equal(keel_st_writer_add(&w, "y", KEEL_DT_F32, 2, NULL, x, &err), KEEL_E_ARG);
    assert_int_equal(keel_st_writer_add(&w, "", KEEL_DT_F32, 2, s, x, &err), KEEL_E_ARG);
    assert_int_equal(keel_st_writer_add(&w, "__metadata__", KEEL_DT_F32, 2, s, x, &err), KEEL_E_ARG);
    assert_int_equal(keel_st_writer_add(&w, "y", KEEL_DT_COUNT, 2, s, x, &err), KEEL_E_ARG);
    assert_int_equal(w.n, 1);
    keel_st_writer_free(&w);
}

/* Entries of g_dir whose names start with `prefix` + ".tmp.". */
static int count_temps(const char *prefix) {
    char want[256];
    snprintf(want, sizeof want, "%s.tmp.", prefix);
    DIR *d = opendir(g_dir);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strncmp(e->d_name, want, strlen(want)) == 0) n++;
    closedir(d);
    return n;
}

static void test_atomic_write(void **state) {
    (void)state;
    const char *p = tpath("atomic.safetensors");
    static float small[4] = {1, 2, 3, 4};
    int64_t s4[1] = {4};
    keel_st_writer w;
    keel_st_writer_init(&w);
    assert_int_equal(keel_st_writer_add(&w, "small", KEEL_DT_F32, 1, s4, small, NULL), KEEL_OK);
    assert_int_equal(keel_st_writer_write(&w, p, NULL), KEEL_OK);
    assert_int_equal(count_temps("atomic.safetensors"), 0);
    keel_st_writer_free(&w);
    size_t n0;
    uint8_t *before = read_bytes(p, &n0);

    /* a write that fails midway (file size limit) leaves the old file and no temporary file */
    size_t nbig = 1 << 16;
    float *big = calloc(nbig, sizeof *big);
    int64_t sb[1] = {(int64_t)nbig};
    keel_st_writer_init(&w);
    assert_int_equal(keel_st_writer_add(&w, "big", KEEL_DT_F32, 1, sb, big, NULL), KEEL_OK);
    struct rlimit old, lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
    lim = old;
    lim.rlim_cur = 4096;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    keel_err err = {0};
    keel_code rc = keel_st_writer_write(&w, p, &err);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, prev);
    assert_int_equal(rc, KEEL_E_IO);
    assert_non_null(strstr(err.msg, p));
    assert_int_equal(count_temps("atomic.safetensors"), 0);
    size_t n1;
    uint8_t *after = read_bytes(p, &n1);
    assert_int_equal(n0, n1);
    assert_memory_equal(before, after, n0);
    free(after);

    /* a path in a missing directory, and a path under a regular file */
    char bad[1024];
    snprintf(bad, sizeof bad, "%s/no/such/dir/x.safetensors", g_dir);
    assert_int_equal(keel_st_writer_write(&w, bad, &err), KEEL_E_IO);
    assert_non_null(strstr(err.msg, bad));
    snprintf(bad, sizeof bad, "%s/x.safetensors", p);
    assert_int_equal(keel_st_writer_write(&w, bad, &err), KEEL_E_IO);
    after = read_bytes(p, &n1);
    assert_memory_equal(before, after, n0);
    free(after);

    /* a rename that fails (the target is a directory) removes the temporary file */
    const char *dp = tpath("atomic_dir.safetensors");
    mkdir(dp, 0755);
    assert_int_equal(keel_st_writer_write(&w, dp, &err), KEEL_E_IO);
    assert_non_null(strstr(err.msg, "rename"));
    assert_int_equal(count_temps("atomic_dir.safetensors"), 0);

    /* overwriting with success replaces the content and leaves no temporary file */
    assert_int_equal(keel_st_writer_write(&w, p, &err), KEEL_OK);
    assert_int_equal(count_temps("atomic.safetensors"), 0);
    keel_st st;
    assert_int_equal(keel_st_open(&st, p, &err), KEEL_OK);
    assert_non_null(keel_st_find(&st, "big"));
    assert_null(keel_st_find(&st, "small"));
    keel_st_free(&st);
    keel_st_writer_free(&w);
    free(before);
    free(big);
}

static int setup(void **state) {
    (void)state;
    return tk_tmpdir(g_dir, sizeof g_dir, "test_safetensors");
}

static int teardown(void **state) {
    (void)state;
    return tk_rmtree(g_dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtype_table),        cmocka_unit_test(test_dtype_f32),
        cmocka_unit_test(test_roundtrip_all_dtypes), cmocka_unit_test(test_roundtrip_no_meta_no_tensors),
        cmocka_unit_test(test_parse_buffer),       cmocka_unit_test(test_fixture),
        cmocka_unit_test(test_sharded),            cmocka_unit_test(test_shard_errors),
        cmocka_unit_test(test_file_errors),        cmocka_unit_test(test_file_valid_edges),
        cmocka_unit_test(test_writer_add_errors),  cmocka_unit_test(test_atomic_write),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
