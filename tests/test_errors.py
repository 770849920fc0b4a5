"""Bad inputs raise the documented exception class (which is also the
matching builtin: ValueError / TypeError / MemoryError / RuntimeError) with a
message naming the argument and the shapes -- and never crash the interpreter.
"""

from __future__ import annotations

import inspect
import re

import ml_dtypes
import numpy as np
import pytest

HIERARCHY = [
    ("ShapeError", ValueError),
    ("DTypeError", TypeError),
    ("UnsupportedError", ValueError),
    ("OutOfMemoryError", MemoryError),
    ("DeviceError", RuntimeError),
]


@pytest.mark.parametrize("name,builtin", HIERARCHY, ids=[n for n, _ in HIERARCHY])
def test_exception_hierarchy(fa, name, builtin):
    assert issubclass(fa.FlashAttentionError, Exception)
    cls = getattr(fa, name)
    assert issubclass(cls, fa.FlashAttentionError)
    assert issubclass(cls, builtin)


def arrays(b=2, sq=11, sk=13, h=4, hkv=2, d=8, dtype=np.float32, seed=40):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    return q, k, v


def fwd(q, k, v, **kw):
    """Arguments of one forward call."""
    return (q, k, v), kw


Q, K, V = arrays()
# forward_with_states(q, k, v): (id, call, exception class name)
FORWARD_CASES = [
    ("q-rank3", fwd(Q[0], K, V), "ShapeError"),
    ("q-rank5", fwd(Q[None], K, V), "ShapeError"),
    ("k-rank3", fwd(Q, K[0], V), "ShapeError"),
    ("v-rank2", fwd(Q, K, V[0, 0]), "ShapeError"),
    ("batch-mismatch", fwd(Q, K[:1], V[:1]), "ShapeError"),
    ("head-dim-mismatch", fwd(Q, *arrays(d=24)[1:]), "ShapeError"),
    ("v-shape-ne-k", fwd(Q, K, V[:, :5]), "ShapeError"),
    ("v-heads-ne-k", fwd(Q, K, np.concatenate([V, V], axis=2)), "ShapeError"),
    ("v-head-dim0", fwd(Q, K, V[..., :0]), "ShapeError"),
    ("v-head-dim257", fwd(Q, K, np.zeros((*V.shape[:3], 257), np.float32)), "ShapeError"),
    ("h-not-multiple-of-hkv", fwd(*arrays(h=6, hkv=4)), "ShapeError"),
    ("hkv-gt-h", fwd(*arrays(h=2, hkv=4)), "ShapeError"),
    ("zero-heads", fwd(*arrays(h=0, hkv=1)), "ShapeError"),
    ("zero-heads-both", fwd(*arrays(h=0, hkv=0)), "ShapeError"),
    ("d0", fwd(*arrays(d=0)), "ShapeError"),
    ("d257", fwd(*arrays(d=257)), "ShapeError"),
    ("int32", fwd(*arrays(dtype=np.int32)), "DTypeError"),
    ("int64-q-only", fwd(Q.astype(np.int64), K, V), "DTypeError"),
    ("float64", fwd(*arrays(dtype=np.float64)), "DTypeError"),
    ("complex64", fwd(*arrays(dtype=np.complex64)), "DTypeError"),
    ("mixed-f32-f16", fwd(Q, K.astype(np.float16), V), "DTypeError"),
    ("mixed-bf16-f16", fwd(Q.astype(ml_dtypes.bfloat16), K.astype(np.float16), V.astype(np.float16)),
     "DTypeError"),
    ("mixed-v-only", fwd(Q, K, V.astype(ml_dtypes.bfloat16)), "DTypeError"),
    ("scale-zero", fwd(Q, K, V, scale=0.0), "UnsupportedError"),
    ("scale-negative", fwd(Q, K, V, scale=-0.5), "UnsupportedError"),
    ("scale-nan", fwd(Q, K, V, scale=float("nan")), "UnsupportedError"),
    ("scale-inf", fwd(Q, K, V, scale=float("inf")), "UnsupportedError"),
]


