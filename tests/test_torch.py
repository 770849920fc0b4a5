"""flash_nif.torch: the custom ops against torch's SDPA (float64) and the float64 oracle, under
torch.compile(fullgraph=True), torch.export, checkpoint, autocast and opcheck; strided views; dlse.

Skipped as a whole where PyTorch is not installed (``make test`` does not install it). The GPU
tests (marked ``gpu``) run the same checks on CUDA tensors.

Tolerances: against the float64 oracle, conftest's (float32 1e-5; float16 / bfloat16 at most twice
the oracle's own rounding error). Against float64 SDPA, FlashAttention's pattern: our error at most
twice that of torch's own SDPA run in the same dtype, plus 1e-5.
"""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: flash_nif.torch is untested here")
F = torch.nn.functional

from test_gpu import gpu  # noqa: E402,F401 (fixture: a usable GPU)

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
NP_OF = {"f32": np.float32, "f16": np.float16}


@pytest.fixture(scope="module")
def ft(fa):
    import flash_nif.torch

    return flash_nif.torch


def _np(t: torch.Tensor) -> np.ndarray:
    """float64 NumPy copy (the oracle's input)."""
    return t.detach().cpu().double().numpy()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    return float((got - want).norm() / want.norm())


def _inputs(seed, b, sq, sk, h, hkv, d, dtype, dv=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)  # noqa: E731
    q, k, v = mk(b, sq, h, d), mk(b, sk, hkv, d), mk(b, sk, hkv, dv or d)
    do = mk(b, sq, h, dv or d)
    return q, k, v, do


def _grads(fn, q, k, v, do):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o, dq, dk, dv


