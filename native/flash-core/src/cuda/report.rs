//! The compile check with no GPU: every variant compiled for each arch, in parallel, with the
//! resources ptxas reports and the shared memory the kernel declares. `python -m flash_nif.kernels`
//! prints it (and `make test-kernels` runs that).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::compile::{self, Compiled};
use super::libs;
use super::variant::Variant;
use crate::error::{FlashError, Result};
use crate::guard::catch_panics;

/// One variant compiled for one arch.
#[derive(Debug, Clone)]
pub struct Report {
    pub variant: Variant,
    pub arch: String,
    pub outcome: Result<Usage>,
}

/// What ptxas and the cubin say about a compiled kernel.
#[derive(Debug, Clone, PartialEq)]
pub struct Usage {
    pub registers: i64,
    /// Spill stores + spill loads.
    pub spill_bytes: i64,
    pub stack_bytes: i64,
    pub smem_bytes: usize,
    pub log: String,
    /// Read from the caches instead of compiled now.
    pub from_cache: bool,
}

/// Compiles every variant for every arch on `jobs` threads and returns one report per pair, in
/// input order (variants-major). Variants whose source and options are identical compile once;
/// `fresh` skips the caches. An error of one compile is its report's outcome; the call fails only
/// when NVRTC is missing.
pub fn compile_report(variants: &[Variant], archs: &[String], jobs: usize, fresh: bool) -> Result<Vec<Report>> {
    libs::ensure_nvrtc()?;
    // The sm_90a-only kernels are compiled for sm_90a alone.
    let pairs: Vec<(&Variant, &String)> = variants
        .iter()
        .flat_map(|v| archs.iter().filter(move |a| !v.kernel.is_sm90() || *a == "sm_90a").map(move |a| (v, a)))
        .collect();
    // Distinct compiles, the heaviest (largest head dim, tiled kernels) first so that the last
    // jobs to start are short ones.
    let mut unique: Vec<(&Variant, &String)> = Vec::new();
    let mut index: HashMap<(&str, Vec<String>), usize> = HashMap::new();
    let slot: Vec<usize> = pairs
        .iter()
        .map(|&(v, a)| {
            *index.entry((v.source, compile::options(v, a))).or_insert_with(|| {
                unique.push((v, a));
                unique.len() - 1
            })
        })
        .collect();
    let mut order: Vec<usize> = (0..unique.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse((!unique[i].0.kernel.is_elementwise(), unique[i].0.head_dim)));
    let results: Vec<Mutex<Option<Result<Usage>>>> = unique.iter().map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..jobs.clamp(1, unique.len().max(1)) {
            s.spawn(|| {
                while let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let (v, arch) = unique[i];
                    let r = catch_panics("NVRTC", || usage(v, arch, fresh));
                    if let Ok(mut slot) = results[i].lock() {
                        *slot = Some(r);
                    }
                }
            });
        }
    });
    let results: Vec<Result<Usage>> = results
        .into_iter()
        .map(|m| m.into_inner().ok().flatten().unwrap_or_else(|| Err(FlashError::Internal("compile job lost".into()))))
        .collect();
    Ok(pairs
        .iter()
        .zip(slot)
        .map(|(&(v, a), i)| Report { variant: v.clone(), arch: a.clone(), outcome: results[i].clone() })
        .collect())
}

fn usage(v: &Variant, arch: &str, fresh: bool) -> Result<Usage> {
    let mut c: Compiled = compile::compile_with(v, arch, fresh)?;
    if c.log.is_empty() {
        c = compile::compile_with(v, arch, true)?; // a cache entry without its ptxas report
    }
    let (registers, spill_bytes, stack_bytes) = parse_ptxas(&c.log);
    Ok(Usage { registers, spill_bytes, stack_bytes, smem_bytes: c.smem_bytes, log: c.log.to_string(), from_cache: c.from_cache })
}

/// Registers, spill bytes and stack frame read from a ptxas report (`-Xptxas=-v`); -1 when absent.
pub fn parse_ptxas(log: &str) -> (i64, i64, i64) {
    let num_before = |s: &str, pat: &str| -> i64 {
        s.find(pat)
            .and_then(|i| s[..i].split_whitespace().last())
            .and_then(|t| t.parse().ok())
            .unwrap_or(-1)
    };
    let regs = log
        .find("Used ")
        .and_then(|i| log[i + 5..].split_whitespace().next())
        .and_then(|t| t.parse().ok())
        .unwrap_or(-1);
    let spill = num_before(log, "bytes spill stores").max(0) + num_before(log, "bytes spill loads").max(0);
    (regs, spill, num_before(log, "bytes stack frame"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::config::{self, Spec};
    use crate::cuda::variant::{Kernel, TileSet};
    use crate::dtype::DType;

    #[test]
    fn ptxas_report_is_parsed() {
        let log = "ptxas info    : Function properties for flash_fwd\nptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\nptxas info    : Used 166 registers, used 1 barriers";
        assert_eq!(parse_ptxas(log), (166, 12, 16));
    }

    /// The must-run checks of every variant's compiled size are the compile check's
    /// (`make test-kernels`, against tests/golden/kernel_variants.json); this one runs where NVRTC is.
    #[test]
    fn kernels_declare_their_shared_memory_when_nvrtc_is_present() {
        if libs::ensure_nvrtc().is_err() {
            return; // no NVRTC on this machine: nothing to check
        }
        let spec = |kernel| Spec { kernel, dtype: DType::BF16, head_dim: 72, causal: true, masked: false, mods: false, group: 2, seq_k: 100, tf32_terms: 0, f16_parts: false };
        let vs = [
            config::variant(&spec(Kernel::Fwd), TileSet::Default),
            config::variant(&spec(Kernel::Fwd), TileSet::Default), // a duplicate compiles once
            config::variant(&spec(Kernel::BwdDkdvDq), TileSet::Small),
            config::variant(&spec(Kernel::BwdPreprocess), TileSet::Default),
        ];
        let reports = compile_report(&vs, &["sm_80".to_string()], 2, false).expect("NVRTC loads");
        let u: Vec<Usage> = reports.into_iter().map(|r| r.outcome.expect("compiles")).collect();
        assert_eq!(u[0], u[1]);
        assert!(u[0].registers > 0 && u[0].spill_bytes == 0, "{:?}", u[0]);
        assert!(u[0].smem_bytes > 0 && u[2].smem_bytes > 0 && u[2].smem_bytes <= 101376, "{u:?}");
        assert_eq!(u[3].smem_bytes, 0);
    }
}
