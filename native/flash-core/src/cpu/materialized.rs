//! The materialized CPU path: each task holds the whole score matrix of one head, S = Qs·Kᵀ
//! `[Sq, Sk]` (and, in the backward, dS beside it), takes a plain softmax over each row and forms
//! the products as whole-matrix products — the textbook algorithm, exact to the fused path's
//! bounds and returning the same (o, lse) and gradients.
//!
//! What it buys on short sequences: a task reads its head's rows of q, k, v (dO, o) straight from
//! the caller's buffers into scratch that stays in cache, and writes its outputs straight back.
//! The fused path instead packs whole tensors into working layouts first and unpacks after
//! (module `layout`) — several passes over memory that, at S = 60, cost as much as the attention.
//!
//! Masks go through the fused path's own per-tile functions ([`Visibility::tile`] /
//! [`Visibility::mask_scores`]) in one place, [`scores`]: the same tiles are visible, the same
//! elements hidden, and the tiles nobody sees are never multiplied.
//!
//! Tasks: forward one per (batch row, head); backward one per (batch row, kv head), which owns
//! dQ of its query heads and dK/dV of its kv head (no atomics, bit-identical run to run).

use super::layout::{padded_dim, transposed_ld};
use super::matmul::{matmul, Mat};
use super::simd;
use super::tiles::{KeyTile, RowBlock, Visibility};
use super::workspace::BLOCK_Q;
use crate::dtype::DType;
use crate::error::Result;
use crate::io::{BackwardIo, ForwardIo};
use crate::problem::Problem;
use rayon::prelude::*;
use std::f32::consts::{LN_2, LOG2_E};
use std::marker::PhantomData;

/// Bytes of the score matrices one task holds: `matrices` × Sq × ld(Sk) f32 (the longest
/// sequence of a varlen call). The forward holds S, the backward S and dS.
pub fn task_bytes(p: &Problem, matrices: usize) -> u128 {
    let (sq, sk) = (p.dims.seq_q as u128, transposed_ld(p.dims.seq_k) as u128);
    matrices as u128 * sq * sk * 4
}

/// Tasks of a pass: (batch row, head) forward, (batch row, kv head) backward.
pub fn tasks(p: &Problem, backward: bool) -> usize {
    p.dims.batch * if backward { p.dims.kv_heads } else { p.dims.heads }
}

/// Forward (layouts in [`ForwardIo`]).
pub fn forward(p: &Problem, io: ForwardIo) -> Result<()> {
    let ForwardIo { q, k, v, o, lse, mask } = io;
    let vis = Visibility::new(p, &mask);
    let (o, lse) = (SharedOut::new(o, p.dtype), SharedOut::new(lse, DType::F32));
    let h = p.dims.heads;
    (0..tasks(p, false)).into_par_iter().for_each_init(
        || ForwardScratch::new(p),
        |w, bh| forward_head(p, &vis, [q, k, v], (&o, &lse), (bh / h, bh % h), w),
    );
    Ok(())
}

/// Backward (layouts in [`BackwardIo`]).
pub fn backward(p: &Problem, io: BackwardIo) -> Result<()> {
    let BackwardIo { d_out, q, k, v, o, lse, dq, dk, dv, mask } = io;
    let vis = Visibility::new(p, &mask);
    let outs = [SharedOut::new(dq, p.dtype), SharedOut::new(dk, p.dtype), SharedOut::new(dv, p.dtype)];
    let hkv = p.dims.kv_heads;
    (0..tasks(p, true)).into_par_iter().for_each_init(
        || BackwardScratch::new(p),
        |w, bk| backward_group(p, &vis, [d_out, q, k, v, o, lse], &outs, (bk / hkv, bk % hkv), w),
    );
    Ok(())
}

/// An output buffer of the caller that parallel tasks write, each its own elements.
struct SharedOut<'a> {
    ptr: *mut u8,
    len: usize,
    dtype: DType,
    _buf: PhantomData<&'a mut [u8]>,
}

