//! What every backend entry point does first: check host buffer lengths against the validated
//! problem, and turn a panic (a bug) into an error so it never unwinds into Python or the BEAM.

use crate::error::{FlashError, Result};
use crate::io::{BackwardIo, ForwardIo};
use crate::problem::Problem;

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
    let (qb, kvb, lb) = byte_sizes(p);
    check(&[("q", io.q.len(), qb), ("k", io.k.len(), kvb), ("v", io.v.len(), kvb), ("o", io.o.len(), qb), ("lse", io.lse.len(), lb)])
}

/// As [`check_forward_buffers`], for the backward's nine buffers.
pub(crate) fn check_backward_buffers(p: &Problem, io: &BackwardIo) -> Result<()> {
    let (qb, kvb, lb) = byte_sizes(p);
    check(&[
        ("d_out", io.d_out.len(), qb),
        ("q", io.q.len(), qb),
        ("k", io.k.len(), kvb),
        ("v", io.v.len(), kvb),
        ("o", io.o.len(), qb),
        ("lse", io.lse.len(), lb),
        ("dq", io.dq.len(), qb),
        ("dk", io.dk.len(), kvb),
        ("dv", io.dv.len(), kvb),
    ])
}

fn byte_sizes(p: &Problem) -> (usize, usize, usize) {
    let e = p.dtype.size_bytes();
    (p.dims.q_len() * e, p.dims.kv_len() * e, p.dims.lse_len() * 4)
}

fn check(bufs: &[(&str, usize, usize)]) -> Result<()> {
    for &(name, got, want) in bufs {
        if got != want {
            return Err(FlashError::Shape(format!("{name} buffer holds {got} bytes; the problem needs {want}")));
        }
    }
    Ok(())
}
