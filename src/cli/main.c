/* keel: run and serve MLX-quantized Nemotron-H models. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"

typedef struct command {
    const char *name;
    int (*fn)(int, char **);
    const char *usage;
} command;

static const command commands[] = {
    {"info", keel_cli_info, "info MODEL_DIR [--mtp FILE] [--json]"},
    {"quantize", keel_cli_quantize, "quantize IN OUT --bits B --group G [--scales bf16|f16|f32] [--plan PLAN.json]"},
    {"synth", keel_cli_synth, "synth CONFIG OUT_DIR [--bits B] [--group G] [--scales bf16|f16|f32] [--mtp-bits B] [--seed S]"},
    {"run", keel_cli_run, "run MODEL_DIR (--prompt TEXT | --tokens 1,2,3) [-n N] [--greedy | --temp T ...]"},
    {"logits", keel_cli_logits, "logits MODEL_DIR (--tokens 1,2,3 | --prompt TEXT) --out FILE [--mtp]"},
    {"tokenize", keel_cli_tokenize, "tokenize MODEL_DIR TEXT [--json]"},
    {"detokenize", keel_cli_detokenize, "detokenize MODEL_DIR IDS"},
    {"bench", keel_cli_bench, "bench cpu|stream|decode ..."},
    {"contract", keel_cli_contract, "contract [--backend cpu|cuda|all] [--filter REGEX] [--json FILE] [--list]"},
    {"audit", keel_cli_audit, "audit [--chips LIST] [--print-records]"},
};

int keel_cli_fail(const char *cmd, const char *fmt, ...) {
    fflush(stdout);
    fprintf(stderr, "keel %s: ", cmd);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return 1;
}

static int usage(FILE *f) {
    fprintf(f, "usage: keel COMMAND ...\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) fprintf(f, "  keel %s\n", commands[i].usage);
    return f == stderr ? 2 : 0;
}

int main(int argc, char **argv) {
    if (argc < 2) return usage(stderr);
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) return usage(stdout);
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(argv[1], commands[i].name)) return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "keel: unknown command '%s'\n", argv[1]);
    return usage(stderr);
}
