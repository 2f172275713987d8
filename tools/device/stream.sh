#!/usr/bin/env bash
# On the GPU machine: build keel for sm_90, the register/spill report, the CUDA stream-tile tests, `keel bench
# stream` (BENCH_ARGS; BENCH=0 skips), the contract's CUDA registrations (CONTRACT=1; CONTRACT_FILTER, default
# '^cuda/') and compute-sanitizer memcheck on the tests (SANITIZE=1, SANITIZE_FILTER); logs go under $OUT.
# Needs the carried .devdeps (cJSON, PCRE2, cmocka) and .devfix.
set -uo pipefail
OUT=${OUT:-/tmp/keel-stream}
B=${BUILD_DIR:-build-dev-stream}
mkdir -p "$OUT"
if [[ -f .devdeps/env.sh ]]; then . .devdeps/env.sh; else dpkg -i .devdeps/debs/*.deb >"$OUT/deps.log" 2>&1 || { echo "deps install failed"; tail "$OUT/deps.log"; }; fi
export KEEL_FIXTURES=${KEEL_FIXTURES:-$PWD/.devfix}
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
t0=$(date +%s)
if ! { cmake -S . -B "$B" -DKEEL_CUDA=ON -DKEEL_CUDA_ARCHS=90 -DCMAKE_BUILD_TYPE=Release &&
       cmake --build "$B" -j "$(nproc)" --target keel kernels_cuda_test_stream_cuda; } >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - t0 )) s"
nvcc -std=c++17 -O3 -arch=sm_90 -Isrc -Xptxas -v -c src/kernels/cuda/stream.cu -o /tmp/stream.o 2>"$OUT/ptxas.log"
echo "spill check (sm_90): $(grep -c 'stack frame' "$OUT/ptxas.log") functions, $(grep 'stack frame' "$OUT/ptxas.log" | grep -vc '^ *0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads') with a stack frame or spills; registers: $(grep -o 'Used [0-9]* registers' "$OUT/ptxas.log" | awk '{print $2}' | sort -n | uniq | tr '\n' ' ')"
t1=$(date +%s)
timeout ${TEST_TIMEOUT:-200} ./"$B"/tests/kernels_cuda_test_stream_cuda >"$OUT/test.log" 2>&1
echo "test rc=$? ($(grep -c '^\[       OK' "$OUT/test.log") ok, $(( $(date +%s) - t1 )) s)"; grep -E "FAILED|ERROR|error|reference|bound" "$OUT/test.log" | head -20; tail -3 "$OUT/test.log"
if [[ ${BENCH:-1} == 1 ]]; then
  timeout ${BENCH_TIMEOUT:-200} ./"$B"/keel bench stream ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  echo "bench rc=$?"; cat "$OUT/bench.log"
fi
if [[ ${CONTRACT:-0} == 1 ]]; then
  t2=$(date +%s)
  timeout ${CONTRACT_TIMEOUT:-200} ./"$B"/keel contract --backend cuda --filter "${CONTRACT_FILTER:-^cuda/}" --json "$OUT/contract.json" >"$OUT/contract.log" 2>&1
  echo "contract rc=$? ($(( $(date +%s) - t2 )) s)"; grep -v '^ok ' "$OUT/contract.log" | tail -25
fi
if [[ ${SANITIZE:-0} == 1 ]] && command -v compute-sanitizer >/dev/null; then
  t3=$(date +%s)
  KEEL_TEST_FILTER=${SANITIZE_FILTER:-} timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool memcheck ./"$B"/tests/kernels_cuda_test_stream_cuda >"$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$? ($(( $(date +%s) - t3 )) s): $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log")"; grep -m5 -A6 "Invalid" "$OUT/memcheck.log"
fi
