#!/usr/bin/env python3
"""Which scoreboards a kernel's global loads set, and where its instructions wait on them (sm_70 and later).

Usage: tools/sass_waits.py FILE.sass NAME [START END]
  FILE.sass: `cuobjdump -sass` of a cubin (e.g. of `nvcc -cubin -arch=sm_90 -O3 -DNDEBUG -std=c++17 -Isrc
  src/kernels/cuda/packed.cu`; cuobjdump and nvdisasm come with the CUDA toolkit, or from PyPI's
  nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels). NAME: a substring of the function's mangled name.
  Without START END: the function's backward branches that hold an HMMA (its loops), with their counts of
  instructions, HMMA, LDG and LDS. With them (hex addresses): each LDG in the range with the scoreboard it sets,
  and each instruction that waits on one of those scoreboards.
Each instruction's control bits are the top 23 bits of its second 64-bit word: stall (4 bits), yield (1), write
scoreboard (3; 7 = none), read scoreboard (3), wait mask (6), reuse (4). A wait clears only when every instruction
that set the scoreboard has landed, so loads that share one are waited for together (docs/stream-tiles.md).
"""
import re
import sys


def functions(path):
    """{name: [(address, text, {write scoreboard, wait mask})]} of every function in a cuobjdump -sass listing."""
    out, cur, pend = {}, None, None
    for line in open(path):
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);\s+/\* (0x[0-9a-f]+) \*/", line)
        if cur and m:
            pend = (int(m.group(1), 16), m.group(2))
            continue
        m = re.match(r"\s+/\* (0x[0-9a-f]+) \*/", line)
        if cur and pend and m:
            c = int(m.group(1), 16) >> 41
            ctl = dict(wb=(c >> 5) & 7, wait=(c >> 11) & 63)
            out[cur].append((pend[0], pend[1], ctl))
            pend = None
    return out


def loops(ins):
    """(start, end, instructions, HMMA, LDG, LDS) of each backward branch whose body holds an HMMA."""
    res = []
    for addr, text, _ in ins:
        m = re.search(r"BRA (?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)
        if not (m and m.group(1)) or int(m.group(1), 16) >= addr:
            continue
        start = int(m.group(1), 16)
        body = [t for a, t, _ in ins if start <= a <= addr]
        hmma, ldg, lds = (sum(op in t for t in body) for op in ("HMMA", "LDG", "LDS"))
        if hmma:
            res.append((start, addr, len(body), hmma, ldg, lds))
    return res


def main(argv):
    if len(argv) not in (3, 5):
        sys.exit(__doc__)
    funcs = functions(argv[1])
    names = [f for f in funcs if argv[2] in f]
    if not names:
        sys.exit(f"{argv[1]}: no function whose name holds '{argv[2]}'")
    name = names[0]
    print(name)
    if len(argv) == 3:
        for lp in loops(funcs[name]):
            print("  loop %6x-%6x: %5d instructions, %3d HMMA, %3d LDG, %3d LDS" % lp)
        return
    lo, hi = int(argv[3], 16), int(argv[4], 16)
    ins = [x for x in funcs[name] if lo <= x[0] <= hi]
    sbs = sorted({c["wb"] for _, t, c in ins if "LDG" in t and c["wb"] != 7})
    print("  global loads set scoreboards", sbs)
    for addr, text, c in ins:
        if "LDG" in text:
            print("  %6x  sets SB%d  %s" % (addr, c["wb"], text[:56]))
        waits = [s for s in sbs if c["wait"] >> s & 1]
        if waits:
            print("  %6x  waits on %s  %s" % (addr, ",".join("SB%d" % s for s in waits), text[:56]))


if __name__ == "__main__":
    main(sys.argv)
