#!/bin/bash
# On the GPU machine, with build-l/keel and the packed test carried: the packed tile's tests, `keel bench stream
# --quick --shapes lm_head`, and ncu on one 4-bit m = 1 packed launch: its stall counters ($OUT/stall4.txt) and its
# SASS source page (CSV, $OUT/src4.csv; summarized by srcprof.py into $OUT/srcprof4.txt).
source .devdeps/env.sh; export KEEL_FIXTURES=$PWD/.devfix
B=build-l
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
$B/tests/kernels_cuda_test_packed_cuda > $OUT/tests.log 2>&1; echo "packed rc $?" >> $OUT/tests.log
$B/keel bench stream --quick --shapes lm_head > $OUT/bench.log 2>&1
b=4
timeout 150 ncu --clock-control none --set full --import-source no -f -o /tmp/pk$b --kernel-name regex:stream_packed \
    --launch-skip 5 --launch-count 1 $B/keel bench stream --quick --shapes lm_head --bits $b >/tmp/pk$b.run 2>&1
ncu -i /tmp/pk$b.ncu-rep --page raw --csv > /tmp/raw$b.csv 2>/dev/null
python3 - > $OUT/stall$b.txt <<'PY'
import csv
rows = list(csv.reader(open('/tmp/raw4.csv'))); h, v = rows[0], rows[-1]
for i, n in enumerate(h):
    if 'stall' in n or n in ("gpu__time_duration.sum", "smsp__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active", "dram__throughput.avg.pct_of_peak_sustained_elapsed"): print(v[i], n)
PY
ncu -i /tmp/pk$b.ncu-rep --page source --csv --print-source sass > /tmp/src$b.csv 2>/dev/null
python3 tools/device/srcprof.py < /tmp/src$b.csv > $OUT/srcprof$b.txt 2>&1
cp /tmp/src$b.csv $OUT/src$b.csv
echo done
