/* keel audit: gate 5 offline. Compiles every registered GPU kernel for every recorded chip with the pinned
 * compilers and reports each difference from the records, and each broken limit, as a limit problem. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "contract/audit.h"

static const char usage[] =
    "usage: keel audit [--chips LIST] [--print-records] [--records DIR] [--findings FILE] [--source FILE.cu]\n"
    "                  [--any-compiler] [-j N]\n";

int keel_cli_audit(int argc, char **argv) {
    keel_audit_opts o = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool more = i + 1 < argc;
        if (!strcmp(a, "--chips") && more) o.chips = argv[++i];
        else if (!strcmp(a, "--print-records")) o.print_records = true;
        else if (!strcmp(a, "--records") && more) o.records_dir = argv[++i];
        else if (!strcmp(a, "--findings") && more) o.findings = argv[++i];
        else if (!strcmp(a, "--source") && more) o.source = argv[++i];
        else if (!strcmp(a, "--any-compiler")) o.any_compiler = true;
        else if ((!strcmp(a, "-j") || !strcmp(a, "--jobs")) && more) {
            char *end;
            long j = strtol(argv[++i], &end, 10);
            if (*end || j < 1 || j > 256) return keel_cli_fail("audit", "-j %s: expected a count 1..256", argv[i]);
            o.jobs = (int)j;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(usage, stdout);
            return 0;
        } else {
            fputs(usage, stderr);
            return keel_cli_fail("audit", "unknown or incomplete argument '%s'", a);
        }
    }
    int problems = 0;
    keel_err err = {0};
    if (keel_audit_run(&o, stdout, &problems, &err) != KEEL_OK) return keel_cli_fail("audit", "%s", err.msg);
    return problems ? 1 : 0;
}
