#!/usr/bin/env bash
# On the GPU machine: the k-split target sweep for decode (issue #8). Builds keel (sm_90), writes the Nano-30B-A3B
# shape, runs `keel bench decode` at 1k for each split target in $QS (PDL on, no L2 prefetch) and `keel bench stream
# --quick` at two targets; the tests' verdicts go last. Logs go to $OUT (at most 8 files come back).
NAME=split
. "$(dirname "$0")/lib.sh"
build kernels_cuda_test_stream_cuda engine_cuda_test_cuda_engine
timeout 120 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
for q in ${QS:-2 4 8 12 16}; do
  timeout 60 $K bench decode /tmp/nano --prompt-tokens 1000 --tokens 128 --backend cuda --split-target $q >"$OUT/dec_q$q.log" 2>&1
  echo "q=$q rc=$?: $(grep -E '^decode:' "$OUT/dec_q$q.log")"
done
for q in ${BQS:-2 8}; do
  timeout 120 $K bench stream --quick --split-target $q >"$OUT/stream_q$q.log" 2>&1; echo "bench stream q=$q rc=$?"
done
paste <(grep -E "^(q_proj|experts|  separate|k-split)" "$OUT/stream_q2.log" | cut -c1-70) <(grep -E "^(q_proj|experts|  separate|k-split)" "$OUT/stream_q8.log" | cut -c30-70)
timeout 200 $B/tests/kernels_cuda_test_stream_cuda >/tmp/ts.log 2>&1; echo "test_stream rc=$? $(grep -c '^\[       OK' /tmp/ts.log) ok; $(grep -E 'FAILED' /tmp/ts.log | head -3)"
timeout 150 $B/tests/engine_cuda_test_cuda_engine >/tmp/te.log 2>&1; echo "test_engine rc=$? $(grep -c '^\[       OK' /tmp/te.log) ok; $(grep -E 'FAILED' /tmp/te.log | head -3)"
cp /tmp/te.log "$OUT/test_engine.log"
