//! Decode's scores over a 4-bit K cache by integer dot products (AVX512-VNNI `vpdpbusd`: 64 byte
//! products an instruction, at the FMA's rate on the Xeons measured) for bf16 queries,
//! where decode.rs's general path dequantizes every code to f32 and takes 16 products per FMA and
//! a horizontal sum per key and state.
//!
//! Keys in lanes: 16 keys' rows of codes are transposed in registers (a 16 x 16 transpose of their
//! 32-bit words), so that lane x of word vector m holds key x's codes of dims 8m .. 8m + 7; its low
//! nibbles (dims 8m, 8m + 2, .., as bytes) and its high ones (8m + 1, ..) meet q's digits of those
//! dims, broadcast, and each lane sums its own key: no horizontal sum. Per group G of the head dim:
//!   s[st, x] = scale2 · sum_G ( s_G(x) · 2^-e · sum_{d in G} c[x, d] q16[st, d] + b_G(x) · qs_G[st] )
//! with q16 = q · 2^e rounded to an integer (|q16| <= 2^14, e per state and group: the group's
//! largest |q| at [2^13, 2^14)), split into two signed bytes q16 = 256 h + l (l in [-128, 127], h in
//! [-64, 64]) for the byte products, and qs_G the group's sum of q (f32).
//!
//! Exactness: the integer sums are exact (at most 64 · 15 · 2^14 < 2^24, so their conversion to f32
//! is exact too); q16 · 2^-e is q itself wherever q has no more significant bits than fit between
//! its own exponent and the group's largest (bf16's 8 significant bits: elements within 6 binades
//! of the group's largest), else q rounded at 2^-14 of the group's largest |q|, below the rounding
//! of the scores the f32 path adds up (the unit test compares both at 1e-4). f16 queries (11 bits:
//! exact within 3 binades only, measured past 1e-4) and f32 ones keep the f32 path.
//!
//! P V over a 4-bit V with groups of 64 by 16-bit dot products (`vpdpwssd`, 32 products an
//! instruction): per block, state and group, P s_G (the probabilities times the keys' scales) is
//! rounded to integers p16 at 2^-15 of the block's largest |P s_G| (the GPU's tensor cores round it
//! to bf16, 2^-9); two keys' p16 make a 32-bit word, against the two keys' codes of one dim, which
//! a byte permute interleaves from their rows. The integer sums, exact, go to f32 once a block with
//! the codes centred (c - 8, as the values are, so that p16's rounding multiplies |c - 8| <= 8),
//! and the bias terms sum_x P (b_G + 8 s_G) in f32. Its error is p16's rounding: ~6e-5 of o
//! norm-wise in the unit test, below a bf16 output's own rounding. The accumulators keep
//! decode_rows' 4-bit element order, so the general path's output order holds.

use std::arch::x86_64::*;

use super::decode_bf16::{in_groups, key_offsets};
use super::decode_rows::{Quant, KEY_BLOCK};
use crate::decode::{Cache, Decode};
use crate::dtype::DType;
use crate::problem::MAX_HEAD_DIM;

/// Keys per transposed tile: the lanes of a vector of 32-bit words.
const KEYS: usize = 16;
/// Word vectors of a row of D codes: D / 8 (8 codes a word).
const MAX_WORDS: usize = MAX_HEAD_DIM / 8;
/// The most groups a row has (groups of at least 32 dims).
const MAX_GROUPS: usize = MAX_HEAD_DIM / 32;
/// q16's largest magnitude is in [2^(TOP-1), 2^TOP): its digits h = (q16 - l) / 256 stay in [-64, 64].
const TOP: i32 = 14;

/// The fewest keys a task takes these products for: q's digits cost each task ~6 us (D = 128, 8 kv
/// heads, 4 states), ~6 ns a key and kv head saved (one core of the development VM: 64 keys 28 ->
/// 34 us, 256 keys 72 -> 68).
pub(crate) const MIN_KEYS: usize = 128;

