#!/usr/bin/env bash
# On the GPU machine: builds carried here compared on the same device run, e.g. BINS='build-l/keel_base build-l/keel'
# (a build of the tree before the change beside the new one). For each keel binary of $BINS (space-separated paths;
# default build-l/keel), interleaved ROUNDS times (default 2): `keel bench decode` at 1k ($DARGS); then the last
# binary with each of $EXTRA's option sets (';'-separated, e.g. EXTRA='--fused-router on;--pdl-engine off'); with
# CTX32=1 each binary at 32k; with FAMILY=1 the last binary's family table; DECODE=0 leaves out the 1k decode lines
# (the synthetic model is written only where EXTRA, CTX32, FAMILY or NCU decodes it). Unless STREAM=0: per binary `keel
# bench stream $STREAM_ARGS` (default --quick), its table rows, the binaries interleaved STREAM_ROUNDS times (default
# 1), each table in $OUT/stream_<binary's path, / as _>_<round>.log. With CHECKS=1: lib.sh's checks of the last
# binary's build ($CONTRACT_ARGS). With NCU=1: ncu's time per kernel of one launch-by-launch decode step of each binary
# ($OUT/ncu_step.txt). With SASS=1 each binary's SASS instruction count per stream_tile function, and the first
# binary's stream_tile<4, bf16> SASS (tile and twin) in $OUT/tile4.sass.
NAME=ab BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
BINS=${BINS:-$K}
last=${BINS##* }
if [[ ${DECODE:-1} == 1 || -n ${EXTRA:-} || ${CTX32:-0} == 1 || ${FAMILY:-0} == 1 || ${NCU:-0} == 1 ]]; then
  timeout 150 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
fi
if [[ ${DECODE:-1} == 1 ]]; then
  for r in $(seq ${ROUNDS:-2}); do
    for b in $BINS; do
      decode_line "$b" "$b" ${DARGS:-}
    done
  done
fi
IFS=';' read -ra extras <<<"${EXTRA:-}"
for x in "${extras[@]}"; do decode_line "$last $x" "$last" $x ${DARGS:-}; done
if [[ ${CTX32:-0} == 1 ]]; then
  for b in $BINS; do decode_line "$b 32k" "$b" --context 32768 ${DARGS:-}; done
fi
if [[ ${FAMILY:-0} == 1 ]]; then
  timeout 150 $last bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda ${DARGS:-} >$OUT/decode.log 2>&1
  grep -E "^(floor|bandwidth|  [a-z])" $OUT/decode.log | cut -c1-200 | head -12
fi
if [[ ${STREAM:-1} == 1 ]]; then
  for r in $(seq ${STREAM_ROUNDS:-1}); do
    for b in $BINS; do
      log=$OUT/stream_$(echo "$b" | tr / _)_$r.log
      timeout 150 $b bench stream ${STREAM_ARGS:---quick} >"$log" 2>&1
      echo "bench stream $b ($r): rc=$?"; grep -E "^(read bandwidth|[a-z_0-9/]+ +[2-8] +[0-9]+ +[18] |experts|  separate)" "$log"
    done
  done
fi
[[ ${CHECKS:-0} == 1 ]] && checks
if [[ ${NCU:-0} == 1 ]]; then
  for b in $BINS; do echo "== $b" >>"$OUT/ncu_step.txt"; K=$b ncu_step; done
  cat "$OUT/ncu_step.txt"
fi
if [[ ${SASS:-0} == 1 ]]; then
  first=1
  for b in $BINS; do
    cuobjdump -sass "$b" >/tmp/all.sass 2>/dev/null
    python3 - "$first" "$OUT/tile4.sass" "$b" <<'PY'
import re, sys
first, dst, name = sys.argv[1] == "1", sys.argv[2], sys.argv[3]
cur, n, keep = None, {}, []
for line in open("/tmp/all.sass"):
    m = re.match(r"\s+Function : (\S+)", line)
    if m:
        cur = m.group(1); n[cur] = 0
        if first and "11stream_tileILi4ELb0E" in cur: keep.append(line)
        continue
    if cur and re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
        n[cur] += 1
        if first and "11stream_tileILi4ELb0E" in cur: keep.append(line)
for f, c in n.items():
    if "stream_tile" in f: print(f"  {name}: {c:6d} SASS instructions  {f}")
if first: open(dst, "w").writelines(keep)
PY
    first=0
  done
fi
