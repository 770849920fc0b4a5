//! The CUDA half of `flash_nif._native`: device-pointer entry points for CuPy / DLPack arrays
//! (the Python layer in `flash_nif/_cuda.py` allocates outputs and passes raw pointers, the
//! device ordinal and the caller's stream), host-memory entry points for NumPy with
//! `device="cuda"`, and `cuda_info`. Validation is the core's `Problem`; errors map like the CPU's.

use flash_core::cuda::{self, BackwardPtrs, ForwardPtrs};
use flash_core::{DType, FlashError, Options, Problem, TensorSpec};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::{empty_f32, empty_like_dtype, HostArray};
use crate::errors::to_pyerr;

fn spec<'a>(dtype: DType, shape: &'a [usize]) -> TensorSpec<'a> {
    let nbytes = shape.iter().product::<usize>() * dtype.size_bytes();
    TensorSpec { dtype, shape, nbytes }
}

/// Forward on device pointers: fills o (like q) and lse ([B, H, Sq] f32), both preallocated.
#[pyfunction]
#[pyo3(signature = (q, k, v, o, lse, q_shape, kv_shape, dtype, causal, scale, device, stream))]
#[allow(clippy::too_many_arguments)]
fn cuda_forward_device(
    py: Python<'_>,
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    q_shape: Vec<usize>,
    kv_shape: Vec<usize>,
    dtype: &str,
    causal: bool,
    scale: Option<f64>,
    device: usize,
    stream: usize,
) -> PyResult<()> {
    let run = || -> Result<(), FlashError> {
        let dt = DType::parse(dtype, "q")?;
        let opts = Options { causal, scale };
        let p = Problem::forward(&spec(dt, &q_shape), &spec(dt, &kv_shape), &spec(dt, &kv_shape), &opts)?;
        let ptrs = ForwardPtrs { q, k, v, o, lse };
        // SAFETY: the Python layer passes pointers of contiguous arrays of these shapes on `device`,
        // kept alive by the caller until the stream has run.
        py.detach(|| unsafe { cuda::forward_device(&p, device, stream, ptrs) })
    };
    run().map_err(|e| to_pyerr(py, e))
}

/// Backward on device pointers: fills dq (like q), dk and dv (like k), preallocated.
#[pyfunction]
#[pyo3(signature = (d_out, q, k, v, o, lse, dq, dk, dv, q_shape, kv_shape, dtype, causal, scale, device, stream))]
#[allow(clippy::too_many_arguments)]
fn cuda_backward_device(
    py: Python<'_>,
    d_out: u64,
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    q_shape: Vec<usize>,
    kv_shape: Vec<usize>,
    dtype: &str,
    causal: bool,
    scale: Option<f64>,
    device: usize,
    stream: usize,
) -> PyResult<()> {
    let run = || -> Result<(), FlashError> {
        let dt = DType::parse(dtype, "q")?;
        let opts = Options { causal, scale };
        let lse_shape: Vec<usize> = match q_shape.as_slice() {
            [b, sq, h, _] => vec![*b, *h, *sq],
            _ => vec![],
        };
        let (qs, kvs) = (spec(dt, &q_shape), spec(dt, &kv_shape));
        let p = Problem::backward(&qs, &qs, &kvs, &kvs, &qs, &spec(DType::F32, &lse_shape), &opts)?;
        let ptrs = BackwardPtrs { d_out, q, k, v, o, lse, dq, dk, dv };
        // SAFETY: as cuda_forward_device.
        py.detach(|| unsafe { cuda::backward_device(&p, device, stream, ptrs) })
    };
    run().map_err(|e| to_pyerr(py, e))
}

fn inputs<'py, const N: usize>(py: Python<'py>, args: [(&Bound<'py, PyAny>, &str); N]) -> PyResult<Vec<HostArray<'py>>> {
    args.iter()
        .map(|(obj, name)| HostArray::extract(obj, name).map_err(|e| to_pyerr(py, e)))
        .collect()
}

/// (o, lse) for NumPy q, k, v computed on GPU `device` (copied there and back).
#[pyfunction]
#[pyo3(signature = (q, k, v, causal, scale, device))]
fn cuda_forward_host<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    causal: bool,
    scale: Option<f64>,
    device: usize,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let a = inputs(py, [(q, "q"), (k, "k"), (v, "v")])?;
    let opts = Options { causal, scale };
    let p = Problem::forward(&a[0].spec(), &a[1].spec(), &a[2].spec(), &opts).map_err(|e| to_pyerr(py, e))?;
    let o = empty_like_dtype(py, &p.dims.q_shape(), &a[0])?;
    let lse = empty_f32(py, &p.dims.lse_shape())?;
    let (qb, kb, vb) = (a[0].bytes(), a[1].bytes(), a[2].bytes());
    let (ob, lb) = (o.bytes_mut(), lse.bytes_mut());
    py.detach(|| cuda::forward_host(&p, device, qb, kb, vb, ob, lb)).map_err(|e| to_pyerr(py, e))?;
    Ok((o.array.into_any(), lse.array.into_any()))
}

/// (dq, dk, dv) for NumPy inputs computed on GPU `device`.
#[pyfunction]
#[pyo3(signature = (d_out, q, k, v, o, lse, causal, scale, device))]
#[allow(clippy::too_many_arguments)]
fn cuda_backward_host<'py>(
    py: Python<'py>,
    d_out: &Bound<'py, PyAny>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    o: &Bound<'py, PyAny>,
    lse: &Bound<'py, PyAny>,
    causal: bool,
    scale: Option<f64>,
    device: usize,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let a = inputs(py, [(d_out, "d_out"), (q, "q"), (k, "k"), (v, "v"), (o, "o"), (lse, "lse")])?;
    let opts = Options { causal, scale };
    let p = Problem::backward(&a[0].spec(), &a[1].spec(), &a[2].spec(), &a[3].spec(), &a[4].spec(), &a[5].spec(), &opts)
        .map_err(|e| to_pyerr(py, e))?;
    let dq = empty_like_dtype(py, &p.dims.q_shape(), &a[1])?;
    let dk = empty_like_dtype(py, &p.dims.kv_shape(), &a[2])?;
    let dv = empty_like_dtype(py, &p.dims.kv_shape(), &a[3])?;
    let ins: Vec<&[u8]> = a.iter().map(|x| x.bytes()).collect();
    let (dqb, dkb, dvb) = (dq.bytes_mut(), dk.bytes_mut(), dv.bytes_mut());
    py.detach(|| cuda::backward_host(&p, device, ins[0], ins[1], ins[2], ins[3], ins[4], ins[5], dqb, dkb, dvb))
        .map_err(|e| to_pyerr(py, e))?;
    Ok((dq.array.into_any(), dk.array.into_any(), dv.array.into_any()))
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

/// Every kernel variant the launcher can use for these head dims: (name, source, defines).
#[pyfunction]
fn cuda_kernel_variants(head_dims: Vec<usize>) -> Vec<(String, String, Vec<(String, i64)>)> {
    cuda::all_variants(&head_dims)
        .into_iter()
        .map(|v| {
            let defs = v.defines.iter().map(|(k, x)| (k.to_string(), *x)).collect();
            (v.name(), v.source.to_string(), defs)
        })
        .collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cuda_forward_device, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_backward_device, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_forward_host, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_backward_host, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_set_search_roots, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_info, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_kernel_variants, m)?)?;
    Ok(())
}
