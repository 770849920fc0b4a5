"""Decode at Hkv = 8, H = 32, D = 128, Sq = 1, bf16 q over a B x S_cache cache (default 8 x 8192)
in each format, run a few times for a profiler (development tool):

    ncu --kernel-name regex:flash_decode --launch-skip 2 --launch-count 3 --section SpeedOfLight \\
        --section WarpStateStats python bench/profile_decode.py [8x8192] [bf16,8,4] [splits=N]

With `plan`, one call per shape (comma separated: 8x8192,36x1820) and format, nothing timed: run under
`FLASH_NIF_LOG=1` to read each call's plan (kernel, grid, splits, merge, blocks an SM) on stderr.

Also prints the wall time per call next to the CUDA-event time of the same calls (the host's share);
`cprofile` adds the host's profile of those calls.
"""

import sys
import time

import torch

import flash_nif

args = sys.argv[1:]
shape = next((a for a in args if "x" in a), "8x8192")
formats = next((a for a in args if "x" not in a and ("," in a or a in ("bf16", "8", "4"))), "bf16,8,4").split(",")
splits = next((int(a.split("=")[1]) for a in args if a.startswith("splits=")), None)
if "plan" in args:
    for sh in shape.split(","):
        b, s = (int(x) for x in sh.split("x"))
        q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, s, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for name in formats:
            kc, vc = (k, v) if name == "bf16" else (flash_nif.quantize_kv(x, bits=int(name), group_size=64) for x in (k, v))
            print(f"{sh} {name}:", file=sys.stderr, flush=True)
            flash_nif.decode(q, kc, vc, num_splits=splits)
            torch.cuda.synchronize()
    sys.exit(0)
b, s = (int(x) for x in shape.split("x"))
q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(b, s, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for name in formats:
    kc, vc = (k, v) if name == "bf16" else (flash_nif.quantize_kv(x, bits=int(name), group_size=64) for x in (k, v))
    for _ in range(4):
        flash_nif.decode(q, kc, vc, num_splits=splits)
    torch.cuda.synchronize()
    n = 50
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e0.record()
    for _ in range(n):
        flash_nif.decode(q, kc, vc, num_splits=splits)
    e1.record()
    t_host = (time.perf_counter() - t0) / n
    e1.synchronize()
    print(f"{name}: {e0.elapsed_time(e1) / n * 1e3:.1f} us per call (events), host returns after {t_host * 1e6:.1f} us")
    if "cprofile" in args:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            flash_nif.decode(q, kc, vc, num_splits=splits)
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
