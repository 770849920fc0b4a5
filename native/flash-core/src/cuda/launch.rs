//! Launch planning on device pointers: the params struct the kernels read, which kernel variant
//! runs, and the forward / backward launch sequences on the caller's stream.

use std::sync::Arc;

use cudarc::driver::sys as cu;

use super::config::{self, Spec};
use super::device::{self, launch, ContextGuard, Device, DeviceBuffer};
use super::libs;
use super::variant::{Kernel, Variant};
use crate::error::{FlashError, Result};
use crate::guard::catch_panics;
use crate::problem::Problem;

/// The params struct of cuda/params.h, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct FlashParams {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    dout: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    delta: u64,
    lse_log2: u64,
    dq_accum: u64,
    batch: i32,
    seqlen_q: i32,
    seqlen_k: i32,
    heads: i32,
    heads_kv: i32,
    scale: f32,
    scale_log2: f32,
    _pad: i32,
}

/// Device pointers of the data-carrying masks ([`MaskBuffers`](crate::MaskBuffers)' layouts on
/// one GPU); 0 = not given.
#[derive(Debug, Clone, Copy, Default)]
pub struct MaskPtrs {
    pub seg_q: u64,      // [B, Sq] int32
    pub seg_k: u64,      // [B, Sk] int32
    pub block_mask: u64, // [Bm, Hm, ceil(Sq/128), ceil(Sk/128)] uint8
}

/// Device pointers of a forward call: [`ForwardIo`](crate::ForwardIo)'s buffers on one GPU (same
/// layouts).
#[derive(Debug, Clone, Copy)]
pub struct ForwardPtrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub mask: MaskPtrs,
}

/// Device pointers of a backward call: [`BackwardIo`](crate::BackwardIo)'s buffers on one GPU.
#[derive(Debug, Clone, Copy)]
pub struct BackwardPtrs {
    pub d_out: u64,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub mask: MaskPtrs,
}

fn check_supported(p: &Problem) -> Result<()> {
    if !p.mask.is_plain() {
        return Err(FlashError::Unsupported("the CUDA kernels do not take windows, padding, segment ids, block masks or varlen batches yet".into()));
    }
    let d = p.dims.head_dim;
    if !d.is_multiple_of(8) {
        return Err(FlashError::Unsupported(format!(
            "the CUDA backend supports head_dim multiples of 8 (up to 256); got {d}"
        )));
    }
    for (what, n) in [("seq_q", p.dims.seq_q), ("seq_k", p.dims.seq_k), ("heads", p.dims.heads)] {
        if n > i32::MAX as usize {
            return Err(FlashError::Unsupported(format!("{what} = {n} exceeds the CUDA backend's limit")));
        }
    }
    Ok(())
}

fn params(p: &Problem) -> FlashParams {
    let d = &p.dims;
    FlashParams {
        q: 0,
        k: 0,
        v: 0,
        o: 0,
        lse: 0,
        dout: 0,
        dq: 0,
        dk: 0,
        dv: 0,
        delta: 0,
        lse_log2: 0,
        dq_accum: 0,
        batch: d.batch as i32,
        seqlen_q: d.seq_q as i32,
        seqlen_k: d.seq_k as i32,
        heads: d.heads as i32,
        heads_kv: d.kv_heads as i32,
        scale: p.scale,
        scale_log2: p.scale * std::f32::consts::LOG2_E,
        _pad: 0,
    }
}

fn grid_over(n: usize, block: usize) -> u32 {
    n.div_ceil(block) as u32
}

fn kernel_variant(dev: &Device, p: &Problem, kernel: Kernel) -> Result<Variant> {
    let d = &p.dims;
    let spec = Spec { kernel, dtype: p.dtype, head_dim: d.head_dim, causal: p.causal, group: d.group(), seq_k: d.seq_k };
    device::choose(dev, &config::candidates(&spec))
}

/// What every CUDA call does first, once: check that this backend takes `p`, open GPU `device`,
/// load NVRTC, and make the device's primary context current until the guard drops.
pub(super) fn prepare(p: &Problem, device: usize) -> Result<(Arc<Device>, ContextGuard)> {
    check_supported(p)?;
    let dev = device::device(device)?;
    libs::ensure_nvrtc()?;
    let ctx = ContextGuard::new(&dev)?;
    Ok((dev, ctx))
}

/// Forward on device memory: o = softmax(scale q k^T) v, lse = its logsumexp.
///
/// # Safety
/// The pointers must be device memory of GPU `device` with the sizes `p` implies (q/o
/// [B,Sq,H,D], k/v [B,Sk,Hkv,D] in `p.dtype`, lse [B,H,Sq] f32), valid until `stream` reaches this
/// work; `stream` (a CUstream as an integer, 0 = legacy default) must belong to that device's
/// primary context.
pub unsafe fn forward_device(p: &Problem, device: usize, stream: usize, ptrs: ForwardPtrs) -> Result<()> {
    catch_panics("CUDA", || {
        let (dev, _ctx) = prepare(p, device)?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { forward(&dev, p, stream as cu::CUstream, ptrs) }
    })
}

