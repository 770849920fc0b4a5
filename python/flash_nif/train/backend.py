"""Where the trainer's arrays live and which attention kernels it calls.

The model code never imports NumPy or CuPy directly: it asks `xp_of(array)` for the array module
of its inputs, so one code path serves the CPU (NumPy) and the GPU (CuPy). Attention is an
injectable pair of functions, `Attention.forward(q, k, v) -> (o, lse)` and
`Attention.backward(do, q, k, v, o, lse) -> (dq, dk, dv)`, with the tensor conventions of
flash_nif ([B, S, H, D], lse [B, H, S] float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


class SetupError(RuntimeError):
    """A requested device or attention backend cannot be used (reported without a traceback)."""


def xp_of(array: Any):
    """The array module (numpy or cupy) that owns `array`."""
    if isinstance(array, np.ndarray) or np.isscalar(array):
        return np
    module = type(array).__module__.split(".")[0]
    if module == "cupy":
        import cupy

        return cupy
    return np


def to_host(array: Any) -> np.ndarray:
    """A NumPy copy (or view) of a NumPy or CuPy array."""
    if isinstance(array, np.ndarray):
        return array
    return array.get()


@dataclass(frozen=True)
class Device:
    """`name` is "cpu" or "cuda"; `xp` is numpy or cupy."""

    name: str
    xp: Any

    def put(self, array: np.ndarray):
        """Move a host array onto this device (no copy on the CPU)."""
        return array if self.xp is np else self.xp.asarray(array)


def get_device(name: str) -> Device:
    """The CPU, or the GPU through CuPy -- never a silent fallback from cuda to cpu."""
    if name == "cpu":
        return Device("cpu", np)
    if name != "cuda":
        raise SetupError(f"unknown device {name!r} (choose cpu or cuda)")
    try:
        import cupy
    except ImportError as exc:
        raise SetupError(
            "--device cuda needs CuPy (pip install cupy-cuda12x or cupy-cuda13x); "
            f"importing it failed: {exc}"
        ) from None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise SetupError("--device cuda: CuPy sees no CUDA device")
    except SetupError:
        raise
    except Exception as exc:  # CUDARuntimeError when no driver is present
        raise SetupError(f"--device cuda: no usable CUDA device ({exc})") from None
    return Device("cuda", cupy)


@dataclass(frozen=True)
class Attention:
    """Causal attention with saved softmax statistics; `name` says which kernels run."""

    name: str
    forward: Callable  # (q, k, v) -> (o, lse)
    backward: Callable  # (do, q, k, v, o, lse) -> (dq, dk, dv)


def native_attention(device: Device) -> Attention:
    """flash_nif's own kernels; for cuda, only if the extension was built with the GPU backend."""
    try:
        import flash_nif
    except ImportError as exc:
        raise SetupError(f"cannot import flash_nif: {exc}") from None
    fwd = getattr(flash_nif, "forward_with_states", None)
    bwd = getattr(flash_nif, "backward", None)
    if fwd is None or bwd is None:
        raise SetupError(
            "flash_nif.forward_with_states/backward are missing: the native extension is not "
            "built (run `make build`), or use --attention reference on the CPU"
        )
    if device.name == "cuda":
        info = flash_nif.info() if callable(getattr(flash_nif, "info", None)) else {}
        backends = list(info.get("backends", []))
        if "cuda" not in backends:
            cuda = info.get("cuda")
            why = f": {cuda['reason']}" if isinstance(cuda, dict) and cuda.get("reason") else ""
            raise SetupError(
                "--device cuda: this flash_nif build has no CUDA backend "
                f"(flash_nif.info()['backends'] = {backends!r}){why}; refusing to fall back to cpu"
            )

    def forward(q, k, v):
        return fwd(q, k, v, causal=True)

    def backward(do, q, k, v, o, lse):
        # deterministic: a resumed run must repeat a straight one bit for bit (the GPU's default
        # atomic dQ would not).
        return bwd(do, q, k, v, o, lse, causal=True, deterministic=True)

    return Attention("flash_nif", forward, backward)


def _oracle_attention(name: str, out_dtype, lse_dtype) -> Attention:
    """The float64 oracle `flash_nif.reference`, its results cast to `out_dtype` (None: each
    input's dtype) and `lse_dtype`."""
    from flash_nif import reference  # imported with the package; pure NumPy

    def cast(t, like):
        return np.asarray(t, dtype=like.dtype if out_dtype is None else out_dtype)

    def forward(q, k, v):
        o, lse = reference.forward_with_states(q, k, v, causal=True)
        return cast(o, q), np.asarray(lse, dtype=lse_dtype)

    def backward(do, q, k, v, o, lse):
        dq, dk, dv = reference.backward(do, q, k, v, o, lse, causal=True)
        return cast(dq, q), cast(dk, k), cast(dv, v)

    return Attention(name, forward, backward)


def reference_attention(device: Device | None = None) -> Attention:
    """The float64 NumPy oracle `flash_nif.reference`; results come back in the input dtype."""
    if device is not None and device.name != "cpu":
        raise SetupError("--attention reference runs on the CPU only (it is a NumPy oracle)")
    return _oracle_attention("reference", None, np.float32)


def float64_reference_attention() -> Attention:
    """The oracle with float64 in and out: the attention of the float64 model in the grad check."""
    return _oracle_attention("reference-float64", np.float64, np.float64)


def get_attention(name: str, device: Device) -> Attention:
    if name == "flash_nif":
        return native_attention(device)
    if name == "reference":
        return reference_attention(device)
    raise SetupError(f"unknown attention backend {name!r}")