@pytest.mark.parametrize("call,cls_name", [c[1:] for c in FORWARD_CASES], ids=[c[0] for c in FORWARD_CASES])
def test_forward_rejects(fa, call, cls_name):
    args, kwargs = call
    cls = getattr(fa, cls_name)
    for fn in (fa.forward_with_states, fa.forward):
        with pytest.raises(cls) as info:
            fn(*args, **kwargs)
        assert str(info.value)


def _backward_case(mutate, seed=41):
    """Valid backward arguments changed by ``mutate(dict) -> dict``."""

    def call(fa):
        q, k, v = arrays(seed=seed)
        rng = np.random.default_rng(seed + 1)
        do = rng.standard_normal(q.shape).astype(np.float32)
        o, lse = fa.forward_with_states(q, k, v)
        args = dict(do=do, q=q, k=k, v=v, o=o, lse=lse)
        args = mutate(args)
        return fa.backward(args["do"], args["q"], args["k"], args["v"], args["o"], args["lse"])

    return call


def _set(**changes):
    def mutate(a):
        out = dict(a)
        for key, fn in changes.items():
            out[key] = fn(a)
        return out

    return mutate


BACKWARD_CASES = [
    ("do-shape-ne-q", _set(do=lambda a: a["do"][:, :5]), "ShapeError"),
    ("do-rank3", _set(do=lambda a: a["do"][0]), "ShapeError"),
    ("o-shape-ne-q", _set(o=lambda a: a["o"][:, :, :2]), "ShapeError"),
    ("o-head-dim-ne-v", _set(o=lambda a: np.concatenate([a["o"], a["o"]], axis=3)), "ShapeError"),
    ("do-head-dim-ne-v", _set(do=lambda a: a["do"][..., :4]), "ShapeError"),
    ("lse-transposed-shape", _set(lse=lambda a: np.ascontiguousarray(a["lse"].transpose(0, 2, 1))), "ShapeError"),
    ("lse-rank2", _set(lse=lambda a: a["lse"][0]), "ShapeError"),
    ("lse-float64", _set(lse=lambda a: a["lse"].astype(np.float64)), "DTypeError"),
    ("lse-float16", _set(lse=lambda a: a["lse"].astype(np.float16)), "DTypeError"),
    ("do-dtype-ne-q", _set(do=lambda a: a["do"].astype(np.float16)), "DTypeError"),
    ("o-dtype-ne-q", _set(o=lambda a: a["o"].astype(ml_dtypes.bfloat16)), "DTypeError"),
    ("do-int", _set(do=lambda a: a["do"].astype(np.int32)), "DTypeError"),
    ("k-batch-mismatch", _set(k=lambda a: a["k"][:1], v=lambda a: a["v"][:1]), "ShapeError"),
]


@pytest.mark.parametrize("mutate,cls_name", [c[1:] for c in BACKWARD_CASES], ids=[c[0] for c in BACKWARD_CASES])
def test_backward_rejects(fa, mutate, cls_name):
    with pytest.raises(getattr(fa, cls_name)) as info:
        _backward_case(mutate)(fa)
    assert str(info.value)


def test_backward_rejects_bad_scale(fa):
    q, k, v = arrays()
    o, lse = fa.forward_with_states(q, k, v)
    for bad in (0.0, -1.0, float("nan"), float("-inf")):
        with pytest.raises(fa.UnsupportedError):
            fa.backward(o, q, k, v, o, lse, scale=bad)


def test_not_an_array(fa):
    q, k, v = arrays()
    for bad in (None, "q", object()):
        with pytest.raises((TypeError, ValueError)):
            fa.forward(bad, k, v)


def _word(name, msg):
    return re.search(rf"(?<![A-Za-z_]){re.escape(name)}(?![A-Za-z_])", msg, re.IGNORECASE)