// SAFETY: tasks write disjoint elements (see `store`); the buffer outlives them (the borrow).
unsafe impl Sync for SharedOut<'_> {}

impl<'a> SharedOut<'a> {
    fn new(buf: &'a mut [u8], dtype: DType) -> Self {
        SharedOut { ptr: buf.as_mut_ptr(), len: buf.len(), dtype, _buf: PhantomData }
    }

    /// Stores `src` as elements `start..start + src.len()` (bounds checked).
    ///
    /// SAFETY: no other task touches these elements meanwhile. Each element of o, lse, dq, dk
    /// and dv belongs to exactly one (batch row, head) or (batch row, kv head) task.
    unsafe fn store(&self, start: usize, src: &[f32]) {
        let size = self.dtype.size_bytes();
        let (at, n) = (start * size, src.len() * size);
        assert!(at + n <= self.len, "output store out of bounds");
        let dst = std::slice::from_raw_parts_mut(self.ptr.add(at), n);
        self.dtype.store(src, dst, 0);
    }
}

/// Element index of (packed row `row`, head `h`, 0) in a `[rows, heads, D]` tensor.
fn at(row: usize, heads: usize, h: usize, d: usize) -> usize {
    (row * heads + h) * d
}

/// Reads `rows` rows of head `h` (rows `row0..` of a `[rows, heads, D]` tensor) into `dst`
/// `[rows, Dp]`, each element times `scale`; the padding columns are left as they are (zero).
fn load_rows(src: &[u8], dtype: DType, (row0, rows): (usize, usize), (heads, h, d): (usize, usize, usize), scale: f32, dst: &mut [f32]) {
    let dp = padded_dim(d);
    for (i, row) in dst.chunks_exact_mut(dp).take(rows).enumerate() {
        let row = &mut row[..d];
        dtype.load(src, at(row0 + i, heads, h, d), row);
        if scale != 1.0 {
            row.iter_mut().for_each(|x| *x *= scale);
        }
    }
}

/// Reads `rows` rows of head `h` into the transposed `dst` `[D, ld]`.
fn load_transposed(src: &[u8], dtype: DType, (row0, rows): (usize, usize), (heads, h, d): (usize, usize, usize), ld: usize, tmp: &mut [f32], dst: &mut [f32]) {
    let tmp = &mut tmp[..d];
    for j in 0..rows {
        dtype.load(src, at(row0 + j, heads, h, d), tmp);
        for (di, &x) in tmp.iter().enumerate() {
            dst[di * ld + j] = x;
        }
    }
}

/// THE score step of this path (the fused path's per-tile step, over a whole row of S): for rows
/// `rb`, S[r, c] = Qs[r]·K[c] in exp2 units on every tile the mask lets some row see, each tile
/// masked by [`Visibility::mask_scores`]; -inf on the keys between those tiles. Returns the span
/// `[c0, c1)` of keys written (None: the rows see no key); keys outside it are hidden.
///
/// q: [br, Dp] (times scale·log2 e); kt: [D, ld]; s: [br, ld] (the rows' part of S);
/// tiles: reused scratch.
fn scores(vis: &Visibility, rb: &RowBlock, d: usize, q: &[f32], kt: &[f32], ld: usize, s: &mut [f32], tiles: &mut Vec<KeyTile>) -> Option<(usize, usize)> {
    let (br, dp) = (rb.rows(), padded_dim(d));
    tiles.clear();
    tiles.extend(vis.key_blocks(rb).filter_map(|blk| vis.tile(rb, blk)));
    let span = (tiles.first()?.c0, tiles.last()?.c1);
    for t in tiles.iter() {
        // Left to right: a tile's product may spill into the next tile's first (padding)
        // columns, which that tile then overwrites.
        matmul(br, t.cols(), d, &mut s[t.c0..], ld, false, Mat::rows(q, dp), &kt[t.c0..], ld);
        if t.masked() {
            vis.mask_scores(&mut s[t.c0..], ld, rb, t);
        }
    }
    // Keys between visible tiles (hidden block-mask tiles, segment gaps): -inf.
    let mut gaps = tiles.windows(2).map(|w| (w[0].c1, w[1].c0)).filter(|(a, b)| a < b).peekable();
    if gaps.peek().is_some() {
        let gaps: Vec<(usize, usize)> = gaps.collect();
        for row in s.chunks_mut(ld).take(br) {
            for &(a, b) in &gaps {
                row[a..b].fill(f32::NEG_INFINITY);
            }
        }
    }
    Some(span)
}

