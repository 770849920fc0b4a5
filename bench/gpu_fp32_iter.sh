#!/bin/bash
# One device call of the fp32 work: install the wheel, GPU tests (f32 subset), bench (f32), kernel sweep.
# Usage (repo root of /work/main on the device): bash .fp32/bench/gpu_fp32_iter.sh [sweep kernels]
rm -rf /tmp/site_fp32; pip install -q --no-deps --no-index --upgrade --target /tmp/site_fp32 dist_fp32/*.whl || exit 1
export PYTHONPATH=/tmp/site_fp32 PYTHONUNBUFFERED=1
cd .fp32
python -c 'import flash_nif, sys; print(flash_nif.__file__)'
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader | tee $OUT/gpu.txt
timeout 240 python -m pytest -q -m gpu tests/test_gpu.py -k "(f32 or small_suite or custom_scale or every_output or variant_table) and not bf16 and not f16" > $OUT/t.log 2>&1
tail -22 $OUT/t.log
timeout 200 python bench/gpu.py --dtypes f32 --reps 10 2>&1 | tee $OUT/b.log
if [ -n "$1" ]; then timeout 100 python cuda/sweep_f32.py "$1" 2>&1 | tee $OUT/s.log; fi
if [ -n "$RACECHECK" ]; then
  timeout 100 compute-sanitizer --tool racecheck --print-limit 5 python -m pytest -q -m gpu tests/test_gpu.py -k "small_suite and f32" > $OUT/race.log 2>&1
  tail -6 $OUT/race.log
fi
