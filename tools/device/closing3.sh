#!/usr/bin/env bash
# On the GPU machine, with build-l (keel and the CUDA tests, sm_90) built here and carried: the closing check in one
# call. The whole CUDA contract with its SUMMARY line (gate 5's live check against contract/records); the stream-tile,
# engine and agreement tests; `keel bench decode` on the Nano-30B-A3B shape at 1k (defaults and --pdl off) and 32k;
# `keel bench stream --quick`; with NCU_STEP=1 a decode step's GPU time per kernel (ncu, no cache flush). At most 8
# files in $OUT.
NAME=c3 BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64 KEEL_SOURCE_DIR=$PWD
checks
timeout 150 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
timeout 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda >"$OUT/dec_1k.log" 2>&1; echo "dec_1k rc=$?"
grep -E "^(decode|bandwidth|prompt)" "$OUT/dec_1k.log"; sed -n '/family/,$p' "$OUT/dec_1k.log"
timeout 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda --pdl off >/tmp/d.log 2>&1; echo "dec_1k pdl off rc=$?: $(grep '^decode:' /tmp/d.log)"
timeout 90 $K bench decode /tmp/nano --prompt-tokens 1000 --context 32768 --tokens 128 --backend cuda >"$OUT/dec_32k.log" 2>&1; echo "dec_32k rc=$?: $(grep -E '^(decode|bandwidth)' "$OUT/dec_32k.log")"
timeout 150 $K bench stream --quick >"$OUT/stream.log" 2>&1; echo "bench stream rc=$?"
grep -E "^(read bandwidth|lm_head|square16k +4 |q_proj +4|experts|  separate|rows|k-split)" "$OUT/stream.log"
if [[ ${NCU_STEP:-0} == 1 ]]; then ncu_step --launches stream_tile; head -18 "$OUT/ncu_step.txt"; fi
