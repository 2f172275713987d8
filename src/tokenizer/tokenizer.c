/* tokenizer: byte-level BPE from a Hugging Face tokenizer.json (loading, encoding, decoding, streaming decode). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/tokenizer.h"

#include <cjson/cJSON.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>

#define MAX_VOCAB (1 << 24) /* ids beyond this are refused rather than allocated */
#define GPT2_PATTERN "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

/* ---- hash tables ----------------------------------------------------------------------------------- */

typedef struct str_slot {
    const char *key; /* NULL when empty; points into strings the tokenizer owns */
    size_t len;
    int32_t val;
} str_slot;

typedef struct str_map {
    str_slot *slots;
    size_t mask;
} str_map;

typedef struct pair_slot {
    uint64_t key; /* (left << 32 | right) + 1, 0 when empty */
    int32_t rank, new_id;
} pair_slot;

typedef struct pair_map {
    pair_slot *slots;
    size_t mask;
} pair_map;

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return h;
}

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

static size_t table_size(size_t n) {
    size_t c = 16;
    while (c < 2 * n + 2) c <<= 1;
    return c;
}

static void str_map_init(str_map *m, size_t n) {
    size_t c = table_size(n);
    m->slots = keel_xcalloc(c, sizeof *m->slots);
    m->mask = c - 1;
}

/* Inserts or overwrites key -> val; the table is sized for all keys up front. */
static void str_map_put(str_map *m, const char *key, size_t len, int32_t val) {
    for (size_t i = hash_bytes(key, len) & m->mask;; i = (i + 1) & m->mask) {
        str_slot *s = &m->slots[i];
        if (!s->key || (s->len == len && !memcmp(s->key, key, len))) {
            s->key = key, s->len = len, s->val = val;
            return;
        }
    }
}

static int32_t str_map_get(const str_map *m, const char *key, size_t len) {
    if (!m->slots) return -1;
    for (size_t i = hash_bytes(key, len) & m->mask;; i = (i + 1) & m->mask) {
        const str_slot *s = &m->slots[i];
        if (!s->key) return -1;
        if (s->len == len && !memcmp(s->key, key, len)) return s->val;
    }
}

static void pair_map_put(pair_map *m, int32_t a, int32_t b, int32_t rank, int32_t new_id) {
    uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    for (size_t i = hash_u64(key) & m->mask;; i = (i + 1) & m->mask) {
        pair_slot *s = &m->slots[i];
        if (!s->key || s->key == key) {
            s->key = key, s->rank = rank, s->new_id = new_id;
            return;
        }
    }
}

static const pair_slot *pair_map_get(const pair_map *m, int32_t a, int32_t b) {
    uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    for (size_t i = hash_u64(key) & m->mask;; i = (i + 1) & m->mask) {
        const pair_slot *s = &m->slots[i];
        if (!s->key) return NULL;
        if (s->key == key) return s;
    }
}

/* ---- UTF-8 ----------------------------------------------------------------------------------------- */

/* Length of the character at s (n > 0 bytes available): > 0 a complete valid character, 0 a valid but
 * truncated prefix, < 0 minus the length of an invalid maximal subpart (replaced by one U+FFFD). */
static int utf8_char(const uint8_t *s, size_t n) {
    uint8_t c = s[0];
    if (c < 0x80) return 1;
    int need;
    uint8_t lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) need = 1;
    else if (c >= 0xe0 && c <= 0xef) need = 2, lo = c == 0xe0 ? 0xa0 : 0x80, hi = c == 0xed ? 0x9f : 0xbf;
    else if (c >= 0xf0 && c <= 0xf4) need = 3, lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
    else return -1;
    for (int i = 1; i <= need; i++) {
        if ((size_t)i >= n) return 0;
        uint8_t b = s[i];
        if (i == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xbf)) return -i;
    }
    return need + 1;
}

/* Decodes one valid character at s into *cp; returns its length or a value <= 0 when invalid or truncated. */
static int utf8_decode(const uint8_t *s, size_t n, uint32_t *cp) {
    int l = utf8_char(s, n);
    if (l <= 0) return l;
    static const uint8_t lead_mask[5] = {0, 0x7f, 0x1f, 0x0f, 0x07};
    uint32_t v = s[0] & lead_mask[l];
    for (int i = 1; i < l; i++) v = (v << 6) | (s[i] & 0x3f);
    *cp = v;
    return l;
}

static int utf8_encode(uint32_t cp, char *out) {
    if (cp < 0x80) return out[0] = (char)cp, 1;
    if (cp < 0x800) return out[0] = (char)(0xc0 | (cp >> 6)), out[1] = (char)(0x80 | (cp & 0x3f)), 2;
    KEEL_ASSERT(cp < 0x10000);
    out[0] = (char)(0xe0 | (cp >> 12)), out[1] = (char)(0x80 | ((cp >> 6) & 0x3f)), out[2] = (char)(0x80 | (cp & 0x3f));
    return 3;
}

/* Unicode White_Space, which Rust's char::is_whitespace (used by lstrip/rstrip) follows. */
static bool is_white_space(uint32_t c) {
    return (c >= 9 && c <= 13) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) ||
           c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

/* ---- the tokenizer --------------------------------------------------------------------------------- */

typedef struct added_token {
    const char *content; /* owned by keel_tokenizer.strings */
    size_t len;
    int32_t id;
    bool single_word, lstrip, rstrip, normalized;
} added_token;

typedef enum step_kind { STEP_SPLIT, STEP_BYTELEVEL } step_kind;

typedef struct pre_step {
    step_kind kind;
    pcre2_code *re;        /* the split regex; for ByteLevel the GPT-2 regex when use_regex, else NULL */
    bool add_prefix_space; /* ByteLevel only */
} pre_step;

