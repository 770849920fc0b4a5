"""CPU backend against the float64 oracle: every option, dtype and odd size.

Tolerances (see ``conftest.assert_close_to_oracle``):

* float32: relative norm error ``||x - ref|| / ||ref|| <= 1e-5`` for o, lse
  and each gradient, end to end (the oracle's own o / lse feed its backward).
* float16 / bfloat16: at most ``2 * baseline + 1e-5``, where baseline is the
  error of the oracle's float64 result merely rounded to the dtype. The oracle
  sees the same dtype-valued inputs; for the backward it is given the
  kernel's own (dtype-rounded) o and f32 lse, as delta = rowsum(dO * O)
  depends on the stored o.
* lse is float32 for every dtype and is held to 1e-5.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}

# (B, Sq, Sk, H, Hkv, D)
SHAPES = [
    pytest.param(2, 128, 128, 4, 4, 64, id="b2-s128-d64"),
    pytest.param(1, 1, 1, 1, 1, 8, id="s1-d8"),
    pytest.param(2, 1, 97, 4, 2, 40, id="decode-sq1-sk97-gqa-d40"),
    pytest.param(1, 97, 97, 3, 3, 72, id="s97-d72"),
    pytest.param(2, 97, 40, 4, 1, 40, id="sq97>sk40-mqa-d40"),
    pytest.param(1, 50, 130, 6, 2, 8, id="sq50<sk130-gqa-d8"),
    pytest.param(1, 70, 90, 2, 1, 256, id="d256-mqa"),
    pytest.param(1, 33, 45, 2, 1, 3, id="d3-odd"),
    pytest.param(1, 19, 23, 2, 2, 1, id="d1"),
    pytest.param(1, 65, 66, 2, 2, 130, id="d130-simd-tail"),
    pytest.param(1, 300, 20, 2, 1, 32, id="sq300>>sk20-many-empty-rows"),
]


def run_and_check(fa, ref, make_inputs, assert_close_to_oracle, record_error, shape, dtype_name,
                  causal, scale=None, q_scale=1.0, seed=0):
    """Forward + backward through the kernel, each output against the oracle."""
    b, sq, sk, h, hkv, d = shape
    dtype = DTYPES[dtype_name]
    q, k, v, do = make_inputs(seed, b, sq, sk, h, hkv, d, dtype, q_scale)
    ctx = f"shape={shape} causal={causal} scale={scale}"

    o, lse = fa.forward_with_states(q, k, v, causal=causal, scale=scale)
    assert o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (b, h, sq)
    o_ref, lse_ref = ref.forward_with_states(q, k, v, causal=causal, scale=scale)
    record_error(dtype_name, "o", assert_close_to_oracle("o", o, o_ref, dtype, ctx))
    record_error(dtype_name, "lse", assert_close_to_oracle("lse", lse, lse_ref, np.float32, ctx))
    np.testing.assert_array_equal(fa.forward(q, k, v, causal=causal, scale=scale), o)

    dq, dk, dv = fa.backward(do, q, k, v, o, lse, causal=causal, scale=scale)
    assert dq.dtype == dtype and dq.shape == q.shape
    assert dk.dtype == dtype and dk.shape == k.shape
    assert dv.dtype == dtype and dv.shape == v.shape
    if dtype is np.float32:
        grads_ref = ref.backward(do, q, k, v, o_ref, lse_ref, causal=causal, scale=scale)
    else:
        grads_ref = ref.backward(do, q, k, v, o, lse, causal=causal, scale=scale)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref):
        record_error(dtype_name, name, assert_close_to_oracle(name, got, want, dtype, ctx))

    # rows that see no key (causal, Sq > Sk): exact zeros and -inf, never NaN
    empty = sq - sk if causal and sq > sk else 0
    if empty:
        assert np.all(o[:, :empty].astype(np.float32) == 0.0)
        assert np.all(np.isneginf(lse[:, :, :empty]))
        assert np.all(dq[:, :empty].astype(np.float32) == 0.0)
    for t in (o, dq, dk, dv):
        assert not np.isnan(t.astype(np.float32)).any()


@pytest.mark.parametrize("dtype_name", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("b,sq,sk,h,hkv,d", SHAPES)
def test_matches_oracle(fa, ref, make_inputs, assert_close_to_oracle, record_error,
                        b, sq, sk, h, hkv, d, causal, dtype_name):
    run_and_check(fa, ref, make_inputs, assert_close_to_oracle, record_error,
                  (b, sq, sk, h, hkv, d), dtype_name, causal)


@pytest.mark.parametrize("dtype_name", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("scale", [0.05, 0.9], ids=["scale0.05", "scale0.9"])
def test_explicit_scale(fa, ref, make_inputs, assert_close_to_oracle, record_error,
                        scale, causal, dtype_name):
    run_and_check(fa, ref, make_inputs, assert_close_to_oracle, record_error,
                  (1, 64, 80, 4, 2, 40), dtype_name, causal, scale=scale, seed=1)


@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
def test_large_logits_are_stable(fa, ref, make_inputs, assert_close_to_oracle, record_error, dtype_name):
    """Scores up to ~+-100: exp would overflow without the running max."""
    run_and_check(fa, ref, make_inputs, assert_close_to_oracle, record_error,
                  (1, 77, 77, 2, 1, 64), dtype_name, causal=True, q_scale=12.0, seed=2)


@pytest.mark.parametrize(
    "shape,causal,dtype_name",
    [
        pytest.param((1, 1025, 1025, 2, 1, 256), True, "f32", id="s1025-d256-mqa-causal-f32"),
        pytest.param((1, 1025, 1025, 2, 2, 64), False, "bf16", id="s1025-d64-full-bf16"),
        pytest.param((1, 1025, 777, 2, 1, 72), True, "f16", id="sq1025>sk777-d72-causal-f16"),
        pytest.param((1, 300, 1025, 4, 2, 40), False, "f32", id="sq300<sk1025-d40-gqa-full-f32"),
        pytest.param((1, 1, 1025, 8, 1, 128), True, "bf16", id="decode-sk1025-d128-mqa-bf16"),
        pytest.param((1, 2048, 2048, 2, 1, 64), True, "f32", id="s2048-d64-causal-f32"),
    ],
)
def test_large_sizes(fa, ref, make_inputs, assert_close_to_oracle, record_error, shape, causal, dtype_name):
    run_and_check(fa, ref, make_inputs, assert_close_to_oracle, record_error, shape, dtype_name,
                  causal, seed=3)


@pytest.mark.parametrize("seed", range(30))
def test_random_configurations(fa, ref, make_inputs, assert_close_to_oracle, record_error, seed):
    """Random sizes (tile edges everywhere), options and dtypes."""
    rng = np.random.default_rng(1000 + seed)
    b = int(rng.integers(1, 3))
    hkv = int(rng.integers(1, 4))
    h = hkv * int(rng.integers(1, 4))
    d = int(rng.choice([1, 2, 5, 8, 16, 31, 32, 33, 48, 63, 64, 65, 96, 100, 127, 128, 129, 160, 255, 256]))
    sq = int(rng.integers(1, 260))
    sk = int(rng.integers(1, 260))
    causal = bool(rng.integers(0, 2))
    scale = None if rng.integers(0, 2) else float(rng.uniform(0.01, 1.0))
    dtype_name = str(rng.choice(list(DTYPES)))
    run_and_check(fa, ref, make_inputs, assert_close_to_oracle, record_error, (b, sq, sk, h, hkv, d),
                  dtype_name, causal, scale=scale, seed=seed)


@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
def test_backward_uses_the_given_o_and_lse(fa, ref, make_inputs, assert_close_to_oracle, dtype_name):
    """Like the oracle, the kernel takes delta from the o passed in and P from
    the lse passed in (it does not recompute them)."""
    dtype = DTYPES[dtype_name]
    q, k, v, do = make_inputs(60, 1, 90, 70, 4, 2, 48, dtype)
    o, lse = fa.forward_with_states(q, k, v, causal=False)
    o2 = (np.random.default_rng(61).standard_normal(o.shape) * 0.5).astype(dtype)
    lse2 = (lse + np.float32(0.3)).astype(np.float32)
    got = fa.backward(do, q, k, v, o2, lse2, causal=False)
    want = ref.backward(do, q, k, v, o2, lse2, causal=False)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close_to_oracle(name, g, w, dtype)
