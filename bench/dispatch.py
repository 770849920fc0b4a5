#!/usr/bin/env python3
"""Fused or materialized: the measurements behind flash_nif's dispatch (native/flash-core/src/dispatch.rs).

CPU (default): for a grid of sequence lengths S and batch x heads (D = 64, causal, f32, Sq = Sk),
times ``mode="fused"`` and ``mode="materialized"`` forward and backward, rounds interleaved, and
prints

* the grid (median ms per call, materialized / fused ratio per pass),
* the crossover table that follows from it, as the Rust rows to paste into ``CPU_CROSSOVER``
  (per number of (batch row, kv head) pairs, the longest S up to which the materialized pass wins
  at every measured S),
* ExPhil's shape (B = 64 and 1, S = 60, H = 4, D = 64, causal) with ``mode="auto"``, next to torch
  SDPA (forward + backward) and NumPy's materialized forward in the same run.

GPU (``--gpu``): CuPy (or torch) arrays on GPU 0; our fused kernels against torch SDPA's default
backend and its MATH backend (a materialized implementation) in the same run, and whether a
materialized path would win anywhere on the grid. flash_nif has no materialized GPU kernels, so
``mode="materialized"`` there is refused (the script checks that) and ``auto`` is fused.

torch is optional. If ``import torch`` fails, ``--torch-python PATH`` (or FLASH_BENCH_TORCH_PYTHON)
names an interpreter that has it; torch then runs in that child process.

    python bench/dispatch.py                      # CPU grid, table, ExPhil's shape
    python bench/dispatch.py --quick              # fewer cells
    python bench/dispatch.py --gpu                # on a GPU machine

Markdown on stdout, progress on stderr. Times are medians of per-call means over ``--reps``
interleaved rounds, each round at least ``--min-time`` seconds per configuration.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np

D = 64
SEQS = (16, 32, 60, 128, 256, 512, 1024)
BATCH_HEADS = ((64, 4), (16, 4), (4, 4), (1, 4), (1, 1))  # (B, H = Hkv)
QUICK_SEQS = (16, 60, 128, 256, 512)
QUICK_BATCH_HEADS = ((64, 4), (4, 4), (1, 1))
MAX_CELL_GFLOP = 6.0  # skip grid cells whose fwd + bwd would take more (they decide nothing)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def flops(b, s, h, d, causal=True):
    """fwd, bwd flops (causal counted as half; bwd = 2.5 x fwd, as in bench/cpu.py)."""
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return f, 2.5 * f


def inputs(b, s, h, d, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((b, s, h, d), dtype=np.float32) for _ in range(4))


def per_call(fn, min_time):
    """Mean seconds per call over a loop of at least ``min_time`` seconds."""
    n, t = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - t0
        if t >= min_time:
            return t / n
        n = max(2 * n, int(n * min_time / max(t, 1e-6)) + 1)


# ----------------------------------------------------------------------- torch, maybe in a child ----

def torch_fns(b, s, h, d, causal, device="cpu", backend=None):
    """(fwd, fwd + bwd) closures of torch SDPA; ``backend`` "math" forces the materialized one."""
    import torch
    import torch.nn.functional as F

    ctx = None
    if backend == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = lambda: sdpa_kernel(SDPBackend.MATH)  # noqa: E731
    q, k, v, do = (torch.from_numpy(t).permute(0, 2, 1, 3).contiguous().to(device) for t in inputs(b, s, h, d))
    for t in (q, k, v):
        t.requires_grad_(True)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

    def sdpa():
        if ctx is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with ctx():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd():
        with torch.no_grad():
            sdpa()
        sync()

    def both():
        torch.autograd.grad(sdpa(), (q, k, v), do)
        sync()

    return fwd, both


def serve():
    """Child mode: JSON lines in (prepare / time), JSON lines out."""
    fns = None
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "prepare":
                import torch

                fns = None
                fns = torch_fns(*msg["shape"], msg["causal"])
                res = dict(version=torch.__version__, threads=torch.get_num_threads())
            else:
                res = dict(t=per_call(fns[0 if msg["which"] == "fwd" else 1], msg["min_time"]))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            res = dict(error=f"{type(exc).__name__}: {exc}")
        print(json.dumps(res), flush=True)


class Torch:
    """torch SDPA on the CPU, here or in a child interpreter."""

    def __init__(self, python):
        self.proc = self.fns = None
        self.why = ""
        try:
            import torch

            self.version, self.threads = torch.__version__, torch.get_num_threads()
        except ImportError:
            python = python or os.environ.get("FLASH_BENCH_TORCH_PYTHON")
            if not python:
                self.why = "torch is not importable here (pass --torch-python)"
                return
            self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--serve"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)

    def ok(self):
        return not self.why

    def _ask(self, **msg):
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        res = json.loads(self.proc.stdout.readline() or '{"error": "torch child died"}')
        if "error" in res:
            raise RuntimeError(res["error"])
        return res

    def prepare(self, shape, causal):
        if self.proc:
            info = self._ask(cmd="prepare", shape=shape, causal=causal)
            self.version, self.threads = info["version"], info["threads"]
        else:
            self.fns = torch_fns(*shape, causal)

    def time(self, which, min_time):
        if self.proc:
            return self._ask(cmd="time", which=which, min_time=min_time)["t"]
        return per_call(self.fns[0 if which == "fwd" else 1], min_time)


# ------------------------------------------------------------------------------------------ CPU ----

def ours_fns(b, s, h, d, mode, causal=True):
    import flash_nif

    q, k, v, do = inputs(b, s, h, d)
    o, lse = flash_nif.forward_with_states(q, k, v, causal=causal, mode=mode)

    def fwd():
        flash_nif.forward_with_states(q, k, v, causal=causal, mode=mode)

    def bwd():
        flash_nif.backward(do, q, k, v, o, lse, causal=causal, mode=mode)

    return fwd, bwd


def numpy_forward_fn(b, s, h, d, causal=True):
    """NumPy's materialized forward (scores, softmax, P V as whole [B, H, S, S] matrices)."""
    q, k, v, _ = (np.ascontiguousarray(t.transpose(0, 2, 1, 3)) for t in inputs(b, s, h, d))
    scale, hide = 1.0 / math.sqrt(d), ~np.tri(s, dtype=bool)

    def fwd():
        p = np.matmul(q, k.transpose(0, 1, 3, 2))
        p *= scale
        if causal:
            np.copyto(p, -np.inf, where=hide)
        m = p.max(axis=-1, keepdims=True)
        p -= m
        np.exp(p, out=p)
        denom = p.sum(axis=-1, keepdims=True)
        p /= denom
        return np.matmul(p, v), (m + np.log(denom))[..., 0]

    return fwd


