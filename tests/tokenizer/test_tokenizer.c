/* tokenizer: ids against HF tokenizers' fixture cases, round trips, streaming decode, crafted and malformed files. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cjson/cJSON.h>

#include "tokenizer/tokenizer.h"
#include "common/testkit.h"

static char fixture_path[4096];

static const char *fixture(const char *name) {
    char rel[256];
    snprintf(rel, sizeof rel, "nemotron_h_tiny/%s", name);
    return tk_fixture(fixture_path, sizeof fixture_path, rel);
}

static cJSON *read_json(const char *path) {
    char *text;
    size_t len;
    keel_err err;
    assert_int_equal(keel_read_file(path, &text, &len, &err), KEEL_OK);
    cJSON *j = cJSON_Parse(text);
    free(text);
    assert_non_null(j);
    return j;
}

static keel_tokenizer *load_fixture(void) {
    keel_tokenizer *t;
    keel_err err;
    keel_code c = keel_tokenizer_load(&t, fixture("tokenizer.json"), &err);
    if (c) fail_msg("%s", err.msg);
    return t;
}

/* Writes j to KEEL_TMP/tokenizer_<name>.json and returns the path (static storage, one at a time). */
static const char *write_tmp(const char *name, const char *text) {
    static char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer_%s.json", tk_tmp(), name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    return path;
}

static keel_tokenizer *load_json(const char *name, cJSON *j) {
    char *text = cJSON_PrintUnformatted(j);
    const char *path = write_tmp(name, text);
    free(text);
    keel_tokenizer *t;
    keel_err err;
    keel_code c = keel_tokenizer_load(&t, path, &err);
    if (c) fail_msg("%s: %s", name, err.msg);
    return t;
}

/* Independent UTF-8 check: the whole buffer is complete, valid UTF-8. */
static int valid_utf8(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i], need, min;
        if (c < 0x80) { i++; continue; }
        if ((c & 0xe0) == 0xc0) need = 1, min = 0x80, c &= 0x1f;
        else if ((c & 0xf0) == 0xe0) need = 2, min = 0x800, c &= 0x0f;
        else if ((c & 0xf8) == 0xf0) need = 3, min = 0x10000, c &= 0x07;
        else return 0;
        if (i + need >= n) return 0;
        for (unsigned k = 1; k <= need; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return 0;
            c = (c << 6) | (s[i + k] & 0x3f);
        }
        if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return 0;
        i += need + 1;
    }
    return 1;
}

static void encode_ok(const keel_tokenizer *t, const char *s, size_t n, int32_t **ids, int *k) {
    keel_err err;
    keel_code c = keel_tokenizer_encode(t, s, n, ids, k, &err);
    if (c) fail_msg("encode: %s", err.msg);
}

static void assert_roundtrip(const keel_tokenizer *t, const char *s, size_t n) {
    int32_t *ids;
    int k;
    encode_ok(t, s, n, &ids, &k);
    char *out;
    size_t len;
    keel_err err;
    keel_code c = keel_tokenizer_decode(t, ids, k, &out, &len, &err);
    if (c) fail_msg("decode: %s", err.msg);
    assert_int_equal(len, n);
    assert_memory_equal(out, s, n);
    free(out);
    free(ids);
}

static void test_fixture_cases(void **state) {
    (void)state;
    keel_tokenizer *t = load_fixture();
    cJSON *cases = read_json(fixture("tokenizer_cases.json"));
    int count = 0;
    for (cJSON *c = cases->child; c; c = c->next, count++) {
        const char *text = cJSON_GetObjectItem(c, "text")->valuestring;
        cJSON *want = cJSON_GetObjectItem(c, "ids");
        int32_t *ids;
        int n;
        encode_ok(t, text, strlen(text), &ids, &n);
        if (n != cJSON_GetArraySize(want)) fail_msg("case %d: %d ids, expected %d", count, n, cJSON_GetArraySize(want));
        int i = 0;
        for (cJSON *w = want->child; w; w = w->next, i++)
            if (ids[i] != w->valueint) fail_msg("case %d id %d: %d, expected %d", count, i, ids[i], w->valueint);
        free(ids);
        assert_roundtrip(t, text, strlen(text));
    }
    assert_true(count >= 20);
    cJSON_Delete(cases);
    keel_tokenizer_free(t);
}

