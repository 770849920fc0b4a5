"""Decode over KV caches on the GPU (flash_nif.decode, quantize_kv, dequantize_kv, merge_states with
CuPy arrays, torch CUDA tensors, or NumPy with device="cuda"): every test is marked ``gpu`` and skips
without one (torch's, CuPy's, each where installed).

The oracle is reference.py's float64 ``decode`` over the cache as :func:`flash_nif.dequantize_kv`
gives it back (rounded to the dtype, as the CUDA-core kernel rounds dequantized values before its
products), or over the exact dequantized values for the 4- and 8-bit tensor-core kernels, which never
round them (``oracle_cache``), with conftest's tolerances: float32
1e-5, float16 / bfloat16 at most twice the error of the oracle's own output rounded to the dtype;
lse 1e-5. The
cache format is checked bit for bit against the CPU (itself bit for bit the oracle's).

Covers the tensor-core kernel (fp16 / bf16 at D = 64, 128, 256) and the CUDA-core one (fp32, other
head dims, odd ones too), GQA ratios 1, 4, 8, Sq 1, 4, 16, ragged cache lengths with 0, left padding,
windows, softcap, 4 / 8-bit codes in groups of 32 / 64 (odd group counts, a tensor whose scales end
mid-word), queries and values far from unit size, split counts, more blocks than the GPU holds at
once, merge_states, and the errors of bad calls.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from test_masks import GPU_LIBS, HAVE_CUPY_GPU, HAVE_TORCH_GPU, Env, torch

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpu(fa):
    info = fa.info().get("cuda", {})
    if not info.get("available"):
        pytest.skip(f"no usable CUDA GPU: {info.get('reason')}")
    return info


@pytest.fixture
def env(request, gpu):
    return Env(request.node.callspec.params["where"])


@pytest.fixture
def lib(gpu):
    """The accuracy tests' one library: torch, else CuPy, else NumPy with device="cuda"."""
    return Env("torch" if HAVE_TORCH_GPU else "cupy" if HAVE_CUPY_GPU else "numpy-cuda")


