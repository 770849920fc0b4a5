//! The CUDA backend: kernels from cuda/ compiled at run time by NVRTC, launched through cudarc's
//! driver bindings with dynamic loading (the crate builds and runs without CUDA; asking for the GPU
//! there is a [`FlashError::CudaUnavailable`], never a panic).
//!
//! Two ways in:
//! - device pointers ([`forward_device`], [`backward_device`]): the caller's tensors already live on
//!   GPU `device`; the kernels run on the caller's `stream` (0 = the legacy default stream) and
//!   nothing is synchronised. Used for CuPy arrays and DLPack (torch) tensors.
//! - host memory ([`forward_host`], [`backward_host`]): bytes are copied to the GPU, computed, and
//!   copied back (the Elixir NIF's `device: :cuda`, NumPy with `device="cuda"`).
//!
//! The backward has two paths (every dtype). The default: one dK/dV kernel per key block that also
//! adds dS K into an f32 dQ workspace with atomics (5 tile GEMMs per tile pair), then a conversion
//! kernel — dK and dV are bit-identical run to run, dQ may differ in the last bits because the
//! order of the atomic additions varies. `deterministic`: separate dQ and dK/dV kernels, each
//! output element owned by one block, no atomics (7 tile GEMMs).

mod compile;
pub mod config;
mod device;
mod libs;
mod sources;

use std::ffi::c_void;

use cudarc::driver::sys as cu;

pub use compile::{cache_dir, compile_with, nvrtc_version, parse_ptxas, Compiled};
pub use config::{all_variants, variant, Kernel, Variant};
pub use libs::add_search_roots;

use crate::dtype::DType;
use crate::error::{FlashError, Result};
use crate::guard::{catch_panics, check_backward_buffers, check_forward_buffers};
use crate::problem::Problem;
use device::{launch, ContextGuard, DeviceBuffer};

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

/// Device pointers of a forward call (each on the same GPU, contiguous, in the problem's dtype;
/// lse is f32).
#[derive(Debug, Clone, Copy)]
pub struct ForwardPtrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
}

/// Device pointers of a backward call.
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
}

/// What `flash_nif.info()` reports about a GPU.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub arch: String,
    pub multiprocessors: i32,
    pub nvrtc_version: (i32, i32),
    pub nvrtc_source: String,
    pub cache_dir: std::path::PathBuf,
}


/// Number of visible CUDA devices; an error says why there are none usable.
pub fn device_count() -> Result<usize> {
    catch_panics("CUDA", device::device_count)
}

/// Is a GPU usable (driver, a device, and NVRTC)? Err explains why not.
pub fn available() -> Result<()> {
    catch_panics("CUDA", || {
        if device::device_count()? == 0 {
            return Err(FlashError::CudaUnavailable("the CUDA driver reports no device".into()));
        }
        libs::ensure_nvrtc()?;
        Ok(())
    })
}

/// GPU name, arch, NVRTC version and cache directory.
pub fn info(ordinal: usize) -> Result<DeviceInfo> {
    catch_panics("CUDA", || {
        let d = device::device(ordinal)?;
        let src = libs::ensure_nvrtc()?;
        Ok(DeviceInfo {
            ordinal,
            name: d.name.clone(),
            compute_capability: d.cc,
            arch: d.arch.clone(),
            multiprocessors: d.sm_count,
            nvrtc_version: compile::nvrtc_version()?,
            nvrtc_source: src,
            cache_dir: compile::cache_dir(),
        })
    })
}

