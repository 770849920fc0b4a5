"""Fused or materialized (``mode=``): both paths against the float64 oracle and against each other,
forward and backward, with every mask, GQA, Sq != Sk, varlen and each dtype; the environment
overrides (``FLASH_NIF_MODE``, ``FLASH_NIF_MATERIALIZE_MAX_BYTES``), the ceiling, ``auto``'s choice
and ``info()["dispatch"]``.

Tolerances are conftest's (float32 1e-5; float16 / bfloat16 at most twice the error of the
oracle's own result rounded to the dtype; lse 1e-5). The two paths must also agree with each other
within the float32 bound (the dtype's bound for float16 / bfloat16).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from test_masks import CASES, VARLEN, packed

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
MODES = ("fused", "materialized")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No outside override leaks into these tests (each sets what it needs)."""
    monkeypatch.delenv("FLASH_NIF_MODE", raising=False)
    monkeypatch.delenv("FLASH_NIF_MATERIALIZE_MAX_BYTES", raising=False)


def _as_f32(x):
    return np.asarray(x).astype(np.float32)


def _both_paths(run, assert_close_to_oracle, rel_err, want, dtype, ctx):
    """run(mode) -> (o, lse, dq, dk, dv); want: the oracle's (o, lse) and a function of (o, lse)
    giving the oracle's gradients. Each path against the oracle, then against the other."""
    got = {m: run(m) for m in MODES}
    names = ("o", "lse", "dq", "dk", "dv")
    for m in MODES:
        o, lse, *grads = got[m]
        ro, rlse = want[0]
        assert_close_to_oracle("o", o, ro, dtype, f"{ctx} mode={m}")
        assert_close_to_oracle("lse", lse, rlse, np.float32, f"{ctx} mode={m}")
        for n, g, w in zip(names[2:], grads, want[1](o, lse)):
            assert_close_to_oracle(n, g, w, dtype, f"{ctx} mode={m}")
    agree = 1e-5 if np.dtype(dtype) == np.float32 else {np.dtype(np.float16): 2e-3}.get(np.dtype(dtype), 1.6e-2)
    for n, f, t in zip(names, got["fused"], got["materialized"]):
        assert rel_err(_as_f32(t), _as_f32(f)) <= agree, f"{ctx}: fused and materialized {n} differ"
        # -inf (rows that see nothing) in the same places, exact zeros in the same places
        np.testing.assert_array_equal(np.isneginf(_as_f32(t)), np.isneginf(_as_f32(f)))
    return got


@pytest.mark.parametrize("case", list(CASES))
def test_masks_agree_and_match_oracle(fa, ref, make_inputs, assert_close_to_oracle, rel_err, case):
    shape, causal, build = CASES[case]
    b, sq, sk, h, hkv, d = shape
    masks = build(np.random.default_rng(100))
    q, k, v, do = make_inputs(0, b, sq, sk, h, hkv, d, np.float32)

    def run(mode):
        o, lse = fa.forward_with_states(q, k, v, causal=causal, mode=mode, **masks)
        return (o, lse, *fa.backward(do, q, k, v, o, lse, causal=causal, mode=mode, **masks))

    want = (ref.forward_with_states(q, k, v, causal=causal, **masks),
            lambda o, lse: ref.backward(do, q, k, v, o, lse, causal=causal, **masks))
    _both_paths(run, assert_close_to_oracle, rel_err, want, np.float32, f"case={case}")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("b,sq,sk,h,hkv,d", [
    pytest.param(64, 60, 60, 4, 4, 64, id="exphil-b64-s60"),
    pytest.param(1, 60, 60, 4, 4, 64, id="exphil-b1-s60"),
    pytest.param(2, 1, 97, 8, 1, 40, id="decode-mqa"),
    pytest.param(2, 97, 40, 4, 2, 33, id="sq>sk-gqa"),
    pytest.param(1, 50, 130, 6, 2, 72, id="sq<sk-gqa"),
    pytest.param(1, 300, 280, 2, 1, 128, id="s300-mqa"),
])
def test_shapes_and_dtypes(fa, ref, make_inputs, assert_close_to_oracle, rel_err, b, sq, sk, h, hkv, d, causal,
                           dtype_name):
    dtype = DTYPES[dtype_name]
    q, k, v, do = make_inputs(1, b, sq, sk, h, hkv, d, dtype)

    def run(mode):
        o, lse = fa.forward_with_states(q, k, v, causal=causal, mode=mode)
        return (o, lse, *fa.backward(do, q, k, v, o, lse, causal=causal, mode=mode))

    want = (ref.forward_with_states(q, k, v, causal=causal),
            lambda o, lse: ref.backward(do, q, k, v, o, lse, causal=causal))
    _both_paths(run, assert_close_to_oracle, rel_err, want, dtype, f"{(b, sq, sk, h, hkv, d)} causal={causal}")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", list(VARLEN))
