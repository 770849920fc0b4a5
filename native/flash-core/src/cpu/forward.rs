//! Forward: for each (batch row, head, block of query rows), a pass over the key tiles it may see
//! with an online softmax in the exp2 domain; O and LSE are written once per row block.

use super::batch::{query_runs, split_rows, Geometry};
use super::layout::{pack_rows, pack_transposed, padded_dim, transposed_ld, unpack_rows};
use super::matmul::{matmul, Mat};
use super::modify::{sink2, TileMods};
use super::par;
use super::simd;
use super::tiles::{RowBlock, Visibility};
use super::workspace::{filled, zeroed, Buffer, BLOCK_K, BLOCK_Q};
use crate::dtype::DType;
use crate::error::Result;
use crate::io::ForwardIo;
use crate::problem::Problem;
use crate::strides::InputStrides;
use std::f32::consts::{LN_2, LOG2_E};

/// Inputs in the working layouts (see [`Geometry`]).
struct Packed {
    qs: Buffer, // [PB·H, Rq, Dp], times scale·log2(e) so that Q·Kᵀ is already in exp2 units
    kt: Buffer, // [PB·Hkv, D, Rkp]
    v: Buffer,  // [PB·Hkv, Rk, Dvp]
}

/// q, k, v in p.dtype (shapes [`Problem::q_shape`], [`Problem::kv_shape`], [`Problem::v_shape`]);
/// writes o (p.dtype, [`Problem::o_shape`]) and lse (f32, natural log, [`Problem::lse_shape`]).
pub fn run(p: &Problem, io: ForwardIo) -> Result<()> {
    let ForwardIo { q, k, v, o, lse, mask, strides } = io;
    let st = strides.unwrap_or_else(|| InputStrides::packed(p));
    let geo = Geometry::new(p);
    let dvp = padded_dim(geo.head_dim_v);
    let x = Packed {
        qs: pack_rows(q, p.dtype, geo.q4(), st.q, p.scale * LOG2_E, "packed q")?,
        kt: pack_transposed(k, p.dtype, geo.kv4(), st.k, "packed k")?,
        v: pack_rows(v, p.dtype, geo.v4(), st.v, 1.0, "packed v")?,
    };
    let vis = Visibility::new(p, &mask);
    let mut o_acc = zeroed(geo.batches * geo.heads * geo.q_rows * dvp, "output accumulator")?; // [PB·H, Rq, Dvp]
    let mut lse_acc = filled(p.lse_len(), f32::NEG_INFINITY, "lse")?; // [PB·H, Rq], lse's own layout

    let runs = query_runs(p);
    let o_seqs = split_rows(&mut o_acc, dvp, &runs);
    let lse_seqs = split_rows(&mut lse_acc, 1, &runs);
    let mut tasks = Vec::new(); // one per (batch row, head, query block)
    for (bh, (o_seq, lse_seq)) in o_seqs.into_iter().zip(lse_seqs).enumerate() {
        let (b, h) = (bh / geo.heads, bh % geo.heads);
        let blocks = o_seq.chunks_mut(BLOCK_Q * dvp).zip(lse_seq.chunks_mut(BLOCK_Q));
        tasks.extend(blocks.enumerate().map(|(i, (o_rows, lse_rows))| (RowBlock::new(b, h, p.mask.seq(b), i * BLOCK_Q), o_rows, lse_rows)));
    }
    par::each(tasks, |(rb, o_rows, lse_rows)| row_block(p, &geo, &vis, &x, &rb, o_rows, lse_rows));

    unpack_rows(&o_acc, o, p.dtype, geo.o4(), 1.0);
    DType::F32.store(&lse_acc, lse, 0);
    Ok(())
}

/// One block of query rows: o [br, Dvp] (zeroed; receives O), lse [br].
fn row_block(p: &Problem, geo: &Geometry, vis: &Visibility, x: &Packed, rb: &RowBlock, o: &mut [f32], lse: &mut [f32]) {
    let (d, dp) = (geo.head_dim, padded_dim(geo.head_dim));
    let (dv, dvp) = (geo.head_dim_v, padded_dim(geo.head_dim_v));
    let skp = transposed_ld(geo.k_rows);
    let br = rb.rows();
    let hkv = rb.h / p.dims.group();
    let row = p.lse_base(rb.b, rb.h) + rb.r0;
    let q = &x.qs[row * dp..(row + br) * dp]; // [br, Dp]
    let kt_head = &x.kt[geo.kv_matrix(rb.b, hkv) * d * skp..][..d * skp]; // [D, Skp]
    let key0 = geo.key_offset(&rb.seq, rb.b); // column (kt) and row (v) of the batch row's key 0
    let v_head = &x.v[geo.kv_matrix(rb.b, hkv) * geo.k_rows * dvp..][..geo.k_rows * dvp]; // [Rk, Dvp]
    let mut s = vec![0.0f32; br * BLOCK_K]; // [br, BLOCK_K] scores, then probabilities
    // A sink starts every row's softmax: max = sink, sum = exp2(sink - sink) = 1.
    let sink = sink2(p, rb.h);
    let mut m = vec![sink.unwrap_or(f32::NEG_INFINITY); br];
    let mut l = vec![if sink.is_some() { 1.0f32 } else { 0.0 }; br];
    let mut alpha = vec![0.0f32; br];
    let mods = (!p.mods.is_none()).then(|| TileMods::new(p, rb));

    for t in vis.key_blocks(rb).filter_map(|blk| vis.tile(rb, blk)) {
        let (c0, bc) = (key0 + t.c0, t.cols());
        matmul(br, bc, d, &mut s, BLOCK_K, false, Mat::rows(q, dp), &kt_head[c0..], skp);
        if let Some(mods) = &mods {
            mods.apply(&mut s, BLOCK_K, rb, &t, None);
        }
        if t.masked() {
            vis.mask_scores(&mut s, BLOCK_K, rb, &t);
        }
        simd::online_softmax(&mut s, bc, BLOCK_K, &mut m, &mut l, &mut alpha);
        simd::scale_rows(o, dvp, &alpha);
        matmul(br, dv, bc, o, dvp, true, Mat::rows(&s, BLOCK_K), &v_head[c0 * dvp..], dvp);
    }

    for r in 0..br {
        let row = &mut o[r * dvp..r * dvp + dv];
        if l[r] == 0.0 {
            // The row sees no key (and has no sink): o = 0, lse = -inf.
            row.fill(0.0);
            lse[r] = f32::NEG_INFINITY;
        } else {
            let inv = 1.0 / l[r];
            row.iter_mut().for_each(|x| *x *= inv);
            lse[r] = (m[r] + l[r].log2()) * LN_2;
        }
    }
}