/// Backward on device memory: dq, dk, dv from dO, q, k, v, o and lse. Allocates 2·B·H·Sq floats
/// of workspace (stream-ordered) for delta and the log2-domain lse, and on the atomic-dQ path
/// B·Sq·H·D more for the f32 dQ sums.
///
/// # Safety
/// As [`forward_device`], for every pointer in `ptrs`.
pub unsafe fn backward_device(p: &Problem, device: usize, stream: usize, ptrs: BackwardPtrs) -> Result<()> {
    catch_panics("CUDA", || {
        let (dev, _ctx) = prepare(p, device)?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { backward(&dev, p, stream as cu::CUstream, ptrs) }
    })
}

/// The forward's launch on a [`prepare`]d device (its context current).
///
/// # Safety
/// As [`forward_device`].
pub(super) unsafe fn forward(dev: &Device, p: &Problem, s: cu::CUstream, ptrs: ForwardPtrs) -> Result<()> {
    let d = &p.dims;
    if d.batch == 0 || d.seq_q == 0 {
        return Ok(());
    }
    let mut prm = params(p);
    (prm.q, prm.k, prm.v, prm.o, prm.lse) = (ptrs.q, ptrs.k, ptrs.v, ptrs.o, ptrs.lse);
    let v = kernel_variant(dev, p, Kernel::Fwd)?;
    let f = device::function(dev, &v)?;
    // SAFETY: the caller guarantees the pointers; prm mirrors FlashParams.
    unsafe { launch("flash_fwd", f, (grid_over(d.seq_q, v.tiles.block_m), d.heads as u32, d.batch as u32), s, &prm) }
}

/// The backward's launches on a [`prepare`]d device (its context current).
///
/// # Safety
/// As [`backward_device`].
pub(super) unsafe fn backward(dev: &Device, p: &Problem, s: cu::CUstream, ptrs: BackwardPtrs) -> Result<()> {
    let d = &p.dims;
    if d.batch == 0 {
        return Ok(());
    }
    let stats = d.lse_len();
    let mut prm = params(p);
    (prm.q, prm.k, prm.v, prm.o, prm.lse, prm.dout) = (ptrs.q, ptrs.k, ptrs.v, ptrs.o, ptrs.lse, ptrs.d_out);
    (prm.dq, prm.dk, prm.dv) = (ptrs.dq, ptrs.dk, ptrs.dv);
    let atomic_dq = !p.deterministic;
    let vp = kernel_variant(dev, p, Kernel::BwdPreprocess)?;
    let fp = device::function(dev, &vp)?;
    let dq_len = if atomic_dq { d.q_len() } else { 0 };
    let work = DeviceBuffer::alloc((2 * stats + dq_len) * 4, s)?;
    prm.delta = work.ptr;
    prm.lse_log2 = work.ptr + (stats * 4) as u64;
    prm.dq_accum = work.ptr + (2 * stats * 4) as u64;
    let kv_grid = |v: &Variant| (grid_over(d.seq_k, v.tiles.block_n), d.kv_heads as u32, d.batch as u32);
    // SAFETY: caller-guaranteed pointers; workspace sized above; one stream orders the
    // preprocess (and the zeroing of dq_accum) before the gradient kernels, the conversion
    // after them and the workspace free after everything.
    unsafe {
        launch("flash_bwd_preprocess", fp, (grid_over(d.batch * d.seq_q * d.heads, vp.tiles.num_warps), 1, 1), s, &prm)?;
        if atomic_dq {
            let vk = kernel_variant(dev, p, Kernel::BwdDkdvDq)?;
            let vc = kernel_variant(dev, p, Kernel::BwdDqConvert)?;
            let (fk, fc) = (device::function(dev, &vk)?, device::function(dev, &vc)?);
            device::check("cuMemsetD32Async", cu::cuMemsetD32Async(prm.dq_accum, 0, dq_len, s))?;
            launch("flash_bwd_dkdv(atomic dQ)", fk, kv_grid(&vk), s, &prm)?;
            let pairs = dq_len / 2;
            let blocks = grid_over(pairs, vc.threads() as usize).min(8 * dev.sm_count.max(1) as u32);
            launch("flash_bwd_dq_convert", fc, (blocks, 1, 1), s, &prm)?;
        } else {
            let vq = kernel_variant(dev, p, Kernel::BwdDq)?;
            let vk = kernel_variant(dev, p, Kernel::BwdDkdv)?;
            let (fq, fk) = (device::function(dev, &vq)?, device::function(dev, &vk)?);
            launch("flash_bwd_dq", fq, (grid_over(d.seq_q, vq.tiles.block_m), d.heads as u32, d.batch as u32), s, &prm)?;
            launch("flash_bwd_dkdv", fk, kv_grid(&vk), s, &prm)?;
        }
    }
    drop(work);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_struct_matches_the_kernel_layout() {
        // 12 pointers, 5 ints, 2 floats, 1 pad int (cuda/params.h).
        assert_eq!(std::mem::size_of::<FlashParams>(), 12 * 8 + 8 * 4);
    }
}