struct keel_tokenizer {
    int vocab_size;
    char **strings;   /* every token string read from the file, owned */
    int n_strings;
    str_map vocab;    /* model vocab: token -> id */
    str_map added_map; /* added token content -> id */
    pair_map merges;  /* (left id, right id) -> rank and merged id */
    added_token *added;
    int n_added;
    int *by_byte[256]; /* indices into added that start with this byte, longest first, -1 terminated */
    pre_step steps[8];
    int n_steps;
    int32_t init_ids[256][2]; /* BPE's initial symbols for each byte (its byte-level character) */
    int init_n[256];          /* 0 when the character is unknown (then unk or dropped, as HF does) */
    bool init_fallback[256];  /* the initial symbols came from byte fallback */
    int32_t unk_id;           /* -1 when there is no unk token */
    bool fuse_unk, ignore_merges;
    pcre2_code *word_re;      /* a word character (Unicode \w as HF's regex crate has it), for single_word */
    uint32_t byte_cp[256];    /* GPT-2's byte-to-unicode alphabet and its inverse */
    int16_t cp_byte[324];
    uint8_t *dec;             /* decoded bytes of every id */
    int64_t *dec_off;         /* id -> offset into dec; vocab_size + 1 entries */
    uint8_t *present;         /* whether an id has a token */
};

/* GPT-2's byte-to-unicode alphabet: printable bytes map to themselves, the rest to 256 + n in byte order. */
static void bytelevel_tables(keel_tokenizer *t) {
    int n = 0;
    for (int i = 0; i < 324; i++) t->cp_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool keep = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
        t->byte_cp[b] = keep ? (uint32_t)b : (uint32_t)(256 + n++);
        t->cp_byte[t->byte_cp[b]] = (int16_t)b;
    }
}

void keel_tokenizer_free(keel_tokenizer *t) {
    if (!t) return;
    for (int i = 0; i < t->n_strings; i++) free(t->strings[i]);
    free(t->strings);
    free(t->vocab.slots);
    free(t->added_map.slots);
    free(t->merges.slots);
    free(t->added);
    for (int b = 0; b < 256; b++) free(t->by_byte[b]);
    for (int i = 0; i < t->n_steps; i++) pcre2_code_free(t->steps[i].re);
    pcre2_code_free(t->word_re);
    free(t->dec);
    free(t->dec_off);
    free(t->present);
    free(t);
}

int keel_tokenizer_vocab_size(const keel_tokenizer *t) { return t->vocab_size; }

int keel_tokenizer_token_id(const keel_tokenizer *t, const char *token) {
    size_t n = strlen(token);
    int32_t id = str_map_get(&t->added_map, token, n);
    return id >= 0 ? id : str_map_get(&t->vocab, token, n);
}

/* ---- loading --------------------------------------------------------------------------------------- */

static const char *json_type(const cJSON *j) {
    if (!j) return "nothing";
    if (cJSON_IsNull(j)) return "null";
    if (cJSON_IsBool(j)) return "a boolean";
    if (cJSON_IsNumber(j)) return "a number";
    if (cJSON_IsString(j)) return "a string";
    if (cJSON_IsArray(j)) return "an array";
    return "an object";
}

/* A found value for a message: a string in quotes (shortened), else its JSON type. */
static const char *found(const cJSON *j, char buf[80]) {
    if (!cJSON_IsString(j)) return json_type(j);
    snprintf(buf, 80, "\"%.60s\"", j->valuestring);
    return buf;
}

static char *own(keel_tokenizer *t, const char *s) {
    t->strings = keel_xrealloc(t->strings, (size_t)(t->n_strings + 1) * sizeof *t->strings);
    return t->strings[t->n_strings++] = keel_xstrdup(s);
}

/* A boolean field that may be absent (then def); anything else is an error. */
static keel_code get_bool(const cJSON *o, const char *name, bool def, bool *out, const char *path, const char *where,
                          keel_err *err) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!j || cJSON_IsNull(j)) return *out = def, KEEL_OK;
    if (!cJSON_IsBool(j))
        return keel_err_set(err, KEEL_E_FORMAT, "%s: field %s.%s: expected a boolean, found %s", path, where, name,
                            json_type(j));
    *out = cJSON_IsTrue(j);
    return KEEL_OK;
}

/* An integer id in [0, MAX_VOCAB). */
static keel_code get_id(const cJSON *j, int32_t *out, const char *path, const char *field, keel_err *err) {
    if (!cJSON_IsNumber(j))
        return keel_err_set(err, KEEL_E_FORMAT, "%s: field %s: expected an integer id, found %s", path, field,
                            json_type(j));
    if (!(j->valuedouble >= 0 && j->valuedouble < MAX_VOCAB))
        return keel_err_set(err, KEEL_E_RANGE, "%s: field %s: id %g outside [0, %d)", path, field, j->valuedouble,
                            MAX_VOCAB);
    if (j->valuedouble != (double)(int32_t)j->valuedouble)
        return keel_err_set(err, KEEL_E_FORMAT, "%s: field %s: expected an integer id, found %g", path, field,
                            j->valuedouble);
    *out = (int32_t)j->valuedouble;
    return KEEL_OK;
}

/* Onig's \s (what HF uses) also matches U+0085, which PCRE2's \s does not: add it outside and inside classes. */
static char *onig_compat(const char *src) {
    size_t n = strlen(src);
    char *out = keel_xmalloc(n * 13 + 1), *o = out;
    bool in_class = false;
    for (size_t i = 0; i < n; i++) {
        char c = src[i];
        if (c == '\\' && i + 1 < n) {
            char e = src[++i];
            if (e == 's') o += sprintf(o, in_class ? "\\s\\x{85}" : "[\\s\\x{85}]");
            else if (e == 'S' && !in_class) o += sprintf(o, "[^\\s\\x{85}]");
            else *o++ = '\\', *o++ = e;
            continue;
        }
        if (!in_class && c == '[') {
            in_class = true;
            *o++ = c;
            if (i + 1 < n && src[i + 1] == '^') *o++ = src[++i];
            if (i + 1 < n && src[i + 1] == ']') *o++ = src[++i]; /* a leading ] is literal */
            continue;
        }
        if (in_class && c == ']') in_class = false;
        *o++ = c;
    }
    *o = 0;
    return out;
}

