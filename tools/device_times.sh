#!/bin/bash
# device_times.sh — per wheel under dist/: CUDA-event vs host time per decode call (profile_decode.py)
# and the kernels' own durations under ncu (clocks left alone), for A/B of decode builds (development
# tool; run on the device machine with carry ["dist"]; logs in $OUT).
set -u
: "${OUT:?run on the device machine}"
export FLASH_NIF_CACHE_DIR=/tmp/flash_nif_cache
for w in dist/*/; do
    n=$(basename "$w"); rm -rf "/tmp/site_$n"
    python3 -m pip install -q --no-deps --no-index --target "/tmp/site_$n" "$w"/*.whl
done
for rep in ${REPS:-1 2}; do
  for n in ${WHEELS:-base new}; do
    for shape in ${SHAPES:-8x8192 64x1024 1x131072}; do
      echo "== $n $shape rep $rep"
      (cd bench && PYTHONPATH="/tmp/site_$n" python3 profile_decode.py "$shape" "${FORMATS:-bf16,8,4}") 2>&1 | grep "per call"
    done
  done
done
for n in ${WHEELS:-base new}; do
  for f in ${NCU_FORMATS:-bf16 8 4}; do
    echo "== ncu $n $f"
    (cd bench && PYTHONPATH="/tmp/site_$n" timeout 200 ncu --clock-control none --kernel-name regex:"flash_decode|flash_merge" \
        --launch-count 16 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        python3 profile_decode.py 8x8192 "$f" > "$OUT/ncu_times_${n}_$f.txt" 2>&1)
    grep -E "^  flash_|gpu__time_duration|dram__throughput" "$OUT/ncu_times_${n}_$f.txt" | awk '{print $1, $(NF)}' | paste - - - | tail -4
  done
done
# SASS=NAME:FMT: per-instruction executed counts of the decode kernel (ncu source page, SASS, CSV)
if [ -n "${SASS:-}" ]; then
  n=${SASS%%:*} f=${SASS##*:}
  (cd bench && PYTHONPATH="/tmp/site_$n" timeout 300 ncu --clock-control none --kernel-name regex:flash_decode --launch-skip 2 \
      --launch-count 1 --section SourceCounters --page source --print-source sass --csv \
      python3 profile_decode.py 8x8192 "$f" > "$OUT/sass_counts_${n}_$f.csv" 2>&1)
  echo "== sass counts $n $f: $(wc -l < "$OUT/sass_counts_${n}_$f.csv") lines"
fi
