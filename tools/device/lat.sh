#!/usr/bin/env bash
# On the GPU machine: build-l/keel against build-l/keel_base (a build of the tree before the change, carried beside it).
# `keel bench decode` at 1k of both, interleaved ROUNDS times (default 3), the new one with each of EXTRA's option sets
# (';'-separated, e.g. EXTRA='--fused-router on;--fused-mamba on'), both at 32k, the new one's family table;
# CHECKS=1: lib.sh's checks ($CONTRACT_ARGS); STREAM=1: `keel bench stream $STREAM_ARGS` (default --quick) of base
# and new (STREAM_RUNS) ($OUT/stream_*.log; the large shapes' rows printed side by side); unless NCU=0: ncu's time per kernel
# of one launch-by-launch decode step of each ($OUT/ncu_step.txt).
NAME=lat BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
timeout 150 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
for r in $(seq ${ROUNDS:-3}); do
  decode_line base build-l/keel_base ${BASE_ARGS:-}
  decode_line new build-l/keel ${NEW_ARGS:-}
done
IFS=';' read -ra extras <<<"${EXTRA:-}"
for x in "${extras[@]}"; do decode_line "new $x" build-l/keel $x ${NEW_ARGS:-}; done
decode_line base-32k build-l/keel_base --context 32768 ${BASE_ARGS:-}
decode_line new-32k build-l/keel --context 32768 ${NEW_ARGS:-}
timeout 150 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda ${NEW_ARGS:-} > $OUT/decode.log 2>&1
grep -E "^(floor|bandwidth|  [a-z])" $OUT/decode.log | cut -c1-200 | head -12
[[ ${CHECKS:-0} == 1 ]] && checks
if [[ ${STREAM:-0} == 1 ]]; then
  for lb in ${STREAM_RUNS:-base new}; do
    bin=build-l/keel; [[ $lb == new ]] || bin=build-l/keel_base
    timeout 200 $bin bench stream ${STREAM_ARGS:---quick} >"$OUT/stream_$lb.log" 2>&1; echo "bench stream $lb rc=$?"
  done
  grep -E "^read bandwidth" "$OUT"/stream_*.log
  paste -d'|' <(grep -E "^(lm_head|square16k|q_proj|experts)" "$OUT/stream_base.log") \
    <(grep -E "^(lm_head|square16k|q_proj|experts)" "$OUT/stream_new.log" | cut -c15-60) | head -60
fi
if [[ ${NCU:-1} == 1 ]]; then
  echo "== base" >>"$OUT/ncu_step.txt"; K=build-l/keel_base ncu_step
  echo "== new" >>"$OUT/ncu_step.txt"; ncu_step
  cat "$OUT/ncu_step.txt"
fi
