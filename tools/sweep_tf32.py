"""Tile sweep of the f32 tensor-core backward kernels (cuda/tf32.h under bwd_dq.cu, bwd_dkdv.cu)
through the real launcher (development tool; GPU and torch).

tools/sweep.py's method on float32 inputs under the default precision="exact" (split TF32,
TF32_TERMS = 3); FLASH_NIF_TF32=0 would sweep the SIMT kernels instead (tools/sweep_f32.py).
dK/dV tiles need block_n * d_split = 16 * num_warps; a warp holding more than 64 head-dim columns
of dK/dV or 32 query rows a step spilled (NVRTC 13.5, bench/RESULTS.md).

On the GPU machine, from a checkout with the extension built (``make build``):
    .venv/bin/python tools/sweep_tf32.py                   # every kernel below
    .venv/bin/python tools/sweep_tf32.py bwd_dkdv_dq       # some kernels only
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sweep import sweep  # noqa: E402

# (kernel, dtype, head dim) -> candidate (block_m, block_n, num_warps[, d_split[, min_blocks]])
CANDIDATES = {
    ("bwd_dq", "f32", 64): [(128, 64, 8), (128, 32, 8), (64, 64, 4)],
    ("bwd_dq", "f32", 128): [(128, 32, 8), (64, 32, 4), (64, 64, 4)],
    ("bwd_dkdv", "f32", 64): [(32, 128, 8), (32, 64, 4), (16, 128, 8)],
    ("bwd_dkdv", "f32", 128): [(32, 64, 8, 2), (16, 64, 8, 2), (32, 32, 4, 2)],
    ("bwd_dkdv_dq", "f32", 64): [(32, 128, 8), (32, 64, 4), (16, 128, 8)],
    ("bwd_dkdv_dq", "f32", 128): [(32, 64, 8, 2), (16, 64, 8, 2), (32, 32, 4, 2)],
}

if __name__ == "__main__":
    sweep(CANDIDATES, sys.argv[1].split(",") if len(sys.argv) > 1 else None)