/// One forward task's working memory (sized for the longest sequence, reused across tasks).
struct ForwardScratch {
    q: Vec<f32>,  // [Sq, Dp], times scale·log2 e
    kt: Vec<f32>, // [D, ld]
    v: Vec<f32>,  // [Sk, Dp]
    s: Vec<f32>,  // [Sq, ld]: the scores, then the probabilities
    o: Vec<f32>,  // [BLOCK_Q, Dp]
    tmp: Vec<f32>, // [D]
    m: Vec<f32>,  // [BLOCK_Q]
    l: Vec<f32>,
    alpha: Vec<f32>,
    tiles: Vec<KeyTile>,
}

impl ForwardScratch {
    fn new(p: &Problem) -> Self {
        let (sq, sk, d) = (p.dims.seq_q, p.dims.seq_k, p.dims.head_dim);
        let (dp, ld) = (padded_dim(d), transposed_ld(sk));
        ForwardScratch {
            q: vec![0.0; sq * dp],
            kt: vec![0.0; d * ld],
            v: vec![0.0; sk * dp],
            s: vec![0.0; sq * ld],
            o: vec![0.0; BLOCK_Q * dp],
            tmp: vec![0.0; d],
            m: vec![0.0; BLOCK_Q],
            l: vec![0.0; BLOCK_Q],
            alpha: vec![0.0; BLOCK_Q],
            tiles: Vec::new(),
        }
    }
}

/// Head h of batch row b: o rows [q_len, D] and lse [q_len].
fn forward_head(p: &Problem, vis: &Visibility, [q, k, v]: [&[u8]; 3], (o, lse): (&SharedOut, &SharedOut), (b, h): (usize, usize), w: &mut ForwardScratch) {
    let seq = p.mask.seq(b);
    let (sq, sk) = (seq.q_len, seq.k_len);
    let d = p.dims.head_dim;
    let (dp, ld) = (padded_dim(d), transposed_ld(p.dims.seq_k));
    let (heads, hkv) = (p.dims.heads, h / p.dims.group());
    let q_head = (heads, h, d);
    let kv_head = (p.dims.kv_heads, hkv, d);
    load_rows(q, p.dtype, (seq.q_start, sq), q_head, p.scale * LOG2_E, &mut w.q);
    load_transposed(k, p.dtype, (seq.k_start, sk), kv_head, ld, &mut w.tmp, &mut w.kt);
    load_rows(v, p.dtype, (seq.k_start, sk), kv_head, 1.0, &mut w.v);
    let lse_row = p.lse_base(b, h);

    for r0 in (0..sq).step_by(BLOCK_Q) {
        let rb = RowBlock::new(b, h, seq, r0);
        let br = rb.rows();
        let (m, l) = (&mut w.m[..br], &mut w.l[..br]);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        let s = &mut w.s[r0 * ld..];
        let q_rows = &w.q[r0 * dp..(r0 + br) * dp];
        let o_rows = &mut w.o[..br * dp];
        match scores(vis, &rb, d, q_rows, &w.kt, ld, s, &mut w.tiles) {
            Some((c0, c1)) => {
                simd::online_softmax(&mut s[c0..], c1 - c0, ld, m, l, &mut w.alpha[..br]);
                matmul(br, d, c1 - c0, o_rows, dp, false, Mat::rows(&s[c0..], ld), &w.v[c0 * dp..], dp);
            }
            None => o_rows.fill(0.0),
        }
        let mut lse_rows = [0.0f32; BLOCK_Q];
        for r in 0..br {
            let row = &mut o_rows[r * dp..r * dp + d];
            if l[r] == 0.0 {
                // The row sees no key: o = 0, lse = -inf.
                row.fill(0.0);
                lse_rows[r] = f32::NEG_INFINITY;
            } else {
                let inv = 1.0 / l[r];
                row.iter_mut().for_each(|x| *x *= inv);
                lse_rows[r] = (m[r] + l[r].log2()) * LN_2;
            }
            // SAFETY: row (q_start + r0 + r, h) of o belongs to this task alone.
            unsafe { o.store(at(seq.q_start + r0 + r, heads, h, d), row) };
        }
        // SAFETY: lse entries of (b, h) belong to this task alone.
        unsafe { lse.store(lse_row + r0, &lse_rows[..br]) };
    }
}

