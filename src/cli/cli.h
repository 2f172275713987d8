/* cli: the `keel` command. Each subcommand is one function taking its own argv (argv[0] is the subcommand);
 * it prints results on stdout, reasons for failure on stderr, and returns the process exit status. */
#ifndef KEEL_CLI_H
#define KEEL_CLI_H

#include <stdbool.h>

int keel_cli_info(int argc, char **argv);       /* cmd_info.c */
int keel_cli_quantize(int argc, char **argv);   /* cmd_quantize.c */
int keel_cli_synth(int argc, char **argv);      /* cmd_synth.c */
int keel_cli_run(int argc, char **argv);        /* cmd_run.c */
int keel_cli_logits(int argc, char **argv);     /* cmd_run.c */
int keel_cli_tokenize(int argc, char **argv);   /* cmd_tokenize.c */
int keel_cli_detokenize(int argc, char **argv); /* cmd_tokenize.c */
int keel_cli_bench(int argc, char **argv);      /* cmd_bench.c */
int keel_cli_contract(int argc, char **argv);   /* cmd_contract.c */
int keel_cli_audit(int argc, char **argv);      /* cmd_audit.c */

/* Reports a failure: "keel <cmd>: <reason>" on stderr; returns 1 for use as an exit status. */
int keel_cli_fail(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* A whole decimal integer in [lo, hi] into *out; false (and *out untouched) otherwise. (args.c) */
bool keel_cli_parse_long(const char *s, long lo, long hi, long *out);

#endif
