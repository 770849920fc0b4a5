//! Storage element types. Arithmetic is always f32; these only say how elements are stored.

use crate::error::{FlashError, Result};
use half::{bf16, f16};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    /// Parses NumPy-style names ("float32", "float16", "bfloat16"; also "f32", "f16", "bf16").
    /// `arg` names the tensor in the error message.
    pub fn parse(name: &str, arg: &str) -> Result<DType> {
        match name {
            "float32" | "f32" => Ok(DType::F32),
            "float16" | "f16" => Ok(DType::F16),
            "bfloat16" | "bf16" => Ok(DType::BF16),
            other => Err(FlashError::DType(format!(
                "{arg} has dtype {other}; expected float32, float16 or bfloat16"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }

    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Decodes `dst.len()` native-endian elements starting at element `start` of `src`.
    #[inline]
    pub fn load(self, src: &[u8], start: usize, dst: &mut [f32]) {
        let n = dst.len();
        match self {
            DType::F32 => {
                let bytes = &src[start * 4..(start + n) * 4];
                // SAFETY: a byte copy of n native-endian f32 values (bounds checked by the slice
                // above); works at any alignment of `src`.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.as_mut_ptr() as *mut u8, n * 4) }
            }
            DType::F16 => {
                let bytes = &src[start * 2..(start + n) * 2];
                for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = f16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f32();
                }
            }
            DType::BF16 => {
                let bytes = &src[start * 2..(start + n) * 2];
                for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = bf16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f32();
                }
            }
        }
    }

    /// Encodes `src` (rounding to nearest even) into `dst` at element `start`.
    #[inline]
    pub fn store(self, src: &[f32], dst: &mut [u8], start: usize) {
        let n = src.len();
        match self {
            DType::F32 => {
                let bytes = &mut dst[start * 4..(start + n) * 4];
                // SAFETY: as in `load`, the other way round.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr() as *const u8, bytes.as_mut_ptr(), n * 4) }
            }
            DType::F16 => {
                let bytes = &mut dst[start * 2..(start + n) * 2];
                for (s, c) in src.iter().zip(bytes.chunks_exact_mut(2)) {
                    c.copy_from_slice(&f16::from_f32(*s).to_bits().to_ne_bytes());
                }
            }
            DType::BF16 => {
                let bytes = &mut dst[start * 2..(start + n) * 2];
                for (s, c) in src.iter().zip(bytes.chunks_exact_mut(2)) {
                    c.copy_from_slice(&bf16::from_f32(*s).to_bits().to_ne_bytes());
                }
            }
        }
    }
}
