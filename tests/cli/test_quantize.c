/* cli/quantize: `keel quantize` end to end: what it writes, its metadata, plans, and every refusal. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "format/format.h"
#include "common/testkit.h"

static const char *bin, *tmp;

static char *tmp_path(const char *name) {
    static char buf[8][1024];
    static int next;
    char *p = buf[next++ % 8];
    snprintf(p, sizeof buf[0], "%s/cli_quantize_%s", tmp, name);
    return p;
}

/* Runs `keel quantize ARGS`; returns the exit status and leaves stderr in err_out. */
static int run(const char *args, char *err_out, size_t cap) {
    char cmd[4096], errf[1024];
    snprintf(errf, sizeof errf, "%s/cli_quantize_stderr.txt", tmp); /* not tmp_path: its slots rotate */
    snprintf(cmd, sizeof cmd, "'%s' quantize %s >/dev/null 2>'%s'", bin, args, errf);
    int st = system(cmd);
    tk_slurp(errf, err_out, cap);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static void expect_fail(const char *args, const char *const *needles) {
    char msg[4096];
    int rc = run(args, msg, sizeof msg);
    if (rc == 0) fail_msg("keel quantize %s succeeded, expected failure", args);
    if (rc >= 128) fail_msg("keel quantize %s crashed (status %d): %s", args, rc, msg);
    for (int i = 0; needles[i]; i++)
        if (!strstr(msg, needles[i])) fail_msg("keel quantize %s: message lacks '%s': %s", args, needles[i], msg);
}

static uint64_t rng = 0x1234567887654321ull;
static float frand(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((double)(rng >> 11) * 0x1p-53 * 2.0 - 1.0);
}

/* The shared input: a F32 matrix, a BF16 expert stack, a conv kernel (C, K, 1), a 1-D norm and an I32 tensor. */
enum { AN = 24, AK = 128, EE = 2, EO = 16, EI = 64, CC = 8, CK = 4 };
static float a_w[AN * AK];
static uint16_t e_w[EE * EO * EI], c_w[CC * CK], n_w[AK];
static int32_t ids[5] = {1, 2, 3, 4, 5};

static void write_input(const char *path) {
    for (int i = 0; i < AN * AK; i++) a_w[i] = frand() * (i % 7 == 0 ? 5.0f : 1.0f);
    for (int i = 0; i < EE * EO * EI; i++) e_w[i] = keel_f32_to_bf16(frand() - 0.5f);
    for (int i = 0; i < CC * CK; i++) c_w[i] = keel_f32_to_bf16(frand());
    for (int i = 0; i < AK; i++) n_w[i] = keel_f32_to_bf16(1.0f + frand() * 0.1f);
    keel_st_writer w;
    keel_st_writer_init(&w);
    keel_err err = {0};
    const int64_t as[2] = {AN, AK}, es[3] = {EE, EO, EI}, cs[3] = {CC, CK, 1}, ns[1] = {AK}, is[1] = {5};
    assert_int_equal(keel_st_writer_add(&w, "model.a.weight", KEEL_DT_F32, 2, as, a_w, &err), KEEL_OK);
    assert_int_equal(keel_st_writer_add(&w, "model.experts.weight", KEEL_DT_BF16, 3, es, e_w, &err), KEEL_OK);
    assert_int_equal(keel_st_writer_add(&w, "model.conv1d.weight", KEEL_DT_BF16, 3, cs, c_w, &err), KEEL_OK);
    assert_int_equal(keel_st_writer_add(&w, "model.norm.weight", KEEL_DT_BF16, 1, ns, n_w, &err), KEEL_OK);
    assert_int_equal(keel_st_writer_add(&w, "model.ids", KEEL_DT_I32, 1, is, ids, &err), KEEL_OK);
    keel_st_writer_meta(&w, "format", "mlx");
    keel_st_writer_meta(&w, "quantization", "stale");
    if (keel_st_writer_write(&w, path, &err) != KEEL_OK) fail_msg("write %s: %s", path, err.msg);
    keel_st_writer_free(&w);
}

/* A quantized matrix in the output equals the library quantizer on the same floats, and dequantizes to within one
 * step |scale| of the input (the MLX rule clips at most one step at the top code) plus the scale dtype's rounding. */
static void check_quantized(const keel_st *st, const char *base, const float *w, int ndim, const int64_t *shape,
                            int bits, int group, keel_dtype sdt) {
    int64_t k = shape[ndim - 1], rows = 1;
    for (int d = 0; d < ndim - 1; d++) rows *= shape[d];
    int64_t qs[3], ss[3];
    for (int d = 0; d < ndim; d++) qs[d] = ss[d] = shape[d];
    qs[ndim - 1] = k * bits / 32;
    ss[ndim - 1] = k / group;
    char name[256];
    snprintf(name, sizeof name, "%s.weight", base);
    const keel_st_tensor *tw = tk_st_need(st, name, KEEL_DT_U32, ndim, qs);
    snprintf(name, sizeof name, "%s.scales", base);
    const keel_st_tensor *ts = tk_st_need(st, name, sdt, ndim, ss);
    snprintf(name, sizeof name, "%s.biases", base);
    const keel_st_tensor *tb = tk_st_need(st, name, sdt, ndim, ss);
    uint32_t *codes = malloc(tw->nbytes);
    void *sc = malloc(ts->nbytes), *bi = malloc(tb->nbytes);
    keel_quant_quantize(w, (int)rows, (int)k, bits, group, sdt, codes, sc, bi);
    assert_memory_equal(codes, tw->data, tw->nbytes);
    assert_memory_equal(sc, ts->data, ts->nbytes);
    assert_memory_equal(bi, tb->data, tb->nbytes);
    keel_qmat m = {.n = (int)rows, .k = (int)k, .bits = bits, .group = group, .sdt = sdt, .w = tw->data,
                   .scales = ts->data, .biases = tb->data};
    float *wd = malloc(sizeof(float) * rows * k);
    keel_quant_dequantize(&m, wd);
    double rel = sdt == KEEL_DT_BF16 ? 0x1p-8 : sdt == KEEL_DT_F16 ? 0x1p-11 : 0x1p-24;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < k; c++) {
            double s = fabs(keel_dtype_get_f32(sdt, ts->data, (size_t)(r * (k / group) + c / group)));
            double b = fabs(keel_dtype_get_f32(sdt, tb->data, (size_t)(r * (k / group) + c / group)));
            double nb = (double)((1 << bits) - 1);
            /* one step, the stored roundings of scale and bias, float32 dequantization and the code's division */
            double bound = s * (1 + rel) + rel * (nb * s + b) + 0x1p-22 * (2 * nb * s + b + 2 * s);
            double e = fabs((double)wd[r * k + c] - w[r * k + c]);
            if (!(e <= bound)) fail_msg("%s[%lld,%lld]: error %.3g > %.3g", base, (long long)r, (long long)c, e, bound);
        }
    free(wd);
    free(codes);
    free(sc);
    free(bi);
}

