//! The CUDA half of `flash_nif._native`: device-pointer entry points for CuPy / DLPack arrays
//! (the Python layer in `flash_nif/_cuda.py` allocates outputs and passes raw pointers, the
//! device ordinal and the caller's stream), and `cuda_info`. NumPy with `device="cuda"` goes
//! through the core's `forward_host` / `backward_host`. Validation is the core's `Problem`; errors map like the CPU's.

use flash_core::cuda::{self, BackwardPtrs, ForwardPtrs, MaskPtrs};
use flash_core::{FlashError, InputStrides, Problem, Strides, TensorSpec};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::PyFlashError;
use crate::masks::{self, DevArray, DevTensor};

fn dev_spec<'a>(t: &'a DevTensor, name: &'a str) -> TensorSpec<'a> {
    TensorSpec { name, dtype: &t.2, shape: &t.1, nbytes: None }
}

fn dev_specs<'a, const N: usize>(inputs: &'a [DevTensor], names: [&'a str; N]) -> Result<[TensorSpec<'a>; N], FlashError> {
    match <&[DevTensor; N]>::try_from(inputs) {
        Ok(ts) => Ok(std::array::from_fn(|i| dev_spec(&ts[i], names[i]))),
        Err(_) => Err(FlashError::Internal(format!("expected the {N} tensors {names:?}, got {}", inputs.len()))),
    }
}

/// Element strides per input (one per axis, as the array library reports them; None: packed).
type GivenStrides = Option<Vec<Option<Vec<i64>>>>;

/// Forward on device pointers. `inputs` = [q, k, v]; `outputs` = [o (like q), lse ([B, H, Sq] f32)],
/// preallocated by the caller on the same device; `strides`: where each input's rows lie (the last
/// axis contiguous; None: packed). Mask options: segment ids and the block mask as (pointer, shape,
/// dtype) on that device, seqused_k / leftpad_k as NumPy int32 copies.
#[pyfunction]
#[pyo3(signature = (inputs, outputs, device, stream, strides = None, **options))]
fn cuda_forward_device(
    py: Python<'_>, inputs: Vec<DevTensor>, outputs: [u64; 2], device: usize, stream: usize, strides: GivenStrides,
    options: Option<&Bound<'_, PyDict>>,
) -> Result<(), PyFlashError> {
    let [q, k, v] = dev_specs(&inputs, ["q", "k", "v"])?;
    let c = masks::parse(options, Some(&DevArray::extract))?;
    let p = Problem::forward_masked(&q, &k, &v, &c.opts, &c.masks.args())?.with_modifiers(&c.mods.args())?;
    let st = given_strides(&inputs, ["q", "k", "v"], strides)?.map(|s| InputStrides::forward(&p, s));
    run_forward(py, &p, &inputs, outputs, device, stream, c.masks.ptrs(), st)
}

/// The first N inputs' strides (`names` in `inputs`' order), checked; None: all packed.
fn given_strides<const N: usize>(
    inputs: &[DevTensor], names: [&str; N], given: GivenStrides,
) -> Result<Option<[Option<Strides>; N]>, FlashError> {
    let Some(given) = given else { return Ok(None) };
    if given.len() != inputs.len() || inputs.len() < N {
        return Err(FlashError::Internal(format!("{} strides for {} inputs", given.len(), inputs.len())));
    }
    let mut out = [None; N];
    for (i, name) in names.into_iter().enumerate() {
        out[i] = given[i].as_ref().map(|g| Strides::from_axes(name, &inputs[i].1, g)).transpose()?;
    }
    Ok(Some(out))
}

