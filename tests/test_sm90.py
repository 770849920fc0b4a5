"""The Hopper forward (cuda/fwd_sm90.cu) against the float64 oracle, and its dispatch (marked ``gpu``).

On a GPU of compute capability 9.0 the forward of fp16 / bf16 at D = 64, 128 and 256, with any mask
but varlen batches and any score modifier, runs the sm90 kernel; ``FLASH_NIF_SM90=0`` (read per call) forces the portable kernels;
anything the sm90 kernel does not take falls back to them and ``info()["cuda"]["last_kernels"]``
says which kernel ran and why. Outputs are poisoned with NaN before each run. On other GPUs the
accuracy cases still run (on the portable kernels) and the dispatch checks skip.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu import DTYPES, HAVE_TORCH_GPU, to_gpu, to_host

if HAVE_TORCH_GPU:
    import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu(fa):
    info = fa.info().get("cuda", {})
    if not info.get("available"):
        pytest.skip(f"no usable CUDA GPU: {info.get('reason')}")
    if not HAVE_TORCH_GPU:
        pytest.skip("needs torch with CUDA (poisoned outputs)")
    return fa


def last_forward(fa) -> dict:
    return fa.info()["cuda"]["last_kernels"]["forward"]


def forward_poisoned(fa, q, k, v, causal):
    """(o, lse) from the native entry point, on outputs filled with NaN first."""
    b, sq, h, _ = q.shape
    o = torch.full((*q.shape[:-1], v.shape[-1]), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device="cuda")
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[q.dtype]
    desc = [(x.data_ptr(), list(x.shape), name) for x in (q, k, v)]
    stream = torch.cuda.current_stream().cuda_stream
    fa._native.cuda_forward_device(desc, [o.data_ptr(), lse.data_ptr()], 0, stream, causal=causal)
    torch.cuda.synchronize()
    return o, lse


# (B, Sq, Sk, H, Hkv, D): ragged tiles, GQA / MQA, decode, Sq > Sk (causal rows that see
# nothing), several key tiles, more tiles than blocks, each head dim.
SHAPES = [
    pytest.param((2, 300, 300, 4, 2, 64), id="s300-gqa-d64"),
    pytest.param((1, 129, 257, 3, 3, 64), id="sq129<sk257-d64"),
    pytest.param((1, 1, 1000, 4, 1, 128), id="decode-mqa-d128"),
    pytest.param((1, 513, 200, 2, 2, 128), id="sq513>sk200-d128"),
    pytest.param((2, 1024, 1024, 2, 1, 128), id="s1024-gqa-d128"),
    # 192 tiles of 128 rows: more than an H100's 132 blocks, so persistent blocks take several.
    pytest.param((2, 1024, 1024, 12, 4, 128), id="persistent-s1024-gqa-d128"),
    pytest.param((1, 200, 513, 2, 1, 256), id="sq200<sk513-d256"),
    pytest.param((1, 384, 384, 2, 2, 256), id="s384-d256"),
]


@pytest.mark.parametrize("dtype_name", ["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_against_oracle(gpu, ref, make_inputs, assert_close_to_oracle, record_error, shape, dtype_name, causal):
    b, sq, sk, h, hkv, d = shape
    dtype = DTYPES[dtype_name]
    q, k, v, _ = make_inputs(3, b, sq, sk, h, hkv, d, dtype)
    o, lse = forward_poisoned(gpu, *(to_gpu("torch", x) for x in (q, k, v)), causal)
    ro, rlse = ref.forward_with_states(q, k, v, causal=causal)
    ctx = f"shape={shape} causal={causal} kernel={last_forward(gpu)['kernel']}"
    record_error(dtype_name, "o", assert_close_to_oracle("o", to_host(o), ro, dtype, ctx))
    record_error(dtype_name, "lse", assert_close_to_oracle("lse", to_host(lse), rlse, np.float32, ctx))
    if causal and sq > sk:  # rows that see no key: o = 0, lse = -inf
        assert np.isneginf(to_host(lse)[:, :, : sq - sk]).all()
        assert (to_host(o)[:, : sq - sk].astype(np.float32) == 0).all()


@pytest.fixture
def hopper(gpu):
    if not gpu.info()["cuda"].get("sm90"):
        pytest.skip("the sm90 kernels run on compute capability 9.0 only (and not with FLASH_NIF_SM90=0)")
    return gpu


def test_hopper_kernel_runs_and_the_env_switches_it_off(hopper, make_inputs, monkeypatch):
    q, k, v = (to_gpu("torch", x) for x in make_inputs(0, 1, 256, 256, 2, 2, 128, DTYPES["bf16"])[:3])
    o1, lse1 = forward_poisoned(hopper, q, k, v, True)
    ran = last_forward(hopper)
    assert ran["kernel"].startswith("fwd_sm90_bf16_d128"), ran
    assert ran["not_sm90_because"] is None
    monkeypatch.setenv("FLASH_NIF_SM90", "0")
    assert not hopper.info()["cuda"]["sm90"]
    o2, lse2 = forward_poisoned(hopper, q, k, v, True)
    ran = last_forward(hopper)
    assert ran["kernel"].startswith("fwd_bf16_d128"), ran
    assert "FLASH_NIF_SM90=0" in ran["not_sm90_because"]
    # Two exact kernels: the same function up to rounding.
    assert torch.allclose(o1.float(), o2.float(), atol=2e-2, rtol=0)
    assert torch.allclose(lse1, lse2, atol=1e-4, rtol=0)


def test_what_it_cannot_take_falls_back_and_says_why(hopper, make_inputs):
    # float32 "exact" takes the Hopper kernel from 16 keys on (config.rs's MIN_SPLIT_TF32_KEYS).
    for what, s, d, dtype_name, why in (("varlen", 64, 128, "bf16", "varlen"), ("D = 96", 64, 96, "bf16", "head dim 96"),
                                        ("float32, 8 keys", 8, 128, "f32", "16 keys")):
        q, k, v = (to_gpu("torch", x) for x in make_inputs(0, 1, s, s, 2, 2, d, DTYPES[dtype_name])[:3])
        if what == "varlen":
            cu = torch.tensor([0, 20, 64], dtype=torch.int32, device="cuda")
            o, _ = hopper.varlen.forward_with_states(q[0], k[0], v[0], cu, cu, causal=True)
        else:
            o, _ = hopper.forward_with_states(q, k, v)
        assert not torch.isnan(o).any()
        ran = last_forward(hopper)
        assert not ran["kernel"].startswith("fwd_sm90"), (what, ran)
        assert why in ran["not_sm90_because"], (what, ran)


# Masks (test_masks.py's cases at the sm90 head dims) and score modifiers, through NumPy arrays
# with device="cuda". On compute capability 9.0 they run the sm90 kernel's MASKED variants.
MASK_CASES = ["window", "segments-sq-ne-sk", "seqused-leftpad", "block", "all-causal-gqa", "all-noncausal",
              "sees-nothing", "s1000-window"]


def check_host_call(fa, ref, assert_close_to_oracle, record_error, q, k, v, causal, ctx, **opts):
    o, lse = fa.forward_with_states(q, k, v, causal=causal, device="cuda", **opts)
    ro, rlse = ref.forward_with_states(q, k, v, causal=causal, **opts)
    ran = last_forward(fa)
    if fa.info()["cuda"].get("sm90"):
        assert ran["kernel"].startswith("fwd_sm90"), ran
    ctx = f"{ctx} kernel={ran['kernel']}"
    record_error("bf16", "o", assert_close_to_oracle("o", o, ro, DTYPES["bf16"], ctx))
    record_error("bf16", "lse", assert_close_to_oracle("lse", lse, rlse, np.float32, ctx))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", MASK_CASES)
def test_masks_against_oracle(gpu, ref, make_inputs, assert_close_to_oracle, record_error, case, d):
    from test_masks import CASES

    (b, sq, sk, h, hkv, _), causal, build = CASES[case]
    masks = build(np.random.default_rng(5))
    q, k, v, _ = make_inputs(5, b, sq, sk, h, hkv, d, DTYPES["bf16"])
    check_host_call(gpu, ref, assert_close_to_oracle, record_error, q, k, v, causal, f"case={case} d={d}", **masks)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mods", ["softcap", "alibi", "sinks", "all-causal-window"])
def test_modifiers_against_oracle(gpu, ref, make_inputs, assert_close_to_oracle, record_error, mods, d):
    b, sq, sk, h, hkv = 2, 300, 400, 4, 2
    rng = np.random.default_rng(6)
    q, k, v, _ = make_inputs(6, b, sq, sk, h, hkv, d, DTYPES["bf16"])
    slopes = (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)
    sinks = rng.normal(size=h).astype(np.float32)
    opts = {"softcap": dict(softcap=2.0), "alibi": dict(alibi_slopes=slopes), "sinks": dict(sinks=sinks),
            "all-causal-window": dict(softcap=2.0, alibi_slopes=slopes, sinks=sinks, window=(64, 0))}[mods]
    causal = mods.startswith("all-causal")
    check_host_call(gpu, ref, assert_close_to_oracle, record_error, q, k, v, causal, f"mods={mods} d={d}", **opts)
