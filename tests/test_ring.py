"""flash_nif.torch.ring_attention: exact attention over a sequence sharded across ranks.

Ranks are real processes (``flash_nif.spawn``: torch.multiprocessing, gloo on the CPU, NCCL on
GPUs), each holding its shard; the gathered output and gradients are checked against the float64
oracle with conftest's tolerances (float32 1e-5; float16 / bfloat16 at most twice the oracle's own
rounding error, + 1e-5), and float32 also against the single-device ``flash_nif.torch.attention``
on the whole sequence (1e-5). The backward oracle is given the ring's own o (delta = rowsum(dO*O)
depends on the stored o, as in test_torch.py).

One spawn per world size runs every case of that size (a spawn costs seconds: each rank imports
torch). Skipped as a whole without PyTorch or gloo; the GPU tests (marked ``gpu``) need 2 or 4
GPUs and run with NCCL.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: ring attention is untested here")
dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import ml_dtypes  # noqa: E402

from test_gpu import gpu  # noqa: E402,F401 (fixture: a usable GPU)

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
NP_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
SPAWN_TIMEOUT = 240  # seconds: the ranks are killed past it (the suite never hangs)


# (B, S, H, Hkv, D, Dv, dtype, causal, layout, scale): S is the whole sequence. Local lengths and
# chunks that do not divide the kernels' tiles (S = 100: chunks of 25), GQA, MQA, Dv != D.
CASES_2 = {
    "f32-causal-zigzag-gqa": (2, 100, 4, 2, 16, 16, "f32", True, "zigzag", None),
    "f32-causal-contiguous-gqa": (1, 64, 4, 2, 32, 32, "f32", True, "contiguous", None),
    "f32-full-zigzag-mqa-dv": (1, 60, 4, 1, 24, 8, "f32", False, "zigzag", 0.3),
    "f32-full-contiguous": (2, 38, 2, 2, 16, 16, "f32", False, "contiguous", None),
    "bf16-causal-zigzag-gqa": (1, 128, 4, 2, 32, 32, "bf16", True, "zigzag", None),
    "bf16-full-contiguous-gqa": (1, 96, 4, 2, 32, 32, "bf16", False, "contiguous", None),
    "f16-causal-contiguous": (1, 64, 2, 2, 16, 16, "f16", True, "contiguous", None),
}
CASES_4 = {
    "f32-causal-zigzag-gqa": (1, 104, 4, 2, 16, 16, "f32", True, "zigzag", None),
    "f32-causal-contiguous": (1, 64, 2, 1, 16, 16, "f32", True, "contiguous", None),
    "bf16-full-zigzag-gqa": (1, 128, 4, 2, 32, 32, "bf16", False, "zigzag", None),
}


def _inputs(case, seed=0):
    """Full-sequence q, k, v, do (CPU, the case's dtype): every rank draws the same ones."""
    b, s, h, hkv, d, dv, dtype, *_ = case
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(TORCH_DTYPES[dtype])  # noqa: E731
    return mk(b, s, h, d), mk(b, s, hkv, d), mk(b, s, hkv, dv), mk(b, s, h, dv)


def _run_cases(rank, world, cases, device, group=None):
    """One rank of ``group``: each case's shard of (o, dq, dk, dv), on the CPU. Runs in a spawned
    process."""
    import flash_nif.torch as ft

    out = {}
    for name, case in cases.items():
        *_, causal, layout, scale = case
        q, k, v, do = (ft.shard_sequence(x, rank, world, layout=layout).to(device) for x in _inputs(case))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        o = ft.ring_attention(q, k, v, group=group, causal=causal, layout=layout, scale=scale, deterministic=True)
        o.backward(do)
        out[name] = tuple(x.detach().cpu() for x in (o, q.grad, k.grad, v.grad))
        if device != "cpu":  # the same run again: deterministic=True gives the same bits
            q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
            o2 = ft.ring_attention(q2, k2, v2, causal=causal, layout=layout, scale=scale, deterministic=True)
            o2.backward(do)
            again = tuple(x.detach().cpu() for x in (o2, q2.grad, k2.grad, v2.grad))
            out[name + "/again"] = again
    return out


def _run_gloo(rank, world):
    """4 ranks: CASES_2 on the group of global ranks 1 and 3 (a group that is not the default one,
    whose ranks are not their global ranks), then CASES_4 on all four. One spawn for both sizes."""
    pair = dist.new_group([1, 3])  # every rank takes part in creating it
    two = _run_cases([1, 3].index(rank), 2, CASES_2, "cpu", group=pair) if rank in (1, 3) else None
    dist.barrier()
    return two, _run_cases(rank, world, CASES_4, "cpu")


def _np(t):
    return t.detach().cpu().double().numpy()


def _rel(got, want) -> float:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    return float((got - want).norm() / want.norm())


def _check_case(ft, ref, assert_close_to_oracle, case, shards, device="cpu"):
    """The gathered ring results against the oracle, and (float32) the single-device attention."""
    b, s, h, hkv, d, dv, dtype, causal, layout, scale = case
    got = [ft.unshard_sequence([r[i] for r in shards], layout=layout) for i in range(4)]  # o, dq, dk, dv
    q, k, v, do = _inputs(case)
    for t, full in zip(got, (do, q, k, v)):
        assert t.shape == full.shape and t.dtype == full.dtype
    want_o, want_lse = ref.forward_with_states(_np(q), _np(k), _np(v), causal=causal, scale=scale)
    want = ref.backward(_np(do), _np(q), _np(k), _np(v), _np(got[0]), want_lse, causal=causal, scale=scale)
    assert_close_to_oracle("o", _np(got[0]), want_o, NP_DTYPES[dtype], context=f"layout={layout}")
    for name, g, w in zip(("dq", "dk", "dv"), got[1:], want):
        assert_close_to_oracle(name, _np(g), w, NP_DTYPES[dtype], context=f"layout={layout}")
    if dtype == "f32":  # and the single-device op on the gathered sequence
        q, k, v = (x.to(device).requires_grad_() for x in (q, k, v))
        o = ft.attention(q, k, v, causal=causal, scale=scale)
        single = (o, *torch.autograd.grad(o, (q, k, v), do.to(device)))
        for name, g, w in zip(("o", "dq", "dk", "dv"), got, single):
            assert _rel(g, w) <= 1e-5, f"{name}: {_rel(g, w):.3g} from the single-device result"


@pytest.fixture(scope="module")
def ft(fa):
    import flash_nif.torch

    return flash_nif.torch


@pytest.fixture(scope="module")
def spawn(fa):
    from flash_nif.spawn import spawn

    return spawn


@pytest.fixture(scope="module")
def gloo(spawn):
    return spawn(_run_gloo, 4, backend="gloo", timeout=SPAWN_TIMEOUT)


@pytest.mark.parametrize("name", list(CASES_2))
def test_two_ranks_gloo_match_single_device(ft, ref, assert_close_to_oracle, gloo, name):
    _check_case(ft, ref, assert_close_to_oracle, CASES_2[name], [gloo[r][0][name] for r in (1, 3)])


@pytest.mark.parametrize("name", list(CASES_4))
def test_four_ranks_gloo_match_single_device(ft, ref, assert_close_to_oracle, gloo, name):
    _check_case(ft, ref, assert_close_to_oracle, CASES_4[name], [r[1][name] for r in gloo])


# ---- no process group needed -------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_schedule_covers_each_visible_pair_once(ft, world, layout, causal):
    """The blocks the ring computes, mapped to global positions, cover every (query, key) pair
    that the mask shows exactly once, and no hidden pair."""
    from flash_nif.ring import _block

    s = 4 * world  # chunks of 2 (zigzag) or 4 (contiguous)
    pos = torch.arange(s)
    where = [ft.shard_sequence(pos, r, world, layout=layout, dim=0) for r in range(world)]
    n = s // world
    count = torch.zeros(s, s, dtype=torch.int64)
    for rank in range(world):
        for step in range(world):
            src = (rank - step) % world
            blk = _block(rank, src, n, causal, layout)
            if blk is None:
                continue
            qi, kj = where[rank][blk.q], where[src][blk.kv]
            seen = (kj[None, :] <= qi[:, None]) if blk.causal else torch.ones(len(qi), len(kj), dtype=torch.bool)
            count[qi[:, None], kj[None, :]] += seen.long()
    visible = (pos[None, :] <= pos[:, None]) if causal else torch.ones(s, s, dtype=torch.bool)
    assert torch.equal(count, visible.long())


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_and_unshard_round_trip(ft, layout, world):
    x = torch.randn(2, 24, 3, 5)
    shards = [ft.shard_sequence(x, r, world, layout=layout) for r in range(world)]
    assert all(t.shape == (2, 24 // world, 3, 5) for t in shards)
    assert torch.equal(ft.unshard_sequence(shards, layout=layout), x)
    if layout == "zigzag" and world == 2:  # chunks 0 and 3 on rank 0, 1 and 2 on rank 1
        assert torch.equal(shards[0], torch.cat([x[:, 0:6], x[:, 18:24]], 1))
        assert torch.equal(shards[1], x[:, 6:18])
    y = x.transpose(0, 1)  # another dim
    assert torch.equal(ft.unshard_sequence([ft.shard_sequence(y, r, world, layout=layout, dim=0)
                                            for r in range(world)], layout=layout, dim=0), y)


def test_bad_arguments_raise_clear_errors(ft, fa):
    x = torch.randn(1, 10, 2, 4)
    with pytest.raises(ValueError, match="4 equal chunks"):
        ft.shard_sequence(x, 0, 2)  # zigzag: 2 * world chunks
    with pytest.raises(ValueError, match="3 equal chunks"):
        ft.shard_sequence(x, 0, 3, layout="contiguous")
    with pytest.raises(ValueError, match="layout"):
        ft.shard_sequence(x, 0, 2, layout="striped")
    with pytest.raises(ValueError, match="rank"):
        ft.shard_sequence(x, 2, 2, layout="contiguous")
    with pytest.raises(ValueError, match="must match"):
        ft.unshard_sequence([x, x[:, :8]], layout="contiguous")
    with pytest.raises(ValueError, match="even"):
        ft.unshard_sequence([x[:, :5]] * 2)
    q, k = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="local sequence length"):
        ft.ring_attention(q, k[:, :6], k[:, :6])
    with pytest.raises(ValueError, match="even"):
        ft.ring_attention(q[:, :7], k[:, :7], k[:, :7])
    with pytest.raises(TypeError, match="one dtype"):
        ft.ring_attention(q, k.half(), k)
    with pytest.raises(ValueError, match="layout"):
        ft.ring_attention(q, k, k, layout="striped")
    with pytest.raises(TypeError):  # masks other than causal are not taken across shards
        ft.ring_attention(q, k, k, window=(4, 0))
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        ft.ring_attention(q, k, k)
    assert isinstance(fa.UnsupportedError("x"), ValueError)


def test_world_of_one_is_plain_attention(ft):
    """A group of one rank: the ring's one step is our attention, bit for bit."""
    from flash_nif.spawn import _free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(3)
        q, k, v, do = (torch.randn(2, 30, 4, 16, generator=g) for _ in range(4))
        k, v = k[:, :, :2], v[:, :, :2]
        results = []
        for fn in (ft.ring_attention, ft.attention):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            o = fn(qq, kk, vv, causal=True)
            results.append((o, *torch.autograd.grad(o, (qq, kk, vv), do)))
        for name, a, b in zip(("o", "dq", "dk", "dv"), *results):
            assert torch.equal(a, b), name
    finally:
        dist.destroy_process_group()


# ---- GPUs: NCCL, 2 and 4 ranks ---------------------------------------------------------------------


CASES_GPU = {
    "bf16-causal-zigzag-gqa": (1, 2048, 8, 2, 128, 128, "bf16", True, "zigzag", None),
    "bf16-causal-contiguous": (2, 1024, 4, 4, 64, 64, "bf16", True, "contiguous", None),
    "f16-full-zigzag": (1, 1024, 4, 2, 128, 128, "f16", False, "zigzag", None),
    "f32-causal-zigzag-gqa": (1, 1024, 4, 2, 64, 64, "f32", True, "zigzag", None),
    "f32-full-contiguous-dv": (1, 512, 4, 1, 96, 64, "f32", False, "contiguous", 0.1),
}


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_nccl_ranks_match_single_gpu(ft, ref, assert_close_to_oracle, spawn, gpu, world):
    if torch.cuda.device_count() < world or not dist.is_nccl_available():
        pytest.skip(f"needs {world} GPUs and NCCL (torch sees {torch.cuda.device_count()})")
    results = spawn(_run_cases, world, args=(CASES_GPU, "cuda"), backend="nccl", timeout=SPAWN_TIMEOUT)
    for name, case in CASES_GPU.items():
        _check_case(ft, ref, assert_close_to_oracle, case, [r[name] for r in results], device="cuda")
        for r in results:  # deterministic=True: the second run gives the same bits
            for a, b in zip(r[name], r[name + "/again"]):
                assert torch.equal(a, b), f"{name}: not bitwise reproducible"
