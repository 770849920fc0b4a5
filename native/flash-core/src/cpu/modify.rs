//! Score modifiers on one CPU tile ([`crate::modifiers`]'s rules), in the kernels' exp2 units:
//! scores arrive as `scale·log2(e)·q·k`, so a cap `c` becomes `c·log2(e)` and a slope
//! `slope·log2(e)`; the softmax then needs no other change. Sinks live in the row state
//! ([`sink2`]) and in the backward's dsinks sum, not in the tiles.

use super::batch::Geometry;
use super::simd;
use super::tiles::{KeyTile, RowBlock};
use super::workspace::BLOCK_K;
use crate::dtype::DType;
use crate::problem::Problem;
use crate::strides::Strides;
use std::f32::consts::LOG2_E;

/// 0, 1, 2, … as f32: the column offsets of a tile's keys (ALiBi's distances).
static RAMP: [f32; BLOCK_K] = {
    let mut a = [0.0f32; BLOCK_K];
    let mut i = 0;
    while i < BLOCK_K {
        a[i] = i as f32;
        i += 1;
    }
    a
};

/// The modifiers of one (batch row, head) in exp2 units.
pub struct TileMods {
    cap2: Option<f32>,
    slope2: Option<f32>,
    /// Row 0's diagonal key (`k_hi − q_len`): ALiBi's distance is `|i + diag0 − j|`.
    diag0: isize,
}

impl TileMods {
    pub fn new(p: &Problem, rb: &RowBlock) -> Self {
        TileMods {
            cap2: p.mods.softcap.map(|c| c * LOG2_E),
            slope2: p.mods.slope(rb.b, rb.h, p.dims.heads).map(|s| s * LOG2_E),
            diag0: rb.seq.k_hi as isize - rb.seq.q_len as isize,
        }
    }

    pub fn softcap(&self) -> bool {
        self.cap2.is_some()
    }

    /// Modifies the scores of tile `t` of rows `rb`: s [rb.rows(), ld], first `t.cols()` columns.
    /// With softcap, `tanh` (same layout) receives `tanh(s / c)`, which [`softcap_chain`] needs.
    pub fn apply(&self, s: &mut [f32], ld: usize, rb: &RowBlock, t: &KeyTile, mut tanh: Option<&mut [f32]>) {
        let cols = t.cols();
        for r in 0..rb.rows() {
            let row = &mut s[r * ld..r * ld + cols];
            if let Some(c2) = self.cap2 {
                let th = tanh.as_deref_mut().map(|x| &mut x[r * ld..r * ld + cols]);
                cap_row(row, c2, th);
            }
            if let Some(m2) = self.slope2 {
                // |i + diag0 − j| for the row's keys j = c0 + c: a float base minus a ramp, which
                // vectorises (exact: distances stay far below 2^24).
                let base = ((rb.r0 + r) as isize + self.diag0 - t.c0 as isize) as f32;
                for (x, &c) in row.iter_mut().zip(&RAMP[..cols]) {
                    *x -= m2 * (base - c).abs();
                }
            }
        }
    }
}

/// s <- c2·tanh(s / c2); the tanh values go to `th` when given (vectorised: simd::softcap).
fn cap_row(row: &mut [f32], c2: f32, th: Option<&mut [f32]>) {
    simd::softcap(row, c2, th)
}

/// The softcap's chain rule on dS: ds *= 1 − tanh², rows × cols of [rows, ld].
pub fn softcap_chain(ds: &mut [f32], tanh: &[f32], rows: usize, cols: usize, ld: usize) {
    for r in 0..rows {
        let (d, t) = (&mut ds[r * ld..r * ld + cols], &tanh[r * ld..r * ld + cols]);
        d.iter_mut().zip(t).for_each(|(d, t)| *d *= 1.0 - t * t);
    }
}

/// Head h's sink in exp2 units, the online softmax's starting max (with a running sum of 1).
pub fn sink2(p: &Problem, h: usize) -> Option<f32> {
    p.mods.sink(h).map(|s| s * LOG2_E)
}

/// dsinks[h] = −Σ over batch rows and query rows of exp(sink_h − lse) · (rowsum(dO ∘ O) − dlse), in f64 in
/// a fixed order, from the caller's o, dO (each at its strides) and lse (both CPU paths' dsinks).
pub fn sink_grads(p: &Problem, (d_out, do_st): (&[u8], Strides), (o, o_st): (&[u8], Strides), lse: &[u8], dlse: Option<&[f32]>) -> Vec<f32> {
    let (h_n, d) = (p.dims.heads, p.dims.head_dim_v);
    let geo = Geometry::new(p);
    let (mut a, mut c, mut l) = (vec![0.0f32; d], vec![0.0f32; d], [0.0f32]);
    (0..h_n)
        .map(|h| {
            let sink = p.mods.sink(h).unwrap_or(f32::NEG_INFINITY) as f64;
            let mut sum = 0.0f64;
            for b in 0..p.dims.batch {
                let seq = p.mask.seq(b);
                let (pb, r0) = (geo.batch_of(b), geo.query_offset(&seq, b));
                for i in 0..seq.q_len {
                    DType::F32.load(lse, p.lse_base(b, h) + i, &mut l);
                    if l[0] == f32::NEG_INFINITY {
                        continue;
                    }
                    p.dtype.load(d_out, do_st.at(pb, r0 + i, h), &mut a);
                    p.dtype.load(o, o_st.at(pb, r0 + i, h), &mut c);
                    let mut delta: f64 = a.iter().zip(&c).map(|(x, y)| (x * y) as f64).sum();
                    if let Some(g) = dlse {
                        delta -= g[p.lse_base(b, h) + i] as f64;
                    }
                    sum -= (sink - l[0] as f64).exp() * delta;
                }
            }
            sum as f32
        })
        .collect()
}
