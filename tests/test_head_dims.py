"""Every head dim from 1 to 256 on every device, and v's own head dim Dv (DeepSeek-style 192 / 128):
o, do and dv take Dv, dq and dk D. Against the float64 oracle, forward and backward, with causal,
GQA, Sq != Sk, masks and varlen, in every dtype.

Each case runs on the CPU and, marked ``gpu``, on the GPU three ways (NumPy with device="cuda",
torch, CuPy; see test_masks.py's Env). The GPU runs these head dims through its padding layer
(flash-core's cuda/pad.rs): zero-filled copies at a multiple of 8, which must give what the kernels
give on inputs padded by hand, bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_masks import DEVICES, DTYPES, GPU_LIBS, Env, block_mask, documents, i32


@pytest.fixture
def env(request, fa):
    where = request.node.callspec.params["where"]
    if where != "cpu":
        info = fa.info().get("cuda", {})
        if not info.get("available"):
            pytest.skip(f"no usable CUDA GPU: {info.get('reason')}")
    return Env(where)


def inputs(seed, b, sq, sk, h, hkv, d, dv, dtype):
    """q [B, Sq, H, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv], do [B, Sq, H, Dv] (random normals)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, dv)).astype(dtype)
    do = rng.standard_normal((b, sq, h, dv)).astype(dtype)
    return q, k, v, do


def run(fa, ref, env, check, shape, dtype_name, causal=True, masks=None, seed=0, deterministic=False):
    """Forward and backward of one case against the oracle; returns the host outputs."""
    b, sq, sk, h, hkv, d, dv = shape
    dtype = DTYPES[dtype_name]
    masks = masks or {}
    q, k, v, do = inputs(seed, b, sq, sk, h, hkv, d, dv, dtype)
    g = [env.put(x) for x in (q, k, v, do)]
    gm = env.masks(masks)
    ctx = f"shape={shape} causal={causal} masks={sorted(masks)} where={env.where}"
    o, lse = fa.forward_with_states(g[0], g[1], g[2], causal=causal, **gm, **env.kw)
    ho, hlse = env.get(o), env.get(lse)
    assert ho.shape == (b, sq, h, dv) and hlse.shape == (b, h, sq), ctx
    ro, rlse = ref.forward_with_states(q, k, v, causal=causal, **masks)
    check("o", ho, ro, dtype, ctx)
    check("lse", hlse, rlse, np.float32, ctx)
    grads = fa.backward(g[3], g[0], g[1], g[2], o, lse, causal=causal, deterministic=deterministic, **gm, **env.kw)
    hgrads = [env.get(x) for x in grads]
    want = ref.backward(do, q, k, v, ho, hlse, causal=causal, **masks)
    for name, got, w, x in zip(("dq", "dk", "dv"), hgrads, want, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype, (name, got.shape, x.shape, ctx)
        check(name, got, w, dtype, ctx)
    return ho, hlse, *hgrads


# (D, Dv): odd D (FlashAttention's grid has 59 and 111), both ends, Dv < D and Dv > D.
HEAD_DIMS = [(1, 1), (3, 3), (59, 59), (111, 111), (200, 200), (256, 256), (192, 128), (128, 192), (59, 111),
             (111, 59), (256, 8), (8, 256), (40, 24)]


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("d,dv", HEAD_DIMS, ids=[f"d{d}-dv{dv}" for d, dv in HEAD_DIMS])
def test_head_dims_f32(fa, ref, env, assert_close_to_oracle, where, d, dv):
    for causal, shape in ((True, (2, 37, 53, 4, 2)), (False, (1, 70, 30, 3, 1))):  # GQA Sq < Sk, MQA Sq > Sk
        run(fa, ref, env, assert_close_to_oracle, (*shape, d, dv), "f32", causal=causal, seed=d + 7 * dv)


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("dtype_name", ["f16", "bf16"])
@pytest.mark.parametrize("d,dv", [(1, 1), (59, 59), (111, 111), (192, 128), (72, 200), (3, 256)],
                         ids=lambda x: str(x))
def test_head_dims_low_precision(fa, ref, env, assert_close_to_oracle, where, dtype_name, d, dv):
    run(fa, ref, env, assert_close_to_oracle, (2, 97, 80, 4, 2, d, dv), dtype_name, seed=d + dv)


def _masks(rng, b, sq, sk, h):
    return {
        "window": dict(window=(20, 5)),
        "segments": dict(segment_ids=(documents(rng, b, sq, 3), documents(rng, b, sk, 3))),
        "padding": dict(seqused_k=i32(sk, sk - 30), leftpad_k=i32(0, 11)),
        "block": dict(block_mask=block_mask(rng, (b, h, -(-sq // 128), -(-sk // 128)))),
    }


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("mask", ["window", "segments", "padding", "block"])
@pytest.mark.parametrize("d,dv,dtype_name", [(59, 24, "f32"), (24, 72, "f32"), (192, 128, "bf16"), (111, 111, "f16")],
                         ids=lambda x: str(x))
def test_masks_with_any_head_dims(fa, ref, env, assert_close_to_oracle, where, mask, d, dv, dtype_name):
    b, sq, sk, h, hkv = 2, 150, 200, 4, 2
    masks = _masks(np.random.default_rng(d + dv), b, sq, sk, h)[mask]
    for causal in (False, True):
        run(fa, ref, env, assert_close_to_oracle, (b, sq, sk, h, hkv, d, dv), dtype_name, causal=causal, masks=masks)


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("d,dv,dtype_name", [(59, 24, "f32"), (3, 200, "f32"), (192, 128, "bf16"), (111, 111, "f16")],
                         ids=lambda x: str(x))
def test_varlen_with_any_head_dims(fa, ref, env, assert_close_to_oracle, where, d, dv, dtype_name):
    dtype = DTYPES[dtype_name]
    q_lens, k_lens, h, hkv = [5, 0, 97, 1], [7, 3, 90, 40], 4, 2
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (q_lens, k_lens))
    rng = np.random.default_rng(d * dv)
    q = rng.standard_normal((cu_q[-1], h, d)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], hkv, d)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], hkv, dv)).astype(dtype)
    do = rng.standard_normal((cu_q[-1], h, dv)).astype(dtype)
    g = [env.put(x) for x in (q, k, v, do, cu_q, cu_k)]
    for causal, window in ((True, None), (False, (9, 3))):
        ctx = f"varlen d={d} dv={dv} causal={causal} where={env.where}"
        o, lse = fa.varlen.forward_with_states(g[0], g[1], g[2], g[4], g[5], causal=causal, window=window, **env.kw)
        ho, hlse = env.get(o), env.get(lse)
        assert ho.shape == (cu_q[-1], h, dv)
        ro, rlse = ref.varlen_forward_with_states(q, k, v, cu_q, cu_k, causal=causal, window=window)
        assert_close_to_oracle("o", ho, ro, dtype, ctx)
        assert_close_to_oracle("lse", hlse, rlse, np.float32, ctx)
        grads = fa.varlen.backward(g[3], g[0], g[1], g[2], o, lse, g[4], g[5], causal=causal, window=window,
                                   **env.kw)
        want = ref.varlen_backward(do, q, k, v, ho, hlse, cu_q, cu_k, causal=causal, window=window)
        for name, got, w in zip(("dq", "dk", "dv"), grads, want):
            assert_close_to_oracle(name, env.get(got), w, dtype, ctx)


