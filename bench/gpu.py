"""GPU benchmark: flash_nif's CUDA kernels vs torch SDPA (flash, cuDNN, efficient, math) in one run.

Method (as ../shared/docs/ANCHORS.md): B*S = 16384 tokens, H*D = 2048; forward FLOPs =
4*B*H*S^2*D (halved when causal), backward = 2.5 x forward; backward time = (forward+backward)
- forward; median of --reps after --warmup runs, CUDA events; extra peak memory = torch's peak
allocation during one forward+backward minus what was allocated before (flash_nif's backward
workspace, 8*B*H*S bytes from the driver's stream-ordered pool, is not seen by torch and is
added by hand, as is the default backward's f32 dQ accumulator, 4*B*S*H*D bytes). "ours" is the
default backward (dQ by f32 atomics), "ours det." is deterministic=True. Inputs are random. Every
implementation sees the same tensors.

    python bench/gpu.py [--quick] [--dtypes bf16,f32] [--dims 64,128] [--md bench/gpu_results.md]
    python bench/gpu.py --modifiers [--dims 64,128] [--md out.md]
    python bench/gpu.py --forward [--dims 64,128,256] [--md out.md]

``--modifiers``: bf16 rows of softcap (30, Gemma 2's) and ALiBi (slopes 2^(-8h/H)) against
FlexAttention with the equivalent ``score_mod`` (and its block mask for causal), next to the plain
path of both in the same run (which shows whether the plain kernels changed) and our general
(MASKED) kernels with no modifier (seqused_k = every key), which the modifiers run in.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_nif


def timed(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def peak_extra(fn, add=0):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base + add) / 2**20


def run_ours(q, k, v, do, causal, deterministic=False):
    def fwd():
        return flash_nif.forward_with_states(q, k, v, causal=causal)

    def fwd_bwd():
        o, lse = fwd()
        return flash_nif.backward(do, q, k, v, o, lse, causal=causal, deterministic=deterministic)

    return fwd, fwd_bwd


def run_ours_mod(q, k, v, do, causal, **mods):
    def fwd():
        return flash_nif.forward_with_states(q, k, v, causal=causal, **mods)

    def fwd_bwd():
        o, lse = fwd()
        return flash_nif.backward(do, q, k, v, o, lse, causal=causal, **mods)

    return fwd, fwd_bwd


def run_flex(q, k, v, do, causal, score_mod=None):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2)
    b, h, s = qt.shape[0], qt.shape[1], qt.shape[2]
    bm = None
    if causal:
        bm = create_block_mask(lambda b_, h_, qi, ki: ki <= qi, b, h, s, s, device="cuda")

    def fwd():
        with torch.no_grad():
            return flex(qt, kt, vt, score_mod=score_mod, block_mask=bm)

    def fwd_bwd():
        out = flex(qt, kt, vt, score_mod=score_mod, block_mask=bm)
        return torch.autograd.grad(out, (qt, kt, vt), dot)

    return fwd, fwd_bwd


def modifier_rows(args, lines):
    """Softcap and ALiBi against FlexAttention's score_mod, plain rows of both alongside."""
    # One compiled FlexAttention per score_mod and block mask: more than dynamo's default cache
    # of 8 graphs, past which it silently runs flex_attention eagerly (slow, and out of memory).
    torch._dynamo.config.cache_size_limit = 1024
    torch._dynamo.config.accumulated_cache_size_limit = 8192
    cap = 30.0
    lines += ["TFLOPS forward / backward (bf16); ratio = ours / Flex time", "",
              "| D | causal | S | ours plain | ours general kernels | Flex plain | ours softcap | Flex softcap | ratio | ours ALiBi | Flex ALiBi | ratio | softcap / plain (ours) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in [int(x) for x in args.dims.split(",")]:
        for causal in (False, True):
            for s in ([4096] if args.quick else [2048, 8192]):
                b, h = 16384 // s, 2048 // d
                g = torch.Generator(device="cuda").manual_seed(s + d)
                q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
                slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda")
                flops = 4 * b * h * s * s * d / (2 if causal else 1)

                def softcap_mod(score, b_, h_, qi, ki):
                    # literal constants: a captured Python float becomes a symbolic one that
                    # Inductor (torch 2.11) fails to lower ("unbacked_bindings")
                    return 30.0 * torch.tanh(score * (1.0 / 30.0))

                def alibi_mod(score, b_, h_, qi, ki):
                    return score - slopes[h_] * (qi - ki).abs()

                impls = {
                    "ours": lambda *a: run_ours_mod(*a),
                    # the general (MASKED) kernels with no modifier: seqused_k = every key
                    "ours_general": lambda *a: run_ours_mod(*a, seqused_k=torch.full((b,), s, dtype=torch.int32, device="cuda")),
                    "flex": lambda *a: run_flex(*a),
                    "ours_cap": lambda *a: run_ours_mod(*a, softcap=cap),
                    "flex_cap": lambda *a: run_flex(*a, score_mod=softcap_mod),
                    "ours_alibi": lambda *a: run_ours_mod(*a, alibi_slopes=slopes),
                    "flex_alibi": lambda *a: run_flex(*a, score_mod=alibi_mod),
                }
                res = {n: bench_one(n, m, q, k, v, do, causal, flops, args.warmup, args.reps) for n, m in impls.items()}
                for n, r in res.items():
                    if r[1] is None:
                        print(f"  {n}: {r[4]}: {r[5]}", flush=True)

                def cell(n):
                    r = res[n]
                    return f"({r[4]})" if r[1] is None else f"{r[1]:.0f} / {r[2]:.0f}"

                def ratio(a, b):
                    ra, rb = res[a], res[b]
                    if ra[1] is None or rb[1] is None:
                        return "—"
                    return f"{ra[4] / rb[4]:.2f} / {ra[5] / rb[5]:.2f}"

                row = (f"| {d} | {'yes' if causal else 'no'} | {s} | {cell('ours')} | {cell('ours_general')} | {cell('flex')} | {cell('ours_cap')} | "
                       f"{cell('flex_cap')} | {ratio('ours_cap', 'flex_cap')} | {cell('ours_alibi')} | {cell('flex_alibi')} | "
                       f"{ratio('ours_alibi', 'flex_alibi')} | {ratio('ours_cap', 'ours')} |")
                print(row, flush=True)
                lines.append(row)
                del q, k, v, do
                torch.cuda.empty_cache()


def run_torch(backend, q, k, v, do, causal):
    # SDPA wants [B, H, S, D]; transposed views of the same data (FA2/cuDNN accept the strides).
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2)

    def fwd():
        with sdpa_kernel(backend), torch.no_grad():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    def fwd_bwd():
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            return torch.autograd.grad(out, (qt, kt, vt), dot)

    return fwd, fwd_bwd


