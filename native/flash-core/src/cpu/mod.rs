//! The CPU backend: multithreaded (rayon) tiled FlashAttention in f32, O(B·H·S·D) extra memory.
//! Every mask of [`Mask`](crate::Mask) is taken; the tiles it hides are skipped (module `tiles`).
//! Beside it, the materialized path (module `materialized`: whole S×S scores per head), chosen
//! per call by [`dispatch`](crate::dispatch). Both read their inputs where they lie
//! ([`ForwardIo::strides`] / [`BackwardIo::strides`]); outputs are packed.

mod backward;
mod batch;
pub(crate) mod decode;
#[cfg(target_arch = "x86_64")]
mod decode_amx;
#[cfg(target_arch = "x86_64")]
mod decode_bf16;
mod decode_rows;
#[cfg(target_arch = "x86_64")]
mod decode_vnni;
mod forward;
mod layout;
pub(crate) mod materialized;
#[doc(hidden)]
pub mod matmul;
mod modify;
pub(crate) mod par;
mod rotary;
pub mod simd;
mod tiles;
mod transpose;
mod vector;
mod workspace;

#[doc(hidden)]
pub use par::on_the_pool;

use crate::dispatch::{self, Backend, Pass, Path};
use crate::error::Result;
use crate::guard::{catch_panics, check_backward_buffers, check_forward_buffers};
use crate::io::{BackwardIo, ForwardIo};
use crate::problem::Problem;
use crate::rotary::{RotaryIo, RotaryProblem};

/// Forward on the CPU (layouts in [`ForwardIo`]).
pub fn forward(p: &Problem, io: ForwardIo) -> Result<()> {
    check_forward_buffers(p, &io)?;
    let ns = par::attention_ns(products(p));
    match dispatch::choose(p, Backend::Cpu, Pass::Forward)? {
        Path::Fused => catch_panics("CPU", || par::call(ns, || forward::run(p, io))),
        Path::Materialized => catch_panics("CPU", || par::call(ns, || materialized::forward(p, io))),
    }
}

/// Backward on the CPU from the forward's o and lse (layouts in [`BackwardIo`]).
pub fn backward(p: &Problem, io: BackwardIo) -> Result<()> {
    check_backward_buffers(p, &io)?;
    let ns = par::attention_ns(2.5 * products(p)); // five products to the forward's two
    match dispatch::choose(p, Backend::Cpu, Pass::Backward)? {
        Path::Fused => catch_panics("CPU", || par::call(ns, || backward::run(p, io))),
        Path::Materialized => catch_panics("CPU", || par::call(ns, || materialized::backward(p, io))),
    }
}

/// Rotary embeddings on the CPU (layouts in [`RotaryIo`]).
pub fn rotary(p: &RotaryProblem, io: RotaryIo) -> Result<()> {
    crate::rotary::check_buffers(p, &io)?;
    let ns = par::pass_ns(2.0 * io.y.len() as f64);
    catch_panics("CPU", || par::call(ns, || rotary::run(p, io)))
}

/// Whether decode's scores over bf16 and quantized K caches can take the AMX tiles on this machine
/// (decode_amx.rs: the CPU has AMX-BF16, the OS grants the tile data, FLASH_NIF_CPU_AMX is not 0);
/// a call takes them with bf16 q and 8 states per kv head or more.
pub fn decode_amx() -> bool {
    #[cfg(target_arch = "x86_64")]
    return decode_amx::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether decode over a 4-bit K cache can take the byte dot products on this machine
/// (decode_vnni.rs: the CPU has AVX512-VNNI, -BW and -VBMI, FLASH_NIF_CPU_VNNI is not 0); a call
/// takes them with bf16 q where the AMX tiles do not take the scores, and the 16-bit ones for P V
/// over a 4-bit V with groups of 64.
pub fn decode_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    return decode_vnni::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The forward's multiply-adds, masks aside: B·H·Sq·Sk·(D + Dv).
fn products(p: &Problem) -> f64 {
    let d = &p.dims;
    [d.batch, d.heads, d.seq_q, d.seq_k, d.head_dim + d.head_dim_v].iter().map(|&x| x as f64).product()
}

/// Number of threads the CPU kernels run on.
pub fn threads() -> usize {
    rayon::current_num_threads()
}
