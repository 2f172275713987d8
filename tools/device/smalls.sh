#!/usr/bin/env bash
# On the GPU machine, with build-l/keel carried: where the decode step's small launches spend their time. ncu's full
# set on COUNT launches (default 2) of each kernel of $KERNELS (regex:SKIP pairs; default the norm, route, union and
# the first tiles of a decode step) in a launch-by-launch decode step of /tmp/nano, and per launch its duration,
# issue activity, warps and the top stall reasons (cycles a warp waits per issued instruction).
NAME=sm BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
timeout 150 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
for ks in ${KERNELS:-add_rmsnorm:60 route_kernel:30 union_kernel:30 stream_tile:170 matvec_kernel:30 ssm_kernel:30}; do
  kn=${ks%%:*} sk=${ks##*:}
  timeout 200 ncu --clock-control none --cache-control none --set full --import-source no -f -o /tmp/sm_$kn \
    --kernel-name regex:$kn --launch-skip $sk --launch-count ${COUNT:-2} $K bench decode /tmp/nano --prompt-tokens 8 \
    --tokens 2 --backend cuda --graphs off >/tmp/sm_$kn.run 2>&1
  echo "== $kn (skip $sk): ncu rc=$?"
  ncu -i /tmp/sm_$kn.ncu-rep --page raw --csv 2>/dev/null | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin)); h = rows[0]
def num(s):
    try: return float(s.replace(",", ""))
    except ValueError: return None
want = ("gpu__time_duration.sum", "smsp__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
        "sm__warps_active.avg.per_cycle_active", "launch__grid_size", "launch__block_size", "launch__registers_per_thread",
        "dram__bytes_read.sum", "lts__t_bytes.sum", "smsp__cycles_active.avg")
for v in rows[2:]:
    if len(v) != len(h): continue
    print("  " + "  ".join(f"{n}={v[i]}" for i, n in enumerate(h) if n in want))
    st = {}
    for i in range(len(h)):
        if "average_warp_latency_issue_stalled" in h[i] and num(v[i]):
            st.setdefault(h[i].split("_stalled_")[-1].split(".")[0], num(v[i]))
    print("    stalls: " + ", ".join(f"{n} {x:.2f}" for n, x in sorted(st.items(), key=lambda a: -a[1])[:9]))
'
done
