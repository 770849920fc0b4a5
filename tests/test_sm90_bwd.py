"""The Hopper backward (cuda/bwd_sm90.cu) against the float64 oracle, its deterministic mode and its
dispatch (marked ``gpu``).

On a GPU of compute capability 9.0 the backward of fp16 / bf16 at D = 64 and 128 runs the sm90
kernel (float32's Hopper backward is tests/test_tf32.py's); with masks (but varlen batches) and
score modifiers at D = 64 only, deterministic without masks only; ``FLASH_NIF_SM90=0`` forces the
portable kernels; ``info()["cuda"]["last_kernels"]["backward"]`` says which kernel ran and why. On
other GPUs the accuracy cases still run (on the portable kernels) and the dispatch checks skip.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu import DTYPES, HAVE_TORCH_GPU, to_gpu, to_host
from test_sm90 import gpu, hopper  # noqa: F401 (fixtures: a usable GPU; one of compute capability 9.0)

if HAVE_TORCH_GPU:
    import torch

pytestmark = pytest.mark.gpu


def last_backward(fa) -> dict:
    return fa.info()["cuda"]["last_kernels"]["backward"]


def grads(fa, q, k, v, do, causal, deterministic=False, **opts):
    o, lse = fa.forward_with_states(q, k, v, causal=causal, **opts)
    return (o, lse), fa.backward(do, q, k, v, o, lse, causal=causal, deterministic=deterministic, **opts)


def check(fa, ref, make_inputs, assert_close_to_oracle, record_error, shape, dtype_name, causal, deterministic=False,
          seed=0, **opts):
    b, sq, sk, h, hkv, d = shape
    dtype = DTYPES[dtype_name]
    host = make_inputs(seed, b, sq, sk, h, hkv, d, dtype)
    (o, lse), got = grads(fa, *(to_gpu("torch", x) for x in host), causal, deterministic, **opts)
    ran = last_backward(fa)
    if fa.info()["cuda"].get("sm90"):
        assert ran["kernel"].startswith("bwd_sm90"), ran
    q, k, v, do = host
    want = ref.backward(do, q, k, v, to_host(o), to_host(lse), causal=causal, **opts)
    ctx = f"shape={shape} causal={causal} deterministic={deterministic} opts={sorted(opts)} kernel={ran['kernel']}"
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        record_error(dtype_name, name, assert_close_to_oracle(name, to_host(g), w, dtype, ctx))
    return got


# (B, Sq, Sk, H, Hkv, D): ragged tiles, GQA / MQA, Sq > Sk (causal rows that see nothing), Sq < Sk,
# several key blocks and query tiles, each head dim.
SHAPES = [
    pytest.param((2, 300, 300, 4, 2, 64), id="s300-gqa-d64"),
    pytest.param((1, 129, 257, 3, 3, 64), id="sq129<sk257-d64"),
    pytest.param((1, 513, 200, 2, 2, 128), id="sq513>sk200-d128"),
    pytest.param((2, 1024, 1024, 4, 1, 128), id="s1024-mqa-d128"),
    pytest.param((1, 1, 1000, 4, 1, 128), id="decode-mqa-d128"),
    pytest.param((1, 70, 90, 2, 2, 64), id="s70-d64"),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype_name", ["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_against_oracle(gpu, ref, make_inputs, assert_close_to_oracle, record_error, shape, dtype_name, causal,
                        deterministic):
    check(gpu, ref, make_inputs, assert_close_to_oracle, record_error, shape, dtype_name, causal, deterministic)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_is_bit_identical_run_to_run(hopper, make_inputs, d, causal):
    host = make_inputs(1, 2, 777, 777, 8, 2, d, DTYPES["bf16"])
    q, k, v, do = (to_gpu("torch", x) for x in host)
    o, lse = hopper.forward_with_states(q, k, v, causal=causal)
    first = hopper.backward(do, q, k, v, o, lse, causal=causal, deterministic=True)
    assert last_backward(hopper)["kernel"].startswith("bwd_sm90"), last_backward(hopper)
    for _ in range(4):
        again = hopper.backward(do, q, k, v, o, lse, causal=causal, deterministic=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def test_env_switches_it_off_and_the_portable_path_agrees(hopper, make_inputs, monkeypatch):
    host = make_inputs(2, 1, 256, 256, 2, 2, 128, DTYPES["bf16"])
    q, k, v, do = (to_gpu("torch", x) for x in host)
    _, g1 = grads(hopper, q, k, v, do, True)
    assert last_backward(hopper)["kernel"].startswith("bwd_sm90_bf16_d128")
    assert last_backward(hopper)["not_sm90_because"] is None
    monkeypatch.setenv("FLASH_NIF_SM90", "0")
    _, g2 = grads(hopper, q, k, v, do, True)
    ran = last_backward(hopper)
    assert not ran["kernel"].startswith("bwd_sm90") and "FLASH_NIF_SM90=0" in ran["not_sm90_because"], ran
    for a, b in zip(g1, g2):
        assert torch.allclose(a.float(), b.float(), atol=3e-2, rtol=0)


def test_what_it_cannot_take_falls_back_and_says_why(hopper, make_inputs):
    # float32 has its own Hopper backward at D = 64 and 128 (tests/test_tf32.py).
    cases = (("D = 256", 256, {}, False, "head dim 256"),
             ("float32", 256, {}, False, "head dim 256 is not one of [64, 128]"),
             ("float32 window", 64, {"window": (16, 0)}, False, "float32 with masks"),
             ("window at D = 128", 128, {"window": (16, 0)}, False, "masks at head dim 128"),
             ("deterministic window", 64, {"window": (16, 0)}, True, "deterministic with masks"))
    for what, d, opts, deterministic, why in cases:
        dtype = DTYPES["f32" if what.startswith("float32") else "bf16"]
        q, k, v, do = (to_gpu("torch", x) for x in make_inputs(0, 1, 64, 64, 2, 2, d, dtype))
        _, g = grads(hopper, q, k, v, do, False, deterministic, **opts)
        assert not any(torch.isnan(x).any() for x in g)
        ran = last_backward(hopper)
        assert not ran["kernel"].startswith("bwd_sm90"), (what, ran)
        assert why in ran["not_sm90_because"], (what, ran)


# Masks (test_masks.py's cases) and score modifiers at the sm90 head dims, through NumPy arrays with
# device="cuda": at D = 64 the sm90 kernel's MASKED variants (which compile the modifiers in), at
# D = 128 the portable kernels.
MASK_CASES = ["window", "segments-sq-ne-sk", "seqused-leftpad", "block", "all-causal-gqa", "sees-nothing"]


def check_host(fa, ref, assert_close_to_oracle, record_error, q, k, v, do, causal, ctx, **opts):
    o, lse = fa.forward_with_states(q, k, v, causal=causal, device="cuda", **opts)
    got = fa.backward(do, q, k, v, o, lse, causal=causal, device="cuda", **opts)
    ran = last_backward(fa)
    if fa.info()["cuda"].get("sm90"):
        assert ran["kernel"].startswith("bwd_sm90") == (q.shape[-1] == 64), ran
    want = ref.backward(do, q, k, v, o, lse, causal=causal, **opts)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        record_error("bf16", name, assert_close_to_oracle(name, g, w, DTYPES["bf16"], f"{ctx} kernel={ran['kernel']}"))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", MASK_CASES)
def test_masks_against_oracle(gpu, ref, make_inputs, assert_close_to_oracle, record_error, case, d):
    from test_masks import CASES

    (b, sq, sk, h, hkv, _), causal, build = CASES[case]
    masks = build(np.random.default_rng(5))
    q, k, v, do = make_inputs(5, b, sq, sk, h, hkv, d, DTYPES["bf16"])
    check_host(gpu, ref, assert_close_to_oracle, record_error, q, k, v, do, causal, f"case={case} d={d}", **masks)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mods", ["softcap", "alibi", "sinks", "all-causal-window"])
def test_modifiers_against_oracle(gpu, ref, make_inputs, assert_close_to_oracle, record_error, mods, d):
    b, sq, sk, h, hkv = 2, 300, 400, 4, 2
    rng = np.random.default_rng(6)
    q, k, v, do = make_inputs(6, b, sq, sk, h, hkv, d, DTYPES["bf16"])
    slopes = (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)
    sinks = rng.normal(size=h).astype(np.float32)
    opts = {"softcap": dict(softcap=2.0), "alibi": dict(alibi_slopes=slopes), "sinks": dict(sinks=sinks),
            "all-causal-window": dict(softcap=2.0, alibi_slopes=slopes, sinks=sinks, window=(64, 0))}[mods]
    causal = mods.startswith("all-causal")
    check_host(gpu, ref, assert_close_to_oracle, record_error, q, k, v, do, causal, f"mods={mods} d={d}", **opts)