/// One backward task's working memory (sized for the longest sequence, reused across tasks).
struct BackwardScratch {
    k: Vec<f32>,     // [Sk, Dp]
    kt: Vec<f32>,    // [D, ld]
    vt: Vec<f32>,    // [D, ld]
    dk: Vec<f32>,    // [Sk, Dp], in units of dSᵀ·Qs
    dv: Vec<f32>,    // [Sk, Dp]
    q: Vec<f32>,     // [Sq, Dp], times scale·log2 e
    d_out: Vec<f32>, // [Sq, Dp]
    s: Vec<f32>,     // [Sq, ld]: the scores, then P
    ds: Vec<f32>,    // [Sq, ld]: dP = dO·Vᵀ, then dS
    dq: Vec<f32>,    // [BLOCK_Q, Dp]
    lse2: Vec<f32>,  // [Sq], log2 units, +inf for rows that see no key
    delta: Vec<f32>, // [Sq]
    tmp: Vec<f32>,   // [2, D]
    tiles: Vec<KeyTile>,
}

impl BackwardScratch {
    fn new(p: &Problem) -> Self {
        let (sq, sk, d) = (p.dims.seq_q, p.dims.seq_k, p.dims.head_dim);
        let (dp, ld) = (padded_dim(d), transposed_ld(sk));
        BackwardScratch {
            k: vec![0.0; sk * dp],
            kt: vec![0.0; d * ld],
            vt: vec![0.0; d * ld],
            dk: vec![0.0; sk * dp],
            dv: vec![0.0; sk * dp],
            q: vec![0.0; sq * dp],
            d_out: vec![0.0; sq * dp],
            s: vec![0.0; sq * ld],
            ds: vec![0.0; sq * ld],
            dq: vec![0.0; BLOCK_Q * dp],
            lse2: vec![0.0; sq],
            delta: vec![0.0; sq],
            tmp: vec![0.0; 2 * d],
            tiles: Vec::new(),
        }
    }
}