fn check_supported(p: &Problem) -> Result<()> {
    let d = p.dims.head_dim;
    if d % 8 != 0 {
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

fn kernel_variant(dev: &device::Device, p: &Problem, k: Kernel) -> Variant {
    let d = &p.dims;
    let max_smem = dev.max_smem_optin.max(0) as usize;
    config::variant_for(max_smem, k, p.dtype, d.head_dim, p.causal, d.group(), d.seq_q, d.seq_k)
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
        check_supported(p)?;
        let dev = device::device(device)?;
        libs::ensure_nvrtc()?;
        let _ctx = ContextGuard::new(&dev)?;
        let s = stream as cu::CUstream;
        let d = &p.dims;
        if d.batch == 0 || d.seq_q == 0 {
            return Ok(());
        }
        let mut prm = params(p);
        (prm.q, prm.k, prm.v, prm.o, prm.lse) = (ptrs.q, ptrs.k, ptrs.v, ptrs.o, ptrs.lse);
        let v = kernel_variant(&dev, p, Kernel::Fwd);
        let f = device::function(&dev, &v)?;
        // SAFETY: the caller guarantees the pointers; prm mirrors FlashParams.
        unsafe { launch("flash_fwd", f, (grid_over(d.seq_q, v.block_m), d.heads as u32, d.batch as u32), s, &prm) }
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
        check_supported(p)?;
        let dev = device::device(device)?;
        libs::ensure_nvrtc()?;
        let _ctx = ContextGuard::new(&dev)?;
        let s = stream as cu::CUstream;
        let d = &p.dims;
        if d.batch == 0 {
            return Ok(());
        }
        let stats = d.lse_len();
        let mut prm = params(p);
        (prm.q, prm.k, prm.v, prm.o, prm.lse, prm.dout) = (ptrs.q, ptrs.k, ptrs.v, ptrs.o, ptrs.lse, ptrs.d_out);
        (prm.dq, prm.dk, prm.dv) = (ptrs.dq, ptrs.dk, ptrs.dv);
        let atomic_dq = !p.deterministic;
        let vp = kernel_variant(&dev, p, Kernel::BwdPreprocess);
        let fp = device::function(&dev, &vp)?;
        let dq_len = if atomic_dq { d.q_len() } else { 0 };
        let work = DeviceBuffer::alloc((2 * stats + dq_len) * 4, s)?;
        prm.delta = work.ptr;
        prm.lse_log2 = work.ptr + (stats * 4) as u64;
        prm.dq_accum = work.ptr + (2 * stats * 4) as u64;
        let kv_grid = |v: &Variant| (grid_over(d.seq_k, v.block_n), d.kv_heads as u32, d.batch as u32);
        // SAFETY: caller-guaranteed pointers; workspace sized above; one stream orders the
        // preprocess (and the zeroing of dq_accum) before the gradient kernels, the conversion
        // after them and the workspace free after everything.
        unsafe {
            launch("flash_bwd_preprocess", fp, (grid_over(d.batch * d.seq_q * d.heads, vp.num_warps), 1, 1), s, &prm)?;
            if atomic_dq {
                let vk = kernel_variant(&dev, p, Kernel::BwdDkdvDq);
                let vc = kernel_variant(&dev, p, Kernel::BwdDqConvert);
                let (fk, fc) = (device::function(&dev, &vk)?, device::function(&dev, &vc)?);
                device::check("cuMemsetD32Async", cu::cuMemsetD32Async(prm.dq_accum, 0, dq_len, s))?;
                launch("flash_bwd_dkdv(atomic dQ)", fk, kv_grid(&vk), s, &prm)?;
                let pairs = dq_len / 2;
                let blocks = grid_over(pairs, vc.threads() as usize).min(8 * dev.sm_count.max(1) as u32);
                launch("flash_bwd_dq_convert", fc, (blocks, 1, 1), s, &prm)?;
            } else {
                let vq = kernel_variant(&dev, p, Kernel::BwdDq);
                let vk = kernel_variant(&dev, p, Kernel::BwdDkdv);
                let (fq, fk) = (device::function(&dev, &vq)?, device::function(&dev, &vk)?);
                launch("flash_bwd_dq", fq, (grid_over(d.seq_q, vq.block_m), d.heads as u32, d.batch as u32), s, &prm)?;
                launch("flash_bwd_dkdv", fk, kv_grid(&vk), s, &prm)?;
            }
        }
        drop(work);
        Ok(())
    })
}

/// A private stream for host-memory calls, destroyed on drop.
struct Stream(cu::CUstream);

impl Stream {
    fn new() -> Result<Stream> {
        let mut s: cu::CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer; a context is current.
        device::check("cuStreamCreate", unsafe {
            cu::cuStreamCreate(&mut s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream(s))
    }
    fn sync(&self) -> Result<()> {
        // SAFETY: live stream.
        device::check("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(self.0) })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created in new(), destroyed once (pending work still completes).
        unsafe {
            cu::cuStreamSynchronize(self.0);
            cu::cuStreamDestroy_v2(self.0);
        }
    }
}

fn upload(buf: &DeviceBuffer, src: &[u8], s: &Stream) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    // SAFETY: the buffer holds at least src.len() bytes; the host slice outlives the sync below.
    device::check("cuMemcpyHtoDAsync", unsafe {
        cu::cuMemcpyHtoDAsync_v2(buf.ptr, src.as_ptr() as *const c_void, src.len(), s.0)
    })
}

fn download(dst: &mut [u8], buf: &DeviceBuffer, s: &Stream) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    // SAFETY: as upload; the caller synchronises before dst is read.
    device::check("cuMemcpyDtoHAsync", unsafe {
        cu::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, buf.ptr, dst.len(), s.0)
    })
}

