//! Decode's products for bf16 queries against plain bf16 caches on CPUs with AVX512-BF16, by
//! `vdpbf16ps` (32 products per instruction) straight from the cache's bytes, where decode.rs's
//! general path widens each row to f32 and takes 16 per FMA:
//! - scores: q . k, products of two bf16 exact in f32 and f32 sums, so the general path's up to
//!   summation order (and subnormals, which `vdpbf16ps` flushes to zero). q is kept as raw bf16
//!   `[D / 32, states, 32]` per kv head in the cache's element order, unscaled: the scale ·
//!   log2(e) of the exp2-unit scores multiplies each finished score instead.
//! - P V: two keys' rows interleaved (one unpack per 32 elements of the pair) against their two
//!   probabilities rounded to bf16 — as the GPU's tensor cores round P; the sums, and l, stay f32.
//!   The output's element order within each 32 is [`v_position`]'s.

use super::decode_rows::{Plain, KEY_BLOCK};
use super::vector::x86::{interleave_bf16, to_bf16_pairs, Avx512};
use super::vector::Vector;
use crate::decode::{Cache, Decode};
use crate::dtype::DType;

/// bf16 elements per `vdpbf16ps` operand.
pub(crate) const PAIR_LANES: usize = 32;

/// Whether a call takes this path: bf16 q over plain K and V caches whose rows are whole operands,
/// on a CPU with AVX512-BF16 (the caller has checked the AVX-512 set decode.rs's kernel uses).
pub(crate) fn usable(p: &Decode, k: &Cache, v: &Cache) -> bool {
    p.dtype == DType::BF16
        && matches!((k, v), (Cache::Plain(_), Cache::Plain(_)))
        && p.head_dim.is_multiple_of(PAIR_LANES)
        && std::is_x86_feature_detected!("avx512bf16")
        && std::is_x86_feature_detected!("avx512bw")
}

/// Where head-dim element e of V sits in the accumulators (vector e' / 16, lane e' % 16, as
/// decode_rows' `position`): of each 32, unpack's order — elements 8j + m (m < 4) in lanes 4j + m
/// of the first vector, 8j + 4 + m in lanes 4j + m of the second.
pub(crate) fn v_position(e: usize) -> usize {
    let (c, w) = (e / 32, e % 32);
    (2 * c + w % 8 / 4) * 16 + 4 * (w / 8) + w % 4
}

/// s[st, x] = scale2 · q[st] · k[x] for the block's keys x < nk (columns past nk, up to the next
/// multiple of 16, hold finite leftovers nobody reads); qb: this kv head's q, `ops` operands of 32
/// per row.
#[inline(always)]
pub(crate) unsafe fn scores(rows: &Plain<'_, 2>, qb: &[u16], states: usize, ops: usize, nk: usize, scale2: f32, s: &mut [f32]) {
    assert!(qb.len() == ops * states * PAIR_LANES && s.len() == states * KEY_BLOCK && nk <= KEY_BLOCK);
    let (q, s) = (qb.as_ptr(), s.as_mut_ptr());
    let mut st = 0;
    while states - st >= 8 {
        score_group::<8>(rows, st, q, states, ops, nk, scale2, s);
        st += 8;
    }
    if states - st >= 4 {
        score_group::<4>(rows, st, q, states, ops, nk, scale2, s);
        st += 4;
    }
    if states - st >= 2 {
        score_group::<2>(rows, st, q, states, ops, nk, scale2, s);
        st += 2;
    }
    if states - st >= 1 {
        score_group::<1>(rows, st, q, states, ops, nk, scale2, s);
    }
}

/// States st0 .. st0 + N of [`scores`]: per key, N dot products in registers (two chains each);
/// every 16 keys, their partial sums reduced together.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn score_group<const N: usize>(rows: &Plain<'_, 2>, st0: usize, qb: *const u16, states: usize, ops: usize, nk: usize, scale2: f32, s: *mut f32) {
    const LANES: usize = 16;
    let q = |c: usize, n: usize| qb.add((c * states + st0 + n) * PAIR_LANES) as *const u8;
    let scale = Avx512::splat(scale2);
    let mut part = [[Avx512::zero(); LANES]; N];
    let mut x0 = 0;
    while x0 < nk {
        for x in x0..(x0 + LANES).min(nk) {
            let row = rows.row(x);
            let (mut a0, mut a1) = ([Avx512::zero(); N], [Avx512::zero(); N]);
            for c in 0..ops / 2 {
                let (k0, k1) = (row.add(2 * c * 2 * PAIR_LANES), row.add((2 * c + 1) * 2 * PAIR_LANES));
                for n in 0..N {
                    a0[n] = a0[n].dot_bf16(q(2 * c, n), k0);
                    a1[n] = a1[n].dot_bf16(q(2 * c + 1, n), k1);
                }
            }
            if ops % 2 == 1 {
                let k0 = row.add((ops - 1) * 2 * PAIR_LANES);
                for (n, a) in a0.iter_mut().enumerate() {
                    *a = a.dot_bf16(q(ops - 1, n), k0);
                }
            }
            for n in 0..N {
                part[n][x - x0] = a0[n].add(a1[n]);
            }
        }
        for (n, part) in part.iter().enumerate() {
            Avx512::sum_each(part).mul(scale).store(s.add((st0 + n) * KEY_BLOCK + x0));
        }
        x0 += LANES;
    }
}

