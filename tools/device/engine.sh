#!/usr/bin/env bash
# On the GPU machine, from the repository root: build keel for sm_90, run the CUDA engine's tests (fixture against
# the reference and the CPU engine, windows bit-identical, errors, CLI, the Nano-width synthetic agreement),
# compute-sanitizer memcheck over `keel logits --backend cuda` on the fixture, and `keel bench decode` on the demo
# checkpoint and the Nano-width one (NANO=1: also the Nano-shaped 4-bit checkpoint), and the engine kernels' contract
# table (gates 1-4, planted controls). Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/keel-engine}
mkdir -p "$OUT"
. .devdeps/env.sh
export KEEL_FIXTURES=$PWD/.devfix KEEL_SRC=$PWD KEEL_TMP=/tmp/keel-h13
mkdir -p "$KEEL_TMP"
B=build-h13dev
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv >"$OUT/nvidia-smi.txt" 2>&1
t0=$(date +%s)
if ! { cmake -S . -B $B -DKEEL_CUDA=ON -DKEEL_CUDA_ARCHS=90 -DCMAKE_BUILD_TYPE=Release &&
       cmake --build $B -j "$(nproc)" --target keel engine_cuda_test_cuda_engine engine_cuda_test_cuda_synth \
         engine_cuda_test_cuda_engine_contract; } \
     >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - t0 )) s"
export KEEL_BIN=$PWD/$B/keel
step() { # name limit_s command...: runs, appends to $OUT/name.log, prints rc, time and the tail
  local name=$1 lim=$2; shift 2
  local t=$(date +%s)
  echo "\$ $*" >>"$OUT/$name.log"
  timeout "$lim" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t )) s"
  tail -n "${TAILN:-14}" "$OUT/$name.log"
}
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
