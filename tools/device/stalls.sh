#!/usr/bin/env bash
# On the GPU machine, with build-l/keel carried: why a stream tile's warps wait. ncu's stall reasons (per issued
# instruction, all samples) on one launch of each SHAPE in $SHAPES (4 bits, m = 1; default lm_head in_proj), and the
# SASS source page with its per-reason sample columns as CSV ($OUT/src_SHAPE.csv).
NAME=st
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
for sh in ${SHAPES:-lm_head in_proj}; do
  timeout 150 ncu --clock-control none --set full --import-source no -f -o /tmp/st_$sh --kernel-name regex:stream_tile \
    --launch-skip 3 --launch-count 1 build-l/keel bench stream --quick --shapes $sh --bits 4 >/tmp/st_$sh.run 2>&1
  echo "ncu $sh rc=$?"
  ncu -i /tmp/st_$sh.ncu-rep --page raw --csv 2>/dev/null | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin)); h, v = rows[0], rows[-1]
st = [(float(v[i].replace(",", "")), h[i]) for i in range(len(h)) if "average_warp_latency_issue_stalled" in h[i] and v[i].replace(",", "").replace(".", "").isdigit()]
for x, n in sorted(st, reverse=True)[:14]: print(f"  {x:8.2f}  {n}")
for i, n in enumerate(h):
    if n in ("gpu__time_duration.sum", "smsp__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active"): print(f"  {v[i]}  {n}")
'
  ncu -i /tmp/st_$sh.ncu-rep --page source --csv --print-source sass >"$OUT/src_$sh.csv" 2>/dev/null
done
