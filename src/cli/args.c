/* cli: option value parsing shared by the subcommands. */
#include <errno.h>
#include <stdlib.h>

#include "cli.h"

bool keel_cli_parse_long(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}
