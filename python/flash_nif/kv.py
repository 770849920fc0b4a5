"""KV caches for decoding: the 4- and 8-bit affine quantized format, merging partial attention
states by their logsumexp, and decode itself.

``x [B, S, Hkv, D]`` (float32, float16 or ``ml_dtypes.bfloat16``) is stored per group of
``group_size`` (32 or 64) consecutive head-dim elements as codes ``q`` of ``bits`` (4 or 8) bits
with ``x ~ scale * q + bias``, ``scale = (max - min) / (2**bits - 1)``, ``bias = min`` (MLX's affine
format; ``reference.quantize_kv`` defines it bit for bit): :class:`QuantizedKV` holds ``values``
uint32 ``[B, S, Hkv, D * bits / 32]`` (codes packed from the lowest bits of each word up),
``scales`` and ``biases`` ``[B, S, Hkv, D / group_size]`` in x's dtype.

:func:`merge_states` combines the ``(o, lse)`` of attention over disjoint key sets (split caches,
cache plus new tokens) into the attention over their union.

:func:`decode` runs a few new queries against a plain or quantized cache.

Where they run: the backend follows the data. NumPy arrays run on the CPU unless ``device="cuda"``
(GPU 0: copied there and back); CuPy arrays and torch CUDA tensors (any DLPack producer on a GPU)
run on their GPU, on their library's current stream, with outputs of the same library on the same
device and nothing synchronised. Every array of a call lives in one place; a GPU asked for and
missing is a :class:`~flash_nif.DeviceError`, never a quiet CPU run. On a GPU, ``cache_seqlens`` and
``leftpad_k`` are copied to the host to be checked (like ``seqused_k``), and ``k_cache`` and
``v_cache`` must both be plain or both quantized with the same ``bits``.
"""

from __future__ import annotations

import numpy as np

from . import _args, _cuda, _native
from .errors import DeviceError, ShapeError, UnsupportedError

_PARTS = ("values", "scales", "biases")


