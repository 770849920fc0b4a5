"""Float64 NumPy reference for FlashAttention forward and backward: the oracle.

Every backend is checked against these functions. They materialise the
score matrix of one (batch, head) pair at a time, in float64, so they are
simple to read and exact enough to judge float32 kernels, at the price of
O(Sq * Sk) memory per head (fine for the sizes tests use).

Conventions (identical to ``flash_nif``):

=========  ====================  =========================================
tensor     shape                 notes
=========  ====================  =========================================
q, o, do   ``[B, Sq, H, D]``
dq         ``[B, Sq, H, D]``
k, v       ``[B, Sk, Hkv, D]``   ``H % Hkv == 0``; query head ``h`` uses
dk, dv     ``[B, Sk, Hkv, D]``   kv head ``h // (H // Hkv)`` (GQA / MQA)
lse        ``[B, H, Sq]``        ``log(sum_j exp(scale * q_i . k_j))``
=========  ====================  =========================================

* ``scale`` defaults to ``1 / sqrt(D)``.
* ``causal`` is aligned bottom-right: query ``i`` sees key ``j`` iff
  ``j <= i + (Sk - Sq)``.
* A row that sees no key (``causal`` with ``Sq > Sk``, or ``Sk == 0``) gives
  ``o = 0``, ``lse = -inf`` and zero gradients, never NaN.
* Inputs may be float16, ``ml_dtypes.bfloat16``, float32 or float64; they are
  upcast to float64 and every output is float64.

This module depends on NumPy only, never on the native extension.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["forward", "forward_with_states", "backward", "visible_mask"]


def _as_f64(name: str, x, ndim: int) -> np.ndarray:
    """Upcast ``x`` to a float64 array of rank ``ndim`` (checked)."""
    a = np.asarray(x)
    if a.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {a.shape}")
    return a.astype(np.float64)


def _check_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, int, int, int, int, int]:
    """Validate shapes; return ``(B, Sq, Sk, H, Hkv, D)``."""
    b, sq, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
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


def visible_mask(sq: int, sk: int, causal: bool) -> np.ndarray:
    """Boolean ``[Sq, Sk]`` mask, True where query ``i`` may see key ``j``.

    Causal masking is aligned bottom-right: ``j <= i + (Sk - Sq)``.
    """
    if not causal:
        return np.ones((sq, sk), dtype=bool)
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    return j <= i + (sk - sq)


def _head_forward(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """One head: ``q [Sq, D]``, ``k, v [Sk, D]`` -> ``(o [Sq, D], lse [Sq])``."""
    sq, d = q.shape
    s = np.where(mask, scale * (q @ k.T), -np.inf)  # [Sq, Sk]
    if s.shape[1] == 0:
        return np.zeros((sq, d)), np.full(sq, -np.inf)
    m = s.max(axis=1)  # -inf for rows that see no key (or NaN if input has NaN)
    seen = np.isfinite(m) | np.isnan(m)
    m_safe = np.where(seen, m, 0.0)
    p = np.exp(s - m_safe[:, None])  # masked entries: exp(-inf) = 0
    l = p.sum(axis=1)
    l_safe = np.where(seen, l, 1.0)
    o = (p @ v) / l_safe[:, None]
    o[~seen] = 0.0
    lse = np.where(seen, m_safe + np.log(l_safe), -np.inf)
    return o, lse


def forward_with_states(q, k, v, *, causal: bool = True, scale: float | None = None):
    """Attention forward pass, returning the output and the log-sum-exp.

    Args:
        q: ``[B, Sq, H, D]`` queries.
        k: ``[B, Sk, Hkv, D]`` keys, ``H % Hkv == 0``.
        v: ``[B, Sk, Hkv, D]`` values.
        causal: bottom-right aligned causal mask (query ``i`` sees keys
            ``j <= i + Sk - Sq``).
        scale: softmax scale, default ``1 / sqrt(D)``.

    Returns:
        ``(o, lse)``: ``o [B, Sq, H, D]`` float64 and ``lse [B, H, Sq]``
        float64 (natural log; ``-inf`` for rows that see no key, whose ``o``
        is 0).
    """
    q = _as_f64("q", q, 4)
    k = _as_f64("k", k, 4)
    v = _as_f64("v", v, 4)
    b, sq, sk, h, hkv, d = _check_qkv(q, k, v)
    sc = _scale(scale, d)
    group = h // hkv
    mask = visible_mask(sq, sk, causal)
    o = np.zeros((b, sq, h, d))
    lse = np.full((b, h, sq), -np.inf)
    for bi in range(b):
        for hi in range(h):
            kv = hi // group
            o[bi, :, hi, :], lse[bi, hi, :] = _head_forward(
                q[bi, :, hi, :], k[bi, :, kv, :], v[bi, :, kv, :], mask, sc
            )
    return o, lse


def forward(q, k, v, *, causal: bool = True, scale: float | None = None) -> np.ndarray:
    """Attention forward pass: ``o [B, Sq, H, D]`` float64.

    Same arguments as :func:`forward_with_states`.
    """
    return forward_with_states(q, k, v, causal=causal, scale=scale)[0]


def backward(do, q, k, v, o, lse, *, causal: bool = True, scale: float | None = None):
    """Attention backward pass from the saved output and log-sum-exp.

    Follows the FlashAttention-2 recipe, using the given ``o`` and ``lse``
    (as a real kernel does) rather than recomputing them:
    ``P = exp(scale * q k^T - lse)``, ``delta = rowsum(do * o)``,
    ``dV = P^T dO``, ``dS = P * (dO V^T - delta)``, ``dQ = scale * dS K``,
    ``dK = scale * dS^T Q``.

    Args:
        do: ``[B, Sq, H, D]`` gradient of the loss with respect to ``o``.
        q: ``[B, Sq, H, D]``.
        k, v: ``[B, Sk, Hkv, D]``.
        o: ``[B, Sq, H, D]`` forward output.
        lse: ``[B, H, Sq]`` forward log-sum-exp (``-inf`` for rows that see
            no key; those rows get zero gradients).
        causal, scale: as in :func:`forward_with_states`.

    Returns:
        ``(dq, dk, dv)`` float64: ``dq [B, Sq, H, D]``, ``dk`` and
        ``dv [B, Sk, Hkv, D]`` (summed over each GQA group).
    """
    q = _as_f64("q", q, 4)
    k = _as_f64("k", k, 4)
    v = _as_f64("v", v, 4)
    do = _as_f64("do", do, 4)
    o = _as_f64("o", o, 4)
    lse = _as_f64("lse", lse, 3)
    b, sq, sk, h, hkv, d = _check_qkv(q, k, v)
    if do.shape != q.shape:
        raise ValueError(f"do shape {do.shape} must equal q shape {q.shape}")
    if o.shape != q.shape:
        raise ValueError(f"o shape {o.shape} must equal q shape {q.shape}")
    if lse.shape != (b, h, sq):
        raise ValueError(f"lse shape {lse.shape} must be {(b, h, sq)}")
    sc = _scale(scale, d)
    group = h // hkv
    mask = visible_mask(sq, sk, causal)
    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    delta = np.einsum("bshd,bshd->bhs", do, o)  # [B, H, Sq]
    for bi in range(b):
        for hi in range(h):
            kv = hi // group
            qh, kh, vh = q[bi, :, hi, :], k[bi, :, kv, :], v[bi, :, kv, :]
            doh = do[bi, :, hi, :]
            row_lse = lse[bi, hi, :]
            seen = ~np.isneginf(row_lse)
            lse_safe = np.where(seen, row_lse, 0.0)
            # exp(-inf) = 0 on masked entries and on rows that see no key
            shifted = np.where(mask & seen[:, None], sc * (qh @ kh.T) - lse_safe[:, None], -np.inf)
            p = np.exp(shifted)  # [Sq, Sk]
            dv[bi, :, kv, :] += p.T @ doh
            dp = doh @ vh.T
            ds = p * (dp - delta[bi, hi, :, None])
            dq[bi, :, hi, :] = sc * (ds @ kh)
            dk[bi, :, kv, :] += sc * (ds.T @ qh)
    return dq, dk, dv
