//! Decode's products for bf16 queries on CPUs with AVX512-BF16, by `vdpbf16ps` (32 products per
//! instruction) straight from the cache's bytes, where decode.rs's general path widens (or
//! dequantizes) each row to f32 and takes 16 per FMA (`paths` says which products of a call;
//! decode.rs takes them where [`preferred`], i.e. where the instruction runs at the FMA's rate):
//! - scores: q . k, products of two bf16 exact in f32 and f32 sums, so the general path's up to
//!   summation order (and subnormals, which `vdpbf16ps` flushes to zero). q is kept as raw bf16
//!   `[D / 32, states, 32]` per kv head in the cache's element order, unscaled: the scale ·
//!   log2(e) of the exp2-unit scores multiplies each finished score instead.
//! - P V: two keys' rows interleaved (one unpack per 32 elements of the pair) against their two
//!   probabilities rounded to bf16 — as the GPU's tensor cores round P; the sums, and l, stay f32.
//!   The output's element order within each 32 is [`v_position`]'s.
//! - scores over a 4-bit K: the codes as bf16 `M + c`, each group's scale and bias after the
//!   product (`scores_q4`).

use std::arch::x86_64::*;

use super::decode::DotPaths;
use super::decode_rows::{Plain, Quant, KEY_BLOCK};
use super::vector::x86::{interleave_bf16, to_bf16_pairs, Avx512};
use super::vector::Vector;
use crate::decode::{Cache, Decode};
use crate::dtype::DType;

/// Calls `$f::<N>($first, st, $args..)` for the states in groups of N = $max (8 or 4), then 4, 2, 1
/// (each group's states held in registers: one pass over the block's rows per group).
macro_rules! in_groups {
    (8, $f:ident, $states:expr, $first:expr; $($arg:expr),*) => {{
        let mut st = 0;
        while $states - st >= 8 {
            $f::<8>($first, st, $($arg),*);
            st += 8;
        }
        in_groups!(@rest st, $f, $states, $first; $($arg),*);
    }};
    (4, $f:ident, $states:expr, $first:expr; $($arg:expr),*) => {{
        let mut st = 0;
        while $states - st >= 4 {
            $f::<4>($first, st, $($arg),*);
            st += 4;
        }
        in_groups!(@rest st, $f, $states, $first; $($arg),*);
    }};
    (@rest $st:ident, $f:ident, $states:expr, $first:expr; $($arg:expr),*) => {{
        if $states - $st >= 4 {
            $f::<4>($first, $st, $($arg),*);
            $st += 4;
        }
        if $states - $st >= 2 {
            $f::<2>($first, $st, $($arg),*);
            $st += 2;
        }
        if $states - $st >= 1 {
            $f::<1>($first, $st, $($arg),*);
        }
    }};
}
// (decode_vnni.rs takes its state groups the same way.)
pub(crate) use in_groups;

/// bf16 elements per `vdpbf16ps` operand.
pub(crate) const PAIR_LANES: usize = 32;

/// Which of a call's products take this file's paths: bf16 q on a CPU with AVX512-BF16 and
/// AVX512-BW (the caller has checked the AVX-512 set decode.rs's kernel uses); plain caches whose
/// rows are whole operands; a 4-bit K cache with D a multiple of 64. (A 4-bit V by the same means,
/// key pairs interleaved against P s per group, measured no faster than the general path: not
/// kept, bench/RESULTS.md.)
pub(crate) fn paths(p: &Decode, k: &Cache, v: &Cache) -> DotPaths {
    let cpu = p.dtype == DType::BF16 && std::is_x86_feature_detected!("avx512bf16") && std::is_x86_feature_detected!("avx512bw");
    let plain = |c: &Cache| cpu && matches!(c, Cache::Plain(_)) && p.head_dim.is_multiple_of(PAIR_LANES);
    let q4 = cpu && matches!(k, Cache::Quant { fmt, .. } if fmt.bits == 4) && p.head_dim.is_multiple_of(64);
    DotPaths { k_plain: plain(k), k_q4: q4, v_plain: plain(v) }
}

