"""Rotary position embeddings (flash_nif.rotary) against the float64 oracle (reference.rotary_apply /
rotary_backward), which is itself checked first.

Every case runs on the CPU and, marked ``gpu``, on the GPU three ways: NumPy arrays with
device="cuda", torch tensors and CuPy arrays (the Env of tests/test_masks.py). Both layouts
(half-split, interleaved), R == D and R < D (odd D too), positions as None, an int offset and an
int32 array, every dtype; the shared fixtures tests/fixtures/rotary (ExUnit reads them too); and
the errors: R > D, odd R, cos / sin mismatch, positions outside [0, max_pos), wrong dtypes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fixture_cases import assert_generator_reproduces, read_cases
from test_masks import DEVICES, GPU_LIBS, HAVE_CUPY_GPU, Env, cupy

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


@pytest.fixture
def env(request, fa):
    where = request.node.callspec.params["where"]
    if where != "cpu":
        info = fa.info().get("cuda", {})
        if not info.get("available"):
            pytest.skip(f"no usable CUDA GPU: {info.get('reason')}")
    return Env(where)


def tables(max_pos, rotary_dim, dtype=np.float32):
    half = rotary_dim // 2
    ang = np.arange(max_pos)[:, None] * 10000.0 ** (-np.arange(half) / half)[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def positions_of(kind, rng, b, s, max_pos):
    """None, the largest int offset the tables allow, or an int32 array reaching the last row."""
    if kind == "none":
        return None
    if kind == "offset":
        return max_pos - s
    p = rng.integers(0, max_pos, size=(b, s)).astype(np.int32)
    p.flat[-1] = max_pos - 1
    return p


# --- the oracle -----------------------------------------------------------------------------------

def naive_rotary(x, cos, sin, interleaved, positions, sign):
    """Scalar loops over every rotated pair."""
    b_, s_, h_, d = x.shape
    half = cos.shape[1]
    y = x.astype(np.float64).copy()
    for b in range(b_):
        for s in range(s_):
            p = s + (positions or 0) if positions is None or isinstance(positions, int) else int(positions[b, s])
            for h in range(h_):
                for i in range(half):
                    ia, ib = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                    c, sn = float(cos[p, i]), sign * float(sin[p, i])
                    a, bb = float(x[b, s, h, ia]), float(x[b, s, h, ib])
                    y[b, s, h, ia], y[b, s, h, ib] = a * c - bb * sn, bb * c + a * sn
    return y


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("positions", ["none", "offset", "array"])
def test_oracle_matches_scalar_loops(ref, interleaved, positions):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 2, 7))
    cos, sin = tables(6, 4, np.float64)
    pos = positions_of(positions, rng, 2, 3, 6)
    kw = dict(interleaved=interleaved, positions=pos)
    np.testing.assert_allclose(ref.rotary_apply(x, cos, sin, **kw), naive_rotary(x, cos, sin, interleaved, pos, 1.0), atol=1e-14)
    np.testing.assert_allclose(ref.rotary_backward(x, cos, sin, **kw), naive_rotary(x, cos, sin, interleaved, pos, -1.0),
                               atol=1e-14)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_oracle_backward_is_the_transpose_and_the_inverse(ref, interleaved):
    """<apply(x), dy> == <x, backward(dy)> for any x, dy; backward(apply(x)) == x; norms kept."""
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((2, 5, 3, 10)), rng.standard_normal((2, 5, 3, 10))
    cos, sin = tables(9, 8, np.float64)
    kw = dict(interleaved=interleaved, positions=rng.integers(0, 9, size=(2, 5)))
    y = ref.rotary_apply(x, cos, sin, **kw)
    assert np.vdot(y, dy) == pytest.approx(np.vdot(x, ref.rotary_backward(dy, cos, sin, **kw)), rel=1e-13)
    np.testing.assert_allclose(ref.rotary_backward(y, cos, sin, **kw), x, atol=1e-13)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-13)
    np.testing.assert_array_equal(y[..., 8:], x[..., 8:])  # dims R..D pass through


def test_oracle_checks_its_inputs(ref):
    x = np.ones((1, 4, 1, 8))
    cos, sin = tables(4, 8, np.float64)
    with pytest.raises(ValueError, match="positions must lie"):
        ref.rotary_apply(x, cos, sin, positions=1)
    with pytest.raises(ValueError, match="R = 10"):
        ref.rotary_apply(x, *tables(4, 10, np.float64))
    assert ref.rotary_apply(x, cos, sin).dtype == np.float64


# --- the kernels ----------------------------------------------------------------------------------

# (B, S, H, D, R, max_pos)
SHAPES = [
    pytest.param((2, 9, 3, 16, 16, 9), id="full-r16"),
    pytest.param((1, 33, 4, 72, 36, 40), id="half-r36-d72"),
    pytest.param((2, 5, 2, 13, 6, 16), id="odd-d13-r6"),
    pytest.param((3, 1, 8, 128, 128, 64), id="decode-d128"),
    pytest.param((1, 70, 2, 40, 40, 70), id="d40"),
]


def lowp_bound(want, dtype, factor=2.0):
    """factor x the error of the oracle's own result rounded to dtype (+1e-6)."""
    want = np.asarray(want)
    return factor * np.linalg.norm(want.astype(dtype).astype(np.float64) - want) / np.linalg.norm(want) + 1e-6


