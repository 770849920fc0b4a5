//! Fused or materialized: which kernels run a call — the one owner of that decision.
//!
//! * fused: tiled online softmax, O(S) extra memory (`cpu::forward` / `cpu::backward`, the CUDA
//!   kernels);
//! * materialized: each task holds its head's whole score matrix, S×S (`cpu::materialized`).
//!
//! Both are exact to the same bounds and return the same (o, lse) and gradients. The caller asks
//! with [`Options::mode`](crate::Options::mode) (Python / Elixir `mode`); the environment variable
//! [`MODE_ENV`] overrides it for every call of the process. `auto` takes the materialized path
//! only where (1) the backend has one, (2) its S×S working set ([`working_set`]) fits the ceiling
//! [`MAX_BYTES_ENV`] (default 1 GiB) and (3) the backend's crossover table, measured by
//! `bench/dispatch.py`, says it is faster; otherwise fused. An explicit `materialized` over the
//! ceiling, or on a backend without that path, is an error, never a silent switch.

use crate::error::{FlashError, Result};
use crate::problem::Problem;

/// The caller's choice of kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Materialized where it fits the ceiling and the crossover table says it is faster.
    #[default]
    Auto,
    Fused,
    Materialized,
}

impl Mode {
    /// "auto", "fused" or "materialized".
    pub fn parse(name: &str) -> Result<Mode> {
        match name {
            "auto" => Ok(Mode::Auto),
            "fused" => Ok(Mode::Fused),
            "materialized" => Ok(Mode::Materialized),
            other => Err(FlashError::Unsupported(format!(
                "unknown mode {other:?}; expected \"auto\", \"fused\" or \"materialized\""
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::Auto => "auto",
            Mode::Fused => "fused",
            Mode::Materialized => "materialized",
        }
    }
}

/// The kernels a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Fused,
    Materialized,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::Fused => "fused",
            Path::Materialized => "materialized",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Forward,
    Backward,
}

impl Pass {
    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
}

/// Overrides every call's `mode` ("auto", "fused", "materialized"; unset or empty: the call's).
pub const MODE_ENV: &str = "FLASH_NIF_MODE";
/// Ceiling on the materialized path's S×S working set, in bytes (a non-negative integer).
pub const MAX_BYTES_ENV: &str = "FLASH_NIF_MATERIALIZE_MAX_BYTES";
/// The ceiling when [`MAX_BYTES_ENV`] is unset: 1 GiB.
pub const DEFAULT_MAX_BYTES: u128 = 1 << 30;

/// One row of a crossover table: the materialized path is faster for a pass when the longer
/// sequence (max of Sq and Sk; the longest one of a varlen call) is at most `max_seq` and the
/// call has at least `min_pairs` (batch row, kv head) pairs, the materialized path's unit of
/// parallel work. (A count, not a share per thread: the choice must not depend on the thread
/// count, or results would — the two paths agree to the bounds, not to the bit.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Crossover {
    pub pass: Pass,
    pub max_seq: usize,
    pub min_pairs: usize,
}

/// The CPU's crossover table, from `bench/dispatch.py` on the project's 2-core AVX-512 machine,
/// 2026-11-22 (bench/RESULTS.md, "Dispatch issue"; D = 64, causal, B·H from 1 to 256): the
/// materialized forward is faster at every measured S up to 512 (0.15–0.90× the fused time) and
/// slower at 1024 (1.14× at B·H = 1); the backward up to 256 (0.15–0.86×), level at 512 (0.91–0.98×
/// in one run, 1.41× at B·H = 16 in another) and slower at 1024 (1.37×).
pub const CPU_CROSSOVER: &[Crossover] = &[
    Crossover { pass: Pass::Forward, max_seq: 512, min_pairs: 1 },
    Crossover { pass: Pass::Backward, max_seq: 256, min_pairs: 1 },
];

const CPU_MEASURED: &str = "bench/dispatch.py, 2026-11-22, 2-core AMD EPYC (AVX-512), 2 threads: materialized faster up to S = 512 (forward) / 256 (backward)";

/// The CUDA backend has no materialized kernels: auto never picks that path there.
pub const CUDA_CROSSOVER: &[Crossover] = &[];
const CUDA_MEASURED: &str = "no materialized GPU kernels: fused only";

/// Where a backend's table comes from (`info()` shows it).
pub fn measured(backend: Backend) -> &'static str {
    match backend {
        Backend::Cpu => CPU_MEASURED,
        Backend::Cuda => CUDA_MEASURED,
    }
}

/// The crossover table of a backend.
pub fn crossover(backend: Backend) -> &'static [Crossover] {
    match backend {
        Backend::Cpu => CPU_CROSSOVER,
        Backend::Cuda => CUDA_CROSSOVER,
    }
}

