"""Strided NumPy inputs on the CPU: views of q, k, v (and the backward's o, do) are read where they
lie — one slice of a packed qkv, a [B, H, S, D] array seen through np.swapaxes, a batch slice —
with no copy, and give results bit-identical to the same call on contiguous copies. Views the
kernels cannot read (negative strides, a strided last axis) are copied first and still give the
right results. flash_nif.torch's CPU path (bhsd layout, qkv.unbind) rides on the same views.

Sizes are small: the point is the addressing, which the Rust tests (native/flash-core/tests/it/
strides.rs) also check on every path with NaN between a view's elements.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from flash_nif import _args

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}

# (dtype, B, Sq, Sk, H, Hkv, D, causal): GQA, MQA, Sq != Sk both ways, causal and not.
CASES = [
    ("f32", 2, 33, 47, 4, 2, 32, True),
    ("f16", 2, 20, 20, 2, 2, 16, False),
    ("bf16", 3, 17, 9, 4, 1, 24, True),
    ("f32", 1, 70, 70, 2, 1, 40, False),
]
IDS = [f"{c[0]}-B{c[1]}-{c[2]}x{c[3]}-H{c[4]}/{c[5]}-D{c[6]}-{'causal' if c[7] else 'full'}" for c in CASES]
ATTENTION_INPUTS = ("q", "k", "v", "o", "do")


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def bhsd_view(x: np.ndarray) -> np.ndarray:
    """x's values as a [B, S, H, D] view of a [B, H, S, D] buffer (np.swapaxes)."""
    return np.swapaxes(np.ascontiguousarray(np.swapaxes(x, 1, 2)), 1, 2)


@pytest.fixture
def no_copy(monkeypatch):
    """Fails the test if an attention input of a host call is copied (``_args.host_array`` is
    the one place a copy is made); other arguments (lse, masks) go through as before."""
    real = _args.host_array

    def guarded(x, name):
        assert name not in ATTENTION_INPUTS, f"{name} was copied"
        return real(x, name)

    monkeypatch.setattr(_args, "host_array", guarded)


def inputs(make_inputs, case, seed=0):
    dt, b, sq, sk, h, hkv, d, causal = case
    q, k, v, do = make_inputs(seed, b, sq, sk, h, hkv, d, DTYPES[dt])
    return (q, k, v, do), causal


def run(fa, q, k, v, do, causal, o_lse=None, o_view=lambda o: o):
    """(o, lse, dq, dk, dv): forward on (q, k, v), backward from do and the forward's o (passed
    through ``o_view``) — or from the given (o, lse)."""
    o, lse = fa.forward_with_states(q, k, v, causal=causal) if o_lse is None else o_lse
    grads = fa.backward(do, q, k, v, o_view(o), lse, causal=causal)
    return (o, lse, *grads)


