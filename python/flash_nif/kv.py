"""KV caches for decoding: the 4- and 8-bit affine quantized format, and merging partial attention
states by their logsumexp.

``x [B, S, Hkv, D]`` (float32, float16 or ``ml_dtypes.bfloat16``) is stored per group of
``group_size`` (32 or 64) consecutive head-dim elements as codes ``q`` of ``bits`` (4 or 8) bits
with ``x ~ scale * q + bias``, ``scale = (max - min) / (2**bits - 1)``, ``bias = min`` (MLX's affine
format; ``reference.quantize_kv`` defines it bit for bit): :class:`QuantizedKV` holds ``values``
uint32 ``[B, S, Hkv, D * bits / 32]`` (codes packed from the lowest bits of each word up),
``scales`` and ``biases`` ``[B, S, Hkv, D / group_size]`` in x's dtype.

:func:`merge_states` combines the ``(o, lse)`` of attention over disjoint key sets (split caches,
cache plus new tokens) into the attention over their union.

:func:`decode` runs a few new queries against a plain or quantized cache. These run on the CPU
with NumPy arrays; their GPU versions are not built yet (a GPU array is an ``UnsupportedError``).
"""

from __future__ import annotations

import numpy as np

from . import _args, _cuda, _native
from .errors import ShapeError, UnsupportedError


