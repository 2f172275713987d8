"""keel bench decode refuses bad options with a message naming the option, before touching a model or a device:
--context below --prompt-tokens, the CUDA engine's options (--context, --graphs, --pdl, --pdl-engine, --prefetch,
--split-target, --split-long, --split-round, --side, --fused-router, --fused-mamba, --route-window, --fused-norm,
--packed) on the CPU backend, values that are not numbers, on/off (on/off/low, up/down), or in range."""
import os
import subprocess
import sys

BIN = os.environ.get("KEEL_BIN")
FIX = os.path.join(os.environ.get("KEEL_FIXTURES", ""), "nemotron_h_tiny")


def bench(*args):
    return subprocess.run([BIN, "bench", "decode", FIX, *args], capture_output=True, text=True, timeout=120)


CASES = [0]


def expect(args, needle):
    CASES[0] += 1
    r = bench(*args)
    assert r.returncode != 0, (args, r.stdout)
    assert needle in r.stderr, (args, r.stderr)


def main():
    if not BIN:
        print("skip: KEEL_BIN is not set")
        return 77
    expect(["--context", "abc"], "--context 'abc': expected 1..16777216")
    expect(["--context", "0"], "--context '0': expected 1..16777216")
    expect(["--graphs", "maybe"], "--graphs 'maybe': expected on or off")
    expect(["--graphs"], "--graphs '': expected on or off")
    cuda_only = ("--context, --graphs, --pdl, --pdl-engine, --prefetch, --split-target, --split-long, --split-round, "
                 "--side, --fused-router, --fused-mamba, --route-window, --fused-norm and --packed are CUDA engine "
                 "options")
    expect(["--context", "100", "--backend", "cpu"], cuda_only)
    expect(["--graphs", "off", "--backend", "cpu"], cuda_only)
    expect(["--pdl", "off", "--backend", "cpu"], cuda_only)
    expect(["--split-target", "8", "--backend", "cpu"], cuda_only)
    expect(["--split-long", "off", "--backend", "cpu"], cuda_only)
    expect(["--split-long", "half"], "--split-long 'half': expected on or off")
    expect(["--prefetch", "4", "--backend", "cpu"], cuda_only)
    expect(["--pdl", "sometimes"], "--pdl 'sometimes': expected on or off")
    expect(["--pdl-engine", "off", "--backend", "cpu"], cuda_only)
    expect(["--pdl-engine", "half"], "--pdl-engine 'half': expected on or off")
    expect(["--split-target", "0"], "--split-target '0': expected 1..64")
    expect(["--split-target", "65"], "--split-target '65': expected 1..64")
    expect(["--prefetch", "-1"], "--prefetch '-1': expected 0..64 stages")
    expect(["--side", "off", "--backend", "cpu"], cuda_only)
    expect(["--fused-router", "on", "--backend", "cpu"], cuda_only)
    expect(["--fused-mamba", "on", "--backend", "cpu"], cuda_only)
    expect(["--side", "sometimes"], "--side 'sometimes': expected on, off or low")
    expect(["--fused-router", "yes"], "--fused-router 'yes': expected on or off")
    expect(["--fused-mamba"], "--fused-mamba '': expected on or off")
    expect(["--route-window", "on", "--backend", "cpu"], cuda_only)
    expect(["--route-window", "both"], "--route-window 'both': expected on or off")
    expect(["--split-round", "down", "--backend", "cpu"], cuda_only)
    expect(["--split-round", "sideways"], "--split-round 'sideways': expected up or down")
    expect(["--fused-norm", "off", "--backend", "cpu"], cuda_only)
    expect(["--fused-norm", "tiles"], "--fused-norm 'tiles': expected on or off")
    expect(["--packed", "off", "--backend", "cpu"], cuda_only)
    expect(["--packed", "every"], "--packed 'every': expected on, off or all")
    expect(["--packed", "all", "--backend", "cpu"], cuda_only)
    r = bench("--context", "5", "--prompt-tokens", "10", "--backend", "cuda")
    assert r.returncode != 0, r.stdout
    assert ("--context must be at least --prompt-tokens" in r.stderr or "built without CUDA" in r.stderr), r.stderr
    print(f"bench decode option refusals: {CASES[0] + 1} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