def rand(seed, shape, dtype, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def put_cache(fa, env, x, quant):
    """x on env's device, plain or quantized there (quantize_kv on the GPU)."""
    if quant is None:
        return env.put(x)
    bits, gs = quant
    if env.where == "numpy-cuda":
        return fa.quantize_kv(x, bits=bits, group_size=gs, device="cuda")
    return fa.quantize_kv(env.put(x), bits=bits, group_size=gs)


def oracle_cache(fa, ref, x, quant, exact):
    """The cache the oracle reads: x, or its quantized form dequantized on the CPU, in x's dtype as
    the kernels that dequantize before their products round it, or (`exact`) float64: the 4- and
    8-bit tensor-core kernels' products take the codes as they are and the scales and biases in f32
    (cuda/decode_q4.h, decode_q8.h), so their values are scale * code + bias unrounded."""
    if quant is None:
        return x
    c = fa.quantize_kv(x, bits=quant[0], group_size=quant[1])
    if exact:
        return ref.dequantize_kv(ref.QuantizedKV(*(np.asarray(a) for a in (c.values, c.scales, c.biases)), *quant))
    return fa.dequantize_kv(c)


def takes_exact_codes(dtype_name, d, quant):
    """Whether decode runs a quantized tensor-core kernel (fp16 / bf16 at D = 64, 128, 256)."""
    return quant is not None and dtype_name != "f32" and d in (64, 128, 256)


def run_decode(fa, ref, env, assert_close_to_oracle, *, dtype_name, d, sq, group, quant, b=3, s_cache=300, hkv=2,
               seqlens=(300, 123, 0), leftpad=(10, 0, 0), seed=0, v_quant="same", offset=0.0, q_size=1.0,
               v_sizes=1.0, **opts):
    """quant: the k cache's (bits, group_size) or None; v_quant: the v cache's (default the same);
    offset: added to every cached value (large biases against small scales); q_size: q's factor;
    v_sizes: v's factor, or one per key ([s_cache])."""
    dtype = DTYPES[dtype_name]
    v_quant = quant if v_quant == "same" else v_quant
    q = rand(seed, (b, sq, hkv * group, d), np.float32, q_size).astype(dtype)
    k = (rand(seed + 1, (b, s_cache, hkv, d), np.float32) + offset).astype(dtype)
    v_factor = np.reshape(v_sizes, (1, -1, 1, 1))
    v = ((rand(seed + 2, (b, s_cache, hkv, d), np.float32) - offset) * v_factor).astype(dtype)
    rows = {}
    if seqlens is not None:
        rows["cache_seqlens"] = np.array(seqlens, np.int32)
    if leftpad is not None:
        rows["leftpad_k"] = np.array(leftpad, np.int32)
    kc, vc = put_cache(fa, env, k, quant), put_cache(fa, env, v, v_quant)
    o, lse = fa.decode(env.put(q), kc, vc, **{n: env.put(x) for n, x in rows.items()}, **opts, **env.kw)
    exact = takes_exact_codes(dtype_name, d, quant)
    want_o, want_lse = ref.decode(q, oracle_cache(fa, ref, k, quant, exact), oracle_cache(fa, ref, v, v_quant, exact), **rows,
                                  **{n: x for n, x in opts.items() if n != "num_splits"})
    ho, hlse = env.get(o), env.get(lse)
    ctx = f"{dtype_name} d={d} sq={sq} group={group} quant={quant} {opts} where={env.where}"
    assert ho.dtype == dtype and ho.shape == q.shape and hlse.shape == (b, hkv * group, sq)
    assert_close_to_oracle("o", ho, want_o, dtype, ctx)
    assert_close_to_oracle("lse", hlse, want_lse, np.float32, ctx)
    for i, n in enumerate(seqlens or ()):
        if n - (leftpad[i] if leftpad else 0) == 0:
            assert np.all(ho[i].astype(np.float32) == 0) and np.isneginf(hlse[i]).all(), f"row {i}: {ctx}"
    return ho, hlse


# --- accuracy against the oracle --------------------------------------------------------------------

QUANTS = [None, (8, 32), (4, 64), (8, 64), (4, 32)]


@pytest.mark.parametrize("quant", QUANTS, ids=str)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype_name", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("sq, group", [(1, 4), (4, 1), (16, 8), (3, 8)])
def test_decode_matches_the_oracle(fa, ref, lib, assert_close_to_oracle, dtype_name, d, sq, group, quant):
    """Ragged lengths (one 0), left padding, GQA 1 / 4 / 8, Sq 1 .. 16: the tensor-core kernel for
    fp16 / bf16, the CUDA-core one for fp32."""
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name=dtype_name, d=d, sq=sq, group=group, quant=quant,
               seed=d + sq)


@pytest.mark.parametrize("dtype_name", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("d, quant", [(40, None), (72, None), (7, None), (96, (4, 32)), (96, (8, 32)), (192, (4, 64)),
                                      (32, (8, 32))], ids=str)
def test_other_head_dims_take_the_cuda_core_kernel(fa, ref, lib, assert_close_to_oracle, dtype_name, d, quant):
    """Head dims outside 64 / 128 / 256: rows of odd sizes (D = 7: 2-byte copies), an odd number of
    scale groups per row (16-bit scales that start mid-word)."""
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name=dtype_name, d=d, sq=2, group=4, quant=quant, seed=d)


@pytest.mark.parametrize("dtype_name", ["bf16", "f32"])
@pytest.mark.parametrize("opts", [
    dict(window=(37, None)),
    dict(window=(20, 5), causal=False),
    dict(window=(None, 3), causal=False),
    dict(causal=False),
    dict(softcap=8.0),
    dict(softcap=20.0, window=(64, None), scale=0.3),
], ids=str)
@pytest.mark.parametrize("quant", [None, (4, 64)], ids=str)
def test_windows_softcap_and_scale(fa, ref, lib, assert_close_to_oracle, dtype_name, opts, quant):
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name=dtype_name, d=128, sq=4, group=4, quant=quant, **opts)


@pytest.mark.parametrize("quant", [None, (8, 64), (4, 32)], ids=str)
def test_split_counts_agree(fa, ref, lib, assert_close_to_oracle, quant):
    """num_splits 1, 2 (a plain cache's splits merge as a cluster on Hopper), 7, 9, 40 and 64 (past
    one warp's trip the merge takes a block per state), 129 (more splits than some rows have keys,
    and past the block's trip) and the GPU's own choice: each against the oracle, and with one
    another to rounding."""
    outs = []
    for splits in (None, 1, 2, 7, 9, 40, 64, 129):
        o, lse = run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name="bf16", d=128, sq=1, group=8, quant=quant,
                            s_cache=700, seqlens=(700, 129, 5), leftpad=(3, 0, 5), num_splits=splits)
        outs.append((o.astype(np.float32), lse))
    for o, lse in outs[1:]:
        np.testing.assert_allclose(o, outs[0][0], rtol=0.02, atol=0.02)
        np.testing.assert_allclose(lse, outs[0][1], rtol=1e-5)