class QuantizedKV:
    """A quantized cache: ``values``, ``scales``, ``biases`` (NumPy, CuPy or torch arrays, in one
    place), ``bits``, ``group_size``; ``shape`` is the cache's ``[B, S, Hkv, D]`` and ``dtype``
    its float dtype."""

    __slots__ = ("values", "scales", "biases", "bits", "group_size")

    def __init__(self, values, scales, biases, bits: int, group_size: int):
        self.values, self.scales, self.biases = values, scales, biases
        self.bits, self.group_size = bits, group_size

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (*tuple(self.values.shape[:3]), self.values.shape[3] * 32 // self.bits)

    @property
    def dtype(self):
        return self.scales.dtype

    def __repr__(self) -> str:
        return f"QuantizedKV(shape={self.shape}, dtype={self.dtype}, bits={self.bits}, group_size={self.group_size})"


def _int(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise UnsupportedError(f"{name} must be an int, got {x!r}")
    return int(x)


def _host_device(device) -> str:
    """The native device name of a NumPy call: None runs on the CPU (the core parses the rest)."""
    if device is not None and not isinstance(device, str):
        raise UnsupportedError(f"device must be None, 'cpu', 'cuda' or 'auto'; got {device!r}")
    return device or "cpu"


def _empty(t, shape, dtype_name: str):
    """An uninitialised array of t's library on t's device, of a dtype named as NumPy names it."""
    if t.kind == "torch":
        import torch

        return torch.empty(tuple(shape), dtype=getattr(torch, dtype_name), device=f"cuda:{t.device}")
    import cupy

    with cupy.cuda.Device(t.device):
        return cupy.empty(tuple(shape), dtype=dtype_name)


def _format_ok(d: int, bits: int, group_size: int) -> bool:
    return bits in (4, 8) and group_size in (32, 64) and d > 0 and d % group_size == 0


def quantize_kv(x, *, bits: int = 4, group_size: int = 64, device=None) -> QuantizedKV:
    """x ``[B, S, Hkv, D]`` -> :class:`QuantizedKV` (see the module doc), in x's place."""
    bits, group_size = _int("bits", bits), _int("group_size", group_size)
    if _cuda.any_gpu(x):
        return _quantize_gpu(x, bits, group_size, device)
    x = _args.host_array(x, "x")
    if x.ndim != 4:
        raise ShapeError(f"x must be [B, S, Hkv, D]; got shape {x.shape}")
    b, s, h, d = x.shape
    if _format_ok(d, bits, group_size):
        values = np.empty((b, s, h, d * bits // 32), np.uint32)
        scales = np.empty((b, s, h, d // group_size), x.dtype)
        biases = np.empty((b, s, h, d // group_size), x.dtype)
    else:  # the core says what is wrong
        values = scales = biases = np.empty((0, 0, 0, 0), np.uint32)
    _native.quantize_kv_host(x, values, scales, biases, bits=bits, group_size=group_size, device=_host_device(device))
    return QuantizedKV(values, scales, biases, bits, group_size)


def _quantize_gpu(x, bits, group_size, device):
    _cuda._check_device(device)
    t = _cuda._Tensors({"x": x})
    x = t["x"]
    outputs = [None] * 3
    if x.ndim == 4 and _format_ok(x.shape[3], bits, group_size):
        b, s, h, d = x.shape
        outputs = [_empty(t, (b, s, h, d * bits // 32), "uint32"), t.empty((b, s, h, d // group_size), x),
                   t.empty((b, s, h, d // group_size), x)]
    _native.cuda_quantize_kv_device(t.describe(x), [t.ptr(a) for a in outputs], t.device, t.stream, bits=bits,
                                    group_size=group_size)
    return QuantizedKV(*outputs, bits, group_size)


def dequantize_kv(cache: QuantizedKV, *, device=None):
    """:class:`QuantizedKV` -> ``[B, S, Hkv, D]`` in its scales' dtype (``scale * q + bias`` in
    float32, rounded to it), in the cache's place."""
    if not isinstance(cache, QuantizedKV):
        raise UnsupportedError(f"dequantize_kv takes a QuantizedKV (from quantize_kv), got {type(cache).__name__}")
    bits, group_size = _int("bits", cache.bits), _int("group_size", cache.group_size)
    parts = (cache.values, cache.scales, cache.biases)
    if _cuda.any_gpu(*parts):
        _cuda._check_device(device)
        t = _cuda._Tensors(dict(zip(_PARTS, parts)))
        v = t["values"]
        out = t.empty((*v.shape[:3], v.shape[3] * 32 // bits), t["scales"]) if v.ndim == 4 and bits in (4, 8) else None
        _native.cuda_dequantize_kv_device([t.describe(t[n]) for n in _PARTS], t.ptr(out), t.device, t.stream, bits=bits,
                                          group_size=group_size)
        return out
    parts = [_args.host_array(x, n) for x, n in zip(parts, _PARTS)]
    shape = parts[0].shape[:3] + (parts[0].shape[3] * 32 // bits,) if parts[0].ndim == 4 and bits in (4, 8) else (0,)
    out = np.empty(shape, parts[1].dtype)
    _native.dequantize_kv_host(*parts, out, bits=bits, group_size=group_size, device=_host_device(device))
    return out


def _stack(xs, name: str):
    """A sequence of parts as one [P, ...] array of their library (NumPy on the host)."""
    if not xs:
        return np.empty((0,))
    kinds = {_cuda._kind(x) for x in xs}
    if not _cuda.any_gpu(*xs):
        return np.stack([_args.host_array(x, name) for x in xs])
    if kinds == {"torch"}:
        import torch

        return torch.stack(list(xs))
    if kinds <= {"cupy", "cai", "dlpack"}:
        import cupy

        return cupy.stack([cupy.asarray(x) if _cuda._kind(x) != "dlpack" else cupy.from_dlpack(x) for x in xs])
    raise DeviceError(f"{name} must all live on one GPU with one array library; got {sorted(kinds)}")


def merge_states(o_parts, lse_parts, *, device=None):
    """``(o, lse)`` of attention over the union of disjoint key sets, from each set's ``o``
    ``[B, Sq, H, Dv]`` and ``lse`` ``[B, H, Sq]`` (float32): ``o_parts`` and ``lse_parts`` stacked
    ``[P, ...]`` or sequences of P arrays. ``lse = log(sum_p exp(lse_p))``, ``o = sum_p exp(lse_p -
    lse) o_p``; parts with ``lse = -inf`` weigh nothing, and a row no part saw gives ``o = 0``,
    ``lse = -inf``. ``o`` comes back in o_parts' dtype, in their place."""
    if isinstance(o_parts, (list, tuple)):
        o_parts = _stack(o_parts, "o_parts")
    if isinstance(lse_parts, (list, tuple)):
        lse_parts = _stack(lse_parts, "lse_parts")
    if _cuda.any_gpu(o_parts, lse_parts):
        _cuda._check_device(device)
        t = _cuda._Tensors({"o_parts": o_parts, "lse_parts": lse_parts})
        op = t["o_parts"]
        o = lse = None
        if op.ndim == 5:
            _, b, sq, h, dv = op.shape
            o, lse = t.empty((b, sq, h, dv), op), t.empty((b, h, sq), op, float32=True)
        _native.cuda_merge_states_device(t.describe(op), t.describe(t["lse_parts"]), [t.ptr(o), t.ptr(lse)], t.device,
                                         t.stream)
        return o, lse
    o_parts, lse_parts = _args.host_array(o_parts, "o_parts"), _args.host_array(lse_parts, "lse_parts")
    if o_parts.ndim == 5:
        _, b, sq, h, dv = o_parts.shape
        o, lse = np.empty((b, sq, h, dv), o_parts.dtype), np.empty((b, h, sq), np.float32)
    else:
        o = lse = np.empty((0,), np.float32)  # the core rejects the shape
    _native.merge_states_host(o_parts, lse_parts, o, lse, device=_host_device(device))
    return o, lse


def decode(q, k_cache, v_cache, *, cache_seqlens=None, leftpad_k=None, causal: bool = True, scale=None, window=None,
           softcap=None, num_splits=None, device=None):
    """``(o, lse)`` of a few new queries ``q [B, Sq, H, D]`` (Sq = 1 .. 16) against a KV cache
    ``[B, S_cache, Hkv, D]``: arrays in q's dtype, or :class:`QuantizedKV` (read quantized, no
    dequantized copy; scales in q's dtype). Row b's valid keys are ``[leftpad_k[b],
    cache_seqlens[b])`` (int32 ``[B]``; defaults 0 and S_cache); causal and the window are aligned
    to their end, so the last query sees every valid key; ``softcap`` as in
    :func:`flash_nif.forward`. The keys of each row are split ``num_splits`` ways (None: chosen
    from the sizes and, on a GPU, its SM count) and the parts merged by their logsumexp. A row with
    no valid key gives ``o = 0``, ``lse = -inf``. Where it runs: see the module doc."""
    if not isinstance(causal, (bool, np.bool_)):
        raise UnsupportedError(f"causal must be a bool, got {causal!r}")
    opts = dict(causal=bool(causal), scale=None if scale is None else float(scale),
                softcap=None if softcap is None else float(softcap),
                num_splits=None if num_splits is None else _int("num_splits", num_splits))
    opts["window_left"], opts["window_right"] = (None, None) if window is None else _window(window)
    caches = {}  # name -> (arrays, (bits, group_size) or None)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if isinstance(c, QuantizedKV):
            caches[name] = ([c.values, c.scales, c.biases], (_int("bits", c.bits), _int("group_size", c.group_size)))
        else:
            caches[name] = ([c], None)
    fast = _decode_torch(q, caches, (cache_seqlens, leftpad_k), opts, device)
    if fast is not None:
        return fast
    rows = {n: x for n, x in (("cache_seqlens", cache_seqlens), ("leftpad_k", leftpad_k)) if x is not None}
    if _cuda.any_gpu(q, *caches["k_cache"][0], *caches["v_cache"][0], *rows.values()):
        return _decode_gpu(q, caches, rows, opts, device)
    arrays = {n: [_args.host_array(x, f"{n}.{p}" if quant else n) for x, p in zip(xs, _PARTS)]
              for n, (xs, quant) in caches.items()}
    q = _args.host_array(q, "q")
    if q.ndim != 4:
        raise ShapeError(f"q must be [B, Sq, H, D]; got shape {q.shape}")
    b, sq, h, _ = q.shape
    k0 = arrays["k_cache"][0]
    s_cache = k0.shape[1] if k0.ndim == 4 else 0
    seqlens = (_args.host_int32(rows["cache_seqlens"], "cache_seqlens") if "cache_seqlens" in rows
               else np.full(b, s_cache, np.int32))
    leftpad = _args.host_int32(rows["leftpad_k"], "leftpad_k") if "leftpad_k" in rows else np.zeros(b, np.int32)
    o, lse = np.empty(q.shape, q.dtype), np.empty((b, h, sq), np.float32)
    _native.decode_host(q, arrays["k_cache"], arrays["v_cache"], seqlens, leftpad, o, lse, k_quant=caches["k_cache"][1],
                        v_quant=caches["v_cache"][1], device=_host_device(device), **opts)
    return o, lse


def _decode_torch(q, caches, rows, opts, device):
    """decode's common torch call in few Python steps (its host time is on the critical path of a
    decode loop: a few tens of microseconds of kernel per token): q and every cache part (decode's
    `caches`) contiguous CUDA tensors of q's device, the row bounds absent or int32 tensors there
    too. Anything else returns None, and the general path (_decode_gpu) converts or raises; both
    make the same native call."""
    if _cuda._kind(q) != "torch" or q.ndim != 4 or device not in (None, "cuda", "auto"):
        return None
    dev, tensor = q.get_device(), type(q)
    names = _cuda._DTYPE_NAMES
    (k_parts, k_quant), (v_parts, v_quant) = caches["k_cache"], caches["v_cache"]
    descs = []
    for a in (q, *k_parts, *v_parts):
        if type(a) is not tensor or not a.is_cuda or a.get_device() != dev or not a.is_contiguous():
            return None
        name = names.get(a.dtype) or _cuda._dtype_name(a, "torch")
        descs.append((a.data_ptr(), a.shape, name))
    bounds = []
    for r in rows:
        if r is None:
            bounds.append(None)
            continue
        if (type(r) is not tensor or not r.is_cuda or r.get_device() != dev or names.get(r.dtype) != "int32"
                or not r.is_contiguous()):
            return None
        bounds.append((r.data_ptr(), np.ascontiguousarray(r.cpu().numpy())))  # the kernel's, the checks' copy
    b, sq, h, _ = q.shape
    o = q.new_empty(q.shape)
    lse = q.new_empty((b, h, sq), dtype=_torch_float32())
    n = len(k_parts)
    _native.cuda_decode_device(descs[0], descs[1:1 + n], descs[1 + n:], tuple(bounds), [o.data_ptr(), lse.data_ptr()], dev,
                               _cuda._torch_stream(dev), k_quant=k_quant, v_quant=v_quant, **opts)
    return o, lse


def _torch_float32():
    import torch

    return torch.float32


def _decode_gpu(q, caches, rows, opts, device):
    _cuda._check_device(device)
    names = {n: [n] if quant is None else [f"{n}.{p}" for p in _PARTS] for n, (_, quant) in caches.items()}
    t = _cuda._Tensors({"q": q, **{m: x for n, (xs, _) in caches.items() for m, x in zip(names[n], xs)}, **rows})
    q = t["q"]
    bounds = []
    for name in ("cache_seqlens", "leftpad_k"):
        if name in rows:
            a = t.int32(t[name], name)
            bounds.append((t.ptr(a), t.host_int32(a, name)))  # the kernel's, and the checks' copy
        else:
            bounds.append(None)
    o = lse = None
    if q.ndim == 4:  # the core rejects any other shape
        b, sq, h, _ = q.shape
        o, lse = t.empty(q.shape, q), t.empty((b, h, sq), q, float32=True)
    k, v = ([t.describe(t[m]) for m in names[n]] for n in ("k_cache", "v_cache"))
    _native.cuda_decode_device(t.describe(q), k, v, tuple(bounds), [t.ptr(o), t.ptr(lse)], t.device, t.stream,
                               k_quant=caches["k_cache"][1], v_quant=caches["v_cache"][1], **opts)
    return o, lse


def _window(window):
    if not (isinstance(window, tuple) and len(window) == 2 and all(x is None or (_is_nonneg_int(x)) for x in window)):
        raise UnsupportedError(f"window must be a (left, right) tuple of non-negative ints or None; got {window!r}")
    return tuple(None if x is None else int(x) for x in window)


def _is_nonneg_int(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, np.integer)) and x >= 0


__all__ = ["QuantizedKV", "quantize_kv", "dequantize_kv", "merge_states", "decode"]
