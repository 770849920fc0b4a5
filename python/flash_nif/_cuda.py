"""GPU dispatch: CuPy arrays, torch tensors and other DLPack producers, and NumPy with device="cuda".

The backend follows the data. Arrays on a GPU run there, on the stream their library announces as
current (CuPy's current stream, torch's current stream for that device), with outputs allocated
by the same library on the same device: CuPy in -> CuPy out, torch in -> torch out. Other DLPack
producers on a CUDA device are viewed through ``cupy.from_dlpack`` (zero copy) and get CuPy outputs.
Nothing is synchronised: the kernels are queued on that stream like the library's own work.
Non-contiguous inputs are made contiguous by the array library first.

NumPy inputs with ``device="cuda"`` do not come here: the core copies them to GPU 0 and back.
Mixing kinds (NumPy with CuPy) or devices (two GPUs) raises DeviceError; there is never a silent
fallback from a requested GPU to the CPU.
"""

from __future__ import annotations

import sys

import numpy as np

from . import _native
from .errors import DeviceError, DTypeError, UnsupportedError  # noqa: F401

_KDL_CUDA = 2  # DLPack device type of CUDA memory

# Where pip's nvidia-cuda-nvrtc may live: the core searches these sys.path entries for
# nvidia/cu13/lib (or cuda_nvrtc/lib) when no libnvrtc is on the loader path. Cheap: no CUDA call.
if hasattr(_native, "cuda_set_search_roots"):
    _native.cuda_set_search_roots([p for p in sys.path if isinstance(p, str) and p])


def _kind(x) -> str:
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod == "cupy":
        return "cupy"
    if mod == "torch":
        return "torch" if x.device.type == "cuda" else "torch-cpu"
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    if hasattr(x, "__dlpack_device__"):
        try:
            dev_type, _ = x.__dlpack_device__()
        except Exception:  # noqa: BLE001 - a producer that cannot say is not a GPU array here
            return "other"
        return "dlpack" if int(dev_type) == _KDL_CUDA else "other"
    return "other"


_GPU_KINDS = ("cupy", "torch", "cai", "dlpack")


def any_gpu(*xs) -> bool:
    """True if any argument is a GPU array (the caller then dispatches here)."""
    return any(_kind(x) in _GPU_KINDS for x in xs)


def _dtype_name(x) -> str:
    kind = _kind(x)
    if kind == "torch":
        import torch

        names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
        if x.dtype not in names:
            raise DTypeError(f"unsupported dtype {x.dtype}; expected float32, float16 or bfloat16")
        return names[x.dtype]
    return np.dtype(x.dtype).name


def _device_id(x) -> int:
    return x.device.index if _kind(x) == "torch" else x.device.id


class _Tensors:
    """Inputs of one call, all of one kind on one device, made contiguous."""

    def __init__(self, names, arrays):
        kinds = {_kind(a) for a in arrays}
        if len(kinds) != 1 or not kinds <= set(_GPU_KINDS):
            desc = ", ".join(f"{n}: {_kind(a)}" for n, a in zip(names, arrays))
            raise DeviceError(f"inputs must all live on one GPU with one array library; got {desc}")
        kind = kinds.pop()
        if kind in ("cai", "dlpack"):
            try:
                import cupy
            except ImportError as e:
                raise DeviceError(f"{kind} GPU arrays need CuPy installed to be read") from e
            arrays = [cupy.asarray(a) if kind == "cai" else cupy.from_dlpack(a) for a in arrays]
            kind = "cupy"
        devices = {_device_id(a) for a in arrays}
        if len(devices) != 1:
            desc = ", ".join(f"{n}: cuda:{_device_id(a)}" for n, a in zip(names, arrays))
            raise DeviceError(f"inputs are on different GPUs ({desc}); move them to one device")
        self.kind = kind
        self.device = devices.pop()
        if kind == "torch":
            self.arrays = [a.detach().contiguous() for a in arrays]
            import torch

            self.stream = torch.cuda.current_stream(self.device).cuda_stream
        else:
            import cupy

            with cupy.cuda.Device(self.device):
                self.arrays = [cupy.ascontiguousarray(a) for a in arrays]
                self.stream = cupy.cuda.get_current_stream().ptr

    def empty(self, shape, like=None, float32=False):
        ref = self.arrays[0] if like is None else like
        if self.kind == "torch":
            import torch

            return torch.empty(tuple(shape), dtype=torch.float32 if float32 else ref.dtype, device=ref.device)
        import cupy

        with cupy.cuda.Device(self.device):
            return cupy.empty(tuple(shape), dtype=np.float32 if float32 else ref.dtype)

    def ptr(self, a) -> int:
        if a is None:
            return 0
        return a.data_ptr() if self.kind == "torch" else a.data.ptr

    def describe(self, names):
        """[(pointer, shape, dtype name)] of the inputs, for the core's validation."""
        return [(self.ptr(a), _shape(a), _dtype_name(a)) for a in self.arrays]


def _shape(a):
    return [int(s) for s in a.shape]


def forward_with_states(q, k, v, causal, scale, device):
    """(o, lse) on a GPU; see flash_nif.forward_with_states."""
    if device not in (None, "cuda", "auto"):
        raise DeviceError(f"device={device!r} was requested but the inputs live on a GPU; copy them to NumPy first")
    t = _Tensors(("q", "k", "v"), (q, k, v))
    q, k, v = t.arrays
    desc = t.describe(("q", "k", "v"))  # the core validates shapes and dtypes from these
    o = t.empty(q.shape) if len(q.shape) == 4 else None
    lse = t.empty((q.shape[0], q.shape[2], q.shape[1]), float32=True) if len(q.shape) == 4 else None
    _native.cuda_forward_device(desc, [t.ptr(o), t.ptr(lse)], t.device, t.stream, causal=causal, scale=scale)
    return o, lse


def backward(do, q, k, v, o, lse, causal, scale, device, deterministic=False):
    """(dq, dk, dv) on a GPU; see flash_nif.backward."""
    if device not in (None, "cuda", "auto"):
        raise DeviceError(f"device={device!r} was requested but the inputs live on a GPU; copy them to NumPy first")
    names = ("do", "q", "k", "v", "o", "lse")
    t = _Tensors(names, (do, q, k, v, o, lse))
    desc = t.describe(names)  # the core validates every shape and dtype from these
    q, k = t.arrays[1], t.arrays[2]
    ok = len(q.shape) == 4 and len(k.shape) == 4
    dq = t.empty(q.shape) if ok else None
    dk = t.empty(k.shape, like=k) if ok else None
    dv = t.empty(k.shape, like=k) if ok else None
    outputs = [t.ptr(dq), t.ptr(dk), t.ptr(dv)]
    _native.cuda_backward_device(desc, outputs, t.device, t.stream, causal=causal, scale=scale, deterministic=deterministic)
    return dq, dk, dv


def info() -> dict:
    """GPU 0's name, arch, NVRTC version and cache directory, or why CUDA is unavailable."""
    try:
        return {"available": True, **dict(_native.cuda_info(0))}
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"available": False, "reason": str(e)}


__all__ = ["any_gpu", "forward_with_states", "backward", "info", "UnsupportedError"]