@pytest.mark.parametrize("d", [64, 256])
def test_block_merges_at_other_head_dims(fa, ref, lib, assert_close_to_oracle, d):
    """40 splits at D = 64 (half the lanes' columns past Dv) and D = 256 (two passes of columns) by
    the merge's block per state, three sequences of ragged length."""
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name="bf16", d=d, sq=2, group=2, quant=None, b=3,
               s_cache=900, seqlens=(900, 333, 41), leftpad=(0, 7, 0), num_splits=40)


@pytest.mark.parametrize("quant", [None, (8, 32), (4, 64)], ids=str)
def test_splits_of_several_state_chunks(fa, ref, lib, assert_close_to_oracle, quant):
    """64 query states a kv head (Sq = 16, GQA 4): chunks of states across the grid, each with its
    own splits."""
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name="bf16", d=128, sq=16, group=4, quant=quant, b=2,
               s_cache=1000, seqlens=(1000, 300), leftpad=(0, 17), num_splits=3)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_long_cache_splits_across_the_gpu(fa, ref, lib, assert_close_to_oracle, bits):
    """The benchmark's shape at 32k tokens: B = 1, Hkv = 8, H = 32, D = 128, Sq = 1, bf16 (the split
    count the GPU chooses, its merge)."""
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name="bf16", d=128, sq=1, group=4, quant=(bits, 64), b=1,
               s_cache=32768, hkv=8, seqlens=None, leftpad=None)


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("dtype_name, quant", [("bf16", None), ("bf16", (8, 64)), ("bf16", (4, 64)), ("f32", None),
                                               ("f32", (4, 32))], ids=str)
def test_more_items_than_resident_blocks(fa, ref, lib, assert_close_to_oracle, dtype_name, quant, splits):
    """B * Hkv * splits work items (here 480 or 1440) past what the GPU holds at once (132 SMs x 2-3
    blocks: several waves of blocks), across rows with no keys (0 and fully left-padded) and rows of
    one key."""
    b = 60
    rng = np.random.default_rng(7)
    seqlens = rng.integers(0, 90, b)
    seqlens[::7] = 0
    seqlens[3::11] = 1
    leftpad = np.minimum(rng.integers(0, 12, b), seqlens)
    leftpad[5::13] = seqlens[5::13]
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name=dtype_name, d=128, sq=1, group=4, quant=quant, b=b,
               s_cache=90, hkv=8, seqlens=tuple(int(x) for x in seqlens), leftpad=tuple(int(x) for x in leftpad),
               num_splits=splits)


@pytest.mark.parametrize("dtype_name", ["bf16", "f16"])
@pytest.mark.parametrize("quant, v_quant", [((4, 64), (4, 64)), ((4, 32), (4, 32)), ((4, 64), (4, 32)), ((4, 32), (4, 64)),
                                             ((8, 64), (8, 64)), ((8, 32), (8, 32))], ids=str)
@pytest.mark.parametrize("per_sm", [3.5, 6, 12, 20], ids=["3.5-an-sm", "6-an-sm", "12-an-sm", "20-an-sm"])
def test_the_one_wave_kernel(fa, ref, lib, gpu, assert_close_to_oracle, dtype_name, quant, v_quant, per_sm):
    """Quantized caches at D = 128 whose grid needs more than one wave of the chosen kernel (three
    4-bit blocks an SM, two 8-bit ones) but fits one of four blocks an SM (3.5 an SM), of eight (6)
    or of sixteen (12) take the four-, eight- or sixteen-block kernel (decode.rs) where it is
    compiled (four: 4-bit K and V sharing a group size, 8-bit groups of 64; eight and sixteen: groups
    of 64), the chosen one otherwise; past every one-wave kernel's wave (20 an SM), rows this short
    take the one of most blocks an SM in several waves (decode.rs short_rows_past_every_wave);
    ragged rows, empty ones too."""
    sms = gpu.get("multiprocessors")
    if not sms:
        pytest.skip("the GPU's multiprocessor count is unknown")
    b = int(per_sm * sms)
    seqlens = np.random.default_rng(11).integers(0, 64, b)
    seqlens[::9] = 0
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name=dtype_name, d=128, sq=1, group=4, quant=quant,
               v_quant=v_quant, b=b, s_cache=64, hkv=1, seqlens=tuple(int(x) for x in seqlens), leftpad=None)


