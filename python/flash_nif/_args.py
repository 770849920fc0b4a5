"""Arguments of the public functions: Python types checked, arrays converted for ``_native``.

The core validates values (shapes, dtypes, ranges) and names the argument in its messages; this
module checks only what the core cannot see (Python types) and does the friendly conversions:
NumPy arrays to C order (the attention inputs of a CPU call only where the core cannot read the
view in place: :func:`host_view`), integer index arrays to int32. Shared by ``flash_nif`` (padded calls),
``flash_nif.varlen`` and ``flash_nif._cuda`` (GPU arrays).
"""

from __future__ import annotations

import numpy as np

from .errors import DTypeError, OutOfMemoryError, UnsupportedError

# The mask arrays of a padded call, by the names the core's messages use for them.
SEGMENT_NAMES = ("segment_ids[0]", "segment_ids[1]")  # [B, Sq], [B, Sk] int32
INDEX_NAMES = ("seqused_k", "leftpad_k")  # [B] int32, read on the host (they bound the grid)
BLOCK_NAME = "block_mask"  # bool / uint8 [B or 1, H or 1, ceil(Sq/128), ceil(Sk/128)]
CU_NAMES = ("cu_seqlens_q", "cu_seqlens_k")  # varlen: [B + 1] int32, read on the host
MOD_NAMES = ("alibi_slopes", "sinks")  # float32 [H] or [B, H], and [H]: copied to the host

_INT32 = np.iinfo(np.int32)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


MODES = ("auto", "fused", "materialized")
PRECISIONS = ("exact", "tf32")


