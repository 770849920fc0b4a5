//! What every backend entry point does first: check host buffer lengths against the validated
//! problem, and turn a panic (a bug) into an error so it never unwinds into Python or the BEAM.

use crate::error::{FlashError, Result};
use crate::io::{BackwardIo, ForwardIo};
use crate::mask::MaskBuffers;
use crate::problem::Problem;
use crate::strides::{InputStrides, Strides};

/// Runs `f`; a panic becomes `FlashError::Internal` naming the backend.
pub(crate) fn catch_panics<T>(backend: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(FlashError::Internal(format!("panic in the {backend} backend: {msg}")))
    })
}

/// The buffers must have the sizes `p` implies (a Rust caller could pair a problem with other
/// buffers; the kernels trust these sizes).
pub(crate) fn check_forward_buffers(p: &Problem, io: &ForwardIo) -> Result<()> {
    let b = byte_sizes(p);
    check(&[("o", io.o.len(), b.o), ("lse", io.lse.len(), b.lse)])?;
    let spans = InputSpans::of(p, io.strides);
    check_inputs(&[("q", io.q.len(), spans.q), ("k", io.k.len(), spans.k), ("v", io.v.len(), spans.v)], io.strides.is_some())?;
    check_mask_buffers(p, &io.mask)
}

/// As [`check_forward_buffers`], for the backward's nine buffers.
pub(crate) fn check_backward_buffers(p: &Problem, io: &BackwardIo) -> Result<()> {
    let b = byte_sizes(p);
    check(&[("lse", io.lse.len(), b.lse), ("dq", io.dq.len(), b.q), ("dk", io.dk.len(), b.k), ("dv", io.dv.len(), b.v)])?;
    let s = InputSpans::of(p, io.strides);
    let inputs = [("d_out", io.d_out.len(), s.d_out), ("q", io.q.len(), s.q), ("k", io.k.len(), s.k), ("v", io.v.len(), s.v), ("o", io.o.len(), s.o)];
    check_inputs(&inputs, io.strides.is_some())?;
    if let Some(dlse) = io.dlse {
        check(&[("dlse", dlse.len(), b.lse)])?;
    }
    check_mask_buffers(p, &io.mask)?;
    check_dsinks(p, io.dsinks.as_deref().map(<[u8]>::len))
}

/// dsinks' output (f32 [H]) is present exactly when the problem has sinks.
pub(crate) fn check_dsinks(p: &Problem, bytes: Option<usize>) -> Result<()> {
    let want = p.mods.sinks.as_ref().map(|_| p.dims.heads * 4);
    if bytes != want {
        return Err(FlashError::Internal(format!("dsinks buffer: {bytes:?} bytes for a problem that needs {want:?}")));
    }
    Ok(())
}

/// Segment ids and the block mask are present exactly when the problem has them, at its sizes.
pub(crate) fn check_mask_buffers(p: &Problem, m: &MaskBuffers) -> Result<()> {
    let d = &p.dims;
    let segs = p.mask.segments.then_some((d.batch * d.seq_q * 4, d.batch * d.seq_k * 4));
    let blocks = p.mask.block_mask.map(|s| s.len());
    let sizes = [("seg_q", m.seg_q, segs.map(|s| s.0)), ("seg_k", m.seg_k, segs.map(|s| s.1)), ("block_mask", m.block_mask, blocks)];
    for (name, buf, want) in sizes {
        match (buf, want) {
            (Some(b), Some(w)) if b.len() == w => {}
            (None, None) => {}
            (b, w) => {
                let got = b.map(<[u8]>::len);
                return Err(FlashError::Internal(format!("{name} buffer: {got:?} bytes for a problem that needs {w:?}")));
            }
        }
    }
    Ok(())
}

/// Bytes of q (dq), k (dk), v (dv), o (dO) and lse.
struct ByteSizes {
    q: usize,
    k: usize,
    v: usize,
    o: usize,
    lse: usize,
}

fn byte_sizes(p: &Problem) -> ByteSizes {
    let e = p.dtype.size_bytes();
    ByteSizes { q: p.q_len() * e, k: p.kv_len() * e, v: p.v_len() * e, o: p.o_len() * e, lse: p.lse_len() * 4 }
}

/// Bytes from each input's first element to one past its last, as its strides lay it out.
pub(crate) struct InputSpans {
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub o: usize,
    pub d_out: usize,
}

impl InputSpans {
    pub fn of(p: &Problem, strides: Option<InputStrides>) -> InputSpans {
        let s = strides.unwrap_or_else(|| InputStrides::packed(p));
        let e = p.dtype.size_bytes();
        let span = |st: Strides, shape: Vec<usize>| st.extent(&shape) * e;
        InputSpans {
            q: span(s.q, p.q_shape()),
            k: span(s.k, p.kv_shape()),
            v: span(s.v, p.v_shape()),
            o: span(s.o, p.o_shape()),
            d_out: span(s.d_out, p.o_shape()),
        }
    }
}

/// Packed inputs hold exactly their bytes; strided ones at least their span.
fn check_inputs(bufs: &[(&str, usize, usize)], strided: bool) -> Result<()> {
    if !strided {
        return check(bufs);
    }
    for &(name, got, want) in bufs {
        if got < want {
            return Err(FlashError::Shape(format!("{name} buffer holds {got} bytes; its strides reach {want}")));
        }
    }
    Ok(())
}

fn check(bufs: &[(&str, usize, usize)]) -> Result<()> {
    for &(name, got, want) in bufs {
        if got != want {
            return Err(FlashError::Shape(format!("{name} buffer holds {got} bytes; the problem needs {want}")));
        }
    }
    Ok(())
}
