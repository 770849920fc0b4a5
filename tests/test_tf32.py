"""float32 on tensor cores: the ``precision`` option (cuda/tf32.h; fwd.cu, bwd_dq.cu and bwd_dkdv.cu
with TF32_TERMS; on Hopper the wgmma kernels cuda/fwd_sm90_f32.cu, bwd_dq_sm90_f32.cu and
bwd_dkdv_sm90_f32.cu).

GPU tests (marked ``gpu``): every kernel ``precision="exact"`` can pick for float32 against the
float64 oracle — the split-TF32 forward (three TF32 products per pair) and the split-TF32 backward
fed its o and lse, both its paths (the default: dK/dV with dQ by atomics; ``deterministic=True``:
the separate dQ and dK/dV kernels) — within twice the SIMT kernels' worst errors of the GPU suite
(bench/RESULTS.md: o 6.9e-7, dq / dk / dv 1.7e-6): o <= 1.4e-6, dq / dk / dv <= 3.4e-6, lse 1e-5
(conftest's float32 bound); every tile class of the forward and backward (D <= 64, <= 128, > 128),
GQA, causal with Sq != Sk, ragged tiles, each mask and modifier. ``FLASH_NIF_TF32=0`` runs the
SIMT kernels on the same inputs for the record (printed beside). ``precision="tf32"`` (one TF32
product) within its documented bound (5e-3) for o, lse, dq, dk and dv. Outputs of the native entry
points are poisoned with NaN first. ``info()["cuda"]["last_kernels"]`` must name the kernel each
precision promises. On a Hopper GPU the f32 forward and backward at D = 64 and 128 (plain problems) run the wgmma kernels, checked the same way, on strided views too, and what they do
not take falls back with the reason in ``info()``.

CPU tests (run in CI): the option is accepted by every call, the CPU computes in float32 under
either value (bit-identical results), and a bad value is a clear UnsupportedError.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from test_gpu import HAVE_CUPY_GPU, HAVE_TORCH_GPU, to_gpu, to_host

EXACT_BOUNDS = {"o": 1.4e-6, "lse": 1e-5, "dq": 3.4e-6, "dk": 3.4e-6, "dv": 3.4e-6}
TF32_BOUND = 5e-3  # flash_core::precision::TF32_BOUND
LIB = "torch" if HAVE_TORCH_GPU else "cupy"


# ---- CPU: the option's plumbing -------------------------------------------------------------------


def _inputs(make_inputs, shape=(2, 37, 45, 4, 2, 16), seed=3):
    b, sq, sk, h, hkv, d = shape
    return make_inputs(seed, b, sq, sk, h, hkv, d, np.float32)


def test_cpu_is_exact_f32_under_either_precision(fa, make_inputs):
    q, k, v, do = _inputs(make_inputs)
    o, lse = fa.forward_with_states(q, k, v)
    grads = fa.backward(do, q, k, v, o, lse)
    for precision in ("exact", "tf32"):
        o2, lse2 = fa.forward_with_states(q, k, v, precision=precision)
        assert np.array_equal(o2, o) and np.array_equal(lse2, lse), precision
        assert np.array_equal(fa.forward(q, k, v, precision=precision), o)
        for g2, g in zip(fa.backward(do, q, k, v, o, lse, precision=precision), grads):
            assert np.array_equal(g2, g), precision


def test_varlen_takes_precision(fa, make_inputs):
    q, k, v, do = (x[0] for x in _inputs(make_inputs, (1, 45, 45, 4, 2, 16)))  # [total, H, D]
    cu = np.array([0, 20, 45], dtype=np.int32)
    o, lse = fa.varlen.forward_with_states(q, k, v, cu, cu)
    o2, lse2 = fa.varlen.forward_with_states(q, k, v, cu, cu, precision="tf32")
    assert np.array_equal(o2, o) and np.array_equal(lse2, lse)
    assert np.array_equal(fa.varlen.forward(q, k, v, cu, cu, precision="tf32"), o)
    g = fa.varlen.backward(do, q, k, v, o, lse, cu, cu)
    for a, b in zip(fa.varlen.backward(do, q, k, v, o, lse, cu, cu, precision="exact"), g):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("bad", ["fast", "EXACT", "fp32", None, 3, True])
def test_a_bad_precision_is_a_clear_error(fa, make_inputs, bad):
    q, k, v, do = _inputs(make_inputs)
    with pytest.raises(fa.UnsupportedError, match="precision must be 'exact' or 'tf32'"):
        fa.forward(q, k, v, precision=bad)
    with pytest.raises(ValueError, match="precision"):  # UnsupportedError is a ValueError
        fa.backward(do, q, k, v, do, np.zeros((2, 4, 37), np.float32), precision=bad)
    with pytest.raises(fa.UnsupportedError, match="precision"):
        fa.varlen.forward(q[0], k[0], v[0], np.array([0, 37], np.int32), np.array([0, 45], np.int32), precision=bad)


def test_the_core_names_the_choices(fa, make_inputs):
    """The native layer's own check, for a caller that skips the Python wrapper."""
    q, k, v, _ = _inputs(make_inputs)
    with pytest.raises(fa.UnsupportedError, match=r'unknown precision "fast"; expected "exact" or "tf32"'):
        fa._native.forward_host_arrays([q, k, v], "cpu", precision="fast")
    with pytest.raises(fa.UnsupportedError, match="precision must be"):
        fa._native.forward_host_arrays([q, k, v], "cpu", precision=1)