static keel_code compile_regex(pcre2_code **out, const char *pattern, bool literal, const char *path,
                               const char *field, keel_err *err) {
    char *pat = literal ? keel_xstrdup(pattern) : onig_compat(pattern);
    int code;
    PCRE2_SIZE off;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : 0);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, opts, &code, &off, NULL);
    free(pat);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        return keel_err_set(err, KEEL_E_FORMAT, "%s: field %s: bad regex \"%.200s\": %s (at offset %zu)", path, field,
                            pattern, (const char *)msg, (size_t)off);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* the interpreter runs when JIT is unavailable */
    *out = re;
    return KEEL_OK;
}

static keel_code load_bytelevel(keel_tokenizer *t, const cJSON *j, const char *path, const char *where,
                                keel_err *err) {
    pre_step *s = &t->steps[t->n_steps++];
    s->kind = STEP_BYTELEVEL;
    bool use_regex = false;
    keel_code c = get_bool(j, "add_prefix_space", true, &s->add_prefix_space, path, where, err);
    if (!c) c = get_bool(j, "use_regex", true, &use_regex, path, where, err);
    if (!c && use_regex) c = compile_regex(&s->re, GPT2_PATTERN, false, path, where, err);
    return c;
}

static keel_code load_split(keel_tokenizer *t, const cJSON *j, const char *path, const char *where, keel_err *err) {
    char field[256], buf[80];
    const cJSON *beh = cJSON_GetObjectItemCaseSensitive(j, "behavior");
    if (!cJSON_IsString(beh) || strcmp(beh->valuestring, "Isolated"))
        return keel_err_set(err, KEEL_E_UNSUPPORTED, "%s: field %s.behavior: expected \"Isolated\", found %s", path,
                            where, found(beh, buf));
    bool invert;
    keel_code c = get_bool(j, "invert", false, &invert, path, where, err);
    if (c) return c;
    if (invert)
        return keel_err_set(err, KEEL_E_UNSUPPORTED, "%s: field %s.invert: expected false, found true", path, where);
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(j, "pattern");
    const cJSON *re = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
    const cJSON *lit = cJSON_GetObjectItemCaseSensitive(pat, "String");
    if (!cJSON_IsString(re) && !cJSON_IsString(lit))
        return keel_err_set(err, KEEL_E_FORMAT, "%s: field %s.pattern: expected {\"Regex\": ...} or {\"String\": ...}",
                            path, where);
    if (t->n_steps + 2 > (int)KEEL_ARRAY_LEN(t->steps))
        return keel_err_set(err, KEEL_E_UNSUPPORTED, "%s: field %s: more than %d pre-tokenizer steps", path, where,
                            (int)KEEL_ARRAY_LEN(t->steps) - 1);
    snprintf(field, sizeof field, "%s.pattern.%s", where, re ? "Regex" : "String");
    pre_step *s = &t->steps[t->n_steps];
    s->kind = STEP_SPLIT;
    c = compile_regex(&s->re, re ? re->valuestring : lit->valuestring, !re, path, field, err);
    if (!c) t->n_steps++;
    return c;
}

/* pre_tokenizer: ByteLevel, or a Sequence of Split steps ending with ByteLevel. */
static keel_code load_pre_tokenizer(keel_tokenizer *t, const cJSON *root, const char *path, keel_err *err) {
    const cJSON *pt = cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(pt, "type");
    if (!cJSON_IsObject(pt) || !cJSON_IsString(type))
        return keel_err_set(err, KEEL_E_UNSUPPORTED,
                            "%s: field pre_tokenizer: expected a ByteLevel or Sequence pre-tokenizer, found %s", path,
                            json_type(pt));
    if (!strcmp(type->valuestring, "ByteLevel")) return load_bytelevel(t, pt, path, "pre_tokenizer", err);
    if (strcmp(type->valuestring, "Sequence"))
        return keel_err_set(err, KEEL_E_UNSUPPORTED,
                            "%s: field pre_tokenizer.type: expected \"ByteLevel\" or \"Sequence\", found \"%s\"", path,
                            type->valuestring);
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(pt, "pretokenizers");
    if (!cJSON_IsArray(list))
        return keel_err_set(err, KEEL_E_FORMAT, "%s: field pre_tokenizer.pretokenizers: expected an array, found %s",
                            path, json_type(list));
    int n = cJSON_GetArraySize(list), i = 0;
    for (const cJSON *s = list->child; s; s = s->next, i++) {
        char where[64], buf[80];
        snprintf(where, sizeof where, "pre_tokenizer.pretokenizers[%d]", i);
        const cJSON *st = cJSON_GetObjectItemCaseSensitive(s, "type");
        const char *ty = cJSON_IsString(st) ? st->valuestring : "";
        keel_code c;
        if (!strcmp(ty, "Split") && i < n - 1) c = load_split(t, s, path, where, err);
        else if (!strcmp(ty, "ByteLevel") && i == n - 1) c = load_bytelevel(t, s, path, where, err);
        else
            c = keel_err_set(err, KEEL_E_UNSUPPORTED, "%s: field %s.type: expected %s, found %s", path, where,
                             i == n - 1 ? "\"ByteLevel\" (last)" : "\"Split\" before the final ByteLevel",
                             found(st, buf));
        if (c) return c;
    }
    if (n == 0)
        return keel_err_set(err, KEEL_E_UNSUPPORTED, "%s: field pre_tokenizer.pretokenizers: empty, expected ByteLevel",
                            path);
    return KEEL_OK;
}

