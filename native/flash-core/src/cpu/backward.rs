//! Backward from the saved LSE, without atomics (so results are bit-identical run to run):
//!
//! * delta = rowsum(dO ∘ O);
//! * for every (query block i, key block j) tile that is not fully masked:
//!   P = exp2(Qs·Kᵀ - lse2), dP = dO·Vᵀ, dS = P ∘ (dP - delta), then dV_j += Pᵀ·dO_i,
//!   dK_j += dSᵀ·Q_i and dQ_i += dS·K_j.
//!
//! Two schedules of the same tiles, chosen by how much parallelism the problem offers:
//! * `fused`: one task per (batch, kv head) owns dQ of its query heads and dK/dV of its kv head,
//!   so each tile is computed once (5 products per tile);
//! * `split`: a dQ pass parallel over (batch, head, query block) and a dK/dV pass parallel over
//!   (batch, kv head, key block), each recomputing P and dS (7 products per tile) but with
//!   enough tasks to fill every thread when batch × kv heads is small.

use super::forward::mask_causal;
use super::layout::{load_f32, pack_rows, pack_transposed, padded_dim, transposed_ld, unpack_rows};
use super::matmul::{matmul, Mat};
use super::simd;
use super::workspace::{zeroed, Buffer, BLOCK_K, BLOCK_Q};
use crate::error::Result;
use crate::io::BackwardIo;
use crate::problem::Problem;
use rayon::prelude::*;
use std::f32::consts::{LN_2, LOG2_E};

/// Inputs of one backward call in the working layout.
struct Packed {
    qs: Buffer,    // [B·H, Sq, Dp], times scale·log2(e)
    d_out: Buffer, // [B·H, Sq, Dp]
    k: Buffer,     // [B·Hkv, Sk, Dp]
    kt: Buffer,    // [B·Hkv, D, Skp]
    vt: Buffer,    // [B·Hkv, D, Skp]
    lse2: Buffer,  // [B·H, Sq], log2 units; +inf for rows that see no key
    delta: Buffer, // [B·H, Sq]
}

/// Writes dq ([B, Sq, H, D]), dk and dv ([B, Sk, Hkv, D]) in p.dtype.
pub fn run(p: &Problem, io: BackwardIo) -> Result<()> {
    let BackwardIo { d_out, q, k, v, o, lse, dq, dk, dv, .. } = io;
    let dims = p.dims;
    let packed = Packed {
        qs: pack_rows(q, p.dtype, dims.q_shape(), p.scale * LOG2_E, "packed q")?,
        d_out: pack_rows(d_out, p.dtype, dims.q_shape(), 1.0, "packed d_out")?,
        k: pack_rows(k, p.dtype, dims.kv_shape(), 1.0, "packed k")?,
        kt: pack_transposed(k, p.dtype, dims.kv_shape(), "packed k")?,
        vt: pack_transposed(v, p.dtype, dims.kv_shape(), "packed v")?,
        lse2: lse_log2(lse)?,
        delta: row_dots(p, d_out, o)?,
    };
    let dp = padded_dim(dims.head_dim);
    let mut dq_acc = zeroed(dims.batch * dims.heads * dims.seq_q * dp, "dq accumulator")?; // [B·H, Sq, Dp]
    let mut dk_acc = zeroed(dims.batch * dims.kv_heads * dims.seq_k * dp, "dk accumulator")?; // [B·Hkv, Sk, Dp]
    let mut dv_acc = zeroed(dims.batch * dims.kv_heads * dims.seq_k * dp, "dv accumulator")?; // [B·Hkv, Sk, Dp]

    if dims.q_len() > 0 && dims.kv_len() > 0 {
        let tasks = dims.batch * dims.kv_heads;
        let threads = rayon::current_num_threads();
        if tasks % threads == 0 || tasks >= 4 * threads {
            fused(p, &packed, &mut dq_acc, &mut dk_acc, &mut dv_acc);
        } else {
            split_dq(p, &packed, &mut dq_acc);
            split_dkdv(p, &packed, &mut dk_acc, &mut dv_acc);
        }
    }

    // dQ = scale·dS·K; dK = scale·dSᵀ·Q = ln2·dSᵀ·Qs.
    unpack_rows(&dq_acc, dq, p.dtype, dims.q_shape(), p.scale);
    unpack_rows(&dk_acc, dk, p.dtype, dims.kv_shape(), LN_2);
    unpack_rows(&dv_acc, dv, p.dtype, dims.kv_shape(), 1.0);
    Ok(())
}

/// lse (natural log) -> log2 units; -inf (no visible key) -> +inf so that P = exp2(s - lse2) = 0.
fn lse_log2(lse: &[u8]) -> Result<Buffer> {
    let mut out = load_f32(lse, "lse")?;
    for x in out.iter_mut() {
        *x = if *x == f32::NEG_INFINITY { f32::INFINITY } else { *x * LOG2_E };
    }
    Ok(out)
}

