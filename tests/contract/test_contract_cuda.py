"""`keel contract --backend cuda` on a GPU: every CUDA registration (stream tiles at every width, group, scale,
activation and output dtype and epilogue; relu2; routed fc1/fc2) passes gates 1-4 and every planted control is
red at its gate; exactly one SUMMARY line, agreeing with --list and --json. Without a GPU (or a CUDA build) the
command must say why and exit 3; the GPU part is then skipped (77) with that reason."""
import json
import os
import re
import subprocess
import sys

KEEL = os.environ.get("KEEL_BIN")
TMP = os.environ.get("KEEL_TMP", "/tmp")
SUMMARY = re.compile(
    r"^SUMMARY (sm_\d+) (\d+) kernels: (\d+) pass gates 1-4, (\d+) fail, (\d+) known findings; "
    r"(\d+) controls: (\d+) red as planted(?:, (\d+) red early)?, (\d+) missed; (\d+) limit problems$")
LAUNCHERS = ("keel_cuda_stream_matmul", "keel_cuda_relu2", "keel_cuda_stream_experts_up",
             "keel_cuda_stream_experts_down")
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def keel(*args, timeout=600):
    return subprocess.run([KEEL, "contract", *args], capture_output=True, text=True, timeout=timeout)


def main():
    if not KEEL or not os.path.exists(KEEL):
        print("KEEL_BIN not set or missing")
        return 1
    p = keel("--backend", "cuda", "--list")
    if p.returncode == 3:
        ok = "cuda backend is not available" in p.stderr and ("without CUDA" in p.stderr or "no CUDA device" in p.stderr)
        if not ok:
            print(f"FAIL: --backend cuda unavailable, but the message does not say why: {p.stderr!r}")
            return 1
        print(f"skip: {p.stderr.strip()}")
        return 77
    check(p.returncode == 0, f"--list rc {p.returncode}: {p.stderr}")
    regs = [l for l in p.stdout.splitlines() if l.startswith("cuda/")]
    check(p.stdout.splitlines()[-1].endswith(" registrations"), "--list ends with its count")
    n_controls = sum(len(l.split(" controls=")[1].split(",")) for l in regs if " controls=" in l)
    check(all(" controls=" in l and l.split(" controls=")[1] for l in regs), "every registration has a control")
    for entry in LAUNCHERS:
        check(any(f" entry={entry} " in l for l in regs), f"{entry} is not registered")
    names = {l.split()[0] for l in regs}
    for bits in (2, 3, 4, 5, 6, 8):
        for g in (32, 64, 128):
            for s in ("bf16", "f16", "f32"):
                for x in ("bf16", "f16"):
                    for y in ("f32", "bf16"):
                        for e in ("none", "relu2"):
                            n = f"cuda/mma/stream/q{bits}g{g}/{s}/x{x}-y{y}/{e}"
                            check(n in names, f"{n} is not registered")
    planted = {c.split("@")[0] for l in regs for c in l.split(" controls=")[1].split(",")}
    check(planted >= {"width-as-4", "bias-dropped", "write-past-end", "epilogue-order", "row-leak"},
          f"controls planted: {sorted(planted)}")

    out_json = os.path.join(TMP, "contract_cuda.json")
    p = keel("--backend", "cuda", "--json", out_json)
    lines = p.stdout.splitlines()
    sums = [l for l in lines if l.startswith("SUMMARY")]
    check(p.returncode == 0, f"keel contract --backend cuda: rc {p.returncode}\n{p.stdout[-4000:]}{p.stderr[-2000:]}")
    check(len(sums) == 1, f"expected one SUMMARY line, found {len(sums)}")
    m = SUMMARY.match(sums[0]) if sums else None
    check(m is not None, f"SUMMARY format: {sums}")
    if m:
        print(sums[0])
        kernels, npass, nfail, known, controls, red, early, missed, limits = (
            int(m.group(i) or 0) for i in range(2, 11))
        check(kernels == len(regs), f"SUMMARY kernels {kernels} != --list {len(regs)}")
        check(npass == kernels and nfail == 0 and missed == 0, sums[0])
        check(controls == n_controls, f"SUMMARY controls {controls} != --list {n_controls}")
        check(red == controls and early == 0, f"every control red as planted: {sums[0]}")
        results = json.load(open(out_json))
        check(len(results) == kernels, "--json has every registration")
        for r in results:
            check(r["status"] == "pass", f"{r['name']}: {r['status']}")
            g3 = [g for g in r["gates"] if g["gate"] == 3][0]
            exact = g3.get("max_error", -1) == 0  # integer outputs (argmax, chosen experts) have no bound to use
            check(0 <= g3.get("fraction_of_bound", -1) <= 1 and (g3.get("bound_at_max", 0) > 0 or exact),
                  f"{r['name']} gate 3 numbers {g3}")
            check(r["controls"] and all(c["red_at"] == c["planted_gate"] for c in r["controls"]),
                  f"{r['name']} controls {r['controls']}")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