/* normalizer: null (or an empty Sequence); anything that changes text is refused. */
static keel_code check_normalizer(const cJSON *root, const char *path, keel_err *err) {
    const cJSON *nz = cJSON_GetObjectItemCaseSensitive(root, "normalizer");
    if (!nz || cJSON_IsNull(nz)) return KEEL_OK;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(nz, "type");
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(nz, "normalizers");
    if (cJSON_IsString(type) && !strcmp(type->valuestring, "Sequence") && cJSON_IsArray(list) &&
        cJSON_GetArraySize(list) == 0)
        return KEEL_OK;
    char buf[80];
    return keel_err_set(err, KEEL_E_UNSUPPORTED, "%s: field normalizer: expected null, found %s%s", path,
                        cJSON_IsString(type) ? "type " : "", cJSON_IsString(type) ? found(type, buf) : json_type(nz));
}

static keel_code check_decoder(const cJSON *root, const char *path, keel_err *err) {
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(root, "decoder");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(d, "type");
    if (cJSON_IsString(type) && !strcmp(type->valuestring, "ByteLevel")) return KEEL_OK;
    char buf[80];
    return keel_err_set(err, KEEL_E_UNSUPPORTED, "%s: field decoder: expected type \"ByteLevel\", found %s", path,
                        cJSON_IsString(type) ? found(type, buf) : json_type(d));
}

/* Options of model that keel does not implement must be absent or neutral. */
static keel_code check_model_options(keel_tokenizer *t, const cJSON *m, const char *path, keel_err *err) {
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(m, "dropout");
    if (dropout && !cJSON_IsNull(dropout) && !(cJSON_IsNumber(dropout) && dropout->valuedouble == 0))
        return keel_err_set(err, KEEL_E_UNSUPPORTED, "%s: field model.dropout: expected null, found %s", path,
                            json_type(dropout));
    static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < KEEL_ARRAY_LEN(affixes); i++) {
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(m, affixes[i]);
        if (a && !cJSON_IsNull(a) && !(cJSON_IsString(a) && !a->valuestring[0]))
            return keel_err_set(err, KEEL_E_UNSUPPORTED, "%s: field model.%s: expected null, found %s", path,
                                affixes[i], json_type(a));
    }
    keel_code c = get_bool(m, "fuse_unk", false, &t->fuse_unk, path, "model", err);
    if (!c) c = get_bool(m, "ignore_merges", false, &t->ignore_merges, path, "model", err);
    return c;
}

static keel_code load_vocab(keel_tokenizer *t, const cJSON *m, const char *path, keel_err *err) {
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(m, "vocab");
    if (!cJSON_IsObject(vocab))
        return keel_err_set(err, KEEL_E_MISSING, "%s: field model.vocab: expected an object, found %s", path,
                            json_type(vocab));
    str_map_init(&t->vocab, (size_t)cJSON_GetArraySize(vocab));
    for (const cJSON *v = vocab->child; v; v = v->next) {
        char field[64];
        int32_t id;
        snprintf(field, sizeof field, "model.vocab[\"%.32s\"]", v->string);
        keel_code c = get_id(v, &id, path, field, err);
        if (c) return c;
        const char *s = own(t, v->string);
        str_map_put(&t->vocab, s, strlen(s), id);
        t->vocab_size = KEEL_MAX(t->vocab_size, id + 1);
    }
    return KEEL_OK;
}

/* merges: "a b" strings or ["a", "b"] pairs; rank is the position, later duplicates win as in HF. */
static keel_code load_merges(keel_tokenizer *t, const cJSON *m, const char *path, keel_err *err) {
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(m, "merges");
    if (!merges || cJSON_IsNull(merges)) merges = NULL;
    else if (!cJSON_IsArray(merges))
        return keel_err_set(err, KEEL_E_FORMAT, "%s: field model.merges: expected an array, found %s", path,
                            json_type(merges));
    size_t n = merges ? (size_t)cJSON_GetArraySize(merges) : 0;
    t->merges.slots = keel_xcalloc(table_size(n), sizeof *t->merges.slots);
    t->merges.mask = table_size(n) - 1;
    int rank = 0;
    char *buf = NULL;
    size_t cap = 0;
    keel_code c = KEEL_OK;
    for (const cJSON *e = merges ? merges->child : NULL; e && !c; e = e->next, rank++) {
        const char *a = NULL, *b = NULL;
        size_t la = 0, lb = 0;
        if (cJSON_IsString(e)) {
            const char *sp = strchr(e->valuestring, ' ');
            if (sp && !strchr(sp + 1, ' ')) a = e->valuestring, la = (size_t)(sp - a), b = sp + 1, lb = strlen(b);
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(e->child) &&
                   cJSON_IsString(e->child->next)) {
            a = e->child->valuestring, la = strlen(a), b = e->child->next->valuestring, lb = strlen(b);
        }
        if (!a) {
            c = keel_err_set(err, KEEL_E_FORMAT, "%s: field model.merges[%d]: expected \"a b\" or [\"a\", \"b\"]", path,
                             rank);
            break;
        }
        int32_t ia = str_map_get(&t->vocab, a, la), ib = str_map_get(&t->vocab, b, lb);
        if (la + lb + 1 > cap) buf = keel_xrealloc(buf, cap = 2 * (la + lb + 1));
        memcpy(buf, a, la), memcpy(buf + la, b, lb);
        int32_t iab = str_map_get(&t->vocab, buf, la + lb);
        if (ia < 0 || ib < 0 || iab < 0) {
            const char *what = ia < 0 ? a : ib < 0 ? b : buf;
            int wl = (int)KEEL_MIN(ia < 0 ? la : ib < 0 ? lb : la + lb, 64);
            c = keel_err_set(err, KEEL_E_FORMAT, "%s: field model.merges[%d]: token \"%.*s\" is not in model.vocab",
                             path, rank, wl, what);
            break;
        }
        pair_map_put(&t->merges, ia, ib, rank, iab);
    }
    free(buf);
    return c;
}