class QuantizedKV:
    """A quantized cache: ``values``, ``scales``, ``biases`` (NumPy arrays), ``bits``,
    ``group_size``; ``shape`` is the cache's ``[B, S, Hkv, D]`` and ``dtype`` its float dtype."""

    __slots__ = ("values", "scales", "biases", "bits", "group_size")

    def __init__(self, values, scales, biases, bits: int, group_size: int):
        self.values, self.scales, self.biases = values, scales, biases
        self.bits, self.group_size = bits, group_size

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (*self.values.shape[:3], self.values.shape[3] * 32 // self.bits)

    @property
    def dtype(self):
        return self.scales.dtype

    def __repr__(self) -> str:
        return f"QuantizedKV(shape={self.shape}, dtype={self.dtype}, bits={self.bits}, group_size={self.group_size})"


def _cpu_only(what: str, *xs) -> None:
    if _cuda.any_gpu(*xs):
        raise UnsupportedError(f"{what} runs on the CPU with NumPy arrays for now; the GPU version is not built yet")


def _int(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise UnsupportedError(f"{name} must be an int, got {x!r}")
    return int(x)


def quantize_kv(x, *, bits: int = 4, group_size: int = 64) -> QuantizedKV:
    """x ``[B, S, Hkv, D]`` -> :class:`QuantizedKV` (see the module doc)."""
    _cpu_only("quantize_kv", x)
    x = _args.host_array(x, "x")
    bits, group_size = _int("bits", bits), _int("group_size", group_size)
    if x.ndim != 4:
        raise ShapeError(f"x must be [B, S, Hkv, D]; got shape {x.shape}")
    b, s, h, d = x.shape
    if bits not in (4, 8) or group_size not in (32, 64) or d % group_size:  # the core says which
        values = scales = biases = np.empty((0, 0, 0, 0), np.uint32)
    else:
        values = np.empty((b, s, h, d * bits // 32), np.uint32)
        scales = np.empty((b, s, h, d // group_size), x.dtype)
        biases = np.empty((b, s, h, d // group_size), x.dtype)
    _native.quantize_kv_host(x, values, scales, biases, bits=bits, group_size=group_size)
    return QuantizedKV(values, scales, biases, bits, group_size)


def dequantize_kv(cache: QuantizedKV) -> np.ndarray:
    """:class:`QuantizedKV` -> ``[B, S, Hkv, D]`` in its scales' dtype (``scale * q + bias`` in
    float32, rounded to it)."""
    if not isinstance(cache, QuantizedKV):
        raise UnsupportedError(f"dequantize_kv takes a QuantizedKV (from quantize_kv), got {type(cache).__name__}")
    _cpu_only("dequantize_kv", cache.values, cache.scales, cache.biases)
    parts = [_args.host_array(x, n) for x, n in ((cache.values, "values"), (cache.scales, "scales"), (cache.biases, "biases"))]
    shape = parts[0].shape[:3] + (parts[0].shape[3] * 32 // cache.bits,) if parts[0].ndim == 4 and cache.bits in (4, 8) else (0,)
    out = np.empty(shape, parts[1].dtype)
    _native.dequantize_kv_host(*parts, out, bits=_int("bits", cache.bits), group_size=_int("group_size", cache.group_size))
    return out


def merge_states(o_parts, lse_parts):
    """``(o, lse)`` of attention over the union of disjoint key sets, from each set's ``o``
    ``[B, Sq, H, Dv]`` and ``lse`` ``[B, H, Sq]`` (float32): ``o_parts`` and ``lse_parts`` stacked
    ``[P, ...]`` or sequences of P arrays. ``lse = log(sum_p exp(lse_p))``, ``o = sum_p exp(lse_p -
    lse) o_p``; parts with ``lse = -inf`` weigh nothing, and a row no part saw gives ``o = 0``,
    ``lse = -inf``. ``o`` comes back in o_parts' dtype."""
    if isinstance(o_parts, (list, tuple)):
        _cpu_only("merge_states", *o_parts)
        o_parts = np.stack([_args.host_array(x, "o_parts") for x in o_parts]) if o_parts else np.empty((0,))
    if isinstance(lse_parts, (list, tuple)):
        _cpu_only("merge_states", *lse_parts)
        lse_parts = np.stack([_args.host_array(x, "lse_parts") for x in lse_parts]) if lse_parts else np.empty((0,))
    _cpu_only("merge_states", o_parts, lse_parts)
    o_parts, lse_parts = _args.host_array(o_parts, "o_parts"), _args.host_array(lse_parts, "lse_parts")
    if o_parts.ndim == 5:
        _, b, sq, h, dv = o_parts.shape
        o, lse = np.empty((b, sq, h, dv), o_parts.dtype), np.empty((b, h, sq), np.float32)
    else:
        o = lse = np.empty((0,), np.float32)  # the core rejects the shape
    _native.merge_states_host(o_parts, lse_parts, o, lse)
    return o, lse


def decode(q, k_cache, v_cache, *, cache_seqlens=None, leftpad_k=None, causal: bool = True, scale=None, window=None,
           softcap=None, num_splits=None, device=None):
    """``(o, lse)`` of a few new queries ``q [B, Sq, H, D]`` (Sq = 1 .. 16) against a KV cache
    ``[B, S_cache, Hkv, D]``: arrays in q's dtype, or :class:`QuantizedKV` (read quantized, no
    dequantized copy; scales in q's dtype). Row b's valid keys are ``[leftpad_k[b],
    cache_seqlens[b])`` (int32 ``[B]``; defaults 0 and S_cache); causal and the window are aligned
    to their end, so the last query sees every valid key; ``softcap`` as in
    :func:`flash_nif.forward`. The keys of each row are split ``num_splits`` ways (None: chosen
    from the sizes) and the parts merged by their logsumexp. A row with no valid key gives
    ``o = 0``, ``lse = -inf``. CPU only for now (``device`` None or "cpu")."""
    if device not in (None, "cpu"):
        raise UnsupportedError(f"decode runs on the CPU for now (device None or 'cpu'); got device={device!r}")
    caches = []
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if isinstance(c, QuantizedKV):
            _cpu_only("decode", c.values, c.scales, c.biases)
            parts = [_args.host_array(x, n) for x, n in ((c.values, "values"), (c.scales, "scales"), (c.biases, "biases"))]
            caches.append((parts, (_int("bits", c.bits), _int("group_size", c.group_size))))
        else:
            _cpu_only("decode", c)
            caches.append(([_args.host_array(c, name)], None))
    _cpu_only("decode", q)
    q = _args.host_array(q, "q")
    if q.ndim != 4:
        raise ShapeError(f"q must be [B, Sq, H, D]; got shape {q.shape}")
    b, sq, h, _ = q.shape
    s_cache = caches[0][0][0].shape[1] if caches[0][0][0].ndim == 4 else 0
    seqlens = np.full(b, s_cache, np.int32) if cache_seqlens is None else _args.host_int32(cache_seqlens, "cache_seqlens")
    leftpad = np.zeros(b, np.int32) if leftpad_k is None else _args.host_int32(leftpad_k, "leftpad_k")
    left, right = (None, None) if window is None else _window(window)
    o, lse = np.empty(q.shape, q.dtype), np.empty((b, h, sq), np.float32)
    _native.decode_host(q, caches[0][0], caches[1][0], seqlens, leftpad, o, lse, k_quant=caches[0][1], v_quant=caches[1][1],
                        causal=bool(causal), scale=None if scale is None else float(scale), window_left=left,
                        window_right=right, softcap=None if softcap is None else float(softcap),
                        num_splits=None if num_splits is None else _int("num_splits", num_splits))
    return o, lse


def _window(window):
    if not (isinstance(window, tuple) and len(window) == 2 and all(x is None or (_is_nonneg_int(x)) for x in window)):
        raise UnsupportedError(f"window must be a (left, right) tuple of non-negative ints or None; got {window!r}")
    return tuple(None if x is None else int(x) for x in window)


def _is_nonneg_int(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, np.integer)) and x >= 0


__all__ = ["QuantizedKV", "quantize_kv", "dequantize_kv", "merge_states", "decode"]
