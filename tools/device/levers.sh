#!/usr/bin/env bash
# On the GPU machine: the decode levers of issue #8 in one call. Builds keel and the CUDA tests (sm_90); runs the
# stream-tile and engine tests; `keel bench stream --quick` without and with the L2 row prefetch; ncu's full
# sections on one 4-bit lm_head m=1 launch; the Nano-30B-A3B shape's `keel bench decode` with the defaults and each lever changed alone,
# at 1k and 32k; the GPU time of one decode step per kernel (no cache flush); the CUDA contract (CONTRACT=1).
NAME=levers
. "$(dirname "$0")/lib.sh"
TAILN=5 build kernels_cuda_test_stream_cuda engine_cuda_test_cuda_engine engine_cuda_test_cuda_synth
TAILN=4 step test_stream 200 $B/tests/kernels_cuda_test_stream_cuda
TAILN=12 step test_engine 120 $B/tests/engine_cuda_test_cuda_engine
if [[ ${BENCH:-1} == 1 ]]; then
  TAILN=60 step bench_stream_pf0 120 $K bench stream --quick --prefetch 0
  TAILN=60 step bench_stream_pf4 120 $K bench stream --quick --prefetch 4
fi
if [[ ${NCU:-1} == 1 ]]; then
  TAILN=80 step ncu_tile 120 ncu --clock-control none --cache-control none --set full --kernel-name regex:stream_tile --launch-skip 215 --launch-count 1 $K bench stream --quick
fi
TAILN=2 step synth 120 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64
TAILN=22 step dec_1k 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda
TAILN=3 step dec_1k_nopdl 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda --pdl off
TAILN=3 step dec_1k_pf4 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda --prefetch 4
TAILN=3 step dec_1k_q2 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda --split-target 2
TAILN=3 step dec_32k 90 $K bench decode /tmp/nano --prompt-tokens 1000 --context 32768 --tokens 128 --backend cuda
step ncu_step 150 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --launch-count 1000 $K bench decode /tmp/nano --prompt-tokens 8 --tokens 2 --backend cuda --graphs off
python3 tools/device/ncu_step.py "$OUT/ncu_step.log" >"$OUT/ncu_step.txt" 2>&1; head -24 "$OUT/ncu_step.txt"
TAILN=6 step test_synth 150 $B/tests/engine_cuda_test_cuda_synth
if [[ ${CONTRACT:-0} == 1 ]]; then
  TAILN=12 step contract 300 $K contract --backend cuda --filter "${CONTRACT_FILTER:-^cuda/}"
fi
