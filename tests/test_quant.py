"""Quantized KV caches and merged attention states (flash_nif.quantize_kv, dequantize_kv,
merge_states) on the CPU against the float64 oracle: the codes, scales and biases bit for bit
(the format is defined in float32 arithmetic), the dequantized cache within rounding, merged
states against attention over the union of the key sets."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def cache(seed, shape, dtype):
    return (np.random.default_rng(seed).standard_normal(shape) * 2).astype(dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("dtype_name", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_quantize_is_the_oracles_bit_for_bit(fa, ref, bits, group_size, dtype_name, d):
    x = cache(bits + d, (2, 37, 3, d), DTYPES[dtype_name])
    x[0, 0, 0, :group_size] = 1.5  # a constant group: scale 0, codes 0
    got, want = fa.quantize_kv(x, bits=bits, group_size=group_size), ref.quantize_kv(x, bits=bits, group_size=group_size)
    assert got.shape == x.shape and got.dtype == x.dtype and (got.bits, got.group_size) == (bits, group_size)
    np.testing.assert_array_equal(got.values, want.values)
    for a, b in ((got.scales, want.scales), (got.biases, want.biases)):
        assert a.dtype == x.dtype
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    deq = fa.dequantize_kv(got)
    assert deq.dtype == x.dtype and deq.shape == x.shape
    exact = ref.dequantize_kv(want)
    # scale * q + bias in f32 (two roundings of terms as large as |bias| and the group's range),
    # then one rounding to the dtype.
    terms = (np.abs(want.biases.astype(np.float64)) + want.scales.astype(np.float64) * (2**bits - 1)).repeat(group_size, -1)
    tol = terms * 2.4e-7 + np.abs(exact) * {"f32": 0, "f16": 2**-11, "bf16": 2**-8}[dtype_name]
    assert np.all(np.abs(deq.astype(np.float64) - exact) <= tol)
    np.testing.assert_array_equal(deq[0, 0, 0, :group_size].astype(np.float32), 1.5)


@pytest.mark.parametrize("kw, err, match", [
    (dict(bits=3), "UnsupportedError", "bits"),
    (dict(group_size=48), "UnsupportedError", "group_size"),
    (dict(group_size=64, shape=(1, 2, 1, 96)), "ShapeError", "multiple of group_size"),
    (dict(shape=(2, 1, 64)), "ShapeError", r"\[B, S, Hkv, D\]"),
    (dict(dtype=np.float64), "DTypeError", "float64"),
])
def test_quantize_errors(fa, kw, err, match):
    shape, dtype = kw.pop("shape", (1, 2, 1, 64)), kw.pop("dtype", np.float32)
    with pytest.raises(getattr(fa, err), match=match):
        fa.quantize_kv(np.ones(shape, dtype), **kw)


def test_dequantize_checks_its_parts(fa):
    c = fa.quantize_kv(cache(0, (1, 4, 2, 64), np.float32), bits=8, group_size=32)
    with pytest.raises(fa.ShapeError, match="scales"):
        fa.dequantize_kv(fa.QuantizedKV(c.values, c.scales[:, :2], c.biases, 8, 32))
    with pytest.raises(fa.DTypeError, match="one dtype"):
        fa.dequantize_kv(fa.QuantizedKV(c.values, c.scales, c.biases.astype(np.float16), 8, 32))
    with pytest.raises(fa.DTypeError, match="uint32"):
        fa.dequantize_kv(fa.QuantizedKV(c.values.astype(np.int64), c.scales, c.biases, 8, 32))


@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
def test_merge_states_is_attention_over_the_union(fa, ref, assert_close_to_oracle, dtype_name):
    """Attention over three disjoint key ranges (one empty), merged, against the oracle over all
    keys; and in the public API's list form."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 5, 4, 32), (2, 50, 2, 32), (2, 50, 2, 32)))
    cuts = [(0, 20), (20, 20), (20, 50)]
    parts = [fa.forward_with_states(q, k[:, a:b], v[:, a:b], causal=False) for a, b in cuts]
    o, lse = fa.merge_states([p[0].astype(dtype) for p in parts], [p[1] for p in parts])
    ro, rlse = ref.forward_with_states(q, k, v, causal=False)
    assert o.dtype == dtype and lse.dtype == np.float32
    assert_close_to_oracle("o", o, ro, dtype, "merge")
    assert_close_to_oracle("lse", lse, rlse, np.float32, "merge")
    o2, lse2 = fa.merge_states(np.stack([p[0].astype(dtype) for p in parts]), np.stack([p[1] for p in parts]))
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal(lse2, lse)


def test_merge_states_rows_no_part_saw(fa):
    o_parts = np.ones((2, 1, 3, 2, 4), np.float32)
    lse_parts = np.full((2, 1, 2, 3), -np.inf, np.float32)
    lse_parts[1, 0, 0, 1] = 0.25
    o, lse = fa.merge_states(o_parts, lse_parts)
    assert lse[0, 0, 1] == np.float32(0.25) and np.isneginf(np.delete(lse.ravel(), 1)).all()
    assert np.all(o[0, 1, 0] == 1) and np.count_nonzero(o) == 4 and not np.isnan(o).any()


