"""float32 forward and backward on tensor cores vs SIMT vs torch's efficient backend, one run (issue 17).

Method (bench/gpu.py's): B*S = 16384 tokens, H*D = 2048, forward FLOPs = 4*B*H*S^2*D (halved when
causal), backward = 2.5 x forward, backward time = (forward+backward) - forward, median of --reps
after --warmup runs, CUDA events, the same random tensors for everyone.
Forward rows: ours precision="exact" (the faster exact kernel, split products or SIMT; the kernel
lines name it: on Hopper the wgmma kernels at D = 64 and 128, the forward's on fp16 parts "3xf16"),
ours "exact" and "tf32" with FLASH_NIF_TF32_PARTS=1 (the Hopper forward on TF32 operands, "3xtf32" /
"tf32"; by default on scaled fp16 ones, "3xf16" / "1xf16"), ours with
FLASH_NIF_TF32=0 (the SIMT f32 kernels), ours precision="tf32", torch SDPA's efficient backend (f32).
Backward rows: the same four, ours in the default mode (dQ by f32 atomics) and "exact" also with
deterministic=True. Errors: ||x - float64|| / ||float64|| on the first batch row and head pair
(torch in float64): o for the forward, the worst of dq, dk, dv for the backward.

    python bench/tf32.py [--seqs 2048,8192] [--dims 64,128] [--passes fwd,bwd] [--md out.md]
        [--only exact,tf32,eff]   (A/B runs: only these columns; the others print "-")
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_nif
from gpu import timed  # bench/gpu.py: CUDA events, median (run as python bench/tf32.py)


def ours(q, k, v, causal, precision, simt=False, tf32_parts=False):
    """simt: FLASH_NIF_TF32=0 (the SIMT f32 kernels); tf32_parts: FLASH_NIF_TF32_PARTS=1 (the Hopper
    forward's products on TF32 operands instead of scaled fp16 ones)."""
    env = {"FLASH_NIF_TF32": "0"} if simt else {"FLASH_NIF_TF32_PARTS": "1"} if tf32_parts else {}

    def f():
        os.environ.update(env)
        try:
            return flash_nif.forward(q, k, v, causal=causal, precision=precision)
        finally:
            for name in env:
                os.environ.pop(name, None)
    return f


def efficient(q, k, v, causal):
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D]

    def f():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    return f


def ours_fwd_bwd(q, k, v, do, causal, precision, simt=False, deterministic=False):
    """(forward, forward + backward, backward's kernel info) of ours; grads as (dq, dk, dv)."""
    def fwd():
        return flash_nif.forward_with_states(q, k, v, causal=causal, precision=precision)

    def fwd_bwd():
        if simt:
            os.environ["FLASH_NIF_TF32"] = "0"
        try:
            o, lse = fwd()
            return flash_nif.backward(do, q, k, v, o, lse, causal=causal, precision=precision,
                                      deterministic=deterministic)
        finally:
            os.environ.pop("FLASH_NIF_TF32", None)

    def fwd_timed():  # the forward of fwd_bwd, under the same environment
        if simt:
            os.environ["FLASH_NIF_TF32"] = "0"
        try:
            return fwd()
        finally:
            os.environ.pop("FLASH_NIF_TF32", None)
    return fwd_timed, fwd_bwd


def efficient_fwd_bwd(q, k, v, do, causal):
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))  # [B, H, S, D]
    dot = do.transpose(1, 2)

    def fwd():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), torch.no_grad():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    def fwd_bwd():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            return tuple(g.transpose(1, 2) for g in torch.autograd.grad(out, (qt, kt, vt), dot))
    return fwd, fwd_bwd


def grad_err(grads, q, k, v, do, causal):
    """The worst of dq, dk, dv's ||x - float64|| / ||float64|| on batch row 0, heads 0..1."""
    q64, k64, v64 = (x[:1, :, :2].double().transpose(1, 2).requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    want = torch.autograd.grad(out, (q64, k64, v64), do[:1, :, :2].double().transpose(1, 2))
    return max(((g[:1, :, :2].double() - w.transpose(1, 2)).norm() / w.norm()).item() for g, w in zip(grads, want))


def rel_err(o, q, k, v, causal):
    """On batch row 0, heads 0..1, against float64 torch math."""
    q64, k64, v64 = (x[:1, :, :2].double().transpose(1, 2) for x in (q, k, v))
    want = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal).transpose(1, 2)
    got = o[:1, :, :2].double()
    return ((got - want).norm() / want.norm()).item()


def selected(fns, args):
    only = set(args.only.split(",")) if args.only else None
    return {n: f for n, f in fns.items() if only is None or n in only}


def cell(values, name, fmt):
    return fmt.format(values[name]) if name in values else "-"


