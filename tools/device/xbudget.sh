#!/bin/bash
# On the GPU machine, with build-l/keel and the packed test carried: the packed tile's tests (the x budget's bits among
# them), then `keel bench stream --quick --shapes square16k,lm_head --xbudget $XB`: each packed row at the default (auto)
# and at each budget of XB (default 48,80,104,208 KiB: the 100 KB chips', two that keep two blocks an sm_90 SM, and one
# block's most), in one run.
source .devdeps/env.sh; export KEEL_FIXTURES=$PWD/.devfix
B=build-l
XB=${XB:-48,80,104,208}
$B/tests/kernels_cuda_test_packed_cuda > $OUT/test_packed_cuda.log 2>&1; echo "test_packed_cuda rc $?"
grep -E "x budgets|FAILED|PASSED" $OUT/test_packed_cuda.log | head
timeout 480 $B/keel bench stream --quick --shapes ${SHAPES:-square16k,lm_head} --xbudget $XB "$@" > $OUT/bench.log 2>&1
echo "bench rc $?"
grep -E "read bandwidth|/packed" $OUT/bench.log | head -200