static void check_copied(const keel_st *st, const char *name, keel_dtype dt, const void *data, size_t nbytes) {
    const keel_st_tensor *t = keel_st_find(st, name);
    if (!t) fail_msg("output lacks %s", name);
    assert_int_equal(t->dtype, dt);
    assert_int_equal(t->nbytes, nbytes);
    assert_memory_equal(t->data, data, nbytes);
}

static cJSON *quant_meta(const keel_st *st) {
    const char *q = keel_st_meta_get(st, "quantization");
    assert_non_null(q);
    cJSON *j = cJSON_Parse(q);
    if (!j) fail_msg("quantization metadata is not JSON: %s", q);
    return j;
}

static void test_defaults(void **state) {
    (void)state;
    char *in = tmp_path("in.safetensors"), *out = tmp_path("out.safetensors"), args[4096], msg[4096];
    write_input(in);
    unlink(out);
    snprintf(args, sizeof args, "'%s' '%s' --bits 5 --group 32", in, out);
    if (run(args, msg, sizeof msg) != 0) fail_msg("keel quantize %s: %s", args, msg);
    keel_st st;
    keel_err err = {0};
    if (keel_st_open(&st, out, &err) != KEEL_OK) fail_msg("%s", err.msg);
    const int64_t as[2] = {AN, AK}, es[3] = {EE, EO, EI};
    check_quantized(&st, "model.a", a_w, 2, as, 5, 32, KEEL_DT_F32); /* scales follow the weight's dtype */
    float *ef = malloc(sizeof(float) * EE * EO * EI);
    for (int i = 0; i < EE * EO * EI; i++) ef[i] = keel_bf16_to_f32(e_w[i]);
    check_quantized(&st, "model.experts", ef, 3, es, 5, 32, KEEL_DT_BF16);
    free(ef);
    check_copied(&st, "model.conv1d.weight", KEEL_DT_BF16, c_w, sizeof c_w);
    check_copied(&st, "model.norm.weight", KEEL_DT_BF16, n_w, sizeof n_w);
    check_copied(&st, "model.ids", KEEL_DT_I32, ids, sizeof ids);
    assert_null(keel_st_find(&st, "model.norm.scales"));
    assert_null(keel_st_find(&st, "model.conv1d.scales"));
    assert_int_equal(st.n_tensors, 3 + 3 + 3);
    assert_string_equal(keel_st_meta_get(&st, "format"), "mlx");
    cJSON *q = quant_meta(&st);
    cJSON *want = cJSON_Parse("{\"group_size\": 32, \"bits\": 5, \"mode\": \"affine\"}");
    assert_true(cJSON_Compare(q, want, true));
    cJSON_Delete(q);
    cJSON_Delete(want);
    keel_st_free(&st);
}