# ---- GPU: accuracy of every kernel each precision picks ---------------------------------------------


@pytest.fixture(scope="module")
def gpu(fa):
    info = fa.info().get("cuda", {})
    if not info.get("available"):
        pytest.skip(f"no usable CUDA GPU: {info.get('reason')}")
    if not (HAVE_TORCH_GPU or HAVE_CUPY_GPU):
        pytest.skip("neither torch nor CuPy sees a GPU")
    return fa


def last(fa, pass_="forward") -> dict:
    return fa.info()["cuda"]["last_kernels"][pass_]


class _Env:
    """An environment variable (FLASH_NIF_TF32 unless named) set for a block (the core reads it per
    call)."""

    def __init__(self, value, name="FLASH_NIF_TF32"):
        self.name, self.value, self.old = name, value, None

    def __enter__(self):
        self.old = os.environ.get(self.name)
        os.environ[self.name] = self.value

    def __exit__(self, *exc):
        if self.old is None:
            del os.environ[self.name]
        else:
            os.environ[self.name] = self.old




# (B, Sq, Sk, H, Hkv, D): every tile class of the TF32 forward (D <= 64, <= 128, > 128), head dims
# that are not multiples of 16, ragged key tiles, GQA / MQA, Sq != Sk both ways, several key tiles.
SHAPES = [
    pytest.param((2, 300, 300, 4, 2, 64), id="s300-gqa-d64"),
    pytest.param((1, 129, 257, 3, 3, 64), id="sq129<sk257-d64"),
    pytest.param((1, 1, 1000, 4, 1, 128), id="decode-mqa-d128"),
    pytest.param((1, 513, 200, 2, 2, 128), id="sq513>sk200-d128"),
    pytest.param((1, 1024, 1024, 2, 1, 128), id="s1024-d128"),
    pytest.param((1, 200, 333, 2, 1, 256), id="d256"),
    pytest.param((1, 97, 130, 2, 2, 40), id="d40"),
    pytest.param((1, 130, 97, 2, 1, 72), id="d72"),
    pytest.param((1, 70, 90, 2, 2, 136), id="d136"),
    pytest.param((1, 33, 45, 2, 2, 8), id="d8"),
]

# Masks and modifiers (the MASKED kernels): name -> builder of the forward's keyword arguments.
def _seg(b, sq, sk):
    rng = np.random.default_rng(5)
    return tuple(np.sort(rng.integers(0, 3, (b, n))).astype(np.int32) for n in (sq, sk))


EXTRAS = {
    "window": lambda b, sq, sk, h: {"window": (40, 8)},
    "segments": lambda b, sq, sk, h: {"segment_ids": _seg(b, sq, sk)},
    "padding": lambda b, sq, sk, h: {"seqused_k": np.array([sk - 7] * b, np.int32),
                                     "leftpad_k": np.array([3] * b, np.int32)},
    "softcap": lambda b, sq, sk, h: {"softcap": 5.0},
    "alibi": lambda b, sq, sk, h: {"alibi_slopes": np.linspace(0.05, 0.4, h).astype(np.float32)},
    "sinks": lambda b, sq, sk, h: {"sinks": np.linspace(-1.0, 1.0, h).astype(np.float32)},
}


def _gpu_kwargs(kw):
    """The mask arrays on the GPU (the modifiers' small tables may stay NumPy)."""
    return {k: (tuple(to_gpu(LIB, x) for x in v) if k == "segment_ids" else
                to_gpu(LIB, v) if k in ("seqused_k", "leftpad_k") else v) for k, v in kw.items()}


