//! Tile products through the `gemm` crate's micro-kernels (single-threaded: the parallelism is
//! over tiles, one level up).

/// A strided f32 matrix view: element (i, j) is at `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Mat<'a> {
    /// Row-major [rows, ld].
    pub fn rows(data: &'a [f32], ld: usize) -> Self {
        Mat { data, rs: ld, cs: 1 }
    }
    /// The transpose of a row-major [rows, ld] matrix.
    pub fn transposed(data: &'a [f32], ld: usize) -> Self {
        Mat { data, rs: 1, cs: ld }
    }
    fn check(&self, rows: usize, cols: usize) {
        if rows > 0 && cols > 0 {
            assert!((rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len(), "matrix view out of bounds");
        }
    }
}

/// dst[m, n] (row-major, leading dimension `ld`) = (accumulate ? dst : 0) + a[m, k] · b[k, n].
pub fn matmul(m: usize, n: usize, k: usize, dst: &mut [f32], ld: usize, accumulate: bool, a: Mat, b: Mat) {
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * ld + n <= dst.len(), "destination out of bounds");
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                dst[r * ld..r * ld + n].fill(0.0);
            }
        }
        return;
    }
    a.check(m, k);
    b.check(k, n);
    // SAFETY: the bounds of all three views were checked above; the views do not alias `dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            ld as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}
