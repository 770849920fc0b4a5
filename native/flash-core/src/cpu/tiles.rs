//! Which tiles the kernels visit, and how: a tile is one block of query rows of a (batch row,
//! head) against the keys of one aligned key block that those rows may see. Tiles that no mask
//! lets through are skipped, tiles every row sees whole run unmasked, and only the rest
//! (window edges, mixed segments) get an element mask. Bounds come from [`Mask`]; this module
//! adds the segment ids and block mask, which live in the call's buffers.

use super::workspace::{BLOCK_K, BLOCK_Q};
use crate::mask::{BlockMaskShape, Mask, MaskBuffers, Seq, MASK_BLOCK};
use crate::problem::Problem;
use std::iter::StepBy;
use std::ops::Range;

// A query tile and a key block each fall inside one block-mask entry.
const _: () = assert!(MASK_BLOCK.is_multiple_of(BLOCK_Q) && MASK_BLOCK.is_multiple_of(BLOCK_K));

/// Query rows `[r0, r1)` (local, r0 a multiple of BLOCK_Q) of batch row b, head h.
#[derive(Debug, Clone, Copy)]
pub struct RowBlock {
    pub b: usize,
    pub h: usize,
    pub seq: Seq,
    pub r0: usize,
    pub r1: usize,
}

impl RowBlock {
    /// The block of `seq`'s query rows starting at r0.
    pub fn new(b: usize, h: usize, seq: Seq, r0: usize) -> Self {
        RowBlock { b, h, seq, r0, r1: (r0 + BLOCK_Q).min(seq.q_len) }
    }
    pub fn rows(&self) -> usize {
        self.r1 - self.r0
    }
}

/// Keys `[c0, c1)` (local) of one tile and the element masks it needs.
#[derive(Debug, Clone, Copy)]
pub struct KeyTile {
    pub c0: usize,
    pub c1: usize,
    /// Some row does not see every key by window or padding.
    edge: bool,
    /// Segment ids differ within the tile.
    mixed_segments: bool,
}

impl KeyTile {
    pub fn cols(&self) -> usize {
        self.c1 - self.c0
    }
    pub fn masked(&self) -> bool {
        self.edge || self.mixed_segments
    }
}

/// How a tile's segment ids relate.
#[derive(PartialEq, Eq)]
enum Segments {
    /// No query's id can equal any key's.
    Disjoint,
    /// One id throughout (or no segment ids).
    Same,
    Mixed,
}

/// The call's mask in the form the tiles read.
pub struct Visibility<'a> {
    mask: &'a Mask,
    segments: Option<(Vec<i32>, Vec<i32>)>, // [B, Sq], [B, Sk]
    blocks: Option<(&'a [u8], BlockMaskShape)>, // [Bm, Hm, ceil(Sq/128), ceil(Sk/128)]
}

impl<'a> Visibility<'a> {
    /// The problem's mask with its buffers (their sizes were checked against `p`).
    pub fn new(p: &'a Problem, bufs: &MaskBuffers<'a>) -> Self {
        let ids = |bytes: &[u8]| bytes.chunks_exact(4).map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<i32>>();
        let segments = match (bufs.seg_q, bufs.seg_k) {
            (Some(q), Some(k)) if p.mask.segments => Some((ids(q), ids(k))),
            _ => None,
        };
        let blocks = bufs.block_mask.zip(p.mask.block_mask);
        Visibility { mask: &p.mask, segments, blocks }
    }

    /// Starts of the aligned key blocks that rows `rb` may see.
    pub fn key_blocks(&self, rb: &RowBlock) -> StepBy<Range<usize>> {
        let (lo, hi) = self.mask.key_range(&rb.seq, rb.r0, rb.r1);
        (lo / BLOCK_K * BLOCK_K..hi).step_by(BLOCK_K)
    }