/// Whether decode takes [`paths`] on this CPU: where `vdpbf16ps` runs at the FMA's rate, so that
/// its 32 products per instruction beat widening and 16 per FMA: AMD's Zen 4 / 5. The Intel Xeon
/// measured issues it once per 2 cycles (half the FMAs' products; bench/RESULTS.md, session 45),
/// and the general path's widening (one operation per 16 bf16) was faster there.
pub(crate) fn preferred() -> bool {
    static FAST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FAST.get_or_init(|| {
        let id = __cpuid(0); // the vendor string
        [id.ebx, id.edx, id.ecx] == [0x6874_7541, 0x6974_6e65, 0x444d_4163] // "AuthenticAMD"
    })
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
    in_groups!(8, score_group, states, rows; q, states, ops, nk, scale2, s);
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
    in_groups!(8, accumulate_group, states, rows; pw, alpha, states, ops, nk, acc);
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

// ---- 4-bit K: the codes into the dot products ------------------------------------------------------
// q . k = sum_G s_G A_G + (b_G - M s_G) qs_G with A_G = sum_{d in G} (M + c_d) q_d: a code c under
// the high byte of bf16 M = 2^7 reads as M + c (exact), so one unpack against a register of magic
// bytes makes 32 of them; the products and sums are as exact as the general path's (which
// dequantizes in f32), the magic cancelling in f32. qs_G: the group's sum of q (f32).

const Q4_M: f32 = 128.0;

/// The dim of word w (< 32) of code operand r (< 4) of 128-dim chunk t, in unpack's order:
/// operands 0 / 1 hold the low nibbles (even dims) of each 16-byte lane's first / last 8 bytes, 2 /
/// 3 the high nibbles (odd dims).
pub(crate) fn q4_dim(t: usize, r: usize, w: usize) -> usize {
    128 * t + 32 * (w / 8) + 16 * (r & 1) + 2 * (w % 8) + (r >> 1)
}

/// s[st, x] = scale2 · q[st] · k[x] for a 4-bit K (groups of gs, D = d); qb `[chunks, 4, states,
/// 32]` raw bf16 in [`q4_dim`]'s order (0 past D), qsum `[states, groups]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn scores_q4(rows: &Quant<'_, 4>, qb: &[u16], qsum: &[f32], gs: usize, d: usize, states: usize, nk: usize, scale2: f32, s: &mut [f32]) {
    let (chunks, groups) = (d.div_ceil(128), d / gs);
    assert!(qb.len() == chunks * 4 * states * PAIR_LANES && qsum.len() == states * groups && s.len() == states * KEY_BLOCK && nk <= KEY_BLOCK);
    assert!(d.is_multiple_of(64) && groups <= 16 && chunks <= 2);
    let (q, qsum, s) = (qb.as_ptr(), qsum.as_ptr(), s.as_mut_ptr());
    in_groups!(4, score_group_q4, states, rows; q, qsum, gs, d, states, nk, scale2, s);
}

/// Lane x: x · stride, the offsets of 16 consecutive keys' scale entries (the gathers' index).
#[inline(always)]
pub(super) unsafe fn key_offsets(stride: usize) -> __m512i {
    _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(stride as i32))
}

