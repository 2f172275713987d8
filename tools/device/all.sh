#!/usr/bin/env bash
# On the GPU machine, from the repository root: the whole device check in two phases that each fit one call.
#   PHASE=A: build for sm_90, run every test (CPU and GPU), then `keel contract --backend cuda` (stream tiles and
#            engine kernels, gates 1-4, planted controls, live gate-5 check) with its SUMMARY line.
#   PHASE=B: the contract again, compute-sanitizer memcheck over a contract subset and the CUDA engine on the fixture, then
#            `keel bench decode` on the demo and on the Nano-30B-A3B-shaped 4-bit checkpoint that keel synth writes.
# Needs the carried .devdeps (cJSON, PCRE2, cmocka) and .devfix (the fixtures). Logs go to $OUT.
NAME=all BUILD_DIR=${BUILD_DIR:-build-dev}
. "$(dirname "$0")/lib.sh"
if [[ ${PHASE:-A} == A ]]; then
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$OUT/nvidia-smi.txt" 2>&1
  TAILN=3 step build 300 bash -c "cmake -S . -B $B -DKEEL_CUDA=ON -DKEEL_CUDA_ARCHS=90 -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build $B -j $(nproc)"
  TAILN=30 step ctest 300 bash -c "cd $B && ctest -j 8 --output-on-failure --timeout 280"
  TAILN=12 step contract 150 $B/keel contract --backend cuda --json "$OUT/contract_cuda.json"
  grep -h '^SUMMARY' "$OUT/contract.log"
else
  TAILN=3 step build 300 bash -c "cmake -S . -B $B -DKEEL_CUDA=ON -DKEEL_CUDA_ARCHS=90 -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build $B -j $(nproc) --target keel"
  TAILN=6 step contract 150 $B/keel contract --backend cuda
  SUBSET=${SUBSET:-'^cuda/(mma/stream/q5g64/bf16/|mma/routed-(up|down)/q4g128/bf16/xbf16-ybf16/|elementwise/)'}
  TAILN=4 step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 99 $B/keel contract --backend cuda --filter "$SUBSET"
  TOKS=$(python3 -c "print(','.join(str((i*37+5)%512) for i in range(24)))")
  TAILN=4 step memcheck_engine 60 compute-sanitizer --tool memcheck --error-exitcode 99 $B/keel logits \
    .devfix/nemotron_h_tiny --tokens "$TOKS" --out /tmp/mc.safetensors --mtp --backend cuda
  TAILN=2 step synth_demo 60 $B/keel synth configs/demo.json /tmp/demo --bits 4
  TAILN=16 step bench_demo 60 $B/keel bench decode /tmp/demo --prompt-tokens 512 --tokens 128 --backend cuda
  TAILN=2 step synth_nano 200 $B/keel synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64
  TAILN=20 step bench_nano 120 $B/keel bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda
  TAILN=6 step bench_nano_nographs 120 $B/keel bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda --graphs off
  TAILN=20 step bench_nano_32k 150 $B/keel bench decode /tmp/nano --prompt-tokens 1000 --context 32768 --tokens 128 --backend cuda
fi
