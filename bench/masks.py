"""GPU benchmark of masked attention: flash_nif vs torch FlexAttention (compiled) in one run.

Method (as ../shared/docs/ANCHORS.md, "Masks and score modifiers"): bf16, H*D = 2048, B = 1 unless
the mask needs a batch (key padding: B = 2); TFLOPS count only the visible (query, key) pairs:
forward FLOPs = 4*H*D*visible, backward = 2.5 x forward; backward time = (forward+backward) -
forward; median of --reps after --warmup runs, CUDA events. Every implementation sees the same
tensors and the same mask (FlexAttention as a mask_mod with its BlockMask).

Masks: causal (the reference row); sliding window 1024, causal; documents of random lengths
256-4096 packed in one row (segment ids, causal within a document) and the same as a varlen batch;
16 documents of S/16 (segment ids); 10 % random block-sparse (128 x 128 blocks, not causal); key
padding (B = 2, the second row at half length, not causal). A varlen row's FlexAttention column is
the run of the same documents as segment ids just above it.

    python bench/masks.py [--seqs 8192,16384] [--dims 64,128] [--md out.md] [--no-flex]
"""

from __future__ import annotations

import argparse
import datetime

import numpy as np
import torch

import flash_nif
import flash_nif.varlen
from gpu import timed  # bench/gpu.py: CUDA-event median after warm-up (bench/ is sys.path[0])

WINDOW = 1024
BLOCK = 128


def document_lengths(s, rng, lo=256, hi=4096):
    """Random lengths in [lo, hi] summing to s (the last one takes the rest)."""
    lens = []
    while sum(lens) < s:
        lens.append(min(int(rng.integers(lo, hi + 1)), s - sum(lens)))
    return lens


class Case:
    """One mask: our keyword options, a FlexAttention mask_mod, the visible pair count."""

    def __init__(self, name, b, s, causal, visible, ours, mask_mod, varlen=None):
        self.name, self.b, self.s, self.causal, self.visible = name, b, s, causal, visible
        self.ours, self.mask_mod, self.varlen = ours, mask_mod, varlen


