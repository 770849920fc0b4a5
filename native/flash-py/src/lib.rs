//! `flash_nif._native`: the thin PyO3 layer. Converts arrays, releases the GIL around the core,
//! maps errors. The public API and its docs live in python/flash_nif/__init__.py.

mod arrays;
mod cuda;
mod errors;
mod kernels;

use arrays::{empty_f32, empty_like_dtype, HostArray};
use errors::to_pyerr;
use flash_core::{backward_host, cpu, forward_host, Device, Options, Problem};
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn inputs<'py, const N: usize>(py: Python<'py>, args: [(&Bound<'py, PyAny>, &str); N]) -> PyResult<Vec<HostArray<'py>>> {
    args.iter()
        .map(|(obj, name)| HostArray::extract(obj, name).map_err(|e| to_pyerr(py, e)))
        .collect()
}

/// (o, lse) for NumPy q, k, v, computed on `device` ("cpu", "cuda" or "auto").
#[pyfunction]
#[pyo3(signature = (q, k, v, causal, scale, device))]
fn forward_host_arrays<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    causal: bool,
    scale: Option<f64>,
    device: &str,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let device = Device::parse(device).map_err(|e| to_pyerr(py, e))?;
    let a = inputs(py, [(q, "q"), (k, "k"), (v, "v")])?;
    let opts = Options { causal, scale, deterministic: false };
    let p = Problem::forward(&a[0].spec(), &a[1].spec(), &a[2].spec(), &opts).map_err(|e| to_pyerr(py, e))?;
    let o = empty_like_dtype(py, &p.dims.q_shape(), &a[0])?;
    let lse = empty_f32(py, &p.dims.lse_shape())?;
    let (qb, kb, vb) = (a[0].bytes(), a[1].bytes(), a[2].bytes());
    let (ob, lb) = (o.bytes_mut(), lse.bytes_mut());
    py.detach(|| forward_host(device, &p, qb, kb, vb, ob, lb)).map_err(|e| to_pyerr(py, e))?;
    Ok((o.array.into_any(), lse.array.into_any()))
}

/// (dq, dk, dv) for NumPy inputs, computed on `device` ("cpu", "cuda" or "auto").
#[pyfunction]
#[pyo3(signature = (d_out, q, k, v, o, lse, causal, scale, device, deterministic = false))]
#[allow(clippy::too_many_arguments)]
fn backward_host_arrays<'py>(
    py: Python<'py>,
    d_out: &Bound<'py, PyAny>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    o: &Bound<'py, PyAny>,
    lse: &Bound<'py, PyAny>,
    causal: bool,
    scale: Option<f64>,
    device: &str,
    deterministic: bool,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let device = Device::parse(device).map_err(|e| to_pyerr(py, e))?;
    let a = inputs(py, [(d_out, "d_out"), (q, "q"), (k, "k"), (v, "v"), (o, "o"), (lse, "lse")])?;
    let opts = Options { causal, scale, deterministic };
    let p = Problem::backward(&a[0].spec(), &a[1].spec(), &a[2].spec(), &a[3].spec(), &a[4].spec(), &a[5].spec(), &opts)
        .map_err(|e| to_pyerr(py, e))?;
    let dq = empty_like_dtype(py, &p.dims.q_shape(), &a[1])?;
    let dk = empty_like_dtype(py, &p.dims.kv_shape(), &a[2])?;
    let dv = empty_like_dtype(py, &p.dims.kv_shape(), &a[3])?;
    let ins: Vec<&[u8]> = a.iter().map(|x| x.bytes()).collect();
    let (dqb, dkb, dvb) = (dq.bytes_mut(), dk.bytes_mut(), dv.bytes_mut());
    py.detach(|| backward_host(device, &p, ins[0], ins[1], ins[2], ins[3], ins[4], ins[5], dqb, dkb, dvb))
        .map_err(|e| to_pyerr(py, e))?;
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
