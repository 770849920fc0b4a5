"""Forward-only sweep with M_TILES (16-row tiles per warp): correctness on ragged shapes against
the float64 oracle, then kernel time on B*S = 16384, H*D = 2048 (development tool)."""

from __future__ import annotations

import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_cupy as C  # noqa: E402
from sweep import time_launch  # noqa: E402

K = C.K


def make(dt, d, causal, bm, bn, nw, mt, minb=1, group=1):
    defines = [("FLASH_DTYPE", K.DTYPES[dt]), ("HEAD_DIM", d), ("NUM_WARPS", nw), ("IS_CAUSAL", int(causal)),
               ("GQA_GROUP", group), ("BLOCK_M", bm), ("BLOCK_N", bn), ("EVEN_M", 0), ("EVEN_N", 0),
               ("MIN_BLOCKS", minb), ("M_TILES", mt)]
    return K.Variant("fwd", dt, d, "fwd.cu", bm, bn, nw, 1, tuple(defines))


def run(v, q, k, v_, causal, scale):
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    o = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    prm = C.Params(C.ptr(q), C.ptr(k), C.ptr(v_), C.ptr(o), C.ptr(lse), 0, 0, 0, 0, 0, 0,
                   b, sq, sk, h, hkv, scale, scale * math.log2(math.e), 0)
    keep = C.launch(v, (-(-sq // v.block_m), h, b), prm)
    return o, lse, keep, prm


CANDS = {64: [(128, 64, 8, 1, 2), (128, 64, 4, 2, 1), (64, 64, 4, 1, 1)],
         128: [(64, 64, 4, 1, 1), (128, 32, 4, 2, 1), (128, 64, 8, 1, 1)]}

for d, cands in CANDS.items():
    for bm, bn, nw, mt, minb in cands:
        bad = 0
        for causal in (False, True):
            for (b, sq, sk, h, hkv) in ((2, 97, 97, 4, 2), (1, 1000, 97, 2, 2), (1, 1, 1000, 4, 1), (1, 300, 700, 2, 1)):
                q = torch.randn(b, sq, h, d, device="cuda").bfloat16()
                k = torch.randn(b, sk, hkv, d, device="cuda").bfloat16()
                vv = torch.randn(b, sk, hkv, d, device="cuda").bfloat16()
                v = make("bf16", d, causal, bm, bn, nw, mt, minb, h // hkv)
                o, lse, *_ = run(v, q, k, vv, causal, 1 / math.sqrt(d))
                torch.cuda.synchronize()
                ro, rlse, *_ = C.reference(q, k, vv, torch.zeros_like(q), causal, 1 / math.sqrt(d))
                e, el = C.rel_err(o, ro), C.rel_err(lse, rlse)
                base = C.rel_err(ro.bfloat16(), ro)
                if not (e <= 2 * base + 1e-5 and el <= 1e-5):
                    bad += 1
                    print(f"  FAIL d={d} {bm},{bn},{nw},mt{mt} causal={causal} shape={(b, sq, sk, h, hkv)} o={e:.2e} lse={el:.2e}")
        res = []
        for causal in (False, True):
            s_len = 4096
            b, h = 16384 // s_len, 2048 // d
            q, k, vv = (torch.randn(b, s_len, h, d, device="cuda").bfloat16() for _ in range(3))
            v = make("bf16", d, causal, bm, bn, nw, mt, minb)
            _, _, keep, prm = run(v, q, k, vv, causal, 1 / math.sqrt(d))
            ms = time_launch(lambda: C.launch(v, (-(-s_len // bm), h, b), prm))
            flops = 4 * b * h * s_len * s_len * d / (2 if causal else 1)
            res.append(flops / ms / 1e9)
        print(f"d={d} bm={bm} bn={bn} w={nw} mt={mt} minb={minb}: {'ok' if not bad else 'FAILED'}  "
              f"TFLOPS full {res[0]:.0f} causal {res[1]:.0f}", flush=True)
