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
    ("v-head-dim-ne-k", fwd(Q, K, np.concatenate([V, V], axis=3)), "ShapeError"),
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
