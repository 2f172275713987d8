#!/usr/bin/env bash
# On the GPU machine, in the least device time: the engine kernels' contract registrations, the CUDA engine test, then
# `keel bench decode` at 1k of build-l/keel_base (the tree before, carried beside it) and build-l/keel, once each.
NAME=final7 BUILD_DIR=build-l
. "$(dirname "$0")/lib.sh"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/usr/local/cuda/lib64
timeout 60 $K contract --backend cuda --filter '^cuda/engine/' >"$OUT/contract.log" 2>&1
echo "contract rc=$?"; grep -E "^(FAIL|MISSED|LIMIT)" "$OUT/contract.log" | head -5; grep -E "^SUMMARY" "$OUT/contract.log"
timeout 60 $B/tests/engine_cuda_test_cuda_engine >"$OUT/engine.log" 2>&1
echo "engine test rc=$? $(grep -E '^\[  PASSED|^\[  FAILED' "$OUT/engine.log" | head -2)"; grep -E "bit-identical|FAILED" "$OUT/engine.log" | cut -c1-160
timeout 60 $K synth configs/nano-30b-a3b.json /tmp/nano --bits 4 --group 64 >/dev/null 2>&1 || echo "synth failed"
decode_line base build-l/keel_base | tee -a "$OUT/decode.log"
decode_line new build-l/keel | tee -a "$OUT/decode.log"
