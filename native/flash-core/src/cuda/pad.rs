//! The head-dim padding layer of the CUDA launcher. The tiled kernels are compiled for one head
//! dim shared by q, k and v, a multiple of 8 (cuda/params.h). A call whose D is not a multiple of
//! 8, or whose v has its own Dv, runs them on zero-filled copies of head dim
//! Dk = roundup8(max(D, Dv)) — FlashAttention-2 zero-fills the same columns on load — with the
//! scale the problem resolved from the real D, and the first D (dq, dk) or Dv (o, dv) columns of
//! the kernels' outputs are copied out (cuda/pad.cu does both copies).
//!
//! Exact, bit for bit what the kernels compute at Dk: zero columns of q and k add nothing to q·k;
//! zero columns of v give zero columns of o, and zero columns of dO add nothing to dO·vᵀ nor to
//! rowsum(dO ∘ O); the dropped columns of dq, dk and dv are zeros.
//!
//! Only tensors whose head dim differs from Dk are copied: with D = 192 and Dv = 128 (DeepSeek's
//! shapes) q, k, dq and dk are used in place and v, o, dO and dv copied. The copies are
//! stream-ordered workspace, freed after the call: [`workspace_bytes`]. A problem the kernels take
//! as it is ([`needed`] false) launches exactly its kernels, with no copy.

use cudarc::driver::sys as cu;

use super::device::{self, launch, Device, DeviceBuffer, Function};
use super::launch::{self as plan, BackwardPtrs, ForwardPtrs};
use super::variant::Kernel;
use crate::error::Result;
use crate::problem::{Dims, Problem};

/// Whether `d`'s head dims need the padding layer: D not a multiple of 8, or Dv != D.
pub fn needed(d: &Dims) -> bool {
    !d.head_dim.is_multiple_of(8) || d.head_dim_v != d.head_dim
}

/// The kernels' head dim for `d`: max(D, Dv) rounded up to a multiple of 8.
pub fn kernel_head_dim(d: &Dims) -> usize {
    d.head_dim.max(d.head_dim_v).next_multiple_of(8)
}

/// Bytes of device workspace the padding layer allocates for one forward (`backward` false) or
/// backward call of `p`: a Dk-wide copy of every tensor whose head dim is not Dk (0 when it is not
/// [`needed`]). The kernels' own workspace comes on top (the backward's delta, lse and dQ sums,
/// see [`super::backward_device`]), sized at Dk.
pub fn workspace_bytes(p: &Problem, backward: bool) -> usize {
    if !needed(&p.dims) {
        return 0;
    }
    let (dk, e) = (kernel_head_dim(&p.dims), p.dtype.size_bytes());
    let shapes: &[Shape] = if backward { &backward_shapes(p) } else { &forward_shapes(p) };
    shapes.iter().filter(|t| t.cols != dk).map(|t| t.rows * dk * e).sum()
}

/// One tensor as rows of its own head dim: `[rows, cols]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    rows: usize,
    cols: usize,
}

/// q [Rq·H, D], k [Rk·Hkv, D], v [Rk·Hkv, Dv], o [Rq·H, Dv] (Rq, Rk: B·Sq and B·Sk, or the
/// varlen totals).
fn forward_shapes(p: &Problem) -> [Shape; 4] {
    let d = &p.dims;
    let (q_rows, k_rows) = (p.q_rows() * d.heads, p.k_rows() * d.kv_heads);
    let (q, k) = (Shape { rows: q_rows, cols: d.head_dim }, Shape { rows: k_rows, cols: d.head_dim });
    let (v, o) = (Shape { rows: k_rows, cols: d.head_dim_v }, Shape { rows: q_rows, cols: d.head_dim_v });
    [q, k, v, o]
}

/// dO, q, k, v, o, dq, dk, dv: the forward's, dO like o and the gradients like their inputs.
fn backward_shapes(p: &Problem) -> [Shape; 8] {
    let [q, k, v, o] = forward_shapes(p);
    [o, q, k, v, o, q, k, v]
}

/// The problem the kernels see: both head dims Dk; the scale (resolved from the real D), the
/// masks and every size but the head dims as `p`'s.
fn widened(p: &Problem) -> Problem {
    let dk = kernel_head_dim(&p.dims);
    Problem { dims: Dims { head_dim: dk, head_dim_v: dk, ..p.dims }, ..p.clone() }
}

/// cuda/pad.cu's params, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct PadParams {
    src: u64,
    dst: u64,
    rows: i64,
    cols: i32,
    to_wide: i32,
}

