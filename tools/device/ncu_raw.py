#!/usr/bin/env python3
"""Summarizes one kernel of ncu's raw page (`ncu -i REP --page raw --csv`, CSV on stdin): the launch's grid,
registers, time, instructions, issue, warps and DRAM figures, its STALLS largest stall reasons (average warp latency
per issued instruction) and its PIPES busiest pipes (% of peak while active).
Usage: ncu -i REP --page raw --csv | tools/device/ncu_raw.py [STALLS [PIPES]]   (defaults 12 and 10)"""
import csv, sys

FIGURES = ("Kernel Name", "launch__grid_size", "launch__registers_per_thread", "gpu__time_duration.sum",
           "smsp__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
           "smsp__warps_active.avg.per_cycle_active", "smsp__warps_eligible.avg.per_cycle_active",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed")


def main(argv):
    stalls = int(argv[1]) if len(argv) > 1 else 12
    pipes = int(argv[2]) if len(argv) > 2 else 10
    rows = list(csv.reader(sys.stdin))
    if len(rows) < 2:
        sys.exit("ncu_raw: no kernel in the raw page")
    h, v = rows[0], rows[-1]

    def num(i):
        try:
            return float(v[i].replace(",", ""))
        except ValueError:
            return None

    for i, n in enumerate(h):
        if n in FIGURES:
            print(f"  {v[i]}  {n}")
    st = [(num(i), n) for i, n in enumerate(h) if "average_warp_latency_issue_stalled" in n and num(i) is not None]
    for x, n in sorted(st, reverse=True)[:stalls]:
        print(f"  {x:8.2f}  {n}")
    pu = [(num(i), n) for i, n in enumerate(h) if "pipe_" in n and "pct_of_peak_sustained_active" in n and num(i)]
    for x, n in sorted(pu, reverse=True)[:pipes]:
        print(f"  {x:8.2f}  {n}")


if __name__ == "__main__":
    main(sys.argv)
