#!/usr/bin/env python3
"""Rotary embeddings (flash_nif.rotary): bandwidth of apply and backward against a plain copy of the
same bytes, in the same run.

The kernels are one pass over x: read x (and the tables' rows, which stay in cache), write y. So the
ceiling is a device copy of x into a new array of x's size, and GB/s counts 2 * x.nbytes per call
(x read, y written) for both. Every call allocates its output, the copy too (``clone`` / ``copy``),
so both pay the same allocation. Median of ``--reps`` after ``--warmup``; the implementations take
turns so background load hits them alike. On a GPU each sample is 10 calls back to back (the
host's per-call work overlaps the kernels, as in a model), divided by 10.

* GPU (``--gpu``; torch if importable, else CuPy): CUDA events on the library's current stream; the
  copy is ``x.clone()`` (torch) or ``x.copy()`` (CuPy). Target: >= 80 % of the copy's GB/s.
* CPU (``--cpu``, the default when no GPU is found): NumPy arrays, wall clock; the copy is
  ``x.copy()`` (NumPy, one thread), the kernel runs on every core (rayon).

Positions are ``None`` (rows 0..S-1) unless ``--offset N``: an int offset costs nothing, while a
positions array on a GPU is copied to the host to be checked (a synchronisation), so it is not
what this measures.

    python bench/rotary.py --cpu [--quick]
    python bench/rotary.py --gpu [--dtypes bf16,f16,f32] [--dims 128,64]

Prints a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import ml_dtypes
import numpy as np

import flash_nif

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def gpu_lib():
    """("torch", module) or ("cupy", module) with a usable GPU, else None."""
    try:
        import torch

        if torch.cuda.is_available():
            return "torch", torch
    except Exception:  # noqa: BLE001
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cupy", cupy
    except Exception:  # noqa: BLE001
        pass
    return None


class Gpu:
    def __init__(self, name, lib):
        self.name, self.lib = name, lib

    def put(self, a: np.ndarray):
        if self.name == "torch":
            t = self.lib.from_numpy(a.astype(np.float32) if a.dtype == ml_dtypes.bfloat16 else a)
            return t.to(self.lib.bfloat16 if a.dtype == ml_dtypes.bfloat16 else t.dtype).cuda()
        if a.dtype == ml_dtypes.bfloat16:
            return self.lib.asarray(a.view(np.uint16)).view(ml_dtypes.bfloat16)
        return self.lib.asarray(a)

    def copy(self, x):
        return x.clone() if self.name == "torch" else x.copy()

    def time_ms(self, fn, warmup, reps, inner):
        if self.name == "torch":
            event, sync = self.lib.cuda.Event, self.lib.cuda.synchronize
        else:
            event, sync = self.lib.cuda.Event, self.lib.cuda.Device().synchronize
        for _ in range(warmup):
            fn()
        sync()
        out = []
        for _ in range(reps):
            a, b = (event(enable_timing=True), event(enable_timing=True)) if self.name == "torch" else (event(), event())
            a.record()
            for _ in range(inner):  # back to back: the host's per-call work overlaps the GPU's
                fn()
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b) if self.name == "torch" else self.lib.cuda.get_elapsed_time(a, b)
            out.append(ms / inner)
        return out

    def device_name(self):
        if self.name == "torch":
            return self.lib.cuda.get_device_name()
        return self.lib.cuda.runtime.getDeviceProperties(0)["name"].decode()


class Cpu:
    name = "numpy"

    @staticmethod
    def put(a):
        return a

    @staticmethod
    def copy(x):
        return x.copy()

    @staticmethod
    def time_ms(fn, warmup, reps, inner):
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - t0) * 1e3 / inner)
        return out

    @staticmethod
    def device_name():
        return f"CPU, {flash_nif.info()['threads']} threads ({flash_nif.info()['cpu_isa']})"


def bench(env, shape, rotary_dim, dtype_name, interleaved, offset, warmup, reps, inner):
    b, s, h, d = shape
    rng = np.random.default_rng(0)
    x = env.put(rng.standard_normal(shape, dtype=np.float32).astype(DTYPES[dtype_name]))
    cos, sin = (env.put(t) for t in flash_nif.rotary.tables(s + offset, rotary_dim))
    kw = dict(interleaved=interleaved, positions=offset or None)
    calls = {
        "copy": lambda: env.copy(x),
        "apply": lambda: flash_nif.rotary.apply(x, cos, sin, **kw),
        "backward": lambda: flash_nif.rotary.backward(x, cos, sin, **kw),
    }
    times = {k: [] for k in calls}
    for _ in range(reps):  # take turns
        for k, fn in calls.items():
            times[k] += env.time_ms(fn, warmup if not times[k] else 0, 1, inner)
    nbytes = 2 * b * s * h * d * np.dtype(DTYPES[dtype_name]).itemsize
    ms = {k: statistics.median(v) for k, v in times.items()}
    gbs = {k: nbytes / (v * 1e-3) / 1e9 for k, v in ms.items()}
    return ms, gbs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--gpu", action="store_true", help="CUDA (torch or CuPy arrays)")
    where.add_argument("--cpu", action="store_true", help="NumPy arrays on the CPU")
    ap.add_argument("--dtypes", default="bf16,f16,f32")
    ap.add_argument("--dims", default="128,64", help="head dims")
    ap.add_argument("--tokens", type=int, default=None, help="B*S (default: 65536 GPU, 8192 CPU)")
    ap.add_argument("--heads", type=int, default=None, help="H (default: 32 GPU, 16 CPU)")
    ap.add_argument("--offset", type=int, default=0, help="int positions offset (default none)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=None, help="default: 20 GPU, 7 CPU")
    ap.add_argument("--quick", action="store_true", help="bf16 and f32, D = 128 only")
    args = ap.parse_args()

    lib = None if args.cpu else gpu_lib()
    if args.gpu and lib is None:
        raise SystemExit("--gpu: neither torch nor CuPy sees a GPU")
    env = Gpu(*lib) if lib else Cpu()
    gpu = lib is not None
    tokens = args.tokens or (65536 if gpu else 8192)
    heads = args.heads or (32 if gpu else 16)
    reps = args.reps or (20 if gpu else 7)
    dtypes = ["bf16", "f32"] if args.quick else args.dtypes.split(",")
    dims = [128] if args.quick else [int(x) for x in args.dims.split(",")]

    print(f"## rotary, {datetime.date.today()}, {env.device_name()} ({env.name} arrays)\n")
    print(f"B*S = {tokens} (B = 4), H = {heads}, positions {'offset ' + str(args.offset) if args.offset else 'None'}; "
          f"GB/s = 2 * x.nbytes / time; median of {reps}\n")
    print("| dtype | D | R | layout | MiB of x | copy GB/s | apply GB/s | backward GB/s | apply / copy | "
          "backward / copy | apply ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype_name in dtypes:
        for d in dims:
            for r, interleaved in ((d, False), (d, True), (d // 2, False)):
                shape = (4, tokens // 4, heads, d)
                ms, gbs = bench(env, shape, r, dtype_name, interleaved, args.offset, args.warmup, reps, 10 if gpu else 1)
                mib = np.prod(shape) * np.dtype(DTYPES[dtype_name]).itemsize / 2**20
                print(f"| {dtype_name} | {d} | {r} | {'gptj' if interleaved else 'neox'} | {mib:.0f} | "
                      f"{gbs['copy']:.0f} | {gbs['apply']:.0f} | {gbs['backward']:.0f} | "
                      f"{gbs['apply'] / gbs['copy']:.2f} | {gbs['backward'] / gbs['copy']:.2f} | {ms['apply']:.3f} |",
                      flush=True)


if __name__ == "__main__":
    main()
