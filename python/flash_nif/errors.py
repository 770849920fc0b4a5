"""Exceptions raised by flash_nif. Each is also the built-in exception it refines, so callers
can catch either ``flash_nif.ShapeError`` or plain ``ValueError``."""


class FlashAttentionError(Exception):
    """Base class of every error raised by flash_nif."""


class ShapeError(FlashAttentionError, ValueError):
    """Wrong rank, mismatched sizes, or a buffer that does not match its shape."""


class DTypeError(FlashAttentionError, TypeError):
    """Unsupported or mismatched dtype (q, k, v share one of float32/float16/bfloat16; lse is float32)."""


class UnsupportedError(FlashAttentionError, ValueError):
    """An option value the library does not support (e.g. a non-positive scale, an unknown device)."""


class OutOfMemoryError(FlashAttentionError, MemoryError):
    """The inputs, outputs or working buffers cannot be allocated."""


class DeviceError(FlashAttentionError, RuntimeError):
    """A requested device is unavailable, or a device call failed."""


class CompileError(DeviceError):
    """NVRTC failed to compile a kernel (the message carries the compiler log)."""


class InternalError(FlashAttentionError, RuntimeError):
    """A bug in flash_nif (for example a caught panic). Please report it."""


__all__ = [
    "FlashAttentionError",
    "ShapeError",
    "DTypeError",
    "UnsupportedError",
    "OutOfMemoryError",
    "DeviceError",
    "CompileError",
    "InternalError",
]
