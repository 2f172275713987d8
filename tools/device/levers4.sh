#!/usr/bin/env bash
# On the GPU machine, with build-l (keel and the CUDA tests, sm_90) built here and carried: the whole CUDA contract
# (SUMMARY line, failures), the stream-tile, engine and agreement tests, then `keel bench decode` at 1k with the
# defaults and with each ARGS line of $DECODE_ARGS (';'-separated, run in that order: interleave on/off for a lever);
# with NCU_STEP=1 a decode step's GPU time per kernel (ncu, no cache flush; NCU_CTX=C: the step at context C);
# each ARGS line of $BENCH_ARGS (';'-separated) as `keel bench stream ARGS`, its table rows printed.
# CHECKS=0 leaves out the contract and the tests.
NAME=l4 BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64 KEEL_SOURCE_DIR=$PWD
if [[ ${CHECKS:-1} == 1 ]]; then checks; fi
timeout 150 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
timeout 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda >"$OUT/dec_1k.log" 2>&1; echo "dec_1k rc=$?"
grep -E "^(decode|bandwidth|prompt|stream)" "$OUT/dec_1k.log"; sed -n '/family/,$p' "$OUT/dec_1k.log"
IFS=';' read -ra extra <<<"${DECODE_ARGS:-}"
for a in "${extra[@]}"; do
  decode_line "$a" $K $a
done
IFS=';' read -ra bargs <<<"${BENCH_ARGS:-}"
for a in "${bargs[@]}"; do
  timeout 150 $K bench stream $a >/tmp/b.log 2>&1
  echo "bench stream $a: rc=$?"; grep -E "^(read bandwidth|[a-z_0-9]+ +[2-8] +[0-9]+ +[18] |experts|  separate)" /tmp/b.log
done
if [[ ${NCU_STEP:-0} == 1 ]]; then ncu_step; head -24 "$OUT/ncu_step.txt"; fi
