//! Rotary embeddings on the CPU: one pass over x, rayon over (b, s) rows, f32 math. Each row
//! reads its table row once (angles negated for the backward) and turns every head with it; the
//! pass-through dims R..D are copied as bytes.

use rayon::prelude::*;

use crate::dtype::DType;
use crate::error::Result;
use crate::rotary::{PositionSource, RotaryIo, RotaryProblem};

/// Bytes of output per rayon task at least: fewer, larger tasks for small heads.
const MIN_TASK_BYTES: usize = 64 * 1024;

pub(super) fn run(p: &RotaryProblem, io: RotaryIo) -> Result<()> {
    let d = p.dims;
    let e = p.dtype.size_bytes();
    let row_bytes = d.heads * d.head_dim * e; // one (b, s) row: [H, D]
    if row_bytes == 0 || d.rows() == 0 {
        return Ok(());
    }
    let (cos, sin) = (io.cos, io.sin);
    let positions = io.positions;
    let min_rows = MIN_TASK_BYTES.div_ceil(row_bytes);
    io.y.par_chunks_mut(row_bytes).with_min_len(min_rows).enumerate().for_each_init(
        || Row::new(d.half()),
        |row, (bs, y)| {
            let pos = match p.positions {
                PositionSource::Offset(off) => bs % d.seq + off,
                // Validated in [0, max_pos) by RotaryProblem.
                PositionSource::Array => read_i32(positions.unwrap_or_default(), bs) as usize,
            };
            row.load_angles(cos, sin, pos, p.inverse);
            let x = &io.x[bs * row_bytes..(bs + 1) * row_bytes];
            for h in 0..d.heads {
                row.turn(p, x, y, h);
            }
        },
    );
    Ok(())
}

/// One task's scratch: a head's rotated dims and its row of the tables, in f32.
struct Row {
    buf: Vec<f32>, // [R]
    cos: Vec<f32>, // [R/2]
    sin: Vec<f32>, // [R/2], negated for the backward
}

impl Row {
    fn new(half: usize) -> Row {
        Row { buf: vec![0.0; 2 * half], cos: vec![0.0; half], sin: vec![0.0; half] }
    }

    fn load_angles(&mut self, cos: &[u8], sin: &[u8], pos: usize, inverse: bool) {
        let half = self.cos.len();
        DType::F32.load(cos, pos * half, &mut self.cos);
        DType::F32.load(sin, pos * half, &mut self.sin);
        if inverse {
            self.sin.iter_mut().for_each(|s| *s = -*s);
        }
    }

    /// Head h of the row: x -> y ([H, D] bytes each).
    fn turn(&mut self, p: &RotaryProblem, x: &[u8], y: &mut [u8], h: usize) {
        let (dt, hd, r) = (p.dtype, p.dims.head_dim, p.dims.rotary_dim);
        let start = h * hd;
        dt.load(x, start, &mut self.buf);
        let (c, s) = (&self.cos[..], &self.sin[..]);
        if p.interleaved {
            for ((pair, &c), &s) in self.buf.chunks_exact_mut(2).zip(c).zip(s) {
                let (a, b) = (pair[0], pair[1]);
                pair[0] = a * c - b * s;
                pair[1] = b * c + a * s;
            }
        } else {
            let (lo, hi) = self.buf.split_at_mut(r / 2);
            for (((a, b), &c), &s) in lo.iter_mut().zip(hi.iter_mut()).zip(c).zip(s) {
                let (x0, x1) = (*a, *b);
                *a = x0 * c - x1 * s;
                *b = x1 * c + x0 * s;
            }
        }
        dt.store(&self.buf, y, start);
        let e = dt.size_bytes();
        let pass = (start + r) * e..(start + hd) * e;
        y[pass.clone()].copy_from_slice(&x[pass]);
    }
}

fn read_i32(b: &[u8], i: usize) -> i32 {
    i32::from_ne_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}
