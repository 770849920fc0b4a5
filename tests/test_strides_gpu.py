"""Strided views on the GPU (marked ``gpu``): the kernels read q, k, v (and the backward's do and o)
where they lie — ``qkv.unbind`` views, ``[B, H, S, D]`` transposes, batch slices — and give the
bits the same call gives on contiguous copies, on every kernel family (Hopper, portable, fp32,
masked, varlen, the padding copies for odd head dims and rows off 16-byte boundaries).
"""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu import HAVE_CUPY_GPU, HAVE_TORCH_GPU
from test_sm90 import gpu  # noqa: F401 (fixture: a usable GPU)

pytestmark = pytest.mark.gpu

if HAVE_TORCH_GPU:
    import torch
if HAVE_CUPY_GPU:
    import cupy

TORCH_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def tdt(name):
    return getattr(torch, TORCH_DTYPES[name])


def views(kind, b, s, h, hkv, d, dtype, gen):
    """q, k, v [B, S, H, D] as views of one allocation each way `kind` names (k, v with Hkv heads)."""
    dev = "cuda"
    if kind == "qkv":  # one packed [B, S, H + 2 Hkv, D] projection output, split by heads
        x = torch.randn(b, s, h + 2 * hkv, d, device=dev, generator=gen).to(dtype)
        return x[:, :, :h], x[:, :, h:h + hkv], x[:, :, h + hkv:]
    if kind == "bhsd":  # [B, H, S, D] tensors viewed as [B, S, H, D]
        return tuple(torch.randn(b, n, s, d, device=dev, generator=gen).to(dtype).transpose(1, 2) for n in (h, hkv, hkv))
    if kind == "batch-slice":  # every other batch row
        return tuple(torch.randn(2 * b, s, n, d, device=dev, generator=gen).to(dtype)[::2] for n in (h, hkv, hkv))
    if kind == "row-offset":  # rows 2 elements off 16-byte boundaries: the padding copy reads them
        out = []
        for n in (h, hkv, hkv):
            flat = torch.randn(b * s * n * (d + 2) + 2, device=dev, generator=gen).to(dtype)
            out.append(flat[2:].view(b, s, n, d + 2)[..., :d])
        return tuple(out)
    raise ValueError(kind)


def run(fa, q, k, v, do, causal, **opts):
    o, lse = fa.forward_with_states(q, k, v, causal=causal, **opts)
    grads = fa.backward(do, q, k, v, o, lse, causal=causal, deterministic=True, **opts)
    return (o, lse, *grads)


def check_views(fa, q, k, v, causal, gen, do_view=None, **opts):
    """Forward and deterministic backward on the views and on contiguous copies: bit-identical."""
    do = torch.randn(q.shape[:-1] + (v.shape[-1],), device="cuda", generator=gen).to(q.dtype)
    if do_view == "bhsd":
        do = do.transpose(1, 2).contiguous().transpose(1, 2)
    got = run(fa, q, k, v, do, causal, **opts)
    kern = fa.info()["cuda"]["last_kernels"]
    want = run(fa, *(x.contiguous() for x in (q, k, v, do)), causal, **opts)
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape
        assert torch.equal(g, w), f"{name} differs on strided views ({opts}, kernels {kern})"
    # The backward's o as a strided view too.
    o = got[0].transpose(1, 2).contiguous().transpose(1, 2)
    again = fa.backward(do, q, k, v, o, got[1], causal=causal, deterministic=True, **opts)
    for name, g, w in zip(("dq", "dk", "dv"), again, want[2:]):
        assert torch.equal(g, w), f"{name} differs with a strided o"
    return kern


needs_torch = pytest.mark.skipif(not HAVE_TORCH_GPU, reason="needs torch with CUDA")


