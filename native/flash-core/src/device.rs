//! Which backend runs a call on host buffers. Every binding parses and resolves devices here,
//! so Python and Elixir agree on names, on `auto`, and on the error for a missing GPU.

use crate::error::{FlashError, Result};
use crate::io::{BackwardIo, ForwardIo};
use crate::problem::Problem;
use crate::rotary::{RotaryIo, RotaryProblem};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

impl Device {
    /// "cpu", "cuda", or "auto" (the GPU when the CUDA backend and a GPU are present, else the
    /// CPU). An explicit "cuda" is never replaced by the CPU.
    pub fn parse(name: &str) -> Result<Device> {
        match name {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            "auto" => Ok(if cuda_available() { Device::Cuda } else { Device::Cpu }),
            other => Err(FlashError::Unsupported(format!(
                "unknown device {other:?}; expected \"cpu\", \"cuda\" or \"auto\""
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

/// Whether a CUDA device can run the kernels in this process.
pub fn cuda_available() -> bool {
    cuda_unavailable_reason().is_none()
}

/// Why the CUDA backend cannot run here, if it cannot.
pub fn cuda_unavailable_reason() -> Option<String> {
    #[cfg(feature = "cuda")]
    return crate::cuda::available().err().map(|e| e.to_string());
    #[cfg(not(feature = "cuda"))]
    Some("this build of flash_nif has no CUDA backend".into())
}

/// Forward on host buffers (layouts in [`ForwardIo`]) on `device` (GPU 0 for CUDA).
pub fn forward_host(device: Device, p: &Problem, io: ForwardIo) -> Result<()> {
    match device {
        Device::Cpu => crate::cpu::forward(p, io),
        #[cfg(feature = "cuda")]
        Device::Cuda => crate::cuda::forward_host(p, 0, io),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(FlashError::CudaUnavailable(cuda_unavailable_reason().unwrap_or_default())),
    }
}

/// Backward on host buffers (layouts in [`BackwardIo`]) on `device` (GPU 0 for CUDA).
pub fn backward_host(device: Device, p: &Problem, io: BackwardIo) -> Result<()> {
    match device {
        Device::Cpu => crate::cpu::backward(p, io),
        #[cfg(feature = "cuda")]
        Device::Cuda => crate::cuda::backward_host(p, 0, io),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(FlashError::CudaUnavailable(cuda_unavailable_reason().unwrap_or_default())),
    }
}

/// Rotary embeddings on host buffers (layouts in [`RotaryIo`]) on `device` (GPU 0 for CUDA).
pub fn rotary_host(device: Device, p: &RotaryProblem, io: RotaryIo) -> Result<()> {
    match device {
        Device::Cpu => crate::cpu::rotary(p, io),
        #[cfg(feature = "cuda")]
        Device::Cuda => crate::cuda::rotary_host(p, 0, io),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(FlashError::CudaUnavailable(cuda_unavailable_reason().unwrap_or_default())),
    }
}
