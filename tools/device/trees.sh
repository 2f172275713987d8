#!/bin/bash
# On the GPU machine, with build-l/g.tar.xz (old_keel: b5bd8b5, before the parts kernel; pf_keel: f285097, the parts
# kernel and the first-unit L2 prefetch knob; keel: b408055, the revert of f285097, before the split kernel kept its
# m > 1 walks) and .devdeps carried: 16384² at 2, 4 and 6 bits with each binary twice, alternating, in one run; logs
# under $OUT.
mkdir -p build-l/g && tar -xJf build-l/g.tar.xz -C build-l/g
source .devdeps/env.sh
for i in 1 2; do
  for b in old_keel keel pf_keel; do
    timeout 60 build-l/g/$b bench stream --quick --shapes square16k --bits 2,4,6 > $OUT/${b}_$i.log 2>&1; echo "$b $i rc=$?"
  done
done
