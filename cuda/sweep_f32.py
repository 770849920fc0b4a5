"""fp32 SIMT kernels alone (CuPy harness, development tool): for candidate tiles / MIN_BLOCKS of
fwd, bwd_dq and bwd_dkdv (ATOMIC_DQ=0) at D 64 and 128, the error against the default variant and
the kernel time (median of 10 after 3 warm-ups) on B*S = 16384, H*D = 2048, S = 4096.
Usage: python3 cuda/sweep_f32.py [fwd,bwd_dq,bwd_dkdv]"""

from __future__ import annotations

import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_cupy as C  # noqa: E402
from sweep import time_launch  # noqa: E402

K = C.K


def make(kernel, d, causal, bm, bn, minb=1, ud=4, ur=2):
    defines = [("FLASH_DTYPE", 2), ("HEAD_DIM", d), ("NUM_WARPS", 8), ("IS_CAUSAL", int(causal)),
               ("GQA_GROUP", 1), ("BLOCK_M", bm), ("BLOCK_N", bn), ("EVEN_M", 0), ("EVEN_N", 0), ("MIN_BLOCKS", minb),
               ("SIMT_UNROLL_D", ud), ("SIMT_UNROLL_R", ur)]
    if kernel == "bwd_dkdv_dq":
        defines.append(("ATOMIC_DQ", 1))
    return K.Variant(kernel, "f32", d, K.source_file(kernel, "f32", d), bm, bn, 8, 1, tuple(defines))


# (block_m, block_n, min_blocks, unroll of mm_rows' D loop, unroll of mm_pv's row loop)
CANDS = {
    ("fwd", 64): [(128, 128, 1, 4, 2), (128, 128, 1, 8, 2), (128, 128, 1, 2, 1), (128, 64, 1, 4, 2)],
    ("fwd", 128): [(128, 64, 1, 4, 2), (128, 64, 1, 8, 2), (128, 64, 1, 2, 1), (128, 64, 1, 32, 16), (128, 64, 1, 4, 4)],
    ("bwd_dq", 64): [(128, 64, 1, 4, 2), (128, 64, 1, 8, 4)],
    ("bwd_dq", 128): [(64, 64, 1, 4, 2), (64, 64, 1, 8, 4), (64, 64, 1, 2, 1)],
    ("bwd_dkdv", 64): [(64, 128, 1, 4, 2)],
    ("bwd_dkdv", 128): [(64, 64, 1, 4, 2)],
    ("bwd_dkdv_dq", 64): [(64, 128, 1, 4, 2), (64, 128, 1, 8, 4), (64, 128, 1, 2, 1)],
    ("bwd_dkdv_dq", 128): [(64, 64, 1, 4, 2), (64, 64, 1, 8, 4), (64, 64, 1, 2, 1), (64, 64, 1, 16, 16)],
}

kernels = sys.argv[1].split(",") if len(sys.argv) > 1 else ["fwd", "bwd_dq", "bwd_dkdv", "bwd_dkdv_dq"]
s_len = 4096
for (kernel, d), cands in CANDS.items():
    if kernel not in kernels:
        continue
    b, h = 16384 // s_len, 2048 // d
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, s_len, h, d, device="cuda") for _ in range(4))
    scale = 1 / math.sqrt(d)
    for causal in (False, True):
        o, lse = C.run_ours("f32", q, k, v, do, causal, scale, want_bwd=False)
        delta = (o * do).sum(-1).permute(0, 2, 1).contiguous()
        l2 = (lse * math.log2(math.e)).contiguous()
        # fwd: 2 products of the 5-product backward's 2.5x; dq / dkdv alone: 3 / 4 products (1.5x, 2x),
        # dkdv with the atomic dQ: all 5 (2.5x)
        flops = 4 * b * h * s_len * s_len * d / (2 if causal else 1) * {"fwd": 1, "bwd_dq": 1.5, "bwd_dkdv": 2,
                                                                         "bwd_dkdv_dq": 2.5}[kernel]
        ref = None
        for bm, bn, minb, ud, ur in cands:
            var = make(kernel, d, causal, bm, bn, minb, ud, ur)
            outs = [torch.full_like(x, float("nan")) for x in ((q,) if kernel == "fwd" else (q, k, v))]
            if kernel == "fwd":
                l_out = torch.full_like(lse, float("nan"))
                p = C.Params(C.ptr(q), C.ptr(k), C.ptr(v), C.ptr(outs[0]), C.ptr(l_out), 0, 0, 0, 0, 0, 0,
                             b, s_len, s_len, h, h, scale, scale * math.log2(math.e), 0)
                grid = (-(-s_len // bm), h, b)
            else:
                acc = torch.zeros_like(q)
                p = C.Params(C.ptr(q), C.ptr(k), C.ptr(v), C.ptr(o), C.ptr(lse), C.ptr(do), C.ptr(outs[0]),
                             C.ptr(outs[1]), C.ptr(outs[2]), C.ptr(delta), C.ptr(l2),
                             b, s_len, s_len, h, h, scale, scale * math.log2(math.e), 0, dq_accum=C.ptr(acc))
                grid = (-(-s_len // bm), h, b) if kernel == "bwd_dq" else (-(-s_len // bn), h, b)
            try:
                t = time_launch(lambda: C.launch(var, grid, p))
            except Exception as e:  # noqa: BLE001
                print(f"{kernel} d={d} causal={causal} {bm}x{bn} mb{minb} u{ud},{ur}: {type(e).__name__} {str(e)[:80]}")
                continue
            torch.cuda.synchronize()
            got = outs[0] if kernel in ("fwd", "bwd_dq") else torch.cat([outs[1], outs[2]])
            if ref is None:
                ref = got.clone()
            err = C.rel_err(got, ref)
            print(f"{kernel:8s} d={d:3d} causal={int(causal)} {bm:3d}x{bn:3d} mb{minb} u{ud},{ur}: {t:7.3f} ms "
                  f"{flops / t / 1e9:6.1f} TF  err_vs_first {err:.1e}  nan={bool(torch.isnan(got).any())}", flush=True)
