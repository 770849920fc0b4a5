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

from . import _cuda  # GPU arrays (CuPy, torch, DLPack) dispatch
from . import _native
from . import errors, reference  # reference: the float64 oracle, flash_nif.reference.forward(...)
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


def _options(causal, scale, device) -> tuple[bool, float | None, str]:
    """Checks the keyword options' Python types; the core checks their values."""
    if not isinstance(causal, (bool, np.bool_)):
        raise UnsupportedError(f"causal must be a bool, got {causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer))):
        raise UnsupportedError(f"scale must be a number or None, got {scale!r}")
    if device is not None and not isinstance(device, str):
        raise UnsupportedError(f"device must be None, 'cpu', 'cuda' or 'auto'; got {device!r}")
    # NumPy data runs on the CPU unless a device is asked for by name.
    return bool(causal), None if scale is None else float(scale), device or "cpu"


def forward_with_states(q, k, v, *, causal: bool = True, scale: float | None = None, device: str | None = None):
    """Attention output and log-sum-exp.

    q: [B, Sq, H, D]; k, v: [B, Sk, Hkv, D]. Returns (o [B, Sq, H, D] in q's dtype,
    lse [B, H, Sq] float32). Keep both for :func:`backward`.
    """
    opts = _options(causal, scale, device)
    if _cuda.any_gpu(q, k, v):
        return _cuda.forward_with_states(q, k, v, opts[0], opts[1], device)
    q, k, v = (_host_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    return _native.forward_host_arrays([q, k, v], opts[2], causal=opts[0], scale=opts[1])


def forward(q, k, v, *, causal: bool = True, scale: float | None = None, device: str | None = None):
    """Attention output o [B, Sq, H, D] (q's dtype) for q [B, Sq, H, D], k, v [B, Sk, Hkv, D]."""
    return forward_with_states(q, k, v, causal=causal, scale=scale, device=device)[0]


def backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    *,
    causal: bool = True,
    scale: float | None = None,
    device: str | None = None,
    deterministic: bool = False,
):
    """Gradients (dq [B, Sq, H, D], dk [B, Sk, Hkv, D], dv [B, Sk, Hkv, D]) in q's dtype.

    do is the gradient of the loss with respect to o; o and lse are what
    :func:`forward_with_states` returned for the same q, k, v and options.
    dk and dv sum over the query heads that share each kv head.

    The CPU backward is always bit-identical run to run (and across thread counts). On a GPU the
    default sums dQ with float32 atomics (faster; dq may differ in its last bits from run to run,
    dk and dv never do); ``deterministic=True`` takes the atomic-free path instead.
    """
    opts = _options(causal, scale, device)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise UnsupportedError(f"deterministic must be a bool, got {deterministic!r}")
    if _cuda.any_gpu(do, q, k, v, o, lse):
        return _cuda.backward(do, q, k, v, o, lse, opts[0], opts[1], device, bool(deterministic))
    arrays = [_host_array(x, n) for x, n in ((do, "do"), (q, "q"), (k, "k"), (v, "v"), (o, "o"), (lse, "lse"))]
    return _native.backward_host_arrays(arrays, opts[2], causal=opts[0], scale=opts[1], deterministic=bool(deterministic))


def info() -> dict:
    """Version, available backends, CPU thread count and instruction set, and the GPU (if any)."""
    return {**dict(_native.info()), "cuda": _cuda.info()}


def cuda_available() -> bool:
    """Whether the GPU backend can run here (``info()["backends"]`` lists ``"cuda"``): the build
    has it, the driver sees a GPU and NVRTC is found; ``device="auto"`` then picks the GPU."""
    return "cuda" in _native.info()["backends"]


__all__ = [
    "forward",
    "forward_with_states",
    "backward",
    "info",
    "cuda_available",
    "reference",
    *errors.__all__,
]
