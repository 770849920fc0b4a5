"""``backward(..., dlse=...)``: the gradient of lse entering the backward as delta - dlse per row.

The CPU's two paths (fused, materialized) and the GPU against the float64 oracle (whose own dlse
is checked against finite differences in test_reference.py), with masks, sinks, softcap, GQA,
Sq != Sk (rows that see no key) and varlen; bad dlse arguments raise the core's errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import DTYPES
from test_gpu import gpu, to_gpu, to_host  # noqa: F401 (fixture: a usable GPU)

CASES = {
    "causal-gqa-empty-rows": dict(shape=(2, 37, 20, 4, 2, 16), opts=dict(causal=True)),
    "window-softcap": dict(shape=(1, 50, 70, 2, 1, 24), opts=dict(causal=False, window=(9, 3), softcap=5.0)),
    "sinks-alibi": dict(shape=(2, 33, 33, 2, 2, 8), opts=dict(causal=True, sinks=np.array([0.5, -1.0], np.float32),
                                                              alibi_slopes=np.array([0.25, 0.5], np.float32))),
}


def _call(make_inputs, ref, fa, case, dtype, seed=0):
    b, sq, sk, h, hkv, d = CASES[case]["shape"]
    opts = CASES[case]["opts"]
    q, k, v, do = make_inputs(seed, b, sq, sk, h, hkv, d, dtype)
    o, lse = fa.forward_with_states(q, k, v, **opts)
    dlse = np.random.default_rng(seed + 1).standard_normal(lse.shape).astype(np.float32)
    want = ref.backward(do, q, k, v, o, lse, dlse=dlse, **opts)
    return (q, k, v, do, o, lse, dlse, opts), want


@pytest.mark.parametrize("mode", ["fused", "materialized"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_dlse_matches_the_oracle(fa, ref, make_inputs, assert_close_to_oracle, case, dtype, mode):
    (q, k, v, do, o, lse, dlse, opts), want = _call(make_inputs, ref, fa, case, DTYPES[dtype])
    got = fa.backward(do, q, k, v, o, lse, dlse=dlse, mode=mode, **opts)
    assert len(got) == len(want)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert_close_to_oracle(name, g, w, DTYPES[dtype] if name != "dsinks" else np.float32, f"{case} {mode}")
    # dlse changes the gradients (q's and k's; dv does not depend on it).
    plain = fa.backward(do, q, k, v, o, lse, mode=mode, **opts)
    assert not np.array_equal(plain[0], got[0])
    np.testing.assert_array_equal(plain[2], got[2])


def test_zero_dlse_is_the_plain_backward_bit_for_bit(fa, make_inputs):
    q, k, v, do = make_inputs(3, 2, 40, 40, 2, 1, 16)
    o, lse = fa.forward_with_states(q, k, v)
    plain = fa.backward(do, q, k, v, o, lse)
    zero = fa.backward(do, q, k, v, o, lse, dlse=np.zeros_like(lse))
    for a, b in zip(plain, zero):
        np.testing.assert_array_equal(a, b)


def test_rows_without_keys_ignore_dlse(fa, make_inputs):
    q, k, v, do = make_inputs(4, 1, 12, 5, 2, 2, 8)  # causal, Sq > Sk: rows 0..6 see no key
    o, lse = fa.forward_with_states(q, k, v)
    assert np.isneginf(lse[:, :, :7]).all()
    dlse = np.full(lse.shape, np.nan, np.float32)
    dlse[:, :, 7:] = 1.5
    dq, dk, dv = fa.backward(do, q, k, v, o, lse, dlse=dlse)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert (dq[:, :7] == 0).all()


def test_varlen_dlse_matches_the_oracle(fa, ref, assert_close_to_oracle):
    rng = np.random.default_rng(5)
    cu_q, cu_k = np.array([0, 9, 30], np.int32), np.array([0, 20, 27], np.int32)
    q, do = (rng.standard_normal((30, 4, 16)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((27, 2, 16)).astype(np.float32) for _ in range(2))
    o, lse = fa.varlen.forward_with_states(q, k, v, cu_q, cu_k)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    got = fa.varlen.backward(do, q, k, v, o, lse, cu_q, cu_k, dlse=dlse)
    want = ref.varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, dlse=dlse)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close_to_oracle(name, g, w, np.float32)


@pytest.mark.parametrize("bad, error, words", [
    (lambda lse: lse[:, :, :-1], "ShapeError", "dlse has shape"),
    (lambda lse: lse.astype(np.float64), "DTypeError", "dlse has dtype float64"),
    (lambda lse: [1.0], "DTypeError", "dlse must be a NumPy array"),
])
def test_bad_dlse_is_a_clear_error(fa, make_inputs, bad, error, words):
    q, k, v, do = make_inputs(6, 1, 8, 8, 2, 1, 8)
    o, lse = fa.forward_with_states(q, k, v)
    with pytest.raises(getattr(fa, error), match=words):
        fa.backward(do, q, k, v, o, lse, dlse=bad(lse))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_dlse_matches_the_oracle(gpu, ref, make_inputs, assert_close_to_oracle, case, dtype, deterministic):
    (q, k, v, do, o, lse, dlse, opts), _ = _call(make_inputs, ref, gpu, case, DTYPES[dtype])
    lib = "torch"
    pytest.importorskip("torch")
    qg, kg, vg, dog = (to_gpu(lib, x) for x in (q, k, v, do))
    og, lseg = gpu.forward_with_states(qg, kg, vg, **opts)
    o, lse = to_host(og), to_host(lseg)
    want = ref.backward(do, q, k, v, o, lse, dlse=dlse, **opts)  # the kernel's own o and lse
    got = gpu.backward(dog, qg, kg, vg, og, lseg, dlse=to_gpu(lib, dlse), deterministic=deterministic, **opts)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert_close_to_oracle(name, to_host(g), w, DTYPES[dtype] if name != "dsinks" else np.float32, case)