/// Whether a backend has a materialized path at all.
pub fn has_materialized(backend: Backend) -> bool {
    matches!(backend, Backend::Cpu)
}

/// The mode in force for `p`: [`MODE_ENV`] when set (and not empty), else the call's.
pub fn requested_mode(p: &Problem) -> Result<Mode> {
    match std::env::var(MODE_ENV) {
        Ok(v) if !v.trim().is_empty() => Mode::parse(v.trim())
            .map_err(|_| FlashError::Unsupported(format!("{MODE_ENV}={v:?}; expected auto, fused or materialized (or unset)"))),
        _ => Ok(p.mode),
    }
}

/// The ceiling on the materialized working set: [`MAX_BYTES_ENV`], else [`DEFAULT_MAX_BYTES`].
pub fn max_bytes() -> Result<u128> {
    match std::env::var(MAX_BYTES_ENV) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse::<u128>().map_err(|_| {
            FlashError::Unsupported(format!("{MAX_BYTES_ENV}={v:?}; expected a number of bytes (a non-negative integer)"))
        }),
        _ => Ok(DEFAULT_MAX_BYTES),
    }
}

/// Threads the CPU kernels run on.
fn threads() -> usize {
    rayon::current_num_threads().max(1)
}

/// Bytes of S×S matrices the materialized path of `backend` holds at once for this pass: on the
/// CPU, every running task (at most one per thread) holds its head's S (forward) or S and dS
/// (backward), Sq × Sk f32 each (Sk padded). The real memory, so it grows with the thread count:
/// a call near the ceiling may be materialized on fewer threads and fused on more.
pub fn working_set(p: &Problem, backend: Backend, pass: Pass) -> u128 {
    match backend {
        Backend::Cpu => {
            let backward = pass == Pass::Backward;
            let running = crate::cpu::materialized::tasks(p).min(threads()) as u128;
            let matrices = if !backward { 1 } else if p.mods.softcap.is_some() { 3 } else { 2 };
            running * crate::cpu::materialized::task_bytes(p, matrices)
        }
        Backend::Cuda => 0,
    }
}

/// Whether the crossover table of `backend` says the materialized path is the faster one.
pub fn table_prefers_materialized(p: &Problem, backend: Backend, pass: Pass) -> bool {
    let seq = p.dims.seq_q.max(p.dims.seq_k);
    let pairs = p.dims.batch * p.dims.kv_heads;
    crossover(backend).iter().any(|c| c.pass == pass && seq <= c.max_seq && pairs >= c.min_pairs)
}

/// What the materialized path cannot run yet (`auto` then runs fused, an explicit request is an
/// error): a value head dim of its own.
fn materialized_lacks(p: &Problem) -> Option<&'static str> {
    if p.dims.head_dim_v != p.dims.head_dim {
        Some("a value head dim different from q's (Dv != D)")
    } else {
        None
    }
}

/// The path `p` takes on `backend` for `pass` (see the module doc).
pub fn choose(p: &Problem, backend: Backend, pass: Pass) -> Result<Path> {
    let mode = requested_mode(p)?;
    if mode == Mode::Fused {
        return Ok(Path::Fused);
    }
    if let Some(what) = materialized_lacks(p) {
        return match mode {
            Mode::Materialized => Err(FlashError::Unsupported(format!(
                "mode=\"materialized\" does not take {what} yet; use mode=\"fused\" or \"auto\" (which runs them fused)"
            ))),
            _ => Ok(Path::Fused),
        };
    }
    let backend_name = match backend {
        Backend::Cpu => "cpu",
        Backend::Cuda => "cuda",
    };
    if !has_materialized(backend) {
        return match mode {
            Mode::Materialized => Err(FlashError::Unsupported(format!(
                "mode=\"materialized\" is not available on the {backend_name} backend (it has fused kernels only); use mode=\"fused\" or \"auto\""
            ))),
            _ => Ok(Path::Fused),
        };
    }
    let (need, ceiling) = (working_set(p, backend, pass), max_bytes()?);
    let fits = need <= ceiling;
    match mode {
        Mode::Materialized if !fits => Err(FlashError::Unsupported(format!(
            "mode=\"materialized\": the {} S×S working set of this call is {need} bytes ({} MiB), over the ceiling of {ceiling} bytes \
             ({MAX_BYTES_ENV}); use mode=\"fused\" (O(S) memory) or \"auto\", or raise {MAX_BYTES_ENV}",
            pass.name(),
            need >> 20
        ))),
        Mode::Materialized => Ok(Path::Materialized),
        _ if fits && table_prefers_materialized(p, backend, pass) => Ok(Path::Materialized),
        _ => Ok(Path::Fused),
    }
}
