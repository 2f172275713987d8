"""`keel contract --backend cpu` end to end: exit 0, exactly one SUMMARY line whose counts agree with --list and
with the --json results; --filter, --json, the known-findings list (a stale entry fails the run), bad arguments,
and --backend cuda where this build or host has no GPU (a clear message and exit status 3)."""
import json
import os
import re
import subprocess
import sys

KEEL = os.environ.get("KEEL_BIN")
TMP = os.environ.get("KEEL_TMP", "/tmp")
SUMMARY = re.compile(
    r"^SUMMARY (cpu-avx2|cpu-portable) (\d+) kernels: (\d+) pass gates 1-4, (\d+) fail, (\d+) known findings; "
    r"(\d+) controls: (\d+) red as planted(?:, (\d+) red early)?, (\d+) missed; (\d+) limit problems$")
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def keel(*args):
    return subprocess.run([KEEL, "contract", *args], capture_output=True, text=True, timeout=300)


def listed(*args):
    p = keel("--backend", "cpu", "--list", *args)
    check(p.returncode == 0, f"--list rc {p.returncode}: {p.stderr}")
    regs = [l for l in p.stdout.splitlines() if l.startswith("cpu/")]
    check(p.stdout.splitlines()[-1] == f"{len(regs)} registrations", "--list ends with its count")
    return regs


def main():
    if not KEEL or not os.path.exists(KEEL):
        print("KEEL_BIN not set or missing")
        return 1
    regs = listed()
    n_controls = sum(len(l.split(" controls=")[1].split(",")) for l in regs)
    check(len(regs) >= 115, f"only {len(regs)} CPU registrations")
    check(all(" controls=" in l and l.split(" controls=")[1] for l in regs), "every registration has a control")

    out_json = os.path.join(TMP, "contract_cpu.json")
    p = keel("--backend", "cpu", "--json", out_json)
    lines = p.stdout.splitlines()
    sums = [l for l in lines if l.startswith("SUMMARY")]
    check(p.returncode == 0, f"keel contract --backend cpu: rc {p.returncode}\n{p.stdout[-3000:]}{p.stderr}")
    check(len(sums) == 1, f"expected one SUMMARY line, found {len(sums)}")
    check(lines and lines[-1].startswith("SUMMARY"), "SUMMARY is the last line")
    m = SUMMARY.match(sums[0]) if sums else None
    check(m is not None, f"SUMMARY format: {sums}")
    if m:
        kernels, npass, nfail, known, controls, red, early, missed, limits = (
            int(m.group(i) or 0) for i in range(2, 11))
        check(kernels == len(regs), f"SUMMARY kernels {kernels} != --list {len(regs)}")
        check(npass + nfail + known == kernels, "pass + fail + known == kernels")
        check(nfail == 0 and missed == 0 and limits == 0, sums[0])
        check(controls == n_controls, f"SUMMARY controls {controls} != --list {n_controls}")
        check(red + early + missed == controls, "controls add up")
        results = json.load(open(out_json))
        check(len(results) == kernels, "--json has every registration")
        for r in results:
            g3 = [g for g in r["gates"] if g["gate"] == 3][0]
            check(g3["result"] == "pass" or r["status"] == "known-finding", f"{r['name']} gate 3 {g3}")
            check(0 <= g3["fraction_of_bound"] <= 1 and g3["bound_at_max"] > 0, f"{r['name']} gate 3 numbers {g3}")
            check(all(c["red_at"] == c["planted_gate"] for c in r["controls"]), f"{r['name']} controls")
            check(len(r["controls"]) >= 1, f"{r['name']} has no control")

    # --filter runs the matching registrations only.
    p = keel("--backend", "cpu", "--filter", "^cpu/portable/stream/q3g64/")
    m = SUMMARY.match(p.stdout.splitlines()[-1])
    check(p.returncode == 0 and m and int(m.group(2)) == 6, f"--filter: {p.stdout}")
    p = keel("--backend", "cpu", "--filter", "([")
    check(p.returncode == 2 and "--filter" in p.stderr, f"bad regex: rc {p.returncode} {p.stderr}")

    # A known finding that no longer fails is itself an error; so is one naming no registration.
    stale = os.path.join(TMP, "known_findings_stale")
    with open(stale, "w") as f:
        f.write("cpu/portable/stream/q3g64/f16/none 3 was off by one ulp\ncpu/portable/stream/q9g64/f16/none 3 x\n")
    p = keel("--backend", "cpu", "--filter", "^cpu/portable/stream/q3g64/", "--known-findings", stale)
    check(p.returncode == 1, f"stale finding: rc {p.returncode}")
    check("STALE cpu/portable/stream/q3g64/f16/none" in p.stdout, "stale entry reported")
    check("STALE cpu/portable/stream/q9g64/f16/none" in p.stdout, "entry naming no registration reported")
    bad = os.path.join(TMP, "known_findings_bad")
    with open(bad, "w") as f:
        f.write("cpu/portable/stream/q3g64/f16/none three reason\n")
    p = keel("--backend", "cpu", "--known-findings", bad)
    check(p.returncode == 2 and "known_findings_bad:1" in p.stderr, f"malformed list: {p.returncode} {p.stderr}")
    p = keel("--backend", "cpu", "--known-findings", os.path.join(TMP, "no_such_list"))
    check(p.returncode == 2 and "no_such_list" in p.stderr, f"missing list: {p.returncode} {p.stderr}")

    # Bad arguments.
    for args in (["--backend", "tpu"], ["--frobnicate"], ["--filter"]):
        p = keel(*args)
        check(p.returncode == 2 and p.stderr, f"{args}: rc {p.returncode}")

    # --backend cuda without a GPU (or without a CUDA build): a clear message and exit 3, never a crash.
    p = keel("--backend", "cuda")
    if p.returncode == 3:
        check("cuda backend is not available" in p.stderr, f"cuda unavailable message: {p.stderr}")
    else:
        check(p.returncode in (0, 1) and any(l.startswith("SUMMARY sm_") for l in p.stdout.splitlines()),
              f"cuda: rc {p.returncode} {p.stdout[-500:]} {p.stderr}")

    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
