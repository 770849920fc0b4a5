//! Elementwise work of a tile (online softmax, probabilities and dS), vectorised by compiling the
//! same plain loops once per instruction set and picking one at run time (AVX-512, AVX2+FMA, or
//! the baseline). The loops are written with 16 independent lanes so they vectorise without
//! fast-math; every path computes in f32.

use std::sync::OnceLock;

/// exp2 over the range the kernels need (x <= ~0): round-to-nearest split into 2^n * 2^f with a
/// degree-6 polynomial for 2^f on [-0.5, 0.5] (relative error < 2e-7). x < -126 gives exactly 0
/// (so masked -inf entries vanish); NaN stays NaN.
#[inline(always)]
fn exp2(x: f32) -> f32 {
    let xc = if x > 127.0 { 127.0 } else { x };
    let xc = if xc < -126.0 { -126.0 } else { xc };
    let n = xc.round_ties_even();
    let f = xc - n;
    let p = 1.535_336_2e-4_f32;
    let p = p * f + 1.339_887_4e-3;
    let p = p * f + 9.618_437_4e-3;
    let p = p * f + 5.550_332_5e-2;
    let p = p * f + 2.402_264_8e-1;
    let p = p * f + 6.931_472e-1;
    let p = p * f + 1.0;
    let pow2n = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -126.0 {
        0.0
    } else {
        p * pow2n
    }
}

const LANES: usize = 16;

/// Maximum of a row, ignoring NaN (NaN still reaches the output through exp2).
#[inline(always)]
fn row_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &v in acc.iter().chain(rest) {
        m = if v > m { v } else { m };
    }
    m
}

/// x <- exp2(x - shift); returns the sum of the new x.
#[inline(always)]
fn exp2_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut chunks = x.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            let e = exp2(c[i] - shift);
            c[i] = e;
            acc[i] += e;
        }
    }
    let mut sum = 0.0f32;
    for v in chunks.into_remainder() {
        *v = exp2(*v - shift);
        sum += *v;
    }
    acc.iter().sum::<f32>() + sum
}

mod kernels {
    use super::*;

    /// One online-softmax step over a tile of scores in the exp2 domain.
    /// s: [rows, ld] (first `cols` columns used) -> probabilities relative to the new row max;
    /// m, l: running max and sum per row (updated); alpha: per-row factor for the output
    /// accumulator (exp2(m_old - m_new)).
    #[inline(always)]
    pub fn online_softmax(s: &mut [f32], cols: usize, ld: usize, m: &mut [f32], l: &mut [f32], alpha: &mut [f32]) {
        for r in 0..m.len() {
            let row = &mut s[r * ld..r * ld + cols];
            let mx = row_max(row);
            let m_new = if mx > m[r] { mx } else { m[r] };
            // A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
            let shift = if m_new == f32::NEG_INFINITY { 0.0 } else { m_new };
            alpha[r] = exp2(m[r] - shift);
            let sum = exp2_shifted_sum(row, shift);
            l[r] = l[r] * alpha[r] + sum;
            m[r] = m_new;
        }
    }

    /// acc[r, :] *= alpha[r]; acc: [rows, d].
    #[inline(always)]
    pub fn scale_rows(acc: &mut [f32], d: usize, alpha: &[f32]) {
        for (row, &a) in acc.chunks_exact_mut(d).zip(alpha) {
            for v in row {
                *v *= a;
            }
        }
    }

    /// Backward tile: s <- P = exp2(s - lse2[r]); dp <- dS = P * (dp - delta[r]).
    /// s, dp: [rows, ld] with `cols` columns used; lse2 is the row's log-sum-exp in log2 units
    /// (+inf for rows that see no key, which makes P = 0).
    #[inline(always)]
    pub fn probs_and_dscores(s: &mut [f32], dp: &mut [f32], cols: usize, ld: usize, lse2: &[f32], delta: &[f32]) {
        for r in 0..lse2.len() {
            let (sr, dr) = (&mut s[r * ld..r * ld + cols], &mut dp[r * ld..r * ld + cols]);
            let (shift, dl) = (lse2[r], delta[r]);
            for (x, g) in sr.iter_mut().zip(dr.iter_mut()) {
                let pr = exp2(*x - shift);
                *x = pr;
                *g = pr * (*g - dl);
            }
        }
    }
}

macro_rules! isa_module {
    ($name:ident, $features:literal) => {
        #[cfg(target_arch = "x86_64")]
        mod $name {
            #[target_feature(enable = $features)]
            pub unsafe fn online_softmax(s: &mut [f32], cols: usize, ld: usize, m: &mut [f32], l: &mut [f32], alpha: &mut [f32]) {
                super::kernels::online_softmax(s, cols, ld, m, l, alpha)
            }
            #[target_feature(enable = $features)]
            pub unsafe fn scale_rows(acc: &mut [f32], d: usize, alpha: &[f32]) {
                super::kernels::scale_rows(acc, d, alpha)
            }
            #[target_feature(enable = $features)]
            pub unsafe fn probs_and_dscores(s: &mut [f32], dp: &mut [f32], cols: usize, ld: usize, lse2: &[f32], delta: &[f32]) {
                super::kernels::probs_and_dscores(s, dp, cols, ld, lse2, delta)
            }
        }
    };
}
isa_module!(avx512, "avx512f,avx512dq,avx512vl,avx2,fma");
isa_module!(avx2, "avx2,fma");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Baseline,
}

/// The instruction set the kernels use on this machine (detected once).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512dq")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("fma")
            {
                return Isa::Avx512;
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    })
}

macro_rules! dispatch {
    ($f:ident($($arg:expr),*)) => {
        match isa() {
            // SAFETY: isa() only reports instruction sets the CPU supports.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::$f($($arg),*) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::$f($($arg),*) },
            _ => kernels::$f($($arg),*),
        }
    };
}

pub fn online_softmax(s: &mut [f32], cols: usize, ld: usize, m: &mut [f32], l: &mut [f32], alpha: &mut [f32]) {
    dispatch!(online_softmax(s, cols, ld, m, l, alpha))
}

pub fn scale_rows(acc: &mut [f32], d: usize, alpha: &[f32]) {
    dispatch!(scale_rows(acc, d, alpha))
}

pub fn probs_and_dscores(s: &mut [f32], dp: &mut [f32], cols: usize, ld: usize, lse2: &[f32], delta: &[f32]) {
    dispatch!(probs_and_dscores(s, dp, cols, ld, lse2, delta))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2_matches_std() {
        let mut worst = 0.0f64;
        let mut x = -126.0f32;
        while x <= 10.0 {
            let want = (x as f64).exp2();
            let rel = ((exp2(x) as f64 - want) / want).abs();
            worst = worst.max(rel);
            x += 0.00137;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp2(f32::NEG_INFINITY), 0.0);
        assert!(exp2(f32::NAN).is_nan());
    }

    #[test]
    fn row_max_and_sum() {
        let mut row: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let m = row_max(&row);
        let want_m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(m, want_m);
        let want: f64 = row.iter().map(|&v| ((v - m) as f64).exp2()).sum();
        let got = exp2_shifted_sum(&mut row, m);
        assert!(((got as f64 - want) / want).abs() < 1e-6);
    }
}
