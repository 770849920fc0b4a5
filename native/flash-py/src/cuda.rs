//! The CUDA half of `flash_nif._native`: device-pointer entry points for CuPy / DLPack arrays
//! (the Python layer in `flash_nif/_cuda.py` allocates outputs and passes raw pointers, the
//! device ordinal and the caller's stream), and `cuda_info`. NumPy with `device="cuda"` goes
//! through the core's `forward_host` / `backward_host`. Validation is the core's `Problem`; errors map like the CPU's.

use flash_core::cuda::{self, BackwardPtrs, ForwardPtrs};
use flash_core::{FlashError, Problem, TensorSpec};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::PyFlashError;

/// A GPU tensor as the Python layer describes it: (device pointer, shape, dtype name).
type DevTensor = (u64, Vec<usize>, String);

fn dev_spec<'a>(t: &'a DevTensor, name: &'a str) -> TensorSpec<'a> {
    TensorSpec { name, dtype: &t.2, shape: &t.1, nbytes: None }
}

/// Forward on device pointers. `inputs` = [q, k, v]; `outputs` = [o (like q), lse ([B, H, Sq] f32)],
/// preallocated by the caller on the same device.
#[pyfunction]
#[pyo3(signature = (inputs, outputs, device, stream, **options))]
fn cuda_forward_device(
    py: Python<'_>, inputs: Vec<DevTensor>, outputs: [u64; 2], device: usize, stream: usize, options: Option<&Bound<'_, PyDict>>,
) -> Result<(), PyFlashError> {
    let [q, k, v] = inputs.as_slice() else {
        return Err(FlashError::Internal("cuda_forward_device takes [q, k, v]".into()).into());
    };
    let p = Problem::forward(&dev_spec(q, "q"), &dev_spec(k, "k"), &dev_spec(v, "v"), &crate::options(options)?)?;
    let [o, lse] = outputs;
    let ptrs = ForwardPtrs { q: q.0, k: k.0, v: v.0, o, lse, mask: Default::default() };
    // SAFETY: the Python layer passes pointers of contiguous arrays of these shapes on `device`,
    // kept alive by the caller until the stream has run.
    Ok(py.detach(|| unsafe { cuda::forward_device(&p, device, stream, ptrs) })?)
}

/// Backward on device pointers. `inputs` = [do, q, k, v, o, lse]; `outputs` = [dq (like q), dk, dv
/// (like k)], preallocated by the caller on the same device.
#[pyfunction]
#[pyo3(signature = (inputs, outputs, device, stream, **options))]
fn cuda_backward_device(
    py: Python<'_>, inputs: Vec<DevTensor>, outputs: [u64; 3], device: usize, stream: usize, options: Option<&Bound<'_, PyDict>>,
) -> Result<(), PyFlashError> {
    let [d_out, q, k, v, o, lse] = inputs.as_slice() else {
        return Err(FlashError::Internal("cuda_backward_device takes [do, q, k, v, o, lse]".into()).into());
    };
    let p = Problem::backward(
        &dev_spec(d_out, "do"),
        &dev_spec(q, "q"),
        &dev_spec(k, "k"),
        &dev_spec(v, "v"),
        &dev_spec(o, "o"),
        &dev_spec(lse, "lse"),
        &crate::options(options)?,
    )?;
    let [dq, dk, dv] = outputs;
    let ptrs = BackwardPtrs { d_out: d_out.0, q: q.0, k: k.0, v: v.0, o: o.0, lse: lse.0, dq, dk, dv, mask: Default::default() };
    // SAFETY: as cuda_forward_device.
    Ok(py.detach(|| unsafe { cuda::backward_device(&p, device, stream, ptrs) })?)
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
    let i = py.detach(|| cuda::info(device)).map_err(PyFlashError)?;
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
