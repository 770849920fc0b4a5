//! Host staging: copy host buffers to the GPU on a private stream, run the launch sequence,
//! copy the outputs back and synchronise.

use std::ffi::c_void;

use cudarc::driver::sys as cu;

use super::device::{self, Device, DeviceBuffer};
use super::launch::{self, BackwardPtrs, ForwardPtrs, MaskPtrs};
use crate::error::Result;
use crate::guard::{catch_panics, check_backward_buffers, check_forward_buffers};
use crate::io::{BackwardIo, ForwardIo};
use crate::mask::MaskBuffers;
use crate::problem::Problem;

/// A private stream for host-memory calls, destroyed on drop.
pub(super) struct Stream(pub(super) cu::CUstream);

impl Stream {
    pub(super) fn new() -> Result<Stream> {
        let mut s: cu::CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer; a context is current.
        device::check("cuStreamCreate", unsafe {
            cu::cuStreamCreate(&mut s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream(s))
    }
    pub(super) fn sync(&self) -> Result<()> {
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

/// A device copy of `src` (stream-ordered on `s`).
pub(super) fn upload(src: &[u8], s: &Stream) -> Result<DeviceBuffer> {
    let buf = DeviceBuffer::alloc(src.len(), s.0)?;
    if !src.is_empty() {
        // SAFETY: the buffer holds src.len() bytes; the host slice outlives the sync that ends
        // every host call.
        device::check("cuMemcpyHtoDAsync", unsafe {
            cu::cuMemcpyHtoDAsync_v2(buf.ptr, src.as_ptr() as *const c_void, src.len(), s.0)
        })?;
    }
    Ok(buf)
}

/// Device copies of the mask data the call has, and their pointers (0 where absent).
struct MaskUpload {
    _bufs: Vec<DeviceBuffer>,
    ptrs: MaskPtrs,
}

fn upload_masks(m: &MaskBuffers, s: &Stream) -> Result<MaskUpload> {
    let mut bufs = Vec::new();
    let mut put = |src: Option<&[u8]>| -> Result<u64> {
        let Some(src) = src else { return Ok(0) };
        let b = upload(src, s)?;
        let ptr = b.ptr;
        bufs.push(b);
        Ok(ptr)
    };
    let ptrs = MaskPtrs { seg_q: put(m.seg_q)?, seg_k: put(m.seg_k)?, block_mask: put(m.block_mask)? };
    Ok(MaskUpload { _bufs: bufs, ptrs })
}

pub(super) fn download(dst: &mut [u8], buf: &DeviceBuffer, s: &Stream) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    // SAFETY: as upload; the caller synchronises before dst is read.
    device::check("cuMemcpyDtoHAsync", unsafe {
        cu::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, buf.ptr, dst.len(), s.0)
    })
}

/// Runs `body` on a [`prepare`](launch::prepare)d GPU `device` with a private stream, then waits
/// for the stream (so the host buffers `body` copied from and to are done with).
fn staged(p: &Problem, device: usize, body: impl FnOnce(&Device, &Stream) -> Result<()>) -> Result<()> {
    catch_panics("CUDA", || {
        let (dev, _ctx) = launch::prepare(p, device)?;
        let s = Stream::new()?;
        body(&dev, &s)?;
        s.sync()
    })
}

/// Forward on host memory through GPU `device` (copy in, compute, copy out; synchronous).
pub fn forward_host(p: &Problem, device: usize, io: ForwardIo) -> Result<()> {
    check_forward_buffers(p, &io)?;
    staged(p, device, |dev, s| {
        let (q, k, v) = (upload(io.q, s)?, upload(io.k, s)?, upload(io.v, s)?);
        let mask = upload_masks(&io.mask, s)?;
        let (o, lse) = (DeviceBuffer::alloc(io.o.len(), s.0)?, DeviceBuffer::alloc(io.lse.len(), s.0)?);
        let ptrs = ForwardPtrs { q: q.ptr, k: k.ptr, v: v.ptr, o: o.ptr, lse: lse.ptr, mask: mask.ptrs, strides: io.strides };
        // SAFETY: buffers sized from the problem, on this device, ordered on stream s.
        unsafe { launch::forward(dev, p, s.0, ptrs)? };
        download(io.o, &o, s)?;
        download(io.lse, &lse, s)
    })
}

/// Backward on host memory through GPU `device` (copy in, compute, copy out; synchronous).
pub fn backward_host(p: &Problem, device: usize, io: BackwardIo) -> Result<()> {
    check_backward_buffers(p, &io)?;
    staged(p, device, |dev, s| {
        let (d_out, q, k) = (upload(io.d_out, s)?, upload(io.q, s)?, upload(io.k, s)?);
        let (v, o, lse) = (upload(io.v, s)?, upload(io.o, s)?, upload(io.lse, s)?);
        let mask = upload_masks(&io.mask, s)?;
        let [dq, dk, dv] = [io.dq.len(), io.dk.len(), io.dv.len()].map(|n| DeviceBuffer::alloc(n, s.0));
        let (dq, dk, dv) = (dq?, dk?, dv?);
        let dsinks = io.dsinks.as_ref().map(|d| DeviceBuffer::alloc(d.len(), s.0)).transpose()?;
        let dlse = io.dlse.map(|d| upload(d, s)).transpose()?;
        let ptrs = BackwardPtrs {
            d_out: d_out.ptr, q: q.ptr, k: k.ptr, v: v.ptr, o: o.ptr, lse: lse.ptr,
            dq: dq.ptr, dk: dk.ptr, dv: dv.ptr, dsinks: dsinks.as_ref().map_or(0, |d| d.ptr),
            dlse: dlse.as_ref().map_or(0, |d| d.ptr), mask: mask.ptrs, strides: io.strides,
        };
        // SAFETY: buffers sized from the problem, on this device, ordered on stream s.
        unsafe { launch::backward(dev, p, s.0, ptrs)? };
        download(io.dq, &dq, s)?;
        download(io.dk, &dk, s)?;
        download(io.dv, &dv, s)?;
        match (io.dsinks, &dsinks) {
            (Some(dst), Some(buf)) => download(dst, buf, s),
            _ => Ok(()),
        }
    })
}