/// Whether this file's scores take the call: bf16 q over a 4-bit K cache with D a multiple of 64
/// (whole words of 8 codes per vector lane, groups whole words) on a CPU with AVX512-VNNI
/// ([`available`]); the caller checks its task's keys against [`MIN_KEYS`].
pub(crate) fn usable(p: &Decode, k: &Cache) -> bool {
    let k4 = matches!(k, Cache::Quant { fmt, .. } if fmt.bits == 4);
    p.dtype == DType::BF16 && k4 && p.head_dim.is_multiple_of(64) && available()
}

/// AVX512-VNNI, -BW and -VBMI (the byte permute: Cascade and Cooper Lake have VNNI without it and
/// keep the f32 path), and not switched off by FLASH_NIF_CPU_VNNI=0 (read once).
pub(crate) fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        let off = std::env::var("FLASH_NIF_CPU_VNNI").is_ok_and(|v| v.trim() == "0");
        let isa = std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512bw") && std::is_x86_feature_detected!("avx512vbmi");
        !off && isa
    })
}

/// The power of two f with max · f in [2^(top-1), 2^top) (max > 0, finite), from max's binary
/// exponent (in f64, where every f32, subnormal ones too, is normal).
fn scale_into(max: f32, top: i32) -> f64 {
    let exp = ((max as f64).to_bits() >> 52) as i32 - 1023;
    f64::from_bits(((1023 + top - 1 - exp) as u64) << 52)
}

/// Whether [`accumulate_q4`] takes the call's P V: bf16 q (as [`usable`]) over a 4-bit V cache with D
/// a multiple of 64 and groups of 64 (groups of 32 pay twice the per-block work of turning P s_G
/// into words: measured slower than the f32 path, bench/RESULTS.md), on a CPU with [`available`]'s
/// instructions.
pub(crate) fn usable_v(p: &Decode, v: &Cache) -> bool {
    let v4 = matches!(v, Cache::Quant { fmt, .. } if fmt.bits == 4 && fmt.group_size >= 64);
    p.dtype == DType::BF16 && v4 && p.head_dim.is_multiple_of(64) && available()
}

/// One task's queries as the byte products take them, for every kv head and state.
pub(crate) struct Query {
    states: usize,
    words: usize,  // D / 8
    groups: usize, // D / group size
    gs: usize,
    /// `[Hkv, states, words, 4]`: q's digits of word m's dims, 4 signed bytes each: h of the even
    /// dims (8m, 8m + 2, 8m + 4, 8m + 6), h of the odd ones, l of the even, l of the odd.
    digits: Vec<u32>,
    /// `[Hkv, states, groups]`: 2^-e.
    unit: Vec<f32>,
    /// `[Hkv, states, groups]`: the group's sum of q.
    qsum: Vec<f32>,
}