def assert_same(got, want, what):
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert same(g, w), f"{what}: {name} differs from the contiguous call's"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_packed_qkv_slices(fa, make_inputs, case, no_copy):
    """q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2] of one [B, S, 3, H, D] array."""
    (q, k, v, do), causal = inputs(make_inputs, case)
    if q.shape != k.shape:  # one packed array needs Sq = Sk and H = Hkv: pack q apart
        kv = np.ascontiguousarray(np.stack([k, v], axis=2))
        views = (bhsd_view(q), kv[:, :, 0], kv[:, :, 1])
    else:
        qkv = np.ascontiguousarray(np.stack([q, k, v], axis=2))
        views = (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
    assert not any(x.flags.c_contiguous for x in views)
    want = run(fa, q, k, v, do, causal)
    assert_same(run(fa, *views, do, causal), want, "qkv slices")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bhsd_arrays_through_swapaxes(fa, make_inputs, case, no_copy):
    """[B, H, S, D] arrays viewed as [B, S, H, D]; o and do transposed views in the backward."""
    (q, k, v, do), causal = inputs(make_inputs, case, seed=1)
    want = run(fa, q, k, v, do, causal)
    got = run(fa, bhsd_view(q), bhsd_view(k), bhsd_view(v), bhsd_view(do), causal, o_view=bhsd_view)
    assert_same(got, want, "swapaxes views")


@pytest.mark.parametrize("case", CASES[:3], ids=IDS[:3])
def test_batch_slice(fa, make_inputs, case, no_copy):
    """x[::2] of a batch twice as large, and a slice of the sequence of k and v."""
    dt, b, sq, sk, h, hkv, d, causal = case
    q, k, v, do = make_inputs(2, 2 * b, sq, sk + 3, h, hkv, d, DTYPES[dt])
    views = (q[::2], k[::2, 2:-1], v[::2, 2:-1], do[::2])
    want = run(fa, *(np.ascontiguousarray(x) for x in views), causal)
    assert_same(run(fa, *views, causal), want, "batch slices")


def test_o_and_do_views_in_the_backward(fa, make_inputs, no_copy):
    """Only the backward's o and do are views (the forward ran on contiguous inputs)."""
    (q, k, v, do), causal = inputs(make_inputs, CASES[0], seed=3)
    o, lse = fa.forward_with_states(q, k, v, causal=causal)
    want = fa.backward(do, q, k, v, o, lse, causal=causal)
    got = fa.backward(bhsd_view(do), q, k, v, bhsd_view(o), lse, causal=causal)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert same(g, w), f"{name} differs"


@pytest.mark.parametrize("mode", ["fused", "materialized"])
def test_both_paths_with_masks_and_modifiers(fa, make_inputs, mode, no_copy):
    """A window, softcap and sinks (dsinks reads o and do too), on each CPU path."""
    q, k, v, do = make_inputs(4, 2, 24, 24, 4, 2, 16, np.float32)
    kw = dict(causal=False, window=(5, 3), softcap=20.0, sinks=np.array([0.5, -1.0, 0.0, 2.0], np.float32), mode=mode)
    o, lse = fa.forward_with_states(q, k, v, **kw)
    want = (o, lse, *fa.backward(do, q, k, v, o, lse, **kw))
    qv, kv, vv = bhsd_view(q), bhsd_view(k), bhsd_view(v)
    o2, lse2 = fa.forward_with_states(qv, kv, vv, **kw)
    got = (o2, lse2, *fa.backward(bhsd_view(do), qv, kv, vv, bhsd_view(o2), lse2, **kw))
    assert len(got) == 6
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), got, want):
        assert same(g, w), f"{mode}: {name} differs"


def test_broadcast_kv_heads(fa, make_inputs, no_copy):
    """Stride 0 (np.broadcast_to) is a view like any other: one kv head read for all four."""
    q, k, v, do = make_inputs(5, 2, 16, 16, 4, 1, 16, np.float32)
    kb, vb = (np.broadcast_to(x, (2, 16, 4, 16)) for x in (k, v))
    assert kb.strides[2] == 0
    want = run(fa, q, np.ascontiguousarray(kb), np.ascontiguousarray(vb), do, True)
    got = run(fa, q, kb, vb, do, True)
    assert_same(got, want, "broadcast k, v")


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_varlen_views(fa, dt, no_copy):
    """Packed [total, 3, H, D] qkv slices and [H, total, D] arrays through swapaxes."""
    rng = np.random.default_rng(6)
    cu = np.array([0, 7, 7, 30, 41], np.int32)
    total, h, d = int(cu[-1]), 2, 24
    qkv = rng.standard_normal((total, 3, h, d)).astype(DTYPES[dt])
    do = rng.standard_normal((total, h, d)).astype(DTYPES[dt])
    q, k, v = (np.ascontiguousarray(qkv[:, i]) for i in range(3))

    def call(q, k, v, do, o_view=lambda o: o):
        o, lse = fa.varlen.forward_with_states(q, k, v, cu, cu, causal=True)
        return (o, lse, *fa.varlen.backward(do, q, k, v, o_view(o), lse, cu, cu, causal=True))

    def heads_first(x):  # [total, H, D] values as a view of an [H, total, D] buffer
        return np.swapaxes(np.ascontiguousarray(np.swapaxes(x, 0, 1)), 0, 1)

    want = call(q, k, v, do)
    assert_same(call(qkv[:, 0], qkv[:, 1], qkv[:, 2], do), want, "varlen qkv slices")
    assert_same(call(*map(heads_first, (q, k, v, do)), o_view=heads_first), want, "varlen swapaxes")


