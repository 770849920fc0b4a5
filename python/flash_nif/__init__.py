"""flash_nif: exact FlashAttention forward (saving logsumexp) and backward.

Layout (identical in Python and Elixir):

=============  ===================  =========================================
tensor         shape                dtype
=============  ===================  =========================================
q, o, do, dq   [B, Sq, H, D]        float32, float16 or ml_dtypes.bfloat16
k, v, dk, dv   [B, Sk, Hkv, D]      same as q; H % Hkv == 0 (GQA / MQA)
lse            [B, H, Sq]           float32, natural log of each row's sum
=============  ===================  =========================================

``causal`` defaults to True and is aligned bottom-right (query i sees keys
j <= i + Sk - Sq); ``scale`` defaults to 1/sqrt(D). A row that sees no key gives
o = 0, lse = -inf and zero gradients. Arithmetic is f32 whatever the storage dtype.
Non-contiguous or byte-swapped inputs are copied to C order first, never misread.
"""

from __future__ import annotations

import numpy as np

from . import _native
from .errors import (
    CompileError,
    DeviceError,
    DTypeError,
    FlashAttentionError,
    InternalError,
    OutOfMemoryError,
    ShapeError,
    UnsupportedError,
)

__version__ = _native.info()["version"]

_DEVICES = (None, "cpu", "cuda")


def _host_array(x, name: str) -> np.ndarray:
    """A C-contiguous, native-byte-order NumPy array with x's values (a copy only if needed)."""
    if not isinstance(x, np.ndarray):
        raise DTypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    try:
        if not x.dtype.isnative:
            x = x.astype(x.dtype.newbyteorder("="))
        return np.ascontiguousarray(x)
    except MemoryError as e:
        raise OutOfMemoryError(f"cannot make a contiguous copy of {name} with shape {x.shape}") from e


def _check_options(causal, scale, device) -> None:
    if not isinstance(causal, (bool, np.bool_)):
        raise UnsupportedError(f"causal must be a bool, got {causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer))):
        raise UnsupportedError(f"scale must be a number or None, got {scale!r}")
    if device not in _DEVICES:
        raise UnsupportedError(f"device must be one of None, 'cpu', 'cuda'; got {device!r}")
    if device == "cuda":
        raise _native.cuda_unavailable("this build of flash_nif has no CUDA backend")


def forward_with_states(q, k, v, *, causal: bool = True, scale: float | None = None, device: str | None = None):
    """Attention output and log-sum-exp.

    q: [B, Sq, H, D]; k, v: [B, Sk, Hkv, D]. Returns (o [B, Sq, H, D] in q's dtype,
    lse [B, H, Sq] float32). Keep both for :func:`backward`.
    """
    _check_options(causal, scale, device)
    q, k, v = (_host_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    return _native.forward_cpu(q, k, v, bool(causal), None if scale is None else float(scale))


def forward(q, k, v, *, causal: bool = True, scale: float | None = None, device: str | None = None):
    """Attention output o [B, Sq, H, D] (q's dtype) for q [B, Sq, H, D], k, v [B, Sk, Hkv, D]."""
    return forward_with_states(q, k, v, causal=causal, scale=scale, device=device)[0]


def backward(do, q, k, v, o, lse, *, causal: bool = True, scale: float | None = None, device: str | None = None):
    """Gradients (dq [B, Sq, H, D], dk [B, Sk, Hkv, D], dv [B, Sk, Hkv, D]) in q's dtype.

    do is the gradient of the loss with respect to o; o and lse are what
    :func:`forward_with_states` returned for the same q, k, v and options.
    dk and dv sum over the query heads that share each kv head. Deterministic on CPU.
    """
    _check_options(causal, scale, device)
    arrays = [_host_array(x, n) for x, n in ((do, "do"), (q, "q"), (k, "k"), (v, "v"), (o, "o"), (lse, "lse"))]
    return _native.backward_cpu(*arrays, bool(causal), None if scale is None else float(scale))


def info() -> dict:
    """Version, available backends, CPU thread count and instruction set."""
    return dict(_native.info())


__all__ = [
    "forward",
    "forward_with_states",
    "backward",
    "info",
    "FlashAttentionError",
    "ShapeError",
    "DTypeError",
    "UnsupportedError",
    "OutOfMemoryError",
    "DeviceError",
    "CompileError",
    "InternalError",
]
