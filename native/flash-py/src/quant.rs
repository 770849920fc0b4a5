//! The quantized KV cache and state merging for `flash_nif.quantize_kv`, `dequantize_kv` and
//! `merge_states` (NumPy arrays; the Python layer allocates the outputs). The core checks.

use flash_core::{quant, FlashError};
use pyo3::prelude::*;

use crate::arrays::HostArray;
use crate::errors::PyFlashError;

type Array<'py> = Bound<'py, PyAny>;

/// Fills `values`, `scales` and `biases` with `x` quantized.
#[pyfunction]
#[pyo3(signature = (x, values, scales, biases, *, bits, group_size))]
fn quantize_kv_host<'py>(
    py: Python<'py>, x: Array<'py>, values: Array<'py>, scales: Array<'py>, biases: Array<'py>, bits: usize, group_size: usize,
) -> Result<(), PyFlashError> {
    let x = HostArray::extract(&x, "x")?;
    let (v, s, b) = (HostArray::extract(&values, "values")?, HostArray::extract(&scales, "scales")?, HostArray::extract(&biases, "biases")?);
    let (dtype, fmt, shape) = quant::check_cache(&x.spec(), bits, group_size)?;
    let (parts_dtype, parts_fmt, parts_shape) = quant::check_parts(&v.spec(), &s.spec(), &b.spec(), bits, group_size)?;
    if (parts_dtype, parts_fmt, parts_shape) != (dtype, fmt, shape) {
        return Err(FlashError::Internal("the outputs do not match x".into()).into());
    }
    let (x, words, s, b) = (x.bytes(), words_mut(&v)?, s.bytes_mut(), b.bytes_mut());
    py.detach(|| quant::quantize(dtype, &fmt, x, words, s, b))?;
    Ok(())
}

/// Fills `out` (the cache's shape, in the scales' dtype) with the cache dequantized.
#[pyfunction]
#[pyo3(signature = (values, scales, biases, out, *, bits, group_size))]
fn dequantize_kv_host<'py>(
    py: Python<'py>, values: Array<'py>, scales: Array<'py>, biases: Array<'py>, out: Array<'py>, bits: usize, group_size: usize,
) -> Result<(), PyFlashError> {
    let (v, s, b) = (HostArray::extract(&values, "values")?, HostArray::extract(&scales, "scales")?, HostArray::extract(&biases, "biases")?);
    let out = HostArray::extract(&out, "out")?;
    let (dtype, fmt, _) = quant::check_parts(&v.spec(), &s.spec(), &b.spec(), bits, group_size)?;
    let (words, s, b, out) = (words(&v)?, s.bytes(), b.bytes(), out.bytes_mut());
    py.detach(|| quant::dequantize(dtype, &fmt, words, s, b, out))?;
    Ok(())
}

/// Fills `o` `[B, Sq, H, Dv]` and `lse` `[B, H, Sq]` with the merged states.
#[pyfunction]
fn merge_states_host<'py>(py: Python<'py>, o_parts: Array<'py>, lse_parts: Array<'py>, o: Array<'py>, lse: Array<'py>) -> Result<(), PyFlashError> {
    let (op, lp) = (HostArray::extract(&o_parts, "o_parts")?, HostArray::extract(&lse_parts, "lse_parts")?);
    let (o, lse) = (HostArray::extract(&o, "o")?, HostArray::extract(&lse, "lse")?);
    let (dtype, [p, b, sq, h, dv]) = quant::check_states(&op.spec(), &lp.spec())?;
    let (op, lp, o, lse) = (op.bytes(), floats(&lp)?, o.bytes_mut(), floats_mut(&lse)?);
    py.detach(|| quant::merge_states(dtype, p, b, sq, h, dv, op, lp, o, lse))?;
    Ok(())
}

// The arrays' bytes as u32 / f32: their dtype is checked by the core first; an array whose buffer
// is not 4-byte aligned (a view into foreign memory) is an error rather than a misaligned read.
fn aligned(a: &HostArray) -> Result<(), FlashError> {
    if !(a.bytes().as_ptr() as usize).is_multiple_of(4) {
        return Err(FlashError::Shape("an array's buffer is not 4-byte aligned; pass a copy (numpy.array(x))".into()));
    }
    Ok(())
}
fn words<'a>(a: &'a HostArray) -> Result<&'a [u32], FlashError> {
    aligned(a)?;
    let b = a.bytes();
    // SAFETY: a uint32 array's buffer, aligned to 4 (checked), of b.len() / 4 elements.
    Ok(unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u32, b.len() / 4) })
}
#[allow(clippy::mut_from_ref)]
fn words_mut<'a>(a: &'a HostArray) -> Result<&'a mut [u32], FlashError> {
    aligned(a)?;
    let b = a.bytes_mut();
    // SAFETY: as `words`, an output array this call owns.
    Ok(unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut u32, b.len() / 4) })
}
fn floats<'a>(a: &'a HostArray) -> Result<&'a [f32], FlashError> {
    aligned(a)?;
    let b = a.bytes();
    // SAFETY: a float32 array's buffer, aligned to 4 (checked).
    Ok(unsafe { std::slice::from_raw_parts(b.as_ptr() as *const f32, b.len() / 4) })
}
#[allow(clippy::mut_from_ref)]
fn floats_mut<'a>(a: &'a HostArray) -> Result<&'a mut [f32], FlashError> {
    aligned(a)?;
    let b = a.bytes_mut();
    // SAFETY: as `floats`, an output array this call owns.
    Ok(unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut f32, b.len() / 4) })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quantize_kv_host, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_kv_host, m)?)?;
    m.add_function(wrap_pyfunction!(merge_states_host, m)?)?;
    Ok(())
}
