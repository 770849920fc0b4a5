//! The CPU backend: multithreaded (rayon) tiled FlashAttention in f32, O(B·H·S·D) extra memory.

mod backward;
mod forward;
mod layout;
#[doc(hidden)]
pub mod matmul;
pub mod simd;
mod vector;
mod workspace;

use crate::error::{FlashError, Result};
use crate::problem::Problem;

/// Forward. q: [B, Sq, H, D], k/v: [B, Sk, Hkv, D] in p.dtype (native-endian bytes, row-major);
/// fills o ([B, Sq, H, D], p.dtype) and lse ([B, H, Sq], f32).
pub fn forward(p: &Problem, q: &[u8], k: &[u8], v: &[u8], o: &mut [u8], lse: &mut [u8]) -> Result<()> {
    let (q_bytes, kv_bytes, lse_bytes) = byte_sizes(p);
    check_len(&[("q", q.len(), q_bytes), ("k", k.len(), kv_bytes), ("v", v.len(), kv_bytes)])?;
    check_len(&[("o", o.len(), q_bytes), ("lse", lse.len(), lse_bytes)])?;
    guarded(|| forward::run(p, q, k, v, o, lse))
}

/// Backward from the forward's o and lse. Fills dq ([B, Sq, H, D]), dk and dv ([B, Sk, Hkv, D]),
/// all in p.dtype; dk/dv sum over each kv head's group of query heads.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    p: &Problem,
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
    let (q_bytes, kv_bytes, lse_bytes) = byte_sizes(p);
    check_len(&[
        ("d_out", d_out.len(), q_bytes),
        ("q", q.len(), q_bytes),
        ("k", k.len(), kv_bytes),
        ("v", v.len(), kv_bytes),
        ("o", o.len(), q_bytes),
        ("lse", lse.len(), lse_bytes),
    ])?;
    check_len(&[("dq", dq.len(), q_bytes), ("dk", dk.len(), kv_bytes), ("dv", dv.len(), kv_bytes)])?;
    guarded(|| backward::run(p, d_out, q, k, v, o, lse, dq, dk, dv))
}

/// Number of threads the CPU kernels run on.
pub fn threads() -> usize {
    rayon::current_num_threads()
}

fn byte_sizes(p: &Problem) -> (usize, usize, usize) {
    let e = p.dtype.size_bytes();
    (p.dims.q_len() * e, p.dims.kv_len() * e, p.dims.lse_len() * 4)
}

fn check_len(bufs: &[(&str, usize, usize)]) -> Result<()> {
    for &(name, got, want) in bufs {
        if got != want {
            return Err(FlashError::Shape(format!("{name} buffer holds {got} bytes; the problem needs {want}")));
        }
    }
    Ok(())
}

/// Runs `f`, turning a panic (a bug) into an error so it never unwinds into Python or the BEAM.
fn guarded(f: impl FnOnce() -> Result<()>) -> Result<()> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(FlashError::Internal(format!("panic in CPU kernel: {msg}")))
    })
}
