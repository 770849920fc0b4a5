"""probe_decode_copy.py — development probe: the copy rate of decode's 4-bit stages by cp.async
against the tensor copy engine (tools/probe_decode_copy.cu), no compute, with a torch copy's
rate in the same run.

Here:   .venv/bin/python tools/probe_decode_copy.py --compile dist/probe   (NVRTC, sm_90a cubin)
There:  python3 tools/probe_decode_copy.py --run dist/probe/probe.cubin    (needs torch and a GPU)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_cubin(out: str) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import nvrtc_sass as ns

    src = open(os.path.join(ROOT, "tools", "probe_decode_copy.cu")).read().replace('#include "hopper.h"', "")
    src = ns.expand("hopper.h", set()) + src
    opts = ["-arch=sm_90a", "-std=c++17", "-default-device", "-DFLASH_DTYPE=1", "-DHEAD_DIM=128", "-Xptxas=-v"]
    cubin, log = ns.nvrtc(src, "probe_decode_copy.cu", opts)
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "probe.cubin"), "wb").write(cubin)
    print(" ".join(l.strip() for l in log.splitlines() if "registers" in l or "spill" in l))


class Params(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("sc", ctypes.c_void_p * 4), ("s", ctypes.c_int),
                ("hkv", ctypes.c_int), ("keys", ctypes.c_int), ("use_tma", ctypes.c_int), ("scales", ctypes.c_int),
                ("sink", ctypes.c_void_p)]


def run(cubin: str) -> None:
    import torch

    cu = ctypes.CDLL("libcuda.so.1")
    torch.zeros(1, device="cuda")
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    data = open(cubin, "rb").read()
    assert cu.cuModuleLoadData(ctypes.byref(mod), data) == 0
    assert cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"probe") == 0
    B, S, H = 8, 8192, 8
    k = torch.randint(0, 255, (B, S, H, 64), dtype=torch.uint8, device="cuda")
    v = torch.randint(0, 255, (B, S, H, 64), dtype=torch.uint8, device="cuda")
    sc = [torch.randn(B, S, H, 2, device="cuda").to(torch.bfloat16) for _ in range(4)]
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")

    def tmap(t, box0=64, swizzle=2):
        m = (ctypes.c_uint64 * 16)()
        dims = (ctypes.c_uint64 * 2)(H * 64, B * S)
        strides = (ctypes.c_uint64 * 1)(H * 64)
        box = (ctypes.c_uint32 * 2)(box0, 16)
        es = (ctypes.c_uint32 * 2)(1, 1)
        # uint8, interleave none, swizzle 64B, L2 promotion 128B, no OOB fill
        rc = cu.cuTensorMapEncodeTiled(m, 0, 2, ctypes.c_void_p(t.data_ptr()), dims, strides, box, es, 0, swizzle, 2, 0)
        assert rc == 0, rc
        return m

    tk, tv = tmap(k), tmap(v)
    tk80, tv80 = tmap(k, 80, 0), tmap(v, 80, 0)
    code_bytes = k.numel() * 2
    scale_bytes = sum(s.numel() * 2 for s in sc)
    smem = 2 * (128 * 2 * 80 + 128 * 16)
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from decode import gpu_time  # CUDA events around back-to-back calls, the median of the rounds

    def timed(f):
        return gpu_time(torch, f, 20, 5) * 1e6  # us

    copy_us = timed(lambda: dst.copy_(src))
    copy_rate = 2 * src.numel() / copy_us / 1e3
    print(f"copy: {copy_rate:.0f} GB/s (read + written)")
    for splits in (8,):
        keys = S // splits
        for use_tma in (0, 1, 2):
            for scales in (0, 1):
                p = Params(k.data_ptr(), v.data_ptr(), (ctypes.c_void_p * 4)(*[s.data_ptr() for s in sc]), S, H, keys, use_tma,
                           scales, sink.data_ptr())
                args = (ctypes.c_void_p * 5)(ctypes.addressof(p), ctypes.addressof(tk), ctypes.addressof(tv), ctypes.addressof(tk80),
                                              ctypes.addressof(tv80))

                def launch():
                    rc = cu.cuLaunchKernel(fn, H * splits, B, 1, 128, 1, 1, smem, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                                           args, None)
                    assert rc == 0, rc

                launch()
                torch.cuda.synchronize()
                us = timed(launch)
                nbytes = code_bytes + (scale_bytes if scales else 0)
                rate = nbytes / us / 1e3
                print(f"splits {splits} {['cp.async', 'tma 64  ', 'tma 80  '][use_tma]} scales {scales}: {us:6.1f} us, "
                      f"{rate:5.0f} GB/s, {100 * rate / copy_rate:3.0f} % of copy")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", metavar="DIR")
    ap.add_argument("--run", metavar="CUBIN")
    a = ap.parse_args()
    if a.compile:
        compile_cubin(a.compile)
    if a.run:
        run(a.run)
