#!/usr/bin/env bash
# On the GPU machine, with build-l (keel and the CUDA tests, sm_90) built here and carried: the whole CUDA contract
# (SUMMARY line, failures), the stream-tile, engine and agreement tests, then `keel bench decode` at 1k with the
# defaults and with each ARGS line of $DECODE_ARGS (';'-separated, run in that order: interleave on/off for a lever);
# with NCU_STEP=1 a decode step's GPU time per kernel (ncu, no cache flush; NCU_CTX=C: the step at context C).
# CHECKS=0 leaves out the contract and the tests.
NAME=l4 BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64 KEEL_SOURCE_DIR=$PWD
if [[ ${CHECKS:-1} == 1 ]]; then
t=$(date +%s)
timeout 240 $K contract --backend cuda ${CONTRACT_ARGS:-} >"$OUT/contract.log" 2>&1
echo "contract rc=$? in $(( $(date +%s) - t )) s"; grep -E "^(FAIL|MISSED|LIMIT)" "$OUT/contract.log" | head -10; grep -E "^SUMMARY" "$OUT/contract.log"
for tb in kernels_cuda_test_stream_cuda engine_cuda_test_cuda_engine engine_cuda_test_cuda_synth; do
  timeout 200 $B/tests/$tb >"$OUT/$tb.log" 2>&1; echo "$tb rc=$? $(grep -E '^\[  PASSED|^\[  FAILED' "$OUT/$tb.log" | head -2)"
  grep -E "FAILED|Assert|mismatch|differ" "$OUT/$tb.log" | head -5
done
grep -E "agreement" "$OUT/engine_cuda_test_cuda_synth.log" | cut -c1-200
fi
timeout 150 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
timeout 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda >"$OUT/dec_1k.log" 2>&1; echo "dec_1k rc=$?"
grep -E "^(decode|bandwidth|prompt|stream)" "$OUT/dec_1k.log"; sed -n '/family/,$p' "$OUT/dec_1k.log"
IFS=';' read -ra extra <<<"${DECODE_ARGS:-}"
for a in "${extra[@]}"; do
  timeout 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda $a >/tmp/d.log 2>&1
  echo "decode $a: rc=$? $(grep '^decode:' /tmp/d.log | sed 's/ at batch 1//') $(grep '^prompt:' /tmp/d.log | sed 's/.*: //')"
done
if [[ ${NCU_STEP:-0} == 1 ]]; then
  timeout 150 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --launch-count 1000 $K bench decode /tmp/nano --prompt-tokens 8 ${NCU_CTX:+--context $NCU_CTX} --tokens 2 --backend cuda --graphs off ${NCU_ARGS:-} >/tmp/ncu_step.log 2>&1
  python3 tools/device/ncu_step.py /tmp/ncu_step.log >"$OUT/ncu_step.txt" 2>&1; head -24 "$OUT/ncu_step.txt"
fi
