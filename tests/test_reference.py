"""The float64 oracle itself, checked so the other tests can trust it.

* against a naive scalar-loop implementation written independently (per row:
  softmax over the visible keys, then the softmax Jacobian for gradients);
* against central finite differences of ``L = sum(do * o(q, k, v))``;
* structural properties: GQA equals MHA with repeated k/v, bottom-right
  causal alignment, rows that see no key, dtype upcasting.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

# (B, Sq, Sk, H, Hkv, D, causal, scale)
TINY = [
    pytest.param(1, 3, 4, 2, 1, 3, True, None, id="sq<sk-gqa-causal"),
    pytest.param(2, 5, 3, 2, 2, 4, True, 0.7, id="sq>sk-causal-empty-rows-scale"),
    pytest.param(1, 4, 4, 3, 1, 2, False, None, id="mqa-noncausal"),
    pytest.param(1, 1, 5, 2, 1, 3, True, None, id="decode-sq1"),
    pytest.param(1, 4, 6, 4, 2, 3, False, 1.9, id="gqa-noncausal-scale"),
]


def _naive_rows(q, k, causal, scale):
    """Per (batch, head, query row) that sees a key: (b, h, kv head, i, visible keys, scores)."""
    b_, sq, h_, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    for b in range(b_):
        for h in range(h_):
            g = h // (h_ // hkv)
            for i in range(sq):
                keys = [j for j in range(sk) if not causal or j - i <= sk - sq]
                if keys:
                    yield b, h, g, i, keys, [scale * sum(float(q[b, i, h, x]) * float(k[b, j, g, x]) for x in range(d)) for j in keys]


def _naive_scale(q, scale):
    return 1.0 / math.sqrt(q.shape[3]) if scale is None else scale


def naive_forward(q, k, v, causal, scale):
    """Scalar loops: returns ``(o [B,Sq,H,Dv], lse [B,H,Sq])`` float64."""
    b_, sq, h_, _ = q.shape
    d = v.shape[3]  # o has v's head dim
    o = np.zeros((b_, sq, h_, d))
    lse = np.full((b_, h_, sq), -np.inf)
    for b, h, g, i, keys, s in _naive_rows(q, k, causal, _naive_scale(q, scale)):
        m = max(s)
        e = [math.exp(t - m) for t in s]
        tot = sum(e)
        lse[b, h, i] = m + math.log(tot)
        for x in range(d):
            o[b, i, h, x] = sum(e[n] * float(v[b, j, g, x]) for n, j in enumerate(keys)) / tot
    return o, lse


def naive_backward(do, q, k, v, causal, scale):
    """Scalar loops through the softmax Jacobian (recomputes P itself)."""
    d, dv_dim = q.shape[3], v.shape[3]
    scale = _naive_scale(q, scale)
    dq = np.zeros(q.shape)
    dk = np.zeros(k.shape)
    dv = np.zeros(v.shape)
    for b, h, g, i, keys, s in _naive_rows(q, k, causal, scale):
        m = max(s)
        e = [math.exp(t - m) for t in s]
        p = [t / sum(e) for t in e]
        dp = [sum(do[b, i, h, x] * v[b, j, g, x] for x in range(dv_dim)) for j in keys]
        mean = sum(pn * dpn for pn, dpn in zip(p, dp))
        for n, j in enumerate(keys):
            ds = p[n] * (dp[n] - mean)
            for x in range(dv_dim):
                dv[b, j, g, x] += p[n] * do[b, i, h, x]
            for x in range(d):
                dq[b, i, h, x] += scale * ds * k[b, j, g, x]
                dk[b, j, g, x] += scale * ds * q[b, i, h, x]
    return dq, dk, dv


def _inputs(seed, b, sq, sk, h, hkv, d):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, h, d))
    k = rng.standard_normal((b, sk, hkv, d))
    v = rng.standard_normal((b, sk, hkv, d))
    do = rng.standard_normal((b, sq, h, d))
    return q, k, v, do


@pytest.mark.parametrize("b,sq,sk,h,hkv,d,causal,scale", TINY)
def test_forward_matches_naive_loops(ref, b, sq, sk, h, hkv, d, causal, scale):
    q, k, v, _ = _inputs(1, b, sq, sk, h, hkv, d)
    o, lse = ref.forward_with_states(q, k, v, causal=causal, scale=scale)
    o_n, lse_n = naive_forward(q, k, v, causal, scale)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    assert o.shape == (b, sq, h, d) and lse.shape == (b, h, sq)
    np.testing.assert_allclose(o, o_n, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_n))
    np.testing.assert_allclose(lse, lse_n, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(ref.forward(q, k, v, causal=causal, scale=scale), o)


@pytest.mark.parametrize("b,sq,sk,h,hkv,d,causal,scale", TINY)
def test_backward_matches_naive_loops(ref, b, sq, sk, h, hkv, d, causal, scale):
    q, k, v, do = _inputs(2, b, sq, sk, h, hkv, d)
    o, lse = ref.forward_with_states(q, k, v, causal=causal, scale=scale)
    got = ref.backward(do, q, k, v, o, lse, causal=causal, scale=scale)
    want = naive_backward(do, q, k, v, causal, scale)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == np.float64 and g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("b,sq,sk,h,hkv,d,causal,scale", TINY)
def test_backward_matches_finite_differences(ref, b, sq, sk, h, hkv, d, causal, scale):
    q, k, v, do = _inputs(3, b, sq, sk, h, hkv, d)
    o, lse = ref.forward_with_states(q, k, v, causal=causal, scale=scale)
    grads = ref.backward(do, q, k, v, o, lse, causal=causal, scale=scale)

    def loss(qq, kk, vv):
        return float(np.sum(do * ref.forward(qq, kk, vv, causal=causal, scale=scale)))

    eps = 1e-6
    args = [q, k, v]
    for which, (name, grad) in enumerate(zip(("dq", "dk", "dv"), grads)):
        fd = np.zeros_like(args[which])
        for idx in np.ndindex(fd.shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            fd[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8, err_msg=name)


def test_gqa_equals_mha_with_repeated_kv(ref):
    b, sq, sk, h, hkv, d = 2, 7, 9, 6, 2, 5
    q, k, v, do = _inputs(4, b, sq, sk, h, hkv, d)
    group = h // hkv
    k_rep = np.repeat(k, group, axis=2)  # head h -> kv head h // group
    v_rep = np.repeat(v, group, axis=2)
    for causal in (True, False):
        o, lse = ref.forward_with_states(q, k, v, causal=causal)
        o_m, lse_m = ref.forward_with_states(q, k_rep, v_rep, causal=causal)
        np.testing.assert_allclose(o, o_m, rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(lse, lse_m, rtol=1e-13)
        dq, dk, dv = ref.backward(do, q, k, v, o, lse, causal=causal)
        dq_m, dk_m, dv_m = ref.backward(do, q, k_rep, v_rep, o_m, lse_m, causal=causal)
        np.testing.assert_allclose(dq, dq_m, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(dk, dk_m.reshape(b, sk, hkv, group, d).sum(3), rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(dv, dv_m.reshape(b, sk, hkv, group, d).sum(3), rtol=1e-12, atol=1e-13)


def test_causal_alignment_is_bottom_right(ref):
    mask = ref.visible_mask(3, 5, True)
    want = np.array(
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(mask, want)
    np.testing.assert_array_equal(ref.visible_mask(4, 4, True), np.tri(4, dtype=bool))
    # Sq > Sk: the first Sq - Sk rows see nothing
    np.testing.assert_array_equal(ref.visible_mask(5, 2, True).sum(1), [0, 0, 0, 1, 2])
    # the last query row always sees every key, so it equals non-causal there
    q, k, v, _ = _inputs(5, 1, 4, 9, 2, 2, 3)
    oc = ref.forward(q, k, v, causal=True)
    on = ref.forward(q, k, v, causal=False)
    np.testing.assert_allclose(oc[:, -1], on[:, -1], rtol=1e-14)
    assert not np.allclose(oc[:, 0], on[:, 0])


def test_rows_without_keys_are_exact_zero_and_never_nan(ref):
    b, sq, sk, h, hkv, d = 1, 6, 2, 2, 1, 4
    q, k, v, do = _inputs(6, b, sq, sk, h, hkv, d)
    with np.errstate(all="raise"):  # no overflow / invalid / divide on the way
        o, lse = ref.forward_with_states(q, k, v, causal=True)
        dq, dk, dv = ref.backward(do, q, k, v, o, lse, causal=True)
    empty = sq - sk  # rows 0 .. 3 see no key
    assert np.all(o[:, :empty] == 0.0)
    assert np.all(np.isneginf(lse[:, :, :empty]))
    assert np.all(dq[:, :empty] == 0.0)
    assert np.all(np.isfinite(lse[:, :, empty:]))
    for t in (o, dq, dk, dv):
        assert not np.isnan(t).any()


def test_zero_keys(ref):
    q, k, v, do = _inputs(7, 2, 3, 0, 2, 1, 4)
    for causal in (True, False):
        with np.errstate(all="raise"):
            o, lse = ref.forward_with_states(q, k, v, causal=causal)
            dq, dk, dv = ref.backward(do, q, k, v, o, lse, causal=causal)
        assert o.shape == q.shape and np.all(o == 0.0)
        assert lse.shape == (2, 2, 3) and np.all(np.isneginf(lse))
        assert np.all(dq == 0.0) and dk.shape == k.shape and dv.shape == v.shape


def test_zero_batch_and_zero_queries(ref):
    for b, sq in ((0, 4), (2, 0)):
        q, k, v, do = _inputs(8, b, sq, 5, 2, 2, 3)
        o, lse = ref.forward_with_states(q, k, v)
        dq, dk, dv = ref.backward(do, q, k, v, o, lse)
        assert o.shape == q.shape and lse.shape == (b, 2, sq)
        assert dk.shape == k.shape and np.all(dk == 0.0) and np.all(dv == 0.0)


def test_default_scale_is_inverse_sqrt_d(ref):
    q, k, v, _ = _inputs(9, 1, 5, 5, 2, 2, 7)
    np.testing.assert_array_equal(ref.forward(q, k, v), ref.forward(q, k, v, scale=1 / math.sqrt(7)))
    np.testing.assert_array_equal(ref.forward(q, k, v), ref.forward(q, k, v, causal=True))
    assert not np.allclose(ref.forward(q, k, v, scale=0.1), ref.forward(q, k, v))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.float64])
def test_accepts_storage_dtypes_and_returns_float64(ref, dtype):
    q, k, v, do = (t.astype(dtype) for t in _inputs(10, 1, 6, 8, 4, 2, 8))
    o, lse = ref.forward_with_states(q, k, v)
    dq, dk, dv = ref.backward(do, q, k, v, o.astype(dtype), lse.astype(np.float32))
    for t in (o, lse, dq, dk, dv):
        assert t.dtype == np.float64
    up = [t.astype(np.float64) for t in (q, k, v)]
    np.testing.assert_array_equal(o, ref.forward(*up))


def test_backward_uses_the_given_o(ref):
    """delta = rowsum(do * o) comes from the o passed in, like the kernel."""
    q, k, v, do = _inputs(11, 1, 5, 5, 2, 1, 3)
    o, lse = ref.forward_with_states(q, k, v, causal=False)
    dq, dk, dv = ref.backward(do, q, k, v, o, lse, causal=False)
    dq2, dk2, dv2 = ref.backward(do, q, k, v, 2.0 * o, lse, causal=False)
    np.testing.assert_array_equal(dv, dv2)  # dV = P^T dO does not involve o
    assert not np.allclose(dq, dq2)


def test_nan_propagates(ref):
    q, k, v, _ = _inputs(12, 1, 4, 4, 1, 1, 3)
    q[0, 2, 0, 1] = np.nan
    o, lse = ref.forward_with_states(q, k, v, causal=False)
    assert np.isnan(o[0, 2]).all() and np.isnan(lse[0, 0, 2])
    assert np.isfinite(np.delete(o, 2, axis=1)).all()


def test_rejects_bad_shapes(ref):
    q, k, v, do = _inputs(13, 1, 4, 4, 4, 2, 3)
    with pytest.raises(ValueError):
        ref.forward(q[0], k, v)
    with pytest.raises(ValueError):
        ref.forward(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))  # 4 % 3
    with pytest.raises(ValueError):
        ref.forward(q, k[..., :2], v[..., :2])
    o, lse = ref.forward_with_states(q, k, v)
    with pytest.raises(ValueError):
        ref.backward(do[:, :3], q, k, v, o, lse)
    with pytest.raises(ValueError):
        ref.backward(do, q, k, v, o, lse[:, :2])


def test_handles_s2048_one_head_at_a_time(ref):
    """Memory is O(Sq * Sk) per head, so a 2048-long test case is cheap."""
    q, k, v, do = _inputs(14, 1, 2048, 2048, 2, 1, 16)
    o, lse = ref.forward_with_states(q, k, v)
    dq, dk, dv = ref.backward(do, q, k, v, o, lse)
    assert np.isfinite(o).all() and np.isfinite(dq).all() and np.isfinite(dk).all()


# ---- masks and varlen (issue 10): the oracle's own semantics, checked by independent loops ----

def _sees(i, j, *, sq, lo, hi, causal, window, seg=None, block=None):
    """One (query, key) pair by the issue's rules, written out longhand."""
    if not lo <= j < hi:
        return False
    rel, diag = j - lo, i + (hi - lo) - sq
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None and rel < diag - left:
        return False
    if right is not None and rel > diag + right:
        return False
    if seg is not None and seg[0][i] != seg[1][j]:
        return False
    return block is None or bool(block[i // 128, j // 128])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (2, 1), (0, 0), (None, 3), (4, None)])
def test_attention_mask_matches_the_rules(ref, causal, window):
    rng = np.random.default_rng(5)
    b, h, sq, sk = 2, 2, 7, 300  # 300 keys: three 128-blocks
    seg_q, seg_k = rng.integers(0, 2, (b, sq)), rng.integers(0, 2, (b, sk))
    used, pad = np.array([250, 300]), np.array([3, 0])
    bm = rng.integers(0, 2, (1, h, 1, 3)).astype(bool)
    m = ref.attention_mask(b, sq, sk, h, causal=causal, window=window, segment_ids=(seg_q, seg_k),
                           seqused_k=used, leftpad_k=pad, block_mask=bm)
    for bi in range(b):
        for hi in range(h):
            want = [[_sees(i, j, sq=sq, lo=pad[bi], hi=used[bi], causal=causal, window=window,
                           seg=(seg_q[bi], seg_k[bi]), block=bm[0, hi]) for j in range(sk)] for i in range(sq)]
            np.testing.assert_array_equal(m[bi, hi], np.array(want))


def test_masked_backward_matches_finite_differences(ref):
    q, k, v, do = _inputs(9, 1, 4, 6, 2, 1, 3)
    masks = dict(window=(1, 1), segment_ids=(np.array([[0, 0, 1, 1]]), np.array([[0, 1, 1, 1, 0, 1]])),
                 seqused_k=np.array([5]), leftpad_k=np.array([1]))
    o, lse = ref.forward_with_states(q, k, v, causal=False, **masks)
    grads = ref.backward(do, q, k, v, o, lse, causal=False, **masks)
    eps, args = 1e-6, [q, k, v]
    for which, grad in enumerate(grads):
        fd = np.zeros_like(args[which])
        for idx in np.ndindex(fd.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            fd[idx] = np.sum(do * (ref.forward(*plus, causal=False, **masks) - ref.forward(*minus, causal=False, **masks))) / (2 * eps)
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8)


def test_padding_equals_sliced_keys(ref):
    q, k, v, do = _inputs(4, 1, 5, 9, 2, 2, 3)
    o, lse = ref.forward_with_states(q, k, v, causal=True, seqused_k=[7], leftpad_k=[2])
    o2, lse2 = ref.forward_with_states(q, k[:, 2:7], v[:, 2:7], causal=True)
    np.testing.assert_allclose(o, o2, atol=1e-14)
    np.testing.assert_allclose(lse, lse2, atol=1e-14)
    dq, dk, dv = ref.backward(do, q, k, v, o, lse, causal=True, seqused_k=[7], leftpad_k=[2])
    dq2, dk2, dv2 = ref.backward(do, q, k[:, 2:7], v[:, 2:7], o2, lse2, causal=True)
    np.testing.assert_allclose(dq, dq2, atol=1e-14)
    np.testing.assert_allclose(dk[:, 2:7], dk2, atol=1e-14)
    assert not dk[:, :2].any() and not dv[:, 7:].any()


def test_varlen_equals_each_sequence_alone_and_the_padded_batch(ref):
    rng = np.random.default_rng(6)
    lens_q, lens_k = [3, 0, 5], [4, 2, 6]
    cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    q = rng.standard_normal((cu_q[-1], 2, 3))
    k, v = rng.standard_normal((2, cu_k[-1], 1, 3))
    o, lse = ref.varlen_forward_with_states(q, k, v, cu_q, cu_k, causal=True, window=(2, None))
    assert o.shape == q.shape and lse.shape == (2, cu_q[-1])
    for b in range(3):
        ob, lb = ref.forward_with_states(q[None, cu_q[b]:cu_q[b + 1]], k[None, cu_k[b]:cu_k[b + 1]],
                                         v[None, cu_k[b]:cu_k[b + 1]], causal=True, window=(2, None))
        np.testing.assert_allclose(o[cu_q[b]:cu_q[b + 1]], ob[0], atol=1e-14)
        np.testing.assert_allclose(lse[:, cu_q[b]:cu_q[b + 1]], lb[0], atol=1e-14)
    # One query length for all sequences: the same as a padded batch with seqused_k.
    lens_k = [4, 6, 1]
    cu_q, cu_k = np.arange(4) * 5, np.cumsum([0] + lens_k)
    q = rng.standard_normal((15, 2, 3))
    k, v = rng.standard_normal((2, cu_k[-1], 1, 3))
    kp, vp = np.zeros((3, 6, 1, 3)), np.zeros((3, 6, 1, 3))
    for b in range(3):
        kp[b, : lens_k[b]], vp[b, : lens_k[b]] = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
    o, lse = ref.varlen_forward_with_states(q, k, v, cu_q, cu_k, causal=True)
    op, lp = ref.forward_with_states(q.reshape(3, 5, 2, 3), kp, vp, causal=True, seqused_k=lens_k)
    np.testing.assert_allclose(o, op.reshape(15, 2, 3), atol=1e-14)
    np.testing.assert_allclose(lse, lp.transpose(1, 0, 2).reshape(2, 15), atol=1e-14)


def test_masked_rows_are_zero_never_nan(ref):
    q, k, v, do = _inputs(7, 1, 3, 4, 1, 1, 2)
    seg = (np.array([[0, 5, 1]]), np.array([[0, 0, 1, 1]]))  # row 1 has no key with id 5
    o, lse = ref.forward_with_states(q, k, v, causal=False, segment_ids=seg)
    assert np.isneginf(lse[0, 0, 1]) and not o[0, 1].any()
    dq, dk, dv = ref.backward(do, q, k, v, o, lse, causal=False, segment_ids=seg)
    assert not np.isnan(dq).any() and not dq[0, 1].any()


# ---- score modifiers -----------------------------------------------------------------------------


def _longhand_modified(q, k, v, *, causal, scale, softcap=None, slopes=None, sinks=None, lo=None, hi=None):
    """Per-element loops: the issue's order of operations on one score, then a softmax whose
    denominator may hold a sink."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    o, lse = np.zeros((b, sq, h, d)), np.full((b, h, sq), -np.inf)
    for bi in range(b):
        l0, h0 = (0 if lo is None else lo[bi]), (sk if hi is None else hi[bi])
        for hh in range(h):
            kv = hh // (h // hkv)
            for i in range(sq):
                logits, vals = [], []
                for j in range(sk):
                    if not (l0 <= j < h0) or (causal and j - l0 > i + (h0 - l0) - sq):
                        continue
                    s = scale * float(q[bi, i, hh] @ k[bi, j, kv])
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        s -= slopes[bi, hh] * abs(i + (h0 - l0) - sq - (j - l0))
                    logits.append(s)
                    vals.append(v[bi, j, kv])
                den = sum(math.exp(x) for x in logits) + (0.0 if sinks is None else math.exp(sinks[hh]))
                if den == 0.0:
                    continue
                lse[bi, hh, i] = math.log(den)
                for x, vv in zip(logits, vals):
                    o[bi, i, hh] += math.exp(x) / den * vv
    return o, lse


@pytest.mark.parametrize("causal", [True, False])
def test_modifiers_match_longhand(ref, causal):
    q, k, v, _ = _inputs(11, 2, 4, 6, 4, 2, 3)
    q, k = 3 * q, 3 * k  # large scores, where the cap bends them
    slopes = np.array([[0.5, 0.25, 0.125, 1.0], [0.3, 0.2, 0.1, 0.05]])
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    lo, hi = np.array([1, 0]), np.array([6, 4])
    o, lse = ref.forward_with_states(q, k, v, causal=causal, softcap=2.0, alibi_slopes=slopes, sinks=sinks,
                                     seqused_k=hi, leftpad_k=lo)
    o2, lse2 = _longhand_modified(q, k, v, causal=causal, scale=1 / math.sqrt(3), softcap=2.0, slopes=slopes,
                                  sinks=sinks, lo=lo, hi=hi)
    np.testing.assert_allclose(o, o2, atol=1e-12)
    np.testing.assert_allclose(lse, lse2, atol=1e-12)
    # [H] slopes broadcast over the batch.
    o3 = ref.forward(q, k, v, causal=causal, alibi_slopes=slopes[0])
    o4, _ = _longhand_modified(q, k, v, causal=causal, scale=1 / math.sqrt(3), slopes=np.stack([slopes[0]] * 2))
    np.testing.assert_allclose(o3, o4, atol=1e-12)


def test_sink_rows_without_keys(ref):
    q, k, v, do = _inputs(12, 1, 5, 3, 2, 1, 2)  # causal with Sq > Sk: rows 0, 1 see no key
    sinks = np.array([0.7, -2.0])
    o, lse = ref.forward_with_states(q, k, v, causal=True, sinks=sinks)
    assert not o[0, :2].any()
    np.testing.assert_allclose(lse[0, :, :2], np.array([[0.7, 0.7], [-2.0, -2.0]]))
    # A sink only adds to the denominator: o shrinks by exp(lse_plain - lse) and lse grows.
    o0, lse0 = ref.forward_with_states(q, k, v, causal=True)
    np.testing.assert_allclose(lse[:, :, 2:], np.logaddexp(lse0[:, :, 2:], sinks[None, :, None]), atol=1e-14)
    shrink = np.exp(lse0 - lse)[:, :, 2:].transpose(0, 2, 1)[..., None]
    np.testing.assert_allclose(o[:, 2:], o0[:, 2:] * shrink, atol=1e-14)
    dq, dk, dv, dsinks = ref.backward(do, q, k, v, o, lse, causal=True, sinks=sinks)
    assert not dq[0, :2].any() and np.isfinite(dsinks).all()


def test_softcap_is_plain_in_the_limit(ref):
    q, k, v, do = _inputs(13, 1, 4, 5, 2, 2, 3)
    o, lse = ref.forward_with_states(q, k, v, causal=False)
    oc, lsec = ref.forward_with_states(q, k, v, causal=False, softcap=1e6)
    np.testing.assert_allclose(oc, o, atol=1e-9)
    g, gc = ref.backward(do, q, k, v, o, lse, causal=False), ref.backward(do, q, k, v, oc, lsec, causal=False, softcap=1e6)
    for a, c in zip(g, gc):
        np.testing.assert_allclose(c, a, atol=1e-9)


def _fd_check(ref, args, loss, grads, eps=1e-6):
    for which, grad in enumerate(grads):
        fd = np.zeros_like(args[which])
        for idx in np.ndindex(fd.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            fd[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("mods", [
    dict(softcap=1.5),
    dict(alibi_slopes=np.array([0.5, 0.25])),
    dict(softcap=0.8, alibi_slopes=np.array([[0.5, 0.1]]), window=(2, 1), seqused_k=np.array([5]),
         leftpad_k=np.array([1])),
], ids=["softcap", "alibi", "softcap-alibi-masks"])
def test_modified_backward_matches_finite_differences(ref, mods):
    q, k, v, do = _inputs(14, 1, 4, 6, 2, 1, 3)
    q, k = 2 * q, 2 * k
    o, lse = ref.forward_with_states(q, k, v, causal=False, **mods)
    grads = ref.backward(do, q, k, v, o, lse, causal=False, **mods)
    _fd_check(ref, [q, k, v], lambda *a: np.sum(do * ref.forward(*a, causal=False, **mods)), grads)


def test_dsinks_match_finite_differences(ref):
    q, k, v, do = _inputs(15, 2, 5, 4, 2, 1, 3)
    sinks = np.array([0.3, -0.4])
    mods = dict(softcap=1.2, alibi_slopes=np.array([0.2, 0.4]), sinks=sinks)
    o, lse = ref.forward_with_states(q, k, v, causal=True, **mods)
    dq, dk, dv, dsinks = ref.backward(do, q, k, v, o, lse, causal=True, **mods)

    def loss(qq, kk, vv, ss):
        return np.sum(do * ref.forward(qq, kk, vv, causal=True, softcap=1.2, alibi_slopes=mods["alibi_slopes"], sinks=ss))

    _fd_check(ref, [q, k, v, sinks], loss, [dq, dk, dv, dsinks])


@pytest.mark.parametrize("mods", [
    dict(causal=True),
    dict(causal=False, softcap=1.3, sinks=np.array([0.3, -0.4])),
    dict(causal=True, window=(1, 0), alibi_slopes=np.array([0.2, 0.4])),
], ids=["causal-empty-rows", "softcap-sinks", "window-alibi"])
def test_dlse_matches_finite_differences(ref, mods):
    """backward(..., dlse) is the gradient of sum(do * o) + sum(dlse * lse): lse is differentiable
    too (rows that see no key, lse = -inf, contribute nothing)."""
    q, k, v, do = _inputs(17, 2, 5, 3, 2, 1, 3)  # Sq > Sk: causal rows 0, 1 see no key
    dlse = np.random.default_rng(18).standard_normal((2, 2, 5))
    o, lse = ref.forward_with_states(q, k, v, **mods)
    grads = ref.backward(do, q, k, v, o, lse, dlse=dlse, **mods)
    plain = ref.backward(do, q, k, v, o, lse, **mods)
    assert not np.allclose(grads[0], plain[0])  # dlse changes dq
    sinks = mods.get("sinks")
    others = {n: x for n, x in mods.items() if n != "sinks"}

    def loss(qq, kk, vv, *ss):
        oo, ll = ref.forward_with_states(qq, kk, vv, sinks=ss[0] if ss else None, **others)
        return np.sum(do * oo) + np.sum(dlse * np.where(np.isneginf(ll), 0.0, ll))

    args = [q, k, v] if sinks is None else [q, k, v, sinks]
    _fd_check(ref, args, loss, grads)


def test_varlen_dlse_equals_the_padded_call(ref):
    q, k, v, do = _inputs(19, 1, 6, 6, 2, 1, 3)
    dlse = np.random.default_rng(20).standard_normal((1, 2, 6))
    o, lse = ref.forward_with_states(q, k, v, causal=True)
    want = ref.backward(do, q, k, v, o, lse, causal=True, dlse=dlse)
    cu = np.array([0, 6])
    got = ref.varlen_backward(do[0], q[0], k[0], v[0], o[0], lse[0], cu, cu, causal=True, dlse=dlse[0])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w[0], rtol=1e-12, atol=1e-12)


def test_varlen_modifiers_equal_each_sequence_alone(ref):
    rng = np.random.default_rng(16)
    lens_q, lens_k = [3, 4], [5, 2]
    cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    q, do = rng.standard_normal((2, cu_q[-1], 2, 3))
    k, v = rng.standard_normal((2, cu_k[-1], 1, 3))
    slopes, sinks = np.array([[0.5, 0.2], [0.1, 0.3]]), np.array([0.1, -0.3])
    mods = dict(softcap=2.0, alibi_slopes=slopes, sinks=sinks)
    o, lse = ref.varlen_forward_with_states(q, k, v, cu_q, cu_k, causal=True, **mods)
    dq, dk, dv, dsinks = ref.varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, causal=True, **mods)
    total = np.zeros(2)
    for b in range(2):
        sq_, sk_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ob, lb = ref.forward_with_states(q[None, sq_], k[None, sk_], v[None, sk_], causal=True, softcap=2.0,
                                         alibi_slopes=slopes[b], sinks=sinks)
        np.testing.assert_allclose(o[sq_], ob[0], atol=1e-14)
        g = ref.backward(do[None, sq_], q[None, sq_], k[None, sk_], v[None, sk_], ob, lb, causal=True,
                         softcap=2.0, alibi_slopes=slopes[b], sinks=sinks)
        np.testing.assert_allclose(dk[sk_], g[1][0], atol=1e-14)
        total += g[3]
    np.testing.assert_allclose(dsinks, total, atol=1e-14)


def test_rejects_bad_modifiers(ref):
    q, k, v, _ = _inputs(17, 2, 3, 3, 2, 1, 2)
    with pytest.raises(ValueError, match="softcap"):
        ref.forward(q, k, v, softcap=0.0)
    with pytest.raises(ValueError, match="alibi_slopes"):
        ref.forward(q, k, v, alibi_slopes=np.ones(3))
    with pytest.raises(ValueError, match="sinks"):
        ref.forward(q, k, v, sinks=np.ones((2, 2)))


# ---- v's own head dim (Dv != D): o, do and dv take Dv, dq and dk D ----

# (B, Sq, Sk, H, Hkv, D, Dv, causal)
TINY_DV = [
    pytest.param(1, 3, 4, 2, 1, 3, 5, True, id="dv>d-gqa-causal"),
    pytest.param(2, 5, 3, 2, 2, 4, 1, True, id="dv<d-sq>sk-empty-rows"),
    pytest.param(1, 4, 6, 4, 2, 1, 3, False, id="d1-dv3-gqa"),
]


def _inputs_dv(seed, b, sq, sk, h, hkv, d, dv):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, h, d))
    k = rng.standard_normal((b, sk, hkv, d))
    v = rng.standard_normal((b, sk, hkv, dv))
    do = rng.standard_normal((b, sq, h, dv))
    return q, k, v, do


@pytest.mark.parametrize("b,sq,sk,h,hkv,d,dv,causal", TINY_DV)
def test_own_dv_matches_naive_loops(ref, b, sq, sk, h, hkv, d, dv, causal):
    q, k, v, do = _inputs_dv(20, b, sq, sk, h, hkv, d, dv)
    o, lse = ref.forward_with_states(q, k, v, causal=causal)
    assert o.shape == (b, sq, h, dv) and lse.shape == (b, h, sq)
    o_n, lse_n = naive_forward(q, k, v, causal, None)
    np.testing.assert_allclose(o, o_n, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, lse_n, rtol=1e-12, atol=1e-13)
    got = ref.backward(do, q, k, v, o, lse, causal=causal)
    want = naive_backward(do, q, k, v, causal, None)
    for name, g, w, shape in zip(("dq", "dk", "dv"), got, want, (q.shape, k.shape, v.shape)):
        assert g.shape == w.shape == shape, name
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("b,sq,sk,h,hkv,d,dv,causal", TINY_DV)
def test_own_dv_backward_matches_finite_differences(ref, b, sq, sk, h, hkv, d, dv, causal):
    q, k, v, do = _inputs_dv(21, b, sq, sk, h, hkv, d, dv)
    o, lse = ref.forward_with_states(q, k, v, causal=causal)
    grads = ref.backward(do, q, k, v, o, lse, causal=causal)
    eps, args = 1e-6, [q, k, v]
    for which, (name, grad) in enumerate(zip(("dq", "dk", "dv"), grads)):
        fd = np.zeros_like(args[which])
        for idx in np.ndindex(fd.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            fd[idx] = np.sum(do * (ref.forward(*plus, causal=causal) - ref.forward(*minus, causal=causal))) / (2 * eps)
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8, err_msg=name)


def test_own_dv_is_each_column_block_of_v_alone(ref):
    """o's columns are linear in v's: attention with v = [v1 | v2] is [attention(v1) | attention(v2)],
    with one lse; the scale comes from D, whatever Dv is."""
    q, k, v, do = _inputs_dv(22, 2, 7, 9, 4, 2, 5, 12)
    masks = dict(window=(3, None), segment_ids=(np.array([[0] * 4 + [1] * 3] * 2), np.array([[0] * 5 + [1] * 4] * 2)))
    o, lse = ref.forward_with_states(q, k, v, causal=True, **masks)
    for cols in (slice(0, 5), slice(5, 12), slice(11, 12)):
        o_part, lse_part = ref.forward_with_states(q, k, v[..., cols], causal=True, **masks)
        np.testing.assert_allclose(o[..., cols], o_part, rtol=1e-13, atol=1e-14)
        np.testing.assert_array_equal(lse, lse_part)
    np.testing.assert_array_equal(ref.forward(q, k, v), ref.forward(q, k, v, scale=1 / math.sqrt(5)))
    dq, dk, dv = ref.backward(do, q, k, v, o, lse, causal=True, **masks)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    # dV = P^T dO column by column
    _, _, dv_part = ref.backward(do[..., 5:], q, k, v[..., 5:], o[..., 5:], lse, causal=True, **masks)
    np.testing.assert_allclose(dv[..., 5:], dv_part, rtol=1e-12, atol=1e-13)


def test_own_dv_varlen_equals_each_sequence(ref):
    rng = np.random.default_rng(23)
    lens_q, lens_k = [3, 0, 5], [4, 2, 6]
    cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    q, k = rng.standard_normal((cu_q[-1], 2, 3)), rng.standard_normal((cu_k[-1], 1, 3))
    v, do = rng.standard_normal((cu_k[-1], 1, 7)), rng.standard_normal((cu_q[-1], 2, 7))
    o, lse = ref.varlen_forward_with_states(q, k, v, cu_q, cu_k, causal=True)
    assert o.shape == (cu_q[-1], 2, 7)
    dq, dk, dv = ref.varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, causal=True)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for b in range(3):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ob, lb = ref.forward_with_states(q[None, sq], k[None, sk], v[None, sk], causal=True)
        np.testing.assert_allclose(o[sq], ob[0], atol=1e-14)
        g = ref.backward(do[None, sq], q[None, sq], k[None, sk], v[None, sk], ob, lb, causal=True)
        np.testing.assert_allclose(dv[sk], g[2][0], atol=1e-14)


def test_own_dv_shapes_are_checked(ref):
    q, k, v, do = _inputs_dv(24, 1, 4, 5, 2, 1, 3, 6)
    with pytest.raises(ValueError):
        ref.forward(q, k, v[:, :4])  # v's keys must be k's
    with pytest.raises(ValueError):
        ref.forward(q, k, np.concatenate([v, v], axis=2))  # and its heads
    o, lse = ref.forward_with_states(q, k, v)
    with pytest.raises(ValueError):
        ref.backward(do[..., :3], q, k, v, o, lse)  # do has Dv columns, not D
    with pytest.raises(ValueError):
        ref.backward(do, q, k, v, o[..., :3], lse)


# ---- decode: quantized caches, merged states ---------------------------------------------------

_STORE_EPS = {"f32": 2.0**-24, "f16": 2.0**-11, "bf16": 2.0**-8}
_STORE = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("dtype_name", ["f32", "f16", "bf16"])
def test_quantize_round_trip_within_half_a_step(ref, bits, group_size, dtype_name):
    """Within half a step of the element's group, plus what rounding the stored scale and bias to
    the dtype moves the end codes (clipped)."""
    x = (np.random.default_rng(bits + group_size).standard_normal((2, 7, 3, 128)) * 3).astype(_STORE[dtype_name])
    c = ref.quantize_kv(x, bits=bits, group_size=group_size)
    assert c.values.dtype == np.uint32 and c.values.shape == (2, 7, 3, 128 * bits // 32)
    assert c.scales.dtype == x.dtype and c.scales.shape == (2, 7, 3, 128 // group_size) == c.biases.shape
    assert c.shape == x.shape
    err = np.abs(ref.dequantize_kv(c) - x.astype(np.float64))
    sc = c.scales.astype(np.float64).repeat(group_size, axis=-1)
    bi = np.abs(c.biases.astype(np.float64)).repeat(group_size, axis=-1)
    eps = _STORE_EPS[dtype_name]
    assert np.all(err <= 0.5 * sc + (2**bits - 1) * sc * eps + bi * eps + 1e-12)
    assert np.median(err / sc) < 0.3  # not a trivially loose bound: codes do their work


@pytest.mark.parametrize("bits, word", [(4, 0x76543210), (8, 0x03020100)])
def test_quantize_packs_from_the_lowest_bits(ref, bits, word):
    x = (np.arange(32) % 2**bits).astype(np.float32).reshape(1, 1, 1, 32)  # min 0: codes = x
    x[..., -1] = 2**bits - 1  # max = 2^bits - 1: scale 1
    c = ref.quantize_kv(x, bits=bits, group_size=32)
    assert float(c.scales[0, 0, 0, 0]) == 1.0 and float(c.biases[0, 0, 0, 0]) == 0.0
    assert int(c.values[0, 0, 0, 0]) == word
    np.testing.assert_array_equal(ref.dequantize_kv(c), x)


def test_quantize_constant_group_is_exact(ref):
    x = np.full((1, 2, 1, 64), 0.37, np.float32)
    c = ref.quantize_kv(x, bits=4, group_size=32)
    assert np.all(c.scales == 0)
    np.testing.assert_array_equal(ref.dequantize_kv(c), x)


@pytest.mark.parametrize("shape, bits, group_size, match", [
    ((1, 1, 1, 64), 3, 32, "bits"),
    ((1, 1, 1, 64), 4, 48, "group_size"),
    ((1, 1, 1, 96), 4, 64, "multiple of group_size"),
    ((1, 1, 64), 4, 32, "rank 4"),
])
def test_quantize_rejects_bad_arguments(ref, shape, bits, group_size, match):
    with pytest.raises(ValueError, match=match):
        ref.quantize_kv(np.zeros(shape), bits=bits, group_size=group_size)


def test_merge_states_of_disjoint_key_sets_is_full_attention(ref):
    q, k, v, _ = _inputs(11, 2, 5, 23, 4, 2, 8)
    want_o, want_lse = ref.forward_with_states(q, k, v, causal=False)
    cuts = [(0, 7), (7, 7), (7, 16), (16, 23)]  # an empty part weighs nothing
    parts = [ref.forward_with_states(q, k[:, a:b], v[:, a:b], causal=False) for a, b in cuts]
    o, lse = ref.merge_states(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
    np.testing.assert_allclose(o, want_o, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)


def test_merge_states_rows_no_part_saw_are_zero(ref):
    o_parts = np.random.default_rng(0).standard_normal((2, 1, 3, 2, 4))
    lse_parts = np.full((2, 1, 2, 3), -np.inf)
    lse_parts[1, 0, 0, 1] = 0.5  # only (h 0, row 1) seen, by part 1
    o, lse = ref.merge_states(o_parts * np.isfinite(lse_parts).transpose(0, 1, 3, 2)[..., None], lse_parts)
    assert lse[0, 0, 1] == 0.5 and np.isneginf(np.delete(lse.ravel(), 1)).all()
    np.testing.assert_array_equal(o[0, 1, 0], o_parts[1, 0, 1, 0])
    assert not np.isnan(o).any() and np.count_nonzero(o) == 4


def test_decode_is_each_rows_valid_cache_with_causal_at_its_end(ref):
    """Row b attends over its cache keys [leftpad, seqlen) alone, causal aligned to their end;
    quantized caches are read dequantized; a row with no valid key gives o = 0, lse = -inf."""
    b, sq, s_cache, h, hkv, d = 3, 4, 40, 4, 2, 64
    q, k, v, _ = _inputs(12, b, sq, s_cache, h, hkv, d)
    seqlens, leftpad = np.array([40, 17, 5], np.int32), np.array([3, 0, 5], np.int32)
    o, lse = ref.decode(q, k, v, cache_seqlens=seqlens, leftpad_k=leftpad)
    for r in range(2):
        lo, hi = leftpad[r], seqlens[r]
        ro, rlse = ref.forward_with_states(q[r:r + 1], k[r:r + 1, lo:hi], v[r:r + 1, lo:hi], causal=True)
        np.testing.assert_allclose(o[r:r + 1], ro, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(lse[r:r + 1], rlse, rtol=1e-12, atol=1e-13)
    assert np.all(o[2] == 0) and np.isneginf(lse[2]).all()
    kq, vq = ref.quantize_kv(k, bits=8, group_size=32), ref.quantize_kv(v, bits=4, group_size=64)
    got = ref.decode(q, kq, vq, cache_seqlens=seqlens)
    want = ref.forward_with_states(q, ref.dequantize_kv(kq), ref.dequantize_kv(vq), causal=True, seqused_k=seqlens)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
