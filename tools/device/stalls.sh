#!/usr/bin/env bash
# On the GPU machine, with build-l/keel carried: why a stream tile's warps wait. ncu's stall reasons (per issued
# instruction, all samples) on one launch of each SHAPE in $SHAPES (4 bits, m = 1; default lm_head in_proj), and the
# SASS source page with its per-reason sample columns as CSV ($OUT/src_SHAPE.csv).
NAME=st BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
for sh in ${SHAPES:-lm_head in_proj}; do
  timeout 150 ncu --clock-control none --set full --import-source no -f -o /tmp/st_$sh --kernel-name regex:stream_tile \
    --launch-skip 3 --launch-count 1 $K bench stream --quick --shapes $sh --bits 4 >/tmp/st_$sh.run 2>&1
  echo "ncu $sh rc=$?"
  ncu -i /tmp/st_$sh.ncu-rep --page raw --csv 2>/dev/null | python3 tools/device/ncu_raw.py 14 0
  ncu -i /tmp/st_$sh.ncu-rep --page source --csv --print-source sass >"$OUT/src_$sh.csv" 2>/dev/null
done
# DECODE=1: the same on tile launches inside a launch-by-launch decode step of /tmp/nano (synth made here): launches
# DSKIP.. of stream_tile (default 170, 3 of them: in a decode step, past the 8-token prompt's 163)
if [[ ${DECODE:-0} == 1 ]]; then
  timeout 150 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
  timeout 200 ncu --clock-control none --set full --import-source no -f -o /tmp/st_dec --kernel-name regex:stream_tile \
    --launch-skip ${DSKIP:-170} --launch-count ${DCOUNT:-3} $K bench decode /tmp/nano --prompt-tokens 8 --tokens 2 --backend cuda \
    --graphs off >/tmp/st_dec.run 2>&1; echo "ncu decode rc=$?"
  ncu -i /tmp/st_dec.ncu-rep --page source --csv --print-source sass >"$OUT/src_dec.csv" 2>/dev/null
  ncu -i /tmp/st_dec.ncu-rep --page details >"$OUT/ncu_dec.txt" 2>/dev/null; grep -E "Grid Size|Duration" "$OUT/ncu_dec.txt"
fi
