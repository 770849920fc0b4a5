//! The quantized KV cache and state merging for `flash_nif.quantize_kv`, `dequantize_kv` and
//! `merge_states` (NumPy arrays; the Python layer allocates the outputs). The core checks.

use flash_core::decode::{self, Cache, Decode};
use flash_core::{quant, DType, FlashError};
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
    let (x, words, s, b) = (x.bytes(), view_mut::<u32>(&v)?, s.bytes_mut(), b.bytes_mut());
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
    let (words, s, b, out) = (view::<u32>(&v)?, s.bytes(), b.bytes(), out.bytes_mut());
    py.detach(|| quant::dequantize(dtype, &fmt, words, s, b, out))?;
    Ok(())
}

/// Fills `o` `[B, Sq, H, Dv]` and `lse` `[B, H, Sq]` with the merged states.
#[pyfunction]
fn merge_states_host<'py>(py: Python<'py>, o_parts: Array<'py>, lse_parts: Array<'py>, o: Array<'py>, lse: Array<'py>) -> Result<(), PyFlashError> {
    let (op, lp) = (HostArray::extract(&o_parts, "o_parts")?, HostArray::extract(&lse_parts, "lse_parts")?);
    let (o, lse) = (HostArray::extract(&o, "o")?, HostArray::extract(&lse, "lse")?);
    let (dtype, [p, b, sq, h, dv]) = quant::check_states(&op.spec(), &lp.spec())?;
    let (op, lp, o, lse) = (op.bytes(), view::<f32>(&lp)?, o.bytes_mut(), view_mut::<f32>(&lse)?);
    py.detach(|| quant::merge_states(dtype, p, b, sq, h, dv, op, lp, o, lse))?;
    Ok(())
}

/// A cache argument: `[x]`, or `[values, scales, biases]` with `quant` = (bits, group_size).
struct CacheArrays<'py> {
    arrays: Vec<HostArray<'py>>,
    quant: Option<(quant::QuantFormat, DType)>,
    shape: [usize; 4],
    dtype: DType,
}

impl<'py> CacheArrays<'py> {
    fn extract(parts: &[Array<'py>], quant: Option<(usize, usize)>, name: &'static str) -> Result<Self, FlashError> {
        match (quant, parts) {
            (None, [x]) => {
                let x = HostArray::extract(x, name)?;
                let spec = x.spec();
                let dtype = DType::parse(spec.dtype, name)?;
                let shape = <[usize; 4]>::try_from(spec.shape)
                    .map_err(|_| FlashError::Shape(format!("{name} must be [B, S_cache, Hkv, D]; got {:?}", spec.shape)))?;
                Ok(CacheArrays { arrays: vec![x], quant: None, shape, dtype })
            }
            (Some((bits, group_size)), [values, scales, biases]) => {
                let arrays = vec![HostArray::extract(values, "values")?, HostArray::extract(scales, "scales")?, HostArray::extract(biases, "biases")?];
                let (dtype, fmt, shape) = quant::check_parts(&arrays[0].spec(), &arrays[1].spec(), &arrays[2].spec(), bits, group_size)?;
                Ok(CacheArrays { arrays, quant: Some((fmt, dtype)), shape, dtype })
            }
            _ => Err(FlashError::Internal(format!("{name}: expected [x] or [values, scales, biases]"))),
        }
    }

    fn cache(&self) -> Result<Cache<'_>, FlashError> {
        Ok(match self.quant {
            None => Cache::Plain(self.arrays[0].bytes()),
            Some((fmt, _)) => Cache::Quant { fmt, values: view::<u32>(&self.arrays[0])?, scales: self.arrays[1].bytes(), biases: self.arrays[2].bytes() },
        })
    }
}

/// o `[B, Sq, H, D]` and lse `[B, H, Sq]` (preallocated) of q against the caches; seqlens and
/// leftpad int32 `[B]`.
#[pyfunction]
#[pyo3(signature = (q, k, v, seqlens, leftpad, o, lse, *, k_quant, v_quant, causal, scale, window_left, window_right, softcap, num_splits))]
#[allow(clippy::too_many_arguments)] // the Python keyword arguments
fn decode_host<'py>(
    py: Python<'py>, q: Array<'py>, k: Vec<Array<'py>>, v: Vec<Array<'py>>, seqlens: Array<'py>, leftpad: Array<'py>, o: Array<'py>, lse: Array<'py>,
    k_quant: Option<(usize, usize)>, v_quant: Option<(usize, usize)>, causal: bool, scale: Option<f32>, window_left: Option<usize>,
    window_right: Option<usize>, softcap: Option<f32>, num_splits: Option<usize>,
) -> Result<(), PyFlashError> {
    let q = HostArray::extract(&q, "q")?;
    let (k, v) = (CacheArrays::extract(&k, k_quant, "k_cache")?, CacheArrays::extract(&v, v_quant, "v_cache")?);
    let p = Decode::new(&q.spec(), (k.dtype, k.shape), (v.dtype, v.shape), causal, scale, (window_left, window_right), softcap, num_splits)?;
    let (sl, lp) = (HostArray::extract(&seqlens, "cache_seqlens")?, HostArray::extract(&leftpad, "leftpad_k")?);
    for a in [&sl, &lp] {
        let spec = a.spec();
        if spec.dtype != "int32" || spec.shape != [p.batch] {
            return Err(FlashError::Shape(format!("{} must be int32 [B] = [{}]; got {} {:?}", spec.name, p.batch, spec.dtype, spec.shape)).into());
        }
    }
    let (o, lse) = (HostArray::extract(&o, "o")?, HostArray::extract(&lse, "lse")?);
    let (kc, vc) = (k.cache()?, v.cache()?);
    let (qb, sl, lp, ob, lse) = (q.bytes(), view::<i32>(&sl)?, view::<i32>(&lp)?, o.bytes_mut(), view_mut::<f32>(&lse)?);
    py.detach(|| decode::decode_cpu(&p, qb, kc, vc, sl, lp, ob, lse))?;
    Ok(())
}

// The arrays' bytes as 4-byte elements (u32, i32, f32): their dtype is checked by the core first;
// an array whose buffer is not 4-byte aligned (a view into foreign memory) is an error rather than
// a misaligned read.
trait Word: Copy {}
impl Word for u32 {}
impl Word for i32 {}
impl Word for f32 {}

fn aligned(a: &HostArray) -> Result<(), FlashError> {
    if !(a.bytes().as_ptr() as usize).is_multiple_of(4) {
        return Err(FlashError::Shape("an array's buffer is not 4-byte aligned; pass a copy (numpy.array(x))".into()));
    }
    Ok(())
}

fn view<'a, T: Word>(a: &'a HostArray) -> Result<&'a [T], FlashError> {
    aligned(a)?;
    let b = a.bytes();
    // SAFETY: an array of 4-byte elements of T's dtype (checked by the caller), aligned to 4
    // (checked), of b.len() / 4 elements; every bit pattern is a valid u32, i32 or f32.
    Ok(unsafe { std::slice::from_raw_parts(b.as_ptr() as *const T, b.len() / 4) })
}

#[allow(clippy::mut_from_ref)]
fn view_mut<'a, T: Word>(a: &'a HostArray) -> Result<&'a mut [T], FlashError> {
    aligned(a)?;
    let b = a.bytes_mut();
    // SAFETY: as `view`, an output array this call owns.
    Ok(unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut T, b.len() / 4) })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quantize_kv_host, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_kv_host, m)?)?;
    m.add_function(wrap_pyfunction!(merge_states_host, m)?)?;
    m.add_function(wrap_pyfunction!(decode_host, m)?)?;
    Ok(())
}