/// Forward on host memory through GPU `device` (copy in, compute, copy out; synchronous).
pub fn forward_host(p: &Problem, device: usize, q: &[u8], k: &[u8], v: &[u8], o: &mut [u8], lse: &mut [u8]) -> Result<()> {
    check_forward_buffers(p, q, k, v, o, lse)?;
    catch_panics("CUDA", || {
        check_supported(p)?;
        let dev = device::device(device)?;
        libs::ensure_nvrtc()?;
        let _ctx = ContextGuard::new(&dev)?;
        let s = Stream::new()?;
        let bufs = [q.len(), k.len(), v.len(), o.len(), lse.len()].map(|n| DeviceBuffer::alloc(n, s.0));
        let [bq, bk, bv, bo, bl] = bufs;
        let (bq, bk, bv, bo, bl) = (bq?, bk?, bv?, bo?, bl?);
        upload(&bq, q, &s)?;
        upload(&bk, k, &s)?;
        upload(&bv, v, &s)?;
        let ptrs = ForwardPtrs { q: bq.ptr, k: bk.ptr, v: bv.ptr, o: bo.ptr, lse: bl.ptr };
        // SAFETY: buffers sized from the problem, on this device, ordered on stream s.
        unsafe { forward_device(p, device, s.0 as usize, ptrs)? };
        download(o, &bo, &s)?;
        download(lse, &bl, &s)?;
        s.sync()
    })
}

/// Backward on host memory through GPU `device` (copy in, compute, copy out; synchronous).
#[allow(clippy::too_many_arguments)]
pub fn backward_host(
    p: &Problem,
    device: usize,
    d_out: &[u8],
    q: &[u8],
    k: &[u8],
    v: &[u8],
    o: &[u8],
    lse: &[u8],
    dq: &mut [u8],
    dk: &mut [u8],
    dv: &mut [u8],
) -> Result<()> {
    check_backward_buffers(p, d_out, q, k, v, o, lse, dq, dk, dv)?;
    catch_panics("CUDA", || {
        check_supported(p)?;
        let dev = device::device(device)?;
        libs::ensure_nvrtc()?;
        let _ctx = ContextGuard::new(&dev)?;
        let s = Stream::new()?;
        let sizes = [d_out.len(), q.len(), k.len(), v.len(), o.len(), lse.len(), dq.len(), dk.len(), dv.len()];
        let mut bufs = Vec::with_capacity(sizes.len());
        for n in sizes {
            bufs.push(DeviceBuffer::alloc(n, s.0)?);
        }
        for (b, src) in bufs.iter().zip([d_out, q, k, v, o, lse]) {
            upload(b, src, &s)?;
        }
        let ptr = |i: usize| bufs[i].ptr;
        let ptrs = BackwardPtrs {
            d_out: ptr(0),
            q: ptr(1),
            k: ptr(2),
            v: ptr(3),
            o: ptr(4),
            lse: ptr(5),
            dq: ptr(6),
            dk: ptr(7),
            dv: ptr(8),
        };
        // SAFETY: buffers sized from the problem, on this device, ordered on stream s.
        unsafe { backward_device(p, device, s.0 as usize, ptrs)? };
        download(dq, &bufs[6], &s)?;
        download(dk, &bufs[7], &s)?;
        download(dv, &bufs[8], &s)?;
        s.sync()
    })
}

/// Compile report of one variant for `arch` with no GPU: (registers, spill bytes, stack bytes,
/// shared memory bytes). Bypasses the caches.
pub fn compile_report(v: &Variant, arch: &str) -> Result<(i64, i64, i64, usize)> {
    catch_panics("CUDA", || {
        let c = compile::compile_with(v, arch, true)?;
        let (regs, spill, stack) = compile::parse_ptxas(&c.log);
        Ok((regs, spill, stack, v.smem_bytes()))
    })
}

/// The dtype's short name used in variant names ("f16", "bf16", "f32").
pub fn dtype_short(d: DType) -> &'static str {
    config::dtype_short(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_struct_matches_the_kernel_layout() {
        // 12 pointers, 5 ints, 2 floats, 1 pad int (cuda/params.h).
        assert_eq!(std::mem::size_of::<FlashParams>(), 12 * 8 + 8 * 4);
    }

    #[test]
    fn missing_gpu_is_an_error_not_a_panic() {
        if let Err(e) = available() {
            assert!(matches!(e, FlashError::CudaUnavailable(_)), "{e:?}");
        }
    }

    #[test]
    fn nvrtc_compiles_a_kernel_when_present() {
        if libs::ensure_nvrtc().is_err() {
            return; // no NVRTC on this machine: nothing to check
        }
        let v = variant(Kernel::Fwd, DType::BF16, 72, true, 2, 100, 100);
        let (regs, spill, _, smem) = compile_report(&v, "sm_80").expect("compiles");
        assert!(regs > 0 && spill == 0 && smem > 0, "{regs} {spill} {smem}");
    }
}