static void test_vocab_and_token_id(void **state) {
    (void)state;
    keel_tokenizer *t = load_fixture();
    cJSON *j = read_json(fixture("tokenizer.json"));
    int max = -1;
    for (cJSON *v = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "model"), "vocab")->child; v; v = v->next) {
        if (v->valueint > max) max = v->valueint;
        assert_int_equal(keel_tokenizer_token_id(t, v->string), v->valueint);
    }
    for (cJSON *a = cJSON_GetObjectItem(j, "added_tokens")->child; a; a = a->next) {
        int id = cJSON_GetObjectItem(a, "id")->valueint;
        if (id > max) max = id;
        assert_int_equal(keel_tokenizer_token_id(t, cJSON_GetObjectItem(a, "content")->valuestring), id);
    }
    assert_int_equal(keel_tokenizer_vocab_size(t), max + 1);
    assert_int_equal(keel_tokenizer_token_id(t, "<|not a token|>"), -1);
    cJSON_Delete(j);
    keel_tokenizer_free(t);
}

static void test_stream_holds_partial_utf8(void **state) {
    (void)state;
    keel_tokenizer *t = load_fixture();
    const char *text = "h\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac\xf0\x9f\x8e\x89!";
    int32_t *ids;
    int n;
    encode_ok(t, text, strlen(text), &ids, &n);
    keel_detok d;
    keel_detok_init(&d, t);
    char all[256], out[256];
    size_t total = 0, w;
    int held = 0;
    keel_err err;
    for (int i = 0; i < n; i++) {
        assert_int_equal(keel_detok_push(&d, ids[i], out, sizeof out, &w, &err), KEEL_OK);
        assert_true(valid_utf8((const unsigned char *)out, w));
        if (w == 0) held++;
        memcpy(all + total, out, w), total += w;
    }
    assert_true(held > 0); /* some token ended mid-character */
    assert_int_equal(keel_detok_flush(&d, out, sizeof out), 0);
    assert_int_equal(total, strlen(text));
    assert_memory_equal(all, text, total);
    free(ids);
    keel_tokenizer_free(t);
}

static void test_stream_flush_and_invalid(void **state) {
    (void)state;
    keel_tokenizer *t = load_fixture();
    int32_t *ids;
    int n;
    encode_ok(t, "\xe6\x97\xa5", 3, &ids, &n); /* 日 */
    assert_true(n >= 2);
    keel_detok d;
    keel_detok_init(&d, t);
    char out[64];
    size_t w;
    keel_err err;
    assert_int_equal(keel_detok_push(&d, ids[0], out, sizeof out, &w, &err), KEEL_OK);
    assert_int_equal(w, 0);
    assert_int_equal(keel_detok_flush(&d, out, sizeof out), 3);
    assert_memory_equal(out, "\xef\xbf\xbd", 3);
    assert_int_equal(keel_detok_flush(&d, out, sizeof out), 0);
    free(ids);
    /* a lone continuation byte and an invalid lead byte each become U+FFFD; the ASCII after them stays */
    encode_ok(t, "\x80x\xffy", 4, &ids, &n);
    char all[64];
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        assert_int_equal(keel_detok_push(&d, ids[i], out, sizeof out, &w, &err), KEEL_OK);
        memcpy(all + total, out, w), total += w;
    }
    total += keel_detok_flush(&d, all + total, sizeof all - total);
    assert_int_equal(total, 8);
    assert_memory_equal(all, "\xef\xbf\xbdx\xef\xbf\xbdy", 8);
    free(ids);
    /* too small an output buffer is refused and leaves the held bytes alone */
    encode_ok(t, "\xe6\x97\xa5", 3, &ids, &n);
    for (int i = 0; i < n - 1; i++) assert_int_equal(keel_detok_push(&d, ids[i], out, sizeof out, &w, &err), KEEL_OK);
    assert_int_equal(keel_detok_push(&d, ids[n - 1], out, 1, &w, &err), KEEL_E_ARG);
    assert_non_null(strstr(err.msg, "too small"));
    assert_int_equal(keel_detok_push(&d, ids[n - 1], out, sizeof out, &w, &err), KEEL_OK);
    assert_int_equal(w, 3);
    assert_memory_equal(out, "\xe6\x97\xa5", 3);
    free(ids);
    keel_tokenizer_free(t);
}

