//! `flash_nif._native`: the thin PyO3 layer. Converts arrays, releases the GIL around the core,
//! maps errors. The public API and its docs live in python/flash_nif/__init__.py.

mod arrays;
mod cuda;
mod errors;
mod kernels;
mod masks;
mod modifiers;
mod quant;
mod rotary;

use arrays::{empty_f32, empty_like_dtype, HostArray};
use errors::PyFlashError;
use flash_core::{backward_host, cpu, forward_host, BackwardIo, Device, FlashError, ForwardIo, InputStrides, MaskBuffers, Problem, Strides};
use masks::Index;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// The host functions take and return NumPy arrays.
type Array<'py> = Bound<'py, PyAny>;

/// The NumPy arrays of one call, named for messages; `inputs` must hold exactly N of them.
fn host_arrays<'py, const N: usize>(inputs: &[Array<'py>], names: [&'static str; N]) -> Result<[HostArray<'py>; N], FlashError> {
    attention_arrays(inputs, names, 0)
}

/// The NumPy arrays of an attention call: the first `views` (q, k, v; the backward's do and o
/// too) may be views the CPU kernels read in place, the others (lse) must be C-contiguous.
fn attention_arrays<'py, const N: usize>(
    inputs: &[Array<'py>], names: [&'static str; N], views: usize,
) -> Result<[HostArray<'py>; N], FlashError> {
    if inputs.len() != N {
        return Err(FlashError::Internal(format!("expected the {N} arrays {names:?}, got {}", inputs.len())));
    }
    let arrays: Vec<HostArray> = inputs
        .iter()
        .zip(names)
        .enumerate()
        .map(|(i, (obj, name))| if i < views { HostArray::extract_view(obj, name) } else { HostArray::extract(obj, name) })
        .collect::<Result<_, _>>()?;
    Ok(arrays.try_into().unwrap_or_else(|_| unreachable!("length checked above")))
}

/// The strides of `views` when any of them is a view; `None`: all packed. Every device reads them
/// (the host-to-GPU path uploads each view's span and passes its strides).
fn view_strides<const N: usize>(views: [&HostArray; N]) -> Result<Option<[Option<Strides>; N]>, FlashError> {
    if !views.iter().any(|a| a.is_view()) {
        return Ok(None);
    }
    let mut out = [None; N];
    for (s, a) in out.iter_mut().zip(views) {
        *s = Some(a.core_strides()?);
    }
    Ok(Some(out))
}

/// (o, lse) for NumPy `inputs` = [q, k, v], computed on `device` ("cpu", "cuda" or "auto"), with
/// the options and mask arrays in `options` (see masks.rs).
#[pyfunction]
#[pyo3(signature = (inputs, device, **options))]
fn forward_host_arrays<'py>(
    py: Python<'py>, inputs: Vec<Array<'py>>, device: &str, options: Option<&Bound<'py, PyDict>>,
) -> Result<(Array<'py>, Array<'py>), PyFlashError> {
    let device = Device::parse(device)?;
    let [q, k, v] = attention_arrays(&inputs, ["q", "k", "v"], 3)?;
    let c = masks::parse(options, Some(&HostArray::extract))?;
    let p = Problem::forward_masked(&q.spec(), &k.spec(), &v.spec(), &c.opts, &c.masks.args())?.with_modifiers(&c.mods.args())?;
    run_forward(py, device, &p, [q, k, v], c.masks.buffers())
}

/// (dq, dk, dv) — with sinks (dq, dk, dv, dsinks) — for NumPy `inputs` = [do, q, k, v, o, lse],
/// computed on `device`, with the forward's options, mask and modifier arrays; `dlse` (float32,
/// lse's shape) the optional gradient of lse.
#[pyfunction]
#[pyo3(signature = (inputs, device, dlse = None, **options))]
fn backward_host_arrays<'py>(
    py: Python<'py>, inputs: Vec<Array<'py>>, device: &str, dlse: Option<Array<'py>>, options: Option<&Bound<'py, PyDict>>,
) -> Result<Bound<'py, PyTuple>, PyFlashError> {
    let device = Device::parse(device)?;
    let a = attention_arrays(&inputs, ["do", "q", "k", "v", "o", "lse"], 5)?;
    let c = masks::parse(options, Some(&HostArray::extract))?;
    let p = Problem::backward_masked(a.each_ref().map(HostArray::spec).each_ref(), &c.opts, &c.masks.args())?
        .with_modifiers(&c.mods.args())?;
    let dlse = dlse_array(&p, dlse.as_ref())?;
    run_backward(py, device, &p, a, dlse.as_ref(), c.masks.buffers())
}