/// delta[b, h, i] = Σ_d dO[b, i, h, d] · O[b, i, h, d], in f32. Returns [B, H, Sq].
fn row_dots(p: &Problem, d_out: &[u8], o: &[u8]) -> Result<Buffer> {
    let dims = p.dims;
    let (sq, h, d) = (dims.seq_q, dims.heads, dims.head_dim);
    let mut delta = zeroed(dims.lse_len(), "delta")?;
    if sq == 0 {
        return Ok(delta);
    }
    delta.par_chunks_mut(sq).enumerate().for_each(|(bh, out)| {
        let (b, hh) = (bh / h, bh % h);
        let (mut a, mut c) = (vec![0.0f32; d], vec![0.0f32; d]);
        for (i, x) in out.iter_mut().enumerate() {
            let start = ((b * sq + i) * h + hh) * d;
            p.dtype.load(d_out, start, &mut a);
            p.dtype.load(o, start, &mut c);
            *x = a.iter().zip(&c).map(|(x, y)| x * y).sum();
        }
    });
    Ok(delta)
}

/// Scratch of one tile: P and dS, each [BLOCK_Q, BLOCK_K].
struct Tile {
    p: Vec<f32>,
    ds: Vec<f32>,
}

impl Tile {
    fn new() -> Self {
        Tile { p: vec![0.0; BLOCK_Q * BLOCK_K], ds: vec![0.0; BLOCK_Q * BLOCK_K] }
    }
}

/// Rows [r0, r0 + br) of one query head against keys [c0, c0 + bc) of its kv head.
struct TileRef<'a> {
    r0: usize,
    c0: usize,
    bc: usize,
    d: usize,
    qs: &'a [f32],    // [br, Dp]
    d_out: &'a [f32], // [br, Dp]
    lse2: &'a [f32],  // [br]
    delta: &'a [f32], // [br]
    k: &'a [f32],     // [bc, Dp] (and the rest of the head)
    kt: &'a [f32],    // [D, Skp] from column c0
    vt: &'a [f32],    // [D, Skp] from column c0
}

impl TileRef<'_> {
    fn rows(&self) -> usize {
        self.lse2.len()
    }
    fn dp(&self) -> usize {
        padded_dim(self.d)
    }
    fn skp(&self) -> usize {
        (self.kt.len() + self.c0) / self.d
    }

    /// Fills tile.p with P and tile.ds with dS.
    fn probs_and_dscores(&self, p: &Problem, tile: &mut Tile) {
        let (br, bc, d, dp, skp) = (self.rows(), self.bc, self.d, self.dp(), self.skp());
        matmul(br, bc, d, &mut tile.p, BLOCK_K, false, Mat::rows(self.qs, dp), self.kt, skp);
        if p.causal {
            let first_limit = self.r0 as isize + p.dims.diag_offset() - self.c0 as isize;
            mask_causal(&mut tile.p, br, bc, first_limit);
        }
        matmul(br, bc, d, &mut tile.ds, BLOCK_K, false, Mat::rows(self.d_out, dp), self.vt, skp);
        simd::probs_and_dscores(&mut tile.p, &mut tile.ds, bc, BLOCK_K, self.lse2, self.delta);
    }

    /// dQ_i[br, Dp] += dS · K_j.
    fn add_dq(&self, tile: &Tile, dq: &mut [f32]) {
        let (br, bc, d, dp) = (self.rows(), self.bc, self.d, self.dp());
        matmul(br, d, bc, dq, dp, true, Mat::rows(&tile.ds, BLOCK_K), self.k, dp);
    }

    /// dK_j[bc, Dp] += dSᵀ · Qs_i and dV_j[bc, Dp] += Pᵀ · dO_i.
    fn add_dkdv(&self, tile: &Tile, dk: &mut [f32], dv: &mut [f32]) {
        let (br, bc, d, dp) = (self.rows(), self.bc, self.d, self.dp());
        matmul(bc, d, br, dk, dp, true, Mat::transposed(&tile.ds, BLOCK_K), self.qs, dp);
        matmul(bc, d, br, dv, dp, true, Mat::transposed(&tile.p, BLOCK_K), self.d_out, dp);
    }
}

/// The tile (query block starting at r0 of head `bh`, key block starting at c0 of kv head `bkv`).
fn tile_ref<'a>(p: &Problem, x: &'a Packed, bh: usize, bkv: usize, r0: usize, c0: usize) -> TileRef<'a> {
    let dims = p.dims;
    let (d, dp) = (dims.head_dim, padded_dim(dims.head_dim));
    let skp = transposed_ld(dims.seq_k);
    let br = BLOCK_Q.min(dims.seq_q - r0);
    let row = bh * dims.seq_q + r0;
    let (k_head, kt_head) = ((bkv * dims.seq_k + c0) * dp, bkv * d * skp);
    let k_end = (bkv + 1) * dims.seq_k * dp;
    TileRef {
        r0,
        c0,
        bc: BLOCK_K.min(dims.seq_k - c0),
        d,
        qs: &x.qs[row * dp..(row + br) * dp],
        d_out: &x.d_out[row * dp..(row + br) * dp],
        lse2: &x.lse2[row..row + br],
        delta: &x.delta[row..row + br],
        k: &x.k[k_head..k_end],
        kt: &x.kt[kt_head + c0..kt_head + d * skp],
        vt: &x.vt[kt_head + c0..kt_head + d * skp],
    }
}