/// Kv head `hkv` of batch row b and its query heads: dq of those heads, dk and dv of `hkv`.
/// P = exp2(S - lse2), dP = dO·Vᵀ, dS = P ∘ (dP - delta); dV = Pᵀ·dO, dK = dSᵀ·Qs (ln 2 to
/// natural units on the way out), dQ = dS·K (times scale on the way out).
fn backward_group(p: &Problem, vis: &Visibility, inputs: [&[u8]; 6], [dq, dk, dv]: &[SharedOut; 3], (b, hkv): (usize, usize), w: &mut BackwardScratch) {
    let [d_out, q, k, v, o, lse] = inputs;
    let seq = p.mask.seq(b);
    let (sq, sk) = (seq.q_len, seq.k_len);
    let d = p.dims.head_dim;
    let (dp, ld) = (padded_dim(d), transposed_ld(p.dims.seq_k));
    let (heads, g) = (p.dims.heads, p.dims.group());
    let kv_head = (p.dims.kv_heads, hkv, d);
    load_rows(k, p.dtype, (seq.k_start, sk), kv_head, 1.0, &mut w.k);
    load_transposed(k, p.dtype, (seq.k_start, sk), kv_head, ld, &mut w.tmp, &mut w.kt);
    load_transposed(v, p.dtype, (seq.k_start, sk), kv_head, ld, &mut w.tmp, &mut w.vt);
    w.dk[..sk * dp].fill(0.0);
    w.dv[..sk * dp].fill(0.0);

    for h in hkv * g..(hkv + 1) * g {
        let q_head = (heads, h, d);
        load_rows(q, p.dtype, (seq.q_start, sq), q_head, p.scale * LOG2_E, &mut w.q);
        load_rows(d_out, p.dtype, (seq.q_start, sq), q_head, 1.0, &mut w.d_out);
        let lse_row = p.lse_base(b, h);
        for i in 0..sq {
            // delta = rowsum(dO ∘ O), from the o passed in (as the oracle does).
            let (a, c) = w.tmp.split_at_mut(d);
            p.dtype.load(o, at(seq.q_start + i, heads, h, d), a);
            let dor = &w.d_out[i * dp..i * dp + d];
            w.delta[i] = a.iter().zip(dor).map(|(x, y)| x * y).sum();
            DType::F32.load(lse, lse_row + i, &mut c[..1]);
            w.lse2[i] = if c[0] == f32::NEG_INFINITY { f32::INFINITY } else { c[0] * LOG2_E };
        }
        for r0 in (0..sq).step_by(BLOCK_Q) {
            let rb = RowBlock::new(b, h, seq, r0);
            let br = rb.rows();
            let rows = r0 * dp..(r0 + br) * dp;
            let (s, ds) = (&mut w.s[r0 * ld..], &mut w.ds[r0 * ld..]);
            let dq_rows = &mut w.dq[..br * dp];
            match scores(vis, &rb, d, &w.q[rows.clone()], &w.kt, ld, s, &mut w.tiles) {
                Some((c0, c1)) => {
                    let n = c1 - c0;
                    let (q_rows, do_rows) = (&w.q[rows.clone()], &w.d_out[rows.clone()]);
                    matmul(br, n, d, &mut ds[c0..], ld, false, Mat::rows(do_rows, dp), &w.vt[c0..], ld);
                    simd::probs_and_dscores(&mut s[c0..], &mut ds[c0..], n, ld, &w.lse2[r0..r0 + br], &w.delta[r0..r0 + br]);
                    matmul(n, d, br, &mut w.dv[c0 * dp..], dp, true, Mat::transposed(&s[c0..], ld), do_rows, dp);
                    matmul(n, d, br, &mut w.dk[c0 * dp..], dp, true, Mat::transposed(&ds[c0..], ld), q_rows, dp);
                    matmul(br, d, n, dq_rows, dp, false, Mat::rows(&ds[c0..], ld), &w.k[c0 * dp..], dp);
                }
                None => dq_rows.fill(0.0),
            }
            for r in 0..br {
                let row = &mut dq_rows[r * dp..r * dp + d];
                row.iter_mut().for_each(|x| *x *= p.scale);
                // SAFETY: row (q_start + r0 + r, h) of dq belongs to this task alone (h is one of
                // kv head hkv's query heads).
                unsafe { dq.store(at(seq.q_start + r0 + r, heads, h, d), row) };
            }
        }
    }
    for j in 0..sk {
        let row = at(seq.k_start + j, p.dims.kv_heads, hkv, d);
        let dk_row = &mut w.dk[j * dp..j * dp + d];
        dk_row.iter_mut().for_each(|x| *x *= LN_2);
        // SAFETY: rows (k_start + j, hkv) of dk and dv belong to this task alone.
        unsafe {
            dk.store(row, dk_row);
            dv.store(row, &w.dv[j * dp..j * dp + d]);
        }
    }
}