def options(causal, scale, window, device, deterministic=None, *, mode="auto", precision="exact") -> tuple[dict, str]:
    """(the native keyword options, the host device name). ``deterministic`` only for backward."""
    if not isinstance(causal, (bool, np.bool_)):
        raise UnsupportedError(f"causal must be a bool, got {causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer))):
        raise UnsupportedError(f"scale must be a number or None, got {scale!r}")
    if device is not None and not isinstance(device, str):
        raise UnsupportedError(f"device must be None, 'cpu', 'cuda' or 'auto'; got {device!r}")
    if window is not None and not (
        isinstance(window, tuple) and len(window) == 2 and all(s is None or _is_int(s) for s in window)
    ):
        raise UnsupportedError(f"window must be a (left, right) tuple of non-negative ints or None; got {window!r}")
    if mode not in MODES:  # also rejects non-strings
        raise UnsupportedError(f"mode must be 'auto', 'fused' or 'materialized'; got {mode!r}")
    if precision not in PRECISIONS:  # also rejects non-strings
        raise UnsupportedError(f"precision must be 'exact' or 'tf32'; got {precision!r}")
    opts = {"causal": bool(causal), "scale": None if scale is None else float(scale), "mode": mode,
            "precision": precision}
    if window is not None:  # the core checks the sides are >= 0
        opts["window"] = tuple(None if s is None else int(s) for s in window)
    if deterministic is not None:
        if not isinstance(deterministic, (bool, np.bool_)):
            raise UnsupportedError(f"deterministic must be a bool, got {deterministic!r}")
        opts["deterministic"] = bool(deterministic)
    # NumPy data runs on the CPU unless a device is asked for by name.
    return opts, device or "cpu"


def _is_number(x) -> bool:
    return not isinstance(x, (bool, np.bool_)) and isinstance(x, (int, float, np.floating, np.integer))


def modifiers(softcap, alibi_slopes, sinks) -> dict:
    """The native keyword arguments of the score modifiers given: ``softcap`` a float, the
    ``alibi_slopes`` / ``sinks`` arrays (NumPy, CuPy or torch, any device) as float32 NumPy copies:
    they are tiny, and the core reads their values."""
    if softcap is not None and not _is_number(softcap):
        raise UnsupportedError(f"softcap must be a number or None, got {softcap!r}")
    kw = {} if softcap is None else {"softcap": float(softcap)}
    for name, x in zip(MOD_NAMES, (alibi_slopes, sinks)):
        if x is not None:
            kw[name] = host_float32(x, name)
    return kw


def host_float32(x, name: str) -> np.ndarray:
    """A float32 NumPy copy of a small array from NumPy, CuPy or torch (a list too); another real
    dtype is converted, any other is passed on for the core's DTypeError."""
    module = type(x).__module__.split(".")[0]
    if module == "cupy":
        x = x.get()
    elif module == "torch":
        x = x.detach().float().cpu().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    elif not isinstance(x, np.ndarray):
        try:
            x = np.asarray(x)
        except (TypeError, ValueError) as e:
            raise DTypeError(f"{name} must be an array of float32, got {type(x).__name__}") from e
    x = host_array(x, name)
    return x.astype(np.float32) if x.dtype.kind in "fiu" and x.dtype != np.float32 else x


def masks(segment_ids, seqused_k, leftpad_k, block_mask) -> dict:
    """The mask arrays given (None = not given), by name (SEGMENT_NAMES, INDEX_NAMES, BLOCK_NAME)."""
    named = {}
    if segment_ids is not None:
        if not (isinstance(segment_ids, tuple) and len(segment_ids) == 2):
            got = f"a tuple of {len(segment_ids)}" if isinstance(segment_ids, tuple) else type(segment_ids).__name__
            raise UnsupportedError(f"segment_ids must be a (seg_q, seg_k) tuple of arrays; got {got}")
        named.update(zip(SEGMENT_NAMES, segment_ids))
    named.update((n, x) for n, x in zip(INDEX_NAMES, (seqused_k, leftpad_k)) if x is not None)
    if block_mask is not None:
        named[BLOCK_NAME] = block_mask
    return named


def mask_kwargs(named: dict, *, int32, place, index) -> dict:
    """The native keyword arguments of the masks in ``named`` (see :func:`masks`). Each array goes
    through ``place(x, name)`` (a host array, or a GPU array's description); segment ids first
    through ``int32(x, name)``; seqused_k / leftpad_k through ``index(x, name)`` (a host int32 copy)."""
    kw = {}
    if SEGMENT_NAMES[0] in named:
        kw["segment_ids"] = tuple(place(int32(named[n], n), n) for n in SEGMENT_NAMES)
    kw.update((n, index(named[n], n)) for n in INDEX_NAMES if n in named)
    if BLOCK_NAME in named:
        kw[BLOCK_NAME] = place(named[BLOCK_NAME], BLOCK_NAME)
    return kw


def host_array(x, name: str) -> np.ndarray:
    """A C-contiguous, native-byte-order NumPy array with x's values (a copy only if needed)."""
    if not isinstance(x, np.ndarray):
        raise DTypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    try:
        if not x.dtype.isnative:
            x = x.astype(x.dtype.newbyteorder("="))
        return np.ascontiguousarray(x)
    except MemoryError as e:
        raise OutOfMemoryError(f"cannot make a contiguous copy of {name} with shape {x.shape}") from e


def readable_view(x: np.ndarray) -> bool:
    """Whether the CPU kernels read ``x`` in place: native byte order, strides that are
    non-negative multiples of the itemsize, the last axis contiguous (any stride where it has
    length 1). The binding (``HostArray::extract_view``) checks the same."""
    item = x.dtype.itemsize
    if not x.dtype.isnative or item == 0:
        return False
    if any(s < 0 or s % item for s in x.strides):
        return False
    return x.ndim == 0 or x.shape[-1] <= 1 or x.strides[-1] == item


def host_view(x, name: str) -> np.ndarray:
    """An attention input (q, k, v, o, do) of a host call: a view the kernels read in place (a
    ``[B, H, S, D]`` transpose, one slice of a packed qkv, a batch slice) is passed as it is, with
    no copy (with ``device="cuda"`` its span is uploaded as it lies); anything else as
    :func:`host_array`."""
    if isinstance(x, np.ndarray) and readable_view(x):
        return x
    return host_array(x, name)


def optional_host(x, name: str):
    """``host_array`` of an optional array argument (None stays None)."""
    return None if x is None else host_array(x, name)


def check_int32_range(name: str, dtype, lo: int, hi: int) -> None:
    """Values [lo, hi] of an integer array of another dtype must fit int32 to be converted."""
    if lo < _INT32.min or hi > _INT32.max:
        raise DTypeError(f"{name} has dtype {dtype} and values in [{lo}, {hi}], outside int32's range; it must be int32")


def host_int32(x, name: str) -> np.ndarray:
    """``host_array`` of an int32 argument: another integer dtype is converted when its values fit
    int32; any other dtype is passed on for the core's DTypeError."""
    x = host_array(x, name)
    if x.dtype.kind in "iu" and x.dtype != np.int32:
        if x.size:
            check_int32_range(name, x.dtype, int(x.min()), int(x.max()))
        x = x.astype(np.int32)
    return x


def host_masks(named: dict) -> dict:
    """The native keyword arguments of NumPy mask arrays."""
    return mask_kwargs(named, int32=host_int32, place=host_array, index=host_int32)
