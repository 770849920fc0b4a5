//! One SIMD register type per instruction set (AVX-512, AVX2+FMA, and a 1-lane scalar
//! fallback), so the micro-kernel and the softmax are written once, generically, and compiled
//! inside `#[target_feature]` functions for each set.

/// exp2 on the range the kernels need: round-to-nearest split 2^x = 2^n · 2^f with a degree-6
/// polynomial for 2^f on [-0.5, 0.5] (relative error < 2e-7). x < -126 gives exactly 0 (masked
/// -inf scores vanish); NaN stays NaN. Coefficients are the classic minimax set for 2^f.
const EXP2_POLY: [f32; 6] = [1.535_336_2e-4, 1.339_887_4e-3, 9.618_437_4e-3, 5.550_332_5e-2, 2.402_264_8e-1, 6.931_472e-1];
const EXP2_MIN: f32 = -126.0;
const EXP2_MAX: f32 = 127.0;

#[inline(always)]
pub fn exp2_scalar(x: f32) -> f32 {
    let xc = if x > EXP2_MAX { EXP2_MAX } else { x };
    let xc = if xc < EXP2_MIN { EXP2_MIN } else { xc };
    let n = xc.round_ties_even();
    let f = xc - n;
    let mut p = EXP2_POLY[0];
    for c in &EXP2_POLY[1..] {
        p = p * f + c;
    }
    p = p * f + 1.0;
    let pow2n = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < EXP2_MIN {
        0.0
    } else {
        p * pow2n
    }
}

pub trait Vector: Copy {
    const LANES: usize;
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(self, p: *mut f32);
    /// self + a * b
    unsafe fn fma(self, a: Self, b: Self) -> Self;
    unsafe fn add(self, b: Self) -> Self;
    unsafe fn sub(self, b: Self) -> Self;
    unsafe fn mul(self, b: Self) -> Self;
    unsafe fn div(self, b: Self) -> Self;
    unsafe fn abs(self) -> Self;
    /// Lane-wise `if self < t { a } else { b }`.
    unsafe fn select_lt(self, t: Self, a: Self, b: Self) -> Self;
    /// Lane-wise max; a NaN lane in `self` is ignored (the kernels let NaN reach the output
    /// through exp2 instead).
    unsafe fn max(self, b: Self) -> Self;
    unsafe fn exp2(self) -> Self;
    /// The largest lane; NaN lanes are skipped (all NaN: -inf).
    unsafe fn reduce_max(self) -> f32;
    unsafe fn reduce_add(self) -> f32;
    /// `x` holds LANES vectors; lane i of the result is the sum of x[i]'s lanes (LANES dot
    /// products finished at once: a transpose and add tree, not LANES reduce_adds).
    unsafe fn sum_each(x: &[Self]) -> Self;
    /// LANES bf16 values at `p` (any alignment), widened.
    unsafe fn load_bf16(p: *const u8) -> Self;
    /// LANES f16 values at `p` (any alignment), widened.
    unsafe fn load_f16(p: *const u8) -> Self;
    /// LANES bytes at `p` as unsigned integers.
    unsafe fn load_u8(p: *const u8) -> Self;
    /// LANES bytes at `p`: their low nibbles and their high nibbles as unsigned integers.
    unsafe fn load_u4(p: *const u8) -> (Self, Self);
    /// 2·LANES bf16 at `p` (any alignment), widened: (the even elements, the odd ones) — one
    /// shift and one mask where a widening load per LANES would take two operations each.
    unsafe fn load_bf16_pair(p: *const u8) -> (Self, Self);
    /// [`load_u4`](Vector::load_u4)'s nibbles dequantized: `bias + code · scale` (one rounding).
    #[inline(always)]
    unsafe fn load_u4_dequant(p: *const u8, scale: Self, bias: Self) -> (Self, Self) {
        let (lo, hi) = Self::load_u4(p);
        (bias.fma(lo, scale), bias.fma(hi, scale))
    }
}

/// The 1-lane fallback for machines without AVX2.
#[derive(Clone, Copy)]
pub struct Scalar(f32);

