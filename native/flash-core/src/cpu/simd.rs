//! Elementwise work of a tile (online softmax; probabilities and dS), written once over
//! [`Vector`] and compiled per instruction set; [`isa`] picks the set at run time.

use super::vector::{exp2_scalar, Scalar, Vector};
use std::sync::OnceLock;

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
                && std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
            {
                return Isa::Avx512;
            }
            // (F16C: decode widens f16 caches with it; every AVX2 CPU has it.)
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c") {
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    })
}

/// Row maximum of x[..n], ignoring NaN (NaN still reaches the output through exp2).
#[inline(always)]
unsafe fn row_max<V: Vector>(x: *const f32, n: usize) -> f32 {
    let mut acc = V::splat(f32::NEG_INFINITY);
    let mut i = 0;
    while i + V::LANES <= n {
        acc = V::load(x.add(i)).max(acc);
        i += V::LANES;
    }
    let mut m = acc.reduce_max();
    for t in i..n {
        let v = *x.add(t);
        m = if v > m { v } else { m };
    }
    m
}

/// x[..n] <- exp2(x - shift); returns the sum of the new values.
#[inline(always)]
unsafe fn exp2_shifted_sum<V: Vector>(x: *mut f32, n: usize, shift: f32) -> f32 {
    let (sh, mut acc) = (V::splat(shift), V::zero());
    let mut i = 0;
    while i + V::LANES <= n {
        let e = V::load(x.add(i)).sub(sh).exp2();
        e.store(x.add(i));
        acc = acc.add(e);
        i += V::LANES;
    }
    let mut sum = acc.reduce_add();
    for t in i..n {
        let e = exp2_scalar(*x.add(t) - shift);
        *x.add(t) = e;
        sum += e;
    }
    sum
}

mod generic {
    use super::*;

    /// One online-softmax step over a tile of scores in exp2 units.
    /// s: [rows, ld], first `cols` columns used -> exp2(s - new row max);
    /// m, l: running max and sum per row (updated); alpha[r] = exp2(m_old - m_new), the factor
    /// for the row of the output accumulator.
    #[inline(always)]
    pub unsafe fn online_softmax<V: Vector>(s: &mut [f32], cols: usize, ld: usize, m: &mut [f32], l: &mut [f32], alpha: &mut [f32]) {
        assert!(m.len() == l.len() && m.len() == alpha.len() && (m.is_empty() || (m.len() - 1) * ld + cols <= s.len()));
        for r in 0..m.len() {
            let row = s.as_mut_ptr().add(r * ld);
            let mx = row_max::<V>(row, cols);
            let m_new = if mx > m[r] { mx } else { m[r] };
            // A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
            let shift = if m_new == f32::NEG_INFINITY { 0.0 } else { m_new };
            alpha[r] = exp2_scalar(m[r] - shift);
            l[r] = l[r] * alpha[r] + exp2_shifted_sum::<V>(row, cols, shift);
            m[r] = m_new;
        }
    }

    /// acc[r, :d] *= alpha[r]; acc: [rows, d] with d a multiple of the vector width.
    #[inline(always)]
    pub unsafe fn scale_rows<V: Vector>(acc: &mut [f32], d: usize, alpha: &[f32]) {
        assert!(d % V::LANES == 0 && alpha.len() * d <= acc.len());
        for (r, &a) in alpha.iter().enumerate() {
            let (row, av) = (acc.as_mut_ptr().add(r * d), V::splat(a));
            for i in (0..d).step_by(V::LANES) {
                V::load(row.add(i)).mul(av).store(row.add(i));
            }
        }
    }

    /// Backward tile: s <- P = exp2(s - lse2[r]); dp <- dS = P * (dp - delta[r]).
    /// s, dp: [rows, ld], first `cols` columns used; lse2 is the row's log-sum-exp in log2 units
    /// (+inf for rows that see no key, which makes P = 0).
    #[inline(always)]
    pub unsafe fn probs_and_dscores<V: Vector>(s: &mut [f32], dp: &mut [f32], cols: usize, ld: usize, lse2: &[f32], delta: &[f32]) {
        let rows = lse2.len();
        assert!(delta.len() == rows && (rows == 0 || ((rows - 1) * ld + cols <= s.len().min(dp.len()))));
        for r in 0..rows {
            let (sr, dr) = (s.as_mut_ptr().add(r * ld), dp.as_mut_ptr().add(r * ld));
            let (sh, dl) = (V::splat(lse2[r]), V::splat(delta[r]));
            let mut i = 0;
            while i + V::LANES <= cols {
                let p = V::load(sr.add(i)).sub(sh).exp2();
                p.store(sr.add(i));
                p.mul(V::load(dr.add(i)).sub(dl)).store(dr.add(i));
                i += V::LANES;
            }
            for t in i..cols {
                let p = exp2_scalar(*sr.add(t) - lse2[r]);
                *sr.add(t) = p;
                *dr.add(t) = p * (*dr.add(t) - delta[r]);
            }
        }
    }