def ratio(ms, name):
    """Time of torch efficient / ours."""
    return f"{ms['eff'] / ms[name]:.2f}" if "eff" in ms and name in ms else "-"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="2048,8192")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--passes", default="fwd,bwd")
    ap.add_argument("--md")
    ap.add_argument("--only", help="comma list of the columns' kernels to run: exact, parts, simt, tf32, tf32p, "
                                   "eff (forward), exact, det, simt, tf32, eff (backward); default all")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    passes = args.passes.split(",")
    out = []
    if "fwd" in passes:
        out += ["TFLOPS (forward); ratios = time of torch efficient / ours", ""] + forward_rows(args) + [""]
    if "bwd" in passes:
        out += ["TFLOPS (backward); ratios = time of torch efficient / ours", ""] + backward_rows(args) + [""]
    print("\n".join(out))
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(out))


def forward_rows(args):
    cols = ["S", "D", "causal", "ours exact", "ours exact (TF32 operands)", "ours SIMT", "ours tf32",
            "ours tf32 (TF32 operands)", "torch efficient", "exact / eff.", "exact TF32 op. / eff.", "tf32 / eff.",
            "tf32 TF32 op. / eff.", "err exact", "err exact TF32 op.", "err SIMT", "err tf32", "err tf32 TF32 op.",
            "err eff."]
    names = ("exact", "parts", "simt", "tf32", "tf32p", "eff")
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for s in (int(x) for x in args.seqs.split(",")):
        for d in (int(x) for x in args.dims.split(",")):
            b, h = 16384 // s, 2048 // d
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g) for _ in range(3))
            for causal in (False, True):
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                fns = {"exact": ours(q, k, v, causal, "exact"), "parts": ours(q, k, v, causal, "exact", tf32_parts=True),
                       "simt": ours(q, k, v, causal, "exact", simt=True), "tf32": ours(q, k, v, causal, "tf32"),
                       "tf32p": ours(q, k, v, causal, "tf32", tf32_parts=True), "eff": efficient(q, k, v, causal)}
                ms, err, tf = {}, {}, {}
                for name, fn in selected(fns, args).items():
                    ms[name] = timed(fn, args.warmup, args.reps)
                    tf[name] = flops / ms[name] / 1e9
                    err[name] = rel_err(fn(), q, k, v, causal)
                    if name != "eff":
                        kernel = flash_nif.info()["cuda"]["last_kernels"]["forward"]
                        print(f"  {name}: {kernel['kernel']} [{kernel['math']}]")
                cells = [s, d, causal, *(cell(tf, n, "{:.1f}") for n in names),
                         *(ratio(ms, n) for n in ("exact", "parts", "tf32", "tf32p")),
                         *(cell(err, n, "{:.1e}") for n in names)]
                rows.append("| " + " | ".join(map(str, cells)) + " |")
                print(rows[-1], flush=True)
            del q, k, v
    return rows


def backward_rows(args):
    cols = ["S", "D", "causal", "ours exact", "ours exact det.", "ours SIMT", "ours tf32", "torch efficient",
            "exact / eff.", "tf32 / eff.", "err exact", "err exact det.", "err SIMT", "err tf32", "err eff."]
    names = ("exact", "det", "simt", "tf32", "eff")
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for s in (int(x) for x in args.seqs.split(",")):
        for d in (int(x) for x in args.dims.split(",")):
            b, h = 16384 // s, 2048 // d
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(b, s, h, d, device="cuda", generator=g) for _ in range(4))
            for causal in (False, True):
                flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                fns = {"exact": ours_fwd_bwd(q, k, v, do, causal, "exact"),
                       "det": ours_fwd_bwd(q, k, v, do, causal, "exact", deterministic=True),
                       "simt": ours_fwd_bwd(q, k, v, do, causal, "exact", simt=True),
                       "tf32": ours_fwd_bwd(q, k, v, do, causal, "tf32"),
                       "eff": efficient_fwd_bwd(q, k, v, do, causal)}
                ms, err, tf = {}, {}, {}
                for name, (fwd, fwd_bwd) in selected(fns, args).items():
                    ms[name] = max(timed(fwd_bwd, args.warmup, args.reps) - timed(fwd, args.warmup, args.reps), 1e-6)
                    tf[name] = flops / ms[name] / 1e9
                    err[name] = grad_err(fwd_bwd(), q, k, v, do, causal)
                    if name != "eff":
                        kernel = flash_nif.info()["cuda"]["last_kernels"]["backward"]
                        print(f"  {name}: {kernel['kernel']} [{kernel['math']}]")
                cells = [s, d, causal, *(cell(tf, n, "{:.1f}") for n in names),
                         ratio(ms, "exact"), ratio(ms, "tf32"),
                         *(cell(err, n, "{:.1e}") for n in names)]
                rows.append("| " + " | ".join(map(str, cells)) + " |")
                print(rows[-1], flush=True)
            del q, k, v, do
    return rows


if __name__ == "__main__":
    main()
