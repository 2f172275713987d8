#!/usr/bin/env bash
# On the GPU machine, from the repository root: build keel for sm_90 and run `keel contract --backend cuda`
# (every CUDA registration through gates 1-4 and every planted control), then compute-sanitizer memcheck over a
# small subset of the contract (the 5-bit g64 tiles, a routed pair, relu2). Logs go to $OUT. Device budget: build
# ~2 min, contract < 2 min, memcheck <= 200 s.
set -uo pipefail
OUT=${OUT:-/tmp/keel-contract}
mkdir -p "$OUT"
[[ -f .devdeps/env.sh ]] && . .devdeps/env.sh
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
t0=$(date +%s)
if ! { cmake -S . -B build-dev -DKEEL_CUDA=ON -DKEEL_CUDA_ARCHS=90 -DCMAKE_BUILD_TYPE=Release &&
       cmake --build build-dev -j "$(nproc)" --target keel; } >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 300 build-dev/keel contract --backend cuda --json "$OUT/contract_cuda.json" 2>&1 | tee "$OUT/contract_cuda.log" | tail -60
rc=${PIPESTATUS[0]}
echo "keel contract --backend cuda: rc=$rc in $(( $(date +%s) - t0 )) s"
grep '^SUMMARY' "$OUT/contract_cuda.log"
# The extra mode of gate 2: memcheck over a subset (the whole contract would take far longer under the sanitizer).
SUBSET=${SUBSET:-'^cuda/(mma/stream/q5g64/bf16/|mma/routed-(up|down)/q4g128/bf16/xbf16-ybf16/|elementwise/)'}
if command -v compute-sanitizer >/dev/null; then
  t0=$(date +%s)
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 99 build-dev/keel contract --backend cuda \
    --filter "$SUBSET" >"$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$? in $(( $(date +%s) - t0 )) s: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
  grep '^SUMMARY' "$OUT/memcheck.log"
else
  echo "compute-sanitizer not found: memcheck mode not run"
fi
exit "$rc"