impl Vector for Scalar {
    const LANES: usize = 1;
    #[inline(always)]
    unsafe fn zero() -> Self {
        Scalar(0.0)
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Scalar(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Scalar(*p)
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        *p = self.0
    }
    #[inline(always)]
    unsafe fn fma(self, a: Self, b: Self) -> Self {
        Scalar(self.0 + a.0 * b.0)
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        Scalar(self.0 + b.0)
    }
    #[inline(always)]
    unsafe fn sub(self, b: Self) -> Self {
        Scalar(self.0 - b.0)
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        Scalar(self.0 * b.0)
    }
    #[inline(always)]
    unsafe fn div(self, b: Self) -> Self {
        Scalar(self.0 / b.0)
    }
    #[inline(always)]
    unsafe fn abs(self) -> Self {
        Scalar(self.0.abs())
    }
    #[inline(always)]
    unsafe fn select_lt(self, t: Self, a: Self, b: Self) -> Self {
        if self.0 < t.0 {
            a
        } else {
            b
        }
    }
    #[inline(always)]
    unsafe fn max(self, b: Self) -> Self {
        Scalar(if self.0 > b.0 { self.0 } else { b.0 })
    }
    #[inline(always)]
    unsafe fn exp2(self) -> Self {
        Scalar(exp2_scalar(self.0))
    }
    #[inline(always)]
    unsafe fn reduce_max(self) -> f32 {
        if self.0.is_nan() {
            f32::NEG_INFINITY // as the vectors' reductions: NaN lanes skipped
        } else {
            self.0
        }
    }
    #[inline(always)]
    unsafe fn reduce_add(self) -> f32 {
        self.0
    }
    #[inline(always)]
    unsafe fn sum_each(x: &[Self]) -> Self {
        x[0]
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u8) -> Self {
        Scalar(f32::from_bits((u16::from_ne_bytes([*p, *p.add(1)]) as u32) << 16))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> Self {
        Scalar(crate::dtype::f16_to_f32(u16::from_ne_bytes([*p, *p.add(1)])))
    }
    #[inline(always)]
    unsafe fn load_u8(p: *const u8) -> Self {
        Scalar(*p as f32)
    }
    #[inline(always)]
    unsafe fn load_u4(p: *const u8) -> (Self, Self) {
        (Scalar((*p & 15) as f32), Scalar((*p >> 4) as f32))
    }
    #[inline(always)]
    unsafe fn load_bf16_pair(p: *const u8) -> (Self, Self) {
        (Self::load_bf16(p), Self::load_bf16(p.add(2)))
    }
}

#[cfg(target_arch = "x86_64")]
pub mod x86 {
    use super::{Vector, EXP2_MAX, EXP2_MIN, EXP2_POLY};
    use std::arch::x86_64::*;

    const ROUND_NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    #[derive(Clone, Copy)]
    pub struct Avx512(__m512);
    #[derive(Clone, Copy)]
    pub struct Avx2(__m256);

    impl Avx512 {
        /// The register as it is, and back (for code that needs intrinsics this type lacks).
        #[inline(always)]
        pub fn from_raw(x: __m512) -> Self {
            Avx512(x)
        }
        #[inline(always)]
        pub fn raw(self) -> __m512 {
            self.0
        }

        /// self + the products of the 32 bf16 values at `a` and at `b` in pairs: lane i adds
        /// a[2i] b[2i] + a[2i + 1] b[2i + 1] (AVX512-BF16 `vdpbf16ps`: exact products, f32 sums,
        /// subnormal inputs and results flushed to zero).
        #[inline]
        #[target_feature(enable = "avx512f,avx512bf16")]
        pub unsafe fn dot_bf16(self, a: *const u8, b: *const u8) -> Self {
            let (a, b) = (_mm512_loadu_si512(a as *const __m512i), _mm512_loadu_si512(b as *const __m512i));
            Avx512(_mm512_dpbf16_ps(self.0, std::mem::transmute::<__m512i, __m512bh>(a), std::mem::transmute::<__m512i, __m512bh>(b)))
        }

        /// self + in lane i, for the 32 bf16 `a` (as 16 pairs) and one pair `w` (two bf16 in a
        /// u32): a[2i] w.lo + a[2i + 1] w.hi (`vdpbf16ps` against `w` broadcast).
        #[inline]
        #[target_feature(enable = "avx512f,avx512bf16")]
        pub unsafe fn dot_bf16_pair(self, a: __m512i, w: u32) -> Self {
            let w = _mm512_set1_epi32(w as i32);
            Avx512(_mm512_dpbf16_ps(self.0, std::mem::transmute::<__m512i, __m512bh>(a), std::mem::transmute::<__m512i, __m512bh>(w)))
        }
    }

    /// The 32 bf16 at `a` and the 32 at `b` interleaved: (lo, hi), where per 128-bit block j lo
    /// holds pairs (a[8j + m], b[8j + m]) and hi (a[8j + 4 + m], b[8j + 4 + m]), m < 4.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn interleave_bf16(a: *const u8, b: *const u8) -> (__m512i, __m512i) {
        let (a, b) = (_mm512_loadu_si512(a as *const __m512i), _mm512_loadu_si512(b as *const __m512i));
        (_mm512_unpacklo_epi16(a, b), _mm512_unpackhi_epi16(a, b))
    }

    /// 32 f32 (lo, hi: 16 each) to 32 bf16, rounded to nearest even, lo's first: element pairs
    /// (x[2i], x[2i + 1]) as the u32 words of `out`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn to_bf16_pairs(lo: Avx512, hi: Avx512, out: *mut u32) {
        _mm512_storeu_si512(out as *mut __m512i, std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi.0, lo.0)));
    }

    impl Vector for Avx512 {
        const LANES: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> Self {
            Avx512(_mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Avx512(_mm512_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Avx512(_mm512_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm512_storeu_ps(p, self.0)
        }
        #[inline(always)]
        unsafe fn fma(self, a: Self, b: Self) -> Self {
            Avx512(_mm512_fmadd_ps(a.0, b.0, self.0))
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            Avx512(_mm512_add_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn sub(self, b: Self) -> Self {
            Avx512(_mm512_sub_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            Avx512(_mm512_mul_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn div(self, b: Self) -> Self {
            Avx512(_mm512_div_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn abs(self) -> Self {
            Avx512(_mm512_abs_ps(self.0))
        }
        #[inline(always)]
        unsafe fn select_lt(self, t: Self, a: Self, b: Self) -> Self {
            Avx512(_mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(self.0, t.0), b.0, a.0))
        }
        #[inline(always)]
        unsafe fn max(self, b: Self) -> Self {
            // MAXPS returns its second operand when either is NaN.
            Avx512(_mm512_max_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn exp2(self) -> Self {
            let x = self.0;
            // max/min return the second operand on NaN: keep x second so NaN survives.
            let xc = _mm512_min_ps(_mm512_set1_ps(EXP2_MAX), _mm512_max_ps(_mm512_set1_ps(EXP2_MIN), x));
            let n = _mm512_roundscale_ps::<ROUND_NEAREST>(xc);
            let f = _mm512_sub_ps(xc, n);
            let mut p = _mm512_set1_ps(EXP2_POLY[0]);
            for &c in &EXP2_POLY[1..] {
                p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
            }
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0));
            let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)));
            let r = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
            let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP2_MIN));
            Avx512(_mm512_mask_blend_ps(below, r, _mm512_setzero_ps()))
        }
        #[inline(always)]
        unsafe fn reduce_max(self) -> f32 {
            // NaN lanes as -inf (the max of the others, as a scalar fold skipping NaN), then a
            // halving tree: four steps, where the fold was a chain of sixteen (online_softmax).
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(self.0, self.0);
            _mm512_reduce_max_ps(_mm512_mask_blend_ps(nan, self.0, _mm512_set1_ps(f32::NEG_INFINITY)))
        }
        #[inline(always)]
        unsafe fn reduce_add(self) -> f32 {
            _mm512_reduce_add_ps(self.0)
        }
        #[inline(always)]
        unsafe fn sum_each(x: &[Self]) -> Self {
            assert!(x.len() == 16);
            // Four halving steps (128-bit blocks across a pair, then blocks, then lanes within
            // blocks) leave sum(x[4j + k]) in lane 4k + j: read the inputs in that order.
            // (Loops, not closures: a closure might not inline into the caller's target features.)
            const fn input(m: usize) -> usize {
                (m % 4) * 4 + m / 4
            }
            let mut y = [_mm512_setzero_ps(); 8];
            for (i, y) in y.iter_mut().enumerate() {
                let (a, b) = (x[input(2 * i)].0, x[input(2 * i + 1)].0);
                *y = _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(a, b), _mm512_shuffle_f32x4::<0xEE>(a, b));
            }
            let mut z = [_mm512_setzero_ps(); 4];
            for (i, z) in z.iter_mut().enumerate() {
                let (c, d) = (y[2 * i], y[2 * i + 1]);
                *z = _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(c, d), _mm512_shuffle_f32x4::<0xDD>(c, d));
            }
            let mut w = [_mm512_setzero_ps(); 2];
            for (i, w) in w.iter_mut().enumerate() {
                let (e, f) = (z[2 * i], z[2 * i + 1]);
                *w = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(e, f), _mm512_shuffle_ps::<0xEE>(e, f));
            }
            Avx512(_mm512_add_ps(_mm512_shuffle_ps::<0x88>(w[0], w[1]), _mm512_shuffle_ps::<0xDD>(w[0], w[1])))
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u8) -> Self {
            let x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            Avx512(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(x)))
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u8) -> Self {
            Avx512(_mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)))
        }
        #[inline(always)]
        unsafe fn load_u8(p: *const u8) -> Self {
            Avx512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))))
        }
        #[inline(always)]
        unsafe fn load_u4(p: *const u8) -> (Self, Self) {
            let x = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
            let lo = _mm512_and_si512(x, _mm512_set1_epi32(15));
            (Avx512(_mm512_cvtepi32_ps(lo)), Avx512(_mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(x))))
        }
        #[inline(always)]
        unsafe fn load_bf16_pair(p: *const u8) -> (Self, Self) {
            // Little-endian: 32-bit word i holds element 2i in its low half, 2i + 1 in its high.
            let x = _mm512_loadu_si512(p as *const __m512i);
            let odd = _mm512_and_si512(x, _mm512_set1_epi32(0xffff_0000u32 as i32));
            (Avx512(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(x))), Avx512(_mm512_castsi512_ps(odd)))
        }
        /// By a 16-entry table per call (`bias + c · scale` for c < 16, the same fma per entry as
        /// per element): a nibble indexes it directly (`vpermps` reads an index's low 4 bits).
        #[inline(always)]
        unsafe fn load_u4_dequant(p: *const u8, scale: Self, bias: Self) -> (Self, Self) {
            let x = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
            let codes = _mm512_set_ps(15.0, 14.0, 13.0, 12.0, 11.0, 10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0);
            let table = _mm512_fmadd_ps(codes, scale.0, bias.0);
            (Avx512(_mm512_permutexvar_ps(x, table)), Avx512(_mm512_permutexvar_ps(_mm512_srli_epi32::<4>(x), table)))
        }
    }

    impl Vector for Avx2 {
        const LANES: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> Self {
            Avx2(_mm256_setzero_ps())
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Avx2(_mm256_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Avx2(_mm256_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm256_storeu_ps(p, self.0)
        }
        #[inline(always)]
        unsafe fn fma(self, a: Self, b: Self) -> Self {
            Avx2(_mm256_fmadd_ps(a.0, b.0, self.0))
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            Avx2(_mm256_add_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn sub(self, b: Self) -> Self {
            Avx2(_mm256_sub_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            Avx2(_mm256_mul_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn div(self, b: Self) -> Self {
            Avx2(_mm256_div_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn abs(self) -> Self {
            Avx2(_mm256_andnot_ps(_mm256_set1_ps(-0.0), self.0))
        }
        #[inline(always)]
        unsafe fn select_lt(self, t: Self, a: Self, b: Self) -> Self {
            Avx2(_mm256_blendv_ps(b.0, a.0, _mm256_cmp_ps::<_CMP_LT_OQ>(self.0, t.0)))
        }
        #[inline(always)]
        unsafe fn max(self, b: Self) -> Self {
            Avx2(_mm256_max_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn exp2(self) -> Self {
            let x = self.0;
            let xc = _mm256_min_ps(_mm256_set1_ps(EXP2_MAX), _mm256_max_ps(_mm256_set1_ps(EXP2_MIN), x));
            let n = _mm256_round_ps::<ROUND_NEAREST>(xc);
            let f = _mm256_sub_ps(xc, n);
            let mut p = _mm256_set1_ps(EXP2_POLY[0]);
            for &c in &EXP2_POLY[1..] {
                p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
            }
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0));
            let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
            let r = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
            let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP2_MIN));
            Avx2(_mm256_andnot_ps(below, r))
        }
        #[inline(always)]
        unsafe fn reduce_max(self) -> f32 {
            // NaN lanes as -inf, then a halving tree (as the AVX-512 one).
            let x = _mm256_blendv_ps(self.0, _mm256_set1_ps(f32::NEG_INFINITY), _mm256_cmp_ps::<_CMP_UNORD_Q>(self.0, self.0));
            let h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
            let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps::<0b01>(h, h)))
        }
        #[inline(always)]
        unsafe fn reduce_add(self) -> f32 {
            let a: [f32; 8] = std::mem::transmute(self.0);
            (a[0] + a[4]) + (a[1] + a[5]) + ((a[2] + a[6]) + (a[3] + a[7]))
        }
        #[inline(always)]
        unsafe fn sum_each(x: &[Self]) -> Self {
            assert!(x.len() == 8);
            // As Avx512's, one step fewer: sum(x[2j + k]) lands in lane 4k + j.
            const fn input(m: usize) -> usize {
                (m % 2) * 4 + m / 2
            }
            let mut y = [_mm256_setzero_ps(); 4];
            for (i, y) in y.iter_mut().enumerate() {
                let (a, b) = (x[input(2 * i)].0, x[input(2 * i + 1)].0);
                *y = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(a, b), _mm256_permute2f128_ps::<0x31>(a, b));
            }
            let mut w = [_mm256_setzero_ps(); 2];
            for (i, w) in w.iter_mut().enumerate() {
                let (e, f) = (y[2 * i], y[2 * i + 1]);
                *w = _mm256_add_ps(_mm256_shuffle_ps::<0x44>(e, f), _mm256_shuffle_ps::<0xEE>(e, f));
            }
            Avx2(_mm256_add_ps(_mm256_shuffle_ps::<0x88>(w[0], w[1]), _mm256_shuffle_ps::<0xDD>(w[0], w[1])))
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u8) -> Self {
            let x = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            Avx2(_mm256_castsi256_ps(_mm256_slli_epi32::<16>(x)))
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u8) -> Self {
            // F16C: isa() reports Avx2 only where the CPU has it.
            Avx2(_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)))
        }
        #[inline(always)]
        unsafe fn load_u8(p: *const u8) -> Self {
            Avx2(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))))
        }
        #[inline(always)]
        unsafe fn load_u4(p: *const u8) -> (Self, Self) {
            let x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
            let lo = _mm256_and_si256(x, _mm256_set1_epi32(15));
            (Avx2(_mm256_cvtepi32_ps(lo)), Avx2(_mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(x))))
        }
        #[inline(always)]
        unsafe fn load_bf16_pair(p: *const u8) -> (Self, Self) {
            let x = _mm256_loadu_si256(p as *const __m256i);
            let odd = _mm256_and_si256(x, _mm256_set1_epi32(0xffff_0000u32 as i32));
            (Avx2(_mm256_castsi256_ps(_mm256_slli_epi32::<16>(x))), Avx2(_mm256_castsi256_ps(odd)))
        }
    }
}