@needs_torch
@pytest.mark.parametrize("kind", ["qkv", "bhsd", "batch-slice", "row-offset"])
@pytest.mark.parametrize("dtype_name", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("d", [64, 128])
def test_views_are_read_in_place_and_bit_identical(gpu, kind, dtype_name, d):
    import flash_nif as fa

    gen = torch.Generator(device="cuda").manual_seed(d)
    for causal, (b, s, h, hkv) in ((True, (2, 300, 4, 2)), (False, (1, 130, 2, 2))):
        q, k, v = views(kind, b, s, h, hkv, d, tdt(dtype_name), gen)
        check_views(fa, q, k, v, causal, gen, do_view="bhsd")


@needs_torch
@pytest.mark.parametrize("kind", ["qkv", "bhsd"])
def test_views_on_the_portable_kernels(gpu, kind, monkeypatch):
    import flash_nif as fa

    monkeypatch.setenv("FLASH_NIF_SM90", "0")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = views(kind, 2, 257, 4, 1, 128, torch.bfloat16, gen)
    kern = check_views(fa, q, k, v, True, gen)
    assert not kern["forward"]["kernel"].startswith("fwd_sm90"), kern


@needs_torch
@pytest.mark.parametrize("kind", ["qkv", "bhsd", "row-offset"])
def test_views_with_masks_modifiers_and_odd_head_dims(gpu, kind):
    import flash_nif as fa

    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = views(kind, 2, 200, 4, 2, 64, torch.bfloat16, gen)
    check_views(fa, q, k, v, False, gen, window=(40, 0), softcap=20.0)
    seg = torch.tensor([[0] * 120 + [1] * 80, [0] * 200], dtype=torch.int32, device="cuda")
    check_views(fa, q, k, v, True, gen, segment_ids=(seg, seg))
    q, k, v = views(kind, 1, 90, 2, 1, 40, torch.float16, gen)  # D = 40: the padding copies
    check_views(fa, q, k, v, True, gen)


@needs_torch
def test_varlen_views(gpu):
    import flash_nif as fa
    from flash_nif import varlen

    gen = torch.Generator(device="cuda").manual_seed(7)
    lens = [70, 130, 1]
    total, h, d = sum(lens), 4, 64
    x = torch.randn(total, 3 * h, d, device="cuda", generator=gen).to(torch.bfloat16)
    q, k, v = x[:, :h], x[:, h:2 * h], x[:, 2 * h:]
    cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32, device="cuda")
    do = torch.randn(total, h, d, device="cuda", generator=gen).to(torch.bfloat16)
    outs = []
    for args in ((q, k, v, do), tuple(t.contiguous() for t in (q, k, v, do))):
        o, lse = varlen.forward_with_states(*args[:3], cu, cu, causal=True)
        outs.append((o, lse, *varlen.backward(args[3], *args[:3], o, lse, cu, cu, causal=True, deterministic=True)))
    for g, w in zip(*outs):
        assert torch.equal(g, w)
    assert fa.info()["cuda"]["last_kernels"]


@pytest.mark.skipif(not HAVE_CUPY_GPU, reason="needs CuPy")
def test_cupy_views(gpu):
    import flash_nif as fa

    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((2, 100, 3, 4, 64)).astype(np.float16))
    q, k, v = x[:, :, 0], x[:, :, 1], x[:, :, 2]
    o, lse = fa.forward_with_states(q, k, v, causal=True)
    o2, lse2 = fa.forward_with_states(*(cupy.ascontiguousarray(t) for t in (q, k, v)), causal=True)
    assert cupy.array_equal(o, o2) and cupy.array_equal(lse, lse2)


def test_numpy_views_with_device_cuda(gpu):
    """NumPy views on device="cuda": each view's span is uploaded as it lies, with its strides."""
    import flash_nif as fa

    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 80, 3, 4, 64)).astype(np.float32)
    views = (x[:, :, 0], x[:, :, 1], np.swapaxes(rng.standard_normal((2, 4, 80, 64)).astype(np.float32), 1, 2))
    do = rng.standard_normal((2, 80, 4, 64)).astype(np.float32)
    for got, want in zip(fa.forward_with_states(*views, causal=True, device="cuda"),
                         fa.forward_with_states(*(np.ascontiguousarray(t) for t in views), causal=True, device="cuda")):
        assert np.array_equal(got, want)
    o, lse = fa.forward_with_states(*views, causal=True, device="cuda")
    o_view = np.swapaxes(np.ascontiguousarray(np.swapaxes(o, 1, 2)), 1, 2)
    got = fa.backward(do, *views, o_view, lse, causal=True, deterministic=True, device="cuda")
    want = fa.backward(do, *(np.ascontiguousarray(t) for t in views), o, lse, causal=True, deterministic=True, device="cuda")
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


@needs_torch
def test_torch_op_runs_views_with_no_copy(gpu):
    """flash_nif.torch.attention on qkv.unbind views and bhsd tensors launches no copy kernel."""
    import flash_nif.torch as ft
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator(device="cuda").manual_seed(11)
    b, s, h, d = 2, 512, 4, 64
    qkv = torch.randn(b, s, 3, h, d, device="cuda", generator=gen, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.unbind(2)
    ft.attention(q, k, v).sum().backward()  # warm-up (kernel compiles)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        o = ft.attention(q, k, v)
        o.backward(torch.ones_like(o))
        torch.cuda.synchronize()
    # autograd's own unbind backward stacks the three gradients (a cat kernel, which SDPA pays too);
    # no element-wise copy (a .contiguous()) may run.
    copies = [e.key for e in prof.key_averages() if "direct_copy" in e.key or "copy_kernel" in e.key]
    assert not copies, copies
    want = ft.attention(*(t.detach().contiguous() for t in (q, k, v)))
    assert torch.equal(o, want)


@needs_torch
def test_other_calls_copy_views_they_cannot_read(gpu):
    """decode reads packed arrays only: a strided q is copied for it, never misread."""
    import flash_nif as fa

    gen = torch.Generator(device="cuda").manual_seed(13)
    x = torch.randn(2, 1, 3, 8, 64, device="cuda", generator=gen).to(torch.bfloat16)
    q = x[:, :, 0]  # [B, 1, H, D], a strided view
    kc, vc = (torch.randn(2, 300, 2, 64, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    for got, want in zip(fa.decode(q, kc, vc), fa.decode(q.contiguous(), kc, vc)):
        assert torch.equal(got, want)
