"""`keel bench cpu`: argument errors name the option, `stream`/`decode` refuse without CUDA, a tiny run prints a
full table with positive timings and bandwidths."""
import os
import re
import subprocess
import sys

BIN = os.environ.get("KEEL_BIN")
if not BIN or not os.path.exists(BIN):
    print("skip: KEEL_BIN is not set to the keel binary")
    sys.exit(77)


def run(*args):
    p = subprocess.run([BIN, "bench", *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


failures = []


def expect_error(args, pattern):
    rc, out, err = run(*args)
    if rc == 0 or not re.search(pattern, err):
        failures.append(f"bench {' '.join(args)}: rc {rc}, stderr {err!r}, expected /{pattern}/")


expect_error([], r"expected a benchmark: cpu, stream or decode")
expect_error(["nope"], r"unknown benchmark 'nope'")
# stream refuses a bad option (or, built without CUDA, says so); it runs for real where there is a GPU.
expect_error(["stream", "--frobnicate"], r"keel bench stream: (unknown option '--frobnicate'|this keel was built without CUDA)")
expect_error(["stream", "--xbudget", "48x"],
             r"keel bench stream: (--xbudget '48x': expected a comma list of KiB or auto|this keel was built without CUDA)")
expect_error(["stream", "--xbudget", "autox"],
             r"keel bench stream: (--xbudget 'autox': expected a comma list of KiB or auto|this keel was built without CUDA)")
expect_error(["stream", "--xbudget", "48,,96"],
             r"keel bench stream: (--xbudget '48,,96': expected a comma list of KiB or auto|this keel was built without CUDA)")
# decode without a model says so.
expect_error(["decode"], r"keel bench decode: no MODEL_DIR given")
expect_error(["cpu", "--threads", "0"], r"--threads expects an integer in 1\.\.4096, found '0'")
expect_error(["cpu", "--threads", "2x"], r"--threads expects .* found '2x'")
expect_error(["cpu", "--threads"], r"--threads needs a value")
expect_error(["cpu", "--seconds", "0"], r"--seconds expects a number in \(0, 3600\], found '0'")
expect_error(["cpu", "--seconds", "abc"], r"--seconds expects .* found 'abc'")
expect_error(["cpu", "--k", "100"], r"--k expects a multiple of 64 .* found '100'")
expect_error(["cpu", "--n", "0"], r"--n expects an integer .* found '0'")
expect_error(["cpu", "--bits", "4"], r"unknown option '--bits'")
expect_error(["cpu", "--n", "16777216", "--k", "1048576", "--seconds", "0.001"], r"cannot allocate .* MiB")

rc, out, err = run("cpu", "--n", "128", "--k", "256", "--seconds", "0.01", "--threads", "1")
if rc != 0:
    failures.append(f"tiny bench failed: rc {rc}, stderr {err!r}")
else:
    m = re.search(r"read bandwidth .*: ([0-9.]+) GB/s", out)
    if not m or float(m.group(1)) <= 0:
        failures.append(f"no positive read bandwidth in:\n{out}")
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+([0-9.]+)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+(\d+)%$", out, re.M)
    seen = sorted((int(r[0]), int(r[3])) for r in rows)
    want = sorted((b, mm) for b in (2, 3, 4, 5, 6, 8) for mm in (1, 8))
    if seen != want:
        failures.append(f"table rows {seen}, expected {want}:\n{out}")
    for r in rows:
        if int(r[1]) != 128 or float(r[4]) <= 0 or float(r[5]) <= 0:
            failures.append(f"bad row {r}")
    if "threads" not in out or "1 threads" not in out:
        failures.append(f"thread count not reported:\n{out}")

for f in failures:
    print("FAIL:", f)
sys.exit(1 if failures else 0)