/// (o [total_q, H, Dv], lse [H, total_q]) for packed NumPy `inputs` = [q, k, v] and
/// `cu_seqlens` = [cu_seqlens_q, cu_seqlens_k] (int32 [B + 1]).
#[pyfunction]
#[pyo3(signature = (inputs, cu_seqlens, device, **options))]
fn varlen_forward_host_arrays<'py>(
    py: Python<'py>, inputs: Vec<Array<'py>>, cu_seqlens: Vec<Array<'py>>, device: &str,
    options: Option<&Bound<'py, PyDict>>,
) -> Result<(Array<'py>, Array<'py>), PyFlashError> {
    let device = Device::parse(device)?;
    let [q, k, v] = attention_arrays(&inputs, ["q", "k", "v"], 3)?;
    let [cu_q, cu_k] = cu_seqlens_arrays(&cu_seqlens)?;
    let (opts, mods) = masks::options(options)?;
    let p = Problem::varlen_forward(&q.spec(), &k.spec(), &v.spec(), &cu_q.arg(), &cu_k.arg(), &opts)?.with_modifiers(&mods.args())?;
    run_forward(py, device, &p, [q, k, v], MaskBuffers::default())
}

/// (dq, dk, dv[, dsinks]) of a packed call: `inputs` = [do, q, k, v, o, lse], `cu_seqlens` as the
/// forward's, `dlse` as [`backward_host_arrays`]'.
#[pyfunction]
#[pyo3(signature = (inputs, cu_seqlens, device, dlse = None, **options))]
fn varlen_backward_host_arrays<'py>(
    py: Python<'py>, inputs: Vec<Array<'py>>, cu_seqlens: Vec<Array<'py>>, device: &str, dlse: Option<Array<'py>>,
    options: Option<&Bound<'py, PyDict>>,
) -> Result<Bound<'py, PyTuple>, PyFlashError> {
    let device = Device::parse(device)?;
    let a = attention_arrays(&inputs, ["do", "q", "k", "v", "o", "lse"], 5)?;
    let [cu_q, cu_k] = cu_seqlens_arrays(&cu_seqlens)?;
    let [d_out, q, k, v, o, lse] = a.each_ref().map(HostArray::spec);
    let cu = [&cu_q.arg(), &cu_k.arg()];
    let (opts, mods) = masks::options(options)?;
    let p = Problem::varlen_backward(&d_out, &q, &k, &v, &o, &lse, cu, &opts)?.with_modifiers(&mods.args())?;
    let dlse = dlse_array(&p, dlse.as_ref())?;
    run_backward(py, device, &p, a, dlse.as_ref(), MaskBuffers::default())
}

/// The backward's optional `dlse`, checked against `p` (float32, lse's shape).
fn dlse_array<'py>(p: &Problem, dlse: Option<&Array<'py>>) -> Result<Option<HostArray<'py>>, FlashError> {
    let Some(obj) = dlse else { return Ok(None) };
    let a = HostArray::extract(obj, "dlse")?;
    p.check_dlse(&a.spec())?;
    Ok(Some(a))
}

/// The two cumulative-length arrays of a varlen call.
pub(crate) fn cu_seqlens_arrays<'py>(arrays: &[Array<'py>]) -> Result<[Index<'py>; 2], FlashError> {
    match arrays {
        [q, k] => Ok([Index::extract(q, "cu_seqlens_q")?, Index::extract(k, "cu_seqlens_k")?]),
        _ => Err(FlashError::Internal(format!("expected [cu_seqlens_q, cu_seqlens_k], got {} arrays", arrays.len()))),
    }
}

/// Allocates o ([`Problem::o_shape`]: q's rows with v's head dim) and lse for `p` and runs the
/// forward without the GIL.
fn run_forward<'py>(
    py: Python<'py>, device: Device, p: &Problem, [q, k, v]: [HostArray<'py>; 3], mask: MaskBuffers,
) -> Result<(Array<'py>, Array<'py>), PyFlashError> {
    let o = empty_like_dtype(py, &p.o_shape(), &q)?;
    let lse = empty_f32(py, &p.lse_shape())?;
    let strides = view_strides([&q, &k, &v])?.map(|s| InputStrides::forward(p, s));
    let mut io = ForwardIo::new([&q, &k, &v].map(HostArray::bytes), [o.bytes_mut(), lse.bytes_mut()]).with_mask(mask);
    if let Some(st) = strides {
        io = io.with_strides(st);
    }
    py.detach(|| forward_host(device, p, io))?;
    Ok((o.array.into_any(), lse.array.into_any()))
}