static void test_out_of_range(void **state) {
    (void)state;
    keel_tokenizer *t = load_fixture();
    int vs = keel_tokenizer_vocab_size(t);
    int32_t ids[3] = {1, vs, 2};
    char *out = (char *)1;
    size_t len;
    keel_err err;
    char want[32];
    snprintf(want, sizeof want, "%d", vs);
    assert_int_equal(keel_tokenizer_decode(t, ids, 3, &out, &len, &err), KEEL_E_RANGE);
    assert_null(out);
    assert_non_null(strstr(err.msg, want));
    assert_non_null(strstr(err.msg, "position 1"));
    ids[1] = -1;
    assert_int_equal(keel_tokenizer_decode(t, ids, 3, &out, &len, &err), KEEL_E_RANGE);
    assert_non_null(strstr(err.msg, "-1"));
    keel_detok d;
    keel_detok_init(&d, t);
    size_t w;
    assert_int_equal(keel_detok_push(&d, vs + 7, want, sizeof want, &w, &err), KEEL_E_RANGE);
    assert_int_equal(w, 0);
    keel_tokenizer_free(t);
}

typedef struct bad_case {
    const char *name;
    const char *edit; /* a JSON object merged into the fixture (null deletes); NULL: raw text below */
    const char *raw;
    keel_code code;
    const char *field; /* must appear in the reason */
} bad_case;

/* Merges patch into j: objects recurse, null deletes, anything else replaces. */
static void merge_patch(cJSON *j, const cJSON *patch) {
    for (const cJSON *p = patch->child; p; p = p->next) {
        cJSON *cur = cJSON_GetObjectItemCaseSensitive(j, p->string);
        if (cJSON_IsNull(p)) cJSON_DeleteItemFromObjectCaseSensitive(j, p->string);
        else if (cJSON_IsObject(p) && cJSON_IsObject(cur)) merge_patch(cur, p);
        else if (cur) cJSON_ReplaceItemInObjectCaseSensitive(j, p->string, cJSON_Duplicate(p, 1));
        else cJSON_AddItemToObject(j, p->string, cJSON_Duplicate(p, 1));
    }
}

