# Sourced by the device scripts (levers.sh, split.sh, closing2.sh): logs under $OUT, the carried .devdeps and
# .devfix, and two helpers. Set NAME before sourcing; OUT defaults to /tmp/keel-$NAME, the build to build-$NAME.
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