static keel_code load_added(keel_tokenizer *t, const cJSON *root, const char *path, keel_err *err) {
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (!list || cJSON_IsNull(list)) list = NULL;
    else if (!cJSON_IsArray(list))
        return keel_err_set(err, KEEL_E_FORMAT, "%s: field added_tokens: expected an array, found %s", path,
                            json_type(list));
    int n = list ? cJSON_GetArraySize(list) : 0;
    t->added = keel_xcalloc((size_t)n + 1, sizeof *t->added);
    str_map_init(&t->added_map, (size_t)n);
    int i = 0;
    for (const cJSON *a = list ? list->child : NULL; a; a = a->next, i++) {
        char where[64];
        snprintf(where, sizeof where, "added_tokens[%d]", i);
        char field[80];
        snprintf(field, sizeof field, "%s.id", where);
        added_token *at = &t->added[t->n_added];
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(a, "content");
        if (!cJSON_IsString(content) || !content->valuestring[0])
            return keel_err_set(err, KEEL_E_FORMAT, "%s: field %s.content: expected a non-empty string, found %s",
                                path, where, json_type(content));
        bool special = false;
        keel_code c = get_id(cJSON_GetObjectItemCaseSensitive(a, "id"), &at->id, path, field, err);
        if (!c) c = get_bool(a, "special", false, &special, path, where, err);
        if (!c) c = get_bool(a, "single_word", false, &at->single_word, path, where, err);
        if (!c) c = get_bool(a, "lstrip", false, &at->lstrip, path, where, err);
        if (!c) c = get_bool(a, "rstrip", false, &at->rstrip, path, where, err);
        if (!c) c = get_bool(a, "normalized", !special, &at->normalized, path, where, err);
        if (c) return c;
        at->content = own(t, content->valuestring);
        at->len = strlen(at->content);
        str_map_put(&t->added_map, at->content, at->len, at->id);
        t->vocab_size = KEEL_MAX(t->vocab_size, at->id + 1);
        t->n_added++;
    }
    return KEEL_OK;
}

typedef struct len_idx {
    size_t len;
    int idx;
} len_idx;

static int by_len_desc(const void *pa, const void *pb) {
    const len_idx *a = pa, *b = pb;
    return a->len < b->len ? 1 : a->len > b->len ? -1 : a->idx - b->idx;
}

/* Buckets of added tokens by first byte, longest first, for leftmost-longest matching. */
static void index_added(keel_tokenizer *t) {
    int count[256] = {0};
    for (int i = 0; i < t->n_added; i++) count[(uint8_t)t->added[i].content[0]]++;
    for (int b = 0; b < 256; b++) {
        if (!count[b]) continue;
        len_idx *li = keel_xmalloc((size_t)count[b] * sizeof *li);
        int k = 0;
        for (int i = 0; i < t->n_added; i++)
            if ((uint8_t)t->added[i].content[0] == b) li[k++] = (len_idx){t->added[i].len, i};
        qsort(li, (size_t)k, sizeof *li, by_len_desc);
        int *l = keel_xmalloc((size_t)(k + 1) * sizeof *l);
        for (int i = 0; i < k; i++) l[i] = li[i].idx;
        l[k] = -1;
        t->by_byte[b] = l;
        free(li);
    }
}

/* BPE's starting symbols per byte, as HF's merge_word finds them (vocab, then byte fallback, then unk). */
static void init_symbols(keel_tokenizer *t, bool byte_fallback) {
    for (int b = 0; b < 256; b++) {
        char ch[4];
        int l = utf8_encode(t->byte_cp[b], ch);
        int32_t id = str_map_get(&t->vocab, ch, (size_t)l);
        if (id >= 0) {
            t->init_ids[b][0] = id, t->init_n[b] = 1;
            continue;
        }
        t->init_n[b] = 0;
        if (!byte_fallback) continue;
        int32_t fb[2];
        int k = 0;
        for (int i = 0; i < l; i++) {
            char name[8];
            snprintf(name, sizeof name, "<0x%02X>", (uint8_t)ch[i]);
            if ((fb[k] = str_map_get(&t->vocab, name, strlen(name))) >= 0) k++;
        }
        if (k == l) t->init_n[b] = l, t->init_fallback[b] = true, memcpy(t->init_ids[b], fb, sizeof fb);
    }
}

/* The bytes of every id: byte-level characters map back to bytes; a token with any other character is kept as
 * its UTF-8, as HF's ByteLevel decoder does. Added tokens take precedence over the vocab. */
static void build_decode_table(keel_tokenizer *t) {
    const char **tok = keel_xcalloc((size_t)t->vocab_size, sizeof *tok);
    for (size_t i = 0; i <= t->vocab.mask; i++)
        if (t->vocab.slots[i].key) tok[t->vocab.slots[i].val] = t->vocab.slots[i].key;
    for (int i = 0; i < t->n_added; i++) tok[t->added[i].id] = t->added[i].content;
    size_t total = 0;
    for (int id = 0; id < t->vocab_size; id++) total += tok[id] ? strlen(tok[id]) : 0;
    t->dec = keel_xmalloc(total + 1);
    t->dec_off = keel_xmalloc((size_t)(t->vocab_size + 1) * sizeof *t->dec_off);
    t->present = keel_xcalloc((size_t)t->vocab_size, 1);
    int64_t off = 0;
    for (int id = 0; id < t->vocab_size; id++) {
        t->dec_off[id] = off;
        if (!tok[id]) continue;
        t->present[id] = 1;
        const uint8_t *s = (const uint8_t *)tok[id];
        size_t n = strlen(tok[id]), i = 0;
        int64_t start = off;
        while (i < n) {
            uint32_t cp;
            int l = utf8_decode(s + i, n - i, &cp);
            if (l <= 0 || cp >= 324 || t->cp_byte[cp] < 0) break;
            t->dec[off++] = (uint8_t)t->cp_byte[cp];
            i += (size_t)l;
        }
        if (i < n) memcpy(t->dec + start, s, n), off = start + (int64_t)n;
    }
    t->dec_off[t->vocab_size] = off;
    free(tok);
}

