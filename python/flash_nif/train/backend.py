"""Where the trainer's arrays live and which attention kernels it calls.

Two frameworks. "numpy" (the default): the model code never imports NumPy or CuPy directly: it
asks `xp_of(array)` for the array module of its inputs, so one code path serves the CPU (NumPy)
and the GPU (CuPy), and attention is an injectable pair of functions,
`Attention.forward(q, k, v) -> (o, lse)` and `Attention.backward(do, q, k, v, o, lse) -> (dq, dk, dv)`,
with the tensor conventions of flash_nif ([B, S, H, D], lse [B, H, S] float32). "torch": the
arrays are torch tensors on the CPU or a GPU, and attention is `TorchAttention.apply(q, k, v) -> o`,
flash_nif.torch's differentiable op; torch autograd differentiates the rest (torch_model.py).
The optimizer and checkpoints serve both through `xp_of` and `to_host`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


class SetupError(RuntimeError):
    """A requested device or attention backend cannot be used (reported without a traceback)."""


FRAMEWORKS = ("numpy", "torch")


def xp_of(array: Any):
    """The array module (numpy, cupy or torch) that owns `array`."""
    if isinstance(array, np.ndarray) or np.isscalar(array):
        return np
    module = type(array).__module__.split(".")[0]
    if module == "cupy":
        import cupy

        return cupy
    if module == "torch":
        import torch

        return torch
    return np


def scalar(like: Any, value: float):
    """`value` as a scalar of `like`'s dtype, so that `like * scalar` rounds in that dtype: a NumPy
    scalar for NumPy/CuPy; for torch the float itself (torch's kernels cast a Python scalar to the
    tensor's dtype before the arithmetic, so the results are the same bits)."""
    return float(value) if xp_of(like).__name__ == "torch" else like.dtype.type(value)


def sqrt(array: Any):
    """The correctly rounded square root, as NumPy's and CuPy's. torch's vectorised float32 sqrt
    on the CPU is not (it differed from NumPy's in the last bit for 16,555 of 100,000 random
    inputs, torch 2.13, AVX-512), so there it goes through float64 (exact after rounding back:
    0 differences in 3 x 10^6 inputs)."""
    xp = xp_of(array)
    if xp.__name__ == "torch" and array.device.type == "cpu" and array.dtype == xp.float32:
        return array.double().sqrt_().float()
    return xp.sqrt(array)


def to_float64(array: Any):
    """`array` in float64, on its own device."""
    return array.double() if xp_of(array).__name__ == "torch" else array.astype("float64")


def to_host(array: Any) -> np.ndarray:
    """A NumPy copy (or view) of a NumPy or CuPy array or a torch tensor."""
    if isinstance(array, np.ndarray):
        return array
    if xp_of(array).__name__ == "torch":
        return array.detach().cpu().numpy()
    return array.get()


def host_dtype(array: Any) -> np.dtype:
    """The NumPy dtype of a NumPy or CuPy array or a torch tensor (torch.float32 -> float32)."""
    if xp_of(array).__name__ == "torch":
        return np.dtype(str(array.dtype).removeprefix("torch."))
    return array.dtype


@dataclass(frozen=True)
class Device:
    """`name` is "cpu" or "cuda"; `xp` is numpy or cupy (the "numpy" framework) or torch."""

    name: str
    xp: Any

    @property
    def framework(self) -> str:
        return "torch" if self.xp.__name__ == "torch" else "numpy"

    def put(self, array: np.ndarray):
        """Move a host array onto this device (no copy on the CPU)."""
        if self.xp is np:
            return array
        if self.framework == "torch":
            return self.xp.asarray(array, device=self.name)
        return self.xp.asarray(array)


def get_device(name: str, framework: str = "numpy") -> Device:
    """The CPU, or the GPU through CuPy (or torch) -- never a silent fallback from cuda to cpu."""
    if framework not in FRAMEWORKS:
        raise SetupError(f"unknown framework {framework!r} (choose numpy or torch)")
    if name not in ("cpu", "cuda"):
        raise SetupError(f"unknown device {name!r} (choose cpu or cuda)")
    if framework == "torch":
        return _torch_device(name)
    if name == "cpu":
        return Device("cpu", np)
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


def _torch_device(name: str) -> Device:
    try:
        import torch
    except ImportError as exc:
        raise SetupError(f"--framework torch needs PyTorch (pip install torch); importing it failed: {exc}") from None
    if name == "cuda" and not torch.cuda.is_available():
        raise SetupError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    return Device(name, torch)


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
        _require_cuda_backend(flash_nif)

    def forward(q, k, v):
        return fwd(q, k, v, causal=True)

    def backward(do, q, k, v, o, lse):
        # deterministic: a resumed run must repeat a straight one bit for bit (the GPU's default
        # atomic dQ would not).
        return bwd(do, q, k, v, o, lse, causal=True, deterministic=True)

    return Attention("flash_nif", forward, backward)


def _require_cuda_backend(flash_nif) -> None:
    info = flash_nif.info() if callable(getattr(flash_nif, "info", None)) else {}
    backends = list(info.get("backends", []))
    if "cuda" not in backends:
        cuda = info.get("cuda")
        why = f": {cuda['reason']}" if isinstance(cuda, dict) and cuda.get("reason") else ""
        raise SetupError(
            "--device cuda: this flash_nif build has no CUDA backend "
            f"(flash_nif.info()['backends'] = {backends!r}){why}; refusing to fall back to cpu"
        )


@dataclass(frozen=True)
class TorchAttention:
    """Causal attention as one differentiable torch function `apply(q, k, v) -> o` on
    [B, S, H, D] tensors; torch autograd calls its backward. `name` says which kernels run."""

    name: str
    apply: Callable


def torch_attention(device: Device) -> TorchAttention:
    """flash_nif.torch.attention (causal; deterministic backward, as the NumPy framework's, so a
    resumed run repeats a straight one)."""
    try:
        import flash_nif
        import flash_nif.torch as fnt
    except ImportError as exc:
        raise SetupError(f"cannot import flash_nif.torch: {exc}") from None
    if device.name == "cuda":
        _require_cuda_backend(flash_nif)

    def apply(q, k, v):
        return fnt.attention(q, k, v, causal=True, deterministic=True)

    return TorchAttention("flash_nif.torch", apply)


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


def get_attention(name: str, device: Device) -> Attention | TorchAttention:
    if device.framework == "torch":
        if name != "flash_nif":
            raise SetupError(f"--attention {name} is the NumPy framework's; --framework torch "
                             "trains with flash_nif.torch.attention")
        return torch_attention(device)
    if name == "flash_nif":
        return native_attention(device)
    if name == "reference":
        return reference_attention(device)
    raise SetupError(f"unknown attention backend {name!r}")
