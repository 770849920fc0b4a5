"""CPU backend behaviour beyond accuracy: defaults, rows without keys, zero
sizes, determinism, strided / odd memory layouts, NaN, threads, ``info()``."""

from __future__ import annotations

import math
import threading
import time

import ml_dtypes
import numpy as np
import pytest

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def as_f32(x):
    return np.asarray(x).astype(np.float32)


def test_defaults_are_causal_and_inverse_sqrt_d(fa, make_inputs):
    q, k, v, _ = make_inputs(20, 1, 40, 40, 2, 2, 24)
    o = fa.forward(q, k, v)
    np.testing.assert_array_equal(o, fa.forward(q, k, v, causal=True))
    np.testing.assert_array_equal(o, fa.forward(q, k, v, causal=True, scale=1.0 / math.sqrt(24)))
    assert not np.allclose(o, fa.forward(q, k, v, causal=False))
    o2, lse2 = fa.forward_with_states(q, k, v)
    np.testing.assert_array_equal(o, o2)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_rows_without_keys_give_exact_zeros(fa, make_inputs, dtype_name):
    """Causal with Sq > Sk: the first Sq - Sk rows see nothing."""
    b, sq, sk, h, hkv, d = 2, 70, 9, 4, 2, 16
    q, k, v, do = make_inputs(21, b, sq, sk, h, hkv, d, DTYPES[dtype_name])
    o, lse = fa.forward_with_states(q, k, v, causal=True)
    dq, dk, dv = fa.backward(do, q, k, v, o, lse, causal=True)
    empty = sq - sk
    assert np.all(as_f32(o[:, :empty]) == 0.0)
    assert np.all(np.isneginf(lse[:, :, :empty]))
    assert np.all(np.isfinite(lse[:, :, empty:]))
    assert np.all(as_f32(dq[:, :empty]) == 0.0)
    for t in (o, dq, dk, dv):
        assert np.isfinite(as_f32(t)).all()
    assert np.any(as_f32(dq[:, empty:]) != 0.0)


@pytest.mark.parametrize("causal", [True, False])
def test_zero_keys(fa, make_inputs, causal):
    """Sk = 0: every row sees no key."""
    q, k, v, do = make_inputs(22, 2, 5, 0, 4, 2, 8)
    o, lse = fa.forward_with_states(q, k, v, causal=causal)
    assert o.shape == q.shape and np.all(o == 0.0)
    assert lse.shape == (2, 4, 5) and lse.dtype == np.float32 and np.all(np.isneginf(lse))
    dq, dk, dv = fa.backward(do, q, k, v, o, lse, causal=causal)
    assert dq.shape == q.shape and np.all(dq == 0.0)
    assert dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("b,sq,sk", [(0, 5, 7), (2, 0, 7), (0, 0, 0)], ids=["B0", "Sq0", "all0"])
def test_zero_sized_dims(fa, make_inputs, b, sq, sk):
    q, k, v, do = make_inputs(23, b, sq, sk, 4, 1, 8)
    for causal in (True, False):
        o, lse = fa.forward_with_states(q, k, v, causal=causal)
        assert o.shape == q.shape and o.dtype == np.float32
        assert lse.shape == (b, 4, sq)
        dq, dk, dv = fa.backward(do, q, k, v, o, lse, causal=causal)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert np.all(dk == 0.0) and np.all(dv == 0.0)


@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
def test_deterministic(fa, make_inputs, dtype_name):
    """Same inputs, same bytes: forward and backward, several calls."""
    q, k, v, do = make_inputs(24, 2, 300, 333, 4, 2, 64, DTYPES[dtype_name])
    o, lse = fa.forward_with_states(q, k, v, causal=False)
    grads = fa.backward(do, q, k, v, o, lse, causal=False)
    for _ in range(3):
        o2, lse2 = fa.forward_with_states(q, k, v, causal=False)
        assert o2.tobytes() == o.tobytes() and lse2.tobytes() == lse.tobytes()
        grads2 = fa.backward(do, q, k, v, o, lse, causal=False)
        for g, g2 in zip(grads, grads2):
            assert g2.tobytes() == g.tobytes()
    # deterministic=True names what the CPU always does: the same bytes again.
    for g, g3 in zip(grads, fa.backward(do, q, k, v, o, lse, causal=False, deterministic=True)):
        assert g3.tobytes() == g.tobytes()


def test_deterministic_must_be_a_bool(fa, make_inputs):
    q, k, v, do = make_inputs(25, 1, 8, 8, 2, 2, 16)
    o, lse = fa.forward_with_states(q, k, v)
    with pytest.raises(fa.UnsupportedError, match="deterministic"):
        fa.backward(do, q, k, v, o, lse, deterministic="yes")


