#!/bin/bash
# On the GPU machine, with build-l/keel and the packed and stream tests carried: the packed and stream tile tests,
# the whole CUDA contract and `keel bench stream ARGS` (default `--quick --shapes lm_head,square16k`; `--quick` alone
# runs every shape); logs under $OUT.
source .devdeps/env.sh; export KEEL_FIXTURES=$PWD/.devfix
B=build-l
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt 2>&1
for t in kernels_cuda_test_packed_cuda kernels_cuda_test_stream_cuda; do
  [ -x $B/tests/$t ] || continue
  $B/tests/$t > $OUT/$t.log 2>&1; echo "$t rc $?"; tail -1 $OUT/$t.log
done
timeout 300 $B/keel contract --backend cuda > $OUT/contract.log 2>&1; echo "contract rc $?"
grep -E "^(FAIL|MISSED|LIMIT)" $OUT/contract.log | head -20; grep SUMMARY $OUT/contract.log
[ $# -gt 0 ] || set -- --quick --shapes lm_head,square16k
timeout 240 $B/keel bench stream "$@" > $OUT/bench.log 2>&1; echo "bench rc $?"
grep -E "read bandwidth|/packed|separate|experts" $OUT/bench.log | head -60