def _run(fa, ref, rel_err, make_inputs, shape, causal, kw=None, precision="exact", backward=True,
         deterministic=False):
    """{output: error against the oracle} of one call on the GPU, and the kernels that ran."""
    b, sq, sk, h, hkv, d = shape
    q, k, v, do = make_inputs(11, b, sq, sk, h, hkv, d, np.float32)
    kw = kw or {}
    g = [to_gpu(LIB, x) for x in (q, k, v, do)]
    o, lse = fa.forward_with_states(*g[:3], causal=causal, precision=precision, **_gpu_kwargs(kw))
    ran = {"forward": last(fa)}
    ro, rlse = ref.forward_with_states(q, k, v, causal=causal, **kw)
    err = {"o": rel_err(to_host(o), ro), "lse": rel_err(to_host(lse), rlse)}
    if backward:
        grads = fa.backward(g[3], *g[:3], o, lse, causal=causal, precision=precision, deterministic=deterministic,
                            **_gpu_kwargs(kw))
        ran["backward"] = last(fa, "backward")
        want = ref.backward(do, q, k, v, to_host(o), to_host(lse), causal=causal, **kw)
        err.update({n: rel_err(to_host(x), w) for n, x, w in zip(("dq", "dk", "dv"), grads, want)})
    return err, ran


def _backward_kernel(deterministic: bool, hopper: bool = False, d: int = 64) -> str:
    """The name prefix of the backward kernel info() reports: the dK/dV one of either path (on Hopper
    the f32 dK/dV kernel, cuda/bwd_dkdv_sm90_f32.cu, after its own dQ kernel on both paths)."""
    if hopper:
        return f"bwd_sm90_f32_d{d}_"
    return "bwd_dkdv_f32_" if deterministic else "bwd_dkdv_dq_f32_"


def hopper_f32(fa, d: int, plain: bool = True, precision: str = "exact") -> bool:
    """Does the f32 forward at head dim d run the Hopper kernel (cuda/fwd_sm90_f32.cu: compute
    capability 9.0, FLASH_NIF_SM90 not 0, D = 64 or 128, no mask or modifier, 16 keys or more)?"""
    return bool(fa.info()["cuda"].get("sm90")) and d in (64, 128) and plain


def hopper_f32_backward(fa, d: int, plain: bool = True) -> bool:
    """Does the f32 backward at head dim d run the Hopper kernels (cuda/bwd_dq_sm90_f32.cu and
    cuda/bwd_dkdv_sm90_f32.cu: compute capability 9.0, FLASH_NIF_SM90 not 0, D = 64 or 128, no mask
    or modifier, 16 keys or more under "exact")?"""
    return bool(fa.info()["cuda"].get("sm90")) and d in (64, 128) and plain


def exact_forward_math(d: int, hopper: bool = False) -> str:
    """What "exact" runs forward at head dim d (16 keys or more): on a Hopper GPU at D = 64 and 128 the
    wgmma kernel on fp16 parts ("3xf16", cuda/fwd_sm90_f32_f16.cu); elsewhere split TF32, but SIMT
    at the head dims of the SIMT kernels, where SIMT is the faster portable kernel (config.rs's
    tf32_terms)."""
    if hopper:
        return "3xf16"
    return "3xtf32" if d not in (64, 128) else "f32-simt"


def _check_exact(fa, ref, rel_err, make_inputs, record_error, shape, causal, kw=None, deterministic=False):
    err, ran = _run(fa, ref, rel_err, make_inputs, shape, causal, kw, deterministic=deterministic)
    hopper = hopper_f32(fa, shape[-1], plain=not kw)
    math = exact_forward_math(shape[-1], hopper)
    assert ran["forward"]["math"] == math and (math == "f32-simt" or "tf32_terms3" in ran["forward"]["kernel"]), ran
    assert ran["forward"]["kernel"].startswith("fwd_sm90_f32_") == hopper, ran
    bwd = ran["backward"]
    # exact's portable backward: SIMT (faster than its split TF32, config.rs); on Hopper at D = 64 and 128 split TF32.
    hopper_bwd = hopper_f32_backward(fa, shape[-1], plain=not kw)
    bwd_math = "3xf16" if hopper_bwd else "f32-simt"
    assert bwd["math"] == bwd_math, ran
    assert bwd["kernel"].startswith(_backward_kernel(deterministic, hopper_bwd, shape[-1])), ran
    with _Env("0"):
        simt, ran_simt = _run(fa, ref, rel_err, make_inputs, shape, causal, kw, deterministic=deterministic)
    assert ran_simt["forward"]["math"] == "f32-simt" and ran_simt["backward"]["math"] == "f32-simt", ran_simt
    print(f"{shape} causal={causal} det={deterministic} {kw and list(kw)}: {math} / {bwd_math} "
          + " ".join(f"{n} {e:.2e}" for n, e in err.items())
          + " | simt " + " ".join(f"{n} {e:.2e}" for n, e in simt.items()))
    for name, e in err.items():
        kernel_math = math if name in ("o", "lse") else bwd_math
        record_error(kernel_math if kernel_math.startswith("f32-") else f"f32-{kernel_math}", name, e)
        record_error("f32-simt", name, simt[name])
        assert e <= EXACT_BOUNDS[name], f"{name} {e:.3e} > {EXACT_BOUNDS[name]:.1e} ({shape}, causal={causal}, {kw})"


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_exact_f32_on_tensor_cores_meets_the_f32_bound(gpu, ref, rel_err, make_inputs, record_error, shape, causal,
                                                       deterministic):
    _check_exact(gpu, ref, rel_err, make_inputs, record_error, shape, causal, deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("d", [64, 128])
def test_exact_f32_masks_and_modifiers(gpu, ref, rel_err, make_inputs, record_error, extra, d, deterministic):
    b, sq, sk, h = 2, 200, 230, 4
    _check_exact(gpu, ref, rel_err, make_inputs, record_error, (b, sq, sk, h, 2, d), True, EXTRAS[extra](b, sq, sk, h),
                 deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], SHAPES[5], SHAPES[7]])