@pytest.mark.parametrize("dtype_name", ["bf16", "f16"])
@pytest.mark.parametrize("quant, v_quant", [((4, 64), (4, 64)), ((4, 32), (4, 32)), ((4, 64), (4, 32)), ((8, 64), (8, 64)),
                                             ((8, 32), (8, 64))], ids=str)
@pytest.mark.parametrize("splits", [None, 1])
def test_the_wide_kernel(fa, ref, lib, gpu, assert_close_to_oracle, dtype_name, quant, v_quant, splits):
    """Quantized caches at D = 128 whose groups nearly fill the SMs at one block each (here one per
    SM) take one eight-warp block each, unsplit, on Hopper (decode.rs); the chosen kernel's splits
    elsewhere. Ragged rows, empty ones too, keys past a stage's."""
    sms = gpu.get("multiprocessors")
    if not sms:
        pytest.skip("the GPU's multiprocessor count is unknown")
    seqlens = np.random.default_rng(13).integers(0, 700, sms)
    seqlens[::9] = 0
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name=dtype_name, d=128, sq=1, group=4, quant=quant,
               v_quant=v_quant, b=sms, s_cache=700, hkv=1, seqlens=tuple(int(x) for x in seqlens), leftpad=None,
               num_splits=splits)


@pytest.mark.parametrize("dtype_name", ["bf16", "f16"])
@pytest.mark.parametrize("splits", [None, 2, 3])
def test_the_plain_kernel_past_a_wave(fa, ref, lib, gpu, assert_close_to_oracle, dtype_name, splits):
    """Plain caches at D = 128 whose grid is past one wave of the two-block kernel (3 blocks an SM
    here) take four two-warp blocks an SM on Hopper (decode.rs), also split in two (a cluster's
    merge) or three (the merge kernel); ragged rows, empty ones too."""
    sms = gpu.get("multiprocessors")
    if not sms:
        pytest.skip("the GPU's multiprocessor count is unknown")
    b = 3 * sms // (splits or 1)
    seqlens = np.random.default_rng(12).integers(0, 700, b)
    seqlens[::9] = 0
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name=dtype_name, d=128, sq=1, group=4, quant=None, b=b,
               s_cache=700, hkv=1, seqlens=tuple(int(x) for x in seqlens), leftpad=None, num_splits=splits)


@pytest.mark.parametrize("dtype_name", ["bf16", "f16"])
def test_plain_pairs_that_even_the_sms(fa, ref, lib, gpu, assert_close_to_oracle, dtype_name):
    """A plain grid of ~1.45 blocks an SM (uneven: some SMs run two, some one) takes two splits a
    group merged as a cluster, ~2.9 blocks an SM, on Hopper (decode.rs pairs_even_the_sms); ragged
    rows, empty ones too."""
    sms = gpu.get("multiprocessors")
    if not sms:
        pytest.skip("the GPU's multiprocessor count is unknown")
    b = sms * 145 // 100
    seqlens = np.random.default_rng(13).integers(0, 1100, b)
    seqlens[::7] = 0
    seqlens[1] = 1100
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name=dtype_name, d=128, sq=1, group=4, quant=None, b=b,
               s_cache=1100, hkv=1, seqlens=tuple(int(x) for x in seqlens), leftpad=None, num_splits=None)


def test_scales_ending_mid_word(fa, ref, lib, assert_close_to_oracle):
    """B * S * Hkv odd with one 16-bit scale per row: the last scale is the first half of a word past
    the tensor's end (read by a plain load, never past it)."""
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name="f16", d=64, sq=1, group=2, quant=(4, 64), b=1,
               s_cache=37, hkv=1, seqlens=None, leftpad=None)


