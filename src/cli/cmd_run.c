/* placeholder until this command is built; its owner replaces this file. */
#include "cli.h"
int keel_cli_run(int argc, char **argv) { (void)argc; (void)argv; return keel_cli_fail("run", "not built yet"); }
int keel_cli_logits(int argc, char **argv) { (void)argc; (void)argv; return keel_cli_fail("logits", "not built yet"); }
