//! The one error type every binding maps: Python exceptions, Elixir `{:error, reason}`.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Error)]
pub enum FlashError {
    /// Wrong rank, mismatched sizes, buffer length that does not match the shape.
    #[error("{0}")]
    Shape(String),
    /// Unsupported or mismatched element type.
    #[error("{0}")]
    DType(String),
    /// An option or combination the library does not support (bad scale, unknown device...).
    #[error("{0}")]
    Unsupported(String),
    /// A size whose buffers cannot be allocated (or whose byte count overflows).
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A GPU was requested but the CUDA driver, NVRTC or a device is missing.
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA error in {call}: {message}")]
    Cuda { call: String, message: String },
    /// NVRTC rejected a kernel; `log` is the compiler's log.
    #[error("NVRTC failed to compile {kernel}: {log}")]
    Nvrtc { kernel: String, log: String },
    /// A bug in this library (a caught panic, a broken invariant).
    #[error("internal error: {0}")]
    Internal(String),
}

impl FlashError {
    /// A short, stable name of the variant (Elixir atoms, Python exception choice).
    pub fn kind(&self) -> &'static str {
        match self {
            FlashError::Shape(_) => "shape",
            FlashError::DType(_) => "dtype",
            FlashError::Unsupported(_) => "unsupported",
            FlashError::OutOfMemory(_) => "out_of_memory",
            FlashError::CudaUnavailable(_) => "cuda_unavailable",
            FlashError::Cuda { .. } => "cuda",
            FlashError::Nvrtc { .. } => "nvrtc",
            FlashError::Internal(_) => "internal",
        }
    }
}

pub type Result<T> = std::result::Result<T, FlashError>;