@pytest.mark.parametrize("dtype_name", ["bf16", "f16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("quant, v_quant", [((4, 64), (4, 32)), ((4, 32), (4, 64)), ((8, 64), (8, 32))], ids=str)
def test_k_and_v_group_sizes_differ(fa, ref, lib, assert_close_to_oracle, dtype_name, d, quant, v_quant):
    """The k and v caches quantized in groups of different sizes (each kernel takes them apart)."""
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name=dtype_name, d=d, sq=2, group=4, quant=quant,
               v_quant=v_quant, seed=d)


@pytest.mark.parametrize("dtype_name", ["bf16", "f16"])
@pytest.mark.parametrize("quant", [(4, 64), (4, 32), (8, 64)], ids=str)
def test_large_offsets_against_small_scales(fa, ref, lib, assert_close_to_oracle, dtype_name, quant):
    """Cached values near +-30 with unit spread: biases ~250 scales in size. The quantized kernels keep
    the scale and bias terms apart until f32 (decode_q4.h, decode_q8.h), which must not lose them."""
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name=dtype_name, d=128, sq=1, group=4, quant=quant,
               offset=30.0, s_cache=1000, seqlens=(1000, 555, 1), leftpad=(0, 7, 0))


@pytest.mark.parametrize("dtype_name", ["bf16", "f16"])
@pytest.mark.parametrize("quant", [(8, 64), (8, 32), (4, 64)], ids=str)
@pytest.mark.parametrize("q_size, v_sizes", [(1e-3, "1e-4"), (10.0, "3e-5"), (30.0, "1e3"), (1.0, "1e-4..1e3")])
def test_sizes_far_from_one(fa, ref, lib, assert_close_to_oracle, dtype_name, quant, q_size, v_sizes):
    """Queries and values far from unit size, and values whose size changes by 10^7 from key to key
    within a row: the 8-bit kernel takes q into fp16 scaled per row (cuda/decode_q8.h), and the V
    products' weights P * scale, in fp16 for 8-bit caches and for fp16 queries over 4-bit ones,
    follow the largest weight (cuda/decode_weights.h): they must neither underflow nor overflow."""
    s_cache = 600
    if v_sizes == "1e-4..1e3":
        sizes = 10.0 ** np.random.default_rng(3).uniform(-4, 3, s_cache)
    else:
        sizes = float(v_sizes)
    run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name=dtype_name, d=128, sq=1, group=4, quant=quant,
               s_cache=s_cache, seqlens=(600, 333, 0), leftpad=(0, 5, 0), q_size=q_size, v_sizes=sizes, num_splits=2)


# q's factor per head (hkv 2, GQA 4): one warp's four states 10^6 apart, then 10^12 apart (bf16);
# within fp16's range, 10^3 and 10^6 apart (its largest |q| past 2^15).
HEADS_APART = np.array([1.0, 1e-6, 1e6, 1e-3, 1e3, 1e-12, 1.0, 1.0]).reshape(1, 1, 8, 1)
F16_HEADS_APART = np.array([1.0, 1e-3, 3e-2, 1e-3, 1e4, 1e-2, 1.0, 1.0]).reshape(1, 1, 8, 1)
QUERY_SIZES = {
    "bf16": [1e-30, 1e-12, 1e20, HEADS_APART],
    "f16": [1e-4, 1e-2, 1e4, F16_HEADS_APART],
}


@pytest.mark.parametrize("quant", [(4, 64), (4, 32), ((4, 64), (4, 32))], ids=str)
@pytest.mark.parametrize("dtype_name, q_size", [(dt, size) for dt, sizes in QUERY_SIZES.items() for size in sizes],
                         ids=[f"{dt}-{size if np.isscalar(size) else 'heads-apart'}" for dt, sizes in QUERY_SIZES.items() for size in sizes])
def test_queries_of_any_size_over_4_bit_keys(fa, ref, lib, assert_close_to_oracle, quant, dtype_name, q_size):
    """On Hopper the 4-bit kernels under bf16 q take K's codes as bf16 subnormals and q scaled by a
    power of two chosen per warp from its largest |q| (cuda/decode_q4.h, Q4_SUBNORMAL_K); fp16 q
    keeps the magic codes. Tiny and huge queries, and states of one warp far apart in size, must keep
    their scores either way (and with K and V in different group sizes)."""
    k_quant, v_quant = quant if isinstance(quant[0], tuple) else (quant, "same")
    for num_splits in (None, 2):
        run_decode(fa, ref, lib, assert_close_to_oracle, dtype_name=dtype_name, d=128, sq=1, group=4, quant=k_quant,
                   v_quant=v_quant, s_cache=500, seqlens=(500, 77, 0), leftpad=(0, 3, 0), q_size=q_size,
                   num_splits=num_splits)


