#!/usr/bin/env bash
# On the GPU machine: the closing check of the CUDA engine in one call. Builds keel and the engine tests (sm_90),
# runs the engine test, the engine tables of the contract, the Nano-width synthetic agreement, `keel bench decode`
# on the Nano-30B-A3B shape (1k context bf16 and f32 activations, graphs on and off; 32k context), and the GPU time
# of one decode step per kernel (ncu). Logs go to $OUT.
NAME=final BUILD_DIR=${BUILD_DIR:-build-final}
. "$(dirname "$0")/lib.sh"
TAILN=3 step build 200 bash -c "cmake -S . -B $B -DKEEL_CUDA=ON -DKEEL_CUDA_ARCHS=90 -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build $B -j $(nproc) --target keel engine_cuda_test_cuda_engine engine_cuda_test_cuda_synth"
TAILN=30 step engine_test 90 $B/tests/engine_cuda_test_cuda_engine
TAILN=6 step engine_contract 120 $B/keel contract --backend cuda --filter '^cuda/engine/'
TAILN=2 step synth_nano 90 $B/keel synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64
TAILN=24 step bench_1k 60 $B/keel bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda
TAILN=4 step bench_1k_f32 60 $B/keel bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda --activations f32
TAILN=4 step bench_1k_nographs 60 $B/keel bench decode /tmp/nano --prompt-tokens 1000 --tokens 64 --backend cuda --graphs off
TAILN=4 step bench_32k 60 $B/keel bench decode /tmp/nano --prompt-tokens 1000 --context 32768 --tokens 128 --backend cuda
TAILN=4 step bench_32k_f32 60 $B/keel bench decode /tmp/nano --prompt-tokens 1000 --context 32768 --tokens 128 --backend cuda --activations f32
step ncu 100 ncu --metrics gpu__time_duration.sum --csv --launch-count 1000 $B/keel bench decode /tmp/nano --prompt-tokens 8 --tokens 2 --backend cuda --graphs off
python3 tools/device/ncu_step.py "$OUT/ncu.log" > "$OUT/ncu_step.txt" 2>&1; head -30 "$OUT/ncu_step.txt"
TAILN=6 step synth_agree 120 $B/tests/engine_cuda_test_cuda_synth
