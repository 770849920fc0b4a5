"""Type stubs for the compiled module ``flash_nif._native`` (private: use ``flash_nif``).

tests/test_stubs.py checks that this file and the module define the same functions.
"""

from typing import Any, Sequence, TypedDict, Unpack

import numpy as np

class _Options(TypedDict, total=False):
    """The core's Options, passed as keyword arguments; one left out keeps its default."""

    causal: bool  # default True
    scale: float | None  # default None: 1/sqrt(D)
    deterministic: bool  # backward only; default False
    window: tuple[int | None, int | None]  # (left, right); None = unbounded on that side
    mode: str  # "auto" (default), "fused" or "materialized"; FLASH_NIF_MODE overrides it
    precision: str  # "exact" (default) or "tf32": f32 products on the GPU (the CPU is exact f32)
    softcap: float | None  # s = c * tanh(s / c); None = off
    alibi_slopes: np.ndarray  # float32 [H] or [B, H], on the host (from any library)
    sinks: np.ndarray  # float32 [H], on the host; the backward then also returns dsinks

class _HostMasks(_Options, total=False):
    """Mask arrays of a padded host call (NumPy, C-contiguous); names as flash_nif.forward's."""

    segment_ids: tuple[np.ndarray, np.ndarray]  # int32 [B, Sq], [B, Sk]
    seqused_k: np.ndarray  # int32 [B]
    leftpad_k: np.ndarray  # int32 [B]
    block_mask: np.ndarray  # bool / uint8 [B or 1, H or 1, ceil(Sq/128), ceil(Sk/128)]

# --- host (NumPy) arrays, any device ------------------------------------------------------------

def forward_host_arrays(
    inputs: Sequence[np.ndarray], device: str, **options: Unpack[_HostMasks]
) -> tuple[np.ndarray, np.ndarray]:
    """(o [B, Sq, H, Dv] in q's dtype, lse [B, H, Sq] float32) for inputs [q [B, Sq, H, D],
    k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv]], each C-contiguous in native byte order."""