static void test_plan_and_scales(void **state) {
    (void)state;
    char *in = tmp_path("in.safetensors"), *out = tmp_path("out2.safetensors"), *plan = tmp_path("plan.json");
    char args[4096], msg[4096];
    write_input(in);
    FILE *f = fopen(plan, "w");
    fputs("{\"model.a\": {\"bits\": 8, \"group_size\": 128, \"mode\": \"affine\"}, \"model.experts\": false}", f);
    fclose(f);
    snprintf(args, sizeof args, "'%s' '%s' --bits 3 --group 64 --scales f16 --plan '%s'", in, out, plan);
    if (run(args, msg, sizeof msg) != 0) fail_msg("keel quantize %s: %s", args, msg);
    keel_st st;
    keel_err err = {0};
    if (keel_st_open(&st, out, &err) != KEEL_OK) fail_msg("%s", err.msg);
    const int64_t as[2] = {AN, AK};
    check_quantized(&st, "model.a", a_w, 2, as, 8, 128, KEEL_DT_F16);
    check_copied(&st, "model.experts.weight", KEEL_DT_BF16, e_w, sizeof e_w);
    assert_null(keel_st_find(&st, "model.experts.scales"));
    cJSON *q = quant_meta(&st);
    cJSON *want = cJSON_Parse("{\"group_size\": 64, \"bits\": 3, \"mode\": \"affine\", "
                              "\"model.a\": {\"group_size\": 128, \"bits\": 8}, \"model.experts\": false}");
    assert_true(cJSON_Compare(q, want, true));
    cJSON_Delete(q);
    cJSON_Delete(want);
    keel_st_free(&st);
}

