"""Float64 NumPy reference for FlashAttention forward and backward: the oracle.

Every backend is checked against these functions. They materialise the
score matrix of one (batch, head) pair at a time, in float64, so they are
simple to read and exact enough to judge float32 kernels, at the price of
O(Sq * Sk) memory per head (fine for the sizes tests use).

Conventions (identical to ``flash_nif``):

=========  ====================  =========================================
tensor     shape                 notes
=========  ====================  =========================================
q, dq      ``[B, Sq, H, D]``
k, dk      ``[B, Sk, Hkv, D]``   ``H % Hkv == 0``; query head ``h`` uses
v, dv      ``[B, Sk, Hkv, Dv]``  kv head ``h // (H // Hkv)`` (GQA / MQA)
o, do      ``[B, Sq, H, Dv]``    ``Dv`` is v's own head dim (may differ from ``D``)
lse        ``[B, H, Sq]``        ``log(sum_j exp(scale * q_i . k_j))``
=========  ====================  =========================================

* ``scale`` defaults to ``1 / sqrt(D)`` (q and k's head dim, not v's).
* ``causal`` is aligned bottom-right: query ``i`` sees key ``j`` iff
  ``j <= i + (Sk - Sq)``.
* Masks intersect (:func:`attention_mask`): ``window=(left, right)`` keeps
  relative keys in ``[i + off - left, i + off + right]`` (``None`` unbounded;
  ``causal`` caps ``right`` at 0); ``segment_ids=(seg_q [B, Sq], seg_k [B, Sk])``
  keeps equal ids; ``seqused_k`` / ``leftpad_k`` ``[B]`` keep keys in
  ``[leftpad_k[b], seqused_k[b])``, whose relative index is ``j - leftpad_k[b]``
  and ``off = seqused_k[b] - leftpad_k[b] - Sq``; ``block_mask``
  ``[B or 1, H or 1, ceil(Sq/128), ceil(Sk/128)]`` hides 128 x 128 blocks.
  :func:`varlen_forward_with_states` / :func:`varlen_backward` take packed
  sequences (``cu_seqlens``), each attended on its own.
* Score modifiers, in this order on one score (:func:`scores`): ``s = scale * q.k``;
  ``softcap=c`` (``c > 0``) gives ``s = c * tanh(s / c)``; ``alibi_slopes`` (``[H]`` or ``[B, H]``)
  adds ``-slope * |i + off - (j - lo)|`` (the masks' ``off`` and relative key index); then the
  masks; then the softmax. ``sinks`` (``[H]``) adds one logit per head to every row's softmax
  denominator with no value: ``lse = log(sum_j exp(s_j) + exp(sink_h))``; the backward then also
  returns ``dsinks [H]`` (summed over batch rows and query rows).
* A row that sees no key (``causal`` with ``Sq > Sk``, or ``Sk == 0``, or a
  mask) gives ``o = 0``, ``lse = -inf`` (``lse = sink_h`` with sinks) and zero gradients, never NaN.
* Inputs may be float16, ``ml_dtypes.bfloat16``, float32 or float64; they are
  upcast to float64 and every output is float64.

This module depends on NumPy only, never on the native extension.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "forward",
    "forward_with_states",
    "backward",
    "visible_mask",
    "attention_mask",
    "varlen_forward_with_states",
    "varlen_forward",
    "varlen_backward",
    "scores",
    "MASK_BLOCK",
]

MASK_BLOCK = 128  # rows and columns of one block-mask entry (FlexAttention's block size)


def _as_f64(name: str, x, ndim: int) -> np.ndarray:
    """Upcast ``x`` to a float64 array of rank ``ndim`` (checked)."""
    a = np.asarray(x)
    if a.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {a.shape}")
    return a.astype(np.float64)


def _check_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, int, int, int, int, int]:
    """Validate shapes; return ``(B, Sq, Sk, H, Hkv, D)`` (v's own head dim is ``v.shape[3]``)."""
    b, sq, h, d = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same shape but for the head dim, got k {k.shape} and v {v.shape}")
    bk, sk, hkv, dk = k.shape
    if bk != b:
        raise ValueError(f"batch mismatch: q {q.shape} vs k {k.shape}")
    if dk != d:
        raise ValueError(f"head_dim mismatch: q {q.shape} vs k {k.shape}")
    if h == 0 or hkv == 0 or h % hkv != 0:
        raise ValueError(f"H ({h}) must be a positive multiple of Hkv ({hkv})")
    return b, sq, sk, h, hkv, d


def _scale(scale: float | None, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    return float(scale)


def visible_mask(sq: int, sk: int, causal: bool, *, window=None, key_range=None) -> np.ndarray:
    """Boolean ``[Sq, Sk]`` mask of one batch row, True where query ``i`` may see key ``j``.

    ``key_range=(lo, hi)`` (default ``(0, Sk)``) are the valid keys; key ``j`` has relative index
    ``j - lo`` and ``off = (hi - lo) - Sq`` aligns the diagonal bottom-right. Causal:
    ``j - lo <= i + off``; ``window=(left, right)``: ``i + off - left <= j - lo <= i + off + right``
    (``None`` is unbounded on that side; causal caps ``right`` at 0).
    """
    lo, hi = (0, sk) if key_range is None else (int(key_range[0]), int(key_range[1]))
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(int(right), 0)
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    rel, diag = j - lo, i + (hi - lo) - sq
    ok = (j >= lo) & (j < hi)
    if left is not None:
        ok = ok & (rel >= diag - int(left))
    if right is not None:
        ok = ok & (rel <= diag + int(right))
    return np.broadcast_to(ok, (sq, sk)).copy()


def _check_window(window):
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be (left, right), got {window!r}")
    for side in window:
        if side is not None and (int(side) != side or side < 0):
            raise ValueError(f"window sides must be non-negative integers or None, got {window!r}")
    return tuple(None if x is None else int(x) for x in window)


def _key_bounds(b: int, sk: int, seqused_k=None, leftpad_k=None) -> tuple[np.ndarray, np.ndarray]:
    """Valid keys ``[lo[b], hi[b])`` of every batch row."""
    hi = np.full(b, sk) if seqused_k is None else np.asarray(seqused_k).reshape(b)
    lo = np.zeros(b, dtype=np.int64) if leftpad_k is None else np.asarray(leftpad_k).reshape(b)
    if np.any(lo < 0) or np.any(hi > sk) or np.any(lo > hi):
        raise ValueError(f"need 0 <= leftpad_k <= seqused_k <= Sk = {sk}; got {lo}, {hi}")
    return lo, hi


def attention_mask(
    b: int, sq: int, sk: int, h: int, *, causal: bool = True, window=None, segment_ids=None,
    seqused_k=None, leftpad_k=None, block_mask=None,
) -> np.ndarray:
    """Boolean ``[B, H, Sq, Sk]``: True where query ``i`` of head ``h`` in batch row ``b`` sees key
    ``j``; every given mask must allow it (see the module doc)."""
    window = _check_window(window)
    lo, hi = _key_bounds(b, sk, seqused_k, leftpad_k)
    rows = [visible_mask(sq, sk, causal, window=window, key_range=(lo[x], hi[x])) for x in range(b)]
    out = np.stack(rows) if rows else np.zeros((0, sq, sk), dtype=bool)
    out = np.broadcast_to(out[:, None], (b, h, sq, sk))
    if segment_ids is not None:
        seg_q, seg_k = (np.asarray(x) for x in segment_ids)
        if seg_q.shape != (b, sq) or seg_k.shape != (b, sk):
            raise ValueError(f"segment_ids must be [B, Sq] and [B, Sk]; got {seg_q.shape}, {seg_k.shape}")
        out = out & (seg_q[:, None, :, None] == seg_k[:, None, None, :])
    if block_mask is not None:
        bm = np.asarray(block_mask).astype(bool)
        nb_q, nb_k = -(-sq // MASK_BLOCK), -(-sk // MASK_BLOCK)
        if bm.ndim != 4 or bm.shape[0] not in (1, b) or bm.shape[1] not in (1, h) or bm.shape[2:] != (nb_q, nb_k):
            raise ValueError(f"block_mask must be [{b} or 1, {h} or 1, {nb_q}, {nb_k}]; got {bm.shape}")
        full = bm.repeat(MASK_BLOCK, axis=2).repeat(MASK_BLOCK, axis=3)[:, :, :sq, :sk]
        out = out & full
    return np.broadcast_to(out, (b, h, sq, sk))


class _Modifiers:
    """The score modifiers of one call, checked against its sizes."""

    def __init__(self, b: int, h: int, softcap=None, alibi_slopes=None, sinks=None):
        if softcap is not None and not (math.isfinite(float(softcap)) and float(softcap) > 0):
            raise ValueError(f"softcap must be a finite positive number, got {softcap!r}")
        self.softcap = None if softcap is None else float(softcap)
        self.alibi = None
        if alibi_slopes is not None:
            a = np.asarray(alibi_slopes, dtype=np.float64)
            if a.shape not in ((h,), (b, h)):
                raise ValueError(f"alibi_slopes must be [H] = [{h}] or [B, H] = [{b}, {h}]; got {a.shape}")
            self.alibi = np.broadcast_to(a, (b, h))
        self.sinks = None
        if sinks is not None:
            sk = np.asarray(sinks, dtype=np.float64)
            if sk.shape != (h,):
                raise ValueError(f"sinks must be [H] = [{h}]; got {sk.shape}")
            self.sinks = sk


def scores(qh, kh, scale: float, *, softcap=None, slope=None, key_range=None):
    """Modified scores of one head before masking: ``q [Sq, D]``, ``k [Sk, D]`` -> ``(s [Sq, Sk],
    t)`` with ``t = tanh(scale * q.k / softcap)`` (``None`` without softcap), whose ``1 - t**2`` the
    backward needs. ``slope``: this head's ALiBi slope; ``key_range``: the batch row's valid keys."""
    s = scale * (qh @ kh.T)
    t = None
    if softcap is not None:
        t = np.tanh(s / softcap)
        s = softcap * t
    if slope is not None:
        sq, sk = s.shape
        lo, hi = (0, sk) if key_range is None else key_range
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        s = s - slope * np.abs(i + (hi - lo) - sq - (j - lo))
    return s, t


def _head_forward(
    s: np.ndarray, v: np.ndarray, mask: np.ndarray, sink: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """One head: modified scores ``s [Sq, Sk]``, ``v [Sk, D]`` -> ``(o [Sq, D], lse [Sq])``."""
    sq, d = s.shape[0], v.shape[1]
    s = np.where(mask, s, -np.inf)  # [Sq, Sk]
    m = s.max(axis=1, initial=-np.inf)  # -inf for rows that see no key (or NaN if input has NaN)
    if sink is not None:
        m = np.maximum(m, sink)
    seen = np.isfinite(m) | np.isnan(m)
    m_safe = np.where(seen, m, 0.0)
    p = np.exp(s - m_safe[:, None])  # masked entries: exp(-inf) = 0
    l = p.sum(axis=1)
    if sink is not None:
        l = l + np.exp(sink - m_safe)
    l_safe = np.where(seen, l, 1.0)
    o = (p @ v) / l_safe[:, None] if s.shape[1] else np.zeros((sq, d))
    o[~seen] = 0.0
    lse = np.where(seen, m_safe + np.log(l_safe), -np.inf)
    return o, lse


def _bounds(b: int, sk: int, masks: dict) -> tuple[np.ndarray, np.ndarray]:
    return _key_bounds(b, sk, masks.get("seqused_k"), masks.get("leftpad_k"))


def forward_with_states(q, k, v, *, causal: bool = True, scale: float | None = None, softcap=None,
                        alibi_slopes=None, sinks=None, **masks):
    """Attention forward pass, returning the output and the log-sum-exp.

    Args:
        q: ``[B, Sq, H, D]`` queries.
        k: ``[B, Sk, Hkv, D]`` keys, ``H % Hkv == 0``.
        v: ``[B, Sk, Hkv, Dv]`` values (their own head dim ``Dv``).
        causal: bottom-right aligned causal mask (query ``i`` sees keys
            ``j <= i + Sk - Sq``).
        scale: softmax scale, default ``1 / sqrt(D)``.
        softcap, alibi_slopes, sinks: score modifiers (see the module doc).
        masks: ``window``, ``segment_ids``, ``seqused_k``, ``leftpad_k``,
            ``block_mask`` (see :func:`attention_mask`).

    Returns:
        ``(o, lse)``: ``o [B, Sq, H, Dv]`` float64 and ``lse [B, H, Sq]``
        float64 (natural log; ``-inf`` for rows that see no key, whose ``o``
        is 0; with sinks such a row's ``lse`` is its head's sink).
    """
    q = _as_f64("q", q, 4)
    k = _as_f64("k", k, 4)
    v = _as_f64("v", v, 4)
    b, sq, sk, h, hkv, d = _check_qkv(q, k, v)
    sc = _scale(scale, d)
    group = h // hkv
    mods = _Modifiers(b, h, softcap, alibi_slopes, sinks)
    mask = attention_mask(b, sq, sk, h, causal=causal, **masks)
    lo, hi = _bounds(b, sk, masks)
    o = np.zeros((b, sq, h, v.shape[3]))
    lse = np.full((b, h, sq), -np.inf)
    for bi in range(b):
        for hh in range(h):
            kv = hh // group
            slope = None if mods.alibi is None else mods.alibi[bi, hh]
            s, _ = scores(q[bi, :, hh, :], k[bi, :, kv, :], sc, softcap=mods.softcap, slope=slope,
                          key_range=(lo[bi], hi[bi]))
            sink = None if mods.sinks is None else mods.sinks[hh]
            o[bi, :, hh, :], lse[bi, hh, :] = _head_forward(s, v[bi, :, kv, :], mask[bi, hh], sink)
    return o, lse


def forward(q, k, v, *, causal: bool = True, scale: float | None = None, **options) -> np.ndarray:
    """Attention forward pass: ``o [B, Sq, H, Dv]`` float64.

    Same arguments as :func:`forward_with_states`.
    """
    return forward_with_states(q, k, v, causal=causal, scale=scale, **options)[0]


def backward(do, q, k, v, o, lse, *, causal: bool = True, scale: float | None = None, softcap=None,
             alibi_slopes=None, sinks=None, dlse=None, **masks):
    """Attention backward pass from the saved output and log-sum-exp.

    Follows the FlashAttention-2 recipe, using the given ``o`` and ``lse``
    (as a real kernel does) rather than recomputing them:
    ``P = exp(s - lse)`` with ``s`` the modified scores, ``delta = rowsum(do * o)``,
    ``dV = P^T dO``, ``dS = P * (dO V^T - delta)`` (times ``1 - t**2`` with softcap,
    ``t = tanh(scale * q.k / softcap)``), ``dQ = scale * dS K``, ``dK = scale * dS^T Q``;
    with sinks, ``dsinks[h] = -sum over rows of exp(sink_h - lse) * delta``.

    ``dlse`` (optional, ``[B, H, Sq]``): the loss's gradient with respect to ``lse`` too. Since
    ``d lse / d s_j = P_j``, it enters as ``delta - dlse`` per row (``dS = P * (dP - delta + dlse)``,
    and the sinks' term likewise); rows that see no key still get zero gradients.

    Args:
        do: ``[B, Sq, H, Dv]`` gradient of the loss with respect to ``o``.
        q: ``[B, Sq, H, D]``.
        k: ``[B, Sk, Hkv, D]``; v: ``[B, Sk, Hkv, Dv]``.
        o: ``[B, Sq, H, Dv]`` forward output.
        lse: ``[B, H, Sq]`` forward log-sum-exp (``-inf`` for rows that see
            no key; those rows get zero gradients).
        causal, scale, softcap, alibi_slopes, sinks, masks: as in :func:`forward_with_states`.

    Returns:
        ``(dq, dk, dv)`` float64: ``dq [B, Sq, H, D]``, ``dk [B, Sk, Hkv, D]``
        and ``dv [B, Sk, Hkv, Dv]`` (summed over each GQA group); with sinks
        ``(dq, dk, dv, dsinks [H])``.
    """
    q = _as_f64("q", q, 4)
    k = _as_f64("k", k, 4)
    v = _as_f64("v", v, 4)
    do = _as_f64("do", do, 4)
    o = _as_f64("o", o, 4)
    lse = _as_f64("lse", lse, 3)
    b, sq, sk, h, hkv, d = _check_qkv(q, k, v)
    o_shape = (b, sq, h, v.shape[3])  # q's rows, v's head dim
    if do.shape != o_shape:
        raise ValueError(f"do shape {do.shape} must be {o_shape} (q's with v's head dim)")
    if o.shape != o_shape:
        raise ValueError(f"o shape {o.shape} must be {o_shape} (q's with v's head dim)")
    if lse.shape != (b, h, sq):
        raise ValueError(f"lse shape {lse.shape} must be {(b, h, sq)}")
    sc = _scale(scale, d)
    group = h // hkv
    mods = _Modifiers(b, h, softcap, alibi_slopes, sinks)
    mask = attention_mask(b, sq, sk, h, causal=causal, **masks)
    lo, hi = _bounds(b, sk, masks)
    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    dsinks = np.zeros(h)
    delta = np.einsum("bshd,bshd->bhs", do, o)  # [B, H, Sq]
    if dlse is not None:
        dlse = _as_f64("dlse", dlse, 3)
        if dlse.shape != (b, h, sq):
            raise ValueError(f"dlse shape {dlse.shape} must be lse's, {(b, h, sq)}")
        delta = delta - np.where(np.isneginf(lse), 0.0, dlse)  # a row that sees no key stays 0
    for bi in range(b):
        for hh in range(h):
            kv = hh // group
            qh, kh, vh = q[bi, :, hh, :], k[bi, :, kv, :], v[bi, :, kv, :]
            doh = do[bi, :, hh, :]
            row_lse = lse[bi, hh, :]
            seen = ~np.isneginf(row_lse)
            lse_safe = np.where(seen, row_lse, 0.0)
            slope = None if mods.alibi is None else mods.alibi[bi, hh]
            s, t = scores(qh, kh, sc, softcap=mods.softcap, slope=slope, key_range=(lo[bi], hi[bi]))
            # exp(-inf) = 0 on masked entries and on rows that see no key
            p = np.exp(np.where(mask[bi, hh] & seen[:, None], s - lse_safe[:, None], -np.inf))  # [Sq, Sk]
            dv[bi, :, kv, :] += p.T @ doh
            dp = doh @ vh.T
            ds = p * (dp - delta[bi, hh, :, None])
            if mods.sinks is not None:
                p_sink = np.where(seen, np.exp(mods.sinks[hh] - lse_safe), 0.0)
                dsinks[hh] -= np.sum(p_sink * delta[bi, hh])
            if t is not None:
                ds = ds * (1.0 - t * t)
            dq[bi, :, hh, :] = sc * (ds @ kh)
            dk[bi, :, kv, :] += sc * (ds.T @ qh)
    if mods.sinks is not None:
        return dq, dk, dv, dsinks
    return dq, dk, dv


def _cu(name: str, cu, total: int) -> np.ndarray:
    c = np.asarray(cu).astype(np.int64)
    if c.ndim != 1 or c.size == 0 or c[0] != 0 or np.any(np.diff(c) < 0) or c[-1] != total:
        raise ValueError(f"{name} must be [B + 1], 0 first, non-decreasing, ending at {total}; got {c}")
    return c


def _sequences(q, k, cu_seqlens_q, cu_seqlens_k):
    cq, ck = _cu("cu_seqlens_q", cu_seqlens_q, q.shape[0]), _cu("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if cq.size != ck.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length; got {cq.size}, {ck.size}")
    return list(zip(cq[:-1], cq[1:], ck[:-1], ck[1:]))


def _varlen_mods(bi: int, softcap=None, alibi_slopes=None, sinks=None) -> dict:
    """Sequence bi's modifiers: alibi_slopes [B, H] gives that sequence its row."""
    a = None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=np.float64)
    if a is not None and a.ndim == 2:
        a = a[bi]
    return {"softcap": softcap, "alibi_slopes": a, "sinks": sinks}


def varlen_forward_with_states(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool = True,
                               scale: float | None = None, window=None, **modifiers):
    """Packed variable-length forward: ``q [total_q, H, D]``, ``k, v [total_k, Hkv, D]``,
    ``cu_seqlens_*`` ``[B + 1]``; sequence ``b`` is queries ``cu_q[b]:cu_q[b+1]`` against keys
    ``cu_k[b]:cu_k[b+1]``, attended on its own (causal aligned bottom-right per sequence).
    ``v [total_k, Hkv, Dv]`` may have its own head dim. ``modifiers``: ``softcap``,
    ``alibi_slopes`` (``[H]`` or ``[B, H]``), ``sinks``.
    Returns ``(o [total_q, H, Dv], lse [H, total_q])`` float64."""
    q, k, v = _as_f64("q", q, 3), _as_f64("k", k, 3), _as_f64("v", v, 3)
    o = np.zeros((*q.shape[:2], v.shape[2]))
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for bi, (q0, q1, k0, k1) in enumerate(_sequences(q, k, cu_seqlens_q, cu_seqlens_k)):
        ob, lb = forward_with_states(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal,
                                     scale=_scale(scale, q.shape[2]), window=window,
                                     **_varlen_mods(bi, **modifiers))
        o[q0:q1], lse[:, q0:q1] = ob[0], lb[0]
    return o, lse


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, **options) -> np.ndarray:
    """``o [total_q, H, Dv]`` of :func:`varlen_forward_with_states`."""
    return varlen_forward_with_states(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)[0]


def varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *, causal: bool = True,
                    scale: float | None = None, window=None, dlse=None, **modifiers):
    """Packed variable-length backward: ``(dq [total_q, H, D], dk [total_k, Hkv, D],
    dv [total_k, Hkv, Dv])`` float64 from the forward's ``o [total_q, H, Dv]`` and
    ``lse [H, total_q]`` (with ``sinks``, also ``dsinks [H]``); ``dlse`` like lse, as in :func:`backward`."""
    q, k, v = _as_f64("q", q, 3), _as_f64("k", k, 3), _as_f64("v", v, 3)
    do, o, lse = _as_f64("do", do, 3), _as_f64("o", o, 3), _as_f64("lse", lse, 2)
    if dlse is not None and np.shape(dlse) != lse.shape:
        raise ValueError(f"dlse shape {np.shape(dlse)} must be lse's, {lse.shape}")
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dsinks = np.zeros(q.shape[1])
    for bi, (q0, q1, k0, k1) in enumerate(_sequences(q, k, cu_seqlens_q, cu_seqlens_k)):
        g = backward(do[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], o[None, q0:q1],
                     lse[None, :, q0:q1], causal=causal, scale=_scale(scale, q.shape[2]), window=window,
                     dlse=None if dlse is None else np.asarray(dlse)[None, :, q0:q1], **_varlen_mods(bi, **modifiers))
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
        if len(g) == 4:
            dsinks += g[3]
    if modifiers.get("sinks") is not None:
        return dq, dk, dv, dsinks
    return dq, dk, dv


# ---- rotary position embeddings (RoPE) ----------------------------------------------------------
#
# ``x [B, S, H, D]``; ``cos, sin [max_pos, R/2]`` rotate the first ``R = 2 * cos.shape[1] <= D`` dims
# of every head, the rest pass through. Row ``(b, s)`` takes table row ``p = positions[b, s]``
# (``positions`` int ``[B, S]``), or ``s + positions`` when it is an int offset (None: 0). Angle ``i``
# turns the pair ``(a, b) = (i, i + R/2)`` (half-split, GPT-NeoX, the default) or ``(2i, 2i + 1)``
# (``interleaved``, GPT-J):
#
#     y[a] = x[a] cos[p, i] - x[b] sin[p, i],    y[b] = x[b] cos[p, i] + x[a] sin[p, i].
#
# The backward is the transpose (a rotation by -theta): dx = rotary_backward(dy). Every input is
# upcast to float64 and the result is float64 (float64 tables are taken as they are).


def _rotary(x, cos, sin, interleaved, positions, sign, name):
    x = _as_f64(name, x, 4)
    cos, sin = _as_f64("cos", cos, 2), _as_f64("sin", sin, 2)
    b, s, _, d = x.shape
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {cos.shape} and {sin.shape}")
    max_pos, half = cos.shape
    if half == 0 or 2 * half > d:
        raise ValueError(f"tables {cos.shape} rotate R = {2 * half} dims; need 2 <= R <= head_dim = {d}")
    if positions is None or isinstance(positions, (int, np.integer)):
        pos = np.broadcast_to(np.arange(s) + int(positions or 0), (b, s))
    else:
        pos = np.asarray(positions)
        if pos.shape != (b, s) or pos.dtype.kind not in "iu":
            raise ValueError(f"positions must be an integer array [B, S] = {(b, s)}; got {pos.dtype} {pos.shape}")
    if pos.size and (pos.min() < 0 or pos.max() >= max_pos):
        raise ValueError(f"positions must lie in [0, max_pos = {max_pos}); got values in [{pos.min()}, {pos.max()}]")
    c = cos[pos][:, :, None, :]  # [B, S, 1, R/2]
    sn = sign * sin[pos][:, :, None, :]
    y = x.copy()
    if interleaved:
        a, bb = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        y[..., 0:2 * half:2], y[..., 1:2 * half:2] = a * c - bb * sn, bb * c + a * sn
    else:
        a, bb = x[..., :half], x[..., half:2 * half]
        y[..., :half], y[..., half:2 * half] = a * c - bb * sn, bb * c + a * sn
    return y


def rotary_apply(x, cos, sin, *, interleaved: bool = False, positions=None) -> np.ndarray:
    """RoPE of ``x [B, S, H, D]`` with tables ``cos, sin [max_pos, R/2]`` (float64 result)."""
    return _rotary(x, cos, sin, interleaved, positions, 1.0, "x")


def rotary_backward(dy, cos, sin, *, interleaved: bool = False, positions=None) -> np.ndarray:
    """Gradient of :func:`rotary_apply`'s input given ``dy``, its output's gradient: the transpose
    (and inverse) rotation (float64 result)."""
    return _rotary(dy, cos, sin, interleaved, positions, -1.0, "dy")


__all__ += ["rotary_apply", "rotary_backward"]


# ---- decode over a KV cache: quantized caches, merging partial states --------------------------
#
# A quantized cache stores each group of ``group_size`` consecutive head-dim elements x of one
# (batch row, position, kv head) as ``x ~ scale * q + bias`` with ``scale = (max - min) / (2**bits
# - 1)``, ``bias = min`` and ``q = round((x - bias) / scale)`` in ``[0, 2**bits - 1]`` (0 when the
# group is constant: scale 0), MLX's affine format. The codes are packed into uint32 words from the
# lowest bits up (element e of a word at bits ``[e * bits, (e + 1) * bits)``): ``values`` ``[B, S,
# Hkv, D * bits / 32]``; ``scales`` and ``biases`` ``[B, S, Hkv, D / group_size]`` in x's dtype.
# Quantizing is defined in float32 arithmetic, so that every implementation gets the same bits:
# ``scale = store(f32(f32(max - min) / levels))``, ``bias = store(min)``, and each code
# ``rint(f32(f32(x - bias) / scale))`` (ties to even) clipped to ``[0, levels]``, with bias and scale
# the stored values read back as float32 (no fused multiply-add). Dequantizing is float64 here.


class QuantizedKV:
    """A quantized cache: ``values`` (uint32), ``scales``, ``biases``, ``bits``, ``group_size``."""

    def __init__(self, values, scales, biases, bits: int, group_size: int):
        self.values, self.scales, self.biases = values, scales, biases
        self.bits, self.group_size = int(bits), int(group_size)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The shape of the cache it stands for, ``[B, S, Hkv, D]``."""
        return (*self.values.shape[:3], self.values.shape[3] * 32 // self.bits)


QUANT_BITS = (4, 8)
QUANT_GROUP_SIZES = (32, 64)


def _check_quant(d: int, bits: int, group_size: int) -> None:
    if bits not in QUANT_BITS:
        raise ValueError(f"bits must be one of {QUANT_BITS}, got {bits!r}")
    if group_size not in QUANT_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {QUANT_GROUP_SIZES}, got {group_size!r}")
    if d % group_size != 0:
        raise ValueError(f"the head dim ({d}) must be a multiple of group_size ({group_size})")


def quantize_kv(x, *, bits: int = 4, group_size: int = 64, store_dtype=None) -> QuantizedKV:
    """``x [B, S, Hkv, D]`` (float16, bfloat16 or float32) -> :class:`QuantizedKV`, bit for bit what
    a library gives (the float32 definition above). Scales and biases are stored in ``store_dtype``
    (default x's dtype) and the codes computed from the stored values."""
    a = np.asarray(x)
    if a.ndim != 4:
        raise ValueError(f"x must have rank 4 [B, S, Hkv, D], got shape {a.shape}")
    b, s, hkv, d = a.shape
    _check_quant(d, bits, group_size)
    store = np.dtype(store_dtype or a.dtype)
    g = a.astype(np.float32).reshape(b, s, hkv, d // group_size, group_size)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    levels = np.float32(2**bits - 1)
    scales = ((hi - lo) / levels).astype(np.float32).astype(store)
    biases = lo.astype(store)
    sc, bi = scales.astype(np.float32)[..., None], biases.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        codes = np.where(sc > 0, np.rint((g - bi) / sc), np.float32(0))
    codes = np.clip(codes, 0, levels).astype(np.uint64).reshape(b, s, hkv, d)
    per_word = 32 // bits
    words = codes.reshape(b, s, hkv, d // per_word, per_word) << (np.arange(per_word, dtype=np.uint64) * bits)
    values = words.sum(axis=-1).astype(np.uint32)
    return QuantizedKV(values, scales, biases, bits, group_size)


def dequantize_kv(c: QuantizedKV) -> np.ndarray:
    """:class:`QuantizedKV` -> float64 ``[B, S, Hkv, D]``: ``scale * q + bias`` per group."""
    b, s, hkv, d = c.shape
    _check_quant(d, c.bits, c.group_size)
    per_word = 32 // c.bits
    w = np.asarray(c.values).astype(np.uint64)[..., None] >> (np.arange(per_word, dtype=np.uint64) * c.bits)
    codes = (w & np.uint64(2**c.bits - 1)).reshape(b, s, hkv, d // c.group_size, c.group_size).astype(np.float64)
    sc = np.asarray(c.scales).astype(np.float64)[..., None]
    bi = np.asarray(c.biases).astype(np.float64)[..., None]
    ngroups = d // c.group_size
    if sc.shape[:4] != (b, s, hkv, ngroups) or bi.shape[:4] != (b, s, hkv, ngroups):
        raise ValueError(f"scales and biases must be [B, S, Hkv, D / group_size] = {[b, s, hkv, ngroups]}; "
                         f"got {list(sc.shape[:4])} and {list(bi.shape[:4])}")
    return (codes * sc + bi).reshape(b, s, hkv, d)


def merge_states(o_parts, lse_parts) -> tuple[np.ndarray, np.ndarray]:
    """Attention over the union of disjoint key sets from each set's ``(o, lse)``: ``o_parts [P, B,
    Sq, H, Dv]``, ``lse_parts [P, B, H, Sq]`` -> ``(o [B, Sq, H, Dv], lse [B, H, Sq])`` float64,
    ``lse = log(sum_p exp(lse_p))`` and ``o = sum_p exp(lse_p - lse) o_p``. Parts whose lse is
    ``-inf`` (no key) weigh nothing; a row no part saw gives ``o = 0``, ``lse = -inf``."""
    o = np.asarray(o_parts).astype(np.float64)
    lse = np.asarray(lse_parts).astype(np.float64)
    if o.ndim != 5 or lse.ndim != 4 or lse.shape != (o.shape[0], o.shape[1], o.shape[3], o.shape[2]):
        raise ValueError(f"o_parts must be [P, B, Sq, H, Dv] and lse_parts [P, B, H, Sq]; got {o.shape}, {lse.shape}")
    m = lse.max(axis=0, initial=-np.inf)  # [B, H, Sq]
    seen = np.isfinite(m)
    m_safe = np.where(seen, m, 0.0)
    w = np.exp(lse - m_safe)  # [P, B, H, Sq]; -inf parts weigh 0
    total = w.sum(axis=0)
    out_lse = np.where(seen, m_safe + np.log(np.where(seen, total, 1.0)), -np.inf)
    w = w / np.where(seen, total, 1.0)
    out = np.einsum("pbhs,pbshd->bshd", w, o)
    out[np.broadcast_to(~seen.transpose(0, 2, 1)[..., None], out.shape)] = 0.0
    return out, out_lse


def decode(q, k_cache, v_cache, *, cache_seqlens=None, leftpad_k=None, causal: bool = True,
           scale: float | None = None, window=None, softcap=None) -> tuple[np.ndarray, np.ndarray]:
    """Attention of a few new queries over a KV cache: ``q [B, Sq, H, D]``, caches ``[B, S_cache,
    Hkv, D]`` (arrays, or :class:`QuantizedKV`, read dequantized) -> ``(o, lse)`` as
    :func:`forward_with_states`. Row b's valid keys are ``[leftpad_k[b], cache_seqlens[b])``
    (defaults 0 and S_cache), and causal is aligned to the end of them: the last query sees every
    valid key."""
    k = dequantize_kv(k_cache) if isinstance(k_cache, QuantizedKV) else k_cache
    v = dequantize_kv(v_cache) if isinstance(v_cache, QuantizedKV) else v_cache
    return forward_with_states(q, k, v, causal=causal, scale=scale, softcap=softcap, window=window,
                               seqused_k=cache_seqlens, leftpad_k=leftpad_k)


__all__ += ["QuantizedKV", "QUANT_BITS", "QUANT_GROUP_SIZES", "quantize_kv", "dequantize_kv", "merge_states",
            "decode"]