/// A tensor as the kernels see it: the caller's own memory when its head dim is Dk, else a Dk-wide
/// workspace copy.
struct Wide {
    ptr: u64,
    copy: Option<DeviceBuffer>,
}

/// The copies of one call: the pad kernel for (dtype, Dk) on one stream.
struct Padder<'a> {
    dev: &'a Device,
    f: Function,
    warps: usize,
    dk: usize,
    elem: usize,
    s: cu::CUstream,
}

impl<'a> Padder<'a> {
    fn new(dev: &'a Device, wide: &Problem, s: cu::CUstream) -> Result<Self> {
        let v = plan::kernel_variant(dev, wide, Kernel::Pad)?;
        let f = device::function(dev, &v)?;
        Ok(Padder { dev, f, warps: v.tiles.num_warps, dk: wide.dims.head_dim, elem: wide.dtype.size_bytes(), s })
    }

    /// Launches one copy between `[rows, cols]` at `narrow` and `[rows, Dk]` at `wide`.
    ///
    /// # Safety
    /// Both pointers device memory of those sizes, valid until the stream reaches the copy.
    unsafe fn copy(&self, t: Shape, narrow: u64, wide: u64, to_wide: bool) -> Result<()> {
        let (src, dst) = if to_wide { (narrow, wide) } else { (wide, narrow) };
        let prm = PadParams { src, dst, rows: t.rows as i64, cols: t.cols as i32, to_wide: to_wide as i32 };
        // One warp per row, grid-stride: a few blocks per SM are enough for a copy.
        let blocks = plan::grid_over(t.rows, self.warps).min(8 * self.dev.sm_count.max(1) as u32);
        // SAFETY: the caller's guarantees; PadParams mirrors the kernel's params.
        unsafe { launch("flash_pad", self.f, (blocks, 1, 1), self.s, &prm) }
    }

    /// Input tensor `t` at `ptr` as the kernels read it: zero-filled Dk-wide copy unless it is
    /// Dk wide already.
    ///
    /// # Safety
    /// `ptr` device memory of `t`'s size, valid until the stream reaches the copy.
    unsafe fn input(&self, t: Shape, ptr: u64) -> Result<Wide> {
        if t.cols == self.dk {
            return Ok(Wide { ptr, copy: None });
        }
        let buf = DeviceBuffer::alloc(t.rows * self.dk * self.elem, self.s)?;
        // SAFETY: the caller's guarantees for ptr; buf holds [rows, Dk].
        unsafe { self.copy(t, ptr, buf.ptr, true)? };
        Ok(Wide { ptr: buf.ptr, copy: Some(buf) })
    }

    /// Output tensor `t` at `ptr` as the kernels write it: in place unless it is narrower than
    /// Dk, then a workspace that [`Padder::finish`] copies out of.
    fn output(&self, t: Shape, ptr: u64) -> Result<Wide> {
        if t.cols == self.dk {
            return Ok(Wide { ptr, copy: None });
        }
        let buf = DeviceBuffer::alloc(t.rows * self.dk * self.elem, self.s)?;
        Ok(Wide { ptr: buf.ptr, copy: Some(buf) })
    }

    /// Copies an output's first `t.cols` columns from its workspace to `ptr` (nothing when it was
    /// written in place).
    ///
    /// # Safety
    /// As [`Padder::input`].
    unsafe fn finish(&self, t: Shape, w: &Wide, ptr: u64) -> Result<()> {
        match w.copy {
            None => Ok(()),
            // SAFETY: the caller's guarantees for ptr; the workspace holds [rows, Dk].
            Some(_) => unsafe { self.copy(t, ptr, w.ptr, false) },
        }
    }
}

/// The forward through the padding layer (`needed(&p.dims)`).
///
/// # Safety
/// As [`super::forward_device`]; `dev`'s context current.
pub(super) unsafe fn forward(dev: &Device, p: &Problem, s: cu::CUstream, ptrs: ForwardPtrs) -> Result<()> {
    let w = widened(p);
    let pad = Padder::new(dev, &w, s)?;
    let [q, k, v, o] = forward_shapes(p);
    // SAFETY: the caller's pointers have the shapes `p` implies (forward_shapes); the copies are
    // queued on `s` before the kernel that reads them and freed stream-ordered after it.
    unsafe {
        let (wq, wk, wv) = (pad.input(q, ptrs.q)?, pad.input(k, ptrs.k)?, pad.input(v, ptrs.v)?);
        let wo = pad.output(o, ptrs.o)?;
        plan::forward_kernels(dev, &w, s, ForwardPtrs { q: wq.ptr, k: wk.ptr, v: wv.ptr, o: wo.ptr, ..ptrs })?;
        pad.finish(o, &wo, ptrs.o)
    }
}