def test_varlen(fa, ref, assert_close_to_oracle, rel_err, case, dtype_name):
    q_lens, k_lens, h, hkv, d, causal, window = VARLEN[case]
    dtype = DTYPES[dtype_name]
    q, k, v, do, cu_q, cu_k = packed(0, q_lens, k_lens, h, hkv, d, dtype)
    kw = dict(causal=causal, window=window)

    def run(mode):
        o, lse = fa.varlen.forward_with_states(q, k, v, cu_q, cu_k, mode=mode, **kw)
        return (o, lse, *fa.varlen.backward(do, q, k, v, o, lse, cu_q, cu_k, mode=mode, **kw))

    want = (ref.varlen_forward_with_states(q, k, v, cu_q, cu_k, **kw),
            lambda o, lse: ref.varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, **kw))
    _both_paths(run, assert_close_to_oracle, rel_err, want, dtype, f"varlen case={case}")


def test_backward_takes_either_forward(fa, make_inputs):
    """o and lse from one path drive the other path's backward to the same gradients."""
    q, k, v, do = make_inputs(2, 3, 45, 45, 4, 2, 32, np.float32)
    for fwd_mode in MODES:
        o, lse = fa.forward_with_states(q, k, v, mode=fwd_mode)
        grads = [fa.backward(do, q, k, v, o, lse, mode=m) for m in MODES]
        for a, b in zip(*grads):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_materialized_is_bit_identical_run_to_run(fa, make_inputs):
    q, k, v, do = make_inputs(3, 4, 70, 70, 4, 2, 24, np.float32)
    first = fa.forward_with_states(q, k, v, mode="materialized")
    grads = fa.backward(do, q, k, v, *first, mode="materialized")
    for _ in range(3):
        again = fa.forward_with_states(q, k, v, mode="materialized")
        for a, b in zip((*first, *grads), (*again, *fa.backward(do, q, k, v, *again, mode="materialized"))):
            np.testing.assert_array_equal(a, b)


# --- the choice --------------------------------------------------------------------------------

