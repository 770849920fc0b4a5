"""Tile sweep of the fp32 kernels through the real launcher (development tool; GPU and torch).

tools/sweep.py's method (tiles forced with ``_native.cuda_set_tile_override``, the public call
timed, error against the launcher's own tiles) on the fp32 SIMT kernels (D 64, 128) and a generic
one (D 96). All fp32 kernels run 8 warps; d_split is unused. The SIMT unroll knobs are defaults
in cuda/simt_f32.h (SIMT_UNROLL_D, SIMT_UNROLL_R): edit them there to sweep them.

On the GPU machine, from a checkout with the extension built (``make build``):
    .venv/bin/python tools/sweep_f32.py                  # every kernel below
    .venv/bin/python tools/sweep_f32.py fwd,bwd_dq        # some kernels only
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ["FLASH_NIF_TF32"] = "0"  # the SIMT kernels: precision="exact" would run split TF32 (tools/sweep_tf32.py)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sweep import sweep  # noqa: E402

# (kernel, dtype, head dim) -> candidate (block_m, block_n, num_warps[, d_split[, min_blocks]])
CANDIDATES = {
    ("fwd", "f32", 64): [(128, 128, 8), (128, 64, 8), (64, 64, 8), (64, 128, 8)],
    ("fwd", "f32", 128): [(128, 64, 8), (64, 64, 8), (64, 32, 8), (128, 64, 8, 1, 2)],
    ("fwd", "f32", 96): [(64, 64, 8), (64, 32, 8), (32, 32, 8)],
    ("bwd_dq", "f32", 64): [(128, 64, 8), (64, 64, 8), (64, 32, 8)],
    ("bwd_dq", "f32", 128): [(64, 64, 8), (32, 32, 8), (64, 32, 8)],
    ("bwd_dkdv", "f32", 64): [(64, 128, 8), (64, 64, 8), (32, 64, 8)],
    ("bwd_dkdv", "f32", 128): [(64, 64, 8), (32, 64, 8), (64, 32, 8)],
    ("bwd_dkdv_dq", "f32", 64): [(64, 128, 8), (64, 64, 8)],
    ("bwd_dkdv_dq", "f32", 128): [(64, 64, 8), (32, 64, 8), (64, 32, 8)],
}

if __name__ == "__main__":
    sweep(CANDIDATES, sys.argv[1].split(",") if len(sys.argv) > 1 else None)
