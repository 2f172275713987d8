#!/usr/bin/env bash
# On the GPU machine: the closing check of this change in one call. Builds keel and the CUDA tests (sm_90); the whole
# CUDA contract with its SUMMARY line; the stream-tile, engine and synthetic-agreement tests; `keel bench decode` on
# the Nano-30B-A3B shape at 1k (defaults, and with programmatic dependent launch off) and 32k; `keel bench stream
# --quick`; ncu's headline metrics of one 4-bit lm_head m=1 launch. Logs go to $OUT (at most 8 files come back).
NAME=c2
. "$(dirname "$0")/lib.sh"
build kernels_cuda_test_stream_cuda engine_cuda_test_cuda_engine engine_cuda_test_cuda_synth
t=$(date +%s)
timeout 300 $K contract --backend cuda >"$OUT/contract.log" 2>&1
echo "contract rc=$? in $(( $(date +%s) - t )) s"; grep -E "^(FAIL|MISSED|LIMIT)" "$OUT/contract.log" | head -10
timeout 200 $B/tests/kernels_cuda_test_stream_cuda >/tmp/ts.log 2>&1; echo "test_stream rc=$? $(grep -c '^\[       OK' /tmp/ts.log) ok $(grep -E 'FAILED' /tmp/ts.log | head -3)"
timeout 150 $B/tests/engine_cuda_test_cuda_engine >"$OUT/test_engine.log" 2>&1; echo "test_engine rc=$? $(grep -c '^\[       OK' "$OUT/test_engine.log") ok $(grep -E 'FAILED' "$OUT/test_engine.log" | head -3)"
timeout 150 $B/tests/engine_cuda_test_cuda_synth >/tmp/tsy.log 2>&1; echo "test_synth rc=$?"; grep -E "agreement|OK|FAIL" /tmp/tsy.log | head -4
timeout 120 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
timeout 60 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda >"$OUT/dec_1k.log" 2>&1; echo "dec_1k rc=$?"
timeout 60 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda --pdl off >/tmp/d.log 2>&1; echo "dec_1k pdl off rc=$?: $(grep '^decode:' /tmp/d.log)"
timeout 60 $K bench decode /tmp/nano --prompt-tokens 1000 --context 32768 --tokens 128 --backend cuda >"$OUT/dec_32k.log" 2>&1; echo "dec_32k rc=$?: $(grep '^decode:' "$OUT/dec_32k.log")"
timeout 120 $K bench stream --quick >"$OUT/stream.log" 2>&1; echo "bench stream rc=$?"
timeout 120 ncu --clock-control none --cache-control none --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis --kernel-name regex:stream_tile --launch-skip 215 --launch-count 1 $K bench stream --quick >"$OUT/ncu_tile.log" 2>&1; echo "ncu tile rc=$?"
grep -E "^SUMMARY" "$OUT/contract.log"
grep -E "^(decode|bandwidth|prompt)" "$OUT/dec_1k.log"; sed -n '/family/,$p' "$OUT/dec_1k.log"
grep -E "^(read bandwidth|lm_head|square16k +4 +64|q_proj +4|experts|  separate|k-split)" "$OUT/stream.log"
grep -E "Duration|DRAM Throughput|Issue Slots Busy|No Eligible|Achieved Occupancy|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit" "$OUT/ncu_tile.log" | head -12
