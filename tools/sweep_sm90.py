"""Tile sweep of the Hopper forward (fwd_sm90) through the real launcher (development tool; needs
an H100 and torch). For each head dim and candidate (block_m, block_n, num_warps, stages), the
forward is timed at B*S = 16384, H*D = 2048, bf16, causal and not, next to cuDNN (SDPA) in the same
run; TFLOPS and the ratio ours / cuDNN are printed. block_m = 64 per consumer warpgroup
(num_warps = 4 * (1 + consumers)); two consumers take turns (ping-pong).

    python tools/sweep_sm90.py [S ...]        # default S = 2048 8192
"""

from __future__ import annotations

import pathlib
import sys

import torch
from torch.nn.attention import SDPBackend

import flash_nif
from flash_nif import _native

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
from gpu import run_torch, timed  # noqa: E402

CANDIDATES = {
    64: [(192, 128, 16, 4), (192, 64, 16, 4), (128, 128, 12, 4), (128, 64, 12, 4)],
    128: [(128, 176, 12, 2), (128, 128, 12, 2), (128, 128, 12, 3), (128, 64, 12, 4)],
    256: [(128, 80, 12, 2), (128, 64, 12, 2)],
}


def main():
    seqs = [int(x) for x in sys.argv[1:]] or [2048, 8192]
    for d, cands in CANDIDATES.items():
        for s in seqs:
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                fwd, _ = run_torch(SDPBackend.CUDNN_ATTENTION, q, k, v, q, causal)
                cudnn = flops / timed(fwd, 3, 20) / 1e9
                ref, _ = flash_nif.forward_with_states(q, k, v, causal=causal)
                cells = []
                for t in cands:
                    _native.cuda_set_tile_override("fwd_sm90", "bfloat16", d, (*t, 1))
                    try:
                        o, _ = flash_nif.forward_with_states(q, k, v, causal=causal)
                        err = (o.float() - ref.float()).abs().max().item()
                        tf = flops / timed(lambda: flash_nif.forward_with_states(q, k, v, causal=causal), 3, 20) / 1e9
                        cells.append(f"{t}: {tf:.0f} ({tf / cudnn:.2f}){' ERR %.1e' % err if err > 0.05 else ''}")
                    except Exception as e:  # noqa: BLE001 - a candidate that does not fit is reported
                        cells.append(f"{t}: {type(e).__name__} {str(e)[:80]}")
                    finally:
                        _native.cuda_set_tile_override("fwd_sm90", "bfloat16", d, None)
                print(f"D={d} S={s} causal={int(causal)} cuDNN {cudnn:.0f} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