static void test_malformed_files(void **state) {
    (void)state;
    static const bad_case cases[] = {
        {"notjson", NULL, "{\"model\": [1, 2", KEEL_E_FORMAT, "not valid JSON"},
        {"array", NULL, "[1, 2]", KEEL_E_FORMAT, "top"},
        {"nomodel", "{\"model\": null}", NULL, KEEL_E_MISSING, "field model"},
        {"wordpiece", "{\"model\": {\"type\": \"WordPiece\"}}", NULL, KEEL_E_UNSUPPORTED, "model.type"},
        {"notype", "{\"model\": {\"type\": null}}", NULL, KEEL_E_UNSUPPORTED, "model.type"},
        {"badregex", "{\"pre_tokenizer\": {\"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": \"(a\"},"
                     " \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\"}]}}",
         NULL, KEEL_E_FORMAT, "pre_tokenizer.pretokenizers[0].pattern.Regex"},
        {"nopattern", "{\"pre_tokenizer\": {\"pretokenizers\": [{\"type\": \"Split\", \"behavior\": \"Isolated\"},"
                      " {\"type\": \"ByteLevel\"}]}}",
         NULL, KEEL_E_FORMAT, "pre_tokenizer.pretokenizers[0].pattern"},
        {"removed", "{\"pre_tokenizer\": {\"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"},"
                    " \"behavior\": \"Removed\"}, {\"type\": \"ByteLevel\"}]}}",
         NULL, KEEL_E_UNSUPPORTED, "pretokenizers[0].behavior"},
        {"invert", "{\"pre_tokenizer\": {\"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"},"
                   " \"behavior\": \"Isolated\", \"invert\": true}, {\"type\": \"ByteLevel\"}]}}",
         NULL, KEEL_E_UNSUPPORTED, "pretokenizers[0].invert"},
        {"digits", "{\"pre_tokenizer\": {\"pretokenizers\": [{\"type\": \"Digits\"}, {\"type\": \"ByteLevel\"}]}}",
         NULL, KEEL_E_UNSUPPORTED, "pretokenizers[0].type"},
        {"notlast", "{\"pre_tokenizer\": {\"pretokenizers\": [{\"type\": \"ByteLevel\"}, {\"type\": \"Split\"}]}}",
         NULL, KEEL_E_UNSUPPORTED, "pretokenizers[0].type"},
        {"metaspace", "{\"pre_tokenizer\": {\"type\": \"Metaspace\"}}", NULL, KEEL_E_UNSUPPORTED,
         "pre_tokenizer.type"},
        {"nopre", "{\"pre_tokenizer\": null}", NULL, KEEL_E_UNSUPPORTED, "field pre_tokenizer"},
        {"nfc", "{\"normalizer\": {\"type\": \"NFC\"}}", NULL, KEEL_E_UNSUPPORTED, "normalizer"},
        {"nodecoder", "{\"decoder\": null}", NULL, KEEL_E_UNSUPPORTED, "decoder"},
        {"novocab", "{\"model\": {\"vocab\": null}}", NULL, KEEL_E_MISSING, "model.vocab"},
        {"negid", "{\"model\": {\"vocab\": {\"a\": -3}}}", NULL, KEEL_E_RANGE, "model.vocab[\"a\"]"},
        {"fracid", "{\"model\": {\"vocab\": {\"a\": 1.5}}}", NULL, KEEL_E_FORMAT, "model.vocab[\"a\"]"},
        {"mergeoov", "{\"model\": {\"merges\": [\"a zzzq\"]}}", NULL, KEEL_E_FORMAT, "model.merges[0]"},
        {"mergeshape", "{\"model\": {\"merges\": [[\"a\", \"b\"], 7]}}", NULL, KEEL_E_FORMAT, "model.merges[1]"},
        {"dropout", "{\"model\": {\"dropout\": 0.1}}", NULL, KEEL_E_UNSUPPORTED, "model.dropout"},
        {"suffix", "{\"model\": {\"end_of_word_suffix\": \"</w>\"}}", NULL, KEEL_E_UNSUPPORTED,
         "model.end_of_word_suffix"},
        {"unk", "{\"model\": {\"unk_token\": \"<nope>\"}}", NULL, KEEL_E_FORMAT, "model.unk_token"},
        {"addedcontent", "{\"added_tokens\": [{\"id\": 3}]}", NULL, KEEL_E_FORMAT, "added_tokens[0].content"},
        {"addedid", "{\"added_tokens\": [{\"id\": \"x\", \"content\": \"<q>\"}]}", NULL, KEEL_E_FORMAT,
         "added_tokens[0].id"},
        {"addedflag", "{\"added_tokens\": [{\"id\": 3, \"content\": \"<q>\", \"lstrip\": 1}]}", NULL, KEEL_E_FORMAT,
         "added_tokens[0].lstrip"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const bad_case *bc = &cases[i];
        const char *path;
        if (bc->edit) {
            cJSON *j = read_json(fixture("tokenizer.json")), *patch = cJSON_Parse(bc->edit);
            assert_non_null(patch);
            merge_patch(j, patch);
            char *text = cJSON_PrintUnformatted(j);
            path = write_tmp(bc->name, text);
            free(text);
            cJSON_Delete(patch);
            cJSON_Delete(j);
        } else {
            path = write_tmp(bc->name, bc->raw);
        }
        keel_tokenizer *t = (keel_tokenizer *)1;
        keel_err err;
        keel_code c = keel_tokenizer_load(&t, path, &err);
        if (c != bc->code) fail_msg("%s: code %s (%s), expected %s", bc->name, keel_code_name(c), c ? err.msg : "",
                                    keel_code_name(bc->code));
        assert_null(t);
        if (!strstr(err.msg, path) || !strstr(err.msg, bc->field))
            fail_msg("%s: reason '%s' should name %s and %s", bc->name, err.msg, path, bc->field);
    }
    keel_tokenizer *t;
    keel_err err;
    assert_int_equal(keel_tokenizer_load(&t, "/nonexistent/h4/tokenizer.json", &err), KEEL_E_IO);
    assert_non_null(strstr(err.msg, "/nonexistent/h4/tokenizer.json"));
}