def backward_host_arrays(
    inputs: Sequence[np.ndarray], device: str, dlse: np.ndarray | None = None, **options: Unpack[_HostMasks]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq like q, dk like k, dv like v) for inputs [do, q, k, v, o, lse] and the forward's masks;
    `dlse` (float32, lse's shape) the optional gradient of lse."""

def varlen_forward_host_arrays(
    inputs: Sequence[np.ndarray], cu_seqlens: Sequence[np.ndarray], device: str, **options: Unpack[_Options]
) -> tuple[np.ndarray, np.ndarray]:
    """(o [total_q, H, Dv] in q's dtype, lse [H, total_q] float32) for packed inputs
    [q [total_q, H, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv]] and cu_seqlens
    [cu_seqlens_q, cu_seqlens_k] (int32 [B + 1])."""

def varlen_backward_host_arrays(
    inputs: Sequence[np.ndarray], cu_seqlens: Sequence[np.ndarray], device: str, dlse: np.ndarray | None = None,
    **options: Unpack[_Options],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq like q, dk like k, dv like v) for packed inputs [do, q, k, v, o, lse]; `dlse` like lse."""

def rotary_host_arrays(
    inputs: Sequence[np.ndarray], device: str, *, backward: bool, interleaved: bool,
    positions: np.ndarray | None = None, offset: int = 0,
) -> np.ndarray:
    """y (dx with `backward`) like inputs[0] for inputs [x (dy) [B, S, H, D], cos, sin [max_pos, R/2]
    float32]; `positions` int32 [B, S], or None for row (b, s) at s + `offset`."""

def info() -> dict[str, Any]:
    """version, backends, threads, cpu_isa, cpu_amx (whether decode's scores may run on AMX tiles: bf16 q, 8 states a kv head or more), cpu_vnni (whether decode over a 4-bit K cache may take byte dot products: bf16 q), dispatch (mode, ceiling and crossover tables)."""

# --- device pointers (CuPy / DLPack arrays); see flash_nif/_cuda.py ----------------------------

DevTensor = tuple[int, Sequence[int], str]  # (pointer, shape, dtype name)

class _DeviceMasks(_Options, total=False):
    """Mask arguments of a padded device call: data on the device, index arrays as host copies."""

    segment_ids: tuple[DevTensor, DevTensor]  # int32 [B, Sq], [B, Sk]
    seqused_k: np.ndarray  # int32 [B], NumPy
    leftpad_k: np.ndarray  # int32 [B], NumPy
    block_mask: DevTensor  # bool / uint8 [B or 1, H or 1, ceil(Sq/128), ceil(Sk/128)]

def cuda_forward_device(
    inputs: list[DevTensor], outputs: list[int], device: int, stream: int, **options: Unpack[_DeviceMasks]
) -> None:
    """inputs [q, k, v]; outputs [o (q's rows, v's head dim), lse] (pointers, preallocated on the
    same device)."""

def cuda_backward_device(
    inputs: list[DevTensor], outputs: list[int], device: int, stream: int, dlse: DevTensor | None = None,
    **options: Unpack[_DeviceMasks],
) -> None:
    """inputs [do, q, k, v, o, lse]; outputs [dq, dk, dv, dsinks] (pointers; dsinks 0 without sinks);
    `dlse` the optional gradient of lse (f32, lse's shape, same device)."""

def cuda_varlen_forward_device(
    inputs: list[DevTensor], outputs: list[int], cu_seqlens: Sequence[np.ndarray], device: int, stream: int,
    **options: Unpack[_Options],
) -> None:
    """Packed inputs [q, k, v]; outputs [o [total_q, H, Dv], lse [H, total_q]]; cu_seqlens as NumPy
    int32 [B + 1] host copies."""

def cuda_varlen_backward_device(
    inputs: list[DevTensor], outputs: list[int], cu_seqlens: Sequence[np.ndarray], device: int, stream: int,
    dlse: DevTensor | None = None, **options: Unpack[_Options],
) -> None:
    """Packed inputs [do, q, k, v, o, lse]; outputs [dq, dk, dv, dsinks or 0]; `dlse` like lse."""

def cuda_rotary_device(
    inputs: list[DevTensor], output: int, device: int, stream: int, *, backward: bool, interleaved: bool,
    positions: tuple[int, np.ndarray] | None = None, offset: int = 0,
) -> None:
    """inputs [x (dy), cos, sin]; output: y's pointer (like x); positions = (device pointer of the int32
    [B, S] array, its NumPy copy for the core's check), or None for `offset`."""

def cuda_set_search_roots(paths: list[str]) -> None: ...
def cuda_info(device: int = 0) -> dict[str, Any]: ...

# --- the launcher's kernel table and compile check (no GPU); see flash_nif/kernels.py -----------

def cuda_sm90_kernels() -> list[str]: ...
def cuda_kernel_variants(head_dims: list[int]) -> list[dict[str, Any]]:
    """Every variant the launcher can use for these head dims: name, kernel, dtype, head_dim, source,
    entry, defines (dict, in order), block_m, block_n, num_warps, tile_set ("default" / "small")."""

def cuda_compile_report(
    archs: list[str],
    head_dims: list[int],
    jobs: int | None = None,
    fresh: bool = False,
    tile_sets: list[str] | None = None,
    masked: bool = True,
    tf32: bool = True,
) -> list[dict[str, Any]]:
    """One dict per (variant, arch), compiled by NVRTC on `jobs` threads (default: all cores) from the
    embedded sources through the disk cache (unless `fresh`): the variant's fields, arch, ok, then
    registers, spill_bytes, stack_bytes, smem_bytes, cached, log; or error. `tile_sets` keeps only
    variants of those tile sets ("default", "small"); `masked=False` only the plain (non-MASKED) ones; `tf32=False` drops the f32 tensor-core (TF32_TERMS) ones."""

def cuda_nvrtc() -> tuple[str, str]:
    """(NVRTC version, where it was loaded from); raises DeviceError without NVRTC."""

def cuda_set_tile_override(
    kernel: str, dtype: str, head_dim: int, tiles: tuple[int, int, int, int, int] | None
) -> None:
    """Development hook: (block_m, block_n, num_warps, d_split, min_blocks) for every launch of this
    kernel, dtype and head dim in this process; None clears it."""
# KV caches (flash_nif.kv): NumPy arrays on the CPU or through GPU 0 (`device`), and device tensors
# (pointer, shape, dtype name) of CuPy / torch arrays on their GPU, queued on `stream`.
def quantize_kv_host(x: Any, values: Any, scales: Any, biases: Any, *, bits: int, group_size: int,
                     device: str = "cpu") -> None: ...
def dequantize_kv_host(values: Any, scales: Any, biases: Any, out: Any, *, bits: int, group_size: int,
                       device: str = "cpu") -> None: ...
def merge_states_host(o_parts: Any, lse_parts: Any, o: Any, lse: Any, *, device: str = "cpu") -> None: ...
def decode_host(q: Any, k: list[Any], v: list[Any], seqlens: Any, leftpad: Any, o: Any, lse: Any, *,
                k_quant: tuple[int, int] | None, v_quant: tuple[int, int] | None, causal: bool, scale: float | None,
                window_left: int | None, window_right: int | None, softcap: float | None,
                num_splits: int | None, device: str = "cpu") -> None: ...
def cuda_quantize_kv_device(x: DevTensor, outputs: list[int], device: int, stream: int, *, bits: int,
                            group_size: int) -> None: ...
def cuda_dequantize_kv_device(parts: list[DevTensor], out: int, device: int, stream: int, *, bits: int,
                              group_size: int) -> None: ...
def cuda_merge_states_device(o_parts: DevTensor, lse_parts: DevTensor, outputs: list[int], device: int,
                             stream: int) -> None: ...
def cuda_decode_device(q: DevTensor, k: list[DevTensor], v: list[DevTensor],
                       rows: tuple[tuple[int, Any] | None, tuple[int, Any] | None], outputs: list[int], device: int,
                       stream: int, *, k_quant: tuple[int, int] | None, v_quant: tuple[int, int] | None, causal: bool,
                       scale: float | None, window_left: int | None, window_right: int | None, softcap: float | None,
                       num_splits: int | None) -> None:
    """Decode on device tensors; `rows` = (cache_seqlens, leftpad_k), each None or (device pointer,
    its int32 NumPy copy); `outputs` = [o, lse] pointers."""
