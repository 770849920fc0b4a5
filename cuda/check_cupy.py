"""Kernel-level check of cuda/*.cu through CuPy (NVRTC) against a float64 torch oracle.

Development harness for the GPU machine, independent of the Rust launcher: it compiles the same
variants (python/flash_nif/kernels.py), launches them by hand with the params struct, poisons
every output first and prints relative errors per case, then a short timing table against torch
SDPA. Usage: python3 cuda/check_cupy.py [--quick] [--bench]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import math
import pathlib
import sys
import time

import cupy as cp
import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("kernels", ROOT / "python" / "flash_nif" / "kernels.py")
K = importlib.util.module_from_spec(spec)
sys.modules["kernels"] = K
spec.loader.exec_module(K)


class Params(ctypes.Structure):
    """FlashParams (cuda/params.h). Positional: the 11 pointers q .. lse_log2, then the scalars;
    dq_accum (the atomic-dQ workspace) only by keyword."""
    _fields_ = [(n, ctypes.c_void_p) for n in
                ("q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv", "delta", "lse_log2", "dq_accum")] + [
        ("batch", ctypes.c_int), ("seqlen_q", ctypes.c_int), ("seqlen_k", ctypes.c_int),
        ("heads", ctypes.c_int), ("heads_kv", ctypes.c_int), ("scale", ctypes.c_float),
        ("scale_log2", ctypes.c_float), ("_pad", ctypes.c_int)]

    def __init__(self, *args, dq_accum=0):
        super().__init__(*args[:11], dq_accum, *args[11:])


_mods = {}


def get_fn(v):
    key = (v.source, v.defines)
    if key not in _mods:
        src = K.expand_source(v.source, ROOT / "cuda")
        opts = tuple(o for o in v.options("x") if not o.startswith("-arch"))  # CuPy adds the arch
        mod = cp.RawModule(code=src, options=opts, backend="nvrtc")
        fn = mod.get_function(v.entry)
        smem = v.smem_bytes()
        if smem > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = smem
        _mods[key] = (mod, fn)
    return _mods[key][1]


def launch(v, grid, p):
    fn = get_fn(v)
    params = ctypes.pointer(p)
    argv = (ctypes.c_void_p * 1)(ctypes.cast(params, ctypes.c_void_p))
    if all(g > 0 for g in grid):
        cp.cuda.driver.launchKernel(fn.kernel.ptr, grid[0], grid[1], grid[2], v.threads, 1, 1, v.smem_bytes(),
                                    cp.cuda.get_current_stream().ptr, ctypes.addressof(argv), 0)
    return params, argv


CP_DT = {"f32": cp.float32, "f16": cp.float16, "bf16": None}
T_DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def ptr(t):
    return t.data_ptr() if t is not None else 0


def run_ours(dt, q, k, v, do, causal, scale, want_bwd=True):
    """q..do: torch tensors on the GPU in T_DT[dt]; returns o, lse, dq, dk, dv (torch)."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    em = False
    en = False
    o = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device=q.device, dtype=torch.float32)
    p = Params(ptr(q), ptr(k), ptr(v), ptr(o), ptr(lse), ptr(do), 0, 0, 0, 0, 0,
               b, sq, sk, h, hkv, scale, scale * math.log2(math.e), 0)
    vf = K.variant("fwd", dt, d, causal, g, em, en)
    keep = [launch(vf, (-(-sq // vf.block_m), h, b), p)]
    if not want_bwd:
        torch.cuda.synchronize()
        return o, lse
    dq = torch.full_like(q, float("nan"))
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    delta = torch.full((b, h, sq), float("nan"), device=q.device, dtype=torch.float32)
    l2 = torch.full_like(delta, float("nan"))
    p2 = Params(ptr(q), ptr(k), ptr(v), ptr(o), ptr(lse), ptr(do), ptr(dq), ptr(dk), ptr(dv), ptr(delta), ptr(l2),
                b, sq, sk, h, hkv, scale, scale * math.log2(math.e), 0)
    vp = K.variant("bwd_preprocess", dt, d)
    keep.append(launch(vp, (-(-(b * sq * h) // 8), 1, 1), p2))
    vq = K.variant("bwd_dq", dt, d, causal, g, em, en)
    keep.append(launch(vq, (-(-sq // vq.block_m), h, b), p2))
    vk = K.variant("bwd_dkdv", dt, d, causal, g, em, en)
    keep.append(launch(vk, (-(-sk // vk.block_n), hkv, b), p2))
    torch.cuda.synchronize()
    return o, lse, dq, dk, dv


def reference(q, k, v, do, causal, scale):
    """float64 oracle (materialised) with the project's conventions."""
    q, k, v, do = (x.double() for x in (q, k, v, do))
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    qh = q.permute(0, 2, 1, 3)
    kh = k.permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    vh = v.permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    doh = do.permute(0, 2, 1, 3)
    s = qh @ kh.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(~(j <= i + sk - sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    pm = torch.exp(s - lse[..., None])
    pm = torch.nan_to_num(pm, nan=0.0)
    o = pm @ vh
    dv = pm.transpose(-1, -2) @ doh
    dp = doh @ vh.transpose(-1, -2)
    delta = (doh * o).sum(-1, keepdim=True)
    ds = pm * (dp - delta)
    dq = ds @ kh * scale
    dk = ds.transpose(-1, -2) @ qh * scale
    dk = dk.reshape(b, hkv, g, sk, d).sum(2)
    dv = dv.reshape(b, hkv, g, sk, d).sum(2)
    back = lambda x: x.permute(0, 2, 1, 3).contiguous()  # noqa: E731
    return back(o), lse, back(dq), back(dk), back(dv)


def rel_err(got, want):
    got = got.double()
    fin = torch.isfinite(want)
    if not torch.equal(fin, torch.isfinite(got)):
        return float("inf")
    if not torch.equal(got[~fin], want[~fin]):
        return float("inf")
    den = want[fin].norm().item()
    num = (got[fin] - want[fin]).norm().item()
    return num / den if den > 0 else num


def check(args):
    cases = []
    shapes = [  # b, sq, sk, h, hkv
        (2, 97, 97, 4, 2),
        (1, 1, 1000, 4, 1),
        (1, 1000, 97, 2, 2),
        (2, 128, 256, 4, 4),
        (1, 256, 128, 6, 2),
    ]
    dims = [8, 40, 64, 72, 128, 136, 256] if not args.quick else [64, 128]
    for dt in ("bf16", "f16", "f32"):
        for d in dims:
            for causal in (False, True):
                for si, shp in enumerate(shapes):
                    if d not in (64, 128) and si not in (0, 2):
                        continue
                    cases.append((dt, d, causal, shp))
    worst = {}
    nfail = 0
    torch.manual_seed(0)
    t0 = time.time()
    for dt, d, causal, (b, sq, sk, h, hkv) in cases:
        q = torch.randn(b, sq, h, d, device="cuda").to(T_DT[dt])
        k = torch.randn(b, sk, hkv, d, device="cuda").to(T_DT[dt])
        v = torch.randn(b, sk, hkv, d, device="cuda").to(T_DT[dt])
        do = torch.randn(b, sq, h, d, device="cuda").to(T_DT[dt])
        scale = 1.0 / math.sqrt(d)
        outs = run_ours(dt, q, k, v, do, causal, scale)
        refs = reference(q, k, v, do, causal, scale)
        errs = {}
        ok = True
        for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), outs, refs):
            e = rel_err(got, want)
            if name == "lse" or dt == "f32":
                tol = 1e-5 if dt == "f32" else 1e-5
                base = 0.0
            else:
                base = rel_err(want.to(T_DT[dt]), want)
                tol = 2 * base + 1e-5
            errs[name] = (e, base)
            key = (dt, name)
            worst[key] = max(worst.get(key, 0.0), e)
            if not (e <= tol):
                ok = False
        nfail += not ok
        flag = "ok " if ok else "FAIL"
        es = " ".join(f"{n}={e:.1e}/{b_:.0e}" for n, (e, b_) in errs.items())
        print(f"{flag} {dt:4s} d={d:3d} causal={int(causal)} b={b} sq={sq} sk={sk} h={h} hkv={hkv}: {es}", flush=True)
    print(f"{len(cases)} cases, {nfail} failed, {time.time() - t0:.1f}s")
    for dt in ("f32", "f16", "bf16"):
        print(dt, " ".join(f"{n}={worst.get((dt, n), 0):.2e}" for n in ("o", "lse", "dq", "dk", "dv")))
    # determinism
    q = torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    a = run_ours("bf16", q, k, v, do, True, 0.1)
    c = run_ours("bf16", q, k, v, do, True, 0.1)
    print("deterministic:", all(torch.equal(x, y) for x, y in zip(a, c)))
    return nfail


def bench():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def timeit(fn, reps=10, warm=3):
        for _ in range(warm):
            fn()
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        return sorted(ts)[len(ts) // 2]

    print(f"{'cfg':28s} {'ours fwd':>9s} {'ours bwd':>9s} {'fa2 fwd':>8s} {'fa2 bwd':>8s} {'cudnn f':>8s} {'cudnn b':>8s}")
    for d in (64, 128):
        for s_, causal in ((2048, False), (2048, True), (8192, False), (16384, True)):
            b = 16384 // s_
            h = 2048 // d
            q = torch.randn(b, s_, h, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn_like(q)
            v = torch.randn_like(q)
            do = torch.randn_like(q)
            flops = 4 * b * h * s_ * s_ * d / (2 if causal else 1)
            scale = 1 / math.sqrt(d)
            tf = timeit(lambda: run_ours("bf16", q, k, v, do, causal, scale, want_bwd=False))
            tfb = timeit(lambda: run_ours("bf16", q, k, v, do, causal, scale))
            res = [flops / tf / 1e9, 2.5 * flops / (tfb - tf) / 1e9]
            qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
            dot = do.transpose(1, 2)
            for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                with sdpa_kernel(be):
                    f = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
                    t1 = timeit(f)
                    t2 = timeit(lambda: torch.autograd.grad(f(), (qt, kt, vt), dot))
                    res += [flops / t1 / 1e9, 2.5 * flops / (t2 - t1) / 1e9]
            print(f"d={d} S={s_} causal={int(causal)}".ljust(28) + " ".join(f"{x:9.0f}" for x in res), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bench", action="store_true")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), "cupy", cp.__version__, "nvrtc", cp.cuda.nvrtc.getVersion())
    nf = check(a)
    if a.bench:
        bench()
    sys.exit(1 if nf else 0)