impl Query {
    /// q of (kv head, state) is row `row(kv, st)` of `q` (rows of D elements in p's dtype).
    pub(crate) fn new(p: &Decode, q: &[u8], k: &Cache, row: impl Fn(usize, usize) -> usize) -> Query {
        let Cache::Quant { fmt, .. } = k else { unreachable!("decode_vnni::usable takes quantized K caches only") };
        let (d, hkv) = (p.head_dim, p.kv_heads);
        let states = p.heads / hkv * p.seq_q;
        let (gs, groups, words) = (fmt.group_size, fmt.groups(), d / 8);
        let mut digits = vec![0u32; hkv * states * words * 4];
        let (mut unit, mut qsum) = (vec![0f32; hkv * states * groups], vec![0f32; hkv * states * groups]);
        let mut x = [0f32; MAX_HEAD_DIM];
        for kv in 0..hkv {
            for st in 0..states {
                p.dtype.load(q, row(kv, st) * d, &mut x[..d]);
                let at = kv * states + st;
                let dg = &mut digits[at * words * 4..][..words * 4];
                for g in 0..groups {
                    let xs = &x[g * gs..][..gs];
                    // The sum and the largest |q| in 16 independent lanes (the compiler vectorises
                    // them; one chain each would wait on every add), then across the lanes.
                    let (mut sum, mut big) = ([0f32; 16], [0f32; 16]);
                    for chunk in xs.chunks_exact(16) {
                        for i in 0..16 {
                            sum[i] += chunk[i];
                            let a = chunk[i].abs();
                            // (a NaN q may drop out of the maximum; it reaches the scores
                            // through qs_G, the group's sum)
                            big[i] = if big[i] >= a { big[i] } else { a };
                        }
                    }
                    qsum[at * groups + g] = sum.iter().sum();
                    let max = big.iter().fold(0f32, |m, &a| if m >= a { m } else { a });
                    if max == 0.0 || !max.is_finite() {
                        // Digits 0; an infinite q gives NaN scores, as the f32 path's would.
                        unit[at * groups + g] = if max == 0.0 { 0.0 } else { f32::NAN };
                        continue;
                    }
                    // f = 2^e: max · f in [2^(TOP-1), 2^TOP).
                    let f = scale_into(max, TOP);
                    unit[at * groups + g] = (1.0 / f) as f32;
                    // q16 = q · 2^e rounded to nearest even: in f32 by the 1.5 · 2^23 shift (exact for
                    // |q16| < 2^22; 2^e a power of two, so q · 2^e is exact) where 2^e is an f32,
                    // else in f64 (q within ~2^-113 of 0).
                    let mut q16 = [0i32; MAX_HEAD_DIM];
                    if f < 2f64.powi(127) {
                        const SHIFT: f32 = 12582912.0;
                        let ff = f as f32;
                        for (o, &v) in q16.iter_mut().zip(xs) {
                            *o = ((v * ff + SHIFT) - SHIFT) as i32;
                        }
                    } else {
                        for (o, &v) in q16.iter_mut().zip(xs) {
                            *o = (v as f64 * f).round_ties_even() as i32;
                        }
                    }
                    // Each word's 8 dims: q16 = 256 h + l, bytes of the even dims' h, the odd ones' h,
                    // the even ones' l, the odd ones' l.
                    for (m, q16) in (g * gs / 8..).zip(q16[..gs].chunks_exact(8)) {
                        let mut w = [0u32; 4];
                        for (r, &q16) in q16.iter().enumerate() {
                            let l = ((q16 + 128) & 255) - 128;
                            let h = (q16 - l) >> 8;
                            w[r % 2] |= (h as u8 as u32) << (8 * (r / 2));
                            w[2 + r % 2] |= (l as u8 as u32) << (8 * (r / 2));
                        }
                        dg[4 * m..][..4].copy_from_slice(&w);
                    }
                }
            }
        }
        Query { states, words, groups, gs, digits, unit, qsum }
    }
}