def test_messages_name_argument_and_shapes(fa):
    q, _, _ = arrays(sq=11, d=40)
    _, k, v = arrays(sk=13, d=24)
    with pytest.raises(fa.ShapeError) as info:
        fa.forward(q, k, v)
    msg = str(info.value)
    assert _word("k", msg) or _word("v", msg), msg
    assert "40" in msg and "24" in msg, msg

    q, k, v = arrays(h=6, hkv=4)
    with pytest.raises(fa.ShapeError) as info:
        fa.forward(q, k, v)
    msg = str(info.value)
    assert "6" in msg and "4" in msg, msg

    q, k, v = arrays(b=2, sq=11, h=4)
    o, lse = fa.forward_with_states(q, k, v)
    with pytest.raises(fa.ShapeError) as info:
        fa.backward(o, q, k, v, o, lse[:, :3])
    msg = str(info.value)
    assert _word("lse", msg) and "3" in msg, msg

    with pytest.raises(fa.ShapeError) as info:
        fa.backward(o[:, :7], q, k, v, o, lse)
    msg = str(info.value)
    # named as backward() spells it (the Elixir binding says d_out)
    assert _word("do", msg) and "d_out" not in msg and "7" in msg and "11" in msg, msg

    with pytest.raises(fa.DTypeError) as info:
        fa.forward(q.astype(np.int32), k, v)
    msg = str(info.value)
    assert _word("q", msg) and "int32" in msg, msg


@pytest.mark.parametrize("mutate", [
    _set(do=lambda a: a["do"][:, :5]),
    _set(do=lambda a: a["do"].astype(np.float16)),
    _set(do=lambda a: a["do"].astype(np.int32)),
    _set(do=lambda a: a["do"][0]),
], ids=["shape", "dtype-ne-q", "dtype-int", "rank"])
def test_backward_names_do_as_the_caller_spells_it(fa, mutate):
    with pytest.raises((fa.ShapeError, fa.DTypeError)) as info:
        _backward_case(mutate)(fa)
    msg = str(info.value)
    assert _word("do", msg) and "d_out" not in msg, msg


@pytest.mark.parametrize("dtype", [np.float64, np.float16, ml_dtypes.bfloat16, np.int32])
def test_lse_must_be_float32_said_the_first_time(fa, dtype):
    """Any other lse dtype gets lse's own rule, not the generic list of q/k/v dtypes."""
    with pytest.raises(fa.DTypeError) as info:
        _backward_case(_set(lse=lambda a: a["lse"].astype(dtype)))(fa)
    msg = str(info.value)
    assert msg == f"lse has dtype {np.dtype(dtype).name}; it must be float32", msg


def test_missing_device_raises_device_error(fa):
    params = inspect.signature(fa.forward).parameters
    if "device" not in params:
        pytest.skip("forward() takes no device argument")
    if "cuda" in fa.info()["backends"]:
        pytest.skip("a CUDA device is present")
    q, k, v = arrays()
    with pytest.raises(fa.DeviceError):
        fa.forward(q, k, v, device="cuda")


def test_interpreter_alive_after_errors(fa):
    """After every rejection above, real work still runs and is right."""
    q, k, v = arrays()
    o = fa.forward(q, k, v)
    assert o.shape == q.shape and np.isfinite(o).all()


# --- masks and varlen -----------------------------------------------------------------------------
# Q, K, V: B = 2, Sq = 11, Sk = 13, H = 4, Hkv = 2. Python types are checked in Python; shapes,
# dtypes and values by the core, whose messages name the argument as the caller spells it.

def _ids(*shape, dtype=np.int32):
    return np.zeros(shape, dtype=dtype)


