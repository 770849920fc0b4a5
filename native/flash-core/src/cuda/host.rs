//! Host staging: copy host buffers to the GPU on a private stream, run the launch sequence,
//! copy the outputs back and synchronise.

use std::ffi::c_void;

use cudarc::driver::sys as cu;

use super::device::{self, ContextGuard, DeviceBuffer};
use super::launch::{backward_device, check_supported, forward_device, BackwardPtrs, ForwardPtrs};
use super::libs;
use crate::error::Result;
use crate::guard::{catch_panics, check_backward_buffers, check_forward_buffers};
use crate::problem::Problem;

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
