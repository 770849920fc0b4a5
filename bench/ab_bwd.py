"""A/B of the backward alone (development tool): flash_nif.backward on precomputed o, lse, `calls`
back-to-back calls per timing, variants interleaved over rounds; env var VAR set per variant.

    python bench/ab_bwd.py VAR v1,v2,... [--dims 64,128] [--causal 0,1] [--seqs 2048,8192]
"""

import argparse
import os
import statistics

import torch

import flash_nif

ap = argparse.ArgumentParser()
ap.add_argument("var")
ap.add_argument("values")
ap.add_argument("--dims", default="64,128")
ap.add_argument("--causal", default="1")
ap.add_argument("--seqs", default="2048,8192")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--calls", type=int, default=10)
ap.add_argument("--deterministic", action="store_true")
a = ap.parse_args()
values = a.values.split(",")
for d in map(int, a.dims.split(",")):
    for s in map(int, a.seqs.split(",")):
        for causal in map(int, a.causal.split(",")):
            b, h = 16384 // s, 2048 // d
            q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            o, lse = flash_nif.forward_with_states(q, k, v, causal=bool(causal))
            flops = 2.5 * 4 * b * s * s * h * d / (2 if causal else 1)
            times = {x: [] for x in values}
            for _ in range(a.rounds):
                for x in values:
                    os.environ[a.var] = x
                    call = lambda: flash_nif.backward(do, q, k, v, o, lse, causal=bool(causal), deterministic=a.deterministic)
                    call()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(a.calls):
                        call()
                    e1.record()
                    e1.synchronize()
                    times[x].append(e0.elapsed_time(e1) / a.calls)
            row = " ".join(f"{x}: {flops / statistics.median(t) / 1e9:6.1f}" for x, t in times.items())
            print(f"D={d} S={s} causal={causal} det={int(a.deterministic)}  TFLOPS {row}", flush=True)