/* ids of a + [mid] + b under t, each part encoded alone. */
static void assert_split_as(const keel_tokenizer *t, const char *text, const char *a, int32_t mid, const char *b) {
    int32_t *want, *pa, *pb, *got;
    int na, nb, ng;
    encode_ok(t, a, strlen(a), &pa, &na);
    encode_ok(t, b, strlen(b), &pb, &nb);
    want = malloc((size_t)(na + nb + 1) * sizeof *want);
    if (na) memcpy(want, pa, (size_t)na * sizeof *want);
    want[na] = mid;
    if (nb) memcpy(want + na + 1, pb, (size_t)nb * sizeof *want);
    encode_ok(t, text, strlen(text), &got, &ng);
    if (ng != na + nb + 1) fail_msg("'%s': %d ids, expected %d", text, ng, na + nb + 1);
    assert_memory_equal(got, want, (size_t)ng * sizeof *got);
    free(want), free(pa), free(pb), free(got);
}

static void assert_same_ids(const keel_tokenizer *t1, const keel_tokenizer *t2, const char *text) {
    int32_t *a, *b;
    int na, nb;
    encode_ok(t1, text, strlen(text), &a, &na);
    encode_ok(t2, text, strlen(text), &b, &nb);
    assert_int_equal(na, nb);
    if (na) assert_memory_equal(a, b, (size_t)na * sizeof *a);
    free(a), free(b);
}

static void test_added_token_flags(void **state) {
    (void)state;
    cJSON *j = read_json(fixture("tokenizer.json"));
    cJSON *added = cJSON_GetObjectItem(j, "added_tokens");
    static const char *const extra[] = {
        "{\"id\": 600, \"content\": \"<X>\", \"lstrip\": true, \"rstrip\": true, \"normalized\": false}",
        "{\"id\": 601, \"content\": \"@w\", \"single_word\": true, \"normalized\": false}",
        "{\"id\": 602, \"content\": \"ab\", \"normalized\": true}",
        "{\"id\": 603, \"content\": \"bc\", \"normalized\": false}",
        "{\"id\": 604, \"content\": \"<s>bos\", \"special\": true, \"normalized\": false}",
    };
    for (size_t i = 0; i < sizeof extra / sizeof extra[0]; i++) cJSON_AddItemToArray(added, cJSON_Parse(extra[i]));
    keel_tokenizer *t = load_json("flags", j), *base = load_fixture();
    assert_int_equal(keel_tokenizer_vocab_size(t), 605);
    assert_split_as(t, "a  <X> \n b", "a", 600, "b");      /* lstrip and rstrip take the whitespace */
    assert_split_as(t, "x @w y", "x ", 601, " y");          /* single word: spaces around it */
    assert_same_ids(t, base, "x@w y");                      /* not a single word: no match */
    assert_same_ids(t, base, "x @wy");
    assert_same_ids(t, base, "x_@w y");                     /* '_' is a word character (\w) */
    assert_split_as(t, "x.@w y", "x.", 601, " y");
    assert_split_as(t, "abc", "a", 603, "");               /* non-normalized tokens split first, as in HF */
    assert_split_as(t, "xab!", "x", 602, "!");
    assert_split_as(t, "<s>bos inside", "", 604, " inside"); /* longest match wins */
    assert_split_as(t, "<s>bo", "", 1, "bo");
    assert_roundtrip(t, "<X>", 3);
    int32_t hole = 550; /* between the vocab and the added ids: no token */
    char *out;
    size_t len;
    keel_err err;
    assert_int_equal(keel_tokenizer_decode(t, &hole, 1, &out, &len, &err), KEEL_E_RANGE);
    assert_non_null(strstr(err.msg, "550 has no token"));
    keel_tokenizer_free(base);
    keel_tokenizer_free(t);
    cJSON_Delete(j);
}