# (id, keyword arguments of forward, exception class name, words the message must contain)
MASK_CASES = [
    ("window-int", dict(window=3), "UnsupportedError", ["window"]),
    ("window-list", dict(window=[1, 2]), "UnsupportedError", ["window"]),
    ("window-one-side", dict(window=(1,)), "UnsupportedError", ["window"]),
    ("window-float", dict(window=(1.5, 2)), "UnsupportedError", ["window"]),
    ("window-bool", dict(window=(True, 1)), "UnsupportedError", ["window"]),
    ("window-left-negative", dict(window=(-1, 0)), "UnsupportedError", ["window", "left", "-1"]),
    ("window-right-negative", dict(window=(None, -2)), "UnsupportedError", ["window", "right", "-2"]),
    ("window-huge", dict(window=(2**70, 0)), "UnsupportedError", ["window"]),
    ("segments-not-tuple", dict(segment_ids=_ids(2, 11)), "UnsupportedError", ["segment_ids"]),
    ("segments-three", dict(segment_ids=(_ids(2, 11), _ids(2, 13), _ids(2, 13))), "UnsupportedError",
     ["segment_ids"]),
    ("segments-q-shape", dict(segment_ids=(_ids(2, 13), _ids(2, 13))), "ShapeError", ["segment_ids[0]", "11"]),
    ("segments-k-shape", dict(segment_ids=(_ids(2, 11), _ids(1, 13))), "ShapeError", ["segment_ids[1]", "13"]),
    ("segments-float", dict(segment_ids=(_ids(2, 11, dtype=np.float32), _ids(2, 13))), "DTypeError",
     ["segment_ids[0]", "float32", "int32"]),
    ("segments-bool", dict(segment_ids=(_ids(2, 11), _ids(2, 13, dtype=bool))), "DTypeError",
     ["segment_ids[1]", "bool"]),
    ("segments-int64-overflow", dict(segment_ids=(_ids(2, 11, dtype=np.int64) + 2**40, _ids(2, 13))), "DTypeError",
     ["segment_ids[0]", "int64", "int32"]),
    ("segments-list", dict(segment_ids=([[0] * 11] * 2, _ids(2, 13))), "DTypeError", ["segment_ids[0]", "NumPy"]),
    ("seqused-length", dict(seqused_k=np.array([13], np.int32)), "ShapeError", ["seqused_k", "[1]"]),
    ("seqused-rank", dict(seqused_k=np.array([[13, 13]], np.int32)), "ShapeError", ["seqused_k"]),
    ("seqused-over-sk", dict(seqused_k=np.array([13, 14], np.int32)), "ShapeError", ["seqused_k[1]", "14", "13"]),
    ("seqused-negative", dict(seqused_k=np.array([-1, 13], np.int32)), "ShapeError", ["seqused_k[0]", "-1"]),
    ("seqused-int64-over-sk", dict(seqused_k=np.array([13, 2**33])), "DTypeError", ["seqused_k"]),
    ("seqused-float", dict(seqused_k=np.array([13.0, 13.0])), "DTypeError", ["seqused_k", "float64"]),
    ("seqused-list", dict(seqused_k=[13, 13]), "DTypeError", ["seqused_k", "NumPy"]),
    ("leftpad-over-sk", dict(leftpad_k=np.array([0, 14], np.int32)), "ShapeError", ["leftpad_k[1]", "14"]),
    ("leftpad-negative", dict(leftpad_k=np.array([0, -3], np.int32)), "ShapeError", ["leftpad_k[1]", "-3"]),
    ("leftpad-past-seqused", dict(seqused_k=np.array([13, 5], np.int32), leftpad_k=np.array([0, 6], np.int32)),
     "ShapeError", ["leftpad_k[1]", "seqused_k[1]", "6", "5"]),
    ("leftpad-length", dict(leftpad_k=np.array([0, 0, 0], np.int32)), "ShapeError", ["leftpad_k", "[3]"]),
    ("block-rows", dict(block_mask=np.ones((1, 1, 2, 1), bool)), "ShapeError", ["block_mask", "[1, 1, 2, 1]"]),
    ("block-cols", dict(block_mask=np.ones((1, 1, 1, 2), bool)), "ShapeError", ["block_mask"]),
    ("block-batch", dict(block_mask=np.ones((3, 1, 1, 1), bool)), "ShapeError", ["block_mask", "3"]),
    ("block-heads-kv", dict(block_mask=np.ones((1, 2, 1, 1), bool)), "ShapeError", ["block_mask"]),
    ("block-rank3", dict(block_mask=np.ones((1, 1, 1), bool)), "ShapeError", ["block_mask"]),
    ("block-float", dict(block_mask=np.ones((1, 1, 1, 1), np.float32)), "DTypeError", ["block_mask", "float32"]),
    ("block-int32", dict(block_mask=np.ones((1, 1, 1, 1), np.int32)), "DTypeError", ["block_mask", "int32"]),
    ("block-not-array", dict(block_mask=True), "DTypeError", ["block_mask"]),
]