    /// Softcap on a row of scores in the exp2 domain: x <- c2 · t, t = tanh(x / c2), written to
    /// `tanh` when given (the backward's chain rule). For |y| >= 1/8, tanh(y) = 1 − 2 / (1 + e^{2y})
    /// with e^{2y} = 2^{k x}, k = 2 log2(e) / c2 (both signs without a branch: e^{2y} → 0 gives −1,
    /// → large gives 1); below, where that form cancels (an absolute error of ~6e-8 that c2 would
    /// magnify), the odd series y − y³/3 + 2y⁵/15 − 17y⁷/315 (relative error < 1e-8 there).
    #[inline(always)]
    pub unsafe fn softcap<V: Vector>(row: &mut [f32], c2: f32, tanh: Option<&mut [f32]>) {
        let n = row.len();
        let x = row.as_mut_ptr();
        let th = tanh.map(|t| {
            assert!(t.len() >= n);
            t.as_mut_ptr()
        });
        let mut i = 0;
        while i + V::LANES <= n {
            let t = tanh_of::<V>(V::load(x.add(i)), c2);
            t.mul(V::splat(c2)).store(x.add(i));
            if let Some(th) = th {
                t.store(th.add(i));
            }
            i += V::LANES;
        }
        for j in i..n {
            let mut t = 0.0f32;
            tanh_of::<Scalar>(Scalar::splat(*x.add(j)), c2).store(&mut t);
            *x.add(j) = c2 * t;
            if let Some(th) = th {
                *th.add(j) = t;
            }
        }
    }

    /// tanh(x / c2), see [`softcap`].
    #[inline(always)]
    unsafe fn tanh_of<V: Vector>(x: V, c2: f32) -> V {
        let (one, two) = (V::splat(1.0), V::splat(2.0));
        let y = x.mul(V::splat(1.0 / c2));
        let e = x.mul(V::splat(2.0 * std::f32::consts::LOG2_E / c2)).exp2();
        let wide = one.sub(two.div(one.add(e)));
        let y2 = y.mul(y);
        let series = V::splat(-17.0 / 315.0).mul(y2).add(V::splat(2.0 / 15.0)).mul(y2).add(V::splat(-1.0 / 3.0)).mul(y2).mul(y).add(y);
        y.abs().select_lt(V::splat(0.125), series, wide)
    }
}

macro_rules! isa_module {
    ($name:ident, $vector:ty, $features:literal) => {
        #[cfg(target_arch = "x86_64")]
        mod $name {
            use super::generic;
            #[target_feature(enable = $features)]
            pub unsafe fn online_softmax(s: &mut [f32], cols: usize, ld: usize, m: &mut [f32], l: &mut [f32], alpha: &mut [f32]) {
                generic::online_softmax::<$vector>(s, cols, ld, m, l, alpha)
            }
            #[target_feature(enable = $features)]
            pub unsafe fn scale_rows(acc: &mut [f32], d: usize, alpha: &[f32]) {
                generic::scale_rows::<$vector>(acc, d, alpha)
            }
            #[target_feature(enable = $features)]
            pub unsafe fn probs_and_dscores(s: &mut [f32], dp: &mut [f32], cols: usize, ld: usize, lse2: &[f32], delta: &[f32]) {
                generic::probs_and_dscores::<$vector>(s, dp, cols, ld, lse2, delta)
            }
            #[target_feature(enable = $features)]
            pub unsafe fn softcap(row: &mut [f32], c2: f32, tanh: Option<&mut [f32]>) {
                generic::softcap::<$vector>(row, c2, tanh)
            }
        }
    };
}
isa_module!(avx512, super::super::vector::x86::Avx512, "avx512f,avx512dq,avx512vl,avx2,fma");
isa_module!(avx2, super::super::vector::x86::Avx2, "avx2,fma");

