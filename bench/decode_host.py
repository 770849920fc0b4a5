"""Host time of one flash_nif.decode call on the GPU, by part (development tool): the whole call,
the Python side alone (the native call replaced by a no-op), the native call alone (its arguments
captured once and replayed), and torch's own launch of a tiny op for scale. A small cache (B = 1,
S_cache = 256) keeps the GPU ahead of the host, so every number is host time.

    python bench/decode_host.py [--calls 2000] [--formats bf16,8,4]
"""

import argparse
import time

import torch

import flash_nif
from flash_nif import _native


def per_call(fn, calls):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return t * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--formats", default="bf16,8,4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--s-cache", type=int, default=256)
    args = ap.parse_args()
    q = torch.randn(args.batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(args.batch, args.s_cache, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(16, device="cuda")
    print(f"torch tiny add: {per_call(lambda: x.add_(1.0), args.calls):.1f} us")
    print(f"torch.empty x2: {per_call(lambda: (torch.empty((1, 1, 32, 128), dtype=q.dtype, device=q.device), torch.empty((1, 32, 1), dtype=torch.float32, device=q.device)), args.calls):.1f} us")
    print(f"current_stream: {per_call(lambda: torch.cuda.current_stream(q.device).cuda_stream, args.calls):.1f} us")
    real = _native.cuda_decode_device
    for name in args.formats.split(","):
        kc, vc = (k, v) if name == "bf16" else (flash_nif.quantize_kv(t, bits=int(name), group_size=64) for t in (k, v))
        whole = per_call(lambda: flash_nif.decode(q, kc, vc), args.calls)
        captured = {}

        def capture(*a, **kw):
            captured["a"], captured["kw"] = a, kw
            return real(*a, **kw)

        _native.cuda_decode_device = lambda *a, **kw: None
        try:
            python_side = per_call(lambda: flash_nif.decode(q, kc, vc), args.calls)
            _native.cuda_decode_device = capture
            o, lse = flash_nif.decode(q, kc, vc)  # keeps the captured outputs alive
        finally:
            _native.cuda_decode_device = real
        native = per_call(lambda: real(*captured["a"], **captured["kw"]), args.calls)
        print(f"{name}: whole call {whole:.1f} us, Python side {python_side:.1f} us, native call {native:.1f} us")


if __name__ == "__main__":
    main()