static void test_argument_errors(void **state) {
    (void)state;
    char *in = tmp_path("in.safetensors"), *out = tmp_path("never.safetensors"), args[4096];
    write_input(in);
    unlink(out);
    expect_fail("", (const char *const[]){"missing IN or OUT", "usage", NULL});
    snprintf(args, sizeof args, "'%s' '%s' --group 64", in, out);
    expect_fail(args, (const char *const[]){"missing --bits", NULL});
    snprintf(args, sizeof args, "'%s' '%s' --bits 4", in, out);
    expect_fail(args, (const char *const[]){"missing --group", NULL});
    snprintf(args, sizeof args, "'%s' '%s' --bits 7 --group 64", in, out);
    expect_fail(args, (const char *const[]){"--bits 7", "2, 3, 4, 5, 6 or 8", NULL});
    snprintf(args, sizeof args, "'%s' '%s' --bits four --group 64", in, out);
    expect_fail(args, (const char *const[]){"--bits four", NULL});
    snprintf(args, sizeof args, "'%s' '%s' --bits 4 --group 48", in, out);
    expect_fail(args, (const char *const[]){"--group 48", "32, 64 or 128", NULL});
    snprintf(args, sizeof args, "'%s' '%s' --bits 4 --group 64 --scales f8", in, out);
    expect_fail(args, (const char *const[]){"--scales f8", "bf16, f16 or f32", NULL});
    snprintf(args, sizeof args, "'%s' '%s' --group 64 --bits", in, out);
    expect_fail(args, (const char *const[]){"--bits needs a value", NULL});
    snprintf(args, sizeof args, "'%s' '%s' --bits 4 --group 64 --fast", in, out);
    expect_fail(args, (const char *const[]){"unknown option '--fast'", NULL});
    snprintf(args, sizeof args, "'%s' '%s' extra --bits 4 --group 64", in, out);
    expect_fail(args, (const char *const[]){"unexpected argument 'extra'", NULL});
    struct stat sb;
    assert_int_not_equal(stat(out, &sb), 0); /* nothing written on any refusal */
}

static void write_one(const char *path, const char *name, keel_dtype dt, int ndim, const int64_t *shape,
                      const void *data) {
    keel_st_writer w;
    keel_st_writer_init(&w);
    keel_err err = {0};
    assert_int_equal(keel_st_writer_add(&w, name, dt, ndim, shape, data, &err), KEEL_OK);
    if (keel_st_writer_write(&w, path, &err) != KEEL_OK) fail_msg("write %s: %s", path, err.msg);
    keel_st_writer_free(&w);
}

static void test_input_errors(void **state) {
    (void)state;
    char *in = tmp_path("bad.safetensors"), *out = tmp_path("never.safetensors"), args[4096];
    unlink(out);
    /* k = 96 is not a multiple of 64 */
    static float w96[4 * 96];
    const int64_t s96[2] = {4, 96};
    write_one(in, "blk.proj.weight", KEEL_DT_F32, 2, s96, w96);
    snprintf(args, sizeof args, "'%s' '%s' --bits 4 --group 64", in, out);
    expect_fail(args, (const char *const[]){"blk.proj.weight", "4 x 96", "not a multiple of group 64", NULL});
    /* unreadable input: absent, and not a safetensors file */
    snprintf(args, sizeof args, "'%s/does-not-exist.safetensors' '%s' --bits 4 --group 64", tmp, out);
    expect_fail(args, (const char *const[]){"does-not-exist.safetensors", NULL});
    char *junk = tmp_path("junk.safetensors");
    FILE *f = fopen(junk, "wb");
    fputs("this is not a safetensors file at all", f);
    fclose(f);
    snprintf(args, sizeof args, "'%s' '%s' --bits 4 --group 64", junk, out);
    expect_fail(args, (const char *const[]){"junk.safetensors", NULL});
    /* a non-finite weight */
    static float wn[2 * 64];
    wn[70] = NAN;
    const int64_t s64[2] = {2, 64};
    write_one(in, "blk.nan.weight", KEEL_DT_F32, 2, s64, wn);
    snprintf(args, sizeof args, "'%s' '%s' --bits 4 --group 64", in, out);
    expect_fail(args, (const char *const[]){"blk.nan.weight", "row 1, column 6", "finite", NULL});
    /* F32 weights whose scales overflow F16 */
    static float wl[2 * 64];
    for (int i = 0; i < 2 * 64; i++) wl[i] = (i % 2 ? 1e6f : -1e6f);
    write_one(in, "blk.large.weight", KEEL_DT_F32, 2, s64, wl);
    snprintf(args, sizeof args, "'%s' '%s' --bits 4 --group 64 --scales f16", in, out);
    expect_fail(args, (const char *const[]){"blk.large.weight", "F16", "--scales f32", NULL});
    struct stat sb;
    assert_int_not_equal(stat(out, &sb), 0);
}

