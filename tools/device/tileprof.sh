#!/usr/bin/env bash
# On the GPU machine: where a stream tile's time goes on decode shapes. Uses a carried build-l/keel when it runs
# (else builds sm_90); times in_proj, q_proj and the routed experts at 4 bits; ncu's full set on one launch each of
# in_proj m=1, routed fc1 and fc2 m=1, with the SASS lines that collect the most stall samples (srcprof.py).
NAME=tp
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
if [[ -x build-l/keel ]] && build-l/keel contract --list >/dev/null 2>&1; then K=build-l/keel; echo "carried build-l/keel"; else build; fi
step bench 120 $K bench stream --quick --shapes in_proj,q_proj,out_proj,k_proj,experts --bits 4
prof() { # prof NAME SHAPES SKIP
  timeout 150 ncu --clock-control none --set full --import-source no -f -o "/tmp/$1" --kernel-name regex:stream_tile \
    --launch-skip "$3" --launch-count 1 $K bench stream --quick --shapes "$2" --bits 4 >/tmp/$1.run 2>&1
  echo "ncu $1 rc=$?"
  ncu -i "/tmp/$1.ncu-rep" --page details >"$OUT/ncu_$1.txt" 2>&1
  ncu -i "/tmp/$1.ncu-rep" --page source --csv --print-source sass 2>/dev/null | python3 "$(dirname "$0")/srcprof.py" >"$OUT/src_$1.txt" 2>&1
  # with a -lineinfo build: the CUDA source lines with the most stall samples
  ncu -i "/tmp/$1.ncu-rep" --page source --csv --print-source cuda 2>/dev/null | python3 "$(dirname "$0")/srcprof.py" >>"$OUT/src_$1.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Issue Slots Busy|No Eligible|Achieved Occupancy|Warp Cycles Per Issued|Registers Per|Executed Ipc A" "$OUT/ncu_$1.txt" | head -10
  head -${SRCN:-25} "$OUT/src_$1.txt" | tail -$(( ${SRCN:-25} - 3 ))
  awk '/^columns/{n++} n==2' "$OUT/src_$1.txt" | sed -n '/top instructions/,+30p' 
}
for spec in ${PROFS:-inproj:in_proj:3 fc2:experts:56 lmhead:lm_head:3}; do IFS=: read -r n sh sk <<<"$spec"; prof "$n" "$sh" "$sk"; done
