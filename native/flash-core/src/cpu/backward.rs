//! Backward from the saved LSE, without atomics (so results are bit-identical run to run):
//!
//! * delta = rowsum(dO ∘ O);
//! * for every (query block i, key block j) tile that some row sees (see module `tiles`):
//!   P = exp2(Qs·Kᵀ - lse2), dP = dO·Vᵀ, dS = P ∘ (dP - delta), then dV_j += Pᵀ·dO_i,
//!   dK_j += dSᵀ·Q_i and dQ_i += dS·K_j.
//!
//! Two schedules of the same tiles, chosen by how much parallelism the problem offers:
//! * `fused`: one task per (batch row, kv head) owns dQ of its query heads and dK/dV of its kv
//!   head, so each tile is computed once (5 products per tile);
//! * `split`: a dQ pass parallel over (batch row, head, query block) and a dK/dV pass parallel
//!   over (batch row, kv head, key block), each recomputing P and dS (7 products per tile) but
//!   with enough tasks to fill every thread when batch × kv heads is small.
//!
//! Both visit the same tiles and add each dQ, dK and dV block's tiles in the same order, so the
//! result does not depend on the schedule (nor, therefore, on the thread count).

use super::batch::{key_runs, query_runs, split_rows, Geometry};
use super::layout::{load_f32, pack_rows, pack_transposed, padded_dim, transposed_ld, unpack_rows};
use super::matmul::{matmul, Mat};
use super::modify::{sink_grads, softcap_chain, TileMods};
use super::par;
use super::simd;
use super::tiles::{KeyTile, RowBlock, Visibility};
use super::workspace::{zeroed, Buffer, BLOCK_K, BLOCK_Q};
use crate::dtype::DType;
use crate::error::Result;
use crate::io::BackwardIo;
use crate::problem::Problem;
use crate::strides::{InputStrides, Strides};
use std::f32::consts::{LN_2, LOG2_E};

/// Inputs of one backward call in the working layouts (see [`Geometry`]).
struct Packed {
    qs: Buffer,    // [PB·H, Rq, Dp], times scale·log2(e)
    d_out: Buffer, // [PB·H, Rq, Dvp]
    k: Buffer,     // [PB·Hkv, Rk, Dp]
    kt: Buffer,    // [PB·Hkv, D, Rkp]
    vt: Buffer,    // [PB·Hkv, Dv, Rkp]
    lse2: Buffer,  // [PB·H, Rq], log2 units; +inf for rows that see no key
    delta: Buffer, // [PB·H, Rq]
}

/// What every tile of one call reads.
struct Ctx<'a> {
    p: &'a Problem,
    geo: Geometry,
    vis: Visibility<'a>,
    x: Packed,
}