/// Allocates dq, dk, dv for `p` (the shapes of q, k and v; and dsinks [H] f32 when `p` has sinks)
/// and runs the backward without the GIL; returns them as a tuple.
fn run_backward<'py>(
    py: Python<'py>, device: Device, p: &Problem, a: [HostArray<'py>; 6], dlse: Option<&HostArray<'py>>, mask: MaskBuffers,
) -> Result<Bound<'py, PyTuple>, PyFlashError> {
    let [d_out, q, k, v, o, _] = &a;
    let strides = view_strides([d_out, q, k, v, o])?.map(|s| InputStrides::backward(p, s));
    let dq = empty_like_dtype(py, &p.q_shape(), q)?;
    let dk = empty_like_dtype(py, &p.kv_shape(), k)?;
    let dv = empty_like_dtype(py, &p.v_shape(), v)?;
    let dsinks = p.mods.sinks.as_ref().map(|_| empty_f32(py, &[p.dims.heads])).transpose()?;
    let mut io = BackwardIo::new(a.each_ref().map(HostArray::bytes), [dq.bytes_mut(), dk.bytes_mut(), dv.bytes_mut()])
        .with_mask(mask);
    if let Some(ds) = &dsinks {
        io = io.with_dsinks(ds.bytes_mut());
    }
    if let Some(g) = dlse {
        io = io.with_dlse(g.bytes());
    }
    if let Some(st) = strides {
        io = io.with_strides(st);
    }
    py.detach(|| backward_host(device, p, io))?;
    let mut out = vec![dq.array.into_any(), dk.array.into_any(), dv.array.into_any()];
    out.extend(dsinks.map(|d| d.array.into_any()));
    PyTuple::new(py, out).map_err(|e| PyFlashError(FlashError::Internal(format!("cannot build the gradients tuple: {e}"))))
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
    d.set_item("cpu_amx", cpu::decode_amx())?;
    d.set_item("cpu_vnni", cpu::decode_vnni())?;
    d.set_item("dispatch", dispatch_info(py)?)?;
    Ok(d)
}

/// The fused / materialized choice: `mode` (FLASH_NIF_MODE, or None), `max_bytes` (the ceiling in
/// force; an invalid FLASH_NIF_MATERIALIZE_MAX_BYTES is reported as `max_bytes_error`), and per
/// backend whether it has a materialized path and its crossover table.
fn dispatch_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    use flash_core::dispatch::{self, Backend};
    let d = PyDict::new(py);
    d.set_item("mode_env", dispatch::MODE_ENV)?;
    d.set_item("mode", std::env::var(dispatch::MODE_ENV).ok().filter(|v| !v.trim().is_empty()))?;
    d.set_item("max_bytes_env", dispatch::MAX_BYTES_ENV)?;
    match dispatch::max_bytes() {
        Ok(b) => d.set_item("max_bytes", b)?,
        Err(e) => d.set_item("max_bytes_error", e.to_string())?,
    }
    for (name, backend) in [("cpu", Backend::Cpu), ("cuda", Backend::Cuda)] {
        let rows: Vec<Bound<PyDict>> = dispatch::crossover(backend)
            .iter()
            .map(|c| {
                let r = PyDict::new(py);
                r.set_item("pass", c.pass.name())?;
                r.set_item("max_seq", c.max_seq)?;
                r.set_item("min_pairs", c.min_pairs)?;
                Ok(r)
            })
            .collect::<PyResult<_>>()?;
        let b = PyDict::new(py);
        b.set_item("materialized", dispatch::has_materialized(backend))?;
        b.set_item("crossover", rows)?;
        b.set_item("measured", dispatch::measured(backend))?;
        d.set_item(name, b)?;
    }
    Ok(d)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for f in [
        wrap_pyfunction!(forward_host_arrays, m)?,
        wrap_pyfunction!(backward_host_arrays, m)?,
        wrap_pyfunction!(varlen_forward_host_arrays, m)?,
        wrap_pyfunction!(varlen_backward_host_arrays, m)?,
        wrap_pyfunction!(info, m)?,
    ] {
        m.add_function(f)?;
    }
    cuda::register(m)?;
    kernels::register(m)?;
    rotary::register(m)?;
    quant::register(m)?;
    Ok(())
}