@pytest.mark.parametrize("kwargs,cls_name,words", [c[1:] for c in MASK_CASES], ids=[c[0] for c in MASK_CASES])
def test_mask_rejects(fa, kwargs, cls_name, words):
    cls = getattr(fa, cls_name)
    for fn in (fa.forward_with_states, fa.forward):
        with pytest.raises(cls) as info:
            fn(Q, K, V, **kwargs)
        msg = str(info.value)
        for word in words:
            assert word in msg, (word, msg)
    # backward takes the forward's masks and checks them the same way
    o, lse = fa.forward_with_states(Q, K, V)
    with pytest.raises(cls):
        fa.backward(o, Q, K, V, o, lse, **kwargs)


def test_mask_errors_come_before_device_errors(fa):
    """A bad mask is reported as such whatever the device (validation runs first)."""
    with pytest.raises(fa.ShapeError):
        fa.forward(Q, K, V, seqused_k=np.array([13, 14], np.int32), device="cuda")


def _packed(q_lens=(3, 8), k_lens=(4, 9), h=4, hkv=2, d=8, seed=42):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((sum(q_lens), h, d)).astype(np.float32)
    k = rng.standard_normal((sum(k_lens), hkv, d)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (q_lens, k_lens))
    return q, k, v, cu_q, cu_k


PQ, PK, PV, CU_Q, CU_K = _packed()  # total_q = 11, total_k = 13, B = 2


def _cu(*xs, dtype=np.int32):
    return np.array(xs, dtype=dtype)


# (id, (q, k, v, cu_q, cu_k), keyword arguments, exception class name, words in the message)
VARLEN_CASES = [
    ("cu-decreasing", (PQ, PK, PV, _cu(0, 8, 3, 11), _cu(0, 4, 9, 13)), {}, "ShapeError",
     ["cu_seqlens_q", "non-decreasing"]),
    ("cu-overrun", (PQ, PK, PV, CU_Q, _cu(0, 4, 14)), {}, "ShapeError", ["cu_seqlens_k", "14", "13"]),
    ("cu-short", (PQ, PK, PV, _cu(0, 3, 10), CU_K), {}, "ShapeError", ["cu_seqlens_q", "11"]),
    ("cu-first-not-zero", (PQ, PK, PV, _cu(1, 3, 11), CU_K), {}, "ShapeError", ["cu_seqlens_q[0]"]),
    ("cu-empty", (PQ, PK, PV, _cu(), _cu()), {}, "ShapeError", ["cu_seqlens_q"]),
    ("cu-lengths-differ", (PQ, PK, PV, CU_Q, _cu(0, 4, 9, 13)), {}, "ShapeError", ["cu_seqlens_q", "cu_seqlens_k"]),
    ("cu-rank2", (PQ, PK, PV, CU_Q[None], CU_K), {}, "ShapeError", ["cu_seqlens_q"]),
    ("cu-float", (PQ, PK, PV, CU_Q.astype(np.float32), CU_K), {}, "DTypeError", ["cu_seqlens_q", "float32"]),
    ("cu-list", (PQ, PK, PV, [0, 3, 11], CU_K), {}, "DTypeError", ["cu_seqlens_q", "NumPy"]),
    ("cu-int64-overflow", (PQ, PK, PV, CU_Q, _cu(0, 2**35, 13, dtype=np.int64)), {}, "DTypeError", ["cu_seqlens_k"]),
    ("q-rank4", (PQ[None], PK, PV, CU_Q, CU_K), {}, "ShapeError", ["q", "rank 3"]),
    ("k-rank4", (PQ, PK[None], PV[None], CU_Q, CU_K), {}, "ShapeError", ["k", "rank 3"]),
    ("heads", (PQ[:, :3], PK, PV, CU_Q, CU_K), {}, "ShapeError", ["3", "2"]),
    ("dtype", (PQ.astype(np.float16), PK, PV, CU_Q, CU_K), {}, "DTypeError", ["float16"]),
    ("window-negative", (PQ, PK, PV, CU_Q, CU_K), dict(window=(0, -1)), "UnsupportedError", ["window"]),
    ("window-list", (PQ, PK, PV, CU_Q, CU_K), dict(window=[0, 1]), "UnsupportedError", ["window"]),
    ("scale", (PQ, PK, PV, CU_Q, CU_K), dict(scale=0.0), "UnsupportedError", ["scale"]),
    ("device", (PQ, PK, PV, CU_Q, CU_K), dict(device="tpu"), "UnsupportedError", ["tpu"]),
]


