#!/bin/bash
# ab_graph.sh — on the lent GPU machine: GPU tests of one wheel, then bench/decode.py --graph rounds
# alternating wheels (development tool; device_ab.sh's eager counterpart).
# Here:   maturin build --release -q -o dist/NAME for each version; run with carry ["dist/A", "dist/B", ...]
# There:  TEST=NAME TEST_FILES="..." ROUNDS=2 NAMES="base new" SHAPES=... bash tools/ab_graph.sh
set -u
: "${OUT:?run on the device machine, where OUT is set}"
export FLASH_NIF_CACHE_DIR=/tmp/flash_nif_cache
for w in dist/*/; do
    n=$(basename "$w")
    compgen -G "$w*.whl" > /dev/null || continue
    rm -rf "/tmp/site_$n"
    python3 -m pip install -q --no-deps --no-index --target "/tmp/site_$n" "$w"/*.whl
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
if [ -n "${TEST:-}" ]; then
    PYTHONPATH="/tmp/site_$TEST" timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        ${TEST_FILES:-tests/test_decode_gpu.py tests/test_decode_fixtures.py} ${TESTK:+-k "$TESTK"} > "$OUT/test_$TEST.log" 2>&1
    echo "rc $?" >> "$OUT/test_$TEST.log"
    echo "== test $TEST"; tail -4 "$OUT/test_$TEST.log"
fi
for r in $(seq 1 "${ROUNDS:-0}"); do
    for b in ${NAMES:-}; do
        (cd bench && PYTHONPATH="/tmp/site_$b" timeout 200 python3 decode.py --device cuda --graph \
            --formats "${FORMATS:-bf16,8-bit/64,4-bit/64}" \
            --shapes "${SHAPES:-8x8192,16x4096,64x1024,1x131072}" > "$OUT/bench_${r}_$b.log" 2>&1)
        echo "== round $r $b"; grep -E "^\| [0-9]" "$OUT/bench_${r}_$b.log"
    done
done
