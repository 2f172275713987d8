# Sourced by the device scripts (levers.sh, split.sh, closing2.sh, closing3.sh, quick.sh, levers4.sh): logs under
# $OUT, the carried .devdeps and .devfix, and helpers (build, step, checks, decode_line, ncu_step). Set NAME
# before sourcing; OUT defaults to /tmp/keel-$NAME, the build to build-$NAME.
set -uo pipefail
OUT=${OUT:-/tmp/keel-$NAME}
B=${BUILD_DIR:-build-$NAME}
K=$B/keel
mkdir -p "$OUT"
. .devdeps/env.sh
export KEEL_FIXTURES=$PWD/.devfix KEEL_SRC=$PWD KEEL_TMP=/tmp/keel-$NAME-tmp KEEL_BIN=$PWD/$K
mkdir -p "$KEEL_TMP"
# build TARGET...: configures sm_90 Release and builds keel and the named tests; the log's tail on failure
build() {
  local t=$(date +%s)
  { cmake -S . -B "$B" -DKEEL_CUDA=ON -DKEEL_CUDA_ARCHS=90 -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build "$B" -j "$(nproc)" --target keel "$@"; } >/tmp/keel-$NAME-build.log 2>&1 || { tail -30 /tmp/keel-$NAME-build.log; exit 1; }
  echo "build: $(( $(date +%s) - t )) s"
}
# step NAME LIMIT_S COMMAND...: runs with a time limit, logs to $OUT/NAME.log, prints rc, time and TAILN lines
step() {
  local name=$1 lim=$2; shift 2
  local t=$(date +%s)
  echo "\$ $*" >>"$OUT/$name.log"
  timeout "$lim" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t )) s"
  tail -n "${TAILN:-8}" "$OUT/$name.log"
}
# checks: the whole CUDA contract ($OUT/contract.log: its SUMMARY and failures printed), then the stream-tile, engine
# and agreement tests ($OUT/<test>.log: rc, PASSED/FAILED, assertion lines, the agreement lines)
checks() {
  local t=$(date +%s)
  timeout 240 $K contract --backend cuda ${CONTRACT_ARGS:-} >"$OUT/contract.log" 2>&1
  echo "contract rc=$? in $(( $(date +%s) - t )) s"; grep -E "^(FAIL|MISSED|LIMIT)" "$OUT/contract.log" | head -10; grep -E "^SUMMARY" "$OUT/contract.log"
  local tb
  for tb in kernels_cuda_test_stream_cuda engine_cuda_test_cuda_engine engine_cuda_test_cuda_synth; do
    timeout 200 $B/tests/$tb >"$OUT/$tb.log" 2>&1; echo "$tb rc=$? $(grep -E '^\[  PASSED|^\[  FAILED' "$OUT/$tb.log" | head -2)"
    grep -E "FAILED|Assert|mismatch|differ" "$OUT/$tb.log" | head -5
  done
  grep -E "agreement" "$OUT/engine_cuda_test_cuda_synth.log" | cut -c1-200
}
# decode_line LABEL BIN [ARGS...]: `BIN bench decode` of /tmp/nano at 1k with ARGS, as one line: LABEL, rc, the
# decode and prompt figures
decode_line() {
  local label=$1 bin=$2; shift 2
  timeout 90 "$bin" bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda "$@" >/tmp/d.log 2>&1
  echo "decode $label: rc=$? $(grep '^decode:' /tmp/d.log | sed 's/ at batch 1//') $(grep '^prompt:' /tmp/d.log | sed 's/.*: //')"
}
# ncu_step [ncu_step.py options]: one launch-by-launch decode step of /tmp/nano through ncu (no cache flush, no clock
# control; NCU_CTX=C: at context C; NCU_ARGS: more bench decode options), its GPU time per kernel to $OUT/ncu_step.txt
ncu_step() {
  timeout 150 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --launch-count 1000 \
    $K bench decode /tmp/nano --prompt-tokens 8 ${NCU_CTX:+--context $NCU_CTX} --tokens 2 --backend cuda --graphs off \
    ${NCU_ARGS:-} >/tmp/ncu_step.log 2>&1
  python3 tools/device/ncu_step.py /tmp/ncu_step.log "$@" >>"$OUT/ncu_step.txt" 2>&1
}
