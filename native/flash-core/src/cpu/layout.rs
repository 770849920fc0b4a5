//! Conversions between the public layout ([B, S, H, D] in the storage dtype, bytes) and the
//! kernels' working layouts, all f32 with one contiguous matrix per head:
//! * rows:       [B·H, S, Dp], Dp = D rounded up to COL_PAD (zero padding);
//! * transposed: [B·H, D, Sp], Sp = [`transposed_ld`]`(S)` (zero padding).

use super::matmul::{round_up, COL_PAD};
use super::workspace::{zeroed, Buffer};
use crate::dtype::DType;
use crate::error::Result;
use rayon::prelude::*;

/// Padded head dimension of the row layout.
pub fn padded_dim(d: usize) -> usize {
    round_up(d, COL_PAD)
}

/// Leading dimension of the transposed layout: S rounded up to COL_PAD, plus one cache line so
/// that consecutive rows (one per head-dim index, walked by the tile product) do not all fall in
/// the same L1 set when S is a power of two.
pub fn transposed_ld(s: usize) -> usize {
    round_up(s, COL_PAD) + COL_PAD
}

/// A zeroed working buffer of `heads` matrices of `head_len` elements each, every matrix filled by
/// `fill(batch index, head index, matrix)` in parallel.
fn per_head(heads: usize, h: usize, head_len: usize, what: &str, fill: impl Fn(usize, usize, &mut [f32]) + Sync) -> Result<Buffer> {
    let mut out = zeroed(heads * head_len, what)?;
    if head_len > 0 {
        out.par_chunks_mut(head_len).enumerate().for_each(|(bh, head)| fill(bh / h, bh % h, head));
    }
    Ok(out)
}

/// [B, S, H, D] elements of `dtype` -> rows layout [B·H, S, Dp], each element times `scale`.
pub fn pack_rows(src: &[u8], dtype: DType, shape: [usize; 4], scale: f32, what: &str) -> Result<Buffer> {
    let [b, s, h, d] = shape;
    let dp = padded_dim(d);
    per_head(b * h, h, s * dp, what, |bi, hi, head| {
        for (si, row) in head.chunks_exact_mut(dp).enumerate() {
            let row = &mut row[..d];
            dtype.load(src, ((bi * s + si) * h + hi) * d, row);
            if scale != 1.0 {
                row.iter_mut().for_each(|x| *x *= scale);
            }
        }
    })
}

/// [B, S, H, D] elements of `dtype` -> transposed layout [B·H, D, Sp].
pub fn pack_transposed(src: &[u8], dtype: DType, shape: [usize; 4], what: &str) -> Result<Buffer> {
    let [b, s, h, d] = shape;
    let sp = transposed_ld(s);
    per_head(b * h, h, d * sp, what, |bi, hi, head| {
        let mut row = vec![0.0f32; d];
        for si in 0..s {
            dtype.load(src, ((bi * s + si) * h + hi) * d, &mut row);
            for (di, &x) in row.iter().enumerate() {
                head[di * sp + si] = x;
            }
        }
    })
}

/// Rows layout [B·H, S, Dp] times `scale` -> [B, S, H, D] elements of `dtype` in `dst`.
pub fn unpack_rows(src: &[f32], dst: &mut [u8], dtype: DType, shape: [usize; 4], scale: f32) {
    let [_, s, h, d] = shape;
    let dp = padded_dim(d);
    let row_bytes = h * d * dtype.size_bytes();
    if row_bytes == 0 {
        return;
    }
    dst.par_chunks_mut(row_bytes).enumerate().for_each(|(bs, out_row)| {
        let (bi, si) = (bs / s, bs % s);
        let mut buf = vec![0.0f32; d];
        for hi in 0..h {
            let start = ((bi * h + hi) * s + si) * dp;
            buf.iter_mut().zip(&src[start..start + d]).for_each(|(o, &x)| *o = x * scale);
            dtype.store(&buf, out_row, hi * d);
        }
    });
}

/// Decodes a float32 byte buffer.
pub fn load_f32(src: &[u8], what: &str) -> Result<Buffer> {
    let mut out = zeroed(src.len() / 4, what)?;
    DType::F32.load(src, 0, &mut out);
    Ok(out)
}
