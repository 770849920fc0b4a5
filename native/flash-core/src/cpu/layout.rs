//! Conversions between the public layout ([B, S, H, D] in the storage dtype, bytes) and the
//! kernels' working layout ([B, H, S, D] f32, one contiguous [S, D] matrix per head).

use super::workspace::zeroed;
use crate::dtype::DType;
use crate::error::Result;
use rayon::prelude::*;

/// [B, S, H, D] elements of `dtype` in `src` -> [B, H, S, D] f32, each element times `scale`.
pub fn pack(src: &[u8], dtype: DType, shape: [usize; 4], scale: f32, what: &str) -> Result<Vec<f32>> {
    let [_, s, h, d] = shape;
    let mut out = zeroed(shape.iter().product(), what)?;
    if s * d == 0 {
        return Ok(out);
    }
    out.par_chunks_mut(s * d).enumerate().for_each(|(bh, head)| {
        let (b, hh) = (bh / h, bh % h);
        for (si, row) in head.chunks_exact_mut(d).enumerate() {
            dtype.load(src, ((b * s + si) * h + hh) * d, row);
            if scale != 1.0 {
                row.iter_mut().for_each(|x| *x *= scale);
            }
        }
    });
    Ok(out)
}

/// [B, H, S, D] f32 times `scale` -> [B, S, H, D] elements of `dtype` in `dst`.
pub fn unpack(src: &[f32], dst: &mut [u8], dtype: DType, shape: [usize; 4], scale: f32) {
    let [_, s, h, d] = shape;
    let row_bytes = h * d * dtype.size_bytes();
    if row_bytes == 0 {
        return;
    }
    dst.par_chunks_mut(row_bytes).enumerate().for_each(|(bs, out_row)| {
        let (b, si) = (bs / s, bs % s);
        let mut buf = vec![0.0f32; d];
        for hh in 0..h {
            let start = ((b * h + hh) * s + si) * d;
            buf.iter_mut().zip(&src[start..start + d]).for_each(|(o, &x)| *o = x * scale);
            dtype.store(&buf, out_row, hh * d);
        }
    });
}

/// Decodes a float32 byte buffer.
pub fn load_f32(src: &[u8], what: &str) -> Result<Vec<f32>> {
    let mut out = zeroed(src.len() / 4, what)?;
    DType::F32.load(src, 0, &mut out);
    Ok(out)
}