/// The backward through the padding layer (`needed(&p.dims)`).
///
/// # Safety
/// As [`super::backward_device`]; `dev`'s context current.
pub(super) unsafe fn backward(dev: &Device, p: &Problem, s: cu::CUstream, ptrs: BackwardPtrs) -> Result<()> {
    let w = widened(p);
    let pad = Padder::new(dev, &w, s)?;
    let [d_out, q, k, v, o, dq, dk, dv] = backward_shapes(p);
    // SAFETY: as forward.
    unsafe {
        let (wd, wq, wk) = (pad.input(d_out, ptrs.d_out)?, pad.input(q, ptrs.q)?, pad.input(k, ptrs.k)?);
        let (wv, wo) = (pad.input(v, ptrs.v)?, pad.input(o, ptrs.o)?);
        let (wdq, wdk, wdv) = (pad.output(dq, ptrs.dq)?, pad.output(dk, ptrs.dk)?, pad.output(dv, ptrs.dv)?);
        let wide = BackwardPtrs {
            d_out: wd.ptr, q: wq.ptr, k: wk.ptr, v: wv.ptr, o: wo.ptr, dq: wdq.ptr, dk: wdk.ptr, dv: wdv.ptr, ..ptrs
        };
        plan::backward_kernels(dev, &w, s, wide)?;
        pad.finish(dq, &wdq, ptrs.dq)?;
        pad.finish(dk, &wdk, ptrs.dk)?;
        pad.finish(dv, &wdv, ptrs.dv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Options, TensorSpec};

    fn problem(q: &[usize], k: &[usize], v: &[usize]) -> Problem {
        let spec = |name, shape| TensorSpec { name, dtype: "bfloat16", shape, nbytes: None };
        Problem::forward(&spec("q", q), &spec("k", k), &spec("v", v), &Options::default()).unwrap()
    }

    #[test]
    fn plain_head_dims_need_no_padding() {
        let p = problem(&[2, 10, 4, 64], &[2, 12, 2, 64], &[2, 12, 2, 64]);
        assert!(!needed(&p.dims));
        assert_eq!((workspace_bytes(&p, false), workspace_bytes(&p, true)), (0, 0));
    }

    #[test]
    fn odd_head_dims_pad_every_tensor() {
        let p = problem(&[2, 10, 4, 59], &[2, 12, 2, 59], &[2, 12, 2, 59]);
        assert!(needed(&p.dims) && kernel_head_dim(&p.dims) == 64);
        let (q, kv) = (2 * 10 * 4 * 64 * 2, 2 * 12 * 2 * 64 * 2);
        assert_eq!(workspace_bytes(&p, false), q + kv + kv + q);
        assert_eq!(workspace_bytes(&p, true), 4 * q + 4 * kv);
        assert_eq!(widened(&p).scale, p.scale, "the scale stays 1/sqrt(59)");
        assert!((p.scale - 1.0 / 59f32.sqrt()).abs() < 1e-7);
    }

    #[test]
    fn a_narrower_v_pads_only_the_dv_tensors() {
        // DeepSeek-style: D = 192, Dv = 128. q, k, dq, dk are used in place.
        let p = problem(&[1, 10, 4, 192], &[1, 12, 2, 192], &[1, 12, 2, 128]);
        assert_eq!(kernel_head_dim(&p.dims), 192);
        let (o, v) = (10 * 4 * 192 * 2, 12 * 2 * 192 * 2);
        assert_eq!(workspace_bytes(&p, false), v + o);
        assert_eq!(workspace_bytes(&p, true), o + v + o + v); // dO, v, o, dv
        let w = widened(&p);
        assert_eq!((w.dims.head_dim, w.dims.head_dim_v, w.scale), (192, 192, p.scale));
    }

    #[test]
    fn a_wider_v_pads_q_and_k() {
        let p = problem(&[1, 10, 4, 3], &[1, 12, 2, 3], &[1, 12, 2, 200]);
        assert_eq!(kernel_head_dim(&p.dims), 200);
        let (q, k) = (10 * 4 * 200 * 2, 12 * 2 * 200 * 2);
        assert_eq!(workspace_bytes(&p, false), q + k);
        assert!((widened(&p).scale - 1.0 / 3f32.sqrt()).abs() < 1e-7);
    }

    #[test]
    fn pad_params_match_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<PadParams>(), 2 * 8 + 8 + 2 * 4);
    }
}
