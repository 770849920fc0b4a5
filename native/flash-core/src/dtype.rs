//! Storage element types. Arithmetic is always f32; these only say how elements are stored.

use crate::error::{FlashError, Result};
use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
#[cfg(test)]
use half::bf16;

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
    #[inline(always)]
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
                match as_u16(bytes) {
                    // F16C 8 at a time where the CPU has it (measured faster than f16_to_f32 here)
                    Some(h) => h.reinterpret_cast::<f16>().convert_to_f32_slice(dst),
                    None => {
                        for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                            *d = f16_to_f32(u16::from_ne_bytes([c[0], c[1]]));
                        }
                    }
                }
            }
            DType::BF16 => {
                let bytes = &src[start * 2..(start + n) * 2];
                match as_u16(bytes) {
                    Some(h) => dst.iter_mut().zip(h).for_each(|(d, &b)| *d = bf16_to_f32(b)),
                    None => {
                        for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                            *d = bf16_to_f32(u16::from_ne_bytes([c[0], c[1]]));
                        }
                    }
                }
            }
        }
    }

    /// Encodes `src` (rounding to nearest even) into `dst` at element `start`.
    #[inline(always)]
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
                match as_u16_mut(bytes) {
                    Some(h) => h.reinterpret_cast_mut::<f16>().convert_from_f32_slice(src),
                    None => {
                        for (s, c) in src.iter().zip(bytes.chunks_exact_mut(2)) {
                            c.copy_from_slice(&f32_to_f16(*s).to_ne_bytes());
                        }
                    }
                }
            }
            DType::BF16 => {
                let bytes = &mut dst[start * 2..(start + n) * 2];
                match as_u16_mut(bytes) {
                    Some(h) => h.iter_mut().zip(src).for_each(|(b, &s)| *b = f32_to_bf16(s)),
                    None => {
                        for (s, c) in src.iter().zip(bytes.chunks_exact_mut(2)) {
                            c.copy_from_slice(&f32_to_bf16(*s).to_ne_bytes());
                        }
                    }
                }
            }
        }
    }
}

// The 16-bit conversions one slice at a time, so that they vectorize: bytes seen as u16 where
// they are 2-aligned (NumPy arrays and BEAM binaries are; a sub-binary may not be).
fn as_u16(b: &[u8]) -> Option<&[u16]> {
    // SAFETY: every bit pattern is a valid u16; align_to only splits at aligned boundaries.
    match unsafe { b.align_to::<u16>() } {
        ([], h, []) => Some(h),
        _ => None,
    }
}

fn as_u16_mut(b: &mut [u8]) -> Option<&mut [u16]> {
    // SAFETY: as as_u16.
    match unsafe { b.align_to_mut::<u16>() } {
        ([], h, []) => Some(h),
        _ => None,
    }
}

// Each conversion computes every case and selects one, so that a loop of them vectorizes (half's
// scalar ones detect F16C per element); f16 slices that are 2-aligned take half's F16C path.

/// Exact: normals rebiased, subnormals scaled by 2^-24, infinities and NaNs (payload kept) widened.
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let (sign, em) = ((h & 0x8000) << 16, h & 0x7FFF);
    let normal = (em << 13) + ((127 - 15) << 23);
    let inf_nan = (em << 13) | 0x7F80_0000;
    let subnormal = (em as f32 * f32::from_bits(0x3380_0000)).to_bits(); // em * 2^-24, exact
    let bits = if em >= 0x7C00 {
        inf_nan
    } else if em < 0x0400 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(bits | sign)
}

/// Round to nearest even (F. Giesen's float_to_half_fast3_rtne): past 65520 infinity, NaN kept
/// quiet with its top payload bits, results below 2^-14 rounded by an f32 addition.
#[inline(always)]
fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let (sign, a) = (((b >> 16) & 0x8000) as u16, b & 0x7FFF_FFFF);
    let big = if a > 0x7F80_0000 { 0x7E00 | ((a >> 13) & 0x3FF) as u16 } else { 0x7C00 };
    let magic = f32::from_bits(((127 - 15) + (23 - 10) + 1) << 23); // 0.5: its ulp is 2^-24
    let subnormal = (f32::from_bits(a) + magic).to_bits().wrapping_sub(magic.to_bits()) as u16;
    let rebias = 15u32.wrapping_sub(127) << 23;
    let normal = (a.wrapping_add(rebias).wrapping_add(0xFFF + ((a >> 13) & 1)) >> 13) as u16;
    let o = if a >= 0x4780_0000 {
        big
    } else if a < 0x3880_0000 {
        subnormal
    } else {
        normal
    };
    sign | o
}

#[inline(always)]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Round to nearest even, NaN kept quiet: `bf16::from_f32` without branches.
#[inline(always)]
fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) as u16) | 0x0040;
    if b & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_is_halfs() {
        let specials = [0.0f32, -0.0, 1.0, f32::MAX, f32::MIN_POSITIVE, 1e-40, f32::INFINITY, f32::NEG_INFINITY];
        let mut x = 0x1234_5677u32;
        let randoms = (0..100_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            f32::from_bits(x)
        });
        for v in specials.into_iter().chain(randoms) {
            if v.is_nan() {
                assert!(bf16::from_bits(f32_to_bf16(v)).is_nan());
            } else {
                assert_eq!(f32_to_bf16(v), bf16::from_f32(v).to_bits(), "{v:e}");
            }
        }
    }

    #[test]
    fn f16_conversions_are_halfs() {
        for h in 0..=u16::MAX {
            let (got, want) = (f16_to_f32(h), f16::from_bits(h).to_f32());
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{h:#06x}");
            if !got.is_nan() {
                assert_eq!(f32_to_f16(got), h, "round trip of {h:#06x}");
            }
        }
        let specials = [0.0f32, -0.0, 65504.0, 65519.99, 65520.0, 6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8, 1e-40, f32::MAX, f32::INFINITY];
        let mut x = 0x9E37_79B9u32;
        let randoms = (0..200_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            f32::from_bits(x)
        });
        for v in specials.into_iter().flat_map(|v| [v, -v]).chain(randoms) {
            let (got, want) = (f32_to_f16(v), f16::from_f32(v));
            if v.is_nan() {
                assert!(f16::from_bits(got).is_nan());
            } else {
                assert_eq!(got, want.to_bits(), "{v:e}");
            }
        }
    }

    #[test]
    fn slices_round_trip_at_any_alignment() {
        let vals: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.37).collect();
        for dt in [DType::F16, DType::BF16, DType::F32] {
            let e = dt.size_bytes();
            let mut buf = vec![0u8; vals.len() * e + 1];
            for shift in [0, 1] {
                let bytes = &mut buf[shift..shift + vals.len() * e];
                dt.store(&vals, bytes, 0);
                let mut back = vec![0.0f32; vals.len()];
                dt.load(bytes, 0, &mut back);
                for (v, b) in vals.iter().zip(&back) {
                    let want = match dt {
                        DType::F16 => f16::from_f32(*v).to_f32(),
                        DType::BF16 => bf16::from_f32(*v).to_f32(),
                        DType::F32 => *v,
                    };
                    assert_eq!(*b, want, "{dt:?} shift {shift}");
                }
            }
        }
    }
}
