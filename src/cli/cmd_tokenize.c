/* placeholder until this command is built; its owner replaces this file. */
#include "cli.h"
int keel_cli_tokenize(int argc, char **argv) { (void)argc; (void)argv; return keel_cli_fail("tokenize", "not built yet"); }
int keel_cli_detokenize(int argc, char **argv) { (void)argc; (void)argv; return keel_cli_fail("detokenize", "not built yet"); }
