#!/bin/bash
# On the GPU machine, with build-l/keel and the packed and stream tests carried: the packed and stream tile tests,
# the whole `keel bench stream --quick` (every shape) and the whole CUDA contract; logs under $OUT.
source .devdeps/env.sh; export KEEL_FIXTURES=$PWD/.devfix
B=build-l
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt 2>&1
for t in kernels_cuda_test_packed_cuda kernels_cuda_test_stream_cuda; do
  [ -x $B/tests/$t ] || continue
  $B/tests/$t > $OUT/$t.log 2>&1; echo "$t rc $?"; tail -1 $OUT/$t.log
done
timeout 300 $B/keel contract --backend cuda > $OUT/contract.log 2>&1; echo "contract rc $?"
grep -E "^(FAIL|MISSED|LIMIT)" $OUT/contract.log | head -20; grep SUMMARY $OUT/contract.log
timeout 240 $B/keel bench stream --quick > $OUT/bench.log 2>&1; echo "bench rc $?"
grep -E "read bandwidth|lm_head/packed|separate|experts" $OUT/bench.log | head -60