@pytest.mark.parametrize("where", GPU_LIBS)
@pytest.mark.parametrize("quant", [None, (4, 64)], ids=str)
def test_every_array_library(fa, ref, env, assert_close_to_oracle, where, quant):
    """CuPy, torch, NumPy with device="cuda": outputs come back as the input's kind."""
    o, _ = run_decode(fa, ref, env, assert_close_to_oracle, dtype_name="bf16", d=128, sq=2, group=4, quant=quant)
    assert isinstance(o, np.ndarray)


def test_outputs_are_the_inputs_kind(fa, lib):
    q, k = rand(0, (1, 1, 4, 64), np.float32), rand(1, (1, 8, 2, 64), np.float32)
    o, lse = fa.decode(lib.put(q), lib.put(k), lib.put(k), **lib.kw)
    kind = {"torch": "torch", "cupy": "cupy", "numpy-cuda": "numpy"}[lib.where]
    assert type(o).__module__.split(".")[0] == kind and type(lse).__module__.split(".")[0] == kind


@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="torch without CUDA")
def test_runs_on_the_callers_torch_stream(fa, ref, gpu, assert_close_to_oracle):
    """Queued on torch's current stream: a side stream's inputs, made there, are read after they are."""
    q = rand(3, (2, 1, 8, 128), ml_dtypes.bfloat16)
    k, v = rand(4, (2, 64, 2, 128), ml_dtypes.bfloat16), rand(5, (2, 64, 2, 128), ml_dtypes.bfloat16)
    env = Env("torch")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        gq, gk, gv = (env.put(x) for x in (q, k, v))
        o, lse = fa.decode(gq * 1, gk * 1, gv * 1)
    s.synchronize()
    want = ref.decode(q, k, v)
    assert_close_to_oracle("o", env.get(o), want[0], ml_dtypes.bfloat16, "side stream")


