"""Tile-size sweep for one kernel at a time (CuPy harness, development tool).

For each candidate (block_m, block_n, warps, d_split, min_blocks) of fwd / bwd_dq / bwd_dkdv it
checks the result against the default variant's (rel. error) and times the kernel alone (CUDA
events, median of 10 after 3 warm-ups) on B*S = 16384, H*D = 2048. Usage:
    python3 cuda/sweep.py
"""

from __future__ import annotations

import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_cupy as C  # noqa: E402

K = C.K


def make(kernel, dt, d, causal, bm, bn, nw, ds=1, minb=1):
    defines = [("FLASH_DTYPE", K.DTYPES[dt]), ("HEAD_DIM", d), ("NUM_WARPS", nw), ("IS_CAUSAL", int(causal)),
               ("GQA_GROUP", 1), ("BLOCK_M", bm), ("BLOCK_N", bn), ("EVEN_M", 0), ("EVEN_N", 0)]
    if kernel == "bwd_dkdv" and dt != "f32":
        defines.append(("D_SPLIT", ds))
    defines.append(("MIN_BLOCKS", minb))
    if kernel == "fwd" and dt != "f32":
        defines.append(("M_TILES", 1))
    return K.Variant(kernel, dt, d, K.source_file(kernel, dt, d), bm, bn, nw, ds, tuple(defines))


def time_launch(fn, reps=10, warm=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


CANDIDATES = {
    ("bf16", 64): {
        "fwd": [(128, 64, 8), (128, 64, 8, 1, 2), (128, 128, 8), (64, 64, 4), (64, 64, 4, 1, 2), (64, 128, 4)],
        "bwd_dq": [(64, 64, 4), (64, 64, 4, 1, 2), (128, 64, 8), (64, 128, 4), (128, 32, 8)],
        "bwd_dkdv": [(64, 128, 8), (32, 128, 8), (64, 64, 4), (64, 64, 4, 1, 2), (128, 128, 8), (128, 64, 4)],
    },
    ("bf16", 128): {
        "fwd": [(128, 64, 8), (128, 64, 8, 1, 2), (128, 32, 8), (128, 32, 8, 1, 2), (64, 64, 4), (64, 64, 4, 1, 2),
                (128, 128, 8)],
        "bwd_dq": [(64, 64, 4), (64, 64, 4, 1, 2), (128, 64, 8), (64, 32, 4), (128, 32, 8)],
        "bwd_dkdv": [(32, 128, 8), (64, 128, 8), (32, 64, 4), (32, 64, 4, 1, 2), (64, 64, 4), (16, 128, 8)],
    },
    ("f32", 64): {
        "fwd": [(64, 64, 8), (128, 64, 8), (64, 128, 8), (32, 64, 8)],
        "bwd_dq": [(64, 64, 8), (128, 64, 8), (64, 32, 8), (32, 64, 8)],
        "bwd_dkdv": [(64, 64, 8), (64, 128, 8), (32, 64, 8), (128, 64, 8)],
    },
    ("f32", 128): {
        "fwd": [(64, 32, 8), (64, 64, 8), (128, 32, 8), (32, 32, 8)],
        "bwd_dq": [(32, 32, 8), (64, 32, 8), (64, 64, 8), (32, 64, 8)],
        "bwd_dkdv": [(32, 32, 8), (32, 64, 8), (64, 32, 8), (64, 64, 8)],
    },
}


def main():
    s_len = 4096
    cands = CANDIDATES
    if len(sys.argv) > 1 and sys.argv[1] == "dkdv64":  # the D <= 64 dK/dV choice (register edge)
        cands = {("bf16", 64): {"bwd_dkdv": [(128, 64, 4), (96, 64, 4), (64, 64, 4)]}}
    for (dt, d), per_kernel in cands.items():
        for causal in (False, True):
            b, h = 16384 // s_len, 2048 // d
            tdt = C.T_DT[dt]
            q, k, v, do = (torch.randn(b, s_len, h, d, device="cuda").to(tdt) for _ in range(4))
            scale = 1 / math.sqrt(d)
            o, lse, dq, dk, dv = C.run_ours(dt, q, k, v, do, causal, scale)
            delta = torch.empty(b, h, s_len, device="cuda")
            l2 = torch.empty_like(delta)
            flops = 4 * b * h * s_len * s_len * d / (2 if causal else 1)
            for kernel, cands in per_kernel.items():
                ref_out = {"fwd": o, "bwd_dq": dq, "bwd_dkdv": dk}[kernel]
                for c in cands:
                    bm, bn, nw = c[:3]
                    ds = c[3] if len(c) > 3 else 1
                    minb = c[4] if len(c) > 4 else 1
                    v_ = make(kernel, dt, d, causal, bm, bn, nw, ds, minb)
                    if v_.smem_bytes() > 227 * 1024:
                        continue
                    out = torch.full_like(ref_out, float("nan"))
                    o2 = torch.full_like(o, float("nan"))
                    lse2 = torch.full_like(lse, float("nan"))
                    if kernel == "fwd":
                        prm = C.Params(C.ptr(q), C.ptr(k), C.ptr(v), C.ptr(out), C.ptr(lse2), 0, 0, 0, 0, 0, 0,
                                       b, s_len, s_len, h, h, scale, scale * math.log2(math.e), 0)
                        grid = (-(-s_len // bm), h, b)
                    else:
                        dq2 = out if kernel == "bwd_dq" else torch.empty_like(dq)
                        dk2 = out if kernel == "bwd_dkdv" else torch.empty_like(dk)
                        prm = C.Params(C.ptr(q), C.ptr(k), C.ptr(v), C.ptr(o), C.ptr(lse), C.ptr(do), C.ptr(dq2),
                                       C.ptr(dk2), C.ptr(torch.empty_like(dv)), C.ptr(delta), C.ptr(l2),
                                       b, s_len, s_len, h, h, scale, scale * math.log2(math.e), 0)
                        C.launch(K.variant("bwd_preprocess", dt, d), (-(-(b * s_len * h) // 8), 1, 1), prm)
                        grid = (-(-s_len // bm), h, b) if kernel == "bwd_dq" else (-(-s_len // bn), h, b)
                    try:
                        ms = time_launch(lambda: C.launch(v_, grid, prm))
                    except Exception as e:  # noqa: BLE001
                        print(f"{dt} d={d} causal={int(causal)} {kernel:8s} {c}: {type(e).__name__} {e}")
                        continue
                    torch.cuda.synchronize()
                    err = C.rel_err(out.double(), ref_out.double())
                    work = flops * {"fwd": 1.0, "bwd_dq": 1.5, "bwd_dkdv": 2.0}[kernel]
                    print(f"{dt} d={d} causal={int(causal)} {kernel:8s} bm={bm:3d} bn={bn:3d} w={nw} ds={ds} "
                          f"minb={minb}: {ms:7.3f} ms  {work / ms / 1e9:6.0f} TF-equiv  err={err:.1e}", flush=True)


if __name__ == "__main__":
    main()
