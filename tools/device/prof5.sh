#!/usr/bin/env bash
# On the GPU machine, with build-l/keel carried: `keel bench stream --quick`, the 4-bit bf16 tile's SASS (the kernel,
# not its contract twin) and ncu's full set with the most-sampled SASS lines on in_proj and lm_head (tileprof.sh).
NAME=p5
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
$CUOBJ -sass build-l/keel 2>/dev/null | awk '/Function : /{p = ($0 ~ /_stream_cu_[0-9a-f]*11stream_tileILi4ELb0E/)} p' >"$OUT/sass_tile4.txt"
echo "sass lines: $(wc -l <"$OUT/sass_tile4.txt")"
timeout 150 build-l/keel bench stream --quick >"$OUT/stream.log" 2>&1; echo "bench stream rc=$?"
grep -E "^(read bandwidth|lm_head|square16k +4 |in_proj|q_proj +4|out_proj|experts|  separate)" "$OUT/stream.log" | head -40
[[ ${PROF:-1} == 1 ]] && PROFS="inproj:in_proj:3 lmhead:lm_head:3" bash "$(dirname "$0")/tileprof.sh"