    /// Starts of the query blocks of `seq` that may see a key of the aligned block at `blk`.
    pub fn query_blocks(&self, seq: &Seq, blk: usize) -> StepBy<Range<usize>> {
        let (lo, hi) = self.mask.query_range(seq, blk, (blk + BLOCK_K).min(seq.k_len));
        (lo / BLOCK_Q * BLOCK_Q..hi).step_by(BLOCK_Q)
    }

    /// The tile of rows `rb` and key block `blk`, its keys narrowed to those the rows may see;
    /// `None` when no key of it is visible to any row. The dQ and the dK/dV side of the backward
    /// both ask here, so they visit the same tiles.
    pub fn tile(&self, rb: &RowBlock, blk: usize) -> Option<KeyTile> {
        let seq = &rb.seq;
        let (lo, hi) = self.mask.key_range(seq, rb.r0, rb.r1);
        let (c0, c1) = (blk.max(lo), (blk + BLOCK_K).min(hi));
        if c0 >= c1 {
            return None;
        }
        let (q0, q1) = self.mask.query_range(seq, c0, c1);
        if q1 <= rb.r0 || rb.r1 <= q0 || self.block_hidden(rb, blk) {
            return None;
        }
        let segments = self.segments(rb, c0, c1);
        if segments == Segments::Disjoint {
            return None;
        }
        let edge = !self.mask.tile_inside(seq, rb.r0, rb.r1, c0, c1);
        Some(KeyTile { c0, c1, edge, mixed_segments: segments == Segments::Mixed })
    }

    fn block_hidden(&self, rb: &RowBlock, blk: usize) -> bool {
        self.blocks.is_some_and(|(bm, shape)| bm[shape.index(rb.b, rb.h, rb.r0 / MASK_BLOCK, blk / MASK_BLOCK)] == 0)
    }

    /// Compares the ranges of the tile's query and key ids (exact for sorted ids, as packed
    /// sequences have; otherwise the element mask sorts it out).
    fn segments(&self, rb: &RowBlock, c0: usize, c1: usize) -> Segments {
        let Some((seg_q, seg_k)) = &self.segments else { return Segments::Same };
        let (qb, kb) = (rb.b * self.mask.seq_q, rb.b * self.mask.seq_k);
        let (q_min, q_max) = min_max(&seg_q[qb + rb.r0..qb + rb.r1]);
        let (k_min, k_max) = min_max(&seg_k[kb + c0..kb + c1]);
        if q_max < k_min || k_max < q_min {
            Segments::Disjoint
        } else if q_min == q_max && k_min == k_max {
            Segments::Same
        } else {
            Segments::Mixed
        }
    }

    /// Sets to -inf the scores of a masked tile that their rows may not see.
    /// s: [rb.rows(), ld], the first `t.cols()` columns used.
    pub fn mask_scores(&self, s: &mut [f32], ld: usize, rb: &RowBlock, t: &KeyTile) {
        for (r, row) in s.chunks_mut(ld).take(rb.rows()).enumerate() {
            let (i, row) = (rb.r0 + r, &mut row[..t.cols()]);
            if t.edge {
                let (lo, hi) = self.mask.key_bounds(&rb.seq, i);
                let lo = lo.clamp(t.c0, t.c1) - t.c0;
                let hi = (hi.clamp(t.c0, t.c1) - t.c0).max(lo);
                row[..lo].fill(f32::NEG_INFINITY);
                row[hi..].fill(f32::NEG_INFINITY);
            }
            if let (true, Some((seg_q, seg_k))) = (t.mixed_segments, &self.segments) {
                let id = seg_q[rb.b * self.mask.seq_q + i];
                let keys = &seg_k[rb.b * self.mask.seq_k + t.c0..rb.b * self.mask.seq_k + t.c1];
                row.iter_mut().zip(keys).filter(|(_, &k)| k != id).for_each(|(x, _)| *x = f32::NEG_INFINITY);
            }
        }
    }
}

fn min_max(ids: &[i32]) -> (i32, i32) {
    ids.iter().fold((i32::MAX, i32::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)))
}
