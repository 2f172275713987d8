#!/usr/bin/env bash
# On the GPU machine, with build-l/keel carried (sm_90): where a decode step's time goes outside the big tiles.
# GPU time per kernel of one launch-by-launch step (ncu, no cache flush; ncu_step.py), then ncu's full set on one
# decode launch of each engine kernel named in $KERNELS, with the SASS lines that collect the most stall samples.
NAME=ep BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
timeout 150 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
step ncu_step 150 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --launch-count 1000 $K bench decode /tmp/nano --prompt-tokens 8 --tokens 2 --backend cuda --graphs off
python3 tools/device/ncu_step.py "$OUT/ncu_step.log" >"$OUT/ncu_step.txt" 2>&1; head -30 "$OUT/ncu_step.txt"
rm -f "$OUT/ncu_step.log"
for kn in ${KERNELS:-add_rmsnorm_kernel route_kernel matvec_kernel conv_kernel ssm_kernel}; do
  timeout 120 ncu --clock-control none --cache-control none --set full --import-source no -f -o "/tmp/$kn" --kernel-name "regex:^$kn" \
    --launch-skip ${SKIP:-60} --launch-count 1 $K bench decode /tmp/nano --prompt-tokens 8 --tokens 4 --backend cuda --graphs off >/tmp/$kn.run 2>&1
  echo "ncu $kn rc=$?"
  { ncu -i "/tmp/$kn.ncu-rep" --page details; ncu -i "/tmp/$kn.ncu-rep" --page source --csv --print-source sass 2>/dev/null | python3 tools/device/srcprof.py; } >"$OUT/ncu_$kn.txt" 2>&1
  grep -E "Duration|Grid Size|Block Size|Issue Slots Busy|Achieved Occupancy|Warp Cycles Per Issued" "$OUT/ncu_$kn.txt" | head -7
  sed -n '/top instructions/,+12p' "$OUT/ncu_$kn.txt"
done