def test_merge_states_errors(fa):
    with pytest.raises(fa.ShapeError, match=r"\[P, B, H, Sq\]"):
        fa.merge_states(np.zeros((2, 1, 3, 2, 4), np.float32), np.zeros((2, 1, 3, 2), np.float32))
    with pytest.raises(fa.DTypeError, match="float32"):
        fa.merge_states(np.zeros((2, 1, 3, 2, 4), np.float32), np.zeros((2, 1, 2, 3), np.float64))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, group", [(1, 4), (4, 1), (16, 8)])
@pytest.mark.parametrize("quant", [None, (8, 32), (4, 64)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_decode_against_the_oracle(fa, ref, assert_close_to_oracle, d, sq, group, quant, dtype):
    """Ragged cache lengths (one 0), left padding, GQA, split keys, plain and quantized caches; bf16
    over a plain cache takes the bf16 dot products where the CPU has AVX512-BF16 (P rounded to
    bf16 there, as on the GPU: o within the dtype's bound)."""
    b, s_cache, hkv = 3, 300, 2
    rng = np.random.default_rng(d + sq)
    q = rng.standard_normal((b, sq, hkv * group, d)).astype(dtype)
    k, v = (rng.standard_normal((b, s_cache, hkv, d)).astype(dtype) for _ in range(2))
    seqlens, leftpad = np.array([300, 123, 0], np.int32), np.array([10, 0, 0], np.int32)
    kc, vc = (k, v) if quant is None else (fa.quantize_kv(x, bits=quant[0], group_size=quant[1]) for x in (k, v))
    rk, rv = (k, v) if quant is None else (ref.dequantize_kv(ref.quantize_kv(x, bits=quant[0], group_size=quant[1])) for x in (k, v))
    want = ref.decode(q, rk, rv, cache_seqlens=seqlens, leftpad_k=leftpad)
    for splits in (None, 1, 5):
        o, lse = fa.decode(q, kc, vc, cache_seqlens=seqlens, leftpad_k=leftpad, num_splits=splits)
        ctx = f"d={d} sq={sq} group={group} quant={quant} splits={splits}"
        assert_close_to_oracle("o", o, want[0], dtype, ctx)
        assert_close_to_oracle("lse", lse, want[1], np.float32, ctx)
        assert np.all(o[2].astype(np.float32) == 0) and np.isneginf(lse[2]).all()


def test_decode_options_against_the_oracle(fa, ref, assert_close_to_oracle):
    b, sq, s_cache, h, hkv, d = 2, 4, 200, 4, 2, 64
    rng = np.random.default_rng(9)
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, s_cache, hkv, d)).astype(np.float32) for _ in range(2))
    seqlens = np.array([200, 77], np.int32)
    for opts in (dict(causal=False), dict(window=(16, None)), dict(softcap=2.0, scale=0.3), dict(causal=False, window=(5, 3))):
        o, lse = fa.decode(q, k, v, cache_seqlens=seqlens, **opts)
        ro, rlse = ref.decode(q, k, v, cache_seqlens=seqlens, **opts)
        assert_close_to_oracle("o", o, ro, np.float32, str(opts))
        assert_close_to_oracle("lse", lse, rlse, np.float32, str(opts))


def test_decode_errors(fa):
    q = np.ones((1, 1, 2, 64), np.float32)
    k = np.ones((1, 8, 1, 64), np.float32)
    with pytest.raises(fa.ShapeError, match="cache_seqlens"):
        fa.decode(q, k, k, cache_seqlens=np.array([9], np.int32))
    with pytest.raises(fa.ShapeError, match="1 to 16"):
        fa.decode(np.ones((1, 17, 2, 64), np.float32), k, k)
    with pytest.raises(fa.DTypeError, match="must match"):
        fa.decode(q.astype(np.float16), k, k)
    with pytest.raises(fa.UnsupportedError, match="device"):
        fa.decode(q, k, k, device="tpu")


def test_a_missing_gpu_is_an_error_not_a_cpu_run(fa):
    """device="cuda" with NumPy arrays runs on GPU 0; without one it raises, never falls back."""
    if fa.info()["cuda"].get("available"):
        pytest.skip("a GPU is present: tests/test_decode_gpu.py runs these")
    x = cache(1, (1, 4, 1, 64), np.float32)
    q = np.ones((1, 1, 2, 64), np.float32)
    c = fa.quantize_kv(x, bits=8, group_size=32)
    calls = [
        lambda: fa.decode(q, x, x, device="cuda"),
        lambda: fa.quantize_kv(x, device="cuda"),
        lambda: fa.dequantize_kv(c, device="cuda"),
        lambda: fa.merge_states(np.zeros((2, 1, 1, 2, 4), np.float32), np.zeros((2, 1, 2, 1), np.float32), device="cuda"),
    ]
    for call in calls:
        with pytest.raises(fa.DeviceError):
            call()
