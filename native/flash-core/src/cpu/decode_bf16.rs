//! Decode's scores for bf16 queries against a plain bf16 cache on CPUs with AVX512-BF16: q . k by
//! `vdpbf16ps`, 32 products per instruction straight from the cache's bytes (no widening), where
//! decode.rs's general path widens K to f32 and takes 16 per FMA. Products of two bf16 are exact
//! in f32 and the sums are f32 as there, so the scores are the general path's up to summation
//! order (and subnormal inputs or sums, which `vdpbf16ps` flushes to zero).
//!
//! q is kept as raw bf16 `[nvec / 2, states, 32]` per kv head (in the cache's element order, the
//! pairs the instruction multiplies), unscaled: the scale · log2(e) of the exp2-unit scores
//! multiplies each finished score instead.

use super::decode_rows::{Plain, KEY_BLOCK};
use super::vector::{x86::Avx512, Vector};
use crate::decode::{Cache, Decode};
use crate::dtype::DType;

/// bf16 elements per `vdpbf16ps` operand.
pub(crate) const PAIR_LANES: usize = 32;

/// Whether a call takes this path: bf16 q over a plain K cache whose rows are whole operands, on a
/// CPU with AVX512-BF16 (the caller has checked the AVX-512 set decode.rs's kernel uses).
pub(crate) fn usable(p: &Decode, k: &Cache) -> bool {
    p.dtype == DType::BF16 && matches!(k, Cache::Plain(_)) && p.head_dim.is_multiple_of(PAIR_LANES) && std::is_x86_feature_detected!("avx512bf16")
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
