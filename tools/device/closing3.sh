#!/usr/bin/env bash
# On the GPU machine, with build-l (keel and the CUDA tests, sm_90) built here and carried: the closing check in one
# call. The whole CUDA contract with its SUMMARY line (gate 5's live check against contract/records); the stream-tile,
# engine and agreement tests; `keel bench decode` on the Nano-30B-A3B shape at 1k (defaults and --pdl off) and 32k;
# `keel bench stream --quick`; with NCU_STEP=1 a decode step's GPU time per kernel (ncu, no cache flush). At most 8
# files in $OUT.
NAME=c3 BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64 KEEL_SOURCE_DIR=$PWD
t=$(date +%s)
timeout 240 $K contract --backend cuda >"$OUT/contract.log" 2>&1
echo "contract rc=$? in $(( $(date +%s) - t )) s"; grep -E "^(FAIL|MISSED|LIMIT)" "$OUT/contract.log" | head -10; grep -E "^SUMMARY" "$OUT/contract.log"
for tb in kernels_cuda_test_stream_cuda engine_cuda_test_cuda_engine engine_cuda_test_cuda_synth; do
  timeout 200 $B/tests/$tb >/tmp/$tb.log 2>&1; echo "$tb rc=$? $(grep -E '^\[  PASSED|^\[  FAILED' /tmp/$tb.log | head -2)"
done
cat /tmp/engine_cuda_test_cuda_synth.log >"$OUT/tests.log"; grep -E "agreement" "$OUT/tests.log" | cut -c1-200
timeout 150 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
timeout 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda >"$OUT/dec_1k.log" 2>&1; echo "dec_1k rc=$?"
grep -E "^(decode|bandwidth|prompt)" "$OUT/dec_1k.log"; sed -n '/family/,$p' "$OUT/dec_1k.log"
timeout 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda --pdl off >/tmp/d.log 2>&1; echo "dec_1k pdl off rc=$?: $(grep '^decode:' /tmp/d.log)"
timeout 90 $K bench decode /tmp/nano --prompt-tokens 1000 --context 32768 --tokens 128 --backend cuda >"$OUT/dec_32k.log" 2>&1; echo "dec_32k rc=$?: $(grep -E '^(decode|bandwidth)' "$OUT/dec_32k.log")"
timeout 150 $K bench stream --quick >"$OUT/stream.log" 2>&1; echo "bench stream rc=$?"
grep -E "^(read bandwidth|lm_head|square16k +4 |q_proj +4|experts|  separate|rows|k-split)" "$OUT/stream.log"
if [[ ${NCU_STEP:-0} == 1 ]]; then
  timeout 150 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --launch-count 1000 $K bench decode /tmp/nano --prompt-tokens 8 --tokens 2 --backend cuda --graphs off >/tmp/ncu_step.log 2>&1
  python3 tools/device/ncu_step.py /tmp/ncu_step.log --launches stream_tile >"$OUT/ncu_step.txt" 2>&1; head -18 "$OUT/ncu_step.txt"
fi