/// Writes dq (like q), dk (like k) and dv (like v) in p.dtype.
pub fn run(p: &Problem, io: BackwardIo) -> Result<()> {
    let BackwardIo { d_out, q, k, v, o, lse, dq, dk, dv, mask, dsinks, dlse, strides } = io;
    let st = strides.unwrap_or_else(|| InputStrides::packed(p));
    let dlse = dlse.map(|b| load_f32(b, "dlse")).transpose()?; // [PB·H, Rq], lse's layout
    let geo = Geometry::new(p);
    let lse2 = lse_log2(lse)?;
    let mut delta = row_dots(p, &geo, (d_out, st.d_out), (o, st.o))?;
    if let Some(dlse) = &dlse {
        subtract_dlse(&mut delta, &lse2, dlse);
    }
    let x = Packed {
        qs: pack_rows(q, p.dtype, geo.q4(), st.q, p.scale * LOG2_E, "packed q")?,
        d_out: pack_rows(d_out, p.dtype, geo.o4(), st.d_out, 1.0, "packed d_out")?,
        k: pack_rows(k, p.dtype, geo.kv4(), st.k, 1.0, "packed k")?,
        kt: pack_transposed(k, p.dtype, geo.kv4(), st.k, "packed k")?,
        vt: pack_transposed(v, p.dtype, geo.v4(), st.v, "packed v")?,
        lse2,
        delta,
    };
    let cx = Ctx { p, geo, vis: Visibility::new(p, &mask), x };
    let (dp, dvp) = (padded_dim(geo.head_dim), padded_dim(geo.head_dim_v));
    let mut dq_acc = zeroed(geo.batches * geo.heads * geo.q_rows * dp, "dq accumulator")?; // [PB·H, Rq, Dp]
    let mut dk_acc = zeroed(geo.batches * geo.kv_heads * geo.k_rows * dp, "dk accumulator")?; // [PB·Hkv, Rk, Dp]
    let mut dv_acc = zeroed(geo.batches * geo.kv_heads * geo.k_rows * dvp, "dv accumulator")?; // [PB·Hkv, Rk, Dvp]

    if p.q_rows() > 0 && p.k_rows() > 0 {
        let (q_runs, k_runs) = (query_runs(p), key_runs(p, &geo));
        let dq_seqs = split_rows(&mut dq_acc, dp, &q_runs); // [b·H + h]: [q_len, Dp]
        let dk_seqs = split_rows(&mut dk_acc, dp, &k_runs); // [b·Hkv + hkv]: [k_len, Dp]
        let dv_seqs = split_rows(&mut dv_acc, dvp, &k_runs); // [b·Hkv + hkv]: [k_len, Dvp]
        let tasks = p.dims.batch * p.dims.kv_heads;
        let threads = rayon::current_num_threads();
        if tasks % threads == 0 || tasks >= 4 * threads {
            fused(&cx, dq_seqs, dk_seqs, dv_seqs);
        } else {
            split_dq(&cx, dq_seqs);
            split_dkdv(&cx, dk_seqs, dv_seqs);
        }
    }

    if let Some(out) = dsinks {
        DType::F32.store(&sink_grads(p, (d_out, st.d_out), (o, st.o), lse, dlse.as_deref()), out, 0);
    }

    // dQ = scale·dS·K; dK = scale·dSᵀ·Q = ln2·dSᵀ·Qs.
    unpack_rows(&dq_acc, dq, p.dtype, geo.q4(), p.scale);
    unpack_rows(&dk_acc, dk, p.dtype, geo.kv4(), LN_2);
    unpack_rows(&dv_acc, dv, p.dtype, geo.v4(), 1.0);
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

/// delta -= dlse on the rows that see a key (lse2 finite): the gradient of lse enters the
/// backward there, since dS = P ∘ (dP - delta + dlse). Rows that see none keep P = 0.
pub(super) fn subtract_dlse(delta: &mut [f32], lse2: &[f32], dlse: &[f32]) {
    for ((x, &l), &g) in delta.iter_mut().zip(lse2).zip(dlse) {
        if l != f32::INFINITY {
            *x -= g;
        }
    }
}

/// delta[pb, h, i] = Σ_d dO[pb, i, h, d] · O[pb, i, h, d] (d < Dv), in f32, each read at its
/// strides. Returns [PB·H, Rq].
fn row_dots(p: &Problem, geo: &Geometry, (d_out, do_st): (&[u8], Strides), (o, o_st): (&[u8], Strides)) -> Result<Buffer> {
    let [_, rq, h, d] = geo.o4();
    let mut delta = zeroed(p.lse_len(), "delta")?;
    if rq == 0 {
        return Ok(delta);
    }
    par::chunks_mut(&mut delta, rq, |bh, out| {
        let (b, hh) = (bh / h, bh % h);
        let (mut a, mut c) = (vec![0.0f32; d], vec![0.0f32; d]);
        for (i, x) in out.iter_mut().enumerate() {
            p.dtype.load(d_out, do_st.at(b, i, hh), &mut a);
            p.dtype.load(o, o_st.at(b, i, hh), &mut c);
            *x = a.iter().zip(&c).map(|(x, y)| x * y).sum();
        }
    });
    Ok(delta)
}

/// Scratch of one tile: P, dS and (with softcap) tanh of the scores, each [BLOCK_Q, BLOCK_K].
struct Scratch {
    p: Vec<f32>,
    ds: Vec<f32>,
    tanh: Vec<f32>,
}

impl Scratch {
    fn new(p: &Problem) -> Self {
        let tanh = if p.mods.softcap.is_some() { vec![0.0; BLOCK_Q * BLOCK_K] } else { Vec::new() };
        Scratch { p: vec![0.0; BLOCK_Q * BLOCK_K], ds: vec![0.0; BLOCK_Q * BLOCK_K], tanh }
    }
}

/// One tile's operands: rows `rb` of one query head against keys `t` of its kv head.
struct TileRef<'a> {
    rb: RowBlock,
    t: KeyTile,
    d: usize,
    dv: usize,
    ld: usize,        // of kt and vt
    qs: &'a [f32],    // [br, Dp]
    d_out: &'a [f32], // [br, Dvp]
    lse2: &'a [f32],  // [br]
    delta: &'a [f32], // [br]
    k: &'a [f32],     // [bc, Dp]
    kt: &'a [f32],    // [D, ld] from the tile's first key
    vt: &'a [f32],    // [Dv, ld] from the tile's first key
}