def _ws_bytes(fa, b, sq, sk, hkv, backward):
    """The materialized CPU path's S x S working set (native/flash-core/src/dispatch.rs):
    min(threads, B * Hkv) tasks, each holding Sq x ld(Sk) f32 (ld = Sk rounded up to 16, plus 16),
    one matrix forward, two backward."""
    ld = -(-sk // 16) * 16 + 16
    return min(fa.info()["threads"], b * hkv) * sq * ld * 4 * (2 if backward else 1)


def _outputs(fa, q, k, v, do, **kw):
    o, lse = fa.forward_with_states(q, k, v, **kw)
    return (o, lse, *fa.backward(do, q, k, v, o, lse, **kw))


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def _in_table(fa, b, s, hkv):
    """Whether the CPU crossover table says materialized for both passes at this shape."""
    rows = fa.info()["dispatch"]["cpu"]["crossover"]
    ok = {r["pass"] for r in rows if s <= r["max_seq"] and b * hkv >= r["min_pairs"]}
    return ok == {"forward", "backward"}


def test_auto_follows_the_table_and_the_ceiling(fa, make_inputs, monkeypatch):
    # Two key tiles, so the paths differ in their last bits (the fused one rescales its running
    # softmax between tiles); within one tile they are the same sums in the same order.
    b, s, h, d = 16, 200, 2, 8
    q, k, v, do = make_inputs(4, b, s, s, h, h, d, np.float32)
    fused, mat = (_outputs(fa, q, k, v, do, mode=m) for m in MODES)
    assert not _same(fused, mat), "the two paths should differ in their last bits here"
    auto = _outputs(fa, q, k, v, do)
    assert _same(auto, mat if _in_table(fa, b, s, h) else fused)
    # Over the ceiling, auto is fused (and no error).
    monkeypatch.setenv("FLASH_NIF_MATERIALIZE_MAX_BYTES", "0")
    assert _same(_outputs(fa, q, k, v, do), fused)


def test_auto_is_fused_for_long_sequences(fa, make_inputs):
    """Past the table's longest sequence auto takes the fused path."""
    longest = max((r["max_seq"] for r in fa.info()["dispatch"]["cpu"]["crossover"]), default=0)
    s = longest + 1
    q, k, v, do = make_inputs(5, 1, s, s, 2, 2, 8, np.float32)
    assert _same(_outputs(fa, q, k, v, do), _outputs(fa, q, k, v, do, mode="fused"))


def test_ceiling_is_exact_and_refusal_is_clear(fa, make_inputs, monkeypatch):
    b, sq, sk, h, hkv, d = 3, 50, 70, 4, 2, 16
    q, k, v, do = make_inputs(6, b, sq, sk, h, hkv, d, np.float32)
    fwd_need, bwd_need = (_ws_bytes(fa, b, sq, sk, hkv, bw) for bw in (False, True))
    o, lse = fa.forward_with_states(q, k, v, mode="fused")
    monkeypatch.setenv("FLASH_NIF_MATERIALIZE_MAX_BYTES", str(fwd_need))
    fa.forward_with_states(q, k, v, mode="materialized")  # exactly at the ceiling: allowed
    with pytest.raises(fa.UnsupportedError, match=r"materialized.*backward.*over the ceiling.*FLASH_NIF_MATERIALIZE_MAX_BYTES"):
        fa.backward(do, q, k, v, o, lse, mode="materialized")
    monkeypatch.setenv("FLASH_NIF_MATERIALIZE_MAX_BYTES", str(bwd_need))
    fa.backward(do, q, k, v, o, lse, mode="materialized")
    monkeypatch.setenv("FLASH_NIF_MATERIALIZE_MAX_BYTES", str(fwd_need - 1))
    with pytest.raises(fa.UnsupportedError, match=f"{fwd_need} bytes"):
        fa.forward_with_states(q, k, v, mode="materialized")
    with pytest.raises(ValueError):  # UnsupportedError is a ValueError
        fa.varlen.forward(q.reshape(-1, h, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d),
                          np.arange(b + 1, dtype=np.int32) * sq, np.arange(b + 1, dtype=np.int32) * sk,
                          mode="materialized")
    # auto over the ceiling: the fused path, same bits as asking for it
    assert _same(fa.forward_with_states(q, k, v), (o, lse))


def test_env_mode_overrides_the_call(fa, make_inputs, monkeypatch):
    q, k, v, do = make_inputs(7, 2, 200, 200, 2, 2, 8, np.float32)  # two key tiles (see above)
    fused, mat = (_outputs(fa, q, k, v, do, mode=m) for m in MODES)
    assert not _same(fused, mat)
    monkeypatch.setenv("FLASH_NIF_MODE", "materialized")
    assert _same(_outputs(fa, q, k, v, do, mode="fused"), mat)
    monkeypatch.setenv("FLASH_NIF_MODE", "fused")
    assert _same(_outputs(fa, q, k, v, do, mode="materialized"), fused)
    assert _same(_outputs(fa, q, k, v, do), fused)
    monkeypatch.setenv("FLASH_NIF_MODE", "")  # empty: the call decides
    assert _same(_outputs(fa, q, k, v, do, mode="materialized"), mat)
    assert fa.info()["dispatch"]["mode"] is None
    monkeypatch.setenv("FLASH_NIF_MODE", "materialised")
    with pytest.raises(fa.UnsupportedError, match="FLASH_NIF_MODE"):
        fa.forward(q, k, v)
    monkeypatch.setenv("FLASH_NIF_MODE", "fused")
    assert fa.info()["dispatch"]["mode"] == "fused"


def test_bad_options(fa, make_inputs, monkeypatch):
    q, k, v, _ = make_inputs(8, 1, 8, 8, 1, 1, 8, np.float32)
    for bad in ("fast", "Materialized", 1, None, True):
        with pytest.raises(fa.UnsupportedError, match="mode"):
            fa.forward(q, k, v, mode=bad)
    monkeypatch.setenv("FLASH_NIF_MATERIALIZE_MAX_BYTES", "1GiB")
    with pytest.raises(fa.UnsupportedError, match="FLASH_NIF_MATERIALIZE_MAX_BYTES"):
        fa.forward(q, k, v, mode="materialized")
    assert "max_bytes_error" in fa.info()["dispatch"]
    # unknown option names still fail in the core
    with pytest.raises(fa.UnsupportedError, match="unknown option"):
        fa._native.forward_host_arrays([q, k, v], "cpu", mode="fused", modes="fused")


def test_info_reports_the_table(fa):
    d = fa.info()["dispatch"]
    assert d["mode_env"] == "FLASH_NIF_MODE" and d["max_bytes_env"] == "FLASH_NIF_MATERIALIZE_MAX_BYTES"
    assert d["max_bytes"] == 1 << 30
    assert d["cpu"]["materialized"] is True and d["cuda"]["materialized"] is False
    assert d["cuda"]["crossover"] == []  # no materialized GPU kernels: auto never picks it there
    assert d["cpu"]["crossover"], "the CPU table has rows"
    for row in d["cpu"]["crossover"]:
        assert row["pass"] in ("forward", "backward") and row["max_seq"] > 0 and row["min_pairs"] >= 1
    assert "bench/dispatch.py" in d["cpu"]["measured"]


@pytest.mark.gpu
def test_gpu_refuses_materialized_and_auto_is_fused(fa, make_inputs):
    if not fa.info().get("cuda", {}).get("available"):
        pytest.skip("no usable CUDA GPU")
    q, k, v, _ = make_inputs(9, 2, 60, 60, 4, 4, 64, np.float32)
    with pytest.raises(fa.UnsupportedError, match="not available on the cuda backend"):
        fa.forward(q, k, v, device="cuda", mode="materialized")
    np.testing.assert_array_equal(fa.forward(q, k, v, device="cuda"), fa.forward(q, k, v, device="cuda", mode="fused"))
