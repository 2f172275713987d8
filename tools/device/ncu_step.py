"""Per-kernel GPU time of one launch-by-launch decode step from an `ncu --csv --metrics gpu__time_duration.sum` log
of `keel bench decode DIR --prompt-tokens 8 --tokens 2 --graphs off`: the kernels between the first two draws
(argmax_kernel) are one decode step. Prints time by kernel, the step's total and its kernel count."""
import csv, sys, collections

rows = []
each = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--launches" else None  # also list these launches one by one
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") == "gpu__time_duration.sum":
        name = r["Kernel Name"].split("(")[0].strip().split("::")[-1]
        rows.append((name, float(r["Metric Value"].replace(",", "")), r.get("Grid Size", "")))
draws = [i for i, (n, _, _) in enumerate(rows) if n.startswith("argmax_kernel")]
if len(draws) < 2:
    sys.exit(f"fewer than two draws among {len(rows)} kernels")
step = rows[draws[0] + 1 : draws[1] + 1]
tot = sum(t for _, t, _ in step)
by = collections.defaultdict(lambda: [0.0, 0])
for n, t, _ in step:
    by[n][0] += t
    by[n][1] += 1
print(f"one decode step: {len(step)} kernels, {tot / 1e3:.1f} us of GPU time (sum of kernel durations)")
print(f"{'kernel':40s} {'launches':>8s} {'us':>10s} {'share':>7s} {'us/launch':>10s}")
for n, (t, c) in sorted(by.items(), key=lambda kv: -kv[1][0]):
    print(f"{n[:40]:40s} {c:8d} {t / 1e3:10.1f} {100 * t / tot:6.1f}% {t / 1e3 / c:10.2f}")
if each:
    print(f"launches of {each} in step order: grid, us")
    print("  " + " ".join(f"{g.strip('()').split(',')[0]}:{t / 1e3:.1f}" for n, t, g in step if n.startswith(each)))