/// s[st, x] = scale2 · q[st] · k[x] for kv head `kv`'s rows of the block (x < nk; the columns past
/// nk, up to the next multiple of 16, hold finite leftovers nobody reads).
#[inline(always)]
pub(crate) unsafe fn scores_q4(rows: &Quant<'_, 4>, q: &Query, kv: usize, nk: usize, scale2: f32, s: &mut [f32]) {
    assert!(s.len() == q.states * KEY_BLOCK && nk <= KEY_BLOCK && q.words <= MAX_WORDS && q.groups <= MAX_GROUPS);
    let row_bytes = q.words * 4;
    let key_at = key_offsets(rows.scale_stride());
    let mut t = [_mm512_setzero_si512(); MAX_WORDS];
    let mut x0 = 0;
    while x0 < nk {
        let n = (nk - x0).min(KEYS);
        // The 16 keys' rows (0 past nk), 64 bytes (16 words) at a time, transposed.
        for seg in 0..q.words.div_ceil(16) {
            let bytes = (row_bytes - 64 * seg).min(64);
            let mask: __mmask64 = if bytes == 64 { !0 } else { (1u64 << bytes) - 1 };
            let mut r = [_mm512_setzero_si512(); KEYS];
            for (x, r) in r.iter_mut().enumerate().take(n) {
                *r = _mm512_maskz_loadu_epi8(mask, rows.row(x0 + x).add(64 * seg) as *const i8);
            }
            transpose16(&mut r);
            let words = (bytes / 4).min(16);
            t[16 * seg..][..words].copy_from_slice(&r[..words]);
        }
        // Each group's scales and biases across the 16 keys (rows past the block's keys are read
        // but never stored: the arrays hold KEY_BLOCK keys).
        let (sc0, bi0) = rows.scales(x0);
        let mut sc = [_mm512_setzero_ps(); MAX_GROUPS];
        let mut bi = [_mm512_setzero_ps(); MAX_GROUPS];
        for g in 0..q.groups {
            sc[g] = _mm512_i32gather_ps::<4>(key_at, sc0.add(g));
            bi[g] = _mm512_i32gather_ps::<4>(key_at, bi0.add(g));
        }
        let s = s.as_mut_ptr().add(x0);
        in_groups!(8, score_group, q.states, q; kv, &t, &sc, &bi, scale2, s);
        x0 += KEYS;
    }
}

/// States st0 .. st0 + N of 16 keys: per group, the byte products of its words into two integer
/// sums per state (digits h and l), then 256 h + l to f32 times the keys' scales, plus the bias
/// terms; s points at the first key's column of state 0.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn score_group<const N: usize>(q: &Query, st0: usize, kv: usize, t: &[__m512i; MAX_WORDS], sc: &[__m512; MAX_GROUPS], bi: &[__m512; MAX_GROUPS], scale2: f32, s: *mut f32) {
    let low = _mm512_set1_epi8(0x0f);
    let base = kv * q.states + st0;
    let digits = q.digits.as_ptr().add(base * q.words * 4);
    let dg = |n: usize, m: usize, j: usize| _mm512_set1_epi32(*digits.add((n * q.words + m) * 4 + j) as i32);
    let mut acc = [_mm512_setzero_ps(); N];
    let per = q.gs / 8; // words a group
    for g in 0..q.groups {
        let (mut h, mut l) = ([_mm512_setzero_si512(); N], [_mm512_setzero_si512(); N]);
        for m in g * per..(g + 1) * per {
            let even = _mm512_and_si512(t[m], low);
            let odd = _mm512_and_si512(_mm512_srli_epi32::<4>(t[m]), low);
            for n in 0..N {
                h[n] = _mm512_dpbusd_epi32(h[n], even, dg(n, m, 0));
                h[n] = _mm512_dpbusd_epi32(h[n], odd, dg(n, m, 1));
                l[n] = _mm512_dpbusd_epi32(l[n], even, dg(n, m, 2));
                l[n] = _mm512_dpbusd_epi32(l[n], odd, dg(n, m, 3));
            }
        }
        for n in 0..N {
            let at = (base + n) * q.groups + g;
            let sum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32::<8>(h[n]), l[n]));
            acc[n] = _mm512_fmadd_ps(sum, _mm512_mul_ps(sc[g], _mm512_set1_ps(*q.unit.get_unchecked(at))), acc[n]);
            acc[n] = _mm512_fmadd_ps(bi[g], _mm512_set1_ps(*q.qsum.get_unchecked(at)), acc[n]);
        }
    }
    let scale = _mm512_set1_ps(scale2);
    for (n, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(s.add((st0 + n) * KEY_BLOCK), _mm512_mul_ps(*a, scale));
    }
}