def bench_one(name, make, q, k, v, do, causal, flops, warmup, reps, extra_mem=0):
    try:
        fwd, fwd_bwd = make(q, k, v, do, causal)
        tf = timed(fwd, warmup, reps)
        tfb = timed(fwd_bwd, warmup, reps)
        mem = peak_extra(fwd_bwd, extra_mem)
        return name, flops / tf / 1e9, 2.5 * flops / max(tfb - tf, 1e-6) / 1e9, mem, tf, tfb - tf
    except Exception as e:  # noqa: BLE001 - a backend that refuses (dtype, memory) is reported
        torch.cuda.empty_cache()
        return name, None, None, None, f"{type(e).__name__}", str(e)[:60]


def forward_rows(args, lines):
    """Forward only, bf16: ours (the Hopper kernel where it runs), ours with FLASH_NIF_SM90=0 (the
    portable kernels), FA2 and cuDNN through SDPA, TFLOPS and the ratio to cuDNN, in one run."""
    lines += ["Forward TFLOPS (bf16; ratio = ours / cuDNN)", "",
              "| D | causal | S | B·H | ours | kernel | ours portable | torch flash (FA2) | torch cuDNN | ours / cuDNN |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    seqs = [2048, 8192] if args.quick else [2048, 4096, 8192, 16384]
    for d in [int(x) for x in args.dims.split(",")]:
        for causal in (False, True):
            for s in seqs:
                b, h = 16384 // s, 2048 // d
                g = torch.Generator(device="cuda").manual_seed(s + d)
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)

                def ours():
                    return flash_nif.forward_with_states(q, k, v, causal=causal)

                res = {"ours": flops / timed(ours, args.warmup, args.reps) / 1e9}
                kernel = flash_nif.info()["cuda"]["last_kernels"]["forward"]["kernel"] or "?"
                os.environ["FLASH_NIF_SM90"] = "0"
                try:
                    res["portable"] = flops / timed(ours, args.warmup, args.reps) / 1e9
                finally:
                    del os.environ["FLASH_NIF_SM90"]
                for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        fwd, _ = run_torch(backend, q, k, v, q, causal)
                        res[name] = flops / timed(fwd, args.warmup, args.reps) / 1e9
                    except Exception as e:  # noqa: BLE001 - a backend that refuses is reported
                        res[name] = f"({type(e).__name__})"
                cell = lambda x: f"{x:.0f}" if isinstance(x, float) else x  # noqa: E731
                ratio = res["ours"] / res["cudnn"] if isinstance(res["cudnn"], float) else float("nan")
                row = (f"| {d} | {'yes' if causal else 'no'} | {s} | {b}·{h} | {cell(res['ours'])} | "
                       f"{'sm90' if kernel.startswith('fwd_sm90') else 'portable'} | {cell(res['portable'])} | "
                       f"{cell(res['flash'])} | {cell(res['cudnn'])} | {ratio:.2f} |")
                print(row, flush=True)
                lines.append(row)
                del q, k, v
                torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="S in {2048, 8192} only")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--md", help="write the markdown table here too")
    ap.add_argument("--dtypes", default="bf16,f32", help="comma list of bf16, f32")
    ap.add_argument("--dims", default="64,128", help="comma list of head dims")
    ap.add_argument("--modifiers", action="store_true", help="softcap and ALiBi rows against FlexAttention")
    ap.add_argument("--forward", action="store_true",
                    help="forward only (bf16): ours, ours portable (FLASH_NIF_SM90=0), FA2, cuDNN")
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    info = flash_nif.info()["cuda"]
    head = (f"{datetime.date.today()} · {dev} · torch {torch.__version__} · cuDNN {torch.backends.cudnn.version()} · "
            f"flash_nif {flash_nif.__version__} ({info.get('arch')}, NVRTC {info.get('nvrtc_version')})")
    print(head)
    if args.modifiers or args.forward:
        lines = [head, ""]
        (modifier_rows if args.modifiers else forward_rows)(args, lines)
        if args.md:
            with open(args.md, "w") as f:
                f.write("\n".join(lines) + "\n")
        return
    lines = [head, "", "TFLOPS forward / backward, extra peak MiB of one forward+backward", "",
             "| dtype | D | causal | S | B·H | ours | ours det. | torch flash (FA2) | torch cuDNN | torch efficient | materialized |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    seqs = [2048, 8192] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    dims = [int(x) for x in args.dims.split(",")]
    dts = args.dtypes.split(",")
    configs = [("bf16", d, c, s) for d in dims for c in (False, True) for s in seqs] if "bf16" in dts else []
    if "f32" in dts:
        configs += [("f32", d, c, s) for d in dims for c in (False, True) for s in (2048, 8192)]
    for dtype_name, d, causal, s in configs:
        dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
        b, h = 16384 // s, 2048 // d
        g = torch.Generator(device="cuda").manual_seed(s + d)
        q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        workspace = 8 * b * h * s  # delta and lse_log2; the default path adds its f32 dQ accumulator
        # The Hopper backward's deterministic mode adds dQ into the accumulator too (in order).
        hopper_det = info.get("sm90") and dtype_name == "bf16" and d in (64, 128)
        det_extra = workspace + (4 * b * s * h * d + 4 * b * h * math.ceil(s / 64) if hopper_det else 0)
        impls = [("ours", run_ours, workspace + 4 * b * s * h * d),
                 ("ours_det", lambda *a: run_ours(*a, deterministic=True), det_extra)]
        if dtype_name == "bf16":
            impls += [("flash", lambda *a: run_torch(SDPBackend.FLASH_ATTENTION, *a), 0),
                      ("cudnn", lambda *a: run_torch(SDPBackend.CUDNN_ATTENTION, *a), 0)]
        impls += [("efficient", lambda *a: run_torch(SDPBackend.EFFICIENT_ATTENTION, *a), 0)]
        if s <= 2048:
            impls += [("math", lambda *a: run_torch(SDPBackend.MATH, *a), 0)]
        res = {}
        for name, make, extra in impls:
            res[name] = bench_one(name, make, q, k, v, do, causal, flops, args.warmup, args.reps, extra)
        cells = []
        for name in ("ours", "ours_det", "flash", "cudnn", "efficient", "math"):
            r = res.get(name)
            if r is None:
                cells.append("—")
            elif r[1] is None:
                cells.append(f"({r[4]})")
            else:
                cells.append(f"{r[1]:.0f} / {r[2]:.0f} ({r[3]:.0f} MiB)")
        row = f"| {dtype_name} | {d} | {'yes' if causal else 'no'} | {s} | {b}·{h} | " + " | ".join(cells) + " |"
        print(row, flush=True)
        lines.append(row)
        del q, k, v, do
        torch.cuda.empty_cache()
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
