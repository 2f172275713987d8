/* cli: keel run and keel logits through the binary ($KEEL_BIN) on the reference fixture: greedy ids and
 * teacher-forced logits against the float64 reference, the context stop, seeded sampling, and every bad input
 * (token id out of range, prompt longer than the context, missing or mismatched tokenizer, bad options). */
#include <cjson/cJSON.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "format/format.h"
#include "tokenizer/tokenizer.h"
#include "common/testkit.h"

static char g_bin[2048], g_fix[2048], g_tmp[2048];
static keel_st g_ref;
static const int32_t *g_tokens, *g_greedy;
static int g_prompt_len;

static char g_out[1 << 16], g_err[1 << 16];

/* Runs `keel ARGS` (args already shell-quoted), capturing stdout and stderr; returns the exit status. */
static int keel(const char *fmt, ...) {
    char args[8192], cmd[16384], o[2200], e[2200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(o, sizeof o, "%s/run.out", g_tmp);
    snprintf(e, sizeof e, "%s/run.err", g_tmp);
    /* the CPU engine (the default is cuda where a GPU is present), one thread unless the test asks for more: the
     * machines running tests are small and shared */
    snprintf(cmd, sizeof cmd, "'%s' %s --backend cpu%s >'%s' 2>'%s'", g_bin, args,
             strstr(args, "--threads") ? "" : " --threads 1", o, e);
    int st = system(cmd);
    tk_slurp(o, g_out, sizeof g_out);
    tk_slurp(e, g_err, sizeof g_err);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* Copies a captured output, cut to cap. */
static void keep(char *dst, size_t cap, const char *src) {
    size_t n = strlen(src);
    if (n >= cap) n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = 0;
}

static void ids_text(const int32_t *ids, int n, char *buf, size_t cap, const char *sep) {
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < n && at < cap; i++) at += (size_t)snprintf(buf + at, cap - at, "%s%d", i ? sep : "", ids[i]);
}

static int setup(void **state) {
    (void)state;
    const char *b = getenv("KEEL_BIN"), *f = getenv("KEEL_FIXTURES"), *t = getenv("KEEL_TMP");
    if (!b || !f || !t) {
        print_message("KEEL_BIN, KEEL_FIXTURES and KEEL_TMP must be set\n");
        return -1;
    }
    snprintf(g_bin, sizeof g_bin, "%s", b);
    snprintf(g_fix, sizeof g_fix, "%s/nemotron_h_tiny", f);
    snprintf(g_tmp, sizeof g_tmp, "%s/cli_run", t);
    mkdir(g_tmp, 0755);
    char path[2200];
    snprintf(path, sizeof path, "%s/reference.safetensors", g_fix);
    keel_err err = {0};
    if (keel_st_open(&g_ref, path, &err) != KEEL_OK) {
        print_message("%s\n", err.msg);
        return -1;
    }
    g_tokens = keel_st_find(&g_ref, "tokens")->data;
    g_greedy = keel_st_find(&g_ref, "greedy_tokens")->data;
    g_prompt_len = atoi(keel_st_meta_get(&g_ref, "prompt_len"));
    return 0;
}

static int teardown(void **state) {
    (void)state;
    keel_st_free(&g_ref);
    return 0;
}

static void test_greedy_ids(void **state) {
    (void)state;
    char toks[4096], want[4096];
    ids_text(g_tokens, g_prompt_len, toks, sizeof toks, ",");
    ids_text(g_greedy, 24, want, sizeof want, " ");
    assert_int_equal(keel("run '%s' --tokens %s -n 24 --greedy --ids --threads 2", g_fix, toks), 0);
    g_out[strcspn(g_out, "\n")] = 0;
    assert_string_equal(g_out, want);
    assert_non_null(strstr(g_err, "tokens/s"));
    /* greedy is temperature 0 */
    assert_int_equal(keel("run '%s' --tokens %s -n 24 --temp 0 --ids", g_fix, toks), 0);
    g_out[strcspn(g_out, "\n")] = 0;
    assert_string_equal(g_out, want);
}

static void test_context_stop(void **state) {
    (void)state;
    char toks[4096], want[256];
    ids_text(g_tokens, g_prompt_len, toks, sizeof toks, ",");
    ids_text(g_greedy, 2, want, sizeof want, " ");
    assert_int_equal(keel("run '%s' --tokens %s -n 10 --greedy --ids --ctx %d", g_fix, toks, g_prompt_len + 2), 0);
    g_out[strcspn(g_out, "\n")] = 0;
    assert_string_equal(g_out, want);
    assert_non_null(strstr(g_err, "context limit"));
}

/* Greedy from this prompt reaches an eos id of the fixture (2 or 11): the run stops there, and --ignore-eos
 * goes through it. */
static void test_eos_stop(void **state) {
    (void)state;
    char toks[4096], stopped[4096];
    int32_t t[128];
    for (int i = 0; i < 128; i++) t[i] = i * 37 % 490 + 14;
    ids_text(t, 128, toks, sizeof toks, ",");
    assert_int_equal(keel("run '%s' --tokens %s -n 40 --greedy --ids", g_fix, toks), 0);
    assert_non_null(strstr(g_err, "end of sequence"));
    g_out[strcspn(g_out, "\n")] = 0;
    keep(stopped, sizeof stopped, g_out);
    int n_stopped = 0;
    for (char *p = stopped; *p; p++) n_stopped += *p == ' ';
    n_stopped += stopped[0] != 0;
    assert_true(n_stopped < 40);
    assert_int_equal(keel("run '%s' --tokens %s -n 40 --greedy --ids --ignore-eos", g_fix, toks), 0);
    assert_non_null(strstr(g_err, "token budget"));
    size_t k = strlen(stopped);
    assert_memory_equal(g_out, stopped, k); /* the same tokens up to the stop */
    long next = strtol(g_out + k, NULL, 10);
    assert_true(next == 2 || next == 11);   /* then the eos id itself */
}

static void test_seeded_sampling(void **state) {
    (void)state;
    char toks[4096], a[4096], b[4096];
    ids_text(g_tokens, g_prompt_len, toks, sizeof toks, ",");
    assert_int_equal(keel("run '%s' --tokens %s -n 24 --temp 1.0 --top-p 1 --min-p 0 --seed 5 --ids", g_fix, toks), 0);
    keep(a, sizeof a, g_out);
    assert_int_equal(keel("run '%s' --tokens %s -n 24 --temp 1.0 --top-p 1 --min-p 0 --seed 5 --ids", g_fix, toks), 0);
    assert_string_equal(g_out, a);
    assert_int_equal(keel("run '%s' --tokens %s -n 24 --temp 1.0 --top-p 1 --min-p 0 --seed 6 --ids", g_fix, toks), 0);
    keep(b, sizeof b, g_out);
    assert_string_not_equal(a, b);
}

static void test_prompt_text(void **state) {
    (void)state;
    const char *text = "The quick brown fox";
    char path[2200], toks[4096], via_ids[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", g_fix);
    keel_tokenizer *t = NULL;
    keel_err err = {0};
    assert_int_equal(keel_tokenizer_load(&t, path, &err), KEEL_OK);
    int32_t *ids = NULL;
    int n = 0;
    assert_int_equal(keel_tokenizer_encode(t, text, strlen(text), &ids, &n, &err), KEEL_OK);
    assert_true(n > 0);
    ids_text(ids, n, toks, sizeof toks, ",");
    assert_int_equal(keel("run '%s' --tokens %s -n 12 --greedy --ids", g_fix, toks), 0);
    keep(via_ids, sizeof via_ids, g_out);
    assert_int_equal(keel("run '%s' --prompt '%s' -n 12 --greedy --ids", g_fix, text), 0);
    assert_string_equal(g_out, via_ids);
    /* the streamed text is the decoding of those ids */
    int32_t gen[64];
    int ng = 0;
    for (char *p = via_ids; *p && ng < 64;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p) break;
        gen[ng++] = (int32_t)v;
        p = end;
    }
    assert_int_equal(ng, 12);
    char *dec = NULL;
    size_t dl = 0;
    assert_int_equal(keel_tokenizer_decode(t, gen, ng, &dec, &dl, &err), KEEL_OK);
    assert_int_equal(keel("run '%s' --prompt '%s' -n 12 --greedy", g_fix, text), 0);
    bool valid_utf8_only = true;
    for (size_t i = 0; i < dl; i++) valid_utf8_only &= (unsigned char)dec[i] < 0x80;
    if (valid_utf8_only) { /* with ASCII output the stream equals the decoded bytes exactly */
        assert_int_equal(strlen(g_out), dl + 1);
        assert_memory_equal(g_out, dec, dl);
    }
    free(dec);
    free(ids);
    keel_tokenizer_free(t);
}

static const float *tensor(keel_st *st, const char *name, int64_t numel) {
    return tk_st_tensor(st, name, KEEL_DT_F32, numel);
}

static void test_logits_file(void **state) {
    (void)state;
    char toks[4096], out[2200];
    ids_text(g_tokens, 48, toks, sizeof toks, ",");
    snprintf(out, sizeof out, "%s/logits.safetensors", g_tmp);
    assert_int_equal(keel("logits '%s' --tokens %s --out '%s' --mtp", g_fix, toks, out), 0);
    keel_st st;
    keel_err err = {0};
    assert_int_equal(keel_st_open(&st, out, &err), KEEL_OK);
    const float *l = tensor(&st, "logits", 48 * 512), *rl = tensor(&g_ref, "logits", 48 * 512);
    const float *h = tensor(&st, "hidden", 48 * 256), *rh = tensor(&g_ref, "hidden", 48 * 256);
    const float *m = tensor(&st, "mtp_logits", 47 * 512), *rm = tensor(&g_ref, "mtp_logits", 47 * 512);
    for (int i = 0; i < 48 * 512; i++) assert_true(fabsf(l[i] - rl[i]) <= 1e-3f);
    for (int i = 0; i < 48 * 256; i++) assert_true(fabsf(h[i] - rh[i]) <= 1e-3f);
    for (int i = 0; i < 47 * 512; i++) assert_true(fabsf(m[i] - rm[i]) <= 1e-3f);
    keel_st_free(&st);
    /* without --mtp there is no mtp_logits */
    assert_int_equal(keel("logits '%s' --tokens 1,2,3 --out '%s'", g_fix, out), 0);
    assert_int_equal(keel_st_open(&st, out, &err), KEEL_OK);
    assert_null(keel_st_find(&st, "mtp_logits"));
    assert_non_null(keel_st_find(&st, "logits"));
    keel_st_free(&st);
}

static void test_bad_token_id(void **state) {
    (void)state;
    assert_int_not_equal(keel("run '%s' --tokens 1,2,999 --ids", g_fix), 0);
    assert_non_null(strstr(g_err, "999"));
    assert_non_null(strstr(g_err, "512"));
    assert_int_not_equal(keel("logits '%s' --tokens 5,-1 --out '%s/x.safetensors'", g_fix, g_tmp), 0);
    assert_non_null(strstr(g_err, "-1"));
    assert_int_not_equal(keel("run '%s' --tokens 1,,2 --ids", g_fix), 0);
    assert_non_null(strstr(g_err, "--tokens"));
}

static void test_prompt_longer_than_context(void **state) {
    (void)state;
    char toks[4096];
    ids_text(g_tokens, 20, toks, sizeof toks, ",");
    assert_int_not_equal(keel("run '%s' --tokens %s --ctx 10 --ids", g_fix, toks), 0);
    assert_non_null(strstr(g_err, "20"));
    assert_non_null(strstr(g_err, "10"));
    assert_int_not_equal(keel("run '%s' --tokens 1,2 --ctx 5000 --ids", g_fix), 0);
    assert_non_null(strstr(g_err, "4096"));
}

/* A model directory holding links to the fixture's config and weights, without a tokenizer. */
static void model_dir_without_tokenizer(const char *dir) {
    char src[2200], dst[2200];
    mkdir(dir, 0755);
    const char *files[] = {"config.json", "model.safetensors"};
    for (int i = 0; i < 2; i++) {
        snprintf(src, sizeof src, "%s/%s", g_fix, files[i]);
        snprintf(dst, sizeof dst, "%s/%s", dir, files[i]);
        unlink(dst);
        assert_int_equal(symlink(src, dst), 0);
    }
}

static void test_missing_tokenizer(void **state) {
    (void)state;
    char dir[2200];
    snprintf(dir, sizeof dir, "%s/no_tokenizer", g_tmp);
    model_dir_without_tokenizer(dir);
    assert_int_not_equal(keel("run '%s' --prompt hello -n 2", dir), 0);
    assert_non_null(strstr(g_err, "tokenizer.json"));
    /* ids in, ids out needs no tokenizer */
    assert_int_equal(keel("run '%s' --tokens 5,6 -n 2 --greedy --ids", dir), 0);
}

static void test_tokenizer_vocab_mismatch(void **state) {
    (void)state;
    char dir[2200], path[2300];
    snprintf(dir, sizeof dir, "%s/big_tokenizer", g_tmp);
    model_dir_without_tokenizer(dir);
    snprintf(path, sizeof path, "%s/tokenizer.json", g_fix);
    char *json = NULL;
    size_t len = 0;
    keel_err err = {0};
    assert_int_equal(keel_read_file(path, &json, &len, &err), KEEL_OK);
    cJSON *root = cJSON_Parse(json);
    assert_non_null(root);
    cJSON *added = cJSON_GetObjectItem(root, "added_tokens");
    assert_non_null(added);
    cJSON *tok = cJSON_CreateObject();
    cJSON_AddNumberToObject(tok, "id", 700);
    cJSON_AddStringToObject(tok, "content", "<|beyond|>");
    cJSON_AddBoolToObject(tok, "single_word", 0);
    cJSON_AddBoolToObject(tok, "lstrip", 0);
    cJSON_AddBoolToObject(tok, "rstrip", 0);
    cJSON_AddBoolToObject(tok, "normalized", 0);
    cJSON_AddBoolToObject(tok, "special", 1);
    cJSON_AddItemToArray(added, tok);
    char *text = cJSON_PrintUnformatted(root);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    free(text);
    cJSON_Delete(root);
    free(json);
    assert_int_not_equal(keel("run '%s' --prompt hello -n 2", dir), 0);
    assert_non_null(strstr(g_err, "701"));
    assert_non_null(strstr(g_err, "512"));
}

static void test_bad_options(void **state) {
    (void)state;
    assert_int_not_equal(keel("run '%s' --tokens 1 --temp abc", g_fix), 0);
    assert_non_null(strstr(g_err, "--temp"));
    assert_int_not_equal(keel("run '%s' --tokens 1 --prompt hi", g_fix), 0);
    assert_non_null(strstr(g_err, "exactly one"));
    assert_int_not_equal(keel("run '%s' -n 3", g_fix), 0);
    assert_int_not_equal(keel("logits '%s' --tokens 1,2", g_fix), 0);
    assert_non_null(strstr(g_err, "--out"));
    assert_int_not_equal(keel("run '%s' --tokens 1 --greedy --temp 0.5", g_fix), 0);
    assert_int_not_equal(keel("run '%s' --tokens 1 --frobnicate 3", g_fix), 0);
    assert_non_null(strstr(g_err, "--frobnicate"));
    assert_int_not_equal(keel("run '%s/nope' --tokens 1", g_tmp), 0);
    assert_non_null(strstr(g_err, "nope"));
    assert_int_not_equal(keel("logits '%s' --tokens 7 --mtp --out '%s/x.safetensors'", g_fix, g_tmp), 0);
    assert_non_null(strstr(g_err, "--mtp"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_ids),        cmocka_unit_test(test_context_stop),
        cmocka_unit_test(test_eos_stop),          cmocka_unit_test(test_seeded_sampling),   cmocka_unit_test(test_prompt_text),
        cmocka_unit_test(test_logits_file),       cmocka_unit_test(test_bad_token_id),
        cmocka_unit_test(test_prompt_longer_than_context), cmocka_unit_test(test_missing_tokenizer),
        cmocka_unit_test(test_tokenizer_vocab_mismatch),   cmocka_unit_test(test_bad_options),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
