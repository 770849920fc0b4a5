"""Score modifiers (softcap, ALiBi, attention sinks) against the float64 oracle, forward and
backward (dsinks included), alone and with masks, GQA, Sq != Sk, varlen, every dtype, on every
device (test_masks.py's devices: the CPU, and marked ``gpu`` NumPy with device="cuda", torch, CuPy).
Tolerances are conftest's; dsinks (a sum over every row) is held to float32's bound in every dtype,
since it is accumulated in float32 from float32 statistics.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_masks import DEVICES, DTYPES, GPU_LIBS, documents, env, i32  # noqa: F401 - env is a fixture

SLOPES4 = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
SINKS4 = np.array([0.3, -1.0, 2.0, 0.0], np.float32)

# id -> ((B, Sq, Sk, H, Hkv, D), causal, modifiers, masks(rng))
CASES = {
    "softcap": ((2, 37, 53, 4, 2, 16), True, dict(softcap=1.5), lambda r: {}),
    "softcap-noncausal-sq>sk": ((1, 70, 33, 2, 1, 32), False, dict(softcap=0.7), lambda r: {}),
    "alibi": ((2, 45, 45, 4, 4, 16), False, dict(alibi_slopes=SLOPES4), lambda r: {}),
    "alibi-batch-padded": ((2, 25, 40, 4, 2, 16), True,
                           dict(alibi_slopes=np.stack([SLOPES4, SLOPES4[::-1]])),
                           lambda r: dict(seqused_k=i32(40, 30), leftpad_k=i32(5, 3))),
    "sinks": ((2, 30, 30, 4, 2, 16), True, dict(sinks=SINKS4), lambda r: {}),
    "sinks-empty-rows": ((1, 50, 20, 4, 1, 8), True, dict(sinks=SINKS4), lambda r: {}),  # rows 0-29 see no key
    "all-window-segments": ((2, 150, 270, 4, 2, 16), True, dict(softcap=2.0, alibi_slopes=SLOPES4, sinks=SINKS4),
                            lambda r: dict(window=(100, None),
                                           segment_ids=(documents(r, 2, 150, 3), documents(r, 2, 270, 3)))),
    "all-noncausal-d64": ((1, 97, 140, 4, 1, 64), False, dict(softcap=3.0, alibi_slopes=SLOPES4, sinks=SINKS4),
                          lambda r: dict(window=(30, 20))),
    # the GPU's modifier kernels take their own tiles at D = 128 and 256 (config.rs's masked_tiles)
    "all-d128": ((2, 150, 170, 4, 2, 128), True, dict(softcap=3.0, alibi_slopes=SLOPES4, sinks=SINKS4), lambda r: {}),
    "all-d256": ((1, 150, 170, 4, 2, 256), True, dict(softcap=3.0, alibi_slopes=SLOPES4, sinks=SINKS4), lambda r: {}),
}


def run_case(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, case, dtype_name, seed=0,
             deterministic=False, mode=None):
    shape, causal, mods, build = CASES[case]
    b, sq, sk, h, hkv, d = shape
    dtype = DTYPES[dtype_name]
    masks = build(np.random.default_rng(seed + 100))
    q, k, v, do = make_inputs(seed, b, sq, sk, h, hkv, d, dtype)
    q, k = ((2 * x.astype(np.float32)).astype(dtype) for x in (q, k))  # scores the cap bends
    gq, gk, gv, gdo = (env.put(x) for x in (q, k, v, do))
    gm, gmods = env.masks(masks), {n: env.put(x) if isinstance(x, np.ndarray) else x for n, x in mods.items()}
    ctx = f"case={case} where={env.where} mode={mode}"
    if mode is not None:
        gmods["mode"] = mode

    o, lse = fa.forward_with_states(gq, gk, gv, causal=causal, **gm, **gmods, **env.kw)
    ro, rlse = ref.forward_with_states(q, k, v, causal=causal, **masks, **mods)
    ho, hlse = env.get(o), env.get(lse)
    record_error(dtype_name, "o", assert_close_to_oracle("o", ho, ro, dtype, ctx))
    record_error(dtype_name, "lse", assert_close_to_oracle("lse", hlse, rlse, np.float32, ctx))

    grads = fa.backward(gdo, gq, gk, gv, o, lse, causal=causal, deterministic=deterministic, **gm, **gmods, **env.kw)
    want = ref.backward(do, q, k, v, ho, hlse, causal=causal, **masks, **mods)
    assert len(grads) == len(want) == (4 if "sinks" in mods else 3)
    hgrads = [env.get(g) for g in grads]
    for name, got, w in zip(("dq", "dk", "dv"), hgrads, want):
        record_error(dtype_name, name, assert_close_to_oracle(name, got, w, dtype, ctx))
    if "sinks" in mods:
        assert hgrads[3].dtype == np.float32 and hgrads[3].shape == (h,)
        record_error(dtype_name, "dsinks", assert_close_to_oracle("dsinks", hgrads[3], want[3], np.float32, ctx))
    return ho, hlse, hgrads


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_modifiers_f32(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, where, case):
    run_case(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, case, "f32")


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("dtype_name", ["f16", "bf16"])
@pytest.mark.parametrize("case", ["softcap", "alibi-batch-padded", "sinks-empty-rows", "all-window-segments",
                                  "all-noncausal-d64", "all-d128", "all-d256"])
def test_modifiers_low_precision(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, where, case,
                                 dtype_name):
    run_case(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, case, dtype_name, seed=1)


@pytest.mark.parametrize("where", DEVICES[:1])
@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_modifiers_materialized_cpu(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, where, case,
                                    dtype_name):
    """The CPU's materialized path takes the modifiers too, to the same bounds, and agrees with the
    fused path."""
    got = run_case(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, case, dtype_name, mode="materialized")
    fused = run_case(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, case, dtype_name, mode="fused")
    for a, b in zip((got[0], got[1], *got[2]), (fused[0], fused[1], *fused[2])):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("where", GPU_LIBS)
@pytest.mark.parametrize("case", ["softcap", "all-window-segments", "all-d128", "all-d256"])
def test_deterministic_backward_with_modifiers(fa, ref, env, make_inputs, assert_close_to_oracle, record_error,
                                              where, case):
    a = run_case(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, case, "bf16", deterministic=True)
    b = run_case(fa, ref, env, make_inputs, assert_close_to_oracle, record_error, case, "bf16", deterministic=True)
    for x, y in zip(a[2], b[2]):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), case


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
def test_varlen_modifiers(fa, ref, env, assert_close_to_oracle, record_error, where, dtype_name):
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(5)
    q_lens, k_lens, h, hkv, d = [5, 0, 97, 12], [7, 3, 97, 40], 4, 2, 16
    q, do = (rng.standard_normal((sum(q_lens), h, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((sum(k_lens), hkv, d)).astype(dtype) for _ in range(2))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (q_lens, k_lens))
    mods = dict(softcap=1.2, alibi_slopes=rng.random((4, h)).astype(np.float32), sinks=SINKS4)
    g = [env.put(x) for x in (q, k, v, do, cu_q, cu_k)]
    gmods = {n: env.put(x) if isinstance(x, np.ndarray) else x for n, x in mods.items()}
    ctx = f"varlen where={env.where}"
    o, lse = fa.varlen.forward_with_states(g[0], g[1], g[2], g[4], g[5], causal=True, **gmods, **env.kw)
    ro, rlse = ref.varlen_forward_with_states(q, k, v, cu_q, cu_k, causal=True, **mods)
    ho, hlse = env.get(o), env.get(lse)
    record_error(dtype_name, "o", assert_close_to_oracle("o", ho, ro, dtype, ctx))
    record_error(dtype_name, "lse", assert_close_to_oracle("lse", hlse, rlse, np.float32, ctx))
    grads = fa.varlen.backward(g[3], g[0], g[1], g[2], o, lse, g[4], g[5], causal=True, **gmods, **env.kw)
    want = ref.varlen_backward(do, q, k, v, ho, hlse, cu_q, cu_k, causal=True, **mods)
    for name, got, w, dt in zip(("dq", "dk", "dv", "dsinks"), grads, want, (dtype,) * 3 + (np.float32,)):
        record_error(dtype_name, name, assert_close_to_oracle(name, env.get(got), w, dt, ctx))


@pytest.mark.parametrize("where", DEVICES)
def test_modifier_arguments_convert_and_broadcast(fa, env, make_inputs, where):
    """float64 / list slopes and sinks are converted to float32; [H] slopes equal [B, H] repeated."""
    q, k, v, do = (env.put(x) for x in make_inputs(3, 2, 20, 20, 4, 2, 16, np.float32))
    o1, l1 = fa.forward_with_states(q, k, v, alibi_slopes=env.put(SLOPES4), sinks=list(SINKS4.astype(float)), **env.kw)
    o2, l2 = fa.forward_with_states(q, k, v, alibi_slopes=np.stack([SLOPES4.astype(np.float64)] * 2),
                                    sinks=env.put(SINKS4), **env.kw)
    assert np.array_equal(env.get(o1), env.get(o2)) and np.array_equal(env.get(l1), env.get(l2))


@pytest.mark.parametrize("where", DEVICES)
def test_no_modifier_is_the_plain_call(fa, env, make_inputs, where):
    q, k, v, do = (env.put(x) for x in make_inputs(4, 1, 40, 40, 2, 2, 16, np.float32))
    o1, l1 = fa.forward_with_states(q, k, v, **env.kw)
    o2, l2 = fa.forward_with_states(q, k, v, softcap=None, alibi_slopes=None, sinks=None, **env.kw)
    assert np.array_equal(env.get(o1), env.get(o2)) and np.array_equal(env.get(l1), env.get(l2))
    assert len(fa.backward(do, q, k, v, o1, l1, sinks=None, **env.kw)) == 3


def test_bad_modifiers_are_clear_errors(fa, make_inputs):
    q, k, v, do = make_inputs(6, 2, 8, 8, 4, 2, 8, np.float32)
    cases = [
        (dict(softcap=0.0), fa.UnsupportedError, "softcap"),
        (dict(softcap=float("inf")), fa.UnsupportedError, "softcap"),
        (dict(softcap="1"), fa.UnsupportedError, "softcap"),
        (dict(alibi_slopes=np.ones(3, np.float32)), fa.ShapeError, "alibi_slopes"),
        (dict(alibi_slopes=np.ones((3, 4), np.float32)), fa.ShapeError, "alibi_slopes"),
        (dict(sinks=np.ones((2, 4), np.float32)), fa.ShapeError, "sinks"),
        (dict(sinks=np.array([0, 1, np.nan, 0], np.float32)), fa.UnsupportedError, "sinks"),
        (dict(sinks=np.ones(4, bool)), fa.DTypeError, "sinks"),
        # past 1e30, c * log2(e) overflows float32 in the kernels (these gave NaN)
        (dict(softcap=3e38), fa.UnsupportedError, "softcap"),
        (dict(sinks=np.array([0, 3e38, 0, 0], np.float32)), fa.UnsupportedError, "sinks"),
        (dict(alibi_slopes=np.array([0, -3e38, 0, 0], np.float32)), fa.UnsupportedError, "alibi_slopes"),
    ]
    for kw, err, word in cases:
        with pytest.raises(err, match=word):
            fa.forward(q, k, v, **kw)
    o, lse = fa.forward_with_states(q, k, v)
    with pytest.raises(fa.ShapeError, match="sinks"):
        fa.backward(do, q, k, v, o, lse, sinks=np.ones(3, np.float32))