def _strided_inputs(rng, dtype):
    """q, k, v, do with non-C-contiguous layouts of the standard shapes."""
    b, sq, sk, h, hkv, d = 2, 37, 41, 4, 2, 24
    q = rng.standard_normal((b, h, sq, d)).astype(dtype).transpose(0, 2, 1, 3)  # transposed view
    k = rng.standard_normal((b, 2 * sk, hkv, d)).astype(dtype)[:, ::2]  # step along Sk
    v = np.asfortranarray(rng.standard_normal((b, sk, hkv, d)).astype(dtype))  # F order
    do = rng.standard_normal((b, sq, h, 2 * d)).astype(dtype)[..., ::-2]  # negative step on D
    assert not any(t.flags.c_contiguous for t in (q, k, v, do))
    return q, k, v, do


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_noncontiguous_inputs_are_not_misread(fa, dtype_name):
    rng = np.random.default_rng(25)
    q, k, v, do = _strided_inputs(rng, DTYPES[dtype_name])
    qc, kc, vc, doc = (np.ascontiguousarray(t) for t in (q, k, v, do))
    o, lse = fa.forward_with_states(q, k, v, causal=True)
    oc, lsec = fa.forward_with_states(qc, kc, vc, causal=True)
    np.testing.assert_array_equal(o, oc)
    np.testing.assert_array_equal(lse, lsec)
    # o and lse themselves strided in the backward
    o_nc = np.asfortranarray(oc)
    lse_nc = np.ascontiguousarray(lsec.transpose(0, 2, 1)).transpose(0, 2, 1)
    assert not o_nc.flags.c_contiguous and not lse_nc.flags.c_contiguous
    got = fa.backward(do, q, k, v, o_nc, lse_nc, causal=True)
    want = fa.backward(doc, qc, kc, vc, oc, lsec, causal=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_readonly_inputs(fa, make_inputs):
    q, k, v, do = make_inputs(26, 1, 16, 16, 2, 1, 8)
    want = fa.forward(q, k, v)
    for t in (q, k, v):
        t.setflags(write=False)
    np.testing.assert_array_equal(fa.forward(q, k, v), want)


def test_unaligned_or_byteswapped_input_is_never_misread(fa, make_inputs):
    """Contiguous but unaligned, or big-endian: either computed correctly or
    rejected with a FlashAttentionError -- never silently misread."""
    q, k, v, _ = make_inputs(27, 1, 16, 16, 2, 1, 8)
    want = fa.forward(q, k, v)
    buf = np.zeros(q.nbytes + 1, dtype=np.uint8)
    q_unaligned = np.frombuffer(buf.data, dtype=np.float32, count=q.size, offset=1).reshape(q.shape)
    q_unaligned[...] = q
    q_swapped = q.astype(q.dtype.newbyteorder(">"))
    for variant in (q_unaligned, q_swapped):
        try:
            got = fa.forward(variant, k, v)
        except fa.FlashAttentionError:
            continue
        np.testing.assert_array_equal(got, want)


def test_nan_in_gives_nan_out(fa, make_inputs):
    q, k, v, do = make_inputs(28, 2, 33, 33, 2, 1, 16)
    q[1, 5, 1, 3] = np.nan
    o, lse = fa.forward_with_states(q, k, v, causal=False)
    assert np.isnan(o[1, 5, 1]).any() and np.isnan(lse[1, 1, 5])
    mask = np.ones(o.shape, dtype=bool)
    mask[1, 5, 1] = False
    assert np.isfinite(o[mask]).all()  # rows are independent in the forward
    dq, dk, dv = fa.backward(do, q, k, v, o, lse, causal=False)
    assert np.isnan(dq[1, 5, 1]).any() and np.isnan(dk[1]).any()
    assert np.isfinite(dq[0]).all()  # the other batch is untouched

    k2 = k.copy()
    k2[0, 7, 0, 2] = np.nan
    o2 = fa.forward(q, k2, v, causal=True)
    assert np.isnan(o2[0, 7:]).any()
    assert np.isfinite(o2[0, :7]).all()  # causal rows before key 7 never see it


def test_concurrent_calls_from_threads(fa, make_inputs):
    inputs = [make_inputs(30 + i, 1, 200, 200, 4, 2, 32) for i in range(4)]
    want = [fa.forward_with_states(q, k, v) for q, k, v, _ in inputs]
    results = [None] * len(inputs)

    def work(i):
        q, k, v, _ = inputs[i]
        results[i] = fa.forward_with_states(q, k, v)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (o, lse), (wo, wl) in zip(results, want):
        np.testing.assert_array_equal(o, wo)
        np.testing.assert_array_equal(lse, wl)


def test_gil_is_released_during_compute(fa, make_inputs):
    """A Python thread keeps running while a long call computes."""
    q, k, v, do = make_inputs(31, 1, 2048, 2048, 4, 4, 64)
    ticks = 0
    stop = threading.Event()

    def ticker():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    th = threading.Thread(target=ticker)
    th.start()
    try:
        time.sleep(0.01)
        start_ticks, t0 = ticks, time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            fa.forward(q, k, v, causal=False)
        elapsed = time.perf_counter() - t0
        during = ticks - start_ticks
    finally:
        stop.set()
        th.join()
    # with the GIL held the ticker could run only between calls
    assert during >= 0.1 * elapsed / 0.001, (during, elapsed)


def test_info(fa):
    info = fa.info()
    assert isinstance(info, dict)
    assert isinstance(info["version"], str) and info["version"]
    assert isinstance(info["backends"], list) and "cpu" in info["backends"]
    assert isinstance(info["threads"], int) and info["threads"] >= 1
    assert fa.cuda_available() is ("cuda" in info["backends"])
    if hasattr(fa, "__version__"):
        assert info["version"] == fa.__version__
