//! `flash_nif._native`: the thin PyO3 layer. Converts arrays, releases the GIL around the core,
//! maps errors. The public API and its docs live in python/flash_nif/__init__.py.

mod arrays;
mod cuda;
mod errors;
mod kernels;

use arrays::{empty_f32, empty_like_dtype, HostArray};
use errors::PyFlashError;
use flash_core::{backward_host, cpu, forward_host, BackwardIo, Device, FlashError, ForwardIo, Options, Problem};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Both Python functions return NumPy arrays.
type Array<'py> = Bound<'py, PyAny>;

/// The NumPy arrays of one call, named for messages; `inputs` must hold exactly N of them.
fn host_arrays<'py, const N: usize>(inputs: &[Array<'py>], names: [&'static str; N]) -> Result<[HostArray<'py>; N], FlashError> {
    if inputs.len() != N {
        return Err(FlashError::Internal(format!("expected the {N} arrays {names:?}, got {}", inputs.len())));
    }
    let arrays: Vec<HostArray> =
        inputs.iter().zip(names).map(|(obj, name)| HostArray::extract(obj, name)).collect::<Result<_, _>>()?;
    Ok(arrays.try_into().unwrap_or_else(|_| unreachable!("length checked above")))
}

/// The core's [`Options`] from a call's keyword arguments (`causal`, `scale`, `deterministic`);
/// one left out keeps the core's default. The Python layer has checked their types already.
pub(crate) fn options(kwargs: Option<&Bound<'_, PyDict>>) -> Result<Options, FlashError> {
    let mut opts = Options::default();
    let bad = |what: &str| FlashError::Unsupported(what.to_string());
    for (key, value) in kwargs.into_iter().flat_map(|d| d.iter()) {
        match key.extract::<String>().unwrap_or_default().as_str() {
            "causal" => opts.causal = value.extract().map_err(|_| bad("causal must be a bool"))?,
            "scale" => opts.scale = value.extract().map_err(|_| bad("scale must be a number or None"))?,
            "deterministic" => opts.deterministic = value.extract().map_err(|_| bad("deterministic must be a bool"))?,
            other => return Err(FlashError::Unsupported(format!("unknown option {other:?}"))),
        }
    }
    Ok(opts)
}

/// (o, lse) for NumPy `inputs` = [q, k, v], computed on `device` ("cpu", "cuda" or "auto").
#[pyfunction]
#[pyo3(signature = (inputs, device, **options))]
fn forward_host_arrays<'py>(
    py: Python<'py>, inputs: Vec<Array<'py>>, device: &str, options: Option<&Bound<'py, PyDict>>,
) -> Result<(Array<'py>, Array<'py>), PyFlashError> {
    let device = Device::parse(device)?;
    let [q, k, v] = host_arrays(&inputs, ["q", "k", "v"])?;
    let p = Problem::forward(&q.spec(), &k.spec(), &v.spec(), &self::options(options)?)?;
    let o = empty_like_dtype(py, &p.dims.q_shape(), &q)?;
    let lse = empty_f32(py, &p.dims.lse_shape())?;
    let io = ForwardIo::new([&q, &k, &v].map(HostArray::bytes), [o.bytes_mut(), lse.bytes_mut()]);
    py.detach(|| forward_host(device, &p, io))?;
    Ok((o.array.into_any(), lse.array.into_any()))
}

/// (dq, dk, dv) for NumPy `inputs` = [do, q, k, v, o, lse], computed on `device`.
#[pyfunction]
#[pyo3(signature = (inputs, device, **options))]
fn backward_host_arrays<'py>(
    py: Python<'py>, inputs: Vec<Array<'py>>, device: &str, options: Option<&Bound<'py, PyDict>>,
) -> Result<(Array<'py>, Array<'py>, Array<'py>), PyFlashError> {
    let device = Device::parse(device)?;
    let a = host_arrays(&inputs, ["do", "q", "k", "v", "o", "lse"])?;
    let [d_out, q, k, v, o, lse] = &a;
    let opts = self::options(options)?;
    let p = Problem::backward(&d_out.spec(), &q.spec(), &k.spec(), &v.spec(), &o.spec(), &lse.spec(), &opts)?;
    let dq = empty_like_dtype(py, &p.dims.q_shape(), q)?;
    let dk = empty_like_dtype(py, &p.dims.kv_shape(), k)?;
    let dv = empty_like_dtype(py, &p.dims.kv_shape(), v)?;
    let io = BackwardIo::new(a.each_ref().map(HostArray::bytes), [dq.bytes_mut(), dk.bytes_mut(), dv.bytes_mut()]);
    py.detach(|| backward_host(device, &p, io))?;
    Ok((dq.array.into_any(), dk.array.into_any(), dv.array.into_any()))
}

/// Version, backends, thread count and CPU instruction set.
#[pyfunction]
fn info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", flash_core::VERSION)?;
    let mut backends = vec!["cpu"];
    if flash_core::cuda_available() {
        backends.push("cuda");
    }
    d.set_item("backends", backends)?;
    d.set_item("threads", cpu::threads())?;
    d.set_item("cpu_isa", format!("{:?}", cpu::simd::isa()).to_lowercase())?;
    Ok(d)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(forward_host_arrays, m)?)?;
    m.add_function(wrap_pyfunction!(backward_host_arrays, m)?)?;
    m.add_function(wrap_pyfunction!(info, m)?)?;
    cuda::register(m)?;
    kernels::register(m)?;
    Ok(())
}
