"""Masks (window, segment ids, key padding, block masks) and packed varlen batches against the
float64 oracle, forward and backward, on every device.

Each case runs on the CPU (NumPy) and, marked ``gpu``, on the GPU three ways: NumPy arrays with
``device="cuda"`` (the core's upload path), torch tensors and CuPy arrays (whichever is installed;
the mask arrays then live on the data's device). Tolerances are conftest's: float32 1e-5, float16 /
bfloat16 at most twice the error of the oracle's own result rounded to the dtype; lse 1e-5. The
backward oracle is given the kernel's own o and lse (delta = rowsum(dO * O) depends on them).
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
BLOCK = 128


# --- where the arrays live ----------------------------------------------------------------------

def _gpu_mark(lib_ok: bool, reason: str):
    return [pytest.mark.gpu, pytest.mark.skipif(not lib_ok, reason=reason)]


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("numpy-cuda", id="numpy-cuda", marks=pytest.mark.gpu),
    pytest.param("torch", id="torch", marks=_gpu_mark(HAVE_TORCH_GPU, "torch without CUDA")),
    pytest.param("cupy", id="cupy", marks=_gpu_mark(HAVE_CUPY_GPU, "CuPy without a GPU")),
]
GPU_LIBS = DEVICES[1:]


@pytest.fixture
def env(request, fa):
    """Moves arrays to the parametrized device (``device`` param) and back."""
    where = request.node.callspec.params["where"]
    if where != "cpu":
        info = fa.info().get("cuda", {})
        if not info.get("available"):
            pytest.skip(f"no usable CUDA GPU: {info.get('reason')}")
    return Env(where)


class Env:
    def __init__(self, where):
        self.where = where
        self.kw = {"device": "cuda"} if where == "numpy-cuda" else {}

    def put(self, x):
        if x is None or isinstance(x, (int, float)) or self.where in ("cpu", "numpy-cuda"):
            return x  # scalars (a rotary offset) stay as they are
        if isinstance(x, tuple):
            return tuple(self.put(a) for a in x)
        if self.where == "torch":
            if x.dtype == ml_dtypes.bfloat16:  # exact: bf16 -> f32 -> bf16
                return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).cuda()
            return torch.from_numpy(np.ascontiguousarray(x)).cuda()
        if x.dtype == ml_dtypes.bfloat16:
            try:
                return cupy.asarray(x.view(np.uint16)).view(ml_dtypes.bfloat16)
            except Exception as e:  # noqa: BLE001 - a CuPy without bfloat16 support
                pytest.skip(f"this CuPy has no bfloat16 arrays: {e}")
        return cupy.asarray(x)

    def get(self, x) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x
        if torch is not None and isinstance(x, torch.Tensor):
            if x.dtype == torch.bfloat16:
                return x.float().cpu().numpy().astype(ml_dtypes.bfloat16)
            return x.cpu().numpy()
        if x.dtype == ml_dtypes.bfloat16:
            return cupy.asnumpy(x.view(np.uint16)).view(ml_dtypes.bfloat16)
        return cupy.asnumpy(x)

    def masks(self, masks: dict) -> dict:
        return {key: val if key == "window" else self.put(val) for key, val in masks.items()}


# --- cases ----------------------------------------------------------------------------------------

def nblocks(s: int) -> int:
    return -(-s // BLOCK)


def documents(rng, b, s, n):
    """Sorted segment ids (documents packed into a row), int32 [b, s]."""
    return np.sort(rng.integers(0, n, size=(b, s)), axis=1).astype(np.int32)


def block_mask(rng, shape, dtype=bool):
    return (rng.random(shape) < 0.6).astype(dtype)


def i32(*xs):
    return np.array(xs, dtype=np.int32)


# id -> ((B, Sq, Sk, H, Hkv, D), causal, masks(rng) -> dict)
CASES = {
    "window": ((2, 37, 53, 4, 2, 16), False, lambda r: dict(window=(8, 3))),
    "window-causal-left": ((2, 53, 37, 2, 2, 16), True, lambda r: dict(window=(5, None))),
    "window-narrow": ((1, 40, 40, 2, 1, 8), False, lambda r: dict(window=(1, 1))),  # (0, 0): dq = 0 exactly
    "window-right-only": ((1, 30, 50, 2, 2, 8), False, lambda r: dict(window=(None, 4))),
    "window-causal-unbounded": ((1, 33, 33, 2, 2, 8), True, lambda r: dict(window=(None, None))),
    "segments": ((2, 45, 45, 2, 1, 16), True, lambda r: dict(segment_ids=(documents(r, 2, 45, 4),) * 2)),
    "segments-sq-ne-sk": ((2, 30, 61, 4, 2, 16), False,
                          lambda r: dict(segment_ids=(documents(r, 2, 30, 5), documents(r, 2, 61, 5)))),
    "seqused": ((3, 20, 50, 2, 2, 16), True, lambda r: dict(seqused_k=i32(50, 17, 0))),
    "leftpad": ((3, 20, 50, 2, 1, 16), False, lambda r: dict(leftpad_k=i32(0, 13, 50))),
    "seqused-leftpad": ((3, 25, 40, 2, 2, 16), True,
                        lambda r: dict(seqused_k=i32(40, 30, 9), leftpad_k=i32(5, 30, 2))),
    "block": ((2, 200, 300, 2, 1, 16), False, lambda r: dict(block_mask=block_mask(r, (2, 2, 2, 3)))),
    "block-broadcast-uint8": ((2, 150, 260, 4, 2, 8), True,
                              lambda r: dict(block_mask=block_mask(r, (1, 1, 2, 3), np.uint8))),
    "block-per-batch": ((2, 130, 129, 2, 2, 8), False, lambda r: dict(block_mask=block_mask(r, (2, 1, 2, 2)))),
    "all-causal-gqa": ((2, 150, 270, 4, 2, 16), True, lambda r: dict(
        window=(100, None), segment_ids=(documents(r, 2, 150, 3), documents(r, 2, 270, 3)),
        seqused_k=i32(270, 200), leftpad_k=i32(0, 31), block_mask=block_mask(r, (2, 4, 2, 3)))),
    "all-noncausal": ((2, 97, 140, 6, 2, 24), False, lambda r: dict(
        window=(30, 20), segment_ids=(documents(r, 2, 97, 2), documents(r, 2, 140, 2)),
        seqused_k=i32(120, 140), leftpad_k=i32(7, 0), block_mask=block_mask(r, (1, 6, 1, 2)))),
    "decode-sq1-sk1000": ((3, 1, 1000, 4, 1, 32), True,
                          lambda r: dict(seqused_k=i32(1000, 517, 1), window=(256, None))),
    "s1": ((1, 1, 1, 1, 1, 8), False, lambda r: dict(window=(0, 0), seqused_k=i32(1))),
    "s1000-window": ((1, 1000, 1000, 2, 1, 16), True, lambda r: dict(window=(100, None))),
    # Long hidden runs for the GPU's skip probes (32 mask blocks / 256 ids per probe): 4300 keys of
    # a foreign document before the query's own; 36 block columns with 3 on; 4200 foreign queries
    # before the keys' own document (the dK/dV side).
    "long-foreign-keys": ((1, 300, 4600, 2, 1, 16), False, lambda r: dict(segment_ids=(
        np.ones((1, 300), np.int32), np.repeat(i32(0, 1), [4300, 300])[None]))),
    "long-hidden-blocks": ((1, 200, 4600, 2, 2, 16), True, lambda r: dict(
        block_mask=np.isin(np.arange(36), [0, 33, 35]).reshape(1, 1, 1, 36).repeat(2, 2))),
    "long-foreign-queries": ((1, 4400, 200, 2, 1, 16), False, lambda r: dict(segment_ids=(
        np.repeat(i32(0, 1), [4200, 200])[None], np.ones((1, 200), np.int32)))),
    # rows that see nothing: queries above the shifted diagonal (0-49), a batch row without keys,
    # query ids absent from the keys (140-149), a hidden block (128-149)
    "sees-nothing": ((2, 150, 100, 2, 1, 16), True, lambda r: dict(
        window=(10, None), seqused_k=i32(100, 0), block_mask=np.array([True, False]).reshape(1, 1, 2, 1),
        segment_ids=(np.repeat(i32(0, 7), [140, 10])[None].repeat(2, 0), np.zeros((2, 100), np.int32)))),
}


def run_padded(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, case, dtype_name, seed=0,
               deterministic=False):
    shape, causal, build = CASES[case]
    b, sq, sk, h, hkv, d = shape
    dtype = DTYPES[dtype_name]
    masks = build(np.random.default_rng(seed + 100))
    q, k, v, do = make_inputs(seed, b, sq, sk, h, hkv, d, dtype)
    gq, gk, gv, gdo = (env.put(x) for x in (q, k, v, do))
    gm = env.masks(masks)
    ctx = f"case={case} where={env.where}"

    o, lse = fa.forward_with_states(gq, gk, gv, causal=causal, **gm, **env.kw)
    ro, rlse = ref.forward_with_states(q, k, v, causal=causal, **masks)
    ho, hlse = env.get(o), env.get(lse)
    record_error(dtype_name, "o", assert_close_to_oracle("o", ho, ro, dtype, ctx))
    record_error(dtype_name, "lse", assert_close_to_oracle("lse", hlse, rlse, np.float32, ctx))

    grads = fa.backward(gdo, gq, gk, gv, o, lse, causal=causal, deterministic=deterministic, **gm, **env.kw)
    want = ref.backward(do, q, k, v, ho, hlse, causal=causal, **masks)
    hgrads = [env.get(g) for g in grads]
    for name, got, w in zip(("dq", "dk", "dv"), hgrads, want):
        record_error(dtype_name, name, assert_close_to_oracle(name, got, w, dtype, ctx))
    return (ho, hlse, *hgrads), ref.attention_mask(b, sq, sk, h, causal=causal, **masks)


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_masks_f32(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, where, case):
    run_padded(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, case, "f32")


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("dtype_name", ["f16", "bf16"])
@pytest.mark.parametrize("case", ["window", "segments-sq-ne-sk", "seqused-leftpad", "block", "all-causal-gqa",
                                  "all-noncausal", "decode-sq1-sk1000", "sees-nothing"])
def test_masks_low_precision(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, where, case, dtype_name):
    run_padded(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, case, dtype_name, seed=1)


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("case", ["sees-nothing", "seqused-leftpad", "all-causal-gqa"])
def test_rows_that_see_nothing_are_exact_zeros(fa, ref, env, make_inputs, assert_close_to_oracle, record_error,
                                               where, case):
    """o = 0, lse = -inf and dq = 0 exactly on rows without a visible key; dk = dv = 0 exactly on keys
    no row sees."""
    (o, lse, dq, dk, dv), mask = run_padded(fa, ref, env, make_inputs, assert_close_to_oracle, record_error,
                                            case, "bf16")
    b, h = mask.shape[:2]
    hkv = dk.shape[2]
    empty_rows = ~mask.any(axis=3)  # [B, H, Sq]
    assert empty_rows.any(), "the case must have rows that see nothing"
    assert np.all(np.isneginf(lse[empty_rows])) and np.all(np.isfinite(lse[~empty_rows]))
    rows = empty_rows.transpose(0, 2, 1)  # [B, Sq, H]
    assert np.all(o[rows].astype(np.float32) == 0) and np.all(dq[rows].astype(np.float32) == 0)
    unseen = ~mask.reshape(b, hkv, h // hkv, *mask.shape[2:]).any(axis=(2, 3))  # [B, Hkv, Sk]
    keys = unseen.transpose(0, 2, 1)  # [B, Sk, Hkv]
    assert np.all(dk[keys].astype(np.float32) == 0) and np.all(dv[keys].astype(np.float32) == 0)


@pytest.mark.parametrize("where", DEVICES)
def test_other_index_dtypes_give_the_same_result(fa, env, make_inputs, where):
    """int64 / uint8 / int16 ids and padding are converted to int32; a bool block mask reads as uint8."""
    shape, causal, build = CASES["all-noncausal"]
    masks = build(np.random.default_rng(7))
    q, k, v, do = (env.put(x) for x in make_inputs(7, *shape, np.float32))
    want = fa.forward_with_states(q, k, v, causal=causal, **env.masks(masks), **env.kw)
    seg_q, seg_k = masks["segment_ids"]
    other = dict(masks, segment_ids=(seg_q.astype(np.int64), seg_k.astype(np.uint8)),
                 seqused_k=masks["seqused_k"].astype(np.int16), leftpad_k=masks["leftpad_k"].astype(np.int64),
                 block_mask=masks["block_mask"].astype(np.uint8))
    got = fa.forward_with_states(q, k, v, causal=causal, **env.masks(other), **env.kw)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(env.get(g), env.get(w))
    dq, dk, dv = fa.backward(do, q, k, v, *want, causal=causal, **env.masks(other), **env.kw)
    wq, wk, wv = fa.backward(do, q, k, v, *want, causal=causal, **env.masks(masks), **env.kw)
    for w, g in ((wq, dq), (wk, dk), (wv, dv)):
        np.testing.assert_array_equal(env.get(g), env.get(w))


@pytest.mark.parametrize("where", DEVICES)
def test_no_mask_options_equal_the_plain_call(fa, env, make_inputs, where):
    """window=(None, None), seqused_k = Sk and an all-ones block mask change nothing."""
    b, sq, sk, h, hkv, d = 2, 70, 90, 2, 1, 16
    q, k, v, _ = (env.put(x) for x in make_inputs(3, b, sq, sk, h, hkv, d, np.float32))
    want = env.get(fa.forward(q, k, v, **env.kw))
    masks = dict(window=(None, None), seqused_k=np.full(b, sk, np.int32), leftpad_k=np.zeros(b, np.int32),
                 block_mask=np.ones((1, 1, 1, 1), bool))
    got = env.get(fa.forward(q, k, v, **env.masks(masks), **env.kw))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --- varlen ---------------------------------------------------------------------------------------

# id -> (q lengths, k lengths, H, Hkv, D, causal, window)
VARLEN = {
    "mixed": ([5, 0, 97, 1, 12], [7, 3, 97, 40, 0], 4, 2, 16, True, None),
    "mixed-full": ([5, 0, 97, 1, 12], [7, 3, 97, 40, 0], 4, 2, 16, False, None),
    "window": ([33, 64, 1], [50, 64, 9], 2, 1, 24, False, (6, 2)),
    "window-causal": ([40, 17], [20, 60], 2, 2, 8, True, (4, None)),
    "one": ([1], [1], 1, 1, 8, True, None),
    "long": ([1000, 3], [1000, 200], 2, 1, 32, True, (128, None)),
}


def packed(seed, q_lens, k_lens, h, hkv, d, dtype):
    rng = np.random.default_rng(seed)
    tq, tk = sum(q_lens), sum(k_lens)
    q, do = (rng.standard_normal((tq, h, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((tk, hkv, d)).astype(dtype) for _ in range(2))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (q_lens, k_lens))
    return q, k, v, do, cu_q, cu_k


def run_varlen(fa, ref, env, assert_close_to_oracle, record_error, case, dtype_name, seed=0, deterministic=False):
    q_lens, k_lens, h, hkv, d, causal, window = VARLEN[case]
    dtype = DTYPES[dtype_name]
    q, k, v, do, cu_q, cu_k = packed(seed, q_lens, k_lens, h, hkv, d, dtype)
    g = [env.put(x) for x in (q, k, v, do, cu_q, cu_k)]
    ctx = f"varlen case={case} where={env.where}"
    o, lse = fa.varlen.forward_with_states(g[0], g[1], g[2], g[4], g[5], causal=causal, window=window, **env.kw)
    ro, rlse = ref.varlen_forward_with_states(q, k, v, cu_q, cu_k, causal=causal, window=window)
    ho, hlse = env.get(o), env.get(lse)
    assert ho.shape == q.shape and hlse.shape == (h, q.shape[0])
    record_error(dtype_name, "o", assert_close_to_oracle("o", ho, ro, dtype, ctx))
    record_error(dtype_name, "lse", assert_close_to_oracle("lse", hlse, rlse, np.float32, ctx))
    grads = fa.varlen.backward(g[3], g[0], g[1], g[2], o, lse, g[4], g[5], causal=causal, window=window,
                               deterministic=deterministic, **env.kw)
    want = ref.varlen_backward(do, q, k, v, ho, hlse, cu_q, cu_k, causal=causal, window=window)
    hgrads = [env.get(x) for x in grads]
    for name, got, w in zip(("dq", "dk", "dv"), hgrads, want):
        record_error(dtype_name, name, assert_close_to_oracle(name, got, w, dtype, ctx))
    return ho, hlse, *hgrads


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("dtype_name", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("case", list(VARLEN))
def test_varlen(fa, ref, env, assert_close_to_oracle, record_error, where, case, dtype_name):
    run_varlen(fa, ref, env, assert_close_to_oracle, record_error, case, dtype_name)


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
@pytest.mark.parametrize("causal,window", [(True, None), (False, (9, 3))], ids=["causal", "window"])
def test_varlen_equals_padded_batch_with_seqused_k(fa, ref, env, make_inputs, assert_close_to_oracle, rel_err,
                                                   where, dtype_name, causal, window):
    """The same sequences as a padded batch (every row Sq queries, seqused_k[b] keys) and packed."""
    b, sq, sk, h, hkv, d = 3, 29, 70, 4, 2, 16
    used = [70, 13, 1]
    dtype = DTYPES[dtype_name]
    q, k, v, do = make_inputs(11, b, sq, sk, h, hkv, d, dtype)
    opts = dict(causal=causal, window=window, **env.kw)
    gq, gk, gv, gdo = (env.put(x) for x in (q, k, v, do))
    o, lse = fa.forward_with_states(gq, gk, gv, seqused_k=env.put(i32(*used)), **opts)
    dq, dk, dv = (env.get(x) for x in fa.backward(gdo, gq, gk, gv, o, lse, seqused_k=env.put(i32(*used)), **opts))
    o, lse = env.get(o), env.get(lse)

    def pack_k(x):
        return np.concatenate([x[i, :n] for i, n in enumerate(used)])

    cu_q = (np.arange(b + 1) * sq).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(used)]).astype(np.int32)
    pq, pdo = q.reshape(b * sq, h, d), do.reshape(b * sq, h, d)
    pk, pv = pack_k(k), pack_k(v)
    g = [env.put(x) for x in (pq, pk, pv, pdo, cu_q, cu_k)]
    vo, vlse = fa.varlen.forward_with_states(g[0], g[1], g[2], g[4], g[5], **opts)
    vdq, vdk, vdv = (env.get(x) for x in fa.varlen.backward(g[3], g[0], g[1], g[2], vo, vlse, g[4], g[5], **opts))
    vo, vlse = env.get(vo), env.get(vlse)

    ro, rlse = ref.forward_with_states(q, k, v, causal=causal, window=window, seqused_k=used)
    rdq, rdk, rdv = ref.backward(do, q, k, v, o, lse, causal=causal, window=window, seqused_k=used)
    pairs = [("o", vo.reshape(o.shape), o, ro, dtype), ("lse", vlse.reshape(h, b, sq).transpose(1, 0, 2), lse, rlse,
                                                        np.float32),
             ("dq", vdq.reshape(dq.shape), dq, rdq, dtype), ("dk", vdk, pack_k(dk), pack_k(rdk), dtype),
             ("dv", vdv, pack_k(dv), pack_k(rdv), dtype)]
    for name, packed_out, padded_out, want, dt in pairs:
        assert_close_to_oracle(name, packed_out, want, dt, "varlen")
        assert_close_to_oracle(name, padded_out, want, dt, "padded")
        if np.dtype(dt) == np.float32:
            assert rel_err(packed_out, padded_out) <= 1e-6, name
    for i, n in enumerate(used):  # padding keys get no gradient
        assert np.all(dk[i, n:].astype(np.float32) == 0) and np.all(dv[i, n:].astype(np.float32) == 0)


def test_varlen_int64_cu_seqlens(fa, make_inputs):
    q, k, v, do, cu_q, cu_k = packed(5, [3, 8], [4, 9], 2, 1, 8, np.float32)
    want = fa.varlen.forward_with_states(q, k, v, cu_q, cu_k)
    got = fa.varlen.forward_with_states(q, k, v, cu_q.astype(np.int64), cu_k.astype(np.int64))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


# --- GPU only -----------------------------------------------------------------------------------

@pytest.mark.parametrize("where", GPU_LIBS)
@pytest.mark.parametrize("case", ["all-causal-gqa", "all-noncausal", "sees-nothing"])
def test_deterministic_backward_is_bit_identical(fa, ref, env, make_inputs, assert_close_to_oracle, record_error,
                                                 where, case):
    first = run_padded(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, case, "bf16",
                       deterministic=True)[0]
    again = run_padded(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, case, "bf16",
                       deterministic=True)[0]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a,
                                      b.view(np.uint16) if b.dtype == ml_dtypes.bfloat16 else b)


@pytest.mark.parametrize("where", GPU_LIBS)
def test_varlen_deterministic_backward_is_bit_identical(fa, ref, env, assert_close_to_oracle, record_error, where):
    first = run_varlen(fa, ref, env, assert_close_to_oracle, record_error, "mixed", "f16", deterministic=True)
    again = run_varlen(fa, ref, env, assert_close_to_oracle, record_error, "mixed", "f16", deterministic=True)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("where", GPU_LIBS[1:])
def test_gpu_masks_must_live_with_the_data(fa, env, make_inputs, where):
    """Mask arrays of another kind than the data (NumPy with GPU data, or the reverse) are an error
    like any mixed call; so is device="cpu" with GPU masks."""
    b, sq, sk, h, hkv, d = 2, 16, 16, 2, 2, 64
    q, k, v, _ = make_inputs(4, b, sq, sk, h, hkv, d, np.float32)
    gq, gk, gv = (env.put(x) for x in (q, k, v))
    used = i32(16, 3)
    seg = (np.zeros((b, sq), np.int32), np.zeros((b, sk), np.int32))
    with pytest.raises(fa.DeviceError):
        fa.forward(gq, gk, gv, seqused_k=used)
    with pytest.raises(fa.DeviceError):
        fa.forward(gq, gk, gv, segment_ids=(env.put(seg[0]), seg[1]))
    with pytest.raises(fa.DeviceError):
        fa.forward(q, k, v, block_mask=env.put(np.ones((1, 1, 1, 1), bool)))
    with pytest.raises(fa.DeviceError):
        fa.forward(q, k, v, seqused_k=env.put(used), device="cpu")
    cu = i32(0, 16, 32)
    with pytest.raises(fa.DeviceError):
        fa.varlen.forward(gq.reshape(b * sq, h, d), gk.reshape(b * sk, hkv, d), gv.reshape(b * sk, hkv, d), cu,
                          env.put(cu))
    with pytest.raises(fa.ShapeError):  # validation on the device path names the argument
        fa.forward(gq, gk, gv, seqused_k=env.put(i32(16, 17)))
    with pytest.raises(fa.DTypeError):
        fa.forward(gq, gk, gv, block_mask=env.put(np.ones((1, 1, 1, 1), np.float32)))
