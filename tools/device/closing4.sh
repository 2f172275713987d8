#!/usr/bin/env bash
# On the GPU machine, with build-l (keel and the CUDA tests, sm_90) built here and carried: closing3.sh (the whole
# contract, the tests, decode at 1k with and without PDL and at 32k, `keel bench stream --quick`, NCU_STEP=1 a decode
# step through ncu), then `keel bench decode` at 1k with each ARGS line of $DECODE_ARGS (';'-separated) interleaved
# ROUNDS times (default 2) with the defaults. Prints a summary; full logs in $OUT.
here=$(dirname "$0")
bash "$here/closing3.sh" >"${OUT:-/tmp}/c3.txt" 2>&1
grep -vE "^(square16k|lm_head) +[0-9]+ +[0-9]+ +8 " "${OUT:-/tmp}/c3.txt" | cut -c1-200
NAME=c4 BUILD_DIR=build-l
. "$here/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64
IFS=';' read -ra extra <<<"${DECODE_ARGS:-}"
for r in $(seq ${ROUNDS:-2}); do
  for a in "" "${extra[@]}"; do
    decode_line "[$a]" $K $a
  done
done