@pytest.mark.parametrize("where", DEVICES)
def test_default_scale_is_one_over_sqrt_d(fa, env, where):
    """The default scale comes from q and k's D, whatever v's Dv."""
    q, k, v, _ = inputs(3, 1, 20, 30, 2, 1, 59, 128, np.float32)
    g = [env.put(x) for x in (q, k, v)]
    want = env.get(fa.forward(*g, scale=1 / math.sqrt(59), **env.kw))
    np.testing.assert_array_equal(env.get(fa.forward(*g, **env.kw)), want)


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("d,dv", [(59, 111), (192, 128)], ids=str)
def test_deterministic_backward_is_bit_identical(fa, ref, env, assert_close_to_oracle, where, d, dv):
    first = run(fa, ref, env, assert_close_to_oracle, (2, 130, 150, 4, 2, d, dv), "bf16", deterministic=True)
    again = run(fa, ref, env, assert_close_to_oracle, (2, 130, 150, 4, 2, d, dv), "bf16", deterministic=True)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.view(np.uint16) if a.dtype.itemsize == 2 else a,
                                      b.view(np.uint16) if b.dtype.itemsize == 2 else b)


# --- errors -----------------------------------------------------------------------------------------

def test_head_dim_errors(fa):
    q, k, v, do = inputs(4, 1, 6, 7, 2, 1, 59, 24, np.float32)
    for bad_dv in (0, 257):
        with pytest.raises(fa.ShapeError, match="v's head_dim must be between 1 and 256"):
            fa.forward(q, k, np.zeros((1, 7, 1, bad_dv), np.float32))
    with pytest.raises(fa.ShapeError, match="head_dim must be between 1 and 256"):
        fa.forward(*inputs(4, 1, 6, 7, 2, 1, 257, 8, np.float32)[:3])
    with pytest.raises(fa.ShapeError, match="but for the last"):
        fa.forward(q, k, v[:, :5])
    with pytest.raises(fa.ShapeError, match="head_dim mismatch"):
        fa.forward(q, k[..., :58], v)
    o, lse = fa.forward_with_states(q, k, v)
    assert o.shape == (1, 6, 2, 24)
    with pytest.raises(fa.ShapeError, match=r"o has shape \[1, 6, 2, 59\]; it must be q's shape with v's head_dim"):
        fa.backward(do, q, k, v, np.zeros(q.shape, np.float32), lse)
    with pytest.raises(fa.ShapeError, match=r"do has shape \[1, 6, 2, 59\]"):
        fa.backward(np.zeros(q.shape, np.float32), q, k, v, o, lse)
    with pytest.raises(fa.ShapeError, match="lse"):
        fa.backward(do, q, k, v, o, lse[:, :1])
    cu = i32(0, 6)
    with pytest.raises(fa.ShapeError, match="v's head_dim"):
        fa.varlen.forward(q[0], k[0][:6], np.zeros((6, 1, 300), np.float32), cu, cu)
    o, lse = fa.varlen.forward_with_states(q[0], k[0][:6], v[0][:6], cu, cu)
    with pytest.raises(fa.ShapeError, match="o has shape"):
        fa.varlen.backward(do[0], q[0], k[0][:6], v[0][:6], np.zeros(q[0].shape, np.float32), lse, cu, cu)


