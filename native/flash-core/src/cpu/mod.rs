//! The CPU backend: multithreaded (rayon) tiled FlashAttention in f32, O(B·H·S·D) extra memory.

mod backward;
mod forward;
mod layout;
#[doc(hidden)]
pub mod matmul;
pub mod simd;
mod vector;
mod workspace;

use crate::error::Result;
use crate::guard::{catch_panics, check_backward_buffers, check_forward_buffers};
use crate::problem::Problem;

/// Forward. q: [B, Sq, H, D], k/v: [B, Sk, Hkv, D] in p.dtype (native-endian bytes, row-major);
/// fills o ([B, Sq, H, D], p.dtype) and lse ([B, H, Sq], f32).
pub fn forward(p: &Problem, q: &[u8], k: &[u8], v: &[u8], o: &mut [u8], lse: &mut [u8]) -> Result<()> {
    check_forward_buffers(p, q, k, v, o, lse)?;
    catch_panics("CPU", || forward::run(p, q, k, v, o, lse))
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
    check_backward_buffers(p, d_out, q, k, v, o, lse, dq, dk, dv)?;
    catch_panics("CPU", || backward::run(p, d_out, q, k, v, o, lse, dq, dk, dv))
}

/// Number of threads the CPU kernels run on.
pub fn threads() -> usize {
    rayon::current_num_threads()
}