def test_tf32_within_its_documented_bound(gpu, ref, rel_err, make_inputs, record_error, shape, causal, deterministic):
    err, ran = _run(gpu, ref, rel_err, make_inputs, shape, causal, precision="tf32", deterministic=deterministic)
    fwd_math = "1xf16" if hopper_f32(gpu, shape[-1]) else "tf32"
    assert ran["forward"]["math"] == fwd_math and "tf32_terms1" in ran["forward"]["kernel"], ran
    bwd = ran["backward"]
    assert bwd["math"] == ("1xf16" if hopper_f32_backward(gpu, shape[-1]) else "tf32") and "tf32_terms1" in bwd["kernel"], ran
    assert bwd["kernel"].startswith(_backward_kernel(deterministic, hopper_f32_backward(gpu, shape[-1]), shape[-1])), ran
    print(f"{shape} causal={causal} det={deterministic}: tf32 " + " ".join(f"{n} {e:.2e}" for n, e in err.items()))
    for name, e in err.items():
        record_error("f32-tf32", name, e)
        assert e <= TF32_BOUND, err
    # It did round to TF32: one product per pair is measurably less exact than three.
    assert err["o"] > 10 * EXACT_BOUNDS["o"], err
    assert min(err["dq"], err["dk"], err["dv"]) > 10 * EXACT_BOUNDS["dq"], err


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="poisoned outputs need torch")
@pytest.mark.parametrize("precision", ["exact", "tf32"])
def test_every_output_element_is_written(gpu, ref, rel_err, make_inputs, precision):
    import torch

    b, sq, sk, h, hkv, d = 1, 131, 77, 2, 1, 72
    q, k, v, _ = make_inputs(2, b, sq, sk, h, hkv, d, np.float32)
    gq, gk, gv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    o = torch.full((b, sq, h, d), float("nan"), device="cuda")
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    desc = [(x.data_ptr(), list(x.shape), "float32") for x in (gq, gk, gv)]
    stream = torch.cuda.current_stream().cuda_stream
    gpu._native.cuda_forward_device(desc, [o.data_ptr(), lse.data_ptr()], 0, stream, causal=True, precision=precision)
    torch.cuda.synchronize()
    assert last(gpu)["math"] == {"exact": "3xtf32", "tf32": "tf32"}[precision]  # D = 72: the portable kernel
    ro, rlse = ref.forward_with_states(q, k, v, causal=True)
    bound = EXACT_BOUNDS["o"] if precision == "exact" else TF32_BOUND
    assert not torch.isnan(o).any() and rel_err(o.cpu().numpy(), ro) <= bound
    lse_bound = EXACT_BOUNDS["lse"] if precision == "exact" else TF32_BOUND
    assert not torch.isnan(lse).any() and rel_err(lse.cpu().numpy(), rlse) <= lse_bound


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="poisoned outputs need torch")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("precision", ["exact", "tf32"])
@pytest.mark.parametrize("d", [72, 64, 128])
def test_every_gradient_element_is_written(gpu, ref, rel_err, make_inputs, precision, deterministic, d):
    """The f32 backward through the native entry point into NaN-poisoned dq, dk, dv: a head dim
    that is not a multiple of 16 (D = 72: padded columns, D_SPLIT), ragged query and key tiles, GQA.
    "tf32" runs the TF32 kernels; "exact" the SIMT ones (the portable split-TF32 backward was
    slower, config.rs's tf32_terms); on Hopper at D = 64 and 128 both run the wgmma kernels."""
    import torch

    b, sq, sk, h, hkv = 1, 131, 77, 4, 2
    q, k, v, do = make_inputs(4, b, sq, sk, h, hkv, d, np.float32)
    o, lse = ref.forward_with_states(q, k, v, causal=True)
    host = [do, q, k, v, o.astype(np.float32), lse.astype(np.float32)]
    gin = [torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in host]
    grads = [torch.full(x.shape, float("nan"), device="cuda") for x in (q, k, v)]
    desc = [(x.data_ptr(), list(x.shape), "float32") for x in gin]
    stream = torch.cuda.current_stream().cuda_stream
    gpu._native.cuda_backward_device(desc, [x.data_ptr() for x in grads] + [0], 0, stream, causal=True,
                                     precision=precision, deterministic=deterministic)
    torch.cuda.synchronize()
    ran = last(gpu, "backward")
    hopper_bwd = hopper_f32_backward(gpu, d)
    assert ran["math"] == {"exact": "3xf16" if hopper_bwd else "f32-simt", "tf32": "1xf16" if hopper_bwd else "tf32"}[precision], ran
    if precision == "tf32" or hopper_bwd:
        assert ran["kernel"].startswith(_backward_kernel(deterministic, hopper_bwd, d)), ran
    want = ref.backward(do, q, k, v, o, lse, causal=True)
    bound = EXACT_BOUNDS["dq"] if precision == "exact" else TF32_BOUND
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert not torch.isnan(got).any(), name
        assert rel_err(got.cpu().numpy(), w) <= bound, name