def _sdpa(q, k, v, mask, scale=None):
    """SDPA on [B, S, H, D] tensors, GQA through enable_gqa; mask bool [B, H, Sq, Sk] (True: seen)."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def _bottom_right(sq, sk, causal, window=None):
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    rel = j - i - (sk - sq)
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        seen &= rel <= 0
    if window is not None:
        left, right = window
        if left is not None:
            seen &= rel >= -left
        if right is not None:
            seen &= rel <= right
    return seen


# (B, Sq, Sk, H, Hkv, D, causal, window): every row sees a key (SDPA's empty rows are NaN).
SDPA_CASES = {
    "mha-causal": (2, 64, 64, 4, 4, 32, True, None),
    "gqa-sq<sk-causal": (1, 37, 90, 6, 2, 24, True, None),
    "mqa-sq>sk-noncausal": (2, 70, 33, 4, 1, 16, False, None),
    "window": (1, 80, 80, 2, 1, 40, False, (7, 3)),
}


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_gradients_match_sdpa_in_float64(ft, case, dtype):
    b, sq, sk, h, hkv, d, causal, window = SDPA_CASES[case]
    q, k, v, do = _inputs(1, b, sq, sk, h, hkv, d, TORCH_DTYPES[dtype])
    mask = _bottom_right(sq, sk, causal, window)
    got = _grads(lambda *a: ft.attention(*a, causal=causal, window=window), q, k, v, do)
    want = _grads(lambda *a: _sdpa(*a, mask), *(x.double() for x in (q, k, v, do)))
    same_precision = _grads(lambda *a: _sdpa(*a, mask), q, k, v, do)  # torch's own, in dtype
    for name, g, w, s in zip(("o", "dq", "dk", "dv"), got, want, same_precision):
        assert g.dtype == q.dtype
        bound = 1e-5 if dtype == "f32" else 2 * _rel(s, w) + 1e-5
        assert _rel(g, w) <= bound, f"{name}: {_rel(g, w):.3g} > {bound:.3g} (torch's own {_rel(s, w):.3g})"


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_gradients_match_the_oracle(ft, ref, assert_close_to_oracle, dtype, layout):
    """Masks and modifiers the SDPA cannot express: segment ids, softcap, sinks (their gradient too);
    Sq > Sk with causal (rows that see no key)."""
    b, sq, sk, h, hkv, d = 2, 45, 30, 4, 2, 16
    q, k, v, do = _inputs(2, b, sq, sk, h, hkv, d, TORCH_DTYPES[dtype])
    seg_q = torch.tensor([[0] * 20 + [1] * 25, [0] * 45])
    seg_k = torch.tensor([[0] * 10 + [1] * 20, [0] * 30])
    sinks = torch.tensor([0.5, -0.25, 1.0, 0.0], requires_grad=True)
    opts = dict(causal=True, softcap=4.0)
    tq, tk, tv, tdo = (x.transpose(1, 2) for x in (q, k, v, do)) if layout == "bhsd" else (q, k, v, do)
    tq, tk, tv = (x.detach().clone().requires_grad_() for x in (tq, tk, tv))
    o, lse = ft.attention_with_lse(tq, tk, tv, segment_ids=(seg_q, seg_k), sinks=sinks, layout=layout, **opts)
    dq, dk, dv, dsinks = torch.autograd.grad(o, (tq, tk, tv, sinks), tdo)
    if layout == "bhsd":
        o, dq, dk, dv = (x.transpose(1, 2) for x in (o, dq, dk, dv))
    masks = dict(segment_ids=(seg_q.numpy(), seg_k.numpy()), sinks=sinks.detach().numpy(), **opts)
    want_o, want_lse = ref.forward_with_states(_np(q), _np(k), _np(v), **masks)
    want = ref.backward(_np(do), _np(q), _np(k), _np(v), _np(o), _np(lse), **masks)  # the op's own o, lse
    np_dtype = NP_OF.get(dtype, None) or __import__("ml_dtypes").bfloat16
    assert_close_to_oracle("o", _np(o), want_o, np_dtype)
    assert_close_to_oracle("lse", _np(lse), want_lse, np.float32)
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_close_to_oracle(name, _np(g), w, np_dtype)
    assert dsinks.dtype == sinks.dtype
    assert_close_to_oracle("dsinks", dsinks.numpy(), want[3], np.float32)


def _lse_reference(q, k, v, mask, scale):
    """(o, lse) in plain torch float64, differentiable: [B, S, H, D] in, lse [B, H, Sq]."""
    g = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv)
    return o, lse


@pytest.mark.parametrize("causal", [True, False])
def test_dlse_flows_through_attention_with_lse(ft, causal):
    b, sq, sk, h, hkv, d = 2, 40, 56, 4, 2, 16
    q, k, v, do = _inputs(3, b, sq, sk, h, hkv, d, torch.float32)
    dl = torch.randn(b, h, sq, generator=torch.Generator().manual_seed(4))
    mask = _bottom_right(sq, sk, causal)

    def both(fn, q, k, v):
        q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
        o, lse = fn(q, k, v)
        return torch.autograd.grad((o * do.to(o.dtype)).sum() + (lse * dl.to(lse.dtype)).sum(), (q, k, v))

    got = both(lambda *a: ft.attention_with_lse(*a, causal=causal), q, k, v)
    want = both(lambda *a: _lse_reference(*a, mask, d ** -0.5), *(x.double() for x in (q, k, v)))
    o_only = both(lambda *a: (ft.attention(*a, causal=causal), torch.zeros(b, h, sq)), q, k, v)
    for name, g, w, plain in zip(("dq", "dk", "dv"), got, want, o_only):
        assert _rel(g, w) <= 1e-5, name
        if name != "dv":  # lse's gradient reaches q and k, never v
            assert _rel(plain, w) > 1e-3, name


def test_lse_alone_gets_a_gradient(ft):
    q, k, v, _ = _inputs(5, 1, 16, 16, 2, 2, 8, torch.float32)
    q.requires_grad_()
    _, lse = ft.attention_with_lse(q, k, v)
    (dq,) = torch.autograd.grad(lse.sum(), (q,))
    qd = q.detach().double().requires_grad_()
    _, want = _lse_reference(qd, k.double(), v.double(), _bottom_right(16, 16, True), 8 ** -0.5)
    (want_dq,) = torch.autograd.grad(want.sum(), (qd,))
    assert _rel(dq, want_dq) <= 1e-5


def test_strided_views_equal_contiguous_copies_bit_for_bit(ft):
    b, s, h, d = 2, 50, 4, 32
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(b, s, 3, h, d, generator=g)
    do = torch.randn(b, s, h, d, generator=g)
    views = qkv.unbind(2)  # [B, S, H, D] views with sequence stride 3·H·D
    assert not views[0].is_contiguous()
    copies = [x.contiguous() for x in views]
    for got, want in zip(_grads(ft.attention, *views, do), _grads(ft.attention, *copies, do)):
        assert torch.equal(got, want)
    # bhsd: transposed views of [B, S, H, D] storage, and [B, H, S, D] contiguous tensors.
    bh = [x.transpose(1, 2) for x in copies]
    bh_copies = [x.contiguous() for x in bh]
    dob = do.transpose(1, 2)
    for got, want in zip(_grads(lambda *a: ft.attention(*a, layout="bhsd"), *bh, dob),
                         _grads(lambda *a: ft.attention(*a, layout="bhsd"), *bh_copies, dob)):
        assert torch.equal(got, want)


def test_bf16_shares_memory_with_numpy(ft):
    """CPU tensors go to the kernels as NumPy views (bfloat16 through int16), not copies."""
    t = torch.randn(2, 3, 4, 8).to(torch.bfloat16)
    a = ft._to_flash(t)
    assert a.dtype.name == "bfloat16" and a.ctypes.data == t.data_ptr()
    back = ft._from_flash(a)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == t.data_ptr()


class _Block(torch.nn.Module):
    """A transformer-ish block: qkv projection, our attention (bhsd, GQA), output projection."""

    def __init__(self, width=64, heads=4, kv_heads=2):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, width // heads
        self.qkv = torch.nn.Linear(width, (heads + 2 * kv_heads) * self.d)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x, ft):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        q, k, v = (t.view(b, s, -1, self.d).transpose(1, 2) for t in (q, k, v))
        o = ft.attention(q, k, v, layout="bhsd", window=(16, 0))
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


def test_compile_fullgraph_matches_eager(ft):
    torch.manual_seed(7)
    block = _Block()
    x = torch.randn(2, 40, 64)

    def step(x):
        y = block(x, ft)
        return (y * y).mean()

    eager_loss = step(x)
    eager = torch.autograd.grad(eager_loss, list(block.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)  # raises on any graph break
    loss = compiled(x)
    grads = torch.autograd.grad(loss, list(block.parameters()))
    assert torch.allclose(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, eager):
        assert torch.allclose(g, e, rtol=1e-4, atol=1e-6)


def test_compiled_op_alone_is_bit_identical(ft):
    q, k, v, do = _inputs(8, 2, 33, 47, 4, 2, 16, torch.float32)
    fn = lambda q, k, v: ft.attention_with_lse(q, k, v, softcap=3.0)[0]  # noqa: E731
    torch._dynamo.reset()
    for got, want in zip(_grads(torch.compile(fn, fullgraph=True), q, k, v, do), _grads(fn, q, k, v, do)):
        assert torch.equal(got, want)


def _op_args(q, k, v):
    # q, k, v, seg_q, seg_k, seqused_k, leftpad_k, block_mask, alibi_slopes, sinks, then the options.
    sinks = torch.tensor([0.1, -0.2, 0.3, 0.0], requires_grad=True)
    return (q, k, v, None, None, None, None, None, None, sinks, True, None, 8, None, 2.0, False, "auto", "exact")


def test_opcheck_forward(ft):
    q, k, v, _ = _inputs(9, 2, 20, 24, 4, 2, 16, torch.float32)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    torch.library.opcheck(torch.ops.flash_nif.attention_forward.default, _op_args(q, k, v))
    bf = [x.detach().to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(torch.ops.flash_nif.attention_forward.default, _op_args(*bf))


def test_opcheck_backward(ft):
    q, k, v, do = _inputs(10, 2, 20, 24, 4, 2, 16, torch.float32)
    args = _op_args(q, k, v)
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)  # no double backward
    o, lse = torch.ops.flash_nif.attention_forward(*args)
    dlse = torch.randn_like(lse)
    torch.library.opcheck(torch.ops.flash_nif.attention_backward.default, (do, q, k, v, o, lse, dlse, *args[3:]))


def test_export_round_trip_keeps_one_op(ft):
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return ft.attention(q, k, v, layout="bhsd", causal=False)

    q, k, v, _ = _inputs(11, 2, 24, 24, 4, 4, 16, torch.float32)
    args = tuple(x.transpose(1, 2).contiguous() for x in (q, k, v))
    ep = torch.export.export(M(), args)
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.flash_nif.attention_forward.default) == 1
    assert not any("attention" in str(t) and t != torch.ops.flash_nif.attention_forward.default for t in ops)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    assert torch.equal(loaded.module()(*args), M()(*args))


def test_checkpoint_gives_the_same_gradients(ft):
    from torch.utils.checkpoint import checkpoint

    q, k, v, do = _inputs(12, 2, 30, 30, 2, 2, 16, torch.float32)
    fn = lambda q, k, v: ft.attention(q, k, v, causal=True) * 2.0  # noqa: E731
    plain = _grads(fn, q, k, v, do)
    ckpt = _grads(lambda *a: checkpoint(fn, *a, use_reentrant=False), q, k, v, do)
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


def test_autocast_runs_in_the_low_precision_dtype(ft):
    q, k, v, do = _inputs(13, 1, 20, 20, 2, 2, 16, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(ft.attention, q, k, v, do.to(torch.bfloat16))
    want = _grads(ft.attention, *(x.to(torch.bfloat16) for x in (q, k, v)), do.to(torch.bfloat16))
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32  # grads in the leaves' dtype
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        assert torch.equal(g, w.float())


def test_bad_arguments_raise_clear_errors(ft, fa):
    q, k, v, _ = _inputs(14, 1, 8, 8, 2, 2, 8, torch.float32)
    with pytest.raises(fa.UnsupportedError, match="layout"):
        ft.attention(q, k, v, layout="sbhd")
    with pytest.raises(fa.ShapeError):
        ft.attention(q, k[:, :, :, :4], v)
    with pytest.raises(fa.DTypeError, match="float64"):
        ft.attention(q.double(), k.double(), v.double())
    with pytest.raises(fa.UnsupportedError, match="segment_ids"):
        ft.attention(q, k, v, segment_ids=torch.zeros(1, 8, dtype=torch.int32))
    with pytest.raises(fa.UnsupportedError, match="precision"):
        ft.attention(q, k, v, precision="fp16")


def test_precision_reaches_the_op(ft):
    """On the CPU both precisions are exact f32: the same bits."""
    q, k, v, _ = _inputs(15, 1, 8, 8, 2, 2, 8, torch.float32)
    assert torch.equal(ft.attention(q, k, v, precision="tf32"), ft.attention(q, k, v, precision="exact"))


def test_flash_nif_imports_without_torch(fa):
    code = "import sys, flash_nif; assert 'torch' not in sys.modules, 'flash_nif imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- CUDA tensors (the GPU machine) ---------------------------------------------------------------


def _cuda_or_skip(gpu):
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_gpu_gradients_match_sdpa_in_float64(ft, gpu, case, dtype):
    _cuda_or_skip(gpu)
    b, sq, sk, h, hkv, d, causal, window = SDPA_CASES[case]
    q, k, v, do = _inputs(21, b, sq, sk, h, hkv, d, TORCH_DTYPES[dtype], device="cuda")
    mask = _bottom_right(sq, sk, causal, window).cuda()
    got = _grads(lambda *a: ft.attention(*a, causal=causal, window=window), q, k, v, do)
    assert all(g.is_cuda for g in got)
    want = _grads(lambda *a: _sdpa(*a, mask), *(x.double() for x in (q, k, v, do)))
    same_precision = _grads(lambda *a: _sdpa(*a, mask), q, k, v, do)
    for name, g, w, s in zip(("o", "dq", "dk", "dv"), got, want, same_precision):
        bound = 1e-5 if dtype == "f32" else 2 * _rel(s, w) + 1e-5
        assert _rel(g, w) <= bound, f"{name}: {_rel(g, w):.3g} > {bound:.3g} (torch's own {_rel(s, w):.3g})"


@pytest.mark.gpu
def test_gpu_dlse_and_sinks_match_the_cpu(ft, gpu):
    _cuda_or_skip(gpu)
    q, k, v, do = _inputs(22, 2, 64, 96, 4, 2, 64, torch.float32)
    dl = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(23))

    def run(device):
        sinks = torch.tensor([0.5, -0.5, 0.0, 1.0], device=device, requires_grad=True)
        qq, kk, vv = (x.to(device).requires_grad_() for x in (q, k, v))
        o, lse = ft.attention_with_lse(qq, kk, vv, sinks=sinks, deterministic=True)
        loss = (o * do.to(device)).sum() + (lse * dl.to(device)).sum()
        return [t.cpu() for t in torch.autograd.grad(loss, (qq, kk, vv, sinks))]

    for g, c in zip(run("cuda"), run("cpu")):
        assert _rel(g, c) <= 1e-5


@pytest.mark.gpu
def test_gpu_compile_fullgraph_and_strided_views(ft, gpu):
    _cuda_or_skip(gpu)
    torch.manual_seed(24)
    block = _Block(width=128, heads=4, kv_heads=2).cuda().to(torch.bfloat16)
    x = torch.randn(2, 256, 128, device="cuda", dtype=torch.bfloat16)
    eager = block(x, ft)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: block(x, ft), fullgraph=True)(x)
    assert _rel(compiled, eager) <= 1e-2
    qkv = torch.randn(2, 128, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16)
    views = qkv.unbind(2)
    a = _grads(lambda *t: ft.attention(*t, deterministic=True), *views, do)
    b = _grads(lambda *t: ft.attention(*t, deterministic=True), *(t.contiguous() for t in views), do)
    for got, want in zip(a, b):
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_runs_on_the_current_stream(ft, gpu):
    _cuda_or_skip(gpu)
    q, k, v, do = _inputs(25, 2, 512, 512, 8, 8, 64, torch.bfloat16, device="cuda")
    want = ft.attention(q, k, v)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = ft.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(got, want)
