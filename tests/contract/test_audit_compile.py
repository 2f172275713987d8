"""Gate 5 with the pinned compilers: `keel audit` passes on the repository; the planted twin (run-time-indexed
local array) goes red with stack and spill problems; a record edited to disagree, and a foreign compiler line,
are reported naming the field. Skips (77) only when nvcc or Debian's hipcc is not installed (tools/deps.sh)."""
import os, re, shutil, subprocess, sys, tempfile

keel = os.environ.get("KEEL_BIN", "build/keel")
src = os.environ.get("KEEL_SRC", ".")
nvcc = os.environ.get("KEEL_NVCC", "/usr/local/cuda/bin/nvcc")
hipcc = os.environ.get("KEEL_HIPCC", "/usr/bin/hipcc")
# 0. every __global__ of every kernel source is recorded on every recorded chip (the sources are the reference;
#    needs no compiler)
rec_dir = os.path.join(src, "contract/records")
chips = sorted(os.listdir(rec_dir))
missing = []
for d in ("src/kernels/cuda", "src/engine/cuda"):
    for f in sorted(os.listdir(os.path.join(src, d))):
        if not f.endswith(".cu"):
            continue
        names = re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)", open(os.path.join(src, d, f)).read())
        for chip in chips:
            recorded = open(os.path.join(rec_dir, chip)).read()
            missing += [f"{chip} {d}/{f} {n}" for n in names if not re.search(rf"^RECORD {chip} {n}[<\s]", recorded, re.M)]
if missing or len(chips) < 8:
    print("FAIL: kernels without records:\n" + "\n".join(missing) + f"\nchips: {chips}")
    sys.exit(1)

if not os.access(nvcc, os.X_OK):
    print(f"skip: no nvcc at {nvcc} (tools/deps.sh does not install CUDA)"); sys.exit(77)
if not os.access(hipcc, os.X_OK):
    print(f"skip: no hipcc at {hipcc} (tools/deps.sh installs it)"); sys.exit(77)

failures = []
def audit(*args):
    p = subprocess.run([keel, "audit", *args], capture_output=True, text=True, cwd=src)
    return p.returncode, p.stdout + p.stderr

def expect(cond, what, out):
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}\n{out[-3000:]}")

# 1. the repository's kernels against its records. The sanitizer build (KEEL_SANITIZED) tests the audit's host code,
#    which one source on every chip runs whole; the compilers' work is the same as in the Release build's full audit.
scope = ("--source", "src/engine/cuda/sample.cu") if os.environ.get("KEEL_SANITIZED") else ()
rc, out = audit(*scope)
expect(rc == 0 and re.search(rf"AUDIT {len(chips)} chips, \d+ kernel records: 0 limit problems", out), "keel audit passes", out)

tmp = tempfile.mkdtemp(prefix="keel-audit-test-", dir=os.environ.get("KEEL_TMP"))
empty = os.path.join(tmp, "none")
# 2. the planted twin: a stack frame and spills on CUDA, scratch on gfx
rc, out = audit("--source", "src/contract/gate5_twin.cu", "--chips", "sm_90,gfx1030", "--records", empty)
expect(rc == 1, "twin audit exits 1", out)
for field in ("stack", "spill_st", "spill_ld"):
    expect(re.search(rf"LIMIT sm_90 gate5_local_array {field}: [1-9]\d*, and no known finding", out),
           f"twin red on sm_90 {field}", out)
expect(re.search(r"LIMIT gfx1030 gate5_local_array scratch: [1-9]\d*", out), "twin red on gfx1030 scratch", out)

# 3. a record edited to disagree, and a compiler line from another compiler (one small source: step 1 compiled all)
recs = os.path.join(tmp, "records")
shutil.copytree(os.path.join(src, "contract/records"), recs)
path = os.path.join(recs, "sm_90")
text = open(path).read()
one = ("--source", "src/engine/cuda/sample.cu")
rc, out = audit("--chips", "sm_90", "--records", recs, *one)
expect(rc == 0 and re.search(r"AUDIT 1 chips, 1 kernel records: 0 limit problems", out),
       "one source audits alone, the other sources' records not reported gone", out)
m = re.search(r"^RECORD sm_90 (sample_kernel) .*\bregs=(\d+)", text, re.M)
expect(m is not None, "sm_90 records hold sample_kernel", text)
if m:
    kernel, regs = m.group(1), int(m.group(2))
    line = m.group(0)
    open(path, "w").write(text.replace(line, line.replace(f"regs={regs}", f"regs={regs + 8}")))
    rc, out = audit("--chips", "sm_90", "--records", recs, *one)
    expect(rc == 1 and f"LIMIT sm_90 {kernel} regs: recorded {regs + 8}, compiled {regs}" in out,
           "edited record reported naming regs", out)
    open(path, "w").write(re.sub(r"^COMPILER sm_90 .*$", "COMPILER sm_90 Cuda compilation tools, release 12.4, V12.4.99",
                                 text, flags=re.M))
    rc, out = audit("--chips", "sm_90", "--records", recs, *one)
    expect(rc == 1 and "LIMIT sm_90 - compiler: recorded with 'Cuda compilation tools, release 12.4" in out
           and "regs:" not in out, "foreign compiler refused", out)
    rc, out = audit("--chips", "sm_90", "--records", recs, "--any-compiler", *one)
    expect(rc == 0 and "compared anyway" in out, "--any-compiler compares anyway", out)

# 4. bad arguments are reasons, not crashes
rc, out = audit("--chips", "sm_99")
expect(rc == 1 and "unknown chip 'sm_99'" in out, "unknown chip refused", out)
rc, out = audit("--source", os.path.join(tmp, "missing.cu"), "--chips", "sm_90")
expect(rc == 1 and "--source" in out, "missing source refused", out)
shutil.rmtree(tmp, ignore_errors=True)
print(f"{len(failures)} checks failed")
sys.exit(1 if failures else 0)
