#!/bin/bash
# device_ab.sh — one call on the lent GPU machine that A/B-tests wheels (development tool).
#
# Here:   build each version's wheel into its own folder under dist/, e.g.
#           git stash; maturin build --release -q -o dist/base; git stash pop
#           maturin build --release -q -o dist/new
# There:  run this from the repository root with `carry: ["dist"]`; logs land in $OUT:
#           TEST=new BENCH="base new base new" bash tools/device_ab.sh
#
# Every wheel dist/NAME/*.whl is installed into /tmp/site_NAME. Then, each step only when its
# variable is set:
#   TEST=NAME      pytest -m gpu on ${TEST_FILES:-tests/test_decode_gpu.py} (TESTK: a -k filter)
#   BENCH="a b .." bench/decode.py --device cuda once per name in that order (alternate them: the
#                  device has intermittent slowdowns); SHAPES passed through
#   NCU=NAME:FMT   ncu of bench/profile_decode.py 8x8192 FMT: speed of light, occupancy, scheduler
#                  and warp-state statistics (stall reasons) with their details
#   TIMES="a b .." per name: CUDA-event vs host time per call (profile_decode.py, each of
#                  ${TIME_SHAPES:-8x8192 64x1024 1x131072}, formats ${FORMATS:-bf16,8,4}), then the decode and
#                  merge kernels' own durations under ncu (clocks left alone; ${NCU_FORMATS:-bf16 8 4})
#   SASS=NAME:FMT  per-instruction executed counts of the decode kernel (ncu source page, SASS, CSV;
#                  read it here with tools/sass_regions.py)
#   PROFILE_SHAPE  the B x S_cache that NCU and SASS profile (default 8x8192)
#   CPU_PROBE="a b .."  the host CPU: dist/NAME/decode_probe (a build of native/flash-core/examples/
#                  decode_probe carried in dist/NAME, no wheel needed) per name in that order, each of
#                  ${CPU_FORMATS:-bf16 8/64 4/64} at ${CPU_THREADS:-16} threads, B = 4, S = 65536, best of 5;
#                  ${CPU_ROUNDS:-3} rounds
#   CPU_PERF=NAME:FMT  perf record of dist/NAME/decode_probe FMT (CPU_THREADS threads), where the host
#                  has perf: the report's top symbols, and the hottest instructions of the decode task
#                  (perf_hot.txt: percent of that symbol's samples, address, instruction)
# The f32 attention kernels (issue 17), same conventions:
#   TF32="a b .."  bench/tf32.py --only exact,tf32,eff per name in that order (TF32_PASSES, default
#                  bwd; TF32_SEQS, default 2048; TF32_DIMS, default 64,128)
#   PROF="a b .."  bench/profile_bwd_f32.py per name: each backward kernel's time, for each of
#                  ${PROF_CASES:-"D=64" "D=64 causal" "D=128 causal"} (semicolon-separated)
#   NCU_BWD=NAME:KERNEL:ARGS  ncu source counters (SASS, CSV) of one backward kernel (flash_bwd_sm90,
#                  flash_bwd_dq_sm90) under profile_bwd_f32.py ARGS (e.g. "S=2048 D=128 causal tf32");
#                  read it here with bench/ncu_stalls.py FILE --roles
set -u
: "${OUT:?run on the device machine, where OUT is set}"
export FLASH_NIF_CACHE_DIR=/tmp/flash_nif_cache
for w in dist/*/; do
    n=$(basename "$w")
    compgen -G "$w*.whl" > /dev/null || continue  # a folder of other builds (CPU_PROBE)
    rm -rf "/tmp/site_$n"
    python3 -m pip install -q --no-deps --no-index --target "/tmp/site_$n" "$w"/*.whl
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"

if [ -n "${TEST:-}" ]; then
    PYTHONPATH="/tmp/site_$TEST" timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        ${TEST_FILES:-tests/test_decode_gpu.py} ${TESTK:+-k "$TESTK"} > "$OUT/test_$TEST.log" 2>&1
    echo "rc $?" >> "$OUT/test_$TEST.log"
    echo "== test $TEST"; tail -4 "$OUT/test_$TEST.log"
fi

i=0
for b in ${BENCH:-}; do
    i=$((i + 1))
    (cd bench && PYTHONPATH="/tmp/site_$b" timeout 240 python3 decode.py --device cuda \
        --shapes "${SHAPES:-8x8192,64x1024,1x131072}" > "$OUT/bench_${i}_$b.log" 2>&1)
    echo "== bench $i $b"; grep -E "^\| [0-9]" "$OUT/bench_${i}_$b.log"
done

if [ -n "${NCU:-}" ]; then
    w=${NCU%%:*} f=${NCU##*:}
    (cd bench && PYTHONPATH="/tmp/site_$w" timeout 300 ncu --kernel-name regex:flash_decode --launch-skip 2 \
        --launch-count 1 --section SpeedOfLight --section Occupancy --section SchedulerStats \
        --section WarpStateStats --print-details all python3 profile_decode.py "${PROFILE_SHAPE:-8x8192}" "$f" > "$OUT/ncu_$w.txt" 2>&1)
    echo "== ncu $w $f"; grep -E "Duration|DRAM Throughput|Issued Warp|Eligible Warps|Active Warps Per|Stall|Registers Per" "$OUT/ncu_$w.txt"
fi

for n in ${TIMES:-}; do
    for shape in ${TIME_SHAPES:-8x8192 64x1024 1x131072}; do
        echo "== times $n $shape"
        (cd bench && PYTHONPATH="/tmp/site_$n" python3 profile_decode.py "$shape" "${FORMATS:-bf16,8,4}") 2>&1 | grep "per call"
    done
    for f in ${NCU_FORMATS:-bf16 8 4}; do
        echo "== kernel times $n $f"
        (cd bench && PYTHONPATH="/tmp/site_$n" timeout 200 ncu --clock-control none --kernel-name regex:"flash_decode|flash_merge" \
            --launch-count 16 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
            python3 profile_decode.py 8x8192 "$f" > "$OUT/ncu_times_${n}_$f.txt" 2>&1)
        grep -E "^  flash_|gpu__time_duration|dram__throughput" "$OUT/ncu_times_${n}_$f.txt" | awk '{print $1, $(NF)}' | paste - - - | tail -4
    done
done

if [ -n "${CPU_PROBE:-}" ]; then
    for r in $(seq "${CPU_ROUNDS:-3}"); do
        for n in $CPU_PROBE; do
            for f in ${CPU_FORMATS:-bf16 8/64 4/64}; do
                echo "== cpu $r $n $(RAYON_NUM_THREADS=${CPU_THREADS:-16} timeout 120 "dist/$n/decode_probe" "$f" 4 65536 5 2>&1 | tail -1)"
            done
        done
    done | tee "$OUT/cpu_probe.log"
fi

if [ -n "${CPU_PERF:-}" ]; then
    n=${CPU_PERF%%:*} f=${CPU_PERF#*:}
    if command -v perf > /dev/null; then
        # 30 calls, so that the decode outweighs the probe's set-up (random caches, quantization).
        RAYON_NUM_THREADS=${CPU_THREADS:-16} timeout 300 perf record -q -o "$OUT/perf.data" "dist/$n/decode_probe" "$f" 4 65536 30 > /dev/null 2>&1
        perf report -i "$OUT/perf.data" --no-children --sort symbol --stdio 2> /dev/null | grep -v "^#" | grep -v "^$" | head -30 > "$OUT/perf_report.txt"
        sym=$(grep -o "flash_core::cpu::decode::[a-z0-9_]*" "$OUT/perf_report.txt" | head -1)
        perf annotate -i "$OUT/perf.data" --stdio -s "$sym" 2> /dev/null | grep -E "^\s+[0-9]+\.[0-9]+ :" | sort -rn | head -80 > "$OUT/perf_hot.txt"
        rm -f "$OUT/perf.data"
        echo "== cpu perf $n $f"; head -12 "$OUT/perf_report.txt"
    else
        echo "== cpu perf: no perf on this host"
    fi
fi

if [ -n "${SASS:-}" ]; then
    w=${SASS%%:*} f=${SASS##*:}
    (cd bench && PYTHONPATH="/tmp/site_$w" timeout 300 ncu --clock-control none --kernel-name regex:flash_decode --launch-skip 2 \
        --launch-count 1 --section SourceCounters --page source --print-source sass --csv \
        python3 profile_decode.py "${PROFILE_SHAPE:-8x8192}" "$f" > "$OUT/sass_counts_${w}_$f.csv" 2>&1)
    echo "== sass counts $w $f: $(wc -l < "$OUT/sass_counts_${w}_$f.csv") lines"
fi

i=0
for b in ${TF32:-}; do
    i=$((i + 1))
    PYTHONPATH="/tmp/site_$b" timeout 240 python3 bench/tf32.py --only exact,tf32,eff --passes "${TF32_PASSES:-bwd}" \
        --seqs "${TF32_SEQS:-2048}" --dims "${TF32_DIMS:-64,128}" --reps 5 > "$OUT/tf32_${i}_$b.log" 2>&1
    echo "== tf32 $i $b"; grep -E "^\| [0-9]" "$OUT/tf32_${i}_$b.log" | sort -u
done

for n in ${PROF:-}; do
    IFS=';' read -ra cases <<< "${PROF_CASES:-D=64;D=64 causal;D=128 causal}"
    for c in "${cases[@]}"; do
        echo "== prof $n $c"
        # shellcheck disable=SC2086
        PYTHONPATH="/tmp/site_$n" timeout 120 python3 bench/profile_bwd_f32.py S=2048 $c 2>&1 | grep -E " us|TFLOPS"
    done
done

if [ -n "${NCU_BWD:-}" ]; then
    IFS=':' read -r w k args <<< "$NCU_BWD"
    # shellcheck disable=SC2086
    PYTHONPATH="/tmp/site_$w" timeout 300 ncu --kernel-name "$k" --launch-skip 2 --launch-count 1 --section SourceCounters \
        --page source --print-source sass --csv python3 bench/profile_bwd_f32.py $args noprof > "$OUT/ncu_${w}_$k.csv" 2>&1
    gzip -f "$OUT/ncu_${w}_$k.csv"
    echo "== ncu $w $k ($args): $OUT/ncu_${w}_$k.csv.gz"
fi
