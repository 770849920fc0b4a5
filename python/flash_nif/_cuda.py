"""GPU dispatch: CuPy arrays, torch tensors and other DLPack producers, and NumPy with device="cuda".

The backend follows the data. Arrays on a GPU run there, on the stream their library announces as
current (CuPy's current stream, torch's current stream for that device), with outputs allocated
by the same library on the same device: CuPy in -> CuPy out, torch in -> torch out. Other DLPack
producers on a CUDA device are viewed through ``cupy.from_dlpack`` (zero copy) and get CuPy outputs.
Nothing is synchronised: the kernels are queued on that stream like the library's own work.
The attention inputs (q, k, v, and the backward's do and o) are read where they lie when their
last axis is contiguous (``qkv.unbind`` views, ``[B, H, S, D]`` transposes, batch slices): the
kernels take their batch, sequence and head strides. Any other array is made contiguous by its
library first.

Mask arrays and cu_seqlens are inputs like the others (same library, same device); the small
index arrays (seqused_k, leftpad_k, cu_seqlens) are then copied to the host, since the core checks
their values and sizes the launch from them.

NumPy inputs with ``device="cuda"`` do not come here: the core copies them to GPU 0 and back.
Mixing kinds (NumPy with CuPy) or devices (two GPUs) raises DeviceError; there is never a silent
fallback from a requested GPU to the CPU.
"""

from __future__ import annotations

import sys

import numpy as np

from . import _args, _native
from .errors import DeviceError, DTypeError, UnsupportedError  # noqa: F401

_KDL_CUDA = 2  # DLPack device type of CUDA memory

# Where pip's NVRTC may live: the core searches these sys.path entries for nvidia/cu13/lib
# (nvidia-cuda-nvrtc 13, the `cuda13` extra) and nvidia/cuda_nvrtc/lib (nvidia-cuda-nvrtc-cu12, the
# `cuda12` extra) when no libnvrtc is on the loader path. Cheap: no CUDA call.
if hasattr(_native, "cuda_set_search_roots"):
    _native.cuda_set_search_roots([p for p in sys.path if isinstance(p, str) and p])


# A call's host path is on the critical path of decode (a few microseconds of kernel per token):
# the kind of each array type is looked up once, torch's dtypes are named once.
_KIND_OF_TYPE: dict = {}


def _kind(x) -> str:
    t = type(x)
    kind = _KIND_OF_TYPE.get(t)
    if kind is None:
        kind = _kind_of_type(x)
        if kind in ("numpy", "cupy", "torch?"):
            _KIND_OF_TYPE[t] = kind  # a property of the type (torch: of the type and the device)
    if kind == "torch?":
        return "torch" if x.is_cuda else "torch-cpu"
    return kind


def _kind_of_type(x) -> str:
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod == "cupy":
        return "cupy"
    if mod == "torch":
        return "torch?"
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


# torch / NumPy / CuPy dtype -> its name as NumPy spells it (NumPy's ``dtype.name`` is a slow property)
_DTYPE_NAMES: dict = {}


def _dtype_name(x, kind=None) -> str:
    """The dtype's name as NumPy spells it ("float32", "bfloat16", "int32", "bool"); the core
    judges it and names the argument."""
    name = _DTYPE_NAMES.get(x.dtype)
    if name is None:
        torch = (kind or _kind(x)) == "torch"
        name = _DTYPE_NAMES[x.dtype] = str(x.dtype).removeprefix("torch.") if torch else np.dtype(x.dtype).name
    return name


def _device_id(x, kind=None) -> int:
    return x.get_device() if (kind or _kind(x)) == "torch" else x.device.id