impl<'a> TileRef<'a> {
    fn new(cx: &'a Ctx, rb: RowBlock, t: KeyTile) -> Self {
        let (geo, x) = (&cx.geo, &cx.x);
        let (d, dp, ld) = (geo.head_dim, padded_dim(geo.head_dim), transposed_ld(geo.k_rows));
        let (dv, dvp) = (geo.head_dim_v, padded_dim(geo.head_dim_v));
        let (br, bc) = (rb.rows(), t.cols());
        let hkv = rb.h / cx.p.dims.group();
        let row = cx.p.lse_base(rb.b, rb.h) + rb.r0;
        let key = geo.k_row(&rb.seq, rb.b, hkv) + t.c0;
        // kt and vt hold one [D, ld] / [Dv, ld] matrix per kv head; the tile starts at its key.
        let (matrix, key0) = (geo.kv_matrix(rb.b, hkv), geo.key_offset(&rb.seq, rb.b) + t.c0);
        TileRef {
            rb,
            t,
            d,
            dv,
            ld,
            qs: &x.qs[row * dp..(row + br) * dp],
            d_out: &x.d_out[row * dvp..(row + br) * dvp],
            lse2: &x.lse2[row..row + br],
            delta: &x.delta[row..row + br],
            k: &x.k[key * dp..(key + bc) * dp],
            kt: &x.kt[matrix * d * ld + key0..(matrix + 1) * d * ld],
            vt: &x.vt[matrix * dv * ld + key0..(matrix + 1) * dv * ld],
        }
    }

    fn dp(&self) -> usize {
        padded_dim(self.d)
    }

    fn dvp(&self) -> usize {
        padded_dim(self.dv)
    }

    /// Fills s.p with P and s.ds with dS (with respect to the unmodified scores).
    fn probs_and_dscores(&self, cx: &Ctx, s: &mut Scratch) {
        let (br, bc, d, dp) = (self.rb.rows(), self.t.cols(), self.d, self.dp());
        matmul(br, bc, d, &mut s.p, BLOCK_K, false, Mat::rows(self.qs, dp), self.kt, self.ld);
        let mods = (!cx.p.mods.is_none()).then(|| TileMods::new(cx.p, &self.rb));
        if let Some(mods) = &mods {
            let tanh = mods.softcap().then_some(&mut s.tanh[..]);
            mods.apply(&mut s.p, BLOCK_K, &self.rb, &self.t, tanh);
        }
        if self.t.masked() {
            cx.vis.mask_scores(&mut s.p, BLOCK_K, &self.rb, &self.t);
        }
        let (dv, dvp) = (self.dv, self.dvp());
        matmul(br, bc, dv, &mut s.ds, BLOCK_K, false, Mat::rows(self.d_out, dvp), self.vt, self.ld);
        simd::probs_and_dscores(&mut s.p, &mut s.ds, bc, BLOCK_K, self.lse2, self.delta);
        if mods.as_ref().is_some_and(TileMods::softcap) {
            softcap_chain(&mut s.ds, &s.tanh, br, bc, BLOCK_K);
        }
    }

    /// dQ rows of the block [br, Dp] += dS · K.
    fn add_dq(&self, s: &Scratch, dq: &mut [f32]) {
        let (br, bc, d, dp) = (self.rb.rows(), self.t.cols(), self.d, self.dp());
        matmul(br, d, bc, dq, dp, true, Mat::rows(&s.ds, BLOCK_K), self.k, dp);
    }

    /// dK and dV rows of the key block that starts at `blk` ([≤ BLOCK_K, Dp] and [≤ BLOCK_K, Dvp]):
    /// += dSᵀ · Qs and += Pᵀ · dO on the tile's keys.
    fn add_dkdv(&self, s: &Scratch, blk: usize, dk: &mut [f32], dv: &mut [f32]) {
        let (br, bc, d, dp) = (self.rb.rows(), self.t.cols(), self.d, self.dp());
        let (first, dvp) = (self.t.c0 - blk, self.dvp());
        matmul(bc, d, br, &mut dk[first * dp..], dp, true, Mat::transposed(&s.ds, BLOCK_K), self.qs, dp);
        matmul(bc, self.dv, br, &mut dv[first * dvp..], dvp, true, Mat::transposed(&s.p, BLOCK_K), self.d_out, dvp);
    }
}