static keel_code load_json(keel_tokenizer *t, const cJSON *root, const char *path, keel_err *err) {
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(m))
        return keel_err_set(err, KEEL_E_MISSING, "%s: field model: expected an object, found %s", path, json_type(m));
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(m, "type");
    char buf[80];
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "BPE"))
        return keel_err_set(err, KEEL_E_UNSUPPORTED, "%s: field model.type: expected \"BPE\", found %s", path,
                            found(type, buf));
    keel_code c = check_model_options(t, m, path, err);
    if (!c) c = check_normalizer(root, path, err);
    if (!c) c = check_decoder(root, path, err);
    if (!c) c = load_pre_tokenizer(t, root, path, err);
    if (!c) c = load_vocab(t, m, path, err);
    if (!c) c = load_merges(t, m, path, err);
    if (!c) c = load_added(t, root, path, err);
    if (c) return c;
    t->unk_id = -1;
    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(m, "unk_token");
    if (cJSON_IsString(unk) && (t->unk_id = str_map_get(&t->vocab, unk->valuestring, strlen(unk->valuestring))) < 0)
        return keel_err_set(err, KEEL_E_FORMAT, "%s: field model.unk_token: \"%.64s\" is not in model.vocab", path,
                            unk->valuestring);
    bool byte_fallback;
    if ((c = get_bool(m, "byte_fallback", false, &byte_fallback, path, "model", err))) return c;
    if (t->vocab_size == 0)
        return keel_err_set(err, KEEL_E_FORMAT, "%s: field model.vocab: expected tokens, found none", path);
    for (int i = 0; i < t->n_added && !t->word_re; i++)
        if (t->added[i].single_word &&
            (c = compile_regex(&t->word_re, "[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200c}\\x{200d}]", false, path,
                               "added_tokens", err)))
            return c;
    index_added(t);
    init_symbols(t, byte_fallback);
    build_decode_table(t);
    return KEEL_OK;
}

keel_code keel_tokenizer_load(keel_tokenizer **out, const char *path, keel_err *err) {
    *out = NULL;
    char *text;
    size_t len;
    keel_code c = keel_read_file(path, &text, &len, err);
    if (c) return c;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!root) {
        size_t at = end && end >= text ? (size_t)(end - text) : 0;
        free(text);
        return keel_err_set(err, KEEL_E_FORMAT, "%s: not valid JSON (near byte %zu)", path, at);
    }
    free(text);
    keel_tokenizer *t = keel_xcalloc(1, sizeof *t);
    bytelevel_tables(t);
    c = cJSON_IsObject(root) ? load_json(t, root, path, err)
                             : keel_err_set(err, KEEL_E_FORMAT, "%s: expected a JSON object at the top, found %s", path,
                                            json_type(root));
    cJSON_Delete(root);
    if (c) {
        keel_tokenizer_free(t);
        return c;
    }
    *out = t;
    return KEEL_OK;
}

/* ---- encoding -------------------------------------------------------------------------------------- */

typedef struct sym {
    int32_t id, prev, next;
    bool dead;
} sym;

typedef struct merge_item {
    int32_t rank, pos, new_id;
} merge_item;

typedef struct enc {
    const keel_tokenizer *t;
    int32_t *ids;
    size_t n, cap;
    pcre2_match_data *md;
    sym *syms;
    size_t syms_cap;
    merge_item *heap;
    size_t heap_n, heap_cap;
    char *buf; /* the ByteLevel piece with its prefix space, or a byte-level string for ignore_merges */
    size_t buf_cap;
    char *buf2;
    size_t buf2_cap;
    keel_err *err;
} enc;

/* Grows *p to hold need elements; false when memory runs out. */
static bool grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return true;
    size_t c = KEEL_MAX(need, *cap * 2);
    c = KEEL_MAX(c, 16);
    void *q = realloc(*p, c * elem);
    if (!q) return false;
    *p = q, *cap = c;
    return true;
}

static keel_code emit(enc *e, int32_t id) {
    if (!grow((void **)&e->ids, &e->cap, e->n + 1, sizeof *e->ids))
        return keel_err_set(e->err, KEEL_E_NOMEM, "tokenizer: out of memory for %zu ids", e->n + 1);
    e->ids[e->n++] = id;
    return KEEL_OK;
}

static bool heap_less(const merge_item *a, const merge_item *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(enc *e, merge_item m) {
    size_t i = e->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&m, &e->heap[p])) break;
        e->heap[i] = e->heap[p], i = p;
    }
    e->heap[i] = m;
}

static merge_item heap_pop(enc *e) {
    merge_item top = e->heap[0], last = e->heap[--e->heap_n];
    size_t i = 0, n = e->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap_less(&e->heap[c + 1], &e->heap[c])) c++;
        if (!heap_less(&e->heap[c], &last)) break;
        e->heap[i] = e->heap[c], i = c;
    }
    if (n) e->heap[i] = last;
    return top;
}

static void push_pair(enc *e, int32_t pos) {
    const pair_slot *p = pair_map_get(&e->t->merges, e->syms[pos].id, e->syms[e->syms[pos].next].id);
    if (p) heap_push(e, (merge_item){p->rank, pos, p->new_id});
}

