#!/usr/bin/env bash
# On the GPU machine, from the repository root: the CUDA engine end to end in one call. Builds keel and the engine's
# tests for sm_90, runs the engine tests (fixture agreement, windows bit-identical, graphs on/off, errors), the engine
# tables of the contract, then `keel synth` of the Nano-30B-A3B shape and `keel bench decode` at 1k context (graphs on
# and off) and at 32k. a carried .headsnap folder (files of HEAD) is copied over the tree first (to leave out work in progress). Logs: $OUT.
if [[ -d .headsnap ]]; then cp -r .headsnap/. . && echo "restored from .headsnap: $(cd .headsnap && find . -type f | wc -l) files"; fi
NAME=lead BUILD_DIR=${BUILD_DIR:-build-lead-dev}
. "$(dirname "$0")/lib.sh"
TAILN=3 step build 240 bash -c "cmake -S . -B $B -DKEEL_CUDA=ON -DKEEL_CUDA_ARCHS=90 -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build $B -j $(nproc) --target keel engine_cuda_test_cuda_engine engine_cuda_test_cuda_engine_contract ${EXTRA_TARGETS:-}"
TAILN=40 step engine_test 150 $B/tests/engine_cuda_test_cuda_engine
TAILN=12 step engine_contract 150 $B/keel contract --backend cuda --filter '^cuda/engine/'
[[ ${BENCH:-1} == 1 ]] || exit 0
TAILN=2 step synth_nano 120 $B/keel synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64
TAILN=22 step bench_1k 120 $B/keel bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda
TAILN=5 step bench_1k_nographs 90 $B/keel bench decode /tmp/nano --prompt-tokens 1000 --tokens 64 --backend cuda --graphs off
TAILN=8 step bench_32k 120 $B/keel bench decode /tmp/nano --prompt-tokens 1000 --context 32768 --tokens 128 --backend cuda
