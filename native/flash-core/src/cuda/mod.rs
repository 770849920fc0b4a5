//! The CUDA backend: kernels from cuda/ compiled at run time by NVRTC, launched through cudarc's
//! driver bindings with dynamic loading (the crate builds and runs without CUDA; asking for the GPU
//! there is a [`FlashError::CudaUnavailable`], never a panic).
//!
//! Two ways in:
//! - device pointers ([`forward_device`], [`backward_device`]): the caller's tensors already live on
//!   GPU `device`; the kernels run on the caller's `stream` (0 = the legacy default stream) and
//!   nothing is synchronised. Used for CuPy arrays and DLPack (torch) tensors.
//! - host memory ([`forward_host`], [`backward_host`]): bytes are copied to the GPU, computed, and
//!   copied back (the Elixir NIF's `device: :cuda`, NumPy with `device="cuda"`).
//!
//! The backward has two paths (every dtype). The default: one dK/dV kernel per key block that also
//! adds dS K into an f32 dQ workspace with atomics (5 tile GEMMs per tile pair), then a conversion
//! kernel — dK and dV are bit-identical run to run, dQ may differ in the last bits because the
//! order of the atomic additions varies. `deterministic`: separate dQ and dK/dV kernels, each
//! output element owned by one block, no atomics (7 tile GEMMs). On Hopper (sm90.rs) the 16-bit
//! backward is one kernel whose dQ goes into a tiled f32 workspace, and the f32 backward at D = 64
//! and 128 a dQ kernel and a dK/dV kernel, like the deterministic path (on either path).
//!
//! Masks: a problem whose mask is not plain (`!Mask::is_plain`: windows, padding, segment ids,
//! block masks, varlen batches) runs the MASKED variants of the same kernels (cuda/seq.h,
//! cuda/block.h). They take every mask at run time: a batch-row table uploaded per call, the
//! window in the params and the mask tensors by pointer. Each block visits only the tiles that
//! some of its rows see (window and padding bound the tile range; block-mask entries and
//! segment-id ranges are tested per tile) and masks elements on boundary tiles only.

mod compile;
pub mod config;
mod decode;
mod device;
mod elf;
mod host;
mod kv;
pub mod kv_variants;
mod launch;
mod libs;
pub mod pad;
mod report;
mod rotary;
mod sm90;
mod sources;
mod trace;
mod variant;

use crate::error::{FlashError, Result};
use crate::guard::catch_panics;

pub use compile::{cache_dir, nvrtc_version, options as nvrtc_options};
pub use config::{all_variants, set_tile_override, TF32_ENV};
pub use decode::{decode_device, decode_host, CachePtrs, DecodePtrs};
pub use host::{backward_host, forward_host};
pub use kv::{dequantize_device, dequantize_host, merge_states_device, merge_states_host, quantize_device, quantize_host, MergePtrs, QuantPtrs};
pub use launch::{backward_device, forward_device, BackwardPtrs, ForwardPtrs, MaskPtrs};
pub use libs::{add_search_roots, ensure_nvrtc};
pub use report::{compile_report, Report, Usage};
pub use rotary::{rotary_device, rotary_host, RotaryPtrs};
pub use sm90::SM90_ENV;
pub use trace::{last_kernels, LastKernels, Ran, LOG_ENV};
pub use variant::{dtype_short, Kernel, TileSet, Tiles, Variant, ANY_HEAD_DIM};

/// What `flash_nif.info()` reports about a GPU.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub arch: String,
    pub multiprocessors: i32,
    pub nvrtc_version: (i32, i32),
    pub nvrtc_source: String,
    pub cache_dir: std::path::PathBuf,
    /// The Hopper kernels run here (compute capability 9.0 and `FLASH_NIF_SM90` not `0`).
    pub sm90: bool,
}

/// Number of visible CUDA devices; an error says why there are none usable.
pub fn device_count() -> Result<usize> {
    catch_panics("CUDA", device::device_count)
}

/// Is a GPU usable (driver, a device, and NVRTC)? Err explains why not.
pub fn available() -> Result<()> {
    catch_panics("CUDA", || {
        if device::device_count()? == 0 {
            return Err(FlashError::CudaUnavailable("the CUDA driver reports no device".into()));
        }
        libs::ensure_nvrtc()?;
        Ok(())
    })
}

/// GPU name, arch, NVRTC version and cache directory.
pub fn info(ordinal: usize) -> Result<DeviceInfo> {
    catch_panics("CUDA", || {
        let d = device::device(ordinal)?;
        let src = libs::ensure_nvrtc()?;
        Ok(DeviceInfo {
            ordinal,
            name: d.name.clone(),
            compute_capability: d.cc,
            arch: d.arch.clone(),
            multiprocessors: d.sm_count,
            nvrtc_version: compile::nvrtc_version()?,
            nvrtc_source: src,
            cache_dir: compile::cache_dir(),
            sm90: d.cc == (9, 0) && sm90::enabled(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_gpu_is_an_error_not_a_panic() {
        if let Err(e) = available() {
            assert!(matches!(e, FlashError::CudaUnavailable(_)), "{e:?}");
        }
    }
}
