//! flash-core: exact FlashAttention forward (saving logsumexp) and backward.
//!
//! Bindings (PyO3, Rustler) describe their tensors as [`TensorSpec`]s, get a validated
//! [`Problem`] from [`Problem::forward`] / [`Problem::backward`], allocate the outputs it implies,
//! and run it on a [`Device`] ([`forward_host`], [`backward_host`]) with the buffers named in a
//! [`ForwardIo`] / [`BackwardIo`]. All buffers are native-endian, row-major, contiguous bytes:
//!
//! | tensor              | shape              | dtype           |
//! |---------------------|--------------------|-----------------|
//! | q, dq               | [B, Sq, H, D]      | f32, f16, bf16  |
//! | k, dk               | [B, Sk, Hkv, D]    | same as q       |
//! | v, dv               | [B, Sk, Hkv, Dv]   | same as q       |
//! | o, d_out            | [B, Sq, H, Dv]     | same as q       |
//! | lse                 | [B, H, Sq]         | f32 (natural log) |
//!
//! D and Dv (v's last axis, often equal to D) are each any head dim from 1 to 256.

pub mod cpu;
pub mod decode;
pub mod device;
pub mod dispatch;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dtype;
pub mod error;
mod guard;
pub mod io;
pub mod mask;
pub mod modifiers;
pub mod precision;
pub mod problem;
pub mod quant;
pub mod rotary;
pub mod strides;

pub use device::{backward_host, cuda_available, forward_host, rotary_host, Device};
pub use dispatch::Mode;
pub use dtype::DType;
pub use error::{FlashError, Result};
pub use io::{BackwardIo, ForwardIo};
pub use strides::{InputStrides, Strides};
pub use mask::{IndexArg, Mask, MaskArgs, MaskBuffers, Window, MASK_BLOCK};
pub use modifiers::{FloatArg, ModArgs, Modifiers};
pub use precision::Precision;
pub use problem::{Dims, Options, Problem, TensorSpec, MAX_HEAD_DIM};
pub use quant::{QuantFormat, QUANT_BITS, QUANT_GROUP_SIZES};
pub use rotary::{Positions, RotaryDims, RotaryIo, RotaryOptions, RotaryProblem};

/// The crate version (the Python package and the NIF report it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
