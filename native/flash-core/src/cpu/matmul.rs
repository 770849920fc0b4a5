//! Tile products: C[m, n] (+)= A[m, k] · B[k, n] with a register-blocked micro-kernel.
//!
//! A is any strided view (its elements are broadcast), B and C are row-major with contiguous
//! columns (loaded as vectors). Every product in the kernels has this form once K and V are also
//! kept transposed, so no operand is repacked per call. Column counts are rounded up to a
//! multiple of [`COL_PAD`]: B and C must hold those padding columns (zeros in B), which the
//! working layouts guarantee. The kernel is compiled per instruction set, like `simd`.

use super::simd::{isa, Isa};
#[cfg(target_arch = "x86_64")]
use super::vector::x86;
use super::vector::{Scalar, Vector};

/// Column padding the micro-kernel needs in B and C.
pub const COL_PAD: usize = 16;

pub fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// A strided f32 matrix view: element (i, j) is at `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Mat<'a> {
    /// Row-major with leading dimension `ld`.
    pub fn rows(data: &'a [f32], ld: usize) -> Self {
        Mat { data, rs: ld, cs: 1 }
    }
    /// The transpose of a row-major matrix with leading dimension `ld`.
    pub fn transposed(data: &'a [f32], ld: usize) -> Self {
        Mat { data, rs: 1, cs: ld }
    }
}

/// C[m, n] = (accumulate ? C : 0) + A[m, k] · B[k, n]; B row-major with leading dimension
/// `ldb`, C row-major with `ldc`, both holding round_up(n, COL_PAD) columns.
#[allow(clippy::too_many_arguments)]
pub fn matmul(m: usize, n: usize, k: usize, c: &mut [f32], ldc: usize, accumulate: bool, a: Mat, b: &[f32], ldb: usize) {
    if m == 0 || n == 0 {
        return;
    }
    let np = round_up(n, COL_PAD);
    assert!(np <= ldc && (m - 1) * ldc + np <= c.len(), "C out of bounds");
    if k > 0 {
        assert!(np <= ldb && (k - 1) * ldb + np <= b.len(), "B out of bounds");
        assert!((m - 1) * a.rs + (k - 1) * a.cs < a.data.len(), "A out of bounds");
    }
    let args = Args { m, np, k, c: c.as_mut_ptr(), ldc, accumulate, a: a.data.as_ptr(), a_rs: a.rs, a_cs: a.cs, b: b.as_ptr(), ldb };
    // SAFETY: the bounds of A, B and C were checked above; isa() only reports supported sets.
    unsafe {
        match isa() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => avx512(&args),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2(&args),
            _ => blocked::<Scalar, 4, 4>(&args),
        }
    }
}

struct Args {
    m: usize,
    np: usize,
    k: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    ldb: usize,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
unsafe fn avx512(args: &Args) {
    blocked::<x86::Avx512, 8, 2>(args)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2(args: &Args) {
    blocked::<x86::Avx2, 6, 2>(args)
}

/// Walks C in MR × (NV vectors) blocks; narrower blocks finish the columns (np is a multiple
/// of COL_PAD, which is a multiple of every vector width).
#[inline(always)]
unsafe fn blocked<V: Vector, const MR: usize, const NV: usize>(x: &Args) {
    let mut j = 0;
    while j < x.np {
        if x.np - j >= NV * V::LANES {
            rows::<V, MR, NV>(x, j);
            j += NV * V::LANES;
        } else {
            rows::<V, MR, 1>(x, j);
            j += V::LANES;
        }
    }
}

#[inline(always)]
unsafe fn rows<V: Vector, const MR: usize, const NV: usize>(x: &Args, j: usize) {
    let mut i = 0;
    while i + MR <= x.m {
        block::<V, MR, NV>(x, i, j);
        i += MR;
    }
    // The last rows, with a kernel of exactly that height.
    match x.m - i {
        0 => {}
        1 => block::<V, 1, NV>(x, i, j),
        2 => block::<V, 2, NV>(x, i, j),
        3 => block::<V, 3, NV>(x, i, j),
        4 => block::<V, 4, NV>(x, i, j),
        5 => block::<V, 5, NV>(x, i, j),
        6 => block::<V, 6, NV>(x, i, j),
        7 => block::<V, 7, NV>(x, i, j),
        _ => unreachable!("MR is at most 8"),
    }
}

/// C[i..i+R, j..j+NV·LANES] (+)= A[i..i+R, :] · B[:, j..j+NV·LANES], accumulators in registers.
#[inline(always)]
unsafe fn block<V: Vector, const R: usize, const NV: usize>(x: &Args, i: usize, j: usize) {
    let mut acc = [[V::zero(); NV]; R];
    if x.accumulate {
        for (r, row) in acc.iter_mut().enumerate() {
            for (v, a) in row.iter_mut().enumerate() {
                *a = V::load(x.c.add((i + r) * x.ldc + j + v * V::LANES));
            }
        }
    }
    let a = x.a.add(i * x.a_rs);
    for kk in 0..x.k {
        let bp = x.b.add(kk * x.ldb + j);
        let mut b = [V::zero(); NV];
        for (v, bv) in b.iter_mut().enumerate() {
            *bv = V::load(bp.add(v * V::LANES));
        }
        let a_k = a.add(kk * x.a_cs);
        for (r, row) in acc.iter_mut().enumerate() {
            let av = V::splat(*a_k.add(r * x.a_rs));
            for (v, c) in row.iter_mut().enumerate() {
                *c = c.fma(av, b[v]);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (v, c) in row.iter().enumerate() {
            c.store(x.c.add((i + r) * x.ldc + j + v * V::LANES));
        }
    }
}
