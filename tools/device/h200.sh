#!/usr/bin/env bash
# On the GPU machine, with build-l/keel carried: what bounds the packed tile on this card, in one call.
# 1. pkmem (compiled here, seconds): the walk's memory side alone against the plain read, sections 1 (bytes in flight,
#    register ring against a bulk-copy ring), 3 (the same at 4 and 8 bits, with and without arithmetic), 2 (launches
#    back to back, as the bench times them) and 0 (ring depth, tiles a step, four blocks an SM, layouts);
#    $OUT/pkmem.log.
# 2. ncu on one m = 1 launch of each width in $NCU_BITS (default 2 4 8) of lm_head (the unsplit pair walk) and of
#    16384² (the split kernel): stall reasons per issued instruction, pipe utilization, issue and DRAM figures
#    ($OUT/ncu_<shape>_<bits>.txt), and the SASS source page summarized by srcprof.py ($OUT/src_<shape>_<bits>.txt).
# Logs under $OUT; `tar` them if more than eight files must come back.
NAME=h200 BUILD_DIR=${BUILD_DIR:-build-l}
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
if [[ ${PKMEM:-1} == 1 ]]; then
  t=$(date +%s)
  nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/pkmem tools/device/pkmem.cu || echo "pkmem: build failed"
  for s in 1 3 2 0; do echo "== pkmem $s"; timeout 150 /tmp/pkmem $s; done >"$OUT/pkmem.log" 2>&1
  echo "pkmem: $(( $(date +%s) - t )) s"; grep -E "^read:" "$OUT/pkmem.log"
fi
# the launch of each shape ncu profiles: past the bench's warm-up, an m = 1 launch of the shape's first group
for sh in ${NCU_SHAPES:-lm_head square16k}; do
  for b in ${NCU_BITS:-2 4 8}; do
    rep=/tmp/h200_${sh}_$b
    timeout 150 ncu --clock-control none --set full --import-source no -f -o $rep --kernel-name regex:stream_packed \
      --launch-skip ${NCU_SKIP:-5} --launch-count 1 $K bench stream --quick --shapes $sh --bits $b >$rep.run 2>&1
    echo "ncu $sh $b bits: rc=$?"
    ncu -i $rep.ncu-rep --page raw --csv 2>/dev/null | python3 tools/device/ncu_raw.py >"$OUT/ncu_${sh}_$b.txt"
    head -3 "$OUT/ncu_${sh}_$b.txt"
    ncu -i $rep.ncu-rep --page source --csv --print-source sass 2>/dev/null | python3 tools/device/srcprof.py \
      >"$OUT/src_${sh}_$b.txt" 2>&1
  done
done