/// One head's P s_G of a block as [`accumulate_q4`] takes them (scratch, reused per block).
pub(crate) struct PvWork {
    states: usize,
    d: usize,
    gs: usize,
    groups: usize,
    /// `[states, groups, KEY_BLOCK / 2]`: keys 2j and 2j + 1's p16 as a 32-bit word.
    pairs: Vec<u32>,
    /// `[states, groups]`: 1 / the factor p16 was taken at.
    unit: Vec<f32>,
    /// `[states, groups]`: sum over the block's keys of P (b_G + 8 s_G).
    bias: Vec<f32>,
    /// `[states, groups]`: 8 · the sum of the block's p16 (the codes' centre, taken off the sums).
    centre: Vec<i32>,
}

impl PvWork {
    /// For a call [`usable_v`] takes.
    pub(crate) fn new(p: &Decode, v: &Cache) -> PvWork {
        let Cache::Quant { fmt, .. } = v else { unreachable!("decode_vnni::usable_v takes quantized V caches only") };
        let (states, d, gs, groups) = (p.heads / p.kv_heads * p.seq_q, p.head_dim, fmt.group_size, fmt.groups());
        let n = states * groups;
        PvWork { states, d, gs, groups, pairs: vec![0; n * KEY_BLOCK / 2], unit: vec![0.0; n], bias: vec![0.0; n], centre: vec![0; n] }
    }
}

/// acc[st] = alpha[st] · acc[st] + sum over x < nk of p[st, x] · v[x] for kv head's 4-bit V rows of
/// the block (D = 64 · halves, w's shapes); p `[states, KEY_BLOCK]`, acc `[D / 16, states, 16]` in
/// decode_rows' 4-bit order (vector 2c: block c of 32 dims' even dims, 2c + 1 its odd ones).
#[inline(always)]
pub(crate) unsafe fn accumulate_q4(rows: &Quant<'_, 4>, p: &[f32], alpha: &[f32], nk: usize, acc: &mut [f32], w: &mut PvWork) {
    let (states, d, groups) = (w.states, w.d, w.groups);
    assert!(p.len() == states * KEY_BLOCK && alpha.len() == states && acc.len() == d / 16 * states * 16 && nk <= KEY_BLOCK && nk > 0);
    assert!(d.is_multiple_of(64));
    // The P s_G words, their units and the bias terms, per state and group.
    let stride = rows.scale_stride();
    let key_at = key_offsets(stride);
    let (sc0, bi0) = rows.scales(0);
    // The block's keys among the first 16 and the next.
    let (k0, k1) = (((1u32 << nk.min(16)) - 1) as __mmask16, ((1u32 << nk.saturating_sub(16)) - 1) as __mmask16);
    for g in 0..groups {
        // (rows past the block's keys are read but their P is 0: the arrays hold KEY_BLOCK keys)
        let sc = [_mm512_i32gather_ps::<4>(key_at, sc0.add(g)), _mm512_i32gather_ps::<4>(key_at, sc0.add(16 * stride + g))];
        let bi = [_mm512_i32gather_ps::<4>(key_at, bi0.add(g)), _mm512_i32gather_ps::<4>(key_at, bi0.add(16 * stride + g))];
        for st in 0..states {
            let pr = p.as_ptr().add(st * KEY_BLOCK);
            let pp = [_mm512_maskz_loadu_ps(k0, pr), _mm512_maskz_loadu_ps(k1, pr.add(16))];
            let ps = [_mm512_mul_ps(pp[0], sc[0]), _mm512_mul_ps(pp[1], sc[1])];
            let at = st * groups + g;
            // Codes centred (c - 8, as the values are: P s_G's rounding then multiplies |c - 8| <= 8):
            // the bias terms take P (b + 8 s_G).
            let eight = _mm512_set1_ps(8.0);
            w.bias[at] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_fmadd_ps(ps[0], eight, _mm512_mul_ps(pp[0], bi[0])), _mm512_fmadd_ps(ps[1], eight, _mm512_mul_ps(pp[1], bi[1]))));
            let max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(ps[0]), _mm512_abs_ps(ps[1])));
            let words = w.pairs.as_mut_ptr().add(at * KEY_BLOCK / 2);
            if max == 0.0 || !max.is_finite() {
                // No weight (p16 = 0), or a NaN / infinite one: NaN sums, as the f32 path's.
                w.unit[at] = if max == 0.0 { 0.0 } else { f32::NAN };
                w.centre[at] = 0;
                std::ptr::write_bytes(words, 0, KEY_BLOCK / 2);
                continue;
            }
            // max · f in [2^14, 2^15): p16 within i16.
            let f = scale_into(max, 15);
            w.unit[at] = (1.0 / f) as f32;
            let fv = _mm512_set1_ps(f as f32);
            let top = _mm512_set1_epi32(32767);
            let mut sum = _mm512_setzero_si512();
            for (half, ps) in ps.iter().enumerate() {
                let p16 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(*ps, fv)), _mm512_sub_epi32(_mm512_setzero_si512(), top)), top);
                sum = _mm512_add_epi32(sum, p16);
                _mm256_storeu_si256(words.add(8 * half) as *mut __m256i, _mm512_cvtepi32_epi16(p16));
            }
            w.centre[at] = 8 * _mm512_reduce_add_epi32(sum);
        }
    }
    let (acc, alpha, w) = (acc.as_mut_ptr(), alpha.as_ptr(), &*w);
    in_groups!(4, accumulate_group, states, rows; w, alpha, nk, acc);
}

