"""Decode bandwidth on the CPU: flash_nif.decode over a KV cache larger than the L3, plain (bf16)
and quantized (8- and 4-bit), against a memcpy of a large array in the same run.

Effective bandwidth = bytes of the cache read (K and V values, scales, biases) / time; the copy's
rate counts bytes read plus written. Median of --reps after a warm-up.

    python bench/decode.py [--tokens 262144] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import flash_nif


def median_time(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=262144, help="B * S_cache cached tokens")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    b, hkv, h, d = 4, 8, 32, 128
    s = args.tokens // b
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, 1, h, d)).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((b, s, hkv, d)).astype(ml_dtypes.bfloat16) for _ in range(2))
    big = np.ones(k.nbytes // 8 * 2, np.float64)
    dst = np.empty_like(big)
    t = median_time(lambda: np.copyto(dst, big), args.reps)
    copy_rate = 2 * big.nbytes / t
    print(f"{flash_nif.info()['threads']} threads; B={b} S_cache={s} Hkv={hkv} H={h} D={d}, Sq=1, bf16 q")
    print(f"copy: {copy_rate / 1e9:.1f} GB/s (read + written)")
    print("| cache | bytes read (MB) | time (ms) | GB/s | % of copy |")
    print("|---|---|---|---|---|")
    for name, bits in (("bf16", None), ("8-bit", 8), ("4-bit", 4)):
        if bits is None:
            kc, vc = k, v
            nbytes = k.nbytes + v.nbytes
        else:
            kc, vc = (flash_nif.quantize_kv(x, bits=bits, group_size=64) for x in (k, v))
            nbytes = sum(a.nbytes for c in (kc, vc) for a in (c.values, c.scales, c.biases))
        t = median_time(lambda: flash_nif.decode(q, kc, vc), args.reps)
        rate = nbytes / t
        print(f"| {name} | {nbytes / 1e6:.0f} | {t * 1e3:.1f} | {rate / 1e9:.2f} | {100 * rate / copy_rate:.0f} % |")


if __name__ == "__main__":
    main()
