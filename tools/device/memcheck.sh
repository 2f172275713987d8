#!/usr/bin/env bash
# On the GPU machine, with build-l/keel carried: the whole CUDA contract (or the registrations matching $FILTER)
# under compute-sanitizer's memcheck; its SUMMARY line and memcheck's ERROR SUMMARY ($OUT/memcheck.log has it all).
NAME=mc BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
t=$(date +%s)
timeout 500 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 $K contract --backend cuda \
  ${FILTER:+--filter "$FILTER"} >"$OUT/memcheck.log" 2>&1
echo "memcheck rc=$? in $(( $(date +%s) - t )) s"
grep -E "^SUMMARY|ERROR SUMMARY|Invalid|^FAIL|^MISSED" "$OUT/memcheck.log" | head -20