/// Backward on device pointers. `inputs` = [do, q, k, v, o, lse]; `outputs` = [dq (like q), dk, dv
/// (like k), dsinks ([H] f32, or 0 without sinks)], preallocated by the caller on the same device;
/// `dlse` the optional gradient of lse (f32, lse's shape, same device); the forward's mask and
/// modifier options.
#[pyfunction]
#[pyo3(signature = (inputs, outputs, device, stream, dlse = None, strides = None, **options))]
#[allow(clippy::too_many_arguments)] // the binding's arguments, as the Python layer passes them
fn cuda_backward_device(
    py: Python<'_>, inputs: Vec<DevTensor>, outputs: [u64; 4], device: usize, stream: usize, dlse: Option<DevTensor>,
    strides: GivenStrides, options: Option<&Bound<'_, PyDict>>,
) -> Result<(), PyFlashError> {
    let specs = dev_specs(&inputs, ["do", "q", "k", "v", "o", "lse"])?;
    let c = masks::parse(options, Some(&DevArray::extract))?;
    let p = Problem::backward_masked(specs.each_ref(), &c.opts, &c.masks.args())?.with_modifiers(&c.mods.args())?;
    let dlse = dlse_ptr(&p, dlse.as_ref())?;
    let st = given_strides(&inputs, BACKWARD_STRIDED, strides)?.map(|s| InputStrides::backward(&p, s));
    run_backward(py, &p, &inputs, outputs, dlse, device, stream, c.masks.ptrs(), st)
}

/// The backward's inputs that may be views, in order (lse, after them, is packed).
const BACKWARD_STRIDED: [&str; 5] = ["do", "q", "k", "v", "o"];

/// The device pointer of the optional `dlse` (0: none), checked against `p`.
fn dlse_ptr(p: &Problem, dlse: Option<&DevTensor>) -> Result<u64, FlashError> {
    let Some(t) = dlse else { return Ok(0) };
    p.check_dlse(&dev_spec(t, "dlse"))?;
    Ok(t.0)
}

/// Packed variable-length forward on device pointers: `inputs` = [q [total_q, H, D], k, v
/// [total_k, Hkv, D]]; `outputs` = [o (like q), lse ([H, total_q] f32)]; `cu_seqlens` =
/// [cu_seqlens_q, cu_seqlens_k] as NumPy int32 [B + 1] (host copies: they size the grid).
#[pyfunction]
#[pyo3(signature = (inputs, outputs, cu_seqlens, device, stream, strides = None, **options))]
#[allow(clippy::too_many_arguments)] // the binding's arguments, as the Python layer passes them
fn cuda_varlen_forward_device<'py>(
    py: Python<'py>, inputs: Vec<DevTensor>, outputs: [u64; 2], cu_seqlens: Vec<Bound<'py, PyAny>>, device: usize,
    stream: usize, strides: GivenStrides, options: Option<&Bound<'py, PyDict>>,
) -> Result<(), PyFlashError> {
    let [q, k, v] = dev_specs(&inputs, ["q", "k", "v"])?;
    let [cu_q, cu_k] = crate::cu_seqlens_arrays(&cu_seqlens)?;
    let (opts, mods) = masks::options(options)?;
    let p = Problem::varlen_forward(&q, &k, &v, &cu_q.arg(), &cu_k.arg(), &opts)?.with_modifiers(&mods.args())?;
    let st = given_strides(&inputs, ["q", "k", "v"], strides)?.map(|s| InputStrides::forward(&p, s));
    run_forward(py, &p, &inputs, outputs, device, stream, MaskPtrs::default(), st)
}

