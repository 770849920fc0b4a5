#!/bin/bash
# ab_probe.sh — on the lent GPU machine: bench/decode.py --graph rounds of one wheel built with a
# timing probe (bench/patches/decode-probe.patch), one run per probe mode, the modes' defines given
# at run time (FLASH_NIF_NVRTC_DEFINES, compile.rs), so that one wheel serves every mode
# (development tool; wheels installed by ab_graph.sh / device_ab.sh first).
# There:  WHEEL=probe MODES="0 1 3 4" ROUNDS=1 SHAPES=8x8192,1x131072 bash tools/ab_probe.sh
#         (DEFINE: the macro the modes set, DECODE_PROBE unless given)
set -u
: "${OUT:?run on the device machine, where OUT is set}"
export FLASH_NIF_CACHE_DIR=/tmp/flash_nif_cache
for r in $(seq 1 "${ROUNDS:-1}"); do
    for m in ${MODES:-0 1}; do
        (cd bench && FLASH_NIF_NVRTC_DEFINES="${DEFINE:-DECODE_PROBE}=$m" PYTHONPATH="/tmp/site_$WHEEL" timeout 200 python3 decode.py \
            --device cuda --graph --shapes "${SHAPES:-8x8192,64x1024,1x131072}" ${BENCH_ARGS:-} > "$OUT/probe_${r}_$m.log" 2>&1)
        echo "== round $r probe $m"; grep -E "^\| [0-9]" "$OUT/probe_${r}_$m.log"
    done
done
