/* placeholder until this command is built; its owner replaces this file. */
#include "cli.h"
int keel_cli_audit(int argc, char **argv) { (void)argc; (void)argv; return keel_cli_fail("audit", "not built yet"); }
