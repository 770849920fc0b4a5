//! Which kernel ran: the last forward's and backward's main kernel in this process (for `info()`),
//! and with `FLASH_NIF_LOG=1` a line per call on stderr, with the reason when the Hopper kernels
//! were not taken.

use std::sync::Mutex;

use super::variant::Variant;

/// The environment variable that turns the per-call kernel log on (`1`).
pub const LOG_ENV: &str = "FLASH_NIF_LOG";

/// A pass's last main kernel, and why it is not the Hopper one (None when it is, or when the
/// pass has no Hopper kernel).
#[derive(Debug, Clone, Default)]
pub struct Ran {
    pub kernel: Option<String>,
    pub fallback: Option<String>,
    /// How its products were computed ([`Variant::math`]).
    pub math: Option<&'static str>,
}

/// The forward's and the backward's [`Ran`].
#[derive(Debug, Clone, Default)]
pub struct LastKernels {
    pub forward: Ran,
    pub backward: Ran,
}

static LAST: Mutex<LastKernels> = Mutex::new(LastKernels {
    forward: Ran { kernel: None, fallback: None, math: None },
    backward: Ran { kernel: None, fallback: None, math: None },
});

fn logging() -> bool {
    std::env::var(LOG_ENV).is_ok_and(|v| v.trim() == "1")
}

fn with_pass(pass: &str, f: impl FnOnce(&mut Ran)) {
    if let Ok(mut last) = LAST.lock() {
        f(if pass == "forward" { &mut last.forward } else { &mut last.backward });
    }
}

/// Records that `pass` ("forward" or "backward") runs `v`.
pub(super) fn kernel(pass: &str, v: &Variant) {
    let name = v.name();
    let mut note = None;
    with_pass(pass, |r| {
        if v.kernel.is_sm90() {
            r.fallback = None;
        }
        note = r.fallback.clone();
        r.kernel = Some(name.clone());
        r.math = Some(v.math());
    });
    if logging() {
        let math = v.math();
        match note {
            Some(why) => eprintln!("flash_nif: {pass}: {name} [{math}] (not the Hopper kernel: {why})"),
            None => eprintln!("flash_nif: {pass}: {name} [{math}]"),
        }
    }
}

/// Records why `pass` does not run its Hopper kernel (before [`kernel`] names the one it runs).
pub(super) fn fallback(pass: &str, why: &str) {
    with_pass(pass, |r| r.fallback = Some(why.to_string()));
}

/// The last forward's and backward's kernels in this process.
pub fn last_kernels() -> LastKernels {
    LAST.lock().map(|l| l.clone()).unwrap_or_default()
}

/// With `FLASH_NIF_LOG=1`, a decode call's plan on stderr: its kernel, grid, splits, how the splits
/// merge and the blocks an SM its kernel holds (decode keeps no `info()` entry: it has no Hopper
/// fallback to report).
pub(super) fn decode_plan(v: &Variant, grid: (u32, u32), splits: usize, merge: &str, blocks_per_sm: u32) {
    if logging() {
        eprintln!("flash_nif: decode: {} grid {}x{} splits {splits} ({merge}) {blocks_per_sm} blocks an SM", v.name(), grid.0, grid.1);
    }
}