# --- GPU only: the padding layer ------------------------------------------------------------------

def _padded(x, width):
    return np.concatenate([x, np.zeros((*x.shape[:-1], width - x.shape[-1]), x.dtype)], axis=-1)


@pytest.mark.parametrize("where", GPU_LIBS)
@pytest.mark.parametrize("d,dv,dtype_name", [(59, 59, "bf16"), (192, 128, "f16"), (3, 200, "f32"), (111, 8, "bf16")],
                         ids=lambda x: str(x))
def test_padding_layer_equals_the_kernels_on_padded_inputs(fa, env, where, d, dv, dtype_name):
    """The padding layer runs the kernels of Dk = roundup8(max(D, Dv)) on zero-filled copies: the
    same as calling them on inputs padded by hand (scale 1/sqrt(D)), bit for bit, then cropping."""
    dtype = DTYPES[dtype_name]
    dk = -(-max(d, dv) // 8) * 8
    q, k, v, do = inputs(9, 2, 100, 130, 4, 2, d, dv, dtype)
    scale = 1 / math.sqrt(d)
    opts = dict(causal=True, deterministic=True, **env.kw)
    g = [env.put(x) for x in (q, k, v, do)]
    o, lse = fa.forward_with_states(*g[:3], causal=True, **env.kw)
    dq, dk_, dv_ = fa.backward(g[3], *g[:3], o, lse, **opts)
    w = [env.put(_padded(x, dk)) for x in (q, k, v, do)]
    wo, wlse = fa.forward_with_states(*w[:3], causal=True, scale=scale, **env.kw)
    wdq, wdk, wdv = fa.backward(w[3], *w[:3], wo, wlse, scale=scale, **opts)
    pairs = [(o, wo, dv), (lse, wlse, None), (dq, wdq, d), (dk_, wdk, d), (dv_, wdv, dv)]
    for got, want, cols in pairs:
        want = env.get(want)
        want = want if cols is None else want[..., :cols]
        np.testing.assert_array_equal(env.get(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8))
    assert not env.get(wo)[..., dv:].astype(np.float32).any(), "zero v columns give zero o columns"


@pytest.mark.gpu
def test_padding_layer_writes_every_output_element(fa, make_inputs):
    """The native device entry points on NaN-poisoned outputs, through the padding layer."""
    cupy = pytest.importorskip("cupy")
    info = fa.info().get("cuda", {})
    if not info.get("available"):
        pytest.skip(f"no usable CUDA GPU: {info.get('reason')}")
    native = fa._native
    for dtype_name, (b, sq, sk, h, hkv, d, dv) in (("f16", (2, 97, 33, 4, 2, 59, 24)), ("f32", (1, 65, 130, 2, 1, 3, 200))):
        dtype = DTYPES[dtype_name]
        q, k, v, do = (cupy.asarray(x) for x in inputs(1, b, sq, sk, h, hkv, d, dv, dtype))
        name = np.dtype(dtype).name
        o = cupy.full((b, sq, h, dv), np.nan, dtype)
        lse = cupy.full((b, h, sq), np.nan, np.float32)
        stream = cupy.cuda.get_current_stream().ptr
        desc = [(x.data.ptr, list(x.shape), name) for x in (q, k, v)]
        native.cuda_forward_device(desc, [o.data.ptr, lse.data.ptr], 0, stream, causal=True)
        desc = [(x.data.ptr, list(x.shape), name) for x in (do, q, k, v, o)] + [(lse.data.ptr, [b, h, sq], "float32")]
        for deterministic in (False, True):
            grads = [cupy.full(x.shape, np.nan, dtype) for x in (q, k, v)]
            native.cuda_backward_device(desc, [x.data.ptr for x in grads] + [0], 0, stream, causal=True,  # no dsinks
                                        deterministic=deterministic)
            cupy.cuda.get_current_stream().synchronize()
            for label, x in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads)):
                assert not np.isnan(cupy.asnumpy(x).astype(np.float32)).any(), f"{label} not fully written"
