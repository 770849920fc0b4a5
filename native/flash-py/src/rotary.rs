//! Rotary embeddings for `flash_nif.rotary`: NumPy arrays on any device, and device pointers of
//! CuPy / DLPack arrays. The core's `RotaryProblem` validates; this converts and maps errors.

use flash_core::cuda::{rotary_device, RotaryPtrs};
use flash_core::{rotary_host, Device, FlashError, Positions, RotaryIo, RotaryOptions, RotaryProblem, TensorSpec};
use pyo3::prelude::*;

use crate::arrays::empty_like_dtype;
use crate::errors::PyFlashError;
use crate::masks::{DevTensor, Index};

type Array<'py> = Bound<'py, PyAny>;

/// The name of x in messages: the forward's `x`, the backward's `dy`.
fn x_name(backward: bool) -> &'static str {
    if backward {
        "dy"
    } else {
        "x"
    }
}

fn dev_spec<'a>(t: &'a DevTensor, name: &'a str) -> TensorSpec<'a> {
    TensorSpec { name, dtype: &t.2, shape: &t.1, nbytes: None }
}

fn validate(x: &TensorSpec, cos: &TensorSpec, sin: &TensorSpec, opts: &RotaryOptions, backward: bool) -> Result<RotaryProblem, FlashError> {
    if backward {
        RotaryProblem::backward(x, cos, sin, opts)
    } else {
        RotaryProblem::apply(x, cos, sin, opts)
    }
}

/// `positions` (an int32 array, host copy) or `offset`, as the core takes them.
fn positions<'a>(array: Option<&'a Index>, offset: i64) -> Positions<'a> {
    match array {
        Some(a) => Positions::Array(a.arg()),
        None => Positions::Offset(offset),
    }
}

/// y (or dx with `backward`) for NumPy `inputs` = [x (or dy), cos, sin], computed on `device`.
/// `positions`: int32 [B, S] NumPy array, or None for `offset`.
#[pyfunction]
#[pyo3(signature = (inputs, device, *, backward, interleaved, positions = None, offset = 0))]
fn rotary_host_arrays<'py>(
    py: Python<'py>, inputs: Vec<Array<'py>>, device: &str, backward: bool, interleaved: bool, positions: Option<Array<'py>>,
    offset: i64,
) -> Result<Array<'py>, PyFlashError> {
    let device = Device::parse(device)?;
    let [x, cos, sin] = crate::host_arrays(&inputs, [x_name(backward), "cos", "sin"])?;
    let index = positions.as_ref().map(|p| Index::extract(p, "positions")).transpose()?;
    let opts = RotaryOptions { interleaved, positions: self::positions(index.as_ref(), offset) };
    let p = validate(&x.spec(), &cos.spec(), &sin.spec(), &opts, backward)?;
    let y = empty_like_dtype(py, &p.dims.x_shape(), &x)?;
    let io = RotaryIo {
        x: x.bytes(),
        cos: cos.bytes(),
        sin: sin.bytes(),
        positions: index.as_ref().map(Index::bytes),
        y: y.bytes_mut(),
    };
    py.detach(|| rotary_host(device, &p, io))?;
    Ok(y.array.into_any())
}

/// Rotary embeddings on device pointers: `inputs` = [x (or dy), cos, sin] as (pointer, shape,
/// dtype), `output` = y's pointer (like x, preallocated on the same device); `positions` =
/// (device pointer of the int32 [B, S] array, its NumPy copy, which the core checks) or None for
/// `offset`. Queued on `stream`; nothing is synchronised.
#[pyfunction]
#[pyo3(signature = (inputs, output, device, stream, *, backward, interleaved, positions = None, offset = 0))]
#[allow(clippy::too_many_arguments)] // the Python keyword arguments
fn cuda_rotary_device<'py>(
    py: Python<'py>, inputs: Vec<DevTensor>, output: u64, device: usize, stream: usize, backward: bool, interleaved: bool,
    positions: Option<(u64, Array<'py>)>, offset: i64,
) -> Result<(), PyFlashError> {
    let [x, cos, sin] = <[DevTensor; 3]>::try_from(inputs)
        .map_err(|v| FlashError::Internal(format!("expected the 3 tensors [x, cos, sin], got {}", v.len())))?;
    let (ptr, index) = match &positions {
        Some((ptr, host)) => (*ptr, Some(Index::extract(host, "positions")?)),
        None => (0, None),
    };
    let opts = RotaryOptions { interleaved, positions: self::positions(index.as_ref(), offset) };
    let p = validate(&dev_spec(&x, x_name(backward)), &dev_spec(&cos, "cos"), &dev_spec(&sin, "sin"), &opts, backward)?;
    let ptrs = RotaryPtrs { x: x.0, cos: cos.0, sin: sin.0, positions: ptr, y: output };
    // SAFETY: the Python layer passes pointers of contiguous arrays of these shapes on `device`
    // (positions: the array whose copy was validated), kept alive until the stream has run.
    Ok(py.detach(|| unsafe { rotary_device(&p, device, stream, ptrs) })?)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rotary_host_arrays, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_rotary_device, m)?)?;
    Ok(())
}