/* GPT-2's byte-to-unicode alphabet, written out from its definition. */
static int gpt2_char(int b, char *out) {
    static int map[256], ready;
    if (!ready) {
        int n = 0;
        for (int i = 0; i < 256; i++)
            map[i] = ((i >= '!' && i <= '~') || (i >= 0xa1 && i <= 0xac) || i >= 0xae) ? i : 256 + n++;
        ready = 1;
    }
    int cp = map[b];
    if (cp < 0x80) return out[0] = (char)cp, 1;
    out[0] = (char)(0xc0 | (cp >> 6)), out[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
}

/* A tokenizer with ids 0..255 for the bytes and a few merges; byte 'z' left out when drop_z. */
static keel_tokenizer *small_tokenizer(const char *name, const char *model_extra, const char *pre, bool drop_z) {
    cJSON *vocab = cJSON_CreateObject();
    for (int b = 0; b < 256; b++) {
        char s[4] = {0};
        gpt2_char(b, s);
        if (!(drop_z && b == 'z')) cJSON_AddNumberToObject(vocab, s, b);
    }
    cJSON_AddNumberToObject(vocab, "he", 256);
    cJSON_AddNumberToObject(vocab, "\xc4\xa0w", 257); /* "Ġw" */
    cJSON_AddNumberToObject(vocab, "e\xc4\xa0", 258);
    cJSON_AddNumberToObject(vocab, "hew", 259);
    cJSON_AddNumberToObject(vocab, "<unk>", 260);
    cJSON *j = cJSON_Parse("{\"model\": {\"type\": \"BPE\","
                           " \"merges\": [\"e \xc4\xa0\", [\"h\", \"e\"], \"\xc4\xa0 w\"]},"
                           " \"decoder\": {\"type\": \"ByteLevel\"}, \"normalizer\": null, \"added_tokens\": []}");
    assert_non_null(j);
    cJSON *model = cJSON_GetObjectItem(j, "model");
    cJSON_AddItemToObject(model, "vocab", vocab);
    if (model_extra) {
        cJSON *patch = cJSON_Parse(model_extra);
        merge_patch(model, patch);
        cJSON_Delete(patch);
    }
    cJSON_AddItemToObject(j, "pre_tokenizer", cJSON_Parse(pre));
    keel_tokenizer *t = load_json(name, j);
    cJSON_Delete(j);
    return t;
}

static void assert_ids(const keel_tokenizer *t, const char *text, int n, ...) {
    int32_t *ids;
    int k;
    encode_ok(t, text, strlen(text), &ids, &k);
    if (k != n) fail_msg("'%s': %d ids, expected %d", text, k, n);
    va_list ap;
    va_start(ap, n);
    for (int i = 0; i < n; i++) {
        int want = va_arg(ap, int);
        if (ids[i] != want) fail_msg("'%s' id %d: %d, expected %d", text, i, ids[i], want);
    }
    va_end(ap);
    free(ids);
}

static void test_gpt2_bytelevel_and_model_options(void **state) {
    (void)state;
    const char *gpt2 = "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": true}";
    const char *whole = "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": false}";
    keel_tokenizer *t = small_tokenizer("gpt2", NULL, gpt2, false);
    assert_ids(t, "he w", 2, 256, 257);        /* "he" | " w": the rank-0 merge "e Ġ" cannot cross pieces */
    assert_ids(t, "hew", 2, 256, 'w');         /* merges only: "hew" is not reachable */
    assert_ids(t, "it's", 4, 'i', 't', '\'', 's');
    assert_roundtrip(t, "it's  a\ttest\n\xff\xfe", 14);
    keel_tokenizer_free(t);
    t = small_tokenizer("whole", NULL, whole, false);
    assert_ids(t, "he w", 3, 'h', 258, 'w');   /* one piece: "e Ġ" (rank 0) merges first */
    keel_tokenizer_free(t);
    t = small_tokenizer("prefix", NULL, "{\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"use_regex\": true}",
                        false);
    assert_ids(t, "w", 1, 257); /* a space is added in front */
    assert_ids(t, " w", 1, 257);
    keel_tokenizer_free(t);
    t = small_tokenizer("ignore", "{\"ignore_merges\": true}", gpt2, false);
    assert_ids(t, "hew", 1, 259); /* a word in the vocab is taken whole */
    assert_ids(t, "he w", 2, 256, 257);
    keel_tokenizer_free(t);
    t = small_tokenizer("unk", "{\"unk_token\": \"<unk>\"}", whole, true);
    assert_ids(t, "azzb", 4, 'a', 260, 260, 'b');
    keel_tokenizer_free(t);
    t = small_tokenizer("fuse", "{\"unk_token\": \"<unk>\", \"fuse_unk\": true}", whole, true);
    assert_ids(t, "azzb", 3, 'a', 260, 'b');
    keel_tokenizer_free(t);
    t = small_tokenizer("drop", NULL, whole, true);
    assert_ids(t, "azzb", 2, 'a', 'b'); /* no unk token: unknown characters are dropped, as HF does */
    keel_tokenizer_free(t);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t next_rand(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static void test_fuzz_roundtrip(void **state) {
    (void)state;
    keel_tokenizer *t = load_fixture();
    static const char *const pieces[] = {"\xc3\xa9", "\xe6\x97\xa5", "\xf0\x9f\x8e\x89", "\xc2\x85", " ", "  ", "\n",
                                         "\r\n", "\t", "<|im_end|>", "<s>", "<|im_", "'s", "Hello", "42", "\xcc\x81",
                                         "\xe2\x80\x8d", "\xe3\x80\x80"};
    int vs = keel_tokenizer_vocab_size(t);
    for (int iter = 0; iter < 4000; iter++) {
        char s[256];
        size_t n = 0, want = next_rand() % 60;
        bool bytes_ok = iter % 2 == 0; /* odd iterations: valid UTF-8 only */
        while (n < want) {
            uint32_t r = next_rand() % 10;
            if (r < 3) s[n++] = (char)(0x20 + next_rand() % 95);
            else if (r < 5 && bytes_ok) s[n++] = (char)(next_rand() % 256);
            else {
                const char *p = pieces[next_rand() % (sizeof pieces / sizeof pieces[0])];
                memcpy(s + n, p, strlen(p)), n += strlen(p);
            }
        }
        int32_t *ids;
        int k;
        encode_ok(t, s, n, &ids, &k);
        for (int i = 0; i < k; i++) assert_true(ids[i] >= 0 && ids[i] < vs);
        char *out;
        size_t len;
        keel_err err;
        assert_int_equal(keel_tokenizer_decode(t, ids, k, &out, &len, &err), KEEL_OK);
        assert_int_equal(len, n);
        assert_memory_equal(out, s, n);
        free(out);
        if (valid_utf8((const unsigned char *)s, n)) { /* streaming gives the same text, never a broken char */
            keel_detok d;
            keel_detok_init(&d, t);
            char buf[512], chunk[256];
            size_t total = 0, w;
            for (int i = 0; i < k; i++) {
                assert_int_equal(keel_detok_push(&d, ids[i], chunk, sizeof chunk, &w, &err), KEEL_OK);
                assert_true(valid_utf8((const unsigned char *)chunk, w));
                memcpy(buf + total, chunk, w), total += w;
            }
            assert_int_equal(keel_detok_flush(&d, chunk, sizeof chunk), 0);
            assert_int_equal(total, n);
            assert_memory_equal(buf, s, n);
        }
        free(ids);
    }
    keel_tokenizer_free(t);
}

static double time_encode(const keel_tokenizer *t, const char *s, size_t n) {
    int32_t *ids;
    int k;
    double t0 = keel_now();
    encode_ok(t, s, n, &ids, &k);
    double dt = keel_now() - t0;
    free(ids);
    assert_roundtrip(t, s, n);
    return dt;
}

static void test_speed(void **state) {
    (void)state;
    keel_tokenizer *t = load_fixture();
    cJSON *cases = read_json(fixture("tokenizer_cases.json"));
    size_t n = 100 * 1024;
    char *s = malloc(n + 1);
    size_t k = 0;
    while (k < n)
        for (cJSON *c = cases->child; c && k < n; c = c->next) {
            const char *text = cJSON_GetObjectItem(c, "text")->valuestring;
            size_t l = strlen(text) < n - k ? strlen(text) : n - k;
            memcpy(s + k, text, l), k += l;
        }
    double mixed = time_encode(t, s, n);
    memset(s, 'x', n);
    double one_word = time_encode(t, s, n); /* one 100 KB pre-token: merging must not be quadratic */
    memset(s, ' ', n);
    double spaces = time_encode(t, s, n);
    print_message("encode 100 KB: mixed %.3f s, one word %.3f s, spaces %.3f s\n", mixed, one_word, spaces);
    /* generous bounds (sanitizer builds, a busy machine); quadratic work would take minutes */
    assert_true(mixed < 2.0 && one_word < 2.0 && spaces < 2.0);
    free(s);
    cJSON_Delete(cases);
    keel_tokenizer_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixture_cases),
        cmocka_unit_test(test_vocab_and_token_id),
        cmocka_unit_test(test_stream_holds_partial_utf8),
        cmocka_unit_test(test_stream_flush_and_invalid),
        cmocka_unit_test(test_out_of_range),
        cmocka_unit_test(test_malformed_files),
        cmocka_unit_test(test_added_token_flags),
        cmocka_unit_test(test_gpt2_bytelevel_and_model_options),
        cmocka_unit_test(test_fuzz_roundtrip),
        cmocka_unit_test(test_speed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
