#!/usr/bin/env bash
# On the GPU machine: where a stream tile's time goes and where a decode step's time goes, without cache flushes
# or clock changes. Builds keel (sm_90), profiles three stream-tile launches of `keel bench stream --quick` with
# ncu's full section set (4-bit lm_head m=1 and m=8, q_proj m=1), then the Nano-30B-A3B shape: `keel bench decode`
# at 1k and the GPU time of one launch-by-launch decode step per kernel. Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/keel-profile}
mkdir -p "$OUT"
. .devdeps/env.sh
B=${BUILD_DIR:-build-profile}
t=$(date +%s)
{ cmake -S . -B $B -DKEEL_CUDA=ON -DKEEL_CUDA_ARCHS=90 -DCMAKE_BUILD_TYPE=Release >/dev/null &&
  cmake --build $B -j "$(nproc)" --target keel; } >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t )) s"
NCU="ncu --clock-control none --cache-control none --kernel-name-base demangled"
if [[ ${TILE:-1} == 1 ]]; then
  for skip in 3 56 427; do
    timeout 120 $NCU --set full --kernel-name 'regex:stream_tile<4' --launch-skip $skip --launch-count 1 \
      $B/keel bench stream --quick >"$OUT/ncu_tile_$skip.log" 2>&1
    echo "ncu tile skip $skip: rc=$?"
    grep -E "Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|Issue Slots Busy|Executed Ipc A|Achieved Occupancy|Registers Per|No Eligible|One or More|Warp Cycles Per Issued|Stall|L1/TEX Cache Throughput|Mem Busy|Max Bandwidth|Block Limit" "$OUT/ncu_tile_$skip.log" | head -40
  done
fi
if [[ ${DECODE:-1} == 1 ]]; then
  timeout 120 $B/keel synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >"$OUT/synth.log" 2>&1; echo "synth rc=$?"
  timeout 90 $B/keel bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda >"$OUT/bench_1k.log" 2>&1
  echo "bench_1k rc=$?"; tail -24 "$OUT/bench_1k.log"
  timeout 150 $NCU --metrics gpu__time_duration.sum --csv --launch-count 1000 $B/keel bench decode /tmp/nano --prompt-tokens 8 --tokens 2 --backend cuda --graphs off >"$OUT/ncu_step.log" 2>&1
  echo "ncu step rc=$?"
  python3 tools/device/ncu_step.py "$OUT/ncu_step.log" >"$OUT/ncu_step.txt" 2>&1; head -30 "$OUT/ncu_step.txt"
fi
