"""The f32 backward's kernels one by one (development tool): bench/tf32.py's shape (B * S = 16384
tokens, H * D = 2048), torch.profiler's CUDA time per kernel, per precision:

    python bench/profile_bwd_f32.py [S=2048] [D=64] [causal] [exact,tf32]

Run under ncu for one kernel's stalls (then bench/ncu_stalls.py):

    ncu --kernel-name flash_bwd_dq_sm90 --launch-skip 2 --launch-count 1 --section SourceCounters \\
        --page source --print-source sass --csv python bench/profile_bwd_f32.py noprof > prof.csv
"""

import sys
from collections import defaultdict

import torch

import flash_nif

args = sys.argv[1:]
s = next((int(a[2:]) for a in args if a.startswith("S=")), 2048)
d = next((int(a[2:]) for a in args if a.startswith("D=")), 64)
causal = "causal" in args
precisions = next((a.split(",") for a in args if a.split(",")[0] in ("exact", "tf32")), ["exact", "tf32"])
b, h = 16384 // s, 2048 // d
q, k, v, do = (torch.randn(b, s, h, d, device="cuda") for _ in range(4))
flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)

for precision in precisions:
    o, lse = flash_nif.forward_with_states(q, k, v, causal=causal, precision=precision)

    def run():
        return flash_nif.backward(do, q, k, v, o, lse, causal=causal, precision=precision)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    if "noprof" in args:
        continue
    n = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            run()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] += e.device_time_total / n  # us per call
    total = sum(per_kernel.values())
    print(f"{precision} (S = {s}, D = {d}, causal = {causal}): {total:.0f} us per backward, "
          f"{flops / total / 1e6:.1f} TFLOPS")
    for name, us in sorted(per_kernel.items(), key=lambda x: -x[1]):
        print(f"  {us:8.1f} us  {100 * us / total:4.1f} %  {name[:60]}")
