"""CUDA backend against the float64 oracle (marked ``gpu``; skipped without an NVIDIA GPU).

Inputs are random (never zeros), drawn in the storage dtype; the oracle sees the same values.
Tolerances are conftest's: float32 1e-5, float16 / bfloat16 at most twice the error of the
oracle's own result rounded to the dtype (+1e-5); lse (float32) 1e-5. The backward oracle is
given the kernel's own o and lse, as delta = rowsum(dO * O) depends on the stored o.

Arrays go in as torch tensors or CuPy arrays (whichever is installed; both when both are) and
come back as the same kind on the same device. Outputs written through the native entry points
are poisoned with NaN first to prove every element is written.

`test_small_suite` is the suite run under compute-sanitizer (memcheck, racecheck):
    compute-sanitizer --tool memcheck python -m pytest tests/test_gpu.py -k small_suite
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

try:
    import torch

    HAVE_TORCH_GPU = torch.cuda.is_available()
except Exception:  # noqa: BLE001
    torch = None
    HAVE_TORCH_GPU = False
try:
    import cupy

    HAVE_CUPY_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001
    cupy = None
    HAVE_CUPY_GPU = False

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def _gpu_reason(fa) -> str | None:
    info = fa.info().get("cuda", {})
    if not info.get("available"):
        return f"no usable CUDA GPU: {info.get('reason')}"
    if not (HAVE_TORCH_GPU or HAVE_CUPY_GPU):
        return "neither torch nor CuPy sees a GPU"
    return None


@pytest.fixture(scope="module")
def gpu(fa):
    reason = _gpu_reason(fa)
    if reason:
        pytest.skip(reason)
    return fa


LIBS = [pytest.param("torch", marks=pytest.mark.skipif(not HAVE_TORCH_GPU, reason="torch without CUDA")),
        pytest.param("cupy", marks=pytest.mark.skipif(not HAVE_CUPY_GPU, reason="CuPy without a GPU"))]


def to_gpu(lib, x: np.ndarray):
    if lib == "torch":
        if x.dtype == ml_dtypes.bfloat16:  # exact: bf16 -> f32 -> bf16
            return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).cuda()
        return torch.from_numpy(x).cuda()
    if x.dtype == ml_dtypes.bfloat16:
        try:
            return cupy.asarray(x.view(np.uint16)).view(ml_dtypes.bfloat16)
        except Exception as e:  # noqa: BLE001 - a CuPy without bfloat16 support
            pytest.skip(f"this CuPy has no bfloat16 arrays: {e}")
    return cupy.asarray(x)


def to_host(x) -> np.ndarray:
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            return x.float().cpu().numpy().astype(ml_dtypes.bfloat16)
        return x.cpu().numpy()
    if x.dtype == ml_dtypes.bfloat16:
        return cupy.asnumpy(x.view(np.uint16)).view(ml_dtypes.bfloat16)
    return cupy.asnumpy(x)


def same_kind(x, lib):
    if lib == "torch":
        assert isinstance(x, torch.Tensor) and x.is_cuda
    else:
        assert isinstance(x, cupy.ndarray)


# (B, Sq, Sk, H, Hkv, D)
SHAPES = [
    pytest.param((2, 97, 97, 4, 2, 64), id="s97-gqa-d64"),
    pytest.param((1, 1, 1000, 4, 1, 128), id="decode-sq1-sk1000-mqa-d128"),
    pytest.param((1, 1000, 97, 2, 2, 40), id="sq1000>sk97-d40"),
    pytest.param((2, 128, 256, 4, 4, 72), id="sq128<sk256-d72"),
    pytest.param((1, 256, 128, 6, 2, 256), id="sq256>sk128-gqa-d256"),
    pytest.param((1, 130, 70, 2, 1, 136), id="d136-mqa"),
    pytest.param((1, 33, 45, 2, 2, 8), id="d8"),
    pytest.param((1, 1, 1, 1, 1, 16), id="s1"),
]


def check_case(fa, ref, make_inputs, assert_close_to_oracle, record_error, lib, shape, dtype_name, causal,
               scale=None, seed=0, deterministic=False):
    b, sq, sk, h, hkv, d = shape
    dtype = DTYPES[dtype_name]
    q, k, v, do = make_inputs(seed, b, sq, sk, h, hkv, d, dtype)
    gq, gk, gv, gdo = (to_gpu(lib, x) for x in (q, k, v, do))
    o, lse = fa.forward_with_states(gq, gk, gv, causal=causal, scale=scale)
    same_kind(o, lib)
    same_kind(lse, lib)
    ro, rlse = ref.forward_with_states(q, k, v, causal=causal, scale=scale)
    ctx = f"lib={lib} shape={shape} causal={causal} deterministic={deterministic}"
    record_error(dtype_name, "o", assert_close_to_oracle("o", to_host(o), ro, dtype, ctx))
    record_error(dtype_name, "lse", assert_close_to_oracle("lse", to_host(lse), rlse, np.float32, ctx))
    dq, dk, dv = fa.backward(gdo, gq, gk, gv, o, lse, causal=causal, scale=scale, deterministic=deterministic)
    for x in (dq, dk, dv):
        same_kind(x, lib)
    rdq, rdk, rdv = ref.backward(do, q, k, v, to_host(o), to_host(lse), causal=causal, scale=scale)
    for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        record_error(dtype_name, name, assert_close_to_oracle(name, to_host(got), want, dtype, ctx))


@pytest.mark.gpu
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("dtype_name", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_against_oracle(gpu, ref, make_inputs, assert_close_to_oracle, record_error, lib, shape, dtype_name, causal):
    check_case(gpu, ref, make_inputs, assert_close_to_oracle, record_error, lib, shape, dtype_name, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_deterministic_path_against_oracle(gpu, ref, make_inputs, assert_close_to_oracle, record_error, shape,
                                           dtype_name, causal):
    """deterministic=True: the separate dQ kernel instead of the default atomic dQ."""
    lib = "torch" if HAVE_TORCH_GPU else "cupy"
    check_case(gpu, ref, make_inputs, assert_close_to_oracle, record_error, lib, shape, dtype_name, causal,
               deterministic=True)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("d", list(range(8, 257, 8)))
def test_every_head_dim(gpu, ref, make_inputs, assert_close_to_oracle, record_error, d, deterministic):
    lib = "torch" if HAVE_TORCH_GPU else "cupy"
    check_case(gpu, ref, make_inputs, assert_close_to_oracle, record_error, lib, (1, 70, 90, 2, 1, d), "bf16",
               causal=bool(d % 16), seed=d, deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 300, 260, 4, 2, 64), (1, 260, 300, 2, 1, 128), (2, 256, 256, 2, 2, 128),
                                   (1, 130, 70, 2, 2, 64), (1, 64, 200, 3, 1, 128)], ids=str)
def test_f32_several_tiles(gpu, ref, make_inputs, assert_close_to_oracle, record_error, shape, causal, deterministic):
    """fp32 SIMT kernels (D 64, 128) over several query and key tiles, ragged and even, Sq != Sk, GQA."""
    lib = "torch" if HAVE_TORCH_GPU else "cupy"
    check_case(gpu, ref, make_inputs, assert_close_to_oracle, record_error, lib, shape, "f32", causal, seed=sum(shape),
               deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("d", [8, 40, 64, 72, 128, 136, 192, 256])
def test_f32_head_dims(gpu, ref, make_inputs, assert_close_to_oracle, record_error, d, deterministic):
    """fp32: the SIMT kernels (D 64, 128) and the generic ones (every other multiple of 8)."""
    lib = "torch" if HAVE_TORCH_GPU else "cupy"
    check_case(gpu, ref, make_inputs, assert_close_to_oracle, record_error, lib, (1, 70, 90, 2, 1, d), "f32",
               causal=bool(d % 16), seed=d, deterministic=deterministic)


@pytest.mark.gpu
def test_custom_scale_and_peaky_softmax(gpu, ref, make_inputs, assert_close_to_oracle, record_error):
    lib = "torch" if HAVE_TORCH_GPU else "cupy"
    check_case(gpu, ref, make_inputs, assert_close_to_oracle, record_error, lib, (1, 100, 100, 2, 2, 64), "f32",
               causal=True, scale=0.7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
def test_small_suite(gpu, ref, make_inputs, assert_close_to_oracle, record_error, dtype_name):
    """Small cases for compute-sanitizer: ragged tiles, GQA, causal with Sq != Sk, empty rows."""
    lib = "torch" if HAVE_TORCH_GPU else "cupy"
    for shape, causal in (((1, 37, 53, 2, 1, 64), True), ((1, 70, 20, 2, 2, 40), True), ((1, 20, 70, 2, 2, 128), False)):
        check_case(gpu, ref, make_inputs, assert_close_to_oracle, record_error, lib, shape, dtype_name, causal)


@pytest.mark.gpu
def test_every_output_element_is_written(gpu, make_inputs):
    """Call the native entry points on NaN-poisoned outputs; nothing may stay NaN."""
    if not HAVE_CUPY_GPU:
        pytest.skip("needs CuPy")
    native = gpu._native
    for dtype_name, causal, shape in (("bf16", True, (2, 97, 33, 4, 2, 72)), ("f32", False, (1, 65, 130, 2, 1, 40)),
                                      ("f16", True, (1, 200, 100, 3, 3, 256))):
        b, sq, sk, h, hkv, d = shape
        q, k, v, do = (to_gpu("cupy", x) for x in make_inputs(1, b, sq, sk, h, hkv, d, DTYPES[dtype_name]))
        name = np.dtype(DTYPES[dtype_name]).name
        o = to_gpu("cupy", np.full(q.shape, np.nan, DTYPES[dtype_name]))
        lse = cupy.full((b, h, sq), np.nan, np.float32)
        desc = [(x.data.ptr, list(x.shape), name) for x in (q, k, v)]
        stream = cupy.cuda.get_current_stream().ptr
        native.cuda_forward_device(desc, [o.data.ptr, lse.data.ptr], 0, stream, causal=causal)
        desc = [(x.data.ptr, list(x.shape), name) for x in (do, q, k, v, o)] + [(lse.data.ptr, [b, h, sq], "float32")]
        for deterministic in (False, True):
            grads = [to_gpu("cupy", np.full(x.shape, np.nan, DTYPES[dtype_name])) for x in (q, k, v)]
            outputs = [g.data.ptr for g in grads] + [0]  # no dsinks
            native.cuda_backward_device(desc, outputs, 0, stream, causal=causal, deterministic=deterministic)
            cupy.cuda.get_current_stream().synchronize()
            for label, x in zip(("o", "dq", "dk", "dv"), (o, *grads)):
                assert not np.isnan(to_host(x).astype(np.float32)).any(), f"{label} not fully written ({dtype_name})"
            lse_h = cupy.asnumpy(lse)
            assert not np.isnan(lse_h).any()
            if causal and sq > sk:  # rows that see no key: o = 0, lse = -inf, dq = 0
                empty = sq - sk
                assert np.isneginf(lse_h[:, :, :empty]).all()
                assert (to_host(o)[:, :empty].astype(np.float32) == 0).all()
                assert (to_host(grads[0])[:, :empty].astype(np.float32) == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["bf16", "f32"])
def test_deterministic(gpu, make_inputs, dtype_name):
    """deterministic=True: every output bit-identical over runs. The default: o, lse, dk and dv
    bit-identical, dq (summed by atomics) within a few units of the last bit."""
    lib = "torch" if HAVE_TORCH_GPU else "cupy"
    q, k, v, do = (to_gpu(lib, x) for x in make_inputs(3, 2, 300, 300, 8, 2, 128, DTYPES[dtype_name]))
    for deterministic in (True, False):
        runs = []
        for _ in range(3):
            o, lse = gpu.forward_with_states(q, k, v, causal=True)
            grads = gpu.backward(do, q, k, v, o, lse, causal=True, deterministic=deterministic)
            runs.append([to_host(x) for x in (o, lse, *grads)])
        for other in runs[1:]:
            for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), runs[0], other):
                if deterministic or name != "dq":
                    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (name, deterministic)
                else:
                    a32, b32 = a.astype(np.float32), b.astype(np.float32)
                    ulp = 2.0 ** -7 if dtype_name == "bf16" else 2.0 ** -20
                    assert np.abs(a32 - b32).max() <= 2 * ulp * np.abs(a32).max(), name


@pytest.mark.gpu
def test_runs_on_the_callers_stream(gpu, ref, make_inputs):
    if not HAVE_CUPY_GPU:
        pytest.skip("needs CuPy")
    q, k, v, _ = make_inputs(4, 1, 200, 200, 2, 2, 64, np.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        gq, gk, gv = (cupy.asarray(x) for x in (q, k, v))
        o, _ = gpu.forward_with_states(gq, gk, gv, causal=True)
        s.synchronize()
    err = np.linalg.norm(cupy.asnumpy(o) - ref.forward(q, k, v, causal=True)) / np.linalg.norm(ref.forward(q, k, v))
    assert err < 1e-5


@pytest.mark.gpu
def test_numpy_with_device_cuda(gpu, ref, make_inputs, assert_close_to_oracle):
    q, k, v, do = make_inputs(5, 1, 77, 91, 4, 2, 64, np.float16)
    o, lse = gpu.forward_with_states(q, k, v, causal=True, device="cuda")
    assert isinstance(o, np.ndarray) and isinstance(lse, np.ndarray)
    ro, rlse = ref.forward_with_states(q, k, v, causal=True)
    assert_close_to_oracle("o", o, ro, np.float16)
    dq, dk, dv = gpu.backward(do, q, k, v, o, lse, causal=True, device="cuda")
    rdq, rdk, rdv = ref.backward(do, q, k, v, o, lse, causal=True)
    for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert isinstance(got, np.ndarray)
        assert_close_to_oracle(name, got, want, np.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("lib", LIBS)
def test_errors(gpu, make_inputs, lib):
    q, k, v, _ = make_inputs(6, 1, 16, 16, 2, 2, 64, np.float32)
    gq, gk, gv = (to_gpu(lib, x) for x in (q, k, v))
    with pytest.raises(gpu.DeviceError):  # mixed host and device arrays
        gpu.forward(q, gk, gv)
    with pytest.raises(gpu.DeviceError):  # GPU data with device="cpu"
        gpu.forward(gq, gk, gv, device="cpu")
    with pytest.raises(gpu.DTypeError):
        gpu.forward(gq, to_gpu(lib, k.astype(np.float16)), gv)
    with pytest.raises(gpu.ShapeError):
        gpu.forward(gq, to_gpu(lib, k[:, :, :1].copy()), gv)  # v has another shape than k
    with pytest.raises(gpu.ShapeError):
        gpu.forward(gq[0], gk, gv)
    q, k, v, _ = make_inputs(6, 1, 16, 16, 2, 2, 257, np.float32)
    with pytest.raises(gpu.ShapeError):  # any head dim from 1 to 256 (tests/test_head_dims.py), no more
        gpu.forward(*(to_gpu(lib, x) for x in (q, k, v)))


@pytest.mark.gpu
def test_two_gpus_are_an_error(gpu, make_inputs):
    if not HAVE_TORCH_GPU or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    q, k, v, _ = make_inputs(7, 1, 16, 16, 2, 2, 64, np.float32)
    with pytest.raises(gpu.DeviceError):
        gpu.forward(torch.from_numpy(q).cuda(0), torch.from_numpy(k).cuda(1), torch.from_numpy(v).cuda(0))


@pytest.mark.gpu
def test_long_sequence_needs_no_quadratic_buffer(gpu):
    """Forward + backward at S = 262144 (B=1, H=2, D=64): an S x S buffer would need 512 GiB."""
    if not HAVE_TORCH_GPU:
        pytest.skip("needs torch")
    s = 262144
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, s, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o, lse = gpu.forward_with_states(q, k, v, causal=True)
    dq, dk, dv = gpu.backward(do, q, k, v, o, lse, causal=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    outputs = sum(x.numel() * x.element_size() for x in (o, lse, dq, dk, dv))  # 258 MiB
    assert extra <= outputs + 16 * 2**20, f"{extra / 2**20:.0f} MiB extra for {outputs / 2**20:.0f} MiB of outputs"
    for x in (o, lse, dq, dk, dv):
        assert torch.isfinite(x.float()).all()


@pytest.mark.gpu
def test_info_reports_the_gpu(gpu):
    c = gpu.info()["cuda"]
    assert c["available"] and c["name"] and c["arch"].startswith("sm_") and c["nvrtc_version"] and c["cache_dir"]


_SMALL_SMEM_SCRIPT = r"""
import sys, numpy as np, torch, flash_nif
d, dt, path = int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3]
causal = True
a = np.load(path)
q, k, v, do = (torch.from_numpy(a[n]).cuda().to(dt) for n in ("q", "k", "v", "do"))
o, lse = flash_nif.forward_with_states(q, k, v, causal=causal)
dq, dk, dv = flash_nif.backward(do, q, k, v, o, lse, causal=causal)
np.savez(path, **{n: x.float().cpu().numpy() for n, x in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv))})
"""


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype_name", [(128, "f32"), (256, "bf16"), (128, "bf16")])
def test_small_shared_memory_tiles(gpu, ref, make_inputs, assert_close_to_oracle, tmp_path, d, dtype_name):
    """The fallback tiles for 99 KiB blocks (sm_86/89), forced with FLASH_NIF_MAX_SMEM."""
    import os
    import subprocess
    import sys

    if not HAVE_TORCH_GPU:
        pytest.skip("needs torch")
    dtype = DTYPES[dtype_name]
    q, k, v, do = make_inputs(8, 1, 97, 130, 4, 2, d, dtype)
    path = str(tmp_path / "io.npz")
    np.savez(path, **{n: x.astype(np.float32) for n, x in (("q", q), ("k", k), ("v", v), ("do", do))})
    env = dict(os.environ, FLASH_NIF_MAX_SMEM="101376")
    torch_dtype = {"f32": "float32", "bf16": "bfloat16"}[dtype_name]
    subprocess.run([sys.executable, "-c", _SMALL_SMEM_SCRIPT, str(d), torch_dtype, path], env=env, check=True)
    got = {n: (x if n == "lse" else x.astype(dtype)) for n, x in np.load(path).items()}
    ro, rlse = ref.forward_with_states(q, k, v, causal=True)
    rdq, rdk, rdv = ref.backward(do, q, k, v, got["o"], got["lse"], causal=True)
    for name, want in (("o", ro), ("lse", rlse), ("dq", rdq), ("dk", rdk), ("dv", rdv)):
        assert_close_to_oracle(name, got[name], want, np.float32 if name == "lse" else dtype, f"d={d} small tiles")