@pytest.mark.parametrize("args,kwargs,cls_name,words", [c[1:] for c in VARLEN_CASES], ids=[c[0] for c in VARLEN_CASES])
def test_varlen_rejects(fa, args, kwargs, cls_name, words):
    cls = getattr(fa, cls_name)
    for fn in (fa.varlen.forward_with_states, fa.varlen.forward):
        with pytest.raises(cls) as info:
            fn(*args, **kwargs)
        msg = str(info.value)
        for word in words:
            assert word in msg, (word, msg)


def test_varlen_rejects_padded_mask_keywords(fa):
    """Varlen calls take no segment ids, padding or block mask: cu_seqlens is their batch layout."""
    with pytest.raises(TypeError):
        fa.varlen.forward(PQ, PK, PV, CU_Q, CU_K, seqused_k=np.array([4, 9], np.int32))
    with pytest.raises(fa.UnsupportedError) as info:  # the native layer says so too
        fa._native.varlen_forward_host_arrays([PQ, PK, PV], [CU_Q, CU_K], "cpu", seqused_k=np.array([4, 9], np.int32))
    assert "seqused_k" in str(info.value)


# varlen backward: valid arguments (o = q and lse made up: validation runs before any kernel)
_LSE = np.zeros((4, 11), np.float32)
VARLEN_BACKWARD_CASES = [
    ("lse-padded-layout", dict(lse=np.zeros((2, 4, 11), np.float32)), "ShapeError", ["lse", "[heads, total_q]"]),
    ("lse-transposed", dict(lse=np.zeros((11, 4), np.float32)), "ShapeError", ["lse"]),
    ("lse-float16", dict(lse=_LSE.astype(np.float16)), "DTypeError", ["lse", "float32"]),
    ("do-shape", dict(do=PQ[:5]), "ShapeError", ["do"]),
    ("o-dtype", dict(o=PQ.astype(np.float16)), "DTypeError", ["o"]),
    ("cu-overrun", dict(cu_q=_cu(0, 3, 12)), "ShapeError", ["cu_seqlens_q", "12"]),
    ("deterministic", dict(deterministic=1), "UnsupportedError", ["deterministic"]),
]


@pytest.mark.parametrize("changes,cls_name,words", [c[1:] for c in VARLEN_BACKWARD_CASES],
                         ids=[c[0] for c in VARLEN_BACKWARD_CASES])
def test_varlen_backward_rejects(fa, changes, cls_name, words):
    a = dict(do=PQ, q=PQ, k=PK, v=PV, o=PQ, lse=_LSE, cu_q=CU_Q, cu_k=CU_K, deterministic=False)
    a.update(changes)
    with pytest.raises(getattr(fa, cls_name)) as info:
        fa.varlen.backward(a["do"], a["q"], a["k"], a["v"], a["o"], a["lse"], a["cu_q"], a["cu_k"],
                           deterministic=a["deterministic"])
    msg = str(info.value)
    for word in words:
        assert word in msg, (word, msg)
