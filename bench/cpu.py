#!/usr/bin/env python3
"""CPU benchmark: flash_nif vs torch SDPA (CPU) vs NumPy materialised attention.

fp32, B = 1, H * D = 512 (H = 8 for D = 64, H = 4 for D = 128), Sq = Sk = S.
For each (D, causal, S) every implementation is warmed up once, then the
implementations take turns for ``--reps`` rounds (so background load hits
them alike) and the medians are reported:

* fwd: a forward that keeps what the backward needs (flash_nif: o and lse;
  torch: SDPA on tensors with ``requires_grad``; NumPy: o, lse and the
  softmax matrix);
* bwd: the backward alone; for torch, which cannot run its backward without
  a forward, median(fwd + bwd) - median(fwd), as in ANCHORS.md;
* GFLOP/s with fwd = 4*B*H*S*S*D (halved when causal), bwd = 2.5 * fwd;
* peak: extra peak RSS of one fwd+bwd above the RSS with the inputs built,
  measured in a fresh child interpreter per (implementation, size) so no
  allocator cache from earlier runs hides it (VmHWM, reset through
  /proc/self/clear_refs; Linux only, else "—").

torch is optional and no dependency. If ``import torch`` fails here, pass
``--torch-python PATH`` (or set FLASH_BENCH_TORCH_PYTHON) naming an
interpreter that has torch; torch then runs in that child process. NumPy
materialised attention is skipped where its S x S matrices would need more
than ``--numpy-max-gb`` (default 4).

Usage::

    python bench/cpu.py                 # full grid (several minutes)
    python bench/cpu.py --quick         # S in {512, 1024, 2048}, D = 64
    python bench/cpu.py --seq 1024,4096 --dims 128 --causal yes --reps 5

Prints markdown tables on stdout (progress on stderr).
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

MiB = 2**20
IMPLS = ("ours", "torch", "numpy")


# ---------------------------------------------------------------- memory ----

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _peak_extra_bytes(fn) -> float:
    """Extra peak RSS (bytes) while running ``fn()``; NaN if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return float("nan")
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024.0


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _inputs(s: int, h: int, d: int, seed: int = 0):
    """q, k, v, do: f32 [1, S, H, D], standard normal."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, s, h, d), dtype=np.float32) for _ in range(4))


# ----------------------------------------------- the three implementations ----
# Each ``make_*`` builds the inputs for one size and returns (fwd, bwd, both):
# closures running the forward, the backward from saved forward state, and a
# full forward+backward. torch has no separate backward (bwd is None).

def make_ours(s, h, d, causal):
    import flash_nif

    q, k, v, do = _inputs(s, h, d)
    state = {}

    def fwd():
        state["o"], state["lse"] = flash_nif.forward_with_states(q, k, v, causal=causal)

    def bwd():
        flash_nif.backward(do, q, k, v, state["o"], state["lse"], causal=causal)

    def both():
        o, lse = flash_nif.forward_with_states(q, k, v, causal=causal)
        flash_nif.backward(do, q, k, v, o, lse, causal=causal)

    return fwd, bwd, both


def numpy_forward(q, k, v, causal, scale):
    """Materialised attention. q, k, v [H, S, D] -> (o [H, S, D], lse [H, S], p [H, S, S])."""
    p = np.matmul(q, k.transpose(0, 2, 1))  # [H, S, S] scores, then probabilities in place
    p *= scale
    if causal:
        np.copyto(p, -np.inf, where=~np.tri(p.shape[1], dtype=bool))
    m = p.max(axis=-1, keepdims=True)
    p -= m
    np.exp(p, out=p)
    denom = p.sum(axis=-1, keepdims=True)
    p /= denom
    o = np.matmul(p, v)
    lse = (m + np.log(denom))[..., 0]
    return o, lse, p


def numpy_backward(do, q, k, v, o, p, scale):
    """Hand-written backward from the saved softmax matrix p [H, S, S]."""
    dv = np.matmul(p.transpose(0, 2, 1), do)
    ds = np.matmul(do, v.transpose(0, 2, 1))  # dP, then dS in place
    ds -= np.sum(do * o, axis=-1, keepdims=True)
    ds *= p
    ds *= scale
    dq = np.matmul(ds, k)
    dk = np.matmul(ds.transpose(0, 2, 1), q)
    return dq, dk, dv


def numpy_needs_bytes(s, h):
    return 3 * h * s * s * 4  # p, dP/dS, and temporaries of the same size


def make_numpy(s, h, d, causal):
    q, k, v, do = (np.ascontiguousarray(t[0].transpose(1, 0, 2)) for t in _inputs(s, h, d))
    scale = 1.0 / math.sqrt(d)
    state = {}

    def fwd():
        state["o"], _, state["p"] = numpy_forward(q, k, v, causal, scale)

    def bwd():
        numpy_backward(do, q, k, v, state["o"], state["p"], scale)

    def both():
        o, _, p = numpy_forward(q, k, v, causal, scale)
        numpy_backward(do, q, k, v, o, p, scale)

    return fwd, bwd, both


def make_torch(s, h, d, causal):
    import torch
    import torch.nn.functional as F

    q, k, v, do = (torch.from_numpy(t).permute(0, 2, 1, 3).contiguous() for t in _inputs(s, h, d))
    for t in (q, k, v):
        t.requires_grad_(True)

    def fwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def both():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), do)

    return fwd, None, both


MAKERS = {"ours": make_ours, "numpy": make_numpy, "torch": make_torch}


class LocalRunner:
    """Runs one implementation in this process."""

    def __init__(self, impl):
        self.impl = impl
        self.fns = None
        self.python = sys.executable

    def prepare(self, s, h, d, causal):
        self.fns = None  # free the previous size's inputs first
        self.fns = MAKERS[self.impl](s, h, d, causal)

    def time(self, which: str) -> float:
        fwd, bwd, both = self.fns
        return _timed({"fwd": fwd, "bwd": bwd, "both": both}[which])

    def close(self):
        self.fns = None


class ChildRunner:
    """Runs one implementation in another interpreter (torch from its venv)."""

    def __init__(self, impl, python):
        self.impl = impl
        self.python = python
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--serve", impl],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, **msg):
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.impl} child process died")
        res = json.loads(line)
        if "error" in res:
            raise RuntimeError(res["error"])
        return res

    def prepare(self, s, h, d, causal):
        self.info = self._ask(cmd="prepare", s=s, h=h, d=d, causal=causal)

    def time(self, which: str) -> float:
        return self._ask(cmd="time", which=which)["t"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def serve(impl):
    """Child mode: JSON commands on stdin, one JSON answer per line on stdout."""
    runner = LocalRunner(impl)
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "prepare":
                runner.prepare(msg["s"], msg["h"], msg["d"], msg["causal"])
                import torch

                res = dict(version=torch.__version__, threads=torch.get_num_threads())
            else:
                res = dict(t=runner.time(msg["which"]))
        except Exception as exc:  # report, keep serving
            res = dict(error=f"{type(exc).__name__}: {exc}")
        print(json.dumps(res), flush=True)


def peak_child(impl: str, cfg: str):
    """Child mode: print the extra peak RSS (bytes) of one fwd+bwd."""
    c = json.loads(cfg)
    _, _, both = MAKERS[impl](c["s"], c["h"], c["d"], c["causal"])
    print(_peak_extra_bytes(both))


def peak_in_child(python: str, impl: str, s, h, d, causal) -> float:
    """Extra peak RSS of one fwd+bwd in a fresh interpreter; NaN on failure."""
    cfg = json.dumps(dict(s=s, h=h, d=d, causal=causal))
    proc = subprocess.run([python, os.path.abspath(__file__), "--peak", impl, "--peak-cfg", cfg],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"peak child {impl} failed: {proc.stderr[-500:]}", file=sys.stderr)
        return float("nan")
    return float(proc.stdout.strip().splitlines()[-1])


def torch_runner(python: str | None):
    """A runner for torch, or (None, why) when torch cannot be had."""
    try:
        import torch  # noqa: F401

        return LocalRunner("torch"), ""
    except ImportError:
        pass
    if not python:
        return None, "torch not importable (pass --torch-python to use another interpreter)"
    return ChildRunner("torch", python), ""


# --------------------------------------------------------------- measuring ----

def measure(runners: dict, s, h, d, causal, reps: int, settle: float) -> dict:
    """Median fwd / bwd times for each runner, repetitions interleaved.

    Before each switch to another implementation we sleep ``settle`` seconds:
    OpenBLAS (NumPy) and OpenMP (torch) worker threads keep spinning for up to
    ~0.1-0.2 s after a call and would otherwise steal the cores from the next
    implementation."""
    samples = {name: {"fwd": [], "bwd": [], "both": []} for name in runners}
    plans = {}
    for name, r in runners.items():
        r.prepare(s, h, d, causal)
        plans[name] = ("fwd", "both") if name == "torch" else ("fwd", "bwd")
        for which in plans[name]:  # warm-up
            r.time(which)
        time.sleep(settle)
    for _ in range(reps):
        for name, r in runners.items():
            time.sleep(settle)
            for which in plans[name]:
                samples[name][which].append(r.time(which))
    out = {}
    for name in runners:
        fwd = statistics.median(samples[name]["fwd"])
        if samples[name]["bwd"]:
            bwd = statistics.median(samples[name]["bwd"])
        else:
            bwd = max(statistics.median(samples[name]["both"]) - fwd, 0.0)
        out[name] = dict(fwd=fwd, bwd=bwd)
    for r in runners.values():
        if isinstance(r, LocalRunner):
            r.fns = None  # free memory before the next size
    return out


def flops_fwd(s, h, d, causal):
    f = 4.0 * h * s * s * d
    return f / 2 if causal else f


def fmt_ms(t):
    return "—" if t is None else f"{t * 1e3:.1f}"


def fmt_gf(flops, t):
    return "—" if not t else f"{flops / t / 1e9:.0f}"


def fmt_mib(b):
    return "—" if b is None or b != b else f"{b / MiB:.0f}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="S in {512, 1024, 2048}, D = 64, 3 reps")
    ap.add_argument("--seq", default="512,1024,2048,4096,8192", help="comma-separated S values")
    ap.add_argument("--dims", default="64,128", help="comma-separated head dims (H = 512 / D)")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (median), after 1 warm-up")
    ap.add_argument("--numpy-max-gb", type=float, default=4.0,
                    help="skip NumPy materialised where its matrices need more (GB)")
    ap.add_argument("--settle", type=float, default=0.3,
                    help="seconds to sleep before switching implementation (spinning worker threads)")
    ap.add_argument("--no-numpy", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-peak", action="store_true", help="skip the peak-memory child runs")
    ap.add_argument("--torch-python", default=os.environ.get("FLASH_BENCH_TORCH_PYTHON"),
                    help="interpreter with torch, used when torch is not importable here")
    ap.add_argument("--json", help="also write raw results to this file")
    ap.add_argument("--serve", choices=sorted(MAKERS), help=argparse.SUPPRESS)
    ap.add_argument("--peak", choices=sorted(MAKERS), help=argparse.SUPPRESS)
    ap.add_argument("--peak-cfg", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.seq, args.dims, args.reps = "512,1024,2048", "64", 3
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.serve:
        serve(args.serve)
        return
    if args.peak:
        peak_child(args.peak, args.peak_cfg)
        return
    import flash_nif

    seqs = [int(x) for x in args.seq.split(",")]
    dims = [int(x) for x in args.dims.split(",")]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    torch_r, torch_why = (None, "not run (--no-torch)") if args.no_torch else torch_runner(args.torch_python)
    load_before = os.getloadavg()[0]

    rows = []
    for d in dims:
        h = 512 // d
        for causal in causals:
            for s in seqs:
                runners = {"ours": LocalRunner("ours")}
                if torch_r is not None:
                    runners["torch"] = torch_r
                if not args.no_numpy and numpy_needs_bytes(s, h) <= args.numpy_max_gb * 1e9:
                    runners["numpy"] = LocalRunner("numpy")
                row = dict(d=d, h=h, s=s, causal=causal, flops=flops_fwd(s, h, d, causal))
                row.update(measure(runners, s, h, d, causal, args.reps, args.settle))
                for impl in IMPLS:
                    if impl in row:
                        row[impl]["peak"] = (float("nan") if args.no_peak
                                             else peak_in_child(runners[impl].python, impl, s, h, d, causal))
                rows.append(row)
                print(f"done D={d} causal={causal} S={s}", file=sys.stderr, flush=True)
    torch_note = torch_why
    if torch_r is not None:
        if isinstance(torch_r, ChildRunner):
            torch_note = f"torch {torch_r.info['version']} ({torch_r.info['threads']} threads, separate venv)"
        else:
            import torch

            torch_note = f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
        torch_r.close()

    info = flash_nif.info()
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"CPU benchmark, {datetime.date.today().isoformat()}, {cpu}, {os.cpu_count()} cores "
          f"(load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after); "
          f"flash_nif {info.get('version')} ({info.get('threads')} threads); {torch_note}; "
          f"numpy {np.__version__}. fp32, B=1, H·D=512, median of {args.reps} interleaved rounds "
          f"after a warm-up.\n")

    print("| D | causal | S | impl | fwd ms | bwd ms | fwd+bwd ms | fwd GF/s | bwd GF/s | peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for impl in IMPLS:
            m = r.get(impl)
            if m is None:
                continue
            print(f"| {r['d']} | {'yes' if r['causal'] else 'no'} | {r['s']} | {impl} | {fmt_ms(m['fwd'])} | "
                  f"{fmt_ms(m['bwd'])} | {fmt_ms(m['fwd'] + m['bwd'])} | {fmt_gf(r['flops'], m['fwd'])} | "
                  f"{fmt_gf(2.5 * r['flops'], m['bwd'])} | {fmt_mib(m['peak'])} |")

    print("\nSpeed-up of ours (time of the other / ours; > 1 means ours is faster):\n")
    print("| D | causal | S | fwd vs torch | fwd+bwd vs torch | fwd+bwd vs NumPy |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ours = r["ours"]
        tot = ours["fwd"] + ours["bwd"]
        t, n = r.get("torch"), r.get("numpy")
        cells = [
            f"{t['fwd'] / ours['fwd']:.2f}×" if t else "—",
            f"{(t['fwd'] + t['bwd']) / tot:.2f}×" if t else "—",
            f"{(n['fwd'] + n['bwd']) / tot:.2f}×" if n else "—",
        ]
        print(f"| {r['d']} | {'yes' if r['causal'] else 'no'} | {r['s']} | " + " | ".join(cells) + " |")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
