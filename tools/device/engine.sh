#!/usr/bin/env bash
# On the GPU machine, from the repository root: build keel for sm_90, run the CUDA engine's tests (fixture against
# the reference and the CPU engine, windows bit-identical, errors, CLI, the Nano-width synthetic agreement),
# compute-sanitizer memcheck over `keel logits --backend cuda` on the fixture, and `keel bench decode` on the demo
# checkpoint and the Nano-width one (NANO=1: also the Nano-shaped 4-bit checkpoint), and the engine kernels' contract
# table (gates 1-4, planted controls). Logs go to $OUT.
NAME=engine BUILD_DIR=${BUILD_DIR:-build-h13dev}
export TAILN=${TAILN:-14}
. "$(dirname "$0")/lib.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv >"$OUT/nvidia-smi.txt" 2>&1
build engine_cuda_test_cuda_engine engine_cuda_test_cuda_synth engine_cuda_test_cuda_engine_contract
step engine 120 $B/tests/engine_cuda_test_cuda_engine
if [[ ${QUICK:-0} == 1 ]]; then # the engine, its contract table and the synthetic agreement only
  TAILN=20 step contract 150 $B/tests/engine_cuda_test_cuda_engine_contract
  TAILN=6 step synth 150 $B/tests/engine_cuda_test_cuda_synth
  exit 0
fi
step cli 120 python3 tests/engine/cuda/test_cuda_cli.py
TAILN=20 step contract 150 $B/tests/engine_cuda_test_cuda_engine_contract
TAILN=6 step synth 150 $B/tests/engine_cuda_test_cuda_synth
TOKS=$(python3 -c "print(','.join(str((i*37+5)%512) for i in range(24)))")
TAILN=4 step memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 99 "$KEEL_BIN" logits \
  .devfix/nemotron_h_tiny --tokens "$TOKS" --out "$KEEL_TMP/mc.safetensors" --mtp --backend cuda
[[ -f $KEEL_TMP/demo/model.safetensors ]] || TAILN=1 step bench 60 "$KEEL_BIN" synth configs/demo.json "$KEEL_TMP/demo" --bits 4
TAILN=16 step bench 60 "$KEEL_BIN" bench decode "$KEEL_TMP/demo" --prompt-tokens 512 --tokens 128 --backend cuda
if [[ -f $KEEL_TMP/nano_widths_small/model.safetensors ]]; then
  TAILN=16 step bench 90 "$KEEL_BIN" bench decode "$KEEL_TMP/nano_widths_small" --prompt-tokens 512 --tokens 64 --backend cuda
fi
if [[ ${NANO:-0} == 1 ]]; then
  [[ -f $KEEL_TMP/nano/model.safetensors ]] || TAILN=1 step nano 200 "$KEEL_BIN" synth configs/nano-30b-a3b.json "$KEEL_TMP/nano" --bits 4
  TAILN=16 step nano 120 "$KEEL_BIN" bench decode "$KEEL_TMP/nano" --prompt-tokens 256 --tokens 64 --backend cuda
fi