macro_rules! dispatch {
    ($f:ident($($arg:expr),*)) => {
        // SAFETY: isa() only reports instruction sets the CPU supports; the generic kernels
        // check their slice bounds before touching raw pointers.
        unsafe {
            match isa() {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => avx512::$f($($arg),*),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => avx2::$f($($arg),*),
                _ => generic::$f::<Scalar>($($arg),*),
            }
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

/// See `generic::softcap`.
pub fn softcap(row: &mut [f32], c2: f32, tanh: Option<&mut [f32]>) {
    dispatch!(softcap(row, c2, tanh))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorised softcap is within ~1e-7 (absolute, on tanh) of f64's, on both signs, with a
    /// tail past the vector width, and saturates to ±c without NaN.
    #[test]
    fn softcap_matches_f64_tanh() {
        for cap in [30.0f32, 1e6] {
            // a huge cap sees only small y = x / c2: the series' range, where c2 magnifies errors
            let c2 = cap * std::f32::consts::LOG2_E;
            let orig: Vec<f32> = (0..203).map(|i| (i as f32 - 101.0) * 0.9).chain([1e30, -1e30, 0.0, 1e-8, 5.0, -5.0]).collect();
            let (mut row, mut th) = (orig.clone(), vec![0.0f32; orig.len()]);
            softcap(&mut row, c2, Some(&mut th));
            for ((x, &t), &o) in row.iter().zip(&th).zip(&orig) {
                let want = (o as f64 / c2 as f64).tanh();
                assert!((t as f64 - want).abs() < 3e-7, "tanh({o} / c2) = {t}, want {want}");
                let (got, want) = (*x as f64, c2 as f64 * want);
                assert!((got - want).abs() < 2e-6 * (1.0 + want.abs()), "cap {cap}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn exp2_matches_std() {
        let mut worst = 0.0f64;
        let mut x = -126.0f32;
        while x <= 10.0 {
            let want = (x as f64).exp2();
            let rel = ((exp2_scalar(x) as f64 - want) / want).abs();
            worst = worst.max(rel);
            x += 0.00137;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp2_scalar(f32::NEG_INFINITY), 0.0);
        assert!(exp2_scalar(f32::NAN).is_nan());
    }

    /// The dispatched (vector) softmax step agrees with a scalar f64 computation, including a
    /// tail that is not a multiple of the vector width and a fully masked row.
    #[test]
    fn online_softmax_matches_scalar() {
        let (rows, cols, ld) = (3usize, 37usize, 48usize);
        let mut s: Vec<f32> = (0..rows * ld).map(|i| ((i * 37 % 101) as f32 * 0.173).sin() * 4.0).collect();
        s[2 * ld..2 * ld + cols].fill(f32::NEG_INFINITY);
        let orig = s.clone();
        let (mut m, mut l, mut alpha) = (vec![f32::NEG_INFINITY; rows], vec![0.0; rows], vec![0.0; rows]);
        online_softmax(&mut s, cols, ld, &mut m, &mut l, &mut alpha);
        for r in 0..2 {
            let row = &orig[r * ld..r * ld + cols];
            let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(m[r], mx);
            let want: f64 = row.iter().map(|&v| ((v - mx) as f64).exp2()).sum();
            assert!(((l[r] as f64 - want) / want).abs() < 1e-6);
            for c in 0..cols {
                let p = ((row[c] - mx) as f64).exp2();
                assert!((s[r * ld + c] as f64 - p).abs() <= 1e-6 * p.max(1e-30) + 1e-12);
            }
        }
        assert_eq!((m[2], l[2]), (f32::NEG_INFINITY, 0.0));
        assert!(s[2 * ld..2 * ld + cols].iter().all(|&p| p == 0.0));
    }

    #[test]
    fn nan_propagates() {
        let mut s = vec![0.5f32; 32];
        s[3] = f32::NAN;
        let (mut m, mut l, mut alpha) = (vec![f32::NEG_INFINITY], vec![0.0], vec![0.0]);
        online_softmax(&mut s, 32, 32, &mut m, &mut l, &mut alpha);
        assert!(l[0].is_nan());
    }
}
