"""Rotary position embeddings (RoPE), forward and backward, on the CPU and on a GPU.

=============  ==================  ==================================================
tensor         shape               dtype
=============  ==================  ==================================================
x, y, dy, dx   [B, S, H, D]        float32, float16 or ml_dtypes.bfloat16
cos, sin       [max_pos, R/2]      float32; they rotate the first R = 2 * cos.shape[1]
                                   <= D dims of every head, the rest pass through
positions      [B, S]              int32 (another integer dtype is converted when its
                                   values fit), or an int offset
=============  ==================  ==================================================

Row ``(b, s)`` takes table row ``p = positions[b, s]`` (packed documents, decode with ragged
caches), or ``s + positions`` for an int offset (decode after a cache of that length; ``None`` = 0).
Every position must lie in ``[0, max_pos)``: anything else is an error, never a read past the
tables. Angle ``i`` turns the pair ``(a, b) = (i, i + R/2)`` (half-split, GPT-NeoX, the default) or
``(2i, 2i + 1)`` (``interleaved=True``, GPT-J)::

    y[a] = x[a] cos[p, i] - x[b] sin[p, i]        y[b] = x[b] cos[p, i] + x[a] sin[p, i]

:func:`backward` is the transpose, a rotation by -theta: the gradient of :func:`apply`'s input
given its output's gradient, and its inverse (``backward(apply(x)) == x`` up to rounding).
Arithmetic is float32; results come back in x's dtype, as a new array of x's library on x's
device (NumPy on the CPU unless ``device="cuda"``; CuPy and torch arrays on their GPU, on their
current stream, nothing synchronised). A ``positions`` array on a GPU is copied to the host to be
checked (like ``seqused_k``); an int offset costs nothing. :func:`tables` builds cos and sin.
"""

from __future__ import annotations

import numpy as np

from . import _args, _cuda, _native
from .errors import UnsupportedError

_I64 = np.iinfo(np.int64)


def tables(max_pos: int, rotary_dim: int, *, base: float = 10000.0, dtype=np.float32):
    """(cos, sin) ``[max_pos, rotary_dim / 2]``: angle ``i`` of position ``p`` is
    ``p * base ** (-2i / rotary_dim)`` (computed in float64, then cast to ``dtype``)."""
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)) or rotary_dim < 2 or rotary_dim % 2:
        raise UnsupportedError(f"rotary_dim must be an even integer >= 2; got {rotary_dim!r}")
    if isinstance(max_pos, bool) or not isinstance(max_pos, (int, np.integer)) or max_pos < 0:
        raise UnsupportedError(f"max_pos must be a non-negative integer; got {max_pos!r}")
    half = int(rotary_dim) // 2
    inv_freq = float(base) ** (-np.arange(half, dtype=np.float64) / half)
    angles = np.arange(int(max_pos), dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def apply(x, cos, sin, *, interleaved: bool = False, positions=None, device: str | None = None):
    """y = RoPE(x): x ``[B, S, H, D]`` rotated by the table rows of its positions (see the module
    doc); y has x's shape, dtype, library and device."""
    return _rotary(x, cos, sin, interleaved, positions, device, backward=False)


def backward(dy, cos, sin, *, interleaved: bool = False, positions=None, device: str | None = None):
    """dx, the gradient of :func:`apply`'s x given dy (its output's gradient), with the forward's
    tables and options: the rotation by -theta."""
    return _rotary(dy, cos, sin, interleaved, positions, device, backward=True)


def _options(interleaved, positions, device):
    """(native keyword options, the positions array or None)."""
    if not isinstance(interleaved, (bool, np.bool_)):
        raise UnsupportedError(f"interleaved must be a bool, got {interleaved!r}")
    if device is not None and not isinstance(device, str):
        raise UnsupportedError(f"device must be None, 'cpu', 'cuda' or 'auto'; got {device!r}")
    opts = {"interleaved": bool(interleaved)}
    if positions is None or isinstance(positions, (bool, np.bool_)):
        if positions is not None:
            raise UnsupportedError(f"positions must be None, an int offset or an int32 array [B, S]; got {positions!r}")
        return opts, None
    if isinstance(positions, (int, np.integer)):
        if not _I64.min <= int(positions) <= _I64.max:
            raise UnsupportedError(f"positions offset {positions} does not fit a 64-bit integer")
        return {**opts, "offset": int(positions)}, None  # the core checks 0 <= offset, offset + S <= max_pos
    return opts, positions


def _rotary(x, cos, sin, interleaved, positions, device, backward):
    name = "dy" if backward else "x"
    opts, array = _options(interleaved, positions, device)
    opts["backward"] = backward
    if _cuda.any_gpu(x, cos, sin, *([] if array is None else [array])):
        return _gpu(name, x, cos, sin, array, opts, device)
    arrays = [_args.host_array(a, n) for a, n in ((x, name), (cos, "cos"), (sin, "sin"))]
    if array is not None:
        opts["positions"] = _args.host_int32(array, "positions")
    return _native.rotary_host_arrays(arrays, device or "cpu", **opts)


def _gpu(name, x, cos, sin, positions, opts, device):
    _cuda._check_device(device)
    t = _cuda._Tensors({name: x, "cos": cos, "sin": sin, **({} if positions is None else {"positions": positions})})
    desc = [t.describe(t[n]) for n in (name, "cos", "sin")]  # the core validates shapes and dtypes
    xx = t[name]
    y = t.empty(xx.shape, xx) if xx.ndim == 4 else None
    if positions is not None:
        p = t.int32(t["positions"], "positions")
        opts["positions"] = (t.ptr(p), t.host_int32(p, "positions"))  # the kernel's and the check's
    _native.cuda_rotary_device(desc, t.ptr(y), t.device, t.stream, **opts)
    return y


__all__ = ["apply", "backward", "tables"]