def rel_err(got, want):
    got, want = np.asarray(got).astype(np.float64), np.asarray(want, dtype=np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("positions", ["none", "offset", "array"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_against_oracle(fa, ref, env, assert_close_to_oracle, shape, dtype_name, interleaved, positions, where):
    b, s, h, d, r, max_pos = shape
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal((b, s, h, d)).astype(dtype)
    dy = rng.standard_normal((b, s, h, d)).astype(dtype)
    cos, sin = tables(max_pos, r)
    pos = positions_of(positions, rng, b, s, max_pos)
    kw = dict(interleaved=interleaved, positions=env.put(pos))
    gx, gdy, gcos, gsin = (env.put(a) for a in (x, dy, cos, sin))
    y = fa.rotary.apply(gx, gcos, gsin, **kw, **env.kw)
    dx = fa.rotary.backward(gdy, gcos, gsin, **kw, **env.kw)
    assert type(y) is type(gx) and type(dx) is type(gx)
    y, dx = env.get(y), env.get(dx)
    assert y.dtype == dtype and dx.dtype == dtype and y.shape == x.shape
    rkw = dict(interleaved=interleaved, positions=pos)
    ctx = f"{where} {dtype_name} interleaved={interleaved} positions={positions}"
    want_y = ref.rotary_apply(x, cos, sin, **rkw)
    assert_close_to_oracle("y", y, want_y, dtype, ctx)
    assert_close_to_oracle("dx", dx, ref.rotary_backward(dy, cos, sin, **rkw), dtype, ctx)
    # dims R..D pass through bit for bit
    np.testing.assert_array_equal(y[..., r:].view(np.uint8), x[..., r:].view(np.uint8))
    # the round trip: backward(apply(x)) is x, up to y's rounding to dtype (and back's)
    back = env.get(fa.rotary.backward(env.put(y), gcos, gsin, **kw, **env.kw))
    bound = 1e-6 if dtype == np.float32 else lowp_bound(want_y, dtype, 3.0)
    assert rel_err(back, x) <= bound, ctx


@pytest.mark.parametrize("where", DEVICES)
def test_positions_array_and_offset_agree(fa, env, where):
    """An offset is the array s + offset; documents restarting at 0 take the tables' first rows."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 6, 3, 32)).astype(np.float32)
    cos, sin = (env.put(t) for t in tables(20, 32))

    def rope(x, positions=None):
        return env.get(fa.rotary.apply(env.put(x), cos, sin, positions=env.put(positions), **env.kw))

    pos = np.broadcast_to(np.arange(6, dtype=np.int32) + 7, (2, 6)).copy()
    np.testing.assert_array_equal(rope(x, 7), rope(x, pos))
    docs = np.array([[0, 1, 2, 0, 1, 2]] * 2, dtype=np.int32)
    y = rope(x, docs)
    np.testing.assert_array_equal(y[:, :3], rope(x[:, :3].copy()))
    np.testing.assert_array_equal(y[:, 3:], rope(x[:, 3:].copy()))


@pytest.mark.parametrize("where", DEVICES)
def test_int64_positions_are_converted_and_views_copied(fa, ref, env, where):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 4, 3, 20)).astype(np.float32)[..., 2:18]  # a view: copied, never misread
    cos, sin = tables(8, 16)
    pos = rng.integers(0, 8, size=(2, 4)).astype(np.int64)
    y = env.get(fa.rotary.apply(env.put(x), env.put(cos), env.put(sin), positions=env.put(pos), **env.kw))
    np.testing.assert_allclose(y, ref.rotary_apply(x, cos, sin, positions=pos), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("where", DEVICES)
def test_empty_inputs(fa, env, where):
    cos, sin = tables(4, 8)
    for shape in ((0, 3, 2, 8), (2, 0, 2, 8), (2, 3, 0, 8)):
        y = fa.rotary.apply(env.put(np.zeros(shape, np.float16)), env.put(cos), env.put(sin), **env.kw)
        assert env.get(y).shape == shape


# --- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", DEVICES)
def test_bad_calls_are_clear_errors(fa, env, where):
    x = np.ones((2, 4, 3, 16), np.float32)
    cos, sin = tables(8, 16)
    put = env.put

    def call(x=x, cos=cos, sin=sin, fn=fa.rotary.apply, **kw):
        return fn(put(x), put(cos), put(sin), **kw, **env.kw)

    with pytest.raises(fa.ShapeError, match=r"R = 2 \* 9 = 18.*head_dim 16"):
        call(cos=tables(8, 18)[0], sin=tables(8, 18)[1])
    with pytest.raises(fa.ShapeError, match=r"cos has shape \[8, 8\] but sin has shape \[9, 8\]"):
        call(sin=tables(9, 16)[1])
    with pytest.raises(fa.ShapeError, match=r"positions\[1, 2\] = 8 is outside the tables' rows \[0, max_pos = 8\)"):
        call(positions=put(np.array([[0, 1, 2, 3], [4, 5, 8, 7]], np.int32)))
    with pytest.raises(fa.ShapeError, match=r"positions\[0, 0\] = -1"):
        call(positions=put(np.array([[-1, 1, 2, 3], [4, 5, 6, 7]], np.int32)))
    with pytest.raises(fa.ShapeError, match=r"positions 5\.\.9 .* max_pos = 8"):
        call(positions=5)
    with pytest.raises(fa.UnsupportedError, match="non-negative"):
        call(positions=-1)
    with pytest.raises(fa.ShapeError, match=r"expected \[batch, seq\] = \[2, 4\]"):
        call(positions=put(np.zeros((4, 2), np.int32)))
    with pytest.raises(fa.DTypeError, match="positions has dtype float32; it must be int32"):
        call(positions=put(np.zeros((2, 4), np.float32)))
    with pytest.raises(fa.DTypeError, match="cos has dtype float16; it must be float32"):
        call(cos=cos.astype(np.float16))
    with pytest.raises(fa.DTypeError, match="dy has dtype float64"):
        call(x=x.astype(np.float64), fn=fa.rotary.backward)
    with pytest.raises(fa.DTypeError, match="x has dtype int32"):
        call(x=x.astype(np.int32))
    with pytest.raises(fa.ShapeError, match=r"x must have rank 4"):
        call(x=x[0])
    with pytest.raises(fa.ShapeError, match="cos must have rank 2"):
        call(cos=cos[None], sin=sin[None])
    with pytest.raises(fa.UnsupportedError, match="interleaved must be a bool"):
        call(interleaved=1)
    with pytest.raises(fa.UnsupportedError, match="positions must be None, an int offset"):
        call(positions=True)


def test_odd_rotary_dims_are_refused(fa):
    """R = 2 * cos.shape[1] is even by construction; the tables builder refuses an odd R."""
    with pytest.raises(fa.UnsupportedError, match="even"):
        fa.rotary.tables(8, 7)
    cos, sin = fa.rotary.tables(8, 6)
    assert cos.shape == sin.shape == (8, 3) and cos.dtype == np.float32
    np.testing.assert_allclose(cos, tables(8, 6)[0], atol=1e-7)


def test_numpy_runs_on_the_cpu_unless_asked(fa):
    cos, sin = tables(4, 8)
    with pytest.raises(fa.UnsupportedError, match="unknown device"):
        fa.rotary.apply(np.ones((1, 4, 1, 8), np.float32), cos, sin, device="tpu")


@pytest.mark.gpu
@pytest.mark.parametrize("where", GPU_LIBS[1:])
def test_gpu_arrays_must_live_together(fa, env, where):
    x = np.ones((1, 4, 1, 8), np.float32)
    cos, sin = tables(4, 8)
    with pytest.raises(fa.DeviceError, match="one GPU"):
        fa.rotary.apply(env.put(x), cos, env.put(sin))
    with pytest.raises(fa.DeviceError, match="inputs live on a GPU"):
        fa.rotary.apply(env.put(x), env.put(cos), env.put(sin), device="cpu")


# --- GPU specifics: vector widths, every element written ------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_gpu_misaligned_views_and_poisoned_outputs(fa, ref, dtype_name, interleaved):
    """Through the native entry point on NaN-poisoned outputs, with x and y one element off a 16-byte
    boundary (the launcher must fall back to narrower vectors): every element written, all correct."""
    if not HAVE_CUPY_GPU or not fa.info()["cuda"].get("available"):
        pytest.skip("needs CuPy and a usable GPU")
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(9)
    shape, r = (3, 17, 4, 64), 48
    x = rng.standard_normal(shape).astype(dtype)
    cos, sin = tables(30, r)
    n = x.size
    raw = cupy.asarray(x.reshape(-1).view(np.uint16 if x.itemsize == 2 else np.uint32))
    for shift in (0, 1):
        src = cupy.zeros(n + 1, raw.dtype)
        src[shift:shift + n] = raw
        out = cupy.full(n + 1, 0xFFFF if x.itemsize == 2 else 0x7FC00000, raw.dtype)  # NaN bits
        gx, gy = src[shift:shift + n], out[shift:shift + n]
        gcos, gsin = cupy.asarray(cos), cupy.asarray(sin)
        desc = [(gx.data.ptr, list(shape), np.dtype(dtype).name), (gcos.data.ptr, list(cos.shape), "float32"),
                (gsin.data.ptr, list(sin.shape), "float32")]
        fa._native.cuda_rotary_device(desc, gy.data.ptr, 0, cupy.cuda.get_current_stream().ptr, backward=False,
                                      interleaved=interleaved, offset=3)
        y = cupy.asnumpy(gy).view(dtype).reshape(shape)
        assert not np.isnan(y.astype(np.float32)).any(), f"shift {shift}: elements left unwritten"
        want = ref.rotary_apply(x, cos, sin, interleaved=interleaved, positions=3)
        assert rel_err(y, want) <= (1e-6 if dtype == np.float32 else lowp_bound(want, dtype)), f"shift {shift}"


@pytest.mark.gpu
@pytest.mark.parametrize("where", GPU_LIBS)
def test_gpu_large_call(fa, ref, env, where):
    """Many blocks: B·S·H rows well past one grid wave, D = 128 half rotary in bf16."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 512, 16, 128)).astype(ml_dtypes.bfloat16)
    cos, sin = tables(1024, 64)
    pos = rng.integers(0, 1024, size=(4, 512)).astype(np.int32)
    y = env.get(fa.rotary.apply(env.put(x), env.put(cos), env.put(sin), positions=env.put(pos), **env.kw))
    want = ref.rotary_apply(x, cos, sin, positions=pos)
    assert rel_err(y, want) <= lowp_bound(want, ml_dtypes.bfloat16)


# --- the shared fixtures (ExUnit checks the NIF against the same numbers) ----------------------------

def _fixture_cases():
    return read_cases("rotary")


@pytest.mark.parametrize("where", DEVICES)
def test_shared_fixtures(fa, env, where):
    cases = _fixture_cases()
    assert {c["dtype"] for c, _ in cases} == {"float32", "float16", "bfloat16"}
    assert {c["interleaved"] for c, _ in cases} == {False, True}
    assert any(c["rotary_dim"] < c["head_dim"] for c, _ in cases) and any(c["offset"] is None for c, _ in cases)
    for c, t in cases:
        kw = dict(interleaved=c["interleaved"], positions=env.put(t["positions"]) if c["offset"] is None else c["offset"])
        cos, sin = env.put(t["cos"]), env.put(t["sin"])
        y = env.get(fa.rotary.apply(env.put(t["x"]), cos, sin, **kw, **env.kw))
        dx = env.get(fa.rotary.backward(env.put(t["dy"]), cos, sin, **kw, **env.kw))
        for name, got in (("y", y), ("dx", dx)):
            assert rel_err(got, t[name]) <= c["tol"][name], f"{c['name']} {name}"


def test_fixtures_are_what_the_generator_writes(tmp_path):
    assert_generator_reproduces("rotary", tmp_path)
