/* keel tokenize / detokenize: text to ids and back through MODEL_DIR/tokenizer.json. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "cli.h"
#include "tokenizer/tokenizer.h"

/* MODEL_DIR/tokenizer.json, or the path itself when it names a file. */
static keel_tokenizer *open_tokenizer(const char *cmd, const char *model) {
    char path[4096];
    struct stat st;
    if (stat(model, &st) == 0 && S_ISREG(st.st_mode)) snprintf(path, sizeof path, "%s", model);
    else snprintf(path, sizeof path, "%s/tokenizer.json", model);
    keel_tokenizer *t;
    keel_err err;
    if (keel_tokenizer_load(&t, path, &err)) {
        keel_cli_fail(cmd, "%s", err.msg);
        return NULL;
    }
    return t;
}

int keel_cli_tokenize(int argc, char **argv) {
    const char *model = NULL, *text = NULL;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) json = true;
        else if (!model) model = argv[i];
        else if (!text) text = argv[i];
        else return keel_cli_fail("tokenize", "unexpected argument '%s' (usage: keel tokenize MODEL_DIR TEXT [--json])",
                                  argv[i]);
    }
    if (!text)
        return keel_cli_fail("tokenize", "expected MODEL_DIR and TEXT (usage: keel tokenize MODEL_DIR TEXT [--json])");
    keel_tokenizer *t = open_tokenizer("tokenize", model);
    if (!t) return 1;
    int32_t *ids;
    int n;
    keel_err err;
    if (keel_tokenizer_encode(t, text, strlen(text), &ids, &n, &err)) {
        keel_tokenizer_free(t);
        return keel_cli_fail("tokenize", "%s", err.msg);
    }
    if (json) putchar('[');
    for (int i = 0; i < n; i++) printf("%s%d", i ? (json ? ", " : " ") : "", ids[i]);
    puts(json ? "]" : "");
    free(ids);
    keel_tokenizer_free(t);
    return 0;
}

/* Ids separated by commas and/or whitespace, each a decimal integer. */
static int parse_ids(const char *s, int32_t **out, int *n) {
    int cap = 16;
    int32_t *ids = keel_xmalloc((size_t)cap * sizeof *ids);
    *n = 0;
    for (const char *p = s;;) {
        while (*p == ',' || *p == ' ' || *p == '\t' || *p == '\n') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        size_t tok = strcspn(p, ", \t\n");
        if (end == p || (size_t)(end - p) != tok || errno || v < INT32_MIN || v > INT32_MAX) {
            keel_cli_fail("detokenize", "bad token id '%.*s' at position %d: expected an integer",
                          (int)KEEL_MIN(tok, 40), p, *n);
            free(ids);
            return 1;
        }
        if (*n == cap) ids = keel_xrealloc(ids, (size_t)(cap *= 2) * sizeof *ids);
        ids[(*n)++] = (int32_t)v;
        p = end;
    }
    *out = ids;
    return 0;
}

int keel_cli_detokenize(int argc, char **argv) {
    if (argc < 3)
        return keel_cli_fail("detokenize", "expected MODEL_DIR and IDS (usage: keel detokenize MODEL_DIR IDS)");
    size_t total = 1;
    for (int i = 2; i < argc; i++) total += strlen(argv[i]) + 1;
    char *joined = keel_xmalloc(total);
    joined[0] = 0;
    for (int i = 2; i < argc; i++) strcat(strcat(joined, i > 2 ? " " : ""), argv[i]);
    int32_t *ids;
    int n;
    int rc = parse_ids(joined, &ids, &n);
    free(joined);
    if (rc) return rc;
    keel_tokenizer *t = open_tokenizer("detokenize", argv[1]);
    if (!t) {
        free(ids);
        return 1;
    }
    char *text;
    size_t len;
    keel_err err;
    keel_code c = keel_tokenizer_decode(t, ids, n, &text, &len, &err);
    free(ids);
    keel_tokenizer_free(t);
    if (c) return keel_cli_fail("detokenize", "%s", err.msg);
    fwrite(text, 1, len, stdout);
    putchar('\n');
    free(text);
    return 0;
}
