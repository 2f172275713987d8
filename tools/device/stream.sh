#!/usr/bin/env bash
# On the GPU machine: build keel for sm_90, run the CUDA stream-tile tests, the register/spill report and
# `keel bench stream`; logs go under $OUT. Needs the carried .devdeps (cJSON, PCRE2, cmocka) and .devfix.
set -uo pipefail
OUT=${OUT:-/tmp/keel-stream}
mkdir -p "$OUT"
. .devdeps/env.sh
export KEEL_FIXTURES=${KEEL_FIXTURES:-$PWD/.devfix}
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
t0=$(date +%s)
if ! { cmake -S . -B build-dev -DKEEL_CUDA=ON -DKEEL_CUDA_ARCHS=90 -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release &&
       cmake --build build-dev -j "$(nproc)" --target keel kernels_cuda_test_stream_cuda; } >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - t0 )) s"
nvcc -std=c++17 -O3 -arch=sm_90 -Isrc -Xptxas -v -c src/kernels/cuda/stream.cu -o /tmp/stream.o 2>"$OUT/ptxas.log"
echo "spill check (sm_90): $(grep -c 'stack frame' "$OUT/ptxas.log") functions, $(grep 'stack frame' "$OUT/ptxas.log" | grep -vc '^ *0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads') with a stack frame or spills"
timeout 240 ./build-dev/tests/kernels_cuda_test_stream_cuda >"$OUT/test.log" 2>&1
echo "test rc=$? ($(grep -c OK "$OUT/test.log") ok)"; tail -25 "$OUT/test.log"
timeout 300 ./build-dev/keel bench stream ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
if [[ ${SANITIZE:-0} == 1 ]] && command -v compute-sanitizer >/dev/null; then
  timeout 150 compute-sanitizer --tool memcheck ./build-dev/tests/kernels_cuda_test_stream_cuda >"$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log")"
fi