def interleaved(configs, reps, min_time, settle=0.05):
    """configs: name -> callable(min_time) -> seconds per call. Medians over interleaved rounds."""
    samples = {n: [] for n in configs}
    for f in configs.values():
        f(min_time / 4)  # warm-up
    for _ in range(reps):
        for n, f in configs.items():
            time.sleep(settle)  # let other libraries' spinning threads sleep
            samples[n].append(f(min_time))
    return {n: statistics.median(v) for n, v in samples.items()}


def cpu_grid(seqs, batch_heads, reps, min_time):
    import flash_nif

    threads = flash_nif.info()["threads"]
    rows = []
    for b, h in batch_heads:
        for s in seqs:
            f, bw = flops(b, s, h, D)
            if (f + bw) / 1e9 > MAX_CELL_GFLOP:
                continue
            log(f"grid B={b} H={h} S={s}")
            fns = {m: ours_fns(b, s, h, D, m) for m in ("fused", "materialized")}
            configs = {(m, p): (lambda t, fn=fns[m][i]: per_call(fn, t)) for m in fns for i, p in enumerate(("fwd", "bwd"))}
            t = interleaved(configs, reps, min_time)
            rows.append(dict(b=b, h=h, s=s, pairs=b * h, **{f"{m}_{p}": v for (m, p), v in t.items()}))
    return threads, rows


WORST = 1.2  # a clear loss: materialized 20 % slower than fused somewhere at that S


