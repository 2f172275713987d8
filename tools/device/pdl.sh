#!/usr/bin/env bash
# On the GPU machine: the engine kernels' programmatic dependent launch and the router's paths, build-l/keel against
# build-l/keel_base (a build of the tree before the change, carried beside it). Unless DECODE=0: `keel bench decode`
# at 1k of both, interleaved ROUNDS times (default 2), with the new one also at --fused-router on; then the new one at
# --pdl-engine off, both at 32k, and the new one's family table. With CHECKS=1: lib.sh's checks (the contract with
# $CONTRACT_ARGS, e.g. --filter '^cuda/engine/', and the CUDA tests). Unless NCU=0: ncu times of the router's
# kernels and add_rmsnorm per grid size over decode steps only (a one-token prompt), fused router off and on.
NAME=pdl BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
timeout 150 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
if [[ ${DECODE:-1} == 1 ]]; then
for r in $(seq ${ROUNDS:-2}); do
  decode_line base build-l/keel_base
  decode_line new build-l/keel
  decode_line new-fused-router build-l/keel --fused-router on
done
decode_line new-pdl-engine-off build-l/keel --pdl-engine off
decode_line base-32k build-l/keel_base --context 32768
decode_line new-32k build-l/keel --context 32768
timeout 150 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda > $OUT/decode.log 2>&1; grep -E "^(floor|bandwidth|  [a-z])" $OUT/decode.log | cut -c1-200 | head -12
fi
[[ ${CHECKS:-0} == 1 ]] && checks
[[ ${NCU:-1} == 1 ]] || exit 0
for fr in off on; do
  timeout 120 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum,launch__grid_size --csv \
    -k regex:"route_window_kernel|matvec_kernel|router_kernel|add_rmsnorm_kernel" --launch-count 400 \
    $K bench decode /tmp/nano --prompt-tokens 1 --tokens 4 --backend cuda --graphs off --fused-router $fr >/tmp/ncu_$fr.log 2>&1
  python3 - /tmp/ncu_$fr.log $fr <<'PY'
import csv, sys, statistics as st
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
h = rows[0]; ki = h.index('Kernel Name'); mi = h.index('Metric Name'); vi = h.index('Metric Value'); ii = h.index('ID')
d = {}
for r in rows[1:]:
    d.setdefault(r[ii], {})['k'] = r[ki].split('(')[0]; d[r[ii]][r[mi]] = r[vi]
    if r[mi] == 'gpu__time_duration.sum': d[r[ii]]['unit'] = r[h.index('Metric Unit')]
g = {}
for v in d.values():
    key = (v['k'], v.get('launch__grid_size'))
    t = float(v['gpu__time_duration.sum'].replace(',', ''))
    g.setdefault(key, []).append(t / 1000 if v.get('unit', '').startswith('n') else t)
for k, t in sorted(g.items()): print(f"ncu fused-router {sys.argv[2]}: {k[0]} grid {k[1]}: {len(t)} launches, median {st.median(t):.2f} us")
PY
done