/* BPE on one pre-token of raw bytes, as HF's Word::merge_all: lowest rank first, then leftmost. */
static keel_code bpe(enc *e, const uint8_t *s, size_t len) {
    const keel_tokenizer *t = e->t;
    if (t->ignore_merges) {
        if (!grow((void **)&e->buf2, &e->buf2_cap, 2 * len, 1)) goto nomem;
        size_t k = 0;
        for (size_t i = 0; i < len; i++) k += (size_t)utf8_encode(t->byte_cp[s[i]], e->buf2 + k);
        int32_t id = str_map_get(&t->vocab, e->buf2, k);
        if (id >= 0) return emit(e, id);
    }
    if (!grow((void **)&e->syms, &e->syms_cap, 2 * len, sizeof *e->syms)) goto nomem;
    int32_t n = 0, unk_pending = 0;
    for (size_t i = 0; i < len; i++) {
        int k = t->init_n[s[i]];
        if (k > 0) {
            if (unk_pending && !t->init_fallback[s[i]]) e->syms[n++].id = t->unk_id, unk_pending = 0;
            for (int j = 0; j < k; j++) e->syms[n++].id = t->init_ids[s[i]][j];
        } else if (t->unk_id >= 0) {
            if (unk_pending && !t->fuse_unk) e->syms[n++].id = t->unk_id;
            unk_pending = 1;
        }
    }
    if (unk_pending) e->syms[n++].id = t->unk_id;
    for (int32_t i = 0; i < n; i++)
        e->syms[i] = (sym){e->syms[i].id, i - 1, i + 1 < n ? i + 1 : -1, false};
    if (!grow((void **)&e->heap, &e->heap_cap, 3 * (size_t)n + 1, sizeof *e->heap)) goto nomem;
    e->heap_n = 0;
    for (int32_t i = 0; i + 1 < n; i++) push_pair(e, i);
    while (e->heap_n) {
        merge_item top = heap_pop(e);
        sym *a = &e->syms[top.pos];
        if (a->dead || a->next < 0) continue;
        sym *b = &e->syms[a->next];
        const pair_slot *p = pair_map_get(&t->merges, a->id, b->id);
        if (!p || p->new_id != top.new_id) continue; /* a stale entry */
        a->id = top.new_id;
        b->dead = true;
        a->next = b->next;
        if (a->next >= 0) e->syms[a->next].prev = top.pos;
        if (!grow((void **)&e->heap, &e->heap_cap, e->heap_n + 2, sizeof *e->heap)) goto nomem;
        if (a->prev >= 0) push_pair(e, a->prev);
        if (a->next >= 0) push_pair(e, top.pos);
    }
    for (int32_t i = n ? 0 : -1; i >= 0; i = e->syms[i].next) {
        keel_code c = emit(e, e->syms[i].id);
        if (c) return c;
    }
    return KEEL_OK;
nomem:
    return keel_err_set(e->err, KEEL_E_NOMEM, "tokenizer: out of memory for a pre-token of %zu bytes", len);
}

static keel_code pretokenize(enc *e, int step, const uint8_t *s, size_t len);