def crossover(rows, pass_):
    """[(min pairs, max S)] for one pass: the longest S such that at it and at every shorter
    measured S, materialized is faster on the geometric mean of the (B, H) configurations measured
    there and clearly slower (ratio > WORST) on none; min pairs = the fewest measured. (Single
    cells of a short call are noisy on a loaded machine; one row per pass, measured over all
    batch sizes, is what the grid supports.)"""
    upto = 0
    for s in sorted({r["s"] for r in rows}):
        ratios = [r[f"materialized_{pass_}"] / r[f"fused_{pass_}"] for r in rows if r["s"] == s]
        if math.exp(statistics.fmean(map(math.log, ratios))) >= 1 or max(ratios) > WORST:
            break
        upto = s
    return [(min(r["pairs"] for r in rows), upto)] if upto else []


def cpu_main(args):
    import flash_nif

    info = flash_nif.info()
    seqs, bh = (QUICK_SEQS, QUICK_BATCH_HEADS) if args.quick else (SEQS, BATCH_HEADS)
    load0 = os.getloadavg()[0]
    threads, rows = cpu_grid(seqs, bh, args.reps, args.min_time)

    # ExPhil's shape: auto against torch SDPA and NumPy's materialized forward, same run.
    torch = Torch(args.torch_python)
    exphil = []
    for b in (64, 1):
        shape = (b, 60, 4, D)
        log(f"ExPhil's shape B={b}")
        fwd, bwd = ours_fns(*shape, "auto")
        np_fwd = numpy_forward_fn(*shape)
        configs = {"auto_fwd": lambda t: per_call(fwd, t), "auto_bwd": lambda t: per_call(bwd, t),
                   "numpy_fwd": lambda t: per_call(np_fwd, t)}
        if torch.ok():
            torch.prepare(list(shape), True)
            configs["torch_fwd"] = lambda t: torch.time("fwd", t)
            configs["torch_both"] = lambda t: torch.time("both", t)
        exphil.append((shape, interleaved(configs, args.reps, args.min_time)))
    load1 = os.getloadavg()[0]

    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"### Dispatch, CPU, {now}: {os.cpu_count()} cores, {threads} threads, ISA {info['cpu_isa']}, "
          f"load average {load0:.2f} before, {load1:.2f} after; flash_nif {info['version']}"
          + (f"; torch {torch.version} ({torch.threads} threads)" if torch.ok() else f"; torch: {torch.why}"))
    print()
    print(f"f32, D = {D}, causal, Sq = Sk = S, H = Hkv; median ms per call over {args.reps} interleaved rounds.")
    print()
    print("| B | H | S | pairs | fused fwd | mat. fwd | mat./fused fwd | fused bwd | mat. bwd | mat./fused bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ff, mf, fb, mb = (r[k] * 1e3 for k in ("fused_fwd", "materialized_fwd", "fused_bwd", "materialized_bwd"))
        print(f"| {r['b']} | {r['h']} | {r['s']} | {r['pairs']} | {ff:.3f} | {mf:.3f} | {mf / ff:.2f} | "
              f"{fb:.3f} | {mb:.3f} | {mb / fb:.2f} |")
    print()
    print("Crossover table (paste into CPU_CROSSOVER):")
    print()
    print("```rust")
    for p, name in (("fwd", "Forward"), ("bwd", "Backward")):
        for lv, s in crossover(rows, p):
            print(f"    Crossover {{ pass: Pass::{name}, max_seq: {s}, min_pairs: {lv} }},")
    print("```")
    print()
    print("ExPhil's shape (S = 60, H = 4, D = 64, causal, f32), `mode=\"auto\"`, same run:")
    print()
    print("| B | ours fwd | ours bwd | ours fwd+bwd (GFLOP/s) | torch SDPA fwd | torch fwd+bwd | NumPy materialized fwd |")
    print("|---|---|---|---|---|---|---|")
    for shape, t in exphil:
        f, bw = flops(*shape)
        ours = t["auto_fwd"] + t["auto_bwd"]
        tf = f"{t['torch_fwd'] * 1e3:.3f}" if "torch_fwd" in t else "—"
        tb = f"{t['torch_both'] * 1e3:.3f}" if "torch_both" in t else "—"
        print(f"| {shape[0]} | {t['auto_fwd'] * 1e3:.3f} | {t['auto_bwd'] * 1e3:.3f} | {ours * 1e3:.3f} "
              f"({(f + bw) / ours / 1e9:.0f}) | {tf} | {tb} | {t['numpy_fwd'] * 1e3:.3f} |")


# ------------------------------------------------------------------------------------------ GPU ----

def gpu_main(args):
    import flash_nif
    import torch

    if not torch.cuda.is_available():
        sys.exit("--gpu needs torch with a CUDA device")
    dev = torch.device("cuda")
    seqs, bh = (QUICK_SEQS, QUICK_BATCH_HEADS) if args.quick else (SEQS, BATCH_HEADS + ((256, 16),))

    def ours(b, s, h, mode):
        q, k, v, do = (torch.from_numpy(t).to(dev) for t in inputs(b, s, h, D))
        o, lse = flash_nif.forward_with_states(q, k, v, mode=mode)

        def fwd():
            flash_nif.forward_with_states(q, k, v, mode=mode)
            torch.cuda.synchronize()

        def bwd():
            flash_nif.backward(do, q, k, v, o, lse, mode=mode)
            torch.cuda.synchronize()

        return fwd, bwd

    refused = ""
    try:
        ours(1, 16, 1, "materialized")
    except flash_nif.UnsupportedError as e:
        refused = str(e)
    rows = []
    for b, h in bh:
        for s in seqs:
            log(f"gpu B={b} H={h} S={s}")
            fwd, bwd = ours(b, s, h, "fused")
            tf, tb = torch_fns(b, s, h, D, True, device="cuda")
            mf, mb = torch_fns(b, s, h, D, True, device="cuda", backend="math")
            configs = {"fused_fwd": fwd, "fused_bwd": bwd, "torch_fwd": tf, "torch_both": tb, "math_fwd": mf, "math_both": mb}
            t = interleaved({n: (lambda m, fn=fn: per_call(fn, m)) for n, fn in configs.items()}, args.reps, args.min_time,
                            settle=0.0)
            rows.append(dict(b=b, h=h, s=s, **t))
    name = torch.cuda.get_device_name(0)
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"### Dispatch, GPU, {now}: {name}; flash_nif {flash_nif.__version__}; torch {torch.__version__}")
    print()
    print(f"f32, D = {D}, causal, Sq = Sk = S; median ms per call (synchronised) over {args.reps} interleaved rounds. "
          "torch's MATH backend is a materialized implementation (S x S scores in global memory). "
          f"`mode=\"materialized\"` on the GPU: {refused or 'NOT refused (unexpected)'}")
    print()
    print("| B | H | S | ours fused fwd | torch SDPA fwd | torch MATH fwd | ours fused fwd+bwd | torch SDPA fwd+bwd | torch MATH fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|---|")
    wins = 0
    for r in rows:
        ours_both = r["fused_fwd"] + r["fused_bwd"]
        wins += r["math_fwd"] < r["fused_fwd"] or r["math_both"] < ours_both
        print(f"| {r['b']} | {r['h']} | {r['s']} | {r['fused_fwd'] * 1e3:.3f} | {r['torch_fwd'] * 1e3:.3f} | "
              f"{r['math_fwd'] * 1e3:.3f} | {ours_both * 1e3:.3f} | {r['torch_both'] * 1e3:.3f} | {r['math_both'] * 1e3:.3f} |")
    print()
    print(f"A materialized implementation (torch MATH) beats our fused kernels in {wins} of {len(rows)} cells.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="the GPU part (CuPy / torch arrays on GPU 0)")
    ap.add_argument("--quick", action="store_true", help="fewer grid cells")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--min-time", type=float, default=0.05, help="seconds per configuration per round (default 0.05)")
    ap.add_argument("--torch-python", help="an interpreter with torch, when this one has none (CPU part)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve()
    return gpu_main(args) if args.gpu else cpu_main(args)


if __name__ == "__main__":
    main()
