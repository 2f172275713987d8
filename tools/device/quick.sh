#!/usr/bin/env bash
# On the GPU machine, with build-l (keel and the CUDA tests, sm_90) built here and carried: the stream-tile, engine
# and agreement tests, `keel bench stream` on the decode shapes at 4 bits, and `keel bench decode` at 1k (defaults,
# then each ARGS line of $DECODE_ARGS, separated by ';').
NAME=q BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
TAILN=3 step test_stream 200 $B/tests/kernels_cuda_test_stream_cuda
grep -E "FAILED|Assert|mismatch" "$OUT/test_stream.log" | head -5
TAILN=3 step test_engine 200 $B/tests/engine_cuda_test_cuda_engine
TAILN=6 step test_synth 200 $B/tests/engine_cuda_test_cuda_synth
TAILN=40 step bench 200 $K bench stream --quick --shapes lm_head,in_proj,q_proj,out_proj,k_proj,shared_up,experts --bits ${BITS:-4} ${BENCH_ARGS:-}
if [[ -n ${BENCH2_ARGS:-} ]]; then TAILN=24 step bench2 200 $K bench stream --quick --shapes in_proj,q_proj,out_proj,k_proj,shared_up --bits ${BITS:-4} $BENCH2_ARGS; fi
timeout 150 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
TAILN=30 step dec 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda
IFS=';' read -ra extra <<<"${DECODE_ARGS:-}"
for a in "${extra[@]}"; do
  timeout 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda $a >/tmp/d.log 2>&1
  echo "decode $a: rc=$? $(grep '^decode:' /tmp/d.log)"
done
if [[ ${NCU_STEP:-0} == 1 ]]; then # GPU time per kernel of one launch-by-launch decode step (ncu, no cache flush)
  ncu_step; head -20 "$OUT/ncu_step.txt"
  python3 tools/device/ncu_step.py /tmp/ncu_step.log --launches stream_tile >>"$OUT/ncu_step.txt" 2>&1
fi