def cases(s, h, rng):
    dev = "cuda"
    out = [Case("causal", 1, s, True, s * (s + 1) // 2, {}, lambda b, hh, q, k: q >= k)]
    vis = sum(min(i, WINDOW) + 1 for i in range(s))
    out.append(Case(f"window {WINDOW}, causal", 1, s, True, vis, {"window": (WINDOW, 0)},
                    lambda b, hh, q, k: (q >= k) & (q - k <= WINDOW)))
    for label, lens in (("documents (random 256-4096)", document_lengths(s, rng)), ("documents 16 x S/16", [s // 16] * 16)):
        ids = torch.tensor(np.repeat(np.arange(len(lens)), lens), dtype=torch.int32, device=dev)
        seg = ids[None]  # [1, S]
        vis = sum(n * (n + 1) // 2 for n in lens)
        mod = (lambda ids: lambda b, hh, q, k: (ids[q] == ids[k]) & (q >= k))(ids)
        name = f"{label} ({len(lens)}), causal"
        out.append(Case(name, 1, s, True, vis, {"segment_ids": (seg, seg)}, mod))
        cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32, device=dev)
        out.append(Case(name.replace("documents", "varlen"), 1, s, True, vis, {}, mod, varlen=cu))
    nb = s // BLOCK
    blocks = torch.rand(1, 1, nb, nb, generator=torch.Generator().manual_seed(1)) < 0.10
    blocks_dev = blocks.to(dev)
    vis = int(blocks.sum()) * BLOCK * BLOCK
    out.append(Case("block-sparse 10 %", 1, s, False, vis, {"block_mask": blocks_dev.to(torch.uint8)},
                    lambda b, hh, q, k: blocks_dev[0, 0, q // BLOCK, k // BLOCK]))
    lens = torch.tensor([s, s // 2], dtype=torch.int32, device=dev)
    out.append(Case("key padding (B=2, 1 and 1/2)", 2, s, False, s * (s + s // 2), {"seqused_k": lens},
                    lambda b, hh, q, k: k < lens[b]))
    return out


def run_ours(c, q, k, v, do):
    if c.varlen is not None:
        # [1, S, H, D] -> [S, H, D]: one packed row.
        qv, kv, vv, dov = (x[0] for x in (q, k, v, do))

        def fwd():
            return flash_nif.varlen.forward_with_states(qv, kv, vv, c.varlen, c.varlen, causal=c.causal)

        def fwd_bwd():
            o, lse = fwd()
            return flash_nif.varlen.backward(dov, qv, kv, vv, o, lse, c.varlen, c.varlen, causal=c.causal)

        return fwd, fwd_bwd

    def fwd():
        return flash_nif.forward_with_states(q, k, v, causal=c.causal, **c.ours)

    def fwd_bwd():
        o, lse = fwd()
        return flash_nif.backward(do, q, k, v, o, lse, causal=c.causal, **c.ours)

    return fwd, fwd_bwd


def run_flex(c, q, k, v, do):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    h = q.shape[2]
    bm = create_block_mask(c.mask_mod, c.b, None, c.s, c.s, device="cuda")
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2)
    assert qt.shape[1] == h

    def fwd():
        with torch.no_grad():
            return flex(qt, kt, vt, block_mask=bm)

    def fwd_bwd():
        out = flex(qt, kt, vt, block_mask=bm)
        return torch.autograd.grad(out, (qt, kt, vt), dot)

    return fwd, fwd_bwd


def measure(make, c, q, k, v, do, flops, warmup, reps):
    try:
        fwd, fwd_bwd = make(c, q, k, v, do)
        tf = timed(fwd, warmup, reps)
        tfb = timed(fwd_bwd, warmup, reps)
        return flops / tf / 1e9, 2.5 * flops / max(tfb - tf, 1e-6) / 1e9, tf, tfb - tf
    except Exception as e:  # noqa: BLE001 - a refusal is reported in the table
        torch.cuda.empty_cache()
        print(f"  {make.__name__} {c.name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="8192,16384")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--md", help="write the markdown table here too")
    ap.add_argument("--no-flex", action="store_true", help="ours only")
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 256  # one compile per mask: never fall back to eager
    info = flash_nif.info()["cuda"]
    head = (f"{datetime.date.today()} · {torch.cuda.get_device_name()} · torch {torch.__version__} · "
            f"flash_nif {flash_nif.__version__} ({info.get('arch')}, NVRTC {info.get('nvrtc_version')})")
    print(head, flush=True)
    lines = [head, "", "bf16, H·D = 2048, TFLOPS on visible pairs, forward / backward; ms forward / backward", "",
             "| mask | D | S | visible | ours | FlexAttention | ours / Flex | ours ms |",
             "|---|---|---|---|---|---|---|---|"]
    for d in [int(x) for x in args.dims.split(",")]:
        for s in [int(x) for x in args.seqs.split(",")]:
            h = 2048 // d
            rng = np.random.default_rng(s + d)
            flex_docs = None  # a varlen row is compared with FlexAttention's run of the same documents
            for c in cases(s, h, rng):
                g = torch.Generator(device="cuda").manual_seed(s + d)
                q, k, v, do = (torch.randn(c.b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
                flops = 4 * h * d * c.visible
                ours = measure(run_ours, c, q, k, v, do, flops, args.warmup, args.reps)
                if args.no_flex:
                    flex = None
                elif c.varlen is not None:
                    flex = flex_docs
                else:
                    flex = flex_docs = measure(run_flex, c, q, k, v, do, flops, args.warmup, args.reps)
                fmt = lambda r: "—" if r is None else f"{r[0]:.0f} / {r[1]:.0f}"  # noqa: E731
                ratio = "—" if ours is None or flex is None else f"{ours[0] / flex[0]:.2f} / {ours[1] / flex[1]:.2f}"
                ms = "—" if ours is None else f"{ours[2]:.2f} / {ours[3]:.2f}"
                frac = c.visible / (c.b * s * s)
                row = f"| {c.name} | {d} | {s} | {frac:.3f} | {fmt(ours)} | {fmt(flex)} | {ratio} | {ms} |"
                print(row, flush=True)
                lines.append(row)
                del q, k, v, do
                torch.cuda.empty_cache()
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
