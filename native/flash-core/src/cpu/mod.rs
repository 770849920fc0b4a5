//! The CPU backend: multithreaded (rayon) tiled FlashAttention in f32, O(B·H·S·D) extra memory.
//! Every mask of [`Mask`](crate::Mask) is taken; the tiles it hides are skipped (module `tiles`).

mod backward;
mod batch;
mod forward;
mod layout;
#[doc(hidden)]
pub mod matmul;
mod modify;
mod rotary;
pub mod simd;
mod tiles;
mod vector;
mod workspace;

use crate::error::Result;
use crate::guard::{catch_panics, check_backward_buffers, check_forward_buffers};
use crate::io::{BackwardIo, ForwardIo};
use crate::problem::Problem;
use crate::rotary::{RotaryIo, RotaryProblem};

/// Forward on the CPU (layouts in [`ForwardIo`]).
pub fn forward(p: &Problem, io: ForwardIo) -> Result<()> {
    check_forward_buffers(p, &io)?;
    catch_panics("CPU", || forward::run(p, io))
}

/// Backward on the CPU from the forward's o and lse (layouts in [`BackwardIo`]).
pub fn backward(p: &Problem, io: BackwardIo) -> Result<()> {
    check_backward_buffers(p, &io)?;
    catch_panics("CPU", || backward::run(p, io))
}

/// Rotary embeddings on the CPU (layouts in [`RotaryIo`]).
pub fn rotary(p: &RotaryProblem, io: RotaryIo) -> Result<()> {
    crate::rotary::check_buffers(p, &io)?;
    catch_panics("CPU", || rotary::run(p, io))
}

/// Number of threads the CPU kernels run on.
pub fn threads() -> usize {
    rayon::current_num_threads()
}
