#!/usr/bin/env bash
# On the GPU machine: `keel contract --backend cuda` over every registration (stream tiles, engine, attention, scan)
# with its SUMMARY line, and the GPU time of one launch-by-launch decode step per kernel (ncu) on the
# Nano-30B-A3B-shaped checkpoint. Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/keel-closing}
mkdir -p "$OUT"
. .devdeps/env.sh
B=build-closing
t=$(date +%s)
cmake -S . -B $B -DKEEL_CUDA=ON -DKEEL_CUDA_ARCHS=90 -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build $B -j "$(nproc)" --target keel >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t )) s"
t=$(date +%s)
timeout 240 $B/keel contract --backend cuda >"$OUT/contract.log" 2>&1
echo "contract: rc=$? in $(( $(date +%s) - t )) s"; grep -E "^(FAIL|MISSED|LIMIT|SUMMARY)" "$OUT/contract.log" | head -20
timeout 60 $B/keel synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1
timeout 90 ncu --metrics gpu__time_duration.sum --csv --launch-count 1000 $B/keel bench decode /tmp/nano --prompt-tokens 8 --tokens 2 --backend cuda --graphs off >/tmp/ncu.log 2>&1
python3 tools/device/ncu_step.py /tmp/ncu.log >"$OUT/ncu_step.txt" 2>&1; cat "$OUT/ncu_step.txt" | head -40