/// Packed variable-length backward on device pointers: `inputs` = [do, q, k, v, o, lse],
/// `outputs` = [dq, dk, dv, dsinks or 0], `cu_seqlens` as the forward's, `dlse` as [`cuda_backward_device`]'s.
#[pyfunction]
#[pyo3(signature = (inputs, outputs, cu_seqlens, device, stream, dlse = None, strides = None, **options))]
#[allow(clippy::too_many_arguments)] // the binding's positional arguments, as the Python layer passes them
fn cuda_varlen_backward_device<'py>(
    py: Python<'py>, inputs: Vec<DevTensor>, outputs: [u64; 4], cu_seqlens: Vec<Bound<'py, PyAny>>, device: usize,
    stream: usize, dlse: Option<DevTensor>, strides: GivenStrides, options: Option<&Bound<'py, PyDict>>,
) -> Result<(), PyFlashError> {
    let [d_out, q, k, v, o, lse] = dev_specs(&inputs, ["do", "q", "k", "v", "o", "lse"])?;
    let [cu_q, cu_k] = crate::cu_seqlens_arrays(&cu_seqlens)?;
    let cu = [&cu_q.arg(), &cu_k.arg()];
    let (opts, mods) = masks::options(options)?;
    let p = Problem::varlen_backward(&d_out, &q, &k, &v, &o, &lse, cu, &opts)?.with_modifiers(&mods.args())?;
    let dlse = dlse_ptr(&p, dlse.as_ref())?;
    let st = given_strides(&inputs, BACKWARD_STRIDED, strides)?.map(|s| InputStrides::backward(&p, s));
    run_backward(py, &p, &inputs, outputs, dlse, device, stream, MaskPtrs::default(), st)
}

/// Queues the forward of `p` on `stream` without the GIL (`inputs` checked by `p` already).
#[allow(clippy::too_many_arguments)] // the call's pointers, device, stream, masks and strides
fn run_forward(
    py: Python<'_>, p: &Problem, inputs: &[DevTensor], [o, lse]: [u64; 2], device: usize, stream: usize, mask: MaskPtrs,
    strides: Option<InputStrides>,
) -> Result<(), PyFlashError> {
    let [q, k, v] = [0, 1, 2].map(|i| inputs[i].0);
    let ptrs = ForwardPtrs { q, k, v, o, lse, mask, strides };
    // SAFETY: the Python layer passes pointers of arrays of these shapes (laid out as `strides`
    // say: views of allocations that hold every element) on `device`, kept alive by the caller
    // until the stream has run.
    Ok(py.detach(|| unsafe { cuda::forward_device(p, device, stream, ptrs) })?)
}

/// Queues the backward of `p` on `stream` without the GIL.
#[allow(clippy::too_many_arguments)] // the call's pointers, device, stream and masks
fn run_backward(
    py: Python<'_>, p: &Problem, inputs: &[DevTensor], [dq, dk, dv, dsinks]: [u64; 4], dlse: u64, device: usize,
    stream: usize, mask: MaskPtrs, strides: Option<InputStrides>,
) -> Result<(), PyFlashError> {
    let [d_out, q, k, v, o, lse] = [0, 1, 2, 3, 4, 5].map(|i| inputs[i].0);
    let ptrs = BackwardPtrs { d_out, q, k, v, o, lse, dq, dk, dv, dsinks, dlse, mask, strides };
    // SAFETY: as run_forward.
    Ok(py.detach(|| unsafe { cuda::backward_device(p, device, stream, ptrs) })?)
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
    d.set_item("sm90_env", cuda::SM90_ENV)?;
    d.set_item("sm90", i.sm90)?;
    d.set_item("tf32_env", cuda::TF32_ENV)?;
    d.set_item("log_env", cuda::LOG_ENV)?;
    let last = cuda::last_kernels();
    let kernels = PyDict::new(py);
    for (pass, ran) in [("forward", last.forward), ("backward", last.backward)] {
        let r = PyDict::new(py);
        r.set_item("kernel", ran.kernel)?;
        r.set_item("not_sm90_because", ran.fallback)?;
        r.set_item("math", ran.math)?;
        kernels.set_item(pass, r)?;
    }
    d.set_item("last_kernels", kernels)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for f in [
        wrap_pyfunction!(cuda_forward_device, m)?,
        wrap_pyfunction!(cuda_backward_device, m)?,
        wrap_pyfunction!(cuda_varlen_forward_device, m)?,
        wrap_pyfunction!(cuda_varlen_backward_device, m)?,
        wrap_pyfunction!(cuda_set_search_roots, m)?,
        wrap_pyfunction!(cuda_info, m)?,
    ] {
        m.add_function(f)?;
    }
    Ok(())
}
