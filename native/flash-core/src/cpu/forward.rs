//! Forward: for each (batch, head, block of query rows), a pass over key blocks with an online
//! softmax in the exp2 domain; O and LSE are written once per row block.

use super::layout::{pack_rows, pack_transposed, padded_dim, transposed_ld, unpack_rows};
use super::matmul::{matmul, Mat};
use super::simd;
use super::workspace::{filled, zeroed, BLOCK_K, BLOCK_Q};
use crate::dtype::DType;
use crate::error::Result;
use crate::io::ForwardIo;
use crate::problem::Problem;
use rayon::prelude::*;
use std::f32::consts::{LN_2, LOG2_E};

/// q: [B, Sq, H, D], k/v: [B, Sk, Hkv, D] in p.dtype; writes o ([B, Sq, H, D], p.dtype) and
/// lse ([B, H, Sq], f32, natural log).
pub fn run(p: &Problem, io: ForwardIo) -> Result<()> {
    let ForwardIo { q, k, v, o, lse, .. } = io;
    let dims = p.dims;
    let (sq, sk, dp) = (dims.seq_q, dims.seq_k, padded_dim(dims.head_dim));
    let skp = transposed_ld(sk);
    // Q is pre-multiplied by scale * log2(e) so that Q·Kᵀ is already in exp2 units.
    let qs = pack_rows(q, p.dtype, dims.q_shape(), p.scale * LOG2_E, "packed q")?; // [B·H, Sq, Dp]
    let kt = pack_transposed(k, p.dtype, dims.kv_shape(), "packed k")?; // [B·Hkv, D, Skp]
    let vr = pack_rows(v, p.dtype, dims.kv_shape(), 1.0, "packed v")?; // [B·Hkv, Sk, Dp]
    let mut o_acc = zeroed(dims.batch * dims.heads * sq * dp, "output accumulator")?; // [B·H, Sq, Dp]
    let mut lse_acc = filled(dims.lse_len(), f32::NEG_INFINITY, "lse")?; // [B·H, Sq]

    if sq > 0 {
        o_acc.par_chunks_mut(sq * dp).zip(lse_acc.par_chunks_mut(sq)).enumerate().for_each(|(bh, (o_head, lse_head))| {
            let bkv = (bh / dims.heads) * dims.kv_heads + (bh % dims.heads) / dims.group();
            let q_head = &qs[bh * sq * dp..(bh + 1) * sq * dp];
            let kt_head = &kt[bkv * dims.head_dim * skp..(bkv + 1) * dims.head_dim * skp];
            let v_head = &vr[bkv * sk * dp..(bkv + 1) * sk * dp];
            o_head
                .par_chunks_mut(BLOCK_Q * dp)
                .zip(lse_head.par_chunks_mut(BLOCK_Q))
                .enumerate()
                .for_each(|(blk, (o_rows, lse_rows))| {
                    let r0 = blk * BLOCK_Q;
                    let q_rows = &q_head[r0 * dp..r0 * dp + o_rows.len()];
                    row_block(p, r0, q_rows, kt_head, v_head, o_rows, lse_rows);
                });
        });
    }

    unpack_rows(&o_acc, o, p.dtype, dims.q_shape(), 1.0);
    DType::F32.store(&lse_acc, lse, 0);
    Ok(())
}

/// One block of query rows starting at row r0 of one head.
/// q: [br, Dp] (scaled), kt: [D, Skp], v: [Sk, Dp], o: [br, Dp] (zeroed; receives O), lse: [br].
fn row_block(p: &Problem, r0: usize, q: &[f32], kt: &[f32], v: &[f32], o: &mut [f32], lse: &mut [f32]) {
    let (d, dp) = (p.dims.head_dim, padded_dim(p.dims.head_dim));
    let skp = kt.len() / d;
    let br = lse.len();
    let key_end = p.keys_visible(r0 + br - 1);
    let mut s = vec![0.0f32; br * BLOCK_K]; // [br, BLOCK_K] scores, then probabilities
    let mut m = vec![f32::NEG_INFINITY; br];
    let mut l = vec![0.0f32; br];
    let mut alpha = vec![0.0f32; br];

    for c0 in (0..key_end).step_by(BLOCK_K) {
        let bc = BLOCK_K.min(key_end - c0);
        matmul(br, bc, d, &mut s, BLOCK_K, false, Mat::rows(q, dp), &kt[c0..], skp);
        if p.causal {
            mask_causal(&mut s, br, bc, r0 as isize + p.dims.diag_offset() - c0 as isize);
        }
        simd::online_softmax(&mut s, bc, BLOCK_K, &mut m, &mut l, &mut alpha);
        simd::scale_rows(o, dp, &alpha);
        matmul(br, d, bc, o, dp, true, Mat::rows(&s, BLOCK_K), &v[c0 * dp..], dp);
    }

    for r in 0..br {
        let row = &mut o[r * dp..r * dp + d];
        if l[r] == 0.0 {
            // The row sees no key: o = 0, lse = -inf.
            row.fill(0.0);
            lse[r] = f32::NEG_INFINITY;
        } else {
            let inv = 1.0 / l[r];
            row.iter_mut().for_each(|x| *x *= inv);
            lse[r] = (m[r] + l[r].log2()) * LN_2;
        }
    }
}

/// Sets to -inf the scores a causal row may not see. s: [rows, BLOCK_K]; local row r sees local
/// columns c <= first_limit + r.
pub fn mask_causal(s: &mut [f32], rows: usize, cols: usize, first_limit: isize) {
    if first_limit + 1 >= cols as isize {
        return; // every row of the tile sees every column
    }
    for r in 0..rows {
        let first_hidden = (first_limit + r as isize + 1).clamp(0, cols as isize) as usize;
        s[r * BLOCK_K + first_hidden..r * BLOCK_K + cols].fill(f32::NEG_INFINITY);
    }
}