def test_views_reach_the_binding_uncopied(fa, make_inputs, monkeypatch):
    """The very view objects are what the binding receives (and lse stays as given)."""
    q, k, v, do = make_inputs(7, 1, 8, 8, 2, 2, 16, np.float32)
    qkv = np.ascontiguousarray(np.stack([q, k, v], axis=2))
    views = [qkv[:, :, i] for i in range(3)]
    seen = []
    real = fa._native.forward_host_arrays
    monkeypatch.setattr(fa._native, "forward_host_arrays", lambda arrays, *a, **kw: seen.append(arrays) or real(arrays, *a, **kw))
    fa.forward(*views)
    assert all(got is want for got, want in zip(seen[0], views))


def test_unreadable_views_are_copied_and_still_right(fa, make_inputs):
    """Negative strides and a strided last axis: copied (by host_array), results as contiguous."""
    q, k, v, do = make_inputs(8, 2, 12, 12, 2, 2, 16, np.float32)
    wide = np.repeat(q, 2, axis=-1)  # [B, S, H, 2D]: q's values at even columns
    assert not _args.readable_view(q[:, ::-1]) and not _args.readable_view(wide[..., ::2])
    for view in (q[:, ::-1], wide[..., ::2]):
        want = run(fa, np.ascontiguousarray(view), k, v, do, True)
        assert_same(run(fa, view, k, v, do, True), want, "copied view")
    swapped = q.astype(q.dtype.newbyteorder(">"))  # byte-swapped: copied to native order
    assert_same(run(fa, swapped, k, v, do, False), run(fa, q, k, v, do, False), "byte-swapped")


def test_binding_rejects_what_it_cannot_read(fa, make_inputs):
    """Called directly, the binding refuses a view it cannot read (never misreads it)."""
    q, k, v, _ = make_inputs(9, 1, 8, 8, 2, 2, 16, np.float32)
    opts, _ = _args.options(True, None, None, None)
    for bad in (q[:, ::-1], np.repeat(q, 2, axis=-1)[..., ::2]):
        with pytest.raises(fa.ShapeError, match="read in place only"):
            fa._native.forward_host_arrays([bad, k, v], "cpu", **opts)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_torch_cpu_views(fa, dt, no_copy):
    """flash_nif.torch on CPU tensors: layout="bhsd" and qkv.unbind(2) views give the outputs and
    gradients of contiguous [B, S, H, D] inputs, bit for bit."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    import flash_nif.torch as ft

    tdt = {"f32": torch.float32, "f16": torch.float16}[dt]
    g = torch.Generator().manual_seed(10)
    b, s, h, d = 2, 19, 2, 16
    qkv = torch.randn(b, s, 3, h, d, generator=g).to(tdt)
    w = torch.randn(b, s, h, d, generator=g).to(tdt)  # the loss's weights on o

    def grads(q, k, v, o_of):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = o_of(*leaves)
        (o.float() * w.float()).sum().backward()
        return o.detach(), [x.grad for x in leaves]

    # Contiguous [B, S, H, D] leaves, against the same values as [B, H, S, D] (layout="bhsd").
    plain = [qkv[:, :, i].contiguous() for i in range(3)]
    o_want, g_want = grads(*plain, lambda q, k, v: ft.attention(q, k, v))
    bhsd = [x.transpose(1, 2).contiguous() for x in plain]
    o_bhsd, g_bhsd = grads(*bhsd, lambda q, k, v: ft.attention(q, k, v, layout="bhsd").transpose(1, 2))
    assert torch.equal(o_bhsd, o_want)
    assert all(torch.equal(a.transpose(1, 2), b) for a, b in zip(g_bhsd, g_want))

    # One packed qkv leaf, unbound into views.
    leaf = qkv.detach().clone().requires_grad_()
    o = ft.attention(*leaf.unbind(2))
    (o.float() * w.float()).sum().backward()
    assert torch.equal(o.detach(), o_want)
    assert torch.equal(leaf.grad, torch.stack(g_want, dim=2))
