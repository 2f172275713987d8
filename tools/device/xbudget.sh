#!/bin/bash
# On the GPU machine, with build-l/keel and the packed test carried: the packed tile's tests (the x budget's bits among
# them), then `keel bench stream --quick --shapes square16k,lm_head --xbudget $XB` (default 48,80,104,208,auto: the
# default, two that keep two blocks an sm_90 SM, one block's most, and the largest keeping the default's blocks an SM):
# each packed row at each budget, in one run.
source .devdeps/env.sh; export KEEL_FIXTURES=$PWD/.devfix
B=build-l
XB=${XB:-48,80,104,208,auto}
$B/tests/kernels_cuda_test_packed_cuda > $OUT/test_packed_cuda.log 2>&1; echo "test_packed_cuda rc $?"
grep -E "x budgets|FAILED|PASSED" $OUT/test_packed_cuda.log | head
timeout 480 $B/keel bench stream --quick --shapes ${SHAPES:-square16k,lm_head} --xbudget $XB "$@" > $OUT/bench.log 2>&1
echo "bench rc $?"
grep -E "read bandwidth|/packed" $OUT/bench.log | head -200
