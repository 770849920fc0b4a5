//! Conversions between the public layout ([B, S, H, D] in the storage dtype, bytes; inputs at
//! their [`Strides`], outputs packed) and the kernels' working layouts, all f32 with one
//! contiguous matrix per head:
//! * rows:       [B·H, S, Dp], Dp = D rounded up to COL_PAD (zero padding);
//! * transposed: [B·H, D, Sp], Sp = [`transposed_ld`]`(S)` (zero padding).

use super::matmul::{round_up, COL_PAD};
use super::par;
use super::workspace::{zeroed, Buffer};
use crate::dtype::DType;
use crate::error::Result;
use crate::strides::Strides;

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
        par::chunks_mut(&mut out, head_len, |bh, head| fill(bh / h, bh % h, head));
    }
    Ok(out)
}

/// [B, S, H, D] elements of `dtype` at strides `st` -> rows layout [B·H, S, Dp], each element
/// times `scale`.
pub fn pack_rows(src: &[u8], dtype: DType, shape: [usize; 4], st: Strides, scale: f32, what: &str) -> Result<Buffer> {
    let [b, s, h, d] = shape;
    let dp = padded_dim(d);
    per_head(b * h, h, s * dp, what, |bi, hi, head| {
        for (si, row) in head.chunks_exact_mut(dp).enumerate() {
            let row = &mut row[..d];
            dtype.load(src, st.at(bi, si, hi), row);
            if scale != 1.0 {
                row.iter_mut().for_each(|x| *x *= scale);
            }
        }
    })
}

/// [B, S, H, D] elements of `dtype` at strides `st` -> transposed layout [B·H, D, Sp].
pub fn pack_transposed(src: &[u8], dtype: DType, shape: [usize; 4], st: Strides, what: &str) -> Result<Buffer> {
    let [b, s, h, d] = shape;
    let sp = transposed_ld(s);
    per_head(b * h, h, d * sp, what, |bi, hi, head| {
        let mut row = vec![0.0f32; d];
        for si in 0..s {
            dtype.load(src, st.at(bi, si, hi), &mut row);
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
    par::chunks_mut(dst, row_bytes, |bs, out_row| {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A [B, S, H, D] = [2, 3, 2, 3] tensor whose element (b, s, h, d) is 1000b + 100s + 10h + d,
    /// stored as a [B, H, S, D] transpose with NaN between batches; returns it and its strides.
    fn transposed_input() -> (Vec<u8>, Strides) {
        let st = Strides { batch: 2 * 3 * 3 + 4, seq: 3, head: 3 * 3 };
        let mut vals = vec![f32::NAN; 2 * st.batch];
        for (b, s, h, d) in (0..2).flat_map(|b| (0..3).flat_map(move |s| (0..2).flat_map(move |h| (0..3).map(move |d| (b, s, h, d))))) {
            vals[st.at(b, s, h) + d] = (1000 * b + 100 * s + 10 * h + d) as f32;
        }
        let mut bytes = vec![0u8; vals.len() * 4];
        DType::F32.store(&vals, &mut bytes, 0);
        (bytes, st)
    }

    #[test]
    fn pack_rows_and_transposed_read_at_the_strides() {
        let (src, st) = transposed_input();
        let shape = [2, 3, 2, 3];
        let dp = padded_dim(3);
        let rows = pack_rows(&src, DType::F32, shape, st, 2.0, "test").unwrap(); // [B·H, S, Dp]
        let sp = transposed_ld(3);
        let cols = pack_transposed(&src, DType::F32, shape, st, "test").unwrap(); // [B·H, D, Sp]
        for (b, s, h, d) in (0..2).flat_map(|b| (0..3).flat_map(move |s| (0..2).flat_map(move |h| (0..3).map(move |d| (b, s, h, d))))) {
            let want = (1000 * b + 100 * s + 10 * h + d) as f32;
            assert_eq!(rows[((b * 2 + h) * 3 + s) * dp + d], 2.0 * want, "rows ({b}, {s}, {h}, {d})");
            assert_eq!(cols[((b * 2 + h) * 3 + d) * sp + s], want, "transposed ({b}, {s}, {h}, {d})");
        }
        // Padding stays zero: no NaN from between the batches reached the working layouts.
        assert!(rows.iter().chain(cols.iter()).all(|x| x.is_finite()));
    }
}