/// States st0 .. st0 + N of [`accumulate_q4`], 64 dims at a time: per key pair, the two rows' 32
/// bytes of those dims interleaved into words (key 2j's code, key 2j + 1's) by two byte permutes,
/// low and high nibbles apart, against each state's P s_G word.
#[inline(always)]
unsafe fn accumulate_group<const N: usize>(rows: &Quant<'_, 4>, st0: usize, w: &PvWork, alpha: *const f32, nk: usize, acc: *mut f32) {
    let (states, d, gs, groups) = (w.states, w.d, w.gs, w.groups);
    // Output byte 4i takes byte i (+ 16 r) of the first row, byte 4i + 2 byte i (+ 16 r) of the
    // second (index 64 + ..); bytes 4i + 1 and 4i + 3 are zeroed by the mask.
    let idx = |r: i32| _mm512_set_epi32(
        ((64 + 15 + r) << 16) | (15 + r), ((64 + 14 + r) << 16) | (14 + r), ((64 + 13 + r) << 16) | (13 + r), ((64 + 12 + r) << 16) | (12 + r),
        ((64 + 11 + r) << 16) | (11 + r), ((64 + 10 + r) << 16) | (10 + r), ((64 + 9 + r) << 16) | (9 + r), ((64 + 8 + r) << 16) | (8 + r),
        ((64 + 7 + r) << 16) | (7 + r), ((64 + 6 + r) << 16) | (6 + r), ((64 + 5 + r) << 16) | (5 + r), ((64 + 4 + r) << 16) | (4 + r),
        ((64 + 3 + r) << 16) | (3 + r), ((64 + 2 + r) << 16) | (2 + r), ((64 + 1 + r) << 16) | (1 + r), ((64 + r) << 16) | r,
    );
    let (idx0, idx1) = (idx(0), idx(16));
    const BYTES: __mmask64 = 0x5555_5555_5555_5555;
    let low = _mm512_set1_epi32(0x000f_000f);
    let pairs = nk.div_ceil(2);
    for half in 0..d / 64 {
        // Vectors 4 half + z, z = 2 r + parity (dims 64 half + 32 r + 2 i + parity): group of each.
        let g = [(64 * half) / gs, (64 * half + 32) / gs];
        let mut a = [[_mm512_setzero_si512(); 4]; N];
        for j in 0..pairs {
            let r0 = _mm512_castsi256_si512(_mm256_loadu_si256(rows.row(2 * j).add(32 * half) as *const __m256i));
            let r1 = if 2 * j + 1 < nk { _mm512_castsi256_si512(_mm256_loadu_si256(rows.row(2 * j + 1).add(32 * half) as *const __m256i)) } else { _mm512_setzero_si512() };
            let b0 = _mm512_maskz_permutex2var_epi8(BYTES, r0, idx0, r1);
            let b1 = _mm512_maskz_permutex2var_epi8(BYTES, r0, idx1, r1);
            let codes = [
                _mm512_and_si512(b0, low),
                _mm512_and_si512(_mm512_srli_epi32::<4>(b0), low),
                _mm512_and_si512(b1, low),
                _mm512_and_si512(_mm512_srli_epi32::<4>(b1), low),
            ];
            for (n, a) in a.iter_mut().enumerate() {
                let words = w.pairs.as_ptr().add((st0 + n) * groups * KEY_BLOCK / 2 + j);
                let pw = [_mm512_set1_epi32(*words.add(g[0] * KEY_BLOCK / 2) as i32), _mm512_set1_epi32(*words.add(g[1] * KEY_BLOCK / 2) as i32)];
                for (z, a) in a.iter_mut().enumerate() {
                    *a = _mm512_dpwssd_epi32(*a, codes[z], pw[z / 2]);
                }
            }
        }
        for (n, a) in a.iter().enumerate() {
            let st = st0 + n;
            let al = _mm512_set1_ps(*alpha.add(st));
            for (z, a) in a.iter().enumerate() {
                let at = st * groups + g[z / 2];
                let o = acc.add(((4 * half + z) * states + st) * 16);
                let kept = _mm512_fmadd_ps(_mm512_loadu_ps(o), al, _mm512_set1_ps(*w.bias.get_unchecked(at)));
                // sum p16 (c - 8): exact in i32, and in f32 (|.| <= 32 · 2^15 · 8 = 2^23).
                let sum = _mm512_sub_epi32(*a, _mm512_set1_epi32(*w.centre.get_unchecked(at)));
                _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(*w.unit.get_unchecked(at)), kept));
            }
        }
    }
}