/// Key blocks that query block [r0, r0 + br) must visit (causal skips fully masked ones).
fn key_blocks(p: &Problem, r0: usize, br: usize) -> impl Iterator<Item = usize> {
    (0..p.keys_visible(r0 + br - 1)).step_by(BLOCK_K)
}

/// First query block that sees key c0 (all earlier blocks are fully masked for it).
fn first_query_block(p: &Problem, c0: usize) -> usize {
    if !p.causal {
        return 0;
    }
    let first_row = (c0 as isize - p.dims.diag_offset()).max(0) as usize;
    first_row / BLOCK_Q * BLOCK_Q
}

fn fused(p: &Problem, x: &Packed, dq: &mut [f32], dk: &mut [f32], dv: &mut [f32]) {
    let dims = p.dims;
    let (sq, sk, dp, g) = (dims.seq_q, dims.seq_k, padded_dim(dims.head_dim), dims.group());
    dq.par_chunks_mut(g * sq * dp)
        .zip(dk.par_chunks_mut(sk * dp).zip(dv.par_chunks_mut(sk * dp)))
        .enumerate()
        .for_each(|(bkv, (dq_group, (dk_head, dv_head)))| {
            let mut tile = Tile::new();
            let b = bkv / dims.kv_heads;
            for (blk, (dk_blk, dv_blk)) in dk_head.chunks_mut(BLOCK_K * dp).zip(dv_head.chunks_mut(BLOCK_K * dp)).enumerate() {
                let c0 = blk * BLOCK_K;
                for gi in 0..g {
                    let bh = b * dims.heads + (bkv % dims.kv_heads) * g + gi;
                    let dq_head = &mut dq_group[gi * sq * dp..(gi + 1) * sq * dp];
                    for r0 in (first_query_block(p, c0)..sq).step_by(BLOCK_Q) {
                        let t = tile_ref(p, x, bh, bkv, r0, c0);
                        t.probs_and_dscores(p, &mut tile);
                        t.add_dkdv(&tile, dk_blk, dv_blk);
                        let rows = r0 * dp..(r0 + t.rows()) * dp;
                        t.add_dq(&tile, &mut dq_head[rows]);
                    }
                }
            }
        });
}

fn split_dq(p: &Problem, x: &Packed, dq: &mut [f32]) {
    let dims = p.dims;
    let (sq, dp) = (dims.seq_q, padded_dim(dims.head_dim));
    dq.par_chunks_mut(sq * dp).enumerate().for_each(|(bh, dq_head)| {
        let bkv = (bh / dims.heads) * dims.kv_heads + (bh % dims.heads) / dims.group();
        dq_head.par_chunks_mut(BLOCK_Q * dp).enumerate().for_each(|(blk, dq_blk)| {
            let mut tile = Tile::new();
            let r0 = blk * BLOCK_Q;
            for c0 in key_blocks(p, r0, dq_blk.len() / dp) {
                let t = tile_ref(p, x, bh, bkv, r0, c0);
                t.probs_and_dscores(p, &mut tile);
                t.add_dq(&tile, dq_blk);
            }
        });
    });
}

fn split_dkdv(p: &Problem, x: &Packed, dk: &mut [f32], dv: &mut [f32]) {
    let dims = p.dims;
    let (sq, sk, dp, g) = (dims.seq_q, dims.seq_k, padded_dim(dims.head_dim), dims.group());
    dk.par_chunks_mut(sk * dp).zip(dv.par_chunks_mut(sk * dp)).enumerate().for_each(|(bkv, (dk_head, dv_head))| {
        let b = bkv / dims.kv_heads;
        dk_head
            .par_chunks_mut(BLOCK_K * dp)
            .zip(dv_head.par_chunks_mut(BLOCK_K * dp))
            .enumerate()
            .for_each(|(blk, (dk_blk, dv_blk))| {
                let mut tile = Tile::new();
                let c0 = blk * BLOCK_K;
                for gi in 0..g {
                    let bh = b * dims.heads + (bkv % dims.kv_heads) * g + gi;
                    for r0 in (first_query_block(p, c0)..sq).step_by(BLOCK_Q) {
                        let t = tile_ref(p, x, bh, bkv, r0, c0);
                        t.probs_and_dscores(p, &mut tile);
                        t.add_dkdv(&tile, dk_blk, dv_blk);
                    }
                }
            });
    });
}