/// States st0 .. st0 + N of [`scores_q4`]: per key and chunk, the four code operands' dot products
/// times each lane's group scale; every 16 keys, the partial sums reduced together and the bias
/// terms added.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn score_group_q4<const N: usize>(rows: &Quant<'_, 4>, st0: usize, qb: *const u16, qsum: *const f32, gs: usize, d: usize, states: usize, nk: usize, scale2: f32, s: *mut f32) {
    const LANES: usize = 16;
    let (chunks, groups) = (d.div_ceil(128), d / gs);
    let q = |t: usize, r: usize, n: usize| _mm512_loadu_si512(qb.add(((t * 4 + r) * states + st0 + n) * PAIR_LANES) as *const __m512i);
    let (low, magic) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x43));
    // Lane i of chunk t's products covers dims 128 t + 32 (i / 4) ..: its group.
    let group_of = |t: usize| _mm512_set_epi32(
        ((128 * t + 96) / gs) as i32, ((128 * t + 96) / gs) as i32, ((128 * t + 96) / gs) as i32, ((128 * t + 96) / gs) as i32,
        ((128 * t + 64) / gs) as i32, ((128 * t + 64) / gs) as i32, ((128 * t + 64) / gs) as i32, ((128 * t + 64) / gs) as i32,
        ((128 * t + 32) / gs) as i32, ((128 * t + 32) / gs) as i32, ((128 * t + 32) / gs) as i32, ((128 * t + 32) / gs) as i32,
        ((128 * t) / gs) as i32, ((128 * t) / gs) as i32, ((128 * t) / gs) as i32, ((128 * t) / gs) as i32,
    );
    let idx = [group_of(0), group_of(1)];
    let gmask: __mmask16 = ((1u32 << groups) - 1) as __mmask16;
    let key_at = key_offsets(rows.scale_stride());
    let mut part = [[Avx512::zero(); LANES]; N];
    let mut x0 = 0;
    while x0 < nk {
        for x in x0..(x0 + LANES).min(nk) {
            let row = rows.row(x);
            let (sc, _) = rows.scales(x);
            let scales = _mm512_maskz_loadu_ps(gmask, sc);
            let mut acc = [_mm512_setzero_ps(); N];
            for t in 0..chunks {
                let bytes = if 128 * (t + 1) <= d {
                    _mm512_loadu_si512(row.add(64 * t) as *const __m512i)
                } else {
                    _mm512_maskz_loadu_epi8(0xffff_ffff, row.add(64 * t) as *const i8)
                };
                let lo = _mm512_and_si512(bytes, low);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), low);
                let w = [_mm512_unpacklo_epi8(lo, magic), _mm512_unpackhi_epi8(lo, magic), _mm512_unpacklo_epi8(hi, magic), _mm512_unpackhi_epi8(hi, magic)];
                let svec = _mm512_permutexvar_ps(idx[t], scales);
                for n in 0..N {
                    let mut a = _mm512_setzero_ps();
                    for (r, w) in w.iter().enumerate() {
                        a = _mm512_dpbf16_ps(a, std::mem::transmute::<__m512i, __m512bh>(q(t, r, n)), std::mem::transmute::<__m512i, __m512bh>(*w));
                    }
                    acc[n] = _mm512_fmadd_ps(a, svec, acc[n]);
                }
            }
            for n in 0..N {
                part[n][x - x0] = Avx512::from_raw(acc[n]);
            }
        }
        // The bias terms of these 16 keys: sum_G (b - M s)[x, G] qs[st, G] (rows past the block's
        // keys are read but never stored: the arrays hold KEY_BLOCK keys).
        let (sc0, bi0) = rows.scales(x0);
        let mut bt = [_mm512_setzero_ps(); N];
        for g in 0..groups {
            let sg = _mm512_i32gather_ps::<4>(key_at, sc0.add(g) as *const f32);
            let bg = _mm512_i32gather_ps::<4>(key_at, bi0.add(g) as *const f32);
            let c = _mm512_fmadd_ps(_mm512_set1_ps(-Q4_M), sg, bg);
            for (n, bt) in bt.iter_mut().enumerate() {
                *bt = _mm512_fmadd_ps(c, _mm512_set1_ps(*qsum.add((st0 + n) * groups + g)), *bt);
            }
        }
        let scale = _mm512_set1_ps(scale2);
        for (n, part) in part.iter().enumerate() {
            let sum = _mm512_add_ps(Avx512::sum_each(part).raw(), bt[n]);
            _mm512_storeu_ps(s.add((st0 + n) * KEY_BLOCK + x0), _mm512_mul_ps(sum, scale));
        }
        x0 += LANES;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The operand orders are permutations of the head dim.
    #[test]
    fn orders_are_permutations() {
        for d in [128, 256] {
            let mut seen = vec![false; d];
            for t in 0..d / 128 {
                for r in 0..4 {
                    for w in 0..32 {
                        seen[q4_dim(t, r, w)] = true;
                    }
                }
            }
            assert!(seen.iter().all(|&s| s), "d={d}");
        }
        let mut seen = [false; 64];
        for e in 0..64 {
            seen[v_position(e)] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }
}
