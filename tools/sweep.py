"""Tile sweep through the real launcher (development tool; needs a CUDA GPU and torch).

For each candidate (block_m, block_n, num_warps, d_split, min_blocks) of one kernel, dtype and
head dim, the launcher is told to use those tiles (``_native.cuda_set_tile_override``) and the
call that runs the kernel is timed on torch CUDA tensors, B*S = 16384, H*D = 2048, S = 4096: the
forward for ``fwd``; the deterministic backward (preprocess, dQ, dK/dV) for ``bwd_dq`` and
``bwd_dkdv``; the default atomic-dQ backward for ``bwd_dkdv_dq``. Each time is the median of 10
after 3 warm-ups; the error is against the same call with the launcher's own tiles. For the
forward, d_split is M_TILES (16-row tiles per warp). Candidates the kernel rejects (its static
asserts) or that do not fit the GPU's shared memory are reported and skipped.

On the GPU machine, from a checkout with the extension built (``make build``):
    .venv/bin/python tools/sweep.py                    # the bf16 table below
    .venv/bin/python tools/sweep.py fwd,bwd_dkdv_dq     # some kernels only
tools/sweep_f32.py does the same for the fp32 kernels. bench/RESULTS.md has past results.
"""

from __future__ import annotations

import functools
import pathlib
import sys

import torch

import flash_nif
from flash_nif import _native

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
from gpu import timed  # noqa: E402 - bench/gpu.py's CUDA-event median

# (kernel, dtype, head dim) -> candidate tiles (block_m, block_n, num_warps[, d_split[, min_blocks]])
CANDIDATES = {
    ("fwd", "bf16", 64): [(128, 64, 8), (128, 64, 8, 1, 2), (128, 128, 8), (64, 64, 4), (128, 64, 4, 2)],
    ("fwd", "bf16", 128): [(128, 64, 8), (128, 32, 8), (128, 32, 4, 2), (64, 64, 4), (64, 64, 4, 1, 2)],
    ("bwd_dq", "bf16", 64): [(64, 64, 4), (64, 64, 4, 1, 2), (128, 64, 8), (64, 128, 4), (128, 32, 8)],
    ("bwd_dq", "bf16", 128): [(64, 64, 4), (64, 64, 4, 1, 2), (128, 64, 8), (64, 32, 4), (128, 32, 8)],
    ("bwd_dkdv", "bf16", 64): [(128, 64, 4), (96, 64, 4), (64, 64, 4), (64, 128, 8), (32, 128, 8)],
    ("bwd_dkdv", "bf16", 128): [(32, 128, 8), (64, 128, 8), (32, 64, 4), (64, 64, 4), (16, 128, 8)],
    ("bwd_dkdv_dq", "bf16", 64): [(96, 128, 8), (64, 128, 8), (96, 64, 4)],
    ("bwd_dkdv_dq", "bf16", 128): [(64, 128, 8), (32, 128, 8), (64, 64, 4)],
}

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
# Tile GEMMs of the timed call relative to the forward's 2 (for TFLOPS-equivalent numbers).
WORK = {"fwd": 1.0, "bwd_dq": 3.5, "bwd_dkdv": 3.5, "bwd_dkdv_dq": 2.5}


def rel_err(got, want) -> float:
    got, want = got.double(), want.double()
    if torch.isnan(got).any():
        return float("nan")
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def call(kernel, q, k, v, do, o, lse, causal):
    """The public call that runs `kernel` (o, lse: the forward's, for the backward); its outputs."""
    if kernel == "fwd":
        return flash_nif.forward_with_states(q, k, v, causal=causal)
    return flash_nif.backward(do, q, k, v, o, lse, causal=causal, deterministic=kernel != "bwd_dkdv_dq")


def sweep(candidates, kernels=None, s_len=4096):
    for (kernel, dtype, d), cands in candidates.items():
        if kernels and kernel not in kernels:
            continue
        b, h = 16384 // s_len, 2048 // d
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, s_len, h, d, device="cuda", dtype=TORCH_DTYPES[dtype]) for _ in range(4))
        for causal in (False, True):
            o, lse = flash_nif.forward_with_states(q, k, v, causal=causal)
            run = functools.partial(call, kernel, q, k, v, do, o, lse, causal)
            want = run()  # the launcher's own tiles
            flops = 4 * b * h * s_len * s_len * d / (2 if causal else 1) * WORK[kernel]
            for c in cands:
                tiles = (tuple(c) + (1, 1))[:5]
                label = f"{kernel:11s} {dtype} d={d:3d} causal={int(causal)} tiles={tiles}"
                _native.cuda_set_tile_override(kernel, dtype, d, tiles)
                try:
                    got = run()
                    ms = timed(run, warmup=3, reps=10)
                except flash_nif.FlashAttentionError as e:
                    print(f"{label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                finally:
                    _native.cuda_set_tile_override(kernel, dtype, d, None)
                err = max(rel_err(g, w) for g, w in zip(got, want))
                print(f"{label}: {ms:8.3f} ms {flops / ms / 1e9:6.0f} TF-equiv  err={err:.1e}", flush=True)


if __name__ == "__main__":
    sweep(CANDIDATES, sys.argv[1].split(",") if len(sys.argv) > 1 else None)