@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="torch without CUDA")
@pytest.mark.parametrize("quant", [None, (4, 64), (8, 32)], ids=str)
def test_the_torch_fast_path_is_the_general_one(fa, gpu, monkeypatch, quant):
    """Contiguous torch tensors take kv._decode_torch (few Python steps); the general path
    (_Tensors) gives the same bits, row bounds and all, and takes what the fast one declines."""
    from flash_nif import kv

    env = Env("torch")
    q = env.put(rand(6, (3, 2, 8, 128), ml_dtypes.bfloat16))
    k, v = (put_cache(fa, env, rand(7 + i, (3, 96, 2, 128), ml_dtypes.bfloat16), quant) for i in range(2))
    seqlens = torch.tensor([96, 40, 0], dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([0, 5, 0], dtype=torch.int32, device="cuda")
    calls = []
    real = kv._decode_torch
    monkeypatch.setattr(kv, "_decode_torch", lambda *a: calls.append(1) or real(*a))
    fast = fa.decode(q, k, v, cache_seqlens=seqlens, leftpad_k=leftpad)
    assert calls  # it was taken
    monkeypatch.setattr(kv, "_decode_torch", lambda *a: None)
    general = fa.decode(q, k, v, cache_seqlens=seqlens, leftpad_k=leftpad)
    for a, b in zip(fast, general):
        assert torch.equal(a, b)
    # int64 bounds and a strided q: declined by the fast path, converted by the general one.
    monkeypatch.setattr(kv, "_decode_torch", real)
    q2 = torch.cat([q, q], dim=-1)[..., :128]
    o2, lse2 = fa.decode(q2, k, v, cache_seqlens=seqlens.long(), leftpad_k=leftpad)
    assert torch.equal(o2, general[0]) and torch.equal(lse2, general[1])


@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="torch without CUDA")
@pytest.mark.parametrize("quant", [None, (4, 64), (8, 32)], ids=str)
@pytest.mark.parametrize("s_cache", [64, 4096])
def test_back_to_back_and_in_a_cuda_graph(fa, gpu, quant, s_cache):
    """Decode starts while the stream's previous kernel finishes (launched dependent) and must still
    read what that kernel wrote: a decode whose q is the previous decode's o, and a captured loop
    (write q and a cache row, decode) replayed with new inputs, give the bits of synchronised calls.
    4096 keys split (the merge kernel, or a plain cache's cluster on Hopper); 64 do not."""
    env = Env("torch")
    q0 = env.put(rand(21, (2, 1, 32, 128), ml_dtypes.bfloat16))
    k, v = (put_cache(fa, env, rand(22 + i, (2, s_cache, 8, 128), ml_dtypes.bfloat16), quant) for i in range(2))
    o1, _ = fa.decode(q0, k, v)
    o2, lse2 = fa.decode(o1, k, v)  # reads o1 right behind the kernels that write it
    torch.cuda.synchronize()
    want = fa.decode(o1.clone(), k, v)
    torch.cuda.synchronize()
    assert torch.equal(o2, want[0]) and torch.equal(lse2, want[1])

    # A captured step: q written by a copy kernel, then decode, then its output copied out.
    q_in, out = torch.empty_like(q0), torch.empty_like(q0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fa.decode(q_in.copy_(q0), k, v)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    src = torch.empty_like(q0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_in.copy_(src)
        o, lse = fa.decode(q_in, k, v)
        out.copy_(o)
    for seed in (31, 32, 33):
        src.copy_(env.put(rand(seed, (2, 1, 32, 128), ml_dtypes.bfloat16)))
        graph.replay()
        torch.cuda.synchronize()
        want = fa.decode(src.clone(), k, v)
        torch.cuda.synchronize()
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@pytest.mark.skipif(not HAVE_TORCH_GPU, reason="torch without CUDA")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("words", [1, 2, 3])
def test_codes_off_the_copy_engines_alignment(fa, gpu, bits, words):
    """Codes that start 4, 8 or 12 bytes past a 16-byte boundary (a view into a larger buffer): the
    Hopper kernels' tensor maps start at the boundary below (cuda/decode.rs codes_map) and must read
    the same bits as from an aligned copy, with nothing read before the codes or past them."""
    env = Env("torch")
    q = env.put(rand(11, (2, 1, 32, 128), ml_dtypes.bfloat16))
    k, v = (put_cache(fa, env, rand(12 + i, (2, 300, 8, 128), ml_dtypes.bfloat16), (bits, 64)) for i in range(2))

    def shifted(c):
        buf = torch.zeros(c.values.numel() + words, dtype=torch.int32, device="cuda")
        codes = buf[words:].view(c.values.shape)
        codes.copy_(c.values.view(torch.int32))
        assert codes.data_ptr() % 16 == 4 * words
        return fa.QuantizedKV(codes.view(c.values.dtype), c.scales, c.biases, c.bits, c.group_size)

    seqlens = torch.tensor([300, 123], dtype=torch.int32, device="cuda")
    aligned = fa.decode(q, k, v, cache_seqlens=seqlens)
    off = fa.decode(q, shifted(k), shifted(v), cache_seqlens=seqlens)
    for a, b in zip(aligned, off):
        assert torch.equal(a, b)


# --- the cache format and merge_states on the GPU ---------------------------------------------------

@pytest.mark.parametrize("where", GPU_LIBS)
@pytest.mark.parametrize("dtype_name", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 64), (8, 32), (8, 64)])
def test_quantize_and_dequantize_are_the_cpus_bit_for_bit(fa, env, where, dtype_name, bits, group_size):
    dtype = DTYPES[dtype_name]
    x = rand(bits + group_size, (2, 37, 3, 128), dtype, scale=2.0)
    x[0, 0, 0, :group_size] = 1.5  # a constant group: scale 0, codes 0
    want = fa.quantize_kv(x, bits=bits, group_size=group_size)
    got = put_cache(fa, env, x, (bits, group_size))
    assert (got.bits, got.group_size, tuple(got.shape)) == (bits, group_size, x.shape)
    np.testing.assert_array_equal(env.get(got.values), want.values)
    for a, b in ((got.scales, want.scales), (got.biases, want.biases)):
        np.testing.assert_array_equal(env.get(a).view(np.uint8), b.view(np.uint8))
    back = env.get(fa.dequantize_kv(got, **env.kw))
    np.testing.assert_array_equal(back.view(np.uint8), fa.dequantize_kv(want).view(np.uint8))
    # Within half a quantization step of x, up to the dtype's roundings: of the stored scale and
    # bias (which move every code by up to u (|bias| + levels * step)) and of the result.
    u = {"f32": 2.0**-24, "f16": 2.0**-11, "bf16": 2.0**-8}[dtype_name]
    step = want.scales.astype(np.float64).repeat(group_size, -1)
    bias = np.abs(want.biases.astype(np.float64)).repeat(group_size, -1)
    back = back.astype(np.float64)
    err = np.abs(back - x.astype(np.float64))
    assert np.all(err <= 0.5 * step * (1 + 1e-5) + 2 * u * (bias + (2**bits - 1) * step) + u * np.abs(back) + 1e-7)


