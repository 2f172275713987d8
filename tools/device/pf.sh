#!/bin/bash
# On the GPU machine, with build-l/s.tar.xz (keel, the packed test and old_keel, the tree before the parts kernel,
# stripped) and .devdeps carried: the packed tests, then 16384² and lm_head with the packed tile's L2 prefetch of each
# warp's first unit at 0 and 16 spans (and with dependent launches), against the old tree in the same run; logs
# under $OUT.
mkdir -p build-l/s && tar -xJf build-l/s.tar.xz -C build-l/s
source .devdeps/env.sh
timeout 150 build-l/s/test_packed > $OUT/test_packed_cuda.log 2>&1
echo "test rc=$? $(grep -E 'PASSED|FAILED' $OUT/test_packed_cuda.log | tr '\n' ' ')"
S=square16k,lm_head
run() { timeout 100 "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?"; }
name=old; run build-l/s/old_keel bench stream --quick --shapes $S
for pf in 0 16; do name=pf$pf; run build-l/s/keel bench stream --quick --shapes $S --pk-prefetch $pf; done
for pf in 0 16; do name=pdl$pf; run build-l/s/keel bench stream --quick --shapes $S --pdl --pk-prefetch $pf; done
name=old2; run build-l/s/old_keel bench stream --quick --shapes $S
