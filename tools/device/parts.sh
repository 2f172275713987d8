#!/bin/bash
# On the GPU machine, with build-l/keel, build-l/old/keel (the tree before the parts kernel) and .devdeps carried:
# 16384² old against new twice in one run, the x-budget sweep of the new tree, and ncu's stall counters of one 4-bit
# launch of the parts kernel (m = 8) and of the split kernel (m = 1) ($OUT/stall_parts.txt, $OUT/stall_split.txt).
source .devdeps/env.sh
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
for i in 1 2; do
  timeout 120 build-l/old/keel bench stream --quick --shapes square16k > $OUT/bench_old$i.log 2>&1; echo "old$i rc=$?"
  timeout 120 build-l/keel bench stream --quick --shapes square16k > $OUT/bench_new$i.log 2>&1; echo "new$i rc=$?"
done
timeout 150 build-l/keel bench stream --quick --shapes square16k --bits 2,4,8 --xbudget 16,32,64,auto > $OUT/bench_xb.log 2>&1
echo "xb rc=$?"
prof() { # name kernel-regex
  timeout 100 ncu --clock-control none --set full --import-source no -f -o /tmp/$1 --kernel-name regex:$2 \
    --launch-skip 3 --launch-count 1 build-l/keel bench stream --quick --shapes square16k --bits 4 >/tmp/$1.run 2>&1
  ncu -i /tmp/$1.ncu-rep --page raw --csv > /tmp/$1.csv 2>/dev/null
  python3 - /tmp/$1.csv > $OUT/stall_$1.txt <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1]))); h, v = rows[0], rows[-1]
for i, n in enumerate(h):
    if 'stall' in n or n in ("gpu__time_duration.sum", "smsp__inst_executed.sum", "launch__grid_size", "launch__registers_per_thread",
        "smsp__issue_active.avg.pct_of_peak_sustained_active", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__occupancy_limit_registers", "lts__t_bytes.sum",
        "dram__bytes_read.sum", "smsp__warps_launched.sum"): print(v[i], n)
PY
  ncu -i /tmp/$1.ncu-rep --page source --csv --print-source sass 2>/dev/null | python3 tools/device/srcprof.py > $OUT/srcprof_$1.txt 2>&1
  echo "prof $1: $(wc -l < $OUT/stall_$1.txt) lines"
}
prof parts stream_packed_parts
prof split stream_packed_split