static void plan_case(const char *plan_json, const char *const *needles) {
    char *in = tmp_path("in.safetensors"), *out = tmp_path("never.safetensors"), *plan = tmp_path("badplan.json");
    char args[4096];
    FILE *f = fopen(plan, "w");
    fputs(plan_json, f);
    fclose(f);
    snprintf(args, sizeof args, "'%s' '%s' --bits 4 --group 64 --plan '%s'", in, out, plan);
    expect_fail(args, needles);
    struct stat sb;
    assert_int_not_equal(stat(out, &sb), 0);
}

static void test_plan_errors(void **state) {
    (void)state;
    write_input(tmp_path("in.safetensors"));
    unlink(tmp_path("never.safetensors"));
    plan_case("{\"model.nope\": {\"bits\": 4, \"group_size\": 64}}",
              (const char *const[]){"model.nope", "no tensor 'model.nope.weight'", NULL});
    plan_case("{\"model.norm\": {\"bits\": 4, \"group_size\": 64}}",
              (const char *const[]){"model.norm.weight", "not a 2-D or 3-D float matrix", NULL});
    plan_case("{\"model.a\": {\"bits\": 7, \"group_size\": 64}}", (const char *const[]){"model.a", "bits 7", NULL});
    plan_case("{\"model.a\": {\"bits\": 4, \"group_size\": 16}}",
              (const char *const[]){"model.a", "group_size 16", "32, 64 or 128", NULL});
    plan_case("{\"model.a\": {\"bits\": 4.5}}", (const char *const[]){"model.a", "\"bits\" must be an integer", NULL});
    plan_case("{\"model.a\": {\"bits\": 4, \"width\": 2}}", (const char *const[]){"unknown key \"width\"", NULL});
    plan_case("{\"model.a\": {\"bits\": 4, \"mode\": \"mxfp4\"}}", (const char *const[]){"\"affine\"", NULL});
    plan_case("{\"model.a\": \"8bit\"}", (const char *const[]){"model.a", "expected", NULL});
    plan_case("[1, 2]", (const char *const[]){"expected a JSON object", NULL});
    plan_case("{\"model.a\": {", (const char *const[]){"not valid JSON", NULL});
    /* a plan group that does not divide the matrix: model.a has k = 128, but the experts k = 64 */
    plan_case("{\"model.experts\": {\"bits\": 4, \"group_size\": 128}}",
              (const char *const[]){"model.experts.weight", "2 x 16 x 64", "group 128", "from the plan", NULL});
    char args[4096];
    snprintf(args, sizeof args, "'%s' '%s' --bits 4 --group 64 --plan '%s/no-such-plan.json'",
             tmp_path("in.safetensors"), tmp_path("never.safetensors"), tmp);
    expect_fail(args, (const char *const[]){"plan", "no-such-plan.json", NULL});
}

/* An input that already holds name.scales beside a float name.weight cannot be quantized without a clash. */
static void test_existing_scales(void **state) {
    (void)state;
    char *in = tmp_path("clash.safetensors"), args[4096];
    static float w[2 * 64];
    static uint16_t s[2];
    const int64_t ws[2] = {2, 64}, ss[2] = {2, 1};
    keel_st_writer wr;
    keel_st_writer_init(&wr);
    keel_err err = {0};
    assert_int_equal(keel_st_writer_add(&wr, "x.weight", KEEL_DT_F32, 2, ws, w, &err), KEEL_OK);
    assert_int_equal(keel_st_writer_add(&wr, "x.scales", KEEL_DT_BF16, 2, ss, s, &err), KEEL_OK);
    assert_int_equal(keel_st_writer_write(&wr, in, &err), KEEL_OK);
    keel_st_writer_free(&wr);
    snprintf(args, sizeof args, "'%s' '%s' --bits 4 --group 64", in, tmp_path("never.safetensors"));
    expect_fail(args, (const char *const[]){"x.weight", "x.scales", NULL});
}

int main(void) {
    bin = getenv("KEEL_BIN");
    tmp = getenv("KEEL_TMP");
    if (!bin || !tmp) {
        fprintf(stderr, "KEEL_BIN and KEEL_TMP must be set\n");
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),      cmocka_unit_test(test_plan_and_scales),
        cmocka_unit_test(test_argument_errors), cmocka_unit_test(test_input_errors),
        cmocka_unit_test(test_plan_errors),   cmocka_unit_test(test_existing_scales),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
