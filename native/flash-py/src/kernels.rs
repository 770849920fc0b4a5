//! The launcher's kernel table and compile check for `python -m flash_nif.kernels` (no GPU needed),
//! and the development hook that forces one kernel's tiles (tools/sweep*.py).

use flash_core::cuda::{self, Kernel, Tiles, Variant};
use flash_core::DType;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::PyFlashError;

fn variant_dict<'py>(py: Python<'py>, v: &Variant) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", v.name())?;
    d.set_item("kernel", v.kernel.name())?;
    d.set_item("dtype", cuda::dtype_short(v.dtype))?;
    d.set_item("head_dim", v.head_dim)?;
    d.set_item("source", v.source)?;
    d.set_item("entry", v.kernel.entry())?;
    let defines = PyDict::new(py);
    for (k, x) in &v.defines {
        defines.set_item(*k, *x)?;
    }
    d.set_item("defines", defines)?;
    d.set_item("block_m", v.tiles.block_m)?;
    d.set_item("block_n", v.tiles.block_n)?;
    d.set_item("num_warps", v.tiles.num_warps)?;
    d.set_item("tile_set", v.tile_set.name())?;
    Ok(d)
}

/// Every kernel variant the launcher can use for these head dims, as dicts: name, kernel, dtype,
/// head_dim, source, entry, defines (in order), block_m, block_n, num_warps, tile_set; with `arch`
/// (e.g. "sm_90a") also nvrtc_options, the options the launcher compiles it with there.
#[pyfunction]
#[pyo3(signature = (head_dims, arch = None))]
fn cuda_kernel_variants(py: Python<'_>, head_dims: Vec<usize>, arch: Option<String>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    cuda::all_variants(&head_dims)
        .iter()
        .map(|v| {
            let d = variant_dict(py, v)?;
            if let Some(arch) = &arch {
                d.set_item("nvrtc_options", cuda::nvrtc_options(v, arch))?;
            }
            Ok(d)
        })
        .collect()
}

/// Compiles every variant of `head_dims` for each arch with NVRTC on `jobs` threads (default: all
/// cores), from the sources embedded in this module, through the disk cache unless `fresh`. One
/// dict per (variant, arch): the variant's fields, arch, ok, and registers, spill_bytes,
/// stack_bytes, smem_bytes, cached and log when ok, else error (with NVRTC's log). `tile_sets`
/// ("default", "small") keeps only those variants; `masked` = False keeps only the plain ones (no
/// MASKED define); `tf32` = False drops the f32 tensor-core ones (a TF32_TERMS define). Raises
/// DeviceError without NVRTC.
#[pyfunction]
#[pyo3(signature = (archs, head_dims, jobs = None, fresh = false, tile_sets = None, masked = true, tf32 = true))]
#[allow(clippy::too_many_arguments)] // Python keyword arguments, one per filter
fn cuda_compile_report(
    py: Python<'_>,
    archs: Vec<String>,
    head_dims: Vec<usize>,
    jobs: Option<usize>,
    fresh: bool,
    tile_sets: Option<Vec<String>>,
    masked: bool,
    tf32: bool,
) -> PyResult<Vec<Bound<'_, PyDict>>> {
    let jobs = jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mut variants = cuda::all_variants(&head_dims);
    if let Some(sets) = tile_sets {
        variants.retain(|v| sets.iter().any(|s| s == v.tile_set.name()));
    }
    if !masked {
        variants.retain(|v| !v.defines.contains(&("MASKED", 1)));
    }
    if !tf32 {
        variants.retain(|v| !v.defines.iter().any(|(name, _)| *name == "TF32_TERMS"));
    }
    let reports = py.detach(|| cuda::compile_report(&variants, &archs, jobs, fresh)).map_err(PyFlashError)?;
    reports
        .iter()
        .map(|r| {
            let d = variant_dict(py, &r.variant)?;
            d.set_item("arch", &r.arch)?;
            d.set_item("ok", r.outcome.is_ok())?;
            match &r.outcome {
                Ok(u) => {
                    d.set_item("registers", u.registers)?;
                    d.set_item("spill_bytes", u.spill_bytes)?;
                    d.set_item("stack_bytes", u.stack_bytes)?;
                    d.set_item("smem_bytes", u.smem_bytes)?;
                    d.set_item("cached", u.from_cache)?;
                    d.set_item("log", &u.log)?;
                }
                Err(e) => d.set_item("error", e.to_string())?,
            }
            Ok(d)
        })
        .collect()
}

/// NVRTC's version ("13.0") and where it was loaded from ("system" or the pip library's path).
/// Raises DeviceError without NVRTC.
#[pyfunction]
fn cuda_nvrtc() -> Result<(String, String), PyFlashError> {
    let library = cuda::ensure_nvrtc()?;
    let (major, minor) = cuda::nvrtc_version()?;
    Ok((format!("{major}.{minor}"), library))
}

/// Development hook: every launch of (kernel, dtype, head_dim) in this process uses `tiles` =
/// (block_m, block_n, num_warps, d_split, min_blocks) with no small-tile fallback; None clears it.
/// Kernel names as in the variant table ("fwd", "bwd_dq", "bwd_dkdv", "bwd_dkdv_dq").
#[pyfunction]
#[pyo3(signature = (kernel, dtype, head_dim, tiles))]
fn cuda_set_tile_override(
    kernel: &str,
    dtype: &str,
    head_dim: usize,
    tiles: Option<(usize, usize, usize, usize, usize)>,
) -> Result<(), PyFlashError> {
    let tiles = tiles.map(|(block_m, block_n, num_warps, d_split, min_blocks)| Tiles {
        block_m,
        block_n,
        num_warps,
        d_split,
        min_blocks,
    });
    Ok(cuda::set_tile_override(Kernel::parse(kernel)?, DType::parse(dtype, "dtype")?, head_dim, tiles)?)
}

/// The kernels only sm_90a (Hopper) runs, by name (the compile check builds them for sm_90a alone,
/// and their shared memory need only fit a Hopper GPU).
#[pyfunction]
fn cuda_sm90_kernels() -> Vec<&'static str> {
    Kernel::ALL.into_iter().filter(|k| k.is_sm90()).map(|k| k.name()).collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for f in [
        wrap_pyfunction!(cuda_sm90_kernels, m)?,
        wrap_pyfunction!(cuda_kernel_variants, m)?,
        wrap_pyfunction!(cuda_compile_report, m)?,
        wrap_pyfunction!(cuda_nvrtc, m)?,
        wrap_pyfunction!(cuda_set_tile_override, m)?,
    ] {
        m.add_function(f)?;
    }
    Ok(())
}
