#!/usr/bin/env python3
"""Summarizes ncu's SASS source page (CSV on stdin): total stall samples, the instructions with the most samples,
and samples and executed instructions by opcode."""
import collections, csv, sys

rows = list(csv.reader(sys.stdin))
head = next(i for i, r in enumerate(rows) if any("Source" == c for c in r))
cols, data = rows[head], rows[head + 1:]
def col(sub):
    return next((i for i, c in enumerate(cols) if sub in c), None)
src, samp, nis, exe = col("Source"), col("Warp Stall Sampling (All"), col("Warp Stall Sampling (Not"), col("Instructions Executed")
def num(r, i):
    try:
        return float(r[i].replace(",", "")) if i is not None and i < len(r) else 0.0
    except ValueError:
        return 0.0
tot = sum(num(r, samp) for r in data)
tote = sum(num(r, exe) for r in data)
print(f"columns: {cols}")
print(f"instructions: {len(data)}, stall samples: {tot:.0f}, warp instructions executed: {tote:.0f}")
by = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
for r in data:
    op = r[src].strip().split()[0] if r[src].strip() else "?"
    if op.startswith("@"):
        op = r[src].strip().split()[1]
    op = op.split(".")[0]
    by[op][0] += num(r, samp); by[op][1] += num(r, exe); by[op][2] += num(r, nis)
print("by opcode: samples%  not-issued%  executed%")
for op, (s, e, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:30]:
    print(f"  {op:12s} {100*s/max(tot,1):6.1f} {100*n/max(tot,1):6.1f} {100*e/max(tote,1):6.1f}")
print("top instructions by samples:")
for i, r in sorted(enumerate(data), key=lambda ir: -num(ir[1], samp))[:45]:
    print(f"  #{i:5d} {100*num(r, samp)/max(tot,1):5.1f}% exec {num(r, exe):10.0f}  {r[src].strip()[:90]}")
