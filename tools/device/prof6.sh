#!/usr/bin/env bash
# On the GPU machine, with build-l carried: decode at 1k with the defaults and each ';'-separated DECODE_ARGS line,
# a launch-by-launch decode step through ncu (per kernel and per stream_tile launch), and ncu's full set with the
# most-sampled SASS lines on one launch of each kernel named in KERNELS (default route_kernel add_rmsnorm_kernel).
NAME=p6 BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
timeout 150 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
IFS=';' read -ra extra <<<";${DECODE_ARGS:-}"
for a in "${extra[@]}"; do
  timeout 90 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda $a >/tmp/d.log 2>&1
  echo "decode [$a]: rc=$? $(grep '^decode:' /tmp/d.log | sed 's/ at batch 1//') $(grep '^prompt:' /tmp/d.log | sed 's/.*: //')"
done
ncu_step --launches stream_tile; head -60 "$OUT/ncu_step.txt"
for kn in ${KERNELS:-route_kernel add_rmsnorm_kernel}; do
  timeout 120 ncu --clock-control none --set full --import-source no -f -o /tmp/$kn -k regex:$kn --launch-skip 30 --launch-count 1 \
    $K bench decode /tmp/nano --prompt-tokens 8 --tokens 2 --backend cuda --graphs off >/tmp/$kn.run 2>&1; echo "ncu $kn rc=$?"
  ncu -i /tmp/$kn.ncu-rep --page details >"$OUT/ncu_$kn.txt" 2>&1
  ncu -i /tmp/$kn.ncu-rep --page source --csv --print-source sass 2>/dev/null | python3 "$(dirname "$0")/srcprof.py" >"$OUT/src_$kn.txt" 2>&1
  grep -E "Duration|Executed Instructions  |Warp Cycles Per Issued" "$OUT/ncu_$kn.txt" | head -4
  sed -n '/top instructions/,+14p' "$OUT/src_$kn.txt"
done