@pytest.mark.gpu
def test_exact_with_few_keys_runs_simt_and_a_single_key_gives_v(gpu, make_inputs):
    """A split product keeps ~22 bits: with fewer than MIN_SPLIT_TF32_KEYS keys "exact" takes the
    SIMT kernel, where a row with one key gives o = v bit for bit (P = 1; the oracle's dq is then 0,
    which no rounding of o may disturb)."""
    q, k, v, do = make_inputs(5, 1, 3, 1, 2, 2, 16, np.float32)
    o, lse = gpu.forward_with_states(q, k, v, causal=False, device="cuda")
    assert last(gpu)["math"] == "f32-simt"
    np.testing.assert_array_equal(o, np.broadcast_to(v, o.shape))
    gpu.backward(do, q, k, v, o, lse, causal=False, device="cuda")
    assert last(gpu, "backward")["math"] == "f32-simt"


# ---- GPU: the Hopper f32 forward (cuda/fwd_sm90_f32.cu) ---------------------------------------------

# (B, Sq, Sk, H, Hkv, D): both head dims, GQA / MQA, ragged query and key tiles (Sk not a multiple of
# 32 or 64), Sq != Sk both ways (causal rows that see no key), several key tiles, 2048 keys.
HOPPER_SHAPES = [
    pytest.param((2, 300, 300, 4, 2, 64), id="s300-gqa-d64"),
    pytest.param((1, 129, 257, 3, 3, 64), id="sq129<sk257-d64"),
    pytest.param((1, 513, 200, 2, 2, 128), id="sq513>sk200-d128"),
    pytest.param((1, 1, 1000, 4, 1, 128), id="decode-mqa-d128"),
    pytest.param((1, 1027, 1027, 2, 1, 128), id="s1027-d128"),
    pytest.param((1, 2048, 2048, 2, 2, 64), id="s2048-d64"),
    pytest.param((1, 2048, 2048, 2, 2, 128), id="s2048-d128"),
]


@pytest.fixture
def hopper(gpu):
    if not gpu.info()["cuda"].get("sm90"):
        pytest.skip("the Hopper f32 forward runs on compute capability 9.0 only (and not with FLASH_NIF_SM90=0)")
    return gpu


