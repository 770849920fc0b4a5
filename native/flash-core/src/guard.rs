//! What every backend entry point does first: check host buffer lengths against the validated
//! problem, and turn a panic (a bug) into an error so it never unwinds into Python or the BEAM.

use crate::error::{FlashError, Result};
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

/// q/o: [B, Sq, H, D] and k/v: [B, Sk, Hkv, D] in p.dtype; lse: [B, H, Sq] f32.
pub(crate) fn check_forward_buffers(p: &Problem, q: &[u8], k: &[u8], v: &[u8], o: &[u8], lse: &[u8]) -> Result<()> {
    let (qb, kvb, lb) = byte_sizes(p);
    check(&[("q", q.len(), qb), ("k", k.len(), kvb), ("v", v.len(), kvb), ("o", o.len(), qb), ("lse", lse.len(), lb)])
}

/// The forward's buffers plus d_out and dq (like q), dk and dv (like k).
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_backward_buffers(
    p: &Problem,
    d_out: &[u8],
    q: &[u8],
    k: &[u8],
    v: &[u8],
    o: &[u8],
    lse: &[u8],
    dq: &[u8],
    dk: &[u8],
    dv: &[u8],
) -> Result<()> {
    check_forward_buffers(p, q, k, v, o, lse)?;
    let (qb, kvb, _) = byte_sizes(p);
    check(&[("d_out", d_out.len(), qb), ("dq", dq.len(), qb), ("dk", dk.len(), kvb), ("dv", dv.len(), kvb)])
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