/* Splits s by re, each match and each gap between matches a piece (HF's Isolated behavior). */
static keel_code split(enc *e, const pcre2_code *re, int next_step, const uint8_t *s, size_t len) {
    size_t off = 0, prev = 0;
    while (off < len) {
        int rc = pcre2_match(re, s, len, off, 0, e->md, NULL);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT) rc = pcre2_match(re, s, len, off, PCRE2_NO_JIT, e->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return keel_err_set(e->err, KEEL_E_RANGE, "tokenizer: pre-tokenizer regex failed at byte %zu: %s", off,
                                (const char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        size_t ms = KEEL_MAX((size_t)ov[0], prev), me = KEEL_MAX((size_t)ov[1], ms);
        keel_code c = KEEL_OK;
        if (ms > prev) c = pretokenize(e, next_step, s + prev, ms - prev);
        if (!c && me > ms) c = pretokenize(e, next_step, s + ms, me - ms);
        if (c) return c;
        prev = me;
        off = me > ms ? me : ms + 1; /* after an empty match, try again one character on */
        while (off < len && (s[off] & 0xc0) == 0x80) off++;
    }
    return prev < len ? pretokenize(e, next_step, s + prev, len - prev) : KEEL_OK;
}

/* Runs the pre-tokenizer from step on; past the last step, a piece goes to BPE. */
static keel_code pretokenize(enc *e, int step, const uint8_t *s, size_t len) {
    const keel_tokenizer *t = e->t;
    if (len == 0) return KEEL_OK;
    if (step >= t->n_steps) return bpe(e, s, len);
    const pre_step *st = &t->steps[step];
    if (st->kind == STEP_SPLIT) return split(e, st->re, step + 1, s, len);
    if (st->add_prefix_space && s[0] != ' ') {
        if (!grow((void **)&e->buf, &e->buf_cap, len + 1, 1))
            return keel_err_set(e->err, KEEL_E_NOMEM, "tokenizer: out of memory for %zu bytes", len + 1);
        e->buf[0] = ' ';
        memcpy(e->buf + 1, s, len);
        s = (const uint8_t *)e->buf, len++;
    }
    return st->re ? split(e, st->re, step + 1, s, len) : bpe(e, s, len);
}

/* Whether the character before s[n] (last) or at s[0] is a word character (\w). */
static bool word_char_at(enc *e, const uint8_t *s, size_t n, bool last) {
    if (n == 0) return false;
    size_t i = 0;
    if (last) {
        i = n - 1;
        while (i > 0 && (s[i] & 0xc0) == 0x80 && n - i < 4) i--;
    }
    return pcre2_match(e->t->word_re, s, n, i, PCRE2_ANCHORED, e->md, NULL) >= 0;
}

/* Added tokens with the given normalized flag split s; gaps go to the next pass (normalized tokens), then to the
 * pre-tokenizer. Leftmost match, longest there; single_word, lstrip and rstrip as HF applies them. */
static keel_code split_added(enc *e, bool normalized, const uint8_t *s, size_t len) {
    const keel_tokenizer *t = e->t;
    size_t done = 0, p = 0;
    while (p < len) {
        const int *l = t->by_byte[s[p]];
        const added_token *hit = NULL;
        for (; l && *l >= 0; l++) {
            const added_token *a = &t->added[*l];
            if (a->normalized == normalized && a->len <= len - p && !memcmp(s + p, a->content, a->len)) {
                hit = a;
                break;
            }
        }
        if (!hit) {
            p++;
            continue;
        }
        size_t start = p, stop = p + hit->len;
        if (hit->single_word && (word_char_at(e, s, start, true) || word_char_at(e, s + stop, len - stop, false))) {
            p = stop; /* like HF's non-overlapping search, the rejected span is not searched again */
            continue;
        }
        if (hit->lstrip) {
            while (start > done) {
                size_t i = start - 1;
                while (i > done && (s[i] & 0xc0) == 0x80) i--;
                uint32_t cp;
                if (utf8_decode(s + i, start - i, &cp) <= 0 || !is_white_space(cp)) break;
                start = i;
            }
        }
        if (hit->rstrip) {
            uint32_t cp;
            int l2;
            while (stop < len && (l2 = utf8_decode(s + stop, len - stop, &cp)) > 0 && is_white_space(cp))
                stop += (size_t)l2;
        }
        keel_code c = normalized ? pretokenize(e, 0, s + done, start - done)
                                 : split_added(e, true, s + done, start - done);
        if (!c) c = emit(e, hit->id);
        if (c) return c;
        done = p = stop;
    }
    return normalized ? pretokenize(e, 0, s + done, len - done) : split_added(e, true, s + done, len - done);
}

keel_code keel_tokenizer_encode(const keel_tokenizer *t, const char *text, size_t len, int32_t **ids, int *n,
                                keel_err *err) {
    *ids = NULL, *n = 0;
    if (len > (size_t)INT32_MAX / 2)
        return keel_err_set(err, KEEL_E_RANGE, "tokenizer: text of %zu bytes, expected at most %d", len, INT32_MAX / 2);
    enc e = {.t = t, .err = err};
    e.md = pcre2_match_data_create(1, NULL);
    if (!e.md) return keel_err_set(err, KEEL_E_NOMEM, "tokenizer: out of memory for regex match data");
    keel_code c = split_added(&e, false, (const uint8_t *)text, len);
    pcre2_match_data_free(e.md);
    free(e.syms), free(e.heap), free(e.buf), free(e.buf2);
    if (c) {
        free(e.ids);
        return c;
    }
    *ids = e.ids, *n = (int)e.n;
    return KEEL_OK;
}

/* ---- decoding -------------------------------------------------------------------------------------- */

static keel_code token_bytes(const keel_tokenizer *t, int32_t id, const uint8_t **b, size_t *n, keel_err *err) {
    if (id < 0 || id >= t->vocab_size)
        return keel_err_set(err, KEEL_E_RANGE, "tokenizer: token id %d is outside the vocabulary [0, %d)", id,
                            t->vocab_size);
    if (!t->present[id]) return keel_err_set(err, KEEL_E_RANGE, "tokenizer: token id %d has no token", id);
    *b = t->dec + t->dec_off[id];
    *n = (size_t)(t->dec_off[id + 1] - t->dec_off[id]);
    return KEEL_OK;
}

keel_code keel_tokenizer_decode(const keel_tokenizer *t, const int32_t *ids, int n, char **out, size_t *len,
                                keel_err *err) {
    *out = NULL, *len = 0;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        const uint8_t *b = NULL;
        size_t k = 0;
        keel_code c = token_bytes(t, ids[i], &b, &k, err);
        if (c) return keel_err_prefix(err, "position %d: ", i), c;
        total += k;
    }
    char *s = malloc(total + 1);
    if (!s) return keel_err_set(err, KEEL_E_NOMEM, "tokenizer: out of memory for %zu decoded bytes", total);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        const uint8_t *b = NULL;
        size_t k = 0;
        token_bytes(t, ids[i], &b, &k, NULL);
        memcpy(s + off, b, k), off += k;
    }
    s[off] = 0;
    *out = s, *len = off;
    return KEEL_OK;
}

void keel_detok_init(keel_detok *d, const keel_tokenizer *t) {
    memset(d, 0, sizeof *d);
    d->t = t;
}

static const char replacement[3] = {(char)0xef, (char)0xbf, (char)0xbd};

keel_code keel_detok_push(keel_detok *d, int32_t id, char *out, size_t cap, size_t *written, keel_err *err) {
    *written = 0;
    const uint8_t *b = NULL;
    size_t k = 0;
    keel_code c = token_bytes(d->t, id, &b, &k, err);
    if (c) return c;
    size_t n = (size_t)d->n_held + k, w = 0, i = 0;
    uint8_t small[256], *s = n <= sizeof small ? small : malloc(n);
    if (!s) return keel_err_set(err, KEEL_E_NOMEM, "tokenizer: out of memory for %zu bytes", n);
    memcpy(s, d->held, (size_t)d->n_held);
    memcpy(s + d->n_held, b, k);
    while (i < n) {
        int l = utf8_char(s + i, n - i);
        if (l == 0) break; /* an incomplete character at the end: hold it */
        const char *src = l > 0 ? (const char *)s + i : replacement;
        size_t m = l > 0 ? (size_t)l : 3;
        if (w + m > cap) {
            if (s != small) free(s);
            return keel_err_set(err, KEEL_E_ARG, "tokenizer: output buffer of %zu bytes too small for token %d", cap,
                                id);
        }
        memcpy(out + w, src, m);
        w += m;
        i += (size_t)(l > 0 ? l : -l);
    }
    KEEL_ASSERT(n - i < sizeof d->held);
    memcpy(d->held, s + i, n - i);
    d->n_held = (int)(n - i);
    if (s != small) free(s);
    *written = w;
    return KEEL_OK;
}

size_t keel_detok_flush(keel_detok *d, char *out, size_t cap) {
    KEEL_ASSERT(cap >= 3);
    if (!d->n_held) return 0;
    d->n_held = 0;
    memcpy(out, replacement, 3);
    return 3;
}
