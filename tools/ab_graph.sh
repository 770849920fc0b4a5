#!/bin/bash
# ab_graph.sh — on the lent GPU machine: GPU tests of one wheel, then bench/decode.py --graph rounds
# alternating wheels (development tool; device_ab.sh's bench is eager).
# Here:   maturin build --release -q -o dist/NAME for each version; run with carry ["dist/A", "dist/B", ...]
# There:  TEST=NAME ROUNDS=2 NAMES="base new" SHAPES=8x8192,1x131072 bash tools/ab_graph.sh
#         (BENCH_ARGS: more decode.py options, e.g. "--dtype f16"; TESTK, SASS, NCU: as device_ab.sh)
set -u
: "${OUT:?run on the device machine, where OUT is set}"
export FLASH_NIF_CACHE_DIR=/tmp/flash_nif_cache
# The wheels installed into /tmp/site_NAME and TEST run by device_ab.sh (its other steps left out).
TEST_FILES="${TEST_FILES:-tests/test_decode_gpu.py tests/test_decode_fixtures.py}" BENCH= TIMES= CPU_PROBE= \
    CPU_PERF= TF32= PROF= NCU_BWD= bash "$(dirname "$0")/device_ab.sh"
for r in $(seq 1 "${ROUNDS:-0}"); do
    for b in ${NAMES:-}; do
        (cd bench && PYTHONPATH="/tmp/site_$b" timeout 200 python3 decode.py --device cuda --graph \
            --shapes "${SHAPES:-8x8192,16x4096,64x1024,1x131072}" ${BENCH_ARGS:-} > "$OUT/bench_${r}_$b.log" 2>&1)
        echo "== round $r $b"; grep -E "^\| [0-9]" "$OUT/bench_${r}_$b.log"
    done
done