/// r[x] (lane m: word m of key x's row) becomes r[m] (lane x: the same word).
#[inline(always)]
unsafe fn transpose16(r: &mut [__m512i; KEYS]) {
    // Pairs of keys: per 128-bit lane L, words 4L, 4L + 1 (a) and 4L + 2, 4L + 3 (b) of both.
    let mut a = [_mm512_setzero_si512(); 8];
    let mut b = [_mm512_setzero_si512(); 8];
    for p in 0..8 {
        a[p] = _mm512_unpacklo_epi32(r[2 * p], r[2 * p + 1]);
        b[p] = _mm512_unpackhi_epi32(r[2 * p], r[2 * p + 1]);
    }
    // Quads of keys: u[qd][j], per 128-bit lane L, word 4L + j of keys 4qd .. 4qd + 3.
    let mut u = [[_mm512_setzero_si512(); 4]; 4];
    for qd in 0..4 {
        let (p, p1) = (2 * qd, 2 * qd + 1);
        u[qd] = [
            _mm512_unpacklo_epi64(a[p], a[p1]),
            _mm512_unpackhi_epi64(a[p], a[p1]),
            _mm512_unpacklo_epi64(b[p], b[p1]),
            _mm512_unpackhi_epi64(b[p], b[p1]),
        ];
    }
    // Word 4L + j of all 16 keys: 128-bit lane L of u[0][j], .., u[3][j], side by side.
    for j in 0..4 {
        let lo01 = _mm512_shuffle_i32x4::<0x44>(u[0][j], u[1][j]);
        let hi01 = _mm512_shuffle_i32x4::<0xee>(u[0][j], u[1][j]);
        let lo23 = _mm512_shuffle_i32x4::<0x44>(u[2][j], u[3][j]);
        let hi23 = _mm512_shuffle_i32x4::<0xee>(u[2][j], u[3][j]);
        r[j] = _mm512_shuffle_i32x4::<0x88>(lo01, lo23);
        r[4 + j] = _mm512_shuffle_i32x4::<0xdd>(lo01, lo23);
        r[8 + j] = _mm512_shuffle_i32x4::<0x88>(hi01, hi23);
        r[12 + j] = _mm512_shuffle_i32x4::<0xdd>(hi01, hi23);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[target_feature(enable = "avx512f")]
    unsafe fn transposed() -> [[u32; 16]; 16] {
        let mut r = [_mm512_setzero_si512(); KEYS];
        for (x, r) in r.iter_mut().enumerate() {
            let row: [u32; 16] = std::array::from_fn(|m| (100 * x + m) as u32);
            *r = _mm512_loadu_si512(row.as_ptr() as *const __m512i);
        }
        transpose16(&mut r);
        r.map(|v| {
            let mut out = [0u32; 16];
            _mm512_storeu_si512(out.as_mut_ptr() as *mut __m512i, v);
            out
        })
    }

    /// Lane x of word vector m is word m of key x.
    #[test]
    fn transpose_puts_keys_in_lanes() {
        if !std::is_x86_feature_detected!("avx512f") {
            return;
        }
        // SAFETY: AVX-512F checked above.
        let t = unsafe { transposed() };
        for (m, lanes) in t.iter().enumerate() {
            for (x, &w) in lanes.iter().enumerate() {
                assert_eq!(w, (100 * x + m) as u32, "word {m} lane {x}");
            }
        }
    }

    /// The digits put back together give q · 2^e, within half a unit, in range.
    #[test]
    fn digits_rebuild_q() {
        let d = 128;
        let p = Decode {
            dtype: DType::BF16, batch: 1, seq_q: 1, s_cache: 1, heads: 2, kv_heads: 1, head_dim: d, causal: false, scale: 1.0,
            left: None, right: None, softcap: None, num_splits: None,
        };
        let fmt = crate::quant::QuantFormat::new(4, 64, d).unwrap();
        let k = Cache::Quant { fmt, values: &[], scales: &[], biases: &[] };
        // State 0: a spread of magnitudes (group 0) and zeros (group 1); state 1: negatives and a
        // value exactly at a power of two.
        let xs: Vec<f32> = (0..2 * d).map(|i| match (i / d, i % d) {
            (0, j) if j < 64 => (j as f32 - 31.5) * 2f32.powi(j as i32 % 9 - 4),
            (0, _) => 0.0,
            (_, j) => -(j as f32) / 7.0 + if j == 5 { 64.0 } else { 0.0 },
        }).collect();
        let mut q = vec![0u8; xs.len() * 2];
        DType::BF16.store(&xs, &mut q, 0);
        let mut back = vec![0f32; xs.len()];
        DType::BF16.load(&q, 0, &mut back);
        let qv = Query::new(&p, &q, &k, |_, st| st);
        for st in 0..2 {
            for dim in 0..d {
                let (m, r) = (dim / 8, dim % 8);
                let word = |j: usize| qv.digits[((st * qv.words) + m) * 4 + j];
                let byte = |w: u32| (w >> (8 * (r / 2))) as u8 as i8 as i32;
                let (h, l) = (byte(word(r % 2)), byte(word(2 + r % 2)));
                assert!((-64..=64).contains(&h), "h {h}");
                let unit = qv.unit[st * qv.groups + dim / 64];
                let want = back[st * d + dim];
                let got = (256 * h + l) as f32 * unit;
                assert!((got - want).abs() <= unit * 0.5, "state {st} dim {dim}: {got} vs {want}");
            }
        }
        assert_eq!(qv.unit[1], 0.0);
    }
}
