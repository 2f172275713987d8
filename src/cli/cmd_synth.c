/* keel synth: writes a random checkpoint of a config's geometry (for tests, demos and benchmarks). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "model/model.h"

#define SYNTH_USAGE "usage: keel synth CONFIG OUT_DIR [--bits B] [--group G] [--scales bf16|f16|f32] [--mtp-bits B] [--seed S]"

static bool parse_u64(const char *s, uint64_t *out) {
    if (!s || !*s || *s == '-') return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end) return false;
    *out = v;
    return true;
}

int keel_cli_synth(int argc, char **argv) {
    const char *cfg_path = NULL, *out = NULL;
    keel_synth_opts o = {4, 64, KEEL_DT_BF16, 0, 0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--bits") || !strcmp(a, "--group") || !strcmp(a, "--mtp-bits") || !strcmp(a, "--seed") ||
            !strcmp(a, "--scales")) {
            if (i + 1 >= argc) return keel_cli_fail("synth", "%s needs a value (%s)", a, SYNTH_USAGE);
            const char *v = argv[++i];
            if (!strcmp(a, "--scales")) {
                if (!strcmp(v, "bf16")) o.sdt = KEEL_DT_BF16;
                else if (!strcmp(v, "f16")) o.sdt = KEEL_DT_F16;
                else if (!strcmp(v, "f32")) o.sdt = KEEL_DT_F32;
                else return keel_cli_fail("synth", "--scales %s: expected bf16, f16 or f32", v);
                continue;
            }
            uint64_t x;
            if (!parse_u64(v, &x) || (strcmp(a, "--seed") && x > 64))
                return keel_cli_fail("synth", "%s %s: expected a non-negative integer%s", a, v,
                                     strcmp(a, "--seed") ? " (a width or group)" : "");
            if (!strcmp(a, "--bits")) o.bits = (int)x;
            else if (!strcmp(a, "--group")) o.group = (int)x;
            else if (!strcmp(a, "--mtp-bits")) o.mtp_bits = (int)x;
            else o.seed = x;
            if (!strcmp(a, "--mtp-bits") && x == 0) return keel_cli_fail("synth", "--mtp-bits 0: expected 2, 3, 4, 5, 6 or 8");
        } else if (a[0] == '-' && a[1]) {
            return keel_cli_fail("synth", "unknown option %s (%s)", a, SYNTH_USAGE);
        } else if (!cfg_path) {
            cfg_path = a;
        } else if (!out) {
            out = a;
        } else {
            return keel_cli_fail("synth", "unexpected argument %s (%s)", a, SYNTH_USAGE);
        }
    }
    if (!cfg_path || !out) return keel_cli_fail("synth", "missing CONFIG or OUT_DIR (%s)", SYNTH_USAGE);
    keel_err err = {0};
    char *text = NULL;
    if (keel_read_file(cfg_path, &text, NULL, &err)) return keel_cli_fail("synth", "%s", err.msg);
    double t0 = keel_now();
    keel_code rc = keel_synth_write(text, out, &o, &err);
    free(text);
    if (rc) return keel_cli_fail("synth", "%s: %s", cfg_path, err.msg);
    printf("synth: wrote %s (bits=%d group=%d scales=%s%s, seed %llu) in %.2f s\n", out, o.bits, o.group,
           keel_dtype_name(o.sdt), o.mtp_bits ? ", with an MTP head" : "", (unsigned long long)o.seed, keel_now() - t0);
    return 0;
}