/// One task per (batch row, kv head): dq_seqs[b·H + h], dk_seqs / dv_seqs[b·Hkv + hkv].
fn fused(cx: &Ctx, dq_seqs: Vec<&mut [f32]>, dk_seqs: Vec<&mut [f32]>, dv_seqs: Vec<&mut [f32]>) {
    let g = cx.p.dims.group();
    let mut dq_groups = dq_seqs.into_iter(); // the g query heads of kv head hkv are consecutive
    let tasks: Vec<_> = dk_seqs.into_iter().zip(dv_seqs).map(|kv| (dq_groups.by_ref().take(g).collect::<Vec<_>>(), kv)).collect();
    par::each(tasks.into_iter().enumerate().collect(), |(bkv, (mut dq_group, (dk_seq, dv_seq)))| {
        let (b, hkv) = (bkv / cx.p.dims.kv_heads, bkv % cx.p.dims.kv_heads);
        let (seq, dp, dvp) = (cx.p.mask.seq(b), padded_dim(cx.geo.head_dim), padded_dim(cx.geo.head_dim_v));
        let mut s = Scratch::new(cx.p);
        for (i, (dk_blk, dv_blk)) in dk_seq.chunks_mut(BLOCK_K * dp).zip(dv_seq.chunks_mut(BLOCK_K * dvp)).enumerate() {
            let blk = i * BLOCK_K;
            for (gi, dq_head) in dq_group.iter_mut().enumerate() {
                for r0 in cx.vis.query_blocks(&seq, blk) {
                    let rb = RowBlock::new(b, hkv * g + gi, seq, r0);
                    let Some(t) = cx.vis.tile(&rb, blk) else { continue };
                    let tr = TileRef::new(cx, rb, t);
                    tr.probs_and_dscores(cx, &mut s);
                    tr.add_dkdv(&s, blk, dk_blk, dv_blk);
                    tr.add_dq(&s, &mut dq_head[rb.r0 * dp..rb.r1 * dp]);
                }
            }
        }
    });
}

/// dQ, one task per (batch row, head, query block).
fn split_dq(cx: &Ctx, dq_seqs: Vec<&mut [f32]>) {
    let (h, dp) = (cx.p.dims.heads, padded_dim(cx.geo.head_dim));
    let mut tasks = Vec::new();
    for (bh, dq_seq) in dq_seqs.into_iter().enumerate() {
        let (b, seq) = (bh / h, cx.p.mask.seq(bh / h));
        tasks.extend(dq_seq.chunks_mut(BLOCK_Q * dp).enumerate().map(|(i, dq_blk)| (RowBlock::new(b, bh % h, seq, i * BLOCK_Q), dq_blk)));
    }
    par::each(tasks, |(rb, dq_blk)| {
        let mut s = Scratch::new(cx.p);
        for t in cx.vis.key_blocks(&rb).filter_map(|blk| cx.vis.tile(&rb, blk)) {
            let tr = TileRef::new(cx, rb, t);
            tr.probs_and_dscores(cx, &mut s);
            tr.add_dq(&s, dq_blk);
        }
    });
}

/// dK and dV, one task per (batch row, kv head, key block).
fn split_dkdv(cx: &Ctx, dk_seqs: Vec<&mut [f32]>, dv_seqs: Vec<&mut [f32]>) {
    let (hkv, g) = (cx.p.dims.kv_heads, cx.p.dims.group());
    let (dp, dvp) = (padded_dim(cx.geo.head_dim), padded_dim(cx.geo.head_dim_v));
    let mut tasks = Vec::new();
    for (bk, (dk_seq, dv_seq)) in dk_seqs.into_iter().zip(dv_seqs).enumerate() {
        let blocks = dk_seq.chunks_mut(BLOCK_K * dp).zip(dv_seq.chunks_mut(BLOCK_K * dvp));
        tasks.extend(blocks.enumerate().map(|(i, (dk_blk, dv_blk))| (bk, i * BLOCK_K, dk_blk, dv_blk)));
    }
    par::each(tasks, |(bk, blk, dk_blk, dv_blk)| {
        let (b, seq) = (bk / hkv, cx.p.mask.seq(bk / hkv));
        let mut s = Scratch::new(cx.p);
        for gi in 0..g {
            for r0 in cx.vis.query_blocks(&seq, blk) {
                let rb = RowBlock::new(b, (bk % hkv) * g + gi, seq, r0);
                let Some(t) = cx.vis.tile(&rb, blk) else { continue };
                let tr = TileRef::new(cx, rb, t);
                tr.probs_and_dscores(cx, &mut s);
                tr.add_dkdv(&s, blk, dk_blk, dv_blk);
            }
        }
    });
}
