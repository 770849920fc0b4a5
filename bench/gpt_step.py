"""A GPT-style training step with swappable attention: flash_nif.torch against torch SDPA (issue 15).

Model (GPT-2 small's shape by default): token + learned position embedding, --layers blocks of
pre-LayerNorm → one fused qkv projection → causal attention (--heads heads of width/heads) →
output projection → residual, LayerNorm → 4× GELU MLP → residual; final LayerNorm, output head
tied to the embedding (vocabulary 50304), cross-entropy over every position. Precision: bf16
autocast with float32 master weights (the usual mixed-precision recipe: matmuls and attention in
bf16, norms, softmax-cross-entropy and the optimizer in float32); AdamW (fused on CUDA). One
"step" = zero_grad, forward, backward, optimizer step, timed with CUDA events (median of --steps
after --warmup); the same random batch every step.

Attention (`--attn`, or `all` for one table from one process):
  flash_nif    flash_nif.torch.attention(q, k, v, causal=True) on [B, S, H, D]
  sdpa-flash   F.scaled_dot_product_attention(is_causal=True) on [B, H, S, D] views, under
               sdpa_kernel(SDPBackend.FLASH_ATTENTION)
  sdpa-cudnn   the same under sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
The qkv projection gives [B, S, 3, H, D]; `qkv.unbind(2)` are views with a sequence stride of
3·width, which flash_nif.torch copies to contiguous tensors inside its op (forward and backward:
its kernels take no strides yet) and SDPA reads in place. `--contiguous-qkv` uses three projections
instead, so q, k, v are contiguous [B, S, H, D] (one GEMM becomes three of a third the width).

Prediction ("what our kernels alone predict"). One layer's attention, forward + backward, is
timed alone on the step's shapes two ways: `kernels` -- contiguous tensors in the kernel's own
layout ([B, S, H, D] for flash_nif, [B, H, S, D] for SDPA), so nothing but the attention kernels
(and the op's launch overhead) runs; `as used` -- exactly as a block uses it: q, k, v views of the
projection's output (unbind(2), or three tensors with --contiguous-qkv) in, o reshaped to
[B, S, width] out, the gradient taken with respect to the projection's output, so every layout
copy of either kind (flash_nif's input copies, SDPA's output transpose, unbind's backward stack)
is in it. Then, from the SDPA-flash step of the same run,
    rest           = step(sdpa-flash) - L * as_used(sdpa-flash)   (projections, MLP, norms, loss, optimizer)
    predicted(a)   = rest + L * kernels(a)
and step(a) / predicted(a) - 1 is what the step pays beyond the attention kernels: copies,
synchronisations, launch gaps. `--profile` shows where (bench/gpt_profile.py). The prediction
needs the sdpa-flash row of the same run (`--attn all`); the attention timings run eagerly, also
with `--compile` (which may fuse some of the layout copies that `as used` counts).

    python bench/gpt_step.py --attn all [--batch 4] [--seq 4096] [--contiguous-qkv] [--compile]
    python bench/gpt_step.py --attn flash_nif --profile --out runs/gpt_profile
    python bench/gpt_step.py --device cpu --layers 2 --seq 128 --batch 2 --width 128 --heads 2 --attn all
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_nif
import flash_nif.torch as fnt

ATTNS = ("flash_nif", "sdpa-flash", "sdpa-cudnn")
SDPA_BACKENDS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}
VOCAB = 50304  # GPT-2's 50257 rounded up to a multiple of 128


# ---- attention: [B, S, H, D] in and out, whichever kernel runs -----------------------------------


def kernel_call(name: str, q, k, v):
    """Causal attention in the kernel's own layout: [B, S, H, D] for flash_nif, [B, H, S, D] for SDPA."""
    if name == "flash_nif":
        return fnt.attention(q, k, v, causal=True)
    with sdpa_kernel(SDPA_BACKENDS[name]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attend(name: str, q, k, v):
    """Causal attention of q, k, v [B, S, H, D] -> o [B, S, H, D] (possibly a strided view)."""
    if name == "flash_nif":
        return kernel_call(name, q, k, v)
    o = kernel_call(name, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [B, H, S, D] views
    return o.transpose(1, 2)


# ---- the model ---------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int, heads: int, attn: str, contiguous_qkv: bool):
        super().__init__()
        self.heads, self.attn, self.contiguous_qkv = heads, attn, contiguous_qkv
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        if contiguous_qkv:
            self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        else:
            self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc, self.fc_out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):  # x [B, S, width]
        b, s, c = x.shape
        h = self.ln1(x)
        if self.contiguous_qkv:
            q, k, v = (lin(h).view(b, s, self.heads, c // self.heads) for lin in (self.q, self.k, self.v))
        else:
            q, k, v = self.qkv(h).view(b, s, 3, self.heads, c // self.heads).unbind(2)  # views, stride 3c
        with torch.profiler.record_function(f"attention:{self.attn}"):
            o = attend(self.attn, q, k, v)  # [B, S, H, D]
        x = x + self.proj(o.reshape(b, s, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, seq: int, attn: str, contiguous_qkv: bool):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads, attn, contiguous_qkv) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2L)
            if name.endswith(("proj.weight", "fc_out.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear):
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):  # idx, targets [B, S] int64
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied head, [B, S, VOCAB]
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


# ---- timing ------------------------------------------------------------------------------------


def median_ms(fn, device: str, warmup: int, reps: int) -> float:
    """Median milliseconds of fn(): CUDA events on the current stream (GPU time from the first to
    the last kernel of the call, launch gaps included), or wall time on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class Setup:
    """One model, optimizer and batch for an attention kind; `step()` is one training step."""

    def __init__(self, args, attn: str):
        torch.manual_seed(args.seed)
        self.args, self.attn = args, attn
        dev = args.device
        self.model = GPT(args.layers, args.width, args.heads, args.seq, attn, args.contiguous_qkv).to(dev)
        self.forward = torch.compile(self.model, fullgraph=True) if args.compile else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1, fused=dev == "cuda")
        gen = torch.Generator(device="cpu").manual_seed(args.seed)
        self.idx, self.targets = (torch.randint(VOCAB, (args.batch, args.seq), generator=gen).to(dev) for _ in range(2))

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.args.device, dtype=torch.bfloat16):
            loss = self.forward(self.idx, self.targets)
        loss.backward()
        self.opt.step()
        return loss.detach()


def attention_ms(args, attn: str, as_used: bool) -> float:
    """Forward + backward of one layer's attention on the step's shapes in bf16 (module doc:
    `kernels` or `as used`); torch.autograd.grad, so no .grad accumulation."""
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    b, s, h, c = args.batch, args.seq, args.heads, args.width

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(args.device, torch.bfloat16).requires_grad_()

    if not as_used:
        shape = (b, s, h, c // h) if attn == "flash_nif" else (b, h, s, c // h)
        q, k, v = inputs = tuple(randn(*shape) for _ in range(3))
        do = randn(*shape).detach()

        def run():
            return torch.autograd.grad(kernel_call(attn, q, k, v), inputs, do)
    else:
        if args.contiguous_qkv:
            inputs = tuple(randn(b, s, c) for _ in range(3))  # the three projections' outputs
        else:
            inputs = (randn(b, s, 3 * c),)  # the fused projection's output
        do = randn(b, s, c).detach()

        def run():
            if args.contiguous_qkv:
                q, k, v = (t.view(b, s, h, c // h) for t in inputs)
            else:
                q, k, v = inputs[0].view(b, s, 3, h, c // h).unbind(2)
            return torch.autograd.grad(attend(attn, q, k, v).reshape(b, s, c), inputs, do)

    return median_ms(run, args.device, args.warmup, args.steps)


def measure(args, attn: str) -> dict:
    row = {"attn": attn}
    try:
        setup = Setup(args, attn)
        row["loss"] = setup.step().item()  # also checks the kind runs here
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        row["step_ms"] = median_ms(setup.step, args.device, args.warmup, args.steps)
        if args.device == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del setup
        row["kernels_ms"] = attention_ms(args, attn, as_used=False)
        row["as_used_ms"] = attention_ms(args, attn, as_used=True)
    except RuntimeError as exc:  # e.g. no cuDNN attention on this device or dtype
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return row
    finally:
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if attn == "flash_nif" and args.device == "cuda":
        row["kernels"] = flash_nif.info().get("cuda", {}).get("last_kernels")
    return row


def predict(rows: list[dict], layers: int) -> None:
    """predicted = step(sdpa-flash) - L·as_used(sdpa-flash) + L·kernels(attn), where sdpa-flash ran."""
    base = next((r for r in rows if r["attn"] == "sdpa-flash" and "step_ms" in r), None)
    if base is None:
        return
    rest = base["step_ms"] - layers * base["as_used_ms"]
    for r in rows:
        if "step_ms" in r:
            r["rest_ms"] = rest
            r["predicted_ms"] = rest + layers * r["kernels_ms"]
            r["step_over_predicted"] = r["step_ms"] / r["predicted_ms"]


def table(args, rows: list[dict]) -> str:
    tokens = args.batch * args.seq
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    head = (f"{datetime.date.today()} · {dev} · torch {torch.__version__} · flash_nif {flash_nif.__version__} · "
            f"{args.layers} layers, width {args.width}, {args.heads} heads (D = {args.width // args.heads}), "
            f"B = {args.batch}, S = {args.seq}, bf16 autocast, {'contiguous q/k/v' if args.contiguous_qkv else 'qkv.unbind(2) views'}"
            f"{', torch.compile' if args.compile else ''}; median of {args.steps} after {args.warmup} warmup")
    rest = next((r["rest_ms"] for r in rows if "rest_ms" in r), None)
    if rest is not None:
        head += f"; rest of the step (from sdpa-flash) {rest:.2f} ms"
    lines = [head, "",
             "| attention | step ms | tokens/s | peak GiB | attention fwd+bwd, one layer: kernels ms | as used ms "
             "| predicted step ms (rest + L·kernels) | step / predicted | first loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['attn']} | unavailable: {r['error']} | | | | | | | |")
            continue
        pred = f"{r['predicted_ms']:.2f}" if "predicted_ms" in r else "n/a"
        ratio = f"{r['step_over_predicted']:.3f}" if "step_over_predicted" in r else "n/a"
        peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "n/a"
        lines.append(f"| {r['attn']} | {r['step_ms']:.2f} | {tokens / r['step_ms'] * 1e3:,.0f} | {peak} | "
                     f"{r['kernels_ms']:.3f} | {r['as_used_ms']:.3f} | {pred} | {ratio} | {r['loss']:.4f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attn", choices=ATTNS + ("all",), default="all",
                   help="attention kind, or all three in one process (the prediction needs sdpa-flash)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--contiguous-qkv", action="store_true", help="three projections: q, k, v contiguous [B, S, H, D]")
    p.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="also profile two flash_nif steps: kernels in and around our ops, copies, syncs")
    p.add_argument("--out", default="runs/gpt_step", help="DIR for results.json, the profile and its trace")
    p.add_argument("--md", help="append the table to this markdown file")
    args = p.parse_args(argv)
    if args.width % args.heads:
        p.error(f"--width {args.width} must be divisible by --heads {args.heads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device (use --device cpu for a smoke run)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    attns = ATTNS if args.attn == "all" else (args.attn,)
    rows = [measure(args, a) for a in attns]
    predict(rows, args.layers)
    text = table(args, rows)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    result = {"args": vars(args), "rows": rows}
    if args.profile:
        from gpt_profile import profile_steps  # bench/gpt_profile.py (run as python bench/gpt_step.py)

        report, summary = profile_steps(Setup(args, "flash_nif"), args.out)
        print(report)
        result["profile"] = summary
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    if args.md:
        with open(args.md, "a") as f:
            f.write(text + "\n\n")
    print(f"wrote {os.path.join(args.out, 'results.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
