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
//! The same copies serve inputs whose rows the kernels cannot read where they lie (strides or a
//! pointer off 16-byte boundaries, [`launch::in_place`](super::launch::in_place)): the copy reads
//! them strided and writes them packed.
//!
//! Only tensors whose head dim differs from Dk (or not in place) are copied: with D = 192 and Dv = 128 (DeepSeek's
//! shapes) q, k, dq and dk are used in place and v, o, dO and dv copied. The copies are
//! stream-ordered workspace, freed after the call: [`workspace_bytes`]. A problem the kernels take
//! as it is ([`needed`] false) launches exactly its kernels, with no copy.

use cudarc::driver::sys as cu;

use super::device::{self, launch, Device, DeviceBuffer, Function};
use super::launch::{self as plan, BackwardPtrs, ForwardPtrs, KernelStrides};
use super::variant::Kernel;
use crate::error::Result;
use crate::problem::{Dims, Problem};
use crate::strides::{InputStrides, Strides};

/// Whether `d`'s head dims need the padding layer: D not a multiple of 8, or Dv != D.
pub fn needed(d: &Dims) -> bool {
    !d.head_dim.is_multiple_of(8) || d.head_dim_v != d.head_dim
}

/// A forward's inputs: q, k, v with where their rows lie.
pub(super) fn forward_inputs(p: &Problem, ptrs: &ForwardPtrs) -> [(u64, Strides); 3] {
    let s = ptrs.strides.unwrap_or_else(|| InputStrides::packed(p));
    [(ptrs.q, s.q), (ptrs.k, s.k), (ptrs.v, s.v)]
}

/// A backward's inputs: d_out, q, k, v, o with where their rows lie.
pub(super) fn backward_inputs(p: &Problem, ptrs: &BackwardPtrs) -> [(u64, Strides); 5] {
    let s = ptrs.strides.unwrap_or_else(|| InputStrides::packed(p));
    [(ptrs.d_out, s.d_out), (ptrs.q, s.q), (ptrs.k, s.k), (ptrs.v, s.v), (ptrs.o, s.o)]
}

/// Whether the kernels read every one of `inputs` where it lies.
pub(super) fn inputs_in_place(p: &Problem, inputs: &[(u64, Strides)]) -> bool {
    inputs.iter().all(|(ptr, st)| plan::in_place(st, *ptr, p.dtype.size_bytes()))
}

/// The kernels' head dim for `d`: max(D, Dv) rounded up to a multiple of 8.
pub fn kernel_head_dim(d: &Dims) -> usize {
    d.head_dim.max(d.head_dim_v).next_multiple_of(8)
}

/// Bytes of device workspace the padding layer allocates for one forward (`backward` false) or
/// backward call of `p` with packed inputs: a Dk-wide copy of every tensor whose head dim is not Dk
/// (0 when it is not [`needed`]); an input not read in place adds its own copy. The kernels' own workspace comes on top (the backward's delta, lse and dQ sums,
/// see [`super::backward_device`]), sized at Dk.
pub fn workspace_bytes(p: &Problem, backward: bool) -> usize {
    if !needed(&p.dims) {
        return 0;
    }
    let (dk, e) = (kernel_head_dim(&p.dims), p.dtype.size_bytes());
    let shapes: &[Shape] = if backward { &backward_shapes(p) } else { &forward_shapes(p) };
    shapes.iter().filter(|t| t.cols != dk).map(|t| t.rows * dk * e).sum()
}

/// One tensor as rows of its own head dim: `[rows, cols]`, rows = (call row, head) pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    rows: usize,
    cols: usize,
}

/// Where an input's rows lie, as the copy reads them: its strides and the call's rows per batch row.
#[derive(Debug, Clone, Copy)]
struct Layout {
    st: KernelStrides,
    heads: usize,
    batch_rows: usize,
}

impl Layout {
    /// A query-side (`query`) or key-side input of `p` laid out as `st`.
    fn of(p: &Problem, st: Strides, query: bool) -> Layout {
        let d = &p.dims;
        let (rows, heads) = if query { (d.seq_q, d.heads) } else { (d.seq_k, d.kv_heads) };
        Layout { st: KernelStrides::of(st, rows, p.mask.varlen.is_some()), heads, batch_rows: rows }
    }

    /// For copies whose source is a packed workspace (to_wide = 0), which do not read it.
    const UNUSED: Layout = Layout { st: KernelStrides { seq: 0, head: 0, batch_gap: 0 }, heads: 1, batch_rows: 1 };
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
    src_st: KernelStrides,
    heads: i64,
    batch_rows: i64,
}

/// A tensor as the kernels see it: the caller's own memory when its head dim is Dk (and, an input,
/// the kernels read it in place), else a packed Dk-wide workspace copy.
struct Wide {
    ptr: u64,
    copy: Option<DeviceBuffer>,
}

impl Wide {
    /// Its strides for the kernels: the caller's, or the packed copy's (`packed`).
    fn strides(&self, caller: Strides, packed: Strides) -> Strides {
        if self.copy.is_some() { packed } else { caller }
    }
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