def _hopper_forward(fa, ref, rel_err, make_inputs, shape, causal, precision="exact", views=None):
    """{o, lse: error against the oracle} of the Hopper f32 forward and the kernel that ran; `views`
    (test_strides_gpu's kinds) runs it on strided views of q, k, v."""
    import torch

    from test_strides_gpu import views as make_views

    b, sq, sk, h, hkv, d = shape
    if views:
        assert sq == sk
        gen = torch.Generator(device="cuda").manual_seed(7)
        g = make_views(views, b, sq, h, hkv, d, torch.float32, gen)
        q, k, v = (x.cpu().numpy() for x in g)
    else:
        q, k, v, _ = make_inputs(13, b, sq, sk, h, hkv, d, np.float32)
        g = [to_gpu("torch", x) for x in (q, k, v)]
    o, lse = fa.forward_with_states(*g, causal=causal, precision=precision)
    ran = last(fa)
    ro, rlse = ref.forward_with_states(q, k, v, causal=causal)
    return {"o": rel_err(to_host(o), ro), "lse": rel_err(to_host(lse), rlse)}, ran, (to_host(o), to_host(lse))


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="needs torch")
@pytest.mark.parametrize("parts", ["3xf16", "3xtf32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", HOPPER_SHAPES)
def test_hopper_f32_exact_meets_the_f32_bound(hopper, ref, rel_err, make_inputs, record_error, shape, causal, parts):
    """precision="exact" runs the Hopper kernel (split products on wgmma: fp16 parts by default, TF32
    ones with FLASH_NIF_TF32_PARTS=1) within the f32 bound; the same inputs on the portable kernel
    (FLASH_NIF_SM90=0) printed beside."""
    with _Env("1" if parts == "3xtf32" else "0", "FLASH_NIF_TF32_PARTS"):
        err, ran, (o, lse) = _hopper_forward(hopper, ref, rel_err, make_inputs, shape, causal)
    assert ran["kernel"].startswith(f"fwd_sm90_f32_d{shape[-1]}_") and ran["math"] == parts, ran
    assert ran["not_sm90_because"] is None, ran
    with _Env("0", "FLASH_NIF_SM90"):
        simt, ran_simt, _ = _hopper_forward(hopper, ref, rel_err, make_inputs, shape, causal)
    assert ran_simt["math"] == "f32-simt" and "FLASH_NIF_SM90=0" in ran_simt["not_sm90_because"], ran_simt
    print(f"{shape} causal={causal} {ran['kernel']}: " + " ".join(f"{n} {e:.2e}" for n, e in err.items())
          + " | simt " + " ".join(f"{n} {e:.2e}" for n, e in simt.items()))
    b, sq, sk = shape[:3]
    if causal and sq > sk:  # rows that see no key: o = 0, lse = -inf
        assert np.isneginf(lse[:, :, : sq - sk]).all() and (o[:, : sq - sk] == 0).all()
    for name, e in err.items():
        record_error(f"f32-{parts}-sm90", name, e)
        assert e <= EXACT_BOUNDS[name], f"{name} {e:.3e} > {EXACT_BOUNDS[name]:.1e} ({shape}, causal={causal})"


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="needs torch")
@pytest.mark.parametrize("kind", ["qkv", "bhsd", "batch-slice"])
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_f32_forward_on_strided_views(hopper, ref, rel_err, make_inputs, kind, d):
    err, ran, _ = _hopper_forward(hopper, ref, rel_err, make_inputs, (2, 333, 333, 4, 2, d), True, views=kind)
    assert ran["kernel"].startswith(f"fwd_sm90_f32_d{d}_"), ran
    for name, e in err.items():
        assert e <= EXACT_BOUNDS[name], f"{name} {e:.3e} ({kind}, d={d})"


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="needs torch")
@pytest.mark.parametrize("operands", ["1xf16", "tf32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_tf32_forward_one_product(hopper, ref, rel_err, make_inputs, d, causal, operands):
    """precision="tf32" runs the Hopper kernel with one product (of scaled fp16 operands by default,
    of TF32 ones with FLASH_NIF_TF32_PARTS=1): within its bound, and measurably less exact than
    "exact" (so it did round)."""
    with _Env("1" if operands == "tf32" else "0", "FLASH_NIF_TF32_PARTS"):
        err, ran, _ = _hopper_forward(hopper, ref, rel_err, make_inputs, (1, 300, 300, 2, 1, d), causal, "tf32")
    assert ran["kernel"].startswith(f"fwd_sm90_f32_d{d}_") and ran["math"] == operands, ran
    assert all(e <= TF32_BOUND for e in err.values()), err
    assert err["o"] > 10 * EXACT_BOUNDS["o"], err


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="needs torch")
def test_hopper_f32_falls_back_and_says_why(hopper, make_inputs):
    """What the Hopper f32 forward does not take runs an exact portable kernel, and info() says why."""
    q, k, v, _ = make_inputs(1, 1, 100, 100, 2, 2, 64, np.float32)
    g = [to_gpu("torch", x) for x in (q, k, v)]
    hopper.forward(*g, causal=True, window=(20, 0))
    ran = last(hopper)
    assert not ran["kernel"].startswith("fwd_sm90") and "masks" in ran["not_sm90_because"], ran
    q, k, v, _ = make_inputs(1, 1, 100, 100, 2, 2, 96, np.float32)
    hopper.forward(*(to_gpu("torch", x) for x in (q, k, v)), causal=True)
    ran = last(hopper)
    assert ran["math"] == "3xtf32" and ran["kernel"].startswith("fwd_f32_d96"), ran
    assert "head dim 96" in ran["not_sm90_because"], ran
    hopper.forward(*g, causal=True)  # "exact" by default: the Hopper kernel's split products
    ran = last(hopper)
    assert ran["math"] == "3xf16" and ran["kernel"].startswith("fwd_sm90_f32_d64_"), ran
    with _Env("0"):
        hopper.forward(*g, causal=True)
    ran = last(hopper)
    assert ran["math"] == "f32-simt" and "FLASH_NIF_TF32=0" in ran["not_sm90_because"], ran


# ---- GPU: the Hopper f32 backward (cuda/bwd_dq_sm90_f32.cu, then cuda/bwd_dkdv_sm90_f32.cu) ---------

# (B, Sq, Sk, H, Hkv, D): both head dims, GQA 4:1, ragged query and key tiles, Sq != Sk both ways
# (causal rows that see no key: dq = 0 there), several query and key tiles, ~2048 keys.
HOPPER_BWD_SHAPES = [
    pytest.param((2, 1000, 1000, 4, 1, 64), id="s1000-gqa4"),
    pytest.param((1, 128, 300, 4, 1, 64), id="sq128<sk300-gqa4"),
    pytest.param((1, 300, 128, 4, 1, 64), id="sq300>sk128-gqa4"),
    pytest.param((1, 2047, 2047, 4, 1, 64), id="s2047-gqa4"),
    pytest.param((1, 70, 17, 2, 2, 64), id="s70-sk17"),
    pytest.param((2, 1000, 1000, 4, 1, 128), id="s1000-gqa4-d128"),
    pytest.param((1, 128, 300, 4, 2, 128), id="sq128<sk300-d128"),
    pytest.param((1, 300, 129, 4, 1, 128), id="sq300>sk129-d128"),
    pytest.param((1, 2047, 2047, 2, 1, 128), id="s2047-d128"),
    pytest.param((1, 70, 17, 2, 2, 128), id="s70-sk17-d128"),
]


def _hopper_backward(fa, ref, rel_err, make_inputs, shape, causal, deterministic=False, precision="exact",
                     views=None):
    """{dq, dk, dv: error against the oracle} of the f32 backward on a GPU (fed the GPU forward's o and
    lse, as the oracle is), the backward kernel that ran, and the gradients on the host; `views`
    (test_strides_gpu's kinds) runs it on strided views of q, k, v, and dO as a [B, H, S, D]
    transpose."""
    import torch

    from test_strides_gpu import views as make_views

    b, sq, sk, h, hkv, d = shape
    if views:
        assert sq == sk
        gen = torch.Generator(device="cuda").manual_seed(8)
        g = list(make_views(views, b, sq, h, hkv, d, torch.float32, gen))
        g.append(torch.randn(b, h, sq, d, device="cuda", generator=gen).transpose(1, 2))
        q, k, v, do = (x.cpu().numpy() for x in g)
    else:
        q, k, v, do = make_inputs(17, b, sq, sk, h, hkv, d, np.float32)
        g = [to_gpu("torch", x) for x in (q, k, v, do)]
    o, lse = fa.forward_with_states(*g[:3], causal=causal, precision=precision)
    grads = [to_host(x) for x in fa.backward(g[3], *g[:3], o, lse, causal=causal, precision=precision,
                                             deterministic=deterministic)]
    ran = last(fa, "backward")
    want = ref.backward(do, q, k, v, to_host(o), to_host(lse), causal=causal)
    return {n: rel_err(x, w) for n, x, w in zip(("dq", "dk", "dv"), grads, want)}, ran, grads


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="needs torch")
@pytest.mark.parametrize("parts", ["3xf16", "3xtf32"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", HOPPER_BWD_SHAPES)
def test_hopper_f32_backward_exact_meets_the_f32_bound(hopper, ref, rel_err, make_inputs, record_error, shape,
                                                       causal, deterministic, parts):
    """precision="exact" runs the Hopper backward (split products on wgmma: fp16 parts by default,
    TF32 ones with FLASH_NIF_TF32_PARTS=1; no atomics, so either value of `deterministic`) within the
    f32 bound; the same inputs on the portable kernels (FLASH_NIF_SM90=0) printed beside."""
    args = (hopper, ref, rel_err, make_inputs, shape, causal, deterministic)
    with _Env("1" if parts == "3xtf32" else "0", "FLASH_NIF_TF32_PARTS"):
        err, ran, (dq, dk, dv) = _hopper_backward(*args)
    assert ran["kernel"].startswith(f"bwd_sm90_f32_d{shape[-1]}_") and "tf32_terms3" in ran["kernel"], ran
    assert ran["math"] == parts and ran["not_sm90_because"] is None, ran
    with _Env("0", "FLASH_NIF_SM90"):
        simt, ran_simt, _ = _hopper_backward(*args)
    assert ran_simt["math"] == "f32-simt" and "FLASH_NIF_SM90=0" in ran_simt["not_sm90_because"], ran_simt
    print(f"{shape} causal={causal} det={deterministic} {ran['kernel']}: "
          + " ".join(f"{n} {e:.2e}" for n, e in err.items())
          + " | simt " + " ".join(f"{n} {e:.2e}" for n, e in simt.items()))
    b, sq, sk = shape[:3]
    if causal and sq > sk:  # rows that see no key have no gradient
        assert (dq[:, : sq - sk] == 0).all()
    for x in (dq, dk, dv):
        assert np.isfinite(x).all()
    for name, e in err.items():
        record_error(f"f32-{parts}-sm90", name, e)
        assert e <= EXACT_BOUNDS[name], f"{name} {e:.3e} > {EXACT_BOUNDS[name]:.1e} ({shape}, causal={causal})"


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="needs torch")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_f32_backward_is_bit_identical_run_to_run(hopper, make_inputs, causal, d):
    import torch

    q, k, v, do = (to_gpu("torch", x) for x in make_inputs(19, 2, 777, 777, 8, 2, d, np.float32))
    o, lse = hopper.forward_with_states(q, k, v, causal=causal)
    first = hopper.backward(do, q, k, v, o, lse, causal=causal, deterministic=True)
    assert last(hopper, "backward")["kernel"].startswith(f"bwd_sm90_f32_d{d}_"), last(hopper, "backward")
    for _ in range(3):
        again = hopper.backward(do, q, k, v, o, lse, causal=causal, deterministic=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="needs torch")
@pytest.mark.parametrize("kind", ["qkv", "bhsd", "batch-slice"])
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_f32_backward_on_strided_views(hopper, ref, rel_err, make_inputs, kind, d):
    err, ran, _ = _hopper_backward(hopper, ref, rel_err, make_inputs, (2, 333, 333, 4, 2, d), True, views=kind)
    assert ran["kernel"].startswith(f"bwd_sm90_f32_d{d}_") and ran["not_sm90_because"] is None, ran
    for name, e in err.items():
        assert e <= EXACT_BOUNDS[name], f"{name} {e:.3e} ({kind})"


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="needs torch")
@pytest.mark.parametrize("operands", ["1xf16", "tf32"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_tf32_backward_one_product(hopper, ref, rel_err, make_inputs, record_error, causal, d, operands):
    """precision="tf32" runs the same kernels with one product (of scaled fp16 operands by default, of
    TF32 ones with FLASH_NIF_TF32_PARTS=1): within its bound, and measurably less exact than "exact"
    (so it did round)."""
    with _Env("1" if operands == "tf32" else "0", "FLASH_NIF_TF32_PARTS"):
        err, ran, _ = _hopper_backward(hopper, ref, rel_err, make_inputs, (1, 300, 300, 4, 1, d), causal,
                                       precision="tf32")
    assert ran["kernel"].startswith(f"bwd_sm90_f32_d{d}_") and "tf32_terms1" in ran["kernel"], ran
    assert ran["math"] == operands, ran
    for name, e in err.items():
        record_error("f32-tf32-sm90", name, e)
        assert e <= TF32_BOUND, err
    assert min(err.values()) > 10 * EXACT_BOUNDS["dq"], err


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="needs torch")
def test_hopper_f32_backward_falls_back_and_says_why(hopper, ref, rel_err, make_inputs):
    """What the Hopper f32 backward does not take runs an exact portable kernel, and info() says why."""
    def backward(shape, **kw):
        b, sq, sk, h, hkv, d = shape
        q, k, v, do = make_inputs(23, b, sq, sk, h, hkv, d, np.float32)
        g = [to_gpu("torch", x) for x in (q, k, v, do)]
        o, lse = hopper.forward_with_states(*g[:3], causal=True, **kw)
        grads = hopper.backward(g[3], *g[:3], o, lse, causal=True, **kw)
        want = ref.backward(do, q, k, v, to_host(o), to_host(lse), causal=True, **kw)
        for name, x, w in zip(("dq", "dk", "dv"), grads, want):
            assert rel_err(to_host(x), w) <= EXACT_BOUNDS[name], (name, shape, kw)
        return last(hopper, "backward")

    ran = backward((1, 100, 100, 2, 2, 96))
    assert ran["math"] == "f32-simt" and ran["kernel"].startswith("bwd_dkdv_dq_f32_d96"), ran
    assert "head dim 96" in ran["not_sm90_because"], ran
    ran = backward((1, 100, 100, 2, 2, 64), window=(20, 0))
    assert not ran["kernel"].startswith("bwd_sm90") and "masks" in ran["not_sm90_because"], ran
    ran = backward((1, 100, 15, 2, 2, 64))  # fewer keys than MIN_SPLIT_TF32_KEYS
    assert ran["math"] == "f32-simt" and "16 keys or more" in ran["not_sm90_because"], ran
    with _Env("0"):
        ran = backward((1, 100, 100, 2, 2, 64))
    assert ran["math"] == "f32-simt" and "FLASH_NIF_TF32=0" in ran["not_sm90_because"], ran
    ran = backward((1, 100, 100, 2, 2, 64))
    assert ran["math"] == "3xf16" and ran["kernel"].startswith("bwd_sm90_f32_d64_"), ran
