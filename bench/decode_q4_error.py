"""How the 4-bit tensor-core decode kernel's arithmetic (cuda/decode_q4.h) errs, emulated in float64
on the CPU (development tool; no GPU): the GPU test case that two earlier versions failed (bf16,
B = 3, S_cache = 300, ragged rows with left padding, Hkv = 2, GQA 4, Sq = 1, groups of 64), each
variant of the P V product against the float64 oracle over the exact dequantized cache (``exact``)
and over the cache rounded to bf16 (``rounded``), as error / the output's own rounding (the GPU
tests' bound is 2):

    python bench/decode_q4_error.py [head_dim ...]

Variants: ``exact P`` (no rounding but the output's), ``round P`` (P to bf16, exact values),
``dequantize`` (P and the values to bf16: the 8-bit kernel's arithmetic), ``codes`` (P * scale to
bf16 times the codes, the bias term in f32: the uncentred version), ``centred codes`` (the same
with codes - 8 and bias + 8 scale: the kernel's). Then the magic offset M = 128 in f32 accumulators
(each 16-key block's sum rounded to f32 as it is added): ``per block`` (each block's products take
(M + 8) off, today's kernel) and ``at the end`` (the codes' products and the sums of P * scale
accumulated apart, (M + 8) times the sums taken off once: branch decode-q4-endcancel).

    python bench/decode_q4_error.py [head_dim ...] [--long]   (--long: one row of 8192 keys)
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

import flash_nif as fa
from flash_nif import reference as ref

BF16 = ml_dtypes.bfloat16


def bf16(x):
    return np.asarray(x, np.float32).astype(BF16).astype(np.float64)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def parts(x, gs):
    """The cache's exact values, scales and biases per element, and its bf16-rounded values."""
    c = fa.quantize_kv(x, bits=4, group_size=gs)
    exact = ref.dequantize_kv(ref.QuantizedKV(*(np.asarray(a) for a in (c.values, c.scales, c.biases)), 4, gs))
    scale = np.repeat(np.asarray(c.scales).astype(np.float64), gs, -1)
    bias = np.repeat(np.asarray(c.biases).astype(np.float64), gs, -1)
    return exact, scale, bias, np.asarray(fa.dequantize_kv(c)).astype(np.float64)


M = 128.0  # the bf16 magic: codes enter the mma as M + c


def f32_blocks(terms):
    """Sum over axis 0 in f32 accumulators, 16 keys (one mma) at a time, each block exact."""
    acc = np.zeros(terms.shape[1:], np.float32)
    for k0 in range(0, terms.shape[0], 16):
        acc = (acc.astype(np.float64) + terms[k0:k0 + 16].sum(0)).astype(np.float32)
    return acc.astype(np.float64)


def main(dims, long):
    b, s_cache, hkv, group, gs = 3, 300, 2, 4, 64
    seqlens, leftpad = np.array((300, 123, 0), np.int32), np.array((10, 0, 0), np.int32)
    if long:
        b, s_cache = 1, 8192
        seqlens, leftpad = np.array((8192,), np.int32), np.array((0,), np.int32)
    for d in dims:
        seed = d + 1  # the GPU test's seed for Sq = 1
        q = np.random.default_rng(seed).standard_normal((b, 1, hkv * group, d)).astype(BF16)
        k, v = (np.random.default_rng(seed + i).standard_normal((b, s_cache, hkv, d)).astype(BF16) for i in (1, 2))
        kx, _, _, kr = parts(k, gs)
        vx, vs, vb, vr = parts(v, gs)
        codes = np.rint((vx - vb) / vs)
        rows = dict(cache_seqlens=seqlens, leftpad_k=leftpad)
        want_x = np.asarray(ref.decode(q, kx, vx, **rows)[0], np.float64)
        want_r = np.asarray(ref.decode(q, kr, vr, **rows)[0], np.float64)
        qf = q.astype(np.float64)

        def run(pv):
            o = np.zeros_like(want_x)
            for bb in range(b):
                lo, hi = leftpad[bb], seqlens[bb]
                for h in range(hkv * group if hi > lo else 0):
                    kv = h // group
                    sc = kx[bb, lo:hi, kv] @ qf[bb, 0, h] / np.sqrt(d)
                    p = np.exp2(((sc - sc.max()) * np.log2(np.e)).astype(np.float32)).astype(np.float64)
                    at = (bb, slice(lo, hi), kv)
                    o[bb, 0, h] = pv(p[:, None], at) / p.sum()
            return o

        variants = {
            "exact P": lambda p, at: (p * vx[at]).sum(0),
            "round P": lambda p, at: (bf16(p) * vx[at]).sum(0),
            "dequantize": lambda p, at: (bf16(p) * vr[at]).sum(0),
            "codes": lambda p, at: (bf16(p * vs[at]) * codes[at]).sum(0) + (p * vb[at]).sum(0),
            "centred codes": lambda p, at: (bf16(p * vs[at]) * (codes[at] - 8)).sum(0) + (p * (vb + 8 * vs)[at]).sum(0),
            "per block": lambda p, at: f32_blocks(bf16(p * vs[at]) * (M + codes[at]) - (M + 8) * bf16(p * vs[at]))
            + (p * (vb + 8 * vs)[at]).sum(0),
            "at the end": lambda p, at: f32_blocks(bf16(p * vs[at]) * (M + codes[at])) - (M + 8) * f32_blocks(bf16(p * vs[at]))
            + (p * (vb + 8 * vs)[at]).sum(0),
        }
        base_x, base_r = rel(bf16(want_x), want_x), rel(bf16(want_r), want_r)
        print(f"D = {d}: output rounding {base_x:.3g} (exact cache), {base_r:.3g} (rounded cache)")
        for name, pv in variants.items():
            o = bf16(run(pv))
            print(f"  {name:14s} error / rounding: exact {rel(o, want_x) / base_x:.2f}, rounded {rel(o, want_r) / base_r:.2f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:] if a != "--long"] or [64, 128], "--long" in sys.argv[1:])