    /// Launches one copy between `[rows, cols]` at `narrow` (laid out as `at` when it is the
    /// source) and `[rows, Dk]` at `wide` (packed).
    ///
    /// # Safety
    /// Both pointers device memory of those sizes, valid until the stream reaches the copy.
    unsafe fn copy(&self, t: Shape, narrow: u64, wide: u64, to_wide: bool, at: Layout) -> Result<()> {
        let (src, dst) = if to_wide { (narrow, wide) } else { (wide, narrow) };
        let (heads, batch_rows) = (at.heads.max(1) as i64, at.batch_rows.max(1) as i64);
        let prm = PadParams { src, dst, rows: t.rows as i64, cols: t.cols as i32, to_wide: to_wide as i32, src_st: at.st, heads, batch_rows };
        // One warp per row, grid-stride: a few blocks per SM are enough for a copy.
        let blocks = plan::grid_over(t.rows, self.warps).min(8 * self.dev.sm_count.max(1) as u32);
        // SAFETY: the caller's guarantees; PadParams mirrors the kernel's params.
        unsafe { launch("flash_pad", self.f, (blocks, 1, 1), self.s, &prm) }
    }

    /// Input tensor `t` at `ptr`, laid out as `at`, as the kernels read it: a packed zero-filled
    /// Dk-wide copy unless it is Dk wide already and read in place.
    ///
    /// # Safety
    /// `ptr` device memory holding `t` as `at` lays it out, valid until the stream reaches the copy.
    unsafe fn input(&self, t: Shape, ptr: u64, st: Strides, at: Layout) -> Result<Wide> {
        if t.cols == self.dk && plan::in_place(&st, ptr, self.elem) {
            return Ok(Wide { ptr, copy: None });
        }
        let buf = DeviceBuffer::alloc(t.rows * self.dk * self.elem, self.s)?;
        // SAFETY: the caller's guarantees for ptr; buf holds [rows, Dk].
        unsafe { self.copy(t, ptr, buf.ptr, true, at)? };
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
            Some(_) => unsafe { self.copy(t, ptr, w.ptr, false, Layout::UNUSED) },
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
    let st = ptrs.strides.unwrap_or_else(|| InputStrides::packed(p));
    let packed = InputStrides::packed(&w);
    // SAFETY: the caller's pointers hold the shapes `p` implies (forward_shapes) where `st` says;
    // the copies are queued on `s` before the kernel that reads them and freed stream-ordered after it.
    unsafe {
        let wq = pad.input(q, ptrs.q, st.q, Layout::of(p, st.q, true))?;
        let wk = pad.input(k, ptrs.k, st.k, Layout::of(p, st.k, false))?;
        let wv = pad.input(v, ptrs.v, st.v, Layout::of(p, st.v, false))?;
        let wo = pad.output(o, ptrs.o)?;
        let strides = InputStrides { q: wq.strides(st.q, packed.q), k: wk.strides(st.k, packed.k), v: wv.strides(st.v, packed.v), ..packed };
        let wide = ForwardPtrs { q: wq.ptr, k: wk.ptr, v: wv.ptr, o: wo.ptr, strides: Some(strides), ..ptrs };
        plan::forward_kernels(dev, &w, s, wide)?;
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
    let st = ptrs.strides.unwrap_or_else(|| InputStrides::packed(p));
    let packed = InputStrides::packed(&w);
    // SAFETY: as forward.
    unsafe {
        let wd = pad.input(d_out, ptrs.d_out, st.d_out, Layout::of(p, st.d_out, true))?;
        let wq = pad.input(q, ptrs.q, st.q, Layout::of(p, st.q, true))?;
        let wk = pad.input(k, ptrs.k, st.k, Layout::of(p, st.k, false))?;
        let wv = pad.input(v, ptrs.v, st.v, Layout::of(p, st.v, false))?;
        let wo = pad.input(o, ptrs.o, st.o, Layout::of(p, st.o, true))?;
        let (wdq, wdk, wdv) = (pad.output(dq, ptrs.dq)?, pad.output(dk, ptrs.dk)?, pad.output(dv, ptrs.dv)?);
        let strides = InputStrides {
            d_out: wd.strides(st.d_out, packed.d_out),
            q: wq.strides(st.q, packed.q),
            k: wk.strides(st.k, packed.k),
            v: wv.strides(st.v, packed.v),
            o: wo.strides(st.o, packed.o),
        };
        let wide = BackwardPtrs {
            d_out: wd.ptr, q: wq.ptr, k: wk.ptr, v: wv.ptr, o: wo.ptr, dq: wdq.ptr, dk: wdk.ptr, dv: wdv.ptr,
            strides: Some(strides), ..ptrs
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
        // 2 pointers, rows, cols and to_wide, the source's Strides (3 i64), heads, batch_rows.
        assert_eq!(std::mem::size_of::<PadParams>(), 2 * 8 + 8 + 2 * 4 + 3 * 8 + 2 * 8);
    }
}
