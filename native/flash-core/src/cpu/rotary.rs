//! Rotary embeddings on the CPU: one pass over x, rayon over (b, s) rows, f32 math. Each row
//! reads its table row once (angles negated for the backward) and turns every head with it; the
//! pass-through dims R..D are copied as bytes.

use super::par;
use super::simd::{isa, Isa};
use crate::dtype::DType;
use crate::error::Result;
use crate::rotary::{PositionSource, RotaryIo, RotaryProblem};

/// Bytes of output per rayon task at least: fewer, larger tasks for small heads.
const MIN_TASK_BYTES: usize = 64 * 1024;

pub(super) fn run(p: &RotaryProblem, io: RotaryIo) -> Result<()> {
    let d = p.dims;
    let e = p.dtype.size_bytes();
    let row_len = d.heads * d.head_dim; // one (b, s) row: [H, D]
    if row_len == 0 || d.rows() == 0 {
        return Ok(());
    }
    let (cos, sin) = (io.cos, io.sin);
    let positions = io.positions;
    let min_rows = MIN_TASK_BYTES.div_ceil(row_len * e);
    par::chunks_mut_init(
        io.y,
        row_len * e,
        min_rows,
        || Row::new(row_len, d.half()),
        |row, bs, y| {
            let pos = match p.positions {
                PositionSource::Offset(off) => bs % d.seq + off,
                // Validated in [0, max_pos) by RotaryProblem.
                PositionSource::Array => read_i32(positions.unwrap_or_default(), bs) as usize,
            };
            row.load_angles(cos, sin, pos, p.inverse);
            row.turn(p, &io.x[bs * row_len * e..(bs + 1) * row_len * e], y);
        },
    );
    Ok(())
}

/// One task's scratch: a (b, s) row of x and its row of the tables, in f32.
struct Row {
    buf: Vec<f32>, // [H, D]
    cos: Vec<f32>, // [R/2]
    sin: Vec<f32>, // [R/2], negated for the backward
}

impl Row {
    fn new(row_len: usize, half: usize) -> Row {
        Row { buf: vec![0.0; row_len], cos: vec![0.0; half], sin: vec![0.0; half] }
    }

    fn load_angles(&mut self, cos: &[u8], sin: &[u8], pos: usize, inverse: bool) {
        let half = self.cos.len();
        DType::F32.load(cos, pos * half, &mut self.cos);
        DType::F32.load(sin, pos * half, &mut self.sin);
        if inverse {
            self.sin.iter_mut().for_each(|s| *s = -*s);
        }
    }

    /// The row x -> y ([H, D] bytes each), compiled for the widest vectors this CPU has.
    fn turn(&mut self, p: &RotaryProblem, x: &[u8], y: &mut [u8]) {
        match isa() {
            // SAFETY: isa() detected these features.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { self.turn_avx512(p, x, y) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { self.turn_avx2(p, x, y) },
            _ => self.turn_any(p, x, y),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
    unsafe fn turn_avx512(&mut self, p: &RotaryProblem, x: &[u8], y: &mut [u8]) {
        self.turn_any(p, x, y)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn turn_avx2(&mut self, p: &RotaryProblem, x: &[u8], y: &mut [u8]) {
        self.turn_any(p, x, y)
    }

    /// Whole-row conversions, then each head turned in f32 (separate multiplies and adds, never
    /// fused: every instruction set gives the same bits).
    #[inline(always)]
    fn turn_any(&mut self, p: &RotaryProblem, x: &[u8], y: &mut [u8]) {
        let (dt, hd, r) = (p.dtype, p.dims.head_dim, p.dims.rotary_dim);
        let half = r / 2;
        dt.load(x, 0, &mut self.buf);
        let (c, s) = (&self.cos[..half], &self.sin[..half]);
        for head in self.buf.chunks_exact_mut(hd) {
            if p.interleaved {
                let v = &mut head[..2 * half];
                for i in 0..half {
                    let (a, b) = (v[2 * i], v[2 * i + 1]);
                    v[2 * i] = a * c[i] - b * s[i];
                    v[2 * i + 1] = b * c[i] + a * s[i];
                }
            } else {
                let (lo, hi) = head.split_at_mut(half);
                let hi = &mut hi[..half];
                for i in 0..half {
                    let (a, b) = (lo[i], hi[i]);
                    lo[i] = a * c[i] - b * s[i];
                    hi[i] = b * c[i] + a * s[i];
                }
            }
        }
        dt.store(&self.buf, y, 0);
        if r < hd {
            // dims R..D as they were, bit for bit (a store of their f32 values could quiet a NaN)
            let e = dt.size_bytes();
            for (yh, xh) in y.chunks_exact_mut(hd * e).zip(x.chunks_exact(hd * e)) {
                yh[r * e..].copy_from_slice(&xh[r * e..]);
            }
        }
    }
}

fn read_i32(b: &[u8], i: usize) -> i32 {
    i32::from_ne_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}
