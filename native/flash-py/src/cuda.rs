//! The CUDA half of `flash_nif._native`: device-pointer entry points for CuPy / DLPack arrays
//! (the Python layer in `flash_nif/_cuda.py` allocates outputs and passes raw pointers, the
//! device ordinal and the caller's stream), and `cuda_info`. NumPy with `device="cuda"` goes
//! through the core's `forward_host` / `backward_host`. Validation is the core's `Problem`; errors map like the CPU's.

use flash_core::cuda::{self, BackwardPtrs, ForwardPtrs};
use flash_core::{DType, FlashError, Options, Problem, TensorSpec};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_pyerr;

fn spec<'a>(dtype: DType, shape: &'a [usize]) -> TensorSpec<'a> {
    let nbytes = shape.iter().product::<usize>() * dtype.size_bytes();
    TensorSpec { dtype, shape, nbytes }
}

/// A GPU tensor as the Python layer describes it: (device pointer, shape, dtype name).
type DevTensor = (u64, Vec<usize>, String);

fn dev_spec<'a>(t: &'a DevTensor, name: &str) -> Result<TensorSpec<'a>, FlashError> {
    Ok(spec(DType::parse(&t.2, name)?, &t.1))
}

/// Forward on device pointers. `inputs` = [q, k, v]; fills o (like q) and lse ([B, H, Sq] f32),
/// both preallocated by the caller on the same device.
#[pyfunction]
#[pyo3(signature = (inputs, o, lse, causal, scale, device, stream))]
#[allow(clippy::too_many_arguments)]
fn cuda_forward_device(
    py: Python<'_>,
    inputs: Vec<DevTensor>,
    o: u64,
    lse: u64,
    causal: bool,
    scale: Option<f64>,
    device: usize,
    stream: usize,
) -> PyResult<()> {
    let run = || -> Result<(), FlashError> {
        let [q, k, v] = inputs.as_slice() else {
            return Err(FlashError::Internal("cuda_forward_device takes [q, k, v]".into()));
        };
        let opts = Options { causal, scale, deterministic: false };
        let p = Problem::forward(&dev_spec(q, "q")?, &dev_spec(k, "k")?, &dev_spec(v, "v")?, &opts)?;
        let ptrs = ForwardPtrs { q: q.0, k: k.0, v: v.0, o, lse };
        // SAFETY: the Python layer passes pointers of contiguous arrays of these shapes on `device`,
        // kept alive by the caller until the stream has run.
        py.detach(|| unsafe { cuda::forward_device(&p, device, stream, ptrs) })
    };
    run().map_err(|e| to_pyerr(py, e))
}

/// Backward on device pointers. `inputs` = [d_out, q, k, v, o, lse]; fills dq (like q), dk and dv
/// (like k), preallocated by the caller on the same device.
#[pyfunction]
#[pyo3(signature = (inputs, dq, dk, dv, causal, scale, device, stream, deterministic = false))]
#[allow(clippy::too_many_arguments)]
fn cuda_backward_device(
    py: Python<'_>,
    inputs: Vec<DevTensor>,
    dq: u64,
    dk: u64,
    dv: u64,
    causal: bool,
    scale: Option<f64>,
    device: usize,
    stream: usize,
    deterministic: bool,
) -> PyResult<()> {
    let run = || -> Result<(), FlashError> {
        let [d_out, q, k, v, o, lse] = inputs.as_slice() else {
            return Err(FlashError::Internal("cuda_backward_device takes [d_out, q, k, v, o, lse]".into()));
        };
        let opts = Options { causal, scale, deterministic };
        let p = Problem::backward(
            &dev_spec(d_out, "d_out")?,
            &dev_spec(q, "q")?,
            &dev_spec(k, "k")?,
            &dev_spec(v, "v")?,
            &dev_spec(o, "o")?,
            &dev_spec(lse, "lse")?,
            &opts,
        )?;
        let ptrs = BackwardPtrs { d_out: d_out.0, q: q.0, k: k.0, v: v.0, o: o.0, lse: lse.0, dq, dk, dv };
        // SAFETY: as cuda_forward_device.
        py.detach(|| unsafe { cuda::backward_device(&p, device, stream, ptrs) })
    };
    run().map_err(|e| to_pyerr(py, e))
}

/// Registers directories (Python's sys.path) where pip's `nvidia/*/lib` NVRTC may be found.
#[pyfunction]
fn cuda_set_search_roots(paths: Vec<String>) {
    cuda::add_search_roots(paths.into_iter().map(std::path::PathBuf::from));
}

/// GPU `device`: name, arch, compute capability, NVRTC version and source, cache directory.
/// Raises DeviceError when CUDA is unavailable.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn cuda_info(py: Python<'_>, device: usize) -> PyResult<Bound<'_, PyDict>> {
    let i = py.detach(|| cuda::info(device)).map_err(|e| to_pyerr(py, e))?;
    let d = PyDict::new(py);
    d.set_item("device", i.ordinal)?;
    d.set_item("name", i.name)?;
    d.set_item("compute_capability", i.compute_capability)?;
    d.set_item("arch", i.arch)?;
    d.set_item("multiprocessors", i.multiprocessors)?;
    d.set_item("nvrtc_version", format!("{}.{}", i.nvrtc_version.0, i.nvrtc_version.1))?;
    d.set_item("nvrtc", i.nvrtc_source)?;
    d.set_item("cache_dir", i.cache_dir.display().to_string())?;
    d.set_item("device_count", cuda::device_count().unwrap_or(0))?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cuda_forward_device, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_backward_device, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_set_search_roots, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_info, m)?)?;
    Ok(())
}
