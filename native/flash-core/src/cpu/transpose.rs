//! Matrix transposes for the working layouts: 16 × 16 blocks through AVX-512 shuffles where the
//! CPU has them (a scalar loop writes one strided float per element, and at S = 60 the
//! materialized path transposes as many floats as it multiplies rows), the edges element by element.

use super::simd::{isa, Isa};

/// dst[c·dst_ld + r] = src[r·src_ld + c] for r < rows, c < cols.
pub fn transpose(src: &[f32], src_ld: usize, rows: usize, cols: usize, dst: &mut [f32], dst_ld: usize) {
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(cols <= src_ld && (rows - 1) * src_ld + cols <= src.len(), "transpose source out of bounds");
    assert!(rows <= dst_ld && (cols - 1) * dst_ld + rows <= dst.len(), "transpose destination out of bounds");
    let (full_r, full_c) = (rows / 16 * 16, cols / 16 * 16);
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 {
        for r in (0..full_r).step_by(16) {
            for c in (0..full_c).step_by(16) {
                // SAFETY: AVX-512 is present (isa); the block lies inside both checked bounds.
                unsafe { x86::block16(src.as_ptr().add(r * src_ld + c), src_ld, dst.as_mut_ptr().add(c * dst_ld + r), dst_ld) };
            }
        }
        scalar(src, src_ld, (full_r, rows), (0, cols), dst, dst_ld);
        scalar(src, src_ld, (0, full_r), (full_c, cols), dst, dst_ld);
        return;
    }
    let _ = (full_r, full_c);
    scalar(src, src_ld, (0, rows), (0, cols), dst, dst_ld);
}

fn scalar(src: &[f32], src_ld: usize, (r0, r1): (usize, usize), (c0, c1): (usize, usize), dst: &mut [f32], dst_ld: usize) {
    for c in c0..c1 {
        let out = &mut dst[c * dst_ld..];
        for r in r0..r1 {
            out[r] = src[r * src_ld + c];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// One 16 × 16 block: rows of `src` (leading dimension `ls`) to columns of `dst` (`ld`).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn block16(src: *const f32, ls: usize, dst: *mut f32, ld: usize) {
        let mut r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(src.add(i * ls)));
        // Pairs of rows interleaved, then pairs of pairs, then 128-bit lanes across four rows.
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for i in 0..4 {
            let (a, b) = (4 * i, 4 * i + 2);
            r[4 * i] = _mm512_shuffle_ps::<0x44>(t[a], t[b]);
            r[4 * i + 1] = _mm512_shuffle_ps::<0xEE>(t[a], t[b]);
            r[4 * i + 2] = _mm512_shuffle_ps::<0x44>(t[a + 1], t[b + 1]);
            r[4 * i + 3] = _mm512_shuffle_ps::<0xEE>(t[a + 1], t[b + 1]);
        }
        for i in 0..4 {
            t[i] = _mm512_shuffle_f32x4::<0x88>(r[i], r[i + 4]);
            t[i + 4] = _mm512_shuffle_f32x4::<0xDD>(r[i], r[i + 4]);
            t[i + 8] = _mm512_shuffle_f32x4::<0x88>(r[i + 8], r[i + 12]);
            t[i + 12] = _mm512_shuffle_f32x4::<0xDD>(r[i + 8], r[i + 12]);
        }
        for i in 0..8 {
            r[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[i + 8]);
            r[i + 8] = _mm512_shuffle_f32x4::<0xDD>(t[i], t[i + 8]);
        }
        for (i, v) in r.iter().enumerate() {
            _mm512_storeu_ps(dst.add(i * ld), *v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_definition() {
        for (rows, cols) in [(16, 16), (60, 64), (33, 17), (1, 40), (40, 1), (64, 128), (15, 15)] {
            let (ls, ld) = (cols + 3, rows + 5);
            let src: Vec<f32> = (0..rows * ls).map(|i| i as f32 * 0.5 - 7.0).collect();
            let mut dst = vec![f32::NAN; cols * ld];
            transpose(&src, ls, rows, cols, &mut dst, ld);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(dst[c * ld + r], src[r * ls + c], "{rows}x{cols} at ({r}, {c})");
                }
            }
            // Nothing outside the block is written.
            for c in 0..cols {
                assert!(dst[c * ld + rows..(c + 1) * ld].iter().all(|x| x.is_nan()));
            }
        }
    }
}