def _torch_stream(device: int) -> int:
    """torch's current stream on `device` as a CUstream integer (torch's private raw getter where it
    has one: a tenth of the public path's time)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


# The attention calls' arguments that the kernels read through strides (every other array, and
# every array of another call — decode, rotary, the cache conversions — is made contiguous).
_STRIDED = ("q", "k", "v", "do", "o")


def _element_strides(a):
    """a's strides in elements if the kernels can read it where it lies (none negative, the last
    axis contiguous), else None."""
    if hasattr(a, "data_ptr"):  # torch
        st = list(a.stride())
    else:
        item = a.dtype.itemsize
        if any(s % item for s in a.strides):
            return None
        st = [s // item for s in a.strides]
    if any(s < 0 for s in st) or (a.ndim and a.shape[-1] > 1 and st[-1] != 1):
        return None
    return st


class _Tensors:
    """Arrays of one call by name, all of one kind on one device; the arrays named in `views` kept
    as the views they are where the kernels can read them (`strides`), every other one made
    contiguous."""

    def __init__(self, named: dict, views=()):
        names, arrays = list(named), list(named.values())
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
        devices = {_device_id(a, kind) for a in arrays}
        if len(devices) != 1:
            desc = ", ".join(f"{n}: cuda:{_device_id(a, kind)}" for n, a in zip(names, arrays))
            raise DeviceError(f"inputs are on different GPUs ({desc}); move them to one device")
        self.kind = kind
        self.device = devices.pop()
        self.views = tuple(views)
        view_strides = {n: _element_strides(a) for n, a in zip(names, arrays) if n in self.views}
        in_place = [view_strides.get(n) is not None for n in names]
        if kind == "torch":
            # Only the pointers are read: a contiguous tensor (or a view kept as it is) goes on as it
            # is; a copy is made outside autograd.
            arrays = [a if keep or a.is_contiguous() else a.detach().contiguous() for a, keep in zip(arrays, in_place)]
            self.stream = _torch_stream(self.device)
        else:
            import cupy

            with cupy.cuda.Device(self.device):
                arrays = [a if keep else cupy.ascontiguousarray(a) for a, keep in zip(arrays, in_place)]
                self.stream = cupy.cuda.get_current_stream().ptr
        self.named = dict(zip(names, arrays))
        # The views' element strides, as kept (a copy's own where one was made).
        self._view_strides = {
            n: view_strides[n] if keep else _element_strides(a)
            for n, a, keep in zip(names, arrays, in_place)
            if n in self.views
        }

    def strides(self, names) -> dict:
        """``strides=`` for the native call: each of `names`' element strides (None for lse and other
        packed extras); empty when every one is contiguous (the kernels' default)."""
        st = [self._view_strides.get(n) for n in names]
        if all(s is None or self._contiguous(self.named[n]) for n, s in zip(names, st)):
            return {}
        return {"strides": st}

    def _contiguous(self, a) -> bool:
        return a.is_contiguous() if self.kind == "torch" else a.flags.c_contiguous

    def __getitem__(self, name):
        return self.named[name]

    def empty(self, shape, like, float32=False):
        if self.kind == "torch":
            import torch

            return torch.empty(tuple(shape), dtype=torch.float32 if float32 else like.dtype, device=like.device)
        import cupy

        with cupy.cuda.Device(self.device):
            return cupy.empty(tuple(shape), dtype=np.float32 if float32 else like.dtype)

    def ptr(self, a) -> int:
        if a is None:
            return 0
        return a.data_ptr() if self.kind == "torch" else a.data.ptr

    def describe(self, a, name=None):
        """(pointer, shape, dtype name) of a GPU array, for the core's validation."""
        return (self.ptr(a), _shape(a), _dtype_name(a, self.kind))

    def int32(self, a, name):
        """a as int32 on its device: another integer dtype is converted when its values fit. The
        copy replaces t[name], so it lives as long as the call's other arrays (its pointer is
        passed on; freed earlier, its memory could be handed to the next conversion)."""
        if self.kind == "torch":
            import torch

            integer = not (a.dtype.is_floating_point or a.dtype.is_complex or a.dtype == torch.bool)
            if not integer or a.dtype == torch.int32:
                return a  # the core names any other dtype in a DTypeError
            if a.numel():
                _args.check_int32_range(name, _dtype_name(a), int(a.min()), int(a.max()))
            a = a.to(torch.int32)
        else:
            if a.dtype.kind not in "iu" or a.dtype == np.int32:
                return a
            import cupy

            with cupy.cuda.Device(self.device):
                if a.size:
                    _args.check_int32_range(name, a.dtype, int(a.min()), int(a.max()))
                a = a.astype(np.int32)
        self.named[name] = a
        return a

    def host_int32(self, a, name) -> np.ndarray:
        """An int32 NumPy copy of a small index array (the core reads its values)."""
        a = self.int32(a, name)
        if self.kind == "torch":
            if _dtype_name(a) != "int32":  # not every torch dtype has a NumPy twin to hand the core
                raise DTypeError(f"{name} has dtype {_dtype_name(a)}; it must be int32")
            return np.ascontiguousarray(a.cpu().numpy())
        import cupy

        return np.ascontiguousarray(cupy.asnumpy(a))


def _shape(a):
    return [int(s) for s in a.shape]


def _check_device(device):
    if device not in (None, "cuda", "auto"):
        raise DeviceError(f"device={device!r} was requested but the inputs live on a GPU; copy them to NumPy first")


def _masks(t: _Tensors, names) -> dict:
    """The native keyword arguments of the mask arrays `names` in t: segment ids and the block mask
    as descriptions on the device, seqused_k / leftpad_k as host copies."""
    return _args.mask_kwargs({n: t[n] for n in names}, int32=t.int32, place=t.describe, index=t.host_int32)


def forward_with_states(qkv, opts, device, masks, cu_seqlens=None):
    """(o, lse) on a GPU; see flash_nif.forward_with_states. ``cu_seqlens`` = (cu_q, cu_k) makes it
    a packed varlen call (flash_nif.varlen): q [total_q, H, D] gives lse [H, total_q]."""
    _check_device(device)
    names = ("q", "k", "v")
    t = _Tensors({**dict(zip(names, qkv)), **masks, **dict(zip(_args.CU_NAMES, cu_seqlens or ()))}, views=_STRIDED)
    q, v = t["q"], t["v"]
    desc = [t.describe(t[n]) for n in names]  # the core validates shapes and dtypes from these
    rank = 3 if cu_seqlens else 4
    # o has q's rows and v's head dim (Dv); a shape the core rejects allocates nothing.
    o = t.empty((*q.shape[:-1], v.shape[-1]), q) if q.ndim == rank and v.ndim == rank else None
    if o is None:
        lse = None
    elif cu_seqlens:
        lse = t.empty((q.shape[1], q.shape[0]), q, float32=True)
    else:
        lse = t.empty((q.shape[0], q.shape[2], q.shape[1]), q, float32=True)
    outputs = [t.ptr(o), t.ptr(lse)]
    if cu_seqlens:
        cu = [t.host_int32(t[n], n) for n in _args.CU_NAMES]
        _native.cuda_varlen_forward_device(desc, outputs, cu, t.device, t.stream, **t.strides(names), **opts)
    else:
        _native.cuda_forward_device(desc, outputs, t.device, t.stream, **t.strides(names), **opts, **_masks(t, masks))
    return o, lse


def backward(arrays, opts, device, masks, cu_seqlens=None, dlse=None):
    """(dq, dk, dv) — with sinks (dq, dk, dv, dsinks) — on a GPU; see flash_nif.backward (and
    flash_nif.varlen.backward with ``cu_seqlens``); ``dlse`` the optional gradient of lse."""
    _check_device(device)
    names = ("do", "q", "k", "v", "o", "lse")
    grad_lse = {} if dlse is None else {"dlse": dlse}
    t = _Tensors({**dict(zip(names, arrays)), **grad_lse, **masks, **dict(zip(_args.CU_NAMES, cu_seqlens or ()))},
                 views=_STRIDED)
    desc = [t.describe(t[n]) for n in names]  # the core validates every shape and dtype from these
    q, k, v = t["q"], t["k"], t["v"]
    rank = 3 if cu_seqlens else 4
    ok = q.ndim == rank and k.ndim == rank and v.ndim == rank
    # Each gradient has its input's shape (dv: v's head dim, Dv).
    dq = t.empty(q.shape, q) if ok else None
    dk = t.empty(k.shape, k) if ok else None
    dv = t.empty(v.shape, v) if ok else None
    # dsinks [H] f32 (H from q: the core checks the sinks' shape against it).
    dsinks = t.empty((q.shape[-2],), q, float32=True) if ok and opts.get("sinks") is not None else None
    outputs = [t.ptr(dq), t.ptr(dk), t.ptr(dv), t.ptr(dsinks)]
    g = None if dlse is None else t.describe(t["dlse"])
    if cu_seqlens:
        cu = [t.host_int32(t[n], n) for n in _args.CU_NAMES]
        _native.cuda_varlen_backward_device(desc, outputs, cu, t.device, t.stream, g, **t.strides(names), **opts)
    else:
        _native.cuda_backward_device(desc, outputs, t.device, t.stream, g, **t.strides(names), **opts, **_masks(t, masks))
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def info() -> dict:
    """GPU 0's name, arch, NVRTC version and cache directory, or why CUDA is unavailable."""
    try:
        return {"available": True, **dict(_native.cuda_info(0))}
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"available": False, "reason": str(e)}


__all__ = ["any_gpu", "forward_with_states", "backward", "info", "UnsupportedError"]
