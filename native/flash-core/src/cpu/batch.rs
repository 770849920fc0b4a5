//! Where each batch row lives in the working layouts, and the split of an output buffer into one
//! piece per (batch row, head) so that parallel tasks own disjoint pieces.
//!
//! The layouts see q as `[PB, Rq, H, D]`, k as `[PB, Rk, Hkv, D]`, v as `[PB, Rk, Hkv, Dv]` and o
//! as `[PB, Rq, H, Dv]`: a padded call is its own `[B, Sq, H, D]` (PB = B), a varlen call one batch of `total_q` (`total_k`) rows in which each
//! sequence is a run of rows (PB = 1). So the rows layout `[PB·H, Rq, Dp]` orders its rows like
//! lse (`[B, H, Sq]` or `[H, total_q]`): batch row b's query row 0 of head h is packed row
//! `p.lse_base(b, h)`.

use crate::mask::Seq;
use crate::problem::Problem;

/// The packed view of one call's tensors.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    pub batches: usize, // PB
    pub q_rows: usize,  // Rq: Sq, or total_q
    pub k_rows: usize,  // Rk: Sk, or total_k
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,   // D: q, k, dq, dk
    pub head_dim_v: usize, // Dv: v, o, dO, dv
    varlen: bool,
}

impl Geometry {
    pub fn new(p: &Problem) -> Self {
        let d = p.dims;
        let (batches, q_rows, k_rows) = match p.mask.varlen {
            Some(v) => (1, v.total_q, v.total_k),
            None => (d.batch, d.seq_q, d.seq_k),
        };
        let varlen = p.mask.varlen.is_some();
        Geometry { batches, q_rows, k_rows, heads: d.heads, kv_heads: d.kv_heads, head_dim: d.head_dim, head_dim_v: d.head_dim_v, varlen }
    }

    /// q (dq) as `[PB, Rq, H, D]`.
    pub fn q4(&self) -> [usize; 4] {
        [self.batches, self.q_rows, self.heads, self.head_dim]
    }

    /// o (dO) as `[PB, Rq, H, Dv]`.
    pub fn o4(&self) -> [usize; 4] {
        [self.batches, self.q_rows, self.heads, self.head_dim_v]
    }

    /// k (dk) as `[PB, Rk, Hkv, D]`.
    pub fn kv4(&self) -> [usize; 4] {
        [self.batches, self.k_rows, self.kv_heads, self.head_dim]
    }

    /// v (dv) as `[PB, Rk, Hkv, Dv]`.
    pub fn v4(&self) -> [usize; 4] {
        [self.batches, self.k_rows, self.kv_heads, self.head_dim_v]
    }

    /// The packed batch that holds batch row b.
    pub fn batch_of(&self, b: usize) -> usize {
        if self.varlen {
            0
        } else {
            b
        }
    }

    /// Matrix of kv head `hkv` of batch row b in `[PB·Hkv, ...]` layouts.
    pub fn kv_matrix(&self, b: usize, hkv: usize) -> usize {
        self.batch_of(b) * self.kv_heads + hkv
    }

    /// Row (rows layout) or column (transposed layout) of the batch row's key 0 in its matrix.
    pub fn key_offset(&self, seq: &Seq, b: usize) -> usize {
        seq.k_start - self.batch_of(b) * self.k_rows
    }

    /// Row of the batch row's query 0 in its packed batch (`[PB, Rq, H, D]`).
    pub fn query_offset(&self, seq: &Seq, b: usize) -> usize {
        seq.q_start - self.batch_of(b) * self.q_rows
    }

    /// Packed row in `[PB·Hkv, Rk]` of the batch row's key 0 for kv head `hkv`.
    pub fn k_row(&self, seq: &Seq, b: usize, hkv: usize) -> usize {
        self.kv_matrix(b, hkv) * self.k_rows + self.key_offset(seq, b)
    }
}

/// Runs `(first packed row, rows)` of every batch row's queries, indexed `b·H + h`.
pub fn query_runs(p: &Problem) -> Vec<(usize, usize)> {
    let h = p.dims.heads;
    (0..p.dims.batch * h).map(|bh| (p.lse_base(bh / h, bh % h), p.mask.seq(bh / h).q_len)).collect()
}

/// Runs of every batch row's keys, indexed `b·Hkv + hkv`.
pub fn key_runs(p: &Problem, geo: &Geometry) -> Vec<(usize, usize)> {
    let hkv = geo.kv_heads;
    (0..p.dims.batch * hkv)
        .map(|bk| {
            let (b, seq) = (bk / hkv, p.mask.seq(bk / hkv));
            (geo.k_row(&seq, b, bk % hkv), seq.k_len)
        })
        .collect()
}

/// Splits `buf` (rows of `width` floats) into the given disjoint runs `(first row, rows)`,
/// returned in the order given. Overlapping runs are a layout bug and panic.
pub fn split_rows<'a>(buf: &'a mut [f32], width: usize, runs: &[(usize, usize)]) -> Vec<&'a mut [f32]> {
    let mut order: Vec<usize> = (0..runs.len()).filter(|&i| runs[i].1 > 0).collect();
    order.sort_by_key(|&i| runs[i].0);
    let mut out: Vec<&'a mut [f32]> = (0..runs.len()).map(|_| <&mut [f32]>::default()).collect();
    let (mut rest, mut at) = (buf, 0);
    for i in order {
        let (start, rows) = runs[i];
        let gap = start.checked_sub(at).expect("runs of rows overlap");
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(gap * width);
        let (piece, tail) = tail.split_at_mut(rows * width);
        (rest, at) = (tail, start + rows);
        out[i] = piece;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_rows_gives_each_run_its_rows() {
        let mut buf: Vec<f32> = (0..20).map(|x| x as f32).collect();
        let runs = [(6, 2), (0, 3), (3, 0), (9, 1)];
        let pieces = split_rows(&mut buf, 2, &runs);
        let got: Vec<Vec<f32>> = pieces.into_iter().map(|p| p.to_vec()).collect();
        assert_eq!(got, vec![vec![12.0, 13.0, 14.0, 15.0], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0], vec![], vec![18.0, 19.0]]);
    }
}