/// acc[st] = alpha[st] acc[st] + sum over x < nk of bf16(p[st, x]) v[x]; acc `[D / 16, states, 16]`
/// in [`v_position`]'s order; pw: scratch for the probabilities as bf16 pairs `[states, KEY_BLOCK /
/// 2]` (a pair's second key past nk weighs 0).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn accumulate(rows: &Plain<'_, 2>, p: &[f32], alpha: &[f32], states: usize, ops: usize, nk: usize, acc: &mut [f32], pw: &mut [u32]) {
    assert!(acc.len() == 2 * ops * states * 16 && p.len() == states * KEY_BLOCK && alpha.len() == states && nk <= KEY_BLOCK);
    assert!(pw.len() == states * KEY_BLOCK / 2);
    const _: () = assert!(KEY_BLOCK == 32);
    for st in 0..states {
        let mut row = [0f32; KEY_BLOCK];
        row[..nk].copy_from_slice(&p[st * KEY_BLOCK..][..nk]);
        to_bf16_pairs(Avx512::load(row.as_ptr()), Avx512::load(row.as_ptr().add(16)), pw.as_mut_ptr().add(st * KEY_BLOCK / 2));
    }
    let (acc, pw, alpha) = (acc.as_mut_ptr(), pw.as_ptr(), alpha.as_ptr());
    let mut st = 0;
    while states - st >= 8 {
        accumulate_group::<8>(rows, st, pw, alpha, states, ops, nk, acc);
        st += 8;
    }
    if states - st >= 4 {
        accumulate_group::<4>(rows, st, pw, alpha, states, ops, nk, acc);
        st += 4;
    }
    if states - st >= 2 {
        accumulate_group::<2>(rows, st, pw, alpha, states, ops, nk, acc);
        st += 2;
    }
    if states - st >= 1 {
        accumulate_group::<1>(rows, st, pw, alpha, states, ops, nk, acc);
    }
}

/// States st0 .. st0 + N of [`accumulate`], the two accumulator vectors of one 32-element operand
/// at a time in registers, the keys in pairs.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate_group<const N: usize>(rows: &Plain<'_, 2>, st0: usize, pw: *const u32, alpha: *const f32, states: usize, ops: usize, nk: usize, acc: *mut f32) {
    let a_at = |i: usize, n: usize| acc.add((i * states + st0 + n) * 16);
    let mut al = [Avx512::zero(); N];
    for (n, a) in al.iter_mut().enumerate() {
        *a = Avx512::splat(*alpha.add(st0 + n));
    }
    for c in 0..ops {
        let (mut a0, mut a1) = ([Avx512::zero(); N], [Avx512::zero(); N]);
        for n in 0..N {
            a0[n] = Avx512::load(a_at(2 * c, n)).mul(al[n]);
            a1[n] = Avx512::load(a_at(2 * c + 1, n)).mul(al[n]);
        }
        for x in (0..nk).step_by(2) {
            // An odd last key pairs with itself at weight 0 (pw's high half).
            let (lo, hi) = interleave_bf16(rows.row(x).add(c * 2 * PAIR_LANES), rows.row((x + 1).min(nk - 1)).add(c * 2 * PAIR_LANES));
            for n in 0..N {
                let w = *pw.add((st0 + n) * KEY_BLOCK / 2 + x / 2);
                a0[n] = a0[n].dot_bf16_pair(lo, w);
                a1[n] = a1[n].dot_bf16_pair(hi, w);
            }
        }
        for n in 0..N {
            a0[n].store(a_at(2 * c, n));
            a1[n].store(a_at(2 * c + 1, n));
        }
    }
}