@pytest.mark.parametrize("where", GPU_LIBS)
@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
def test_merge_states_is_the_cpus(fa, env, where, dtype_name):
    """Three parts, some rows seen by no part (o = 0, lse = -inf) or by one; stacked and as a list."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(7)
    o_parts = rng.standard_normal((3, 2, 5, 4, 72)).astype(dtype)
    lse_parts = rng.standard_normal((3, 2, 4, 5)).astype(np.float32) * 3
    lse_parts[:, 0, 1, 2] = -np.inf
    lse_parts[1:, 1, 3, :] = -np.inf
    o_parts[1:, 1, :, 3] = np.nan  # parts with lse = -inf are never read
    want_o, want_lse = fa.merge_states(o_parts, lse_parts)
    stacked, listed = (env.put(o_parts), env.put(lse_parts)), ([env.put(x) for x in o_parts], [env.put(x) for x in lse_parts])
    for parts in (stacked, listed):
        o, lse = fa.merge_states(*parts, **env.kw)
        o, lse = env.get(o), env.get(lse)
        assert o.dtype == dtype and not np.isnan(o.astype(np.float32)).any()
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=2**-7, atol=1e-3)  # one bf16 ulp
        np.testing.assert_allclose(o.astype(np.float32), want_o.astype(np.float32), **tol)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
        assert np.isneginf(lse[0, 1, 2]) and np.all(o[0, 2, 1].astype(np.float32) == 0)


# --- errors -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", GPU_LIBS)
def test_bad_calls_are_errors(fa, env, where):
    q = env.put(rand(0, (1, 1, 4, 64), np.float32))
    k = rand(1, (1, 8, 2, 64), np.float32)
    gk = env.put(k)
    kw = env.kw
    with pytest.raises(fa.ShapeError, match="cache_seqlens"):
        fa.decode(q, gk, gk, cache_seqlens=env.put(np.array([9], np.int32)), **kw)
    with pytest.raises(fa.ShapeError, match="leftpad_k"):
        fa.decode(q, gk, gk, cache_seqlens=env.put(np.array([4], np.int32)), leftpad_k=env.put(np.array([5], np.int32)),
                  **kw)
    with pytest.raises(fa.ShapeError, match="1 to 16"):
        fa.decode(env.put(rand(0, (1, 17, 4, 64), np.float32)), gk, gk, **kw)
    with pytest.raises(fa.DTypeError, match="must match"):
        fa.decode(env.put(rand(0, (1, 1, 4, 64), np.float16)), gk, gk, **kw)
    with pytest.raises(fa.ShapeError, match="multiple of Hkv"):
        fa.decode(env.put(rand(0, (1, 1, 3, 64), np.float32)), gk, gk, **kw)
    with pytest.raises(fa.UnsupportedError, match="num_splits"):
        fa.decode(q, gk, gk, num_splits=0, **kw)
    c8, c4 = put_cache(fa, env, k, (8, 32)), put_cache(fa, env, k, (4, 32))
    with pytest.raises(fa.UnsupportedError, match="same bits"):
        fa.decode(q, c8, c4, **kw)
    with pytest.raises(fa.UnsupportedError, match="same bits"):
        fa.decode(q, gk, c4, **kw)
    with pytest.raises(fa.UnsupportedError, match="group_size"):
        put_cache(fa, env, k, (4, 48))
    if where != "numpy-cuda":
        with pytest.raises(fa.DeviceError):
            fa.decode(q, k, k)  # a GPU q with NumPy caches
        with pytest.raises(fa.DeviceError):
            fa.decode(q, gk, gk, device="cpu")
        with pytest.raises(fa.DeviceError):
            fa.quantize_kv(gk, device="cpu")
