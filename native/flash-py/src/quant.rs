//! The quantized KV cache, state merging and decode for `flash_nif.quantize_kv`, `dequantize_kv`,
//! `merge_states` and `decode`: NumPy arrays on the CPU or through GPU 0 (`device`), and device
//! pointers of CuPy / torch arrays (`cuda_*_device`). The Python layer allocates the outputs; the
//! core checks.

use flash_core::cuda::{self, CachePtrs, DecodePtrs, MergePtrs, QuantPtrs};
use flash_core::decode::{self, Cache, Decode};
use flash_core::{quant, DType, Device, FlashError, TensorSpec};
use pyo3::prelude::*;

use crate::arrays::HostArray;
use crate::errors::PyFlashError;
use crate::masks::DevTensor;

type Array<'py> = Bound<'py, PyAny>;

/// Fills `values`, `scales` and `biases` with `x` quantized.
#[pyfunction]
#[pyo3(signature = (x, values, scales, biases, *, bits, group_size, device = "cpu"))]
#[allow(clippy::too_many_arguments)] // the Python keyword arguments
fn quantize_kv_host<'py>(
    py: Python<'py>, x: Array<'py>, values: Array<'py>, scales: Array<'py>, biases: Array<'py>, bits: usize, group_size: usize, device: &str,
) -> Result<(), PyFlashError> {
    let device = Device::parse(device)?;
    let x = HostArray::extract(&x, "x")?;
    let (v, s, b) = (HostArray::extract(&values, "values")?, HostArray::extract(&scales, "scales")?, HostArray::extract(&biases, "biases")?);
    let (dtype, fmt, shape) = quant::check_cache(&x.spec(), bits, group_size)?;
    let (parts_dtype, parts_fmt, parts_shape) = quant::check_parts(&v.spec(), &s.spec(), &b.spec(), bits, group_size)?;
    if (parts_dtype, parts_fmt, parts_shape) != (dtype, fmt, shape) {
        return Err(FlashError::Internal("the outputs do not match x".into()).into());
    }
    let (x, words, s, b) = (x.bytes(), view_mut::<u32>(&v)?, s.bytes_mut(), b.bytes_mut());
    py.detach(|| quant::quantize_host(device, dtype, &fmt, x, words, s, b))?;
    Ok(())
}

/// Fills `out` (the cache's shape, in the scales' dtype) with the cache dequantized.
#[pyfunction]
#[pyo3(signature = (values, scales, biases, out, *, bits, group_size, device = "cpu"))]
#[allow(clippy::too_many_arguments)] // the Python keyword arguments
fn dequantize_kv_host<'py>(
    py: Python<'py>, values: Array<'py>, scales: Array<'py>, biases: Array<'py>, out: Array<'py>, bits: usize, group_size: usize, device: &str,
) -> Result<(), PyFlashError> {
    let device = Device::parse(device)?;
    let (v, s, b) = (HostArray::extract(&values, "values")?, HostArray::extract(&scales, "scales")?, HostArray::extract(&biases, "biases")?);
    let out = HostArray::extract(&out, "out")?;
    let (dtype, fmt, _) = quant::check_parts(&v.spec(), &s.spec(), &b.spec(), bits, group_size)?;
    let (words, s, b, out) = (view::<u32>(&v)?, s.bytes(), b.bytes(), out.bytes_mut());
    py.detach(|| quant::dequantize_host(device, dtype, &fmt, words, s, b, out))?;
    Ok(())
}

/// Fills `o` `[B, Sq, H, Dv]` and `lse` `[B, H, Sq]` with the merged states.
#[pyfunction]
#[pyo3(signature = (o_parts, lse_parts, o, lse, *, device = "cpu"))]
fn merge_states_host<'py>(
    py: Python<'py>, o_parts: Array<'py>, lse_parts: Array<'py>, o: Array<'py>, lse: Array<'py>, device: &str,
) -> Result<(), PyFlashError> {
    let device = Device::parse(device)?;
    let (op, lp) = (HostArray::extract(&o_parts, "o_parts")?, HostArray::extract(&lse_parts, "lse_parts")?);
    let (o, lse) = (HostArray::extract(&o, "o")?, HostArray::extract(&lse, "lse")?);
    let (dtype, [p, b, sq, h, dv]) = quant::check_states(&op.spec(), &lp.spec())?;
    let (op, lp, o, lse) = (op.bytes(), view::<f32>(&lp)?, o.bytes_mut(), view_mut::<f32>(&lse)?);
    py.detach(|| quant::merge_states_host(device, dtype, p, b, sq, h, dv, op, lp, o, lse))?;
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
#[pyo3(signature = (q, k, v, seqlens, leftpad, o, lse, *, k_quant, v_quant, causal, scale, window_left, window_right, softcap, num_splits, device = "cpu"))]
#[allow(clippy::too_many_arguments)] // the Python keyword arguments
fn decode_host<'py>(
    py: Python<'py>, q: Array<'py>, k: Vec<Array<'py>>, v: Vec<Array<'py>>, seqlens: Array<'py>, leftpad: Array<'py>, o: Array<'py>, lse: Array<'py>,
    k_quant: Option<(usize, usize)>, v_quant: Option<(usize, usize)>, causal: bool, scale: Option<f32>, window_left: Option<usize>,
    window_right: Option<usize>, softcap: Option<f32>, num_splits: Option<usize>, device: &str,
) -> Result<(), PyFlashError> {
    let device = Device::parse(device)?;
    let q = HostArray::extract(&q, "q")?;
    let (k, v) = (CacheArrays::extract(&k, k_quant, "k_cache")?, CacheArrays::extract(&v, v_quant, "v_cache")?);
    let p = Decode::new(&q.spec(), (k.dtype, k.shape), (v.dtype, v.shape), causal, scale, (window_left, window_right), softcap, num_splits)?;
    let (sl, lp) = (row_bounds(&seqlens, "cache_seqlens", p.batch)?, row_bounds(&leftpad, "leftpad_k", p.batch)?);
    let (o, lse) = (HostArray::extract(&o, "o")?, HostArray::extract(&lse, "lse")?);
    let (kc, vc) = (k.cache()?, v.cache()?);
    let (qb, sl, lp, ob, lse) = (q.bytes(), view::<i32>(&sl)?, view::<i32>(&lp)?, o.bytes_mut(), view_mut::<f32>(&lse)?);
    py.detach(|| decode::decode_host(device, &p, qb, kc, vc, sl, lp, ob, lse))?;
    Ok(())
}

/// `cache_seqlens` / `leftpad_k`: a NumPy int32 [B] array (a GPU array's host copy).
fn row_bounds<'py>(a: &Array<'py>, name: &'static str, batch: usize) -> Result<HostArray<'py>, FlashError> {
    let a = HostArray::extract(a, name)?;
    let spec = a.spec();
    if spec.dtype != "int32" || spec.shape != [batch] {
        return Err(FlashError::Shape(format!("{name} must be int32 [B] = [{batch}]; got {} {:?}", spec.dtype, spec.shape)));
    }
    Ok(a)
}

fn dev_spec<'a>(t: &'a DevTensor, name: &'a str) -> TensorSpec<'a> {
    TensorSpec { name, dtype: &t.2, shape: &t.1, nbytes: None }
}

/// Quantizes `x` (a device tensor) into `outputs` = [values, scales, biases] (device pointers of
/// arrays the Python layer allocated with the format's shapes), queued on `stream`.
#[pyfunction]
#[pyo3(signature = (x, outputs, device, stream, *, bits, group_size))]
fn cuda_quantize_kv_device(
    py: Python<'_>, x: DevTensor, outputs: [u64; 3], device: usize, stream: usize, bits: usize, group_size: usize,
) -> Result<(), PyFlashError> {
    let (dtype, fmt, [b, s, h, _]) = quant::check_cache(&dev_spec(&x, "x"), bits, group_size)?;
    let ptrs = QuantPtrs { x: x.0, values: outputs[0], scales: outputs[1], biases: outputs[2] };
    // SAFETY: the Python layer passes contiguous arrays of the checked shapes on `device`, kept
    // alive until the stream has run.
    Ok(py.detach(|| unsafe { cuda::quantize_device(dtype, &fmt, b * s * h, device, stream, ptrs) })?)
}

/// Dequantizes `parts` = [values, scales, biases] (device tensors) into `out` (the cache's shape in
/// the scales' dtype), queued on `stream`.
#[pyfunction]
#[pyo3(signature = (parts, out, device, stream, *, bits, group_size))]
fn cuda_dequantize_kv_device(
    py: Python<'_>, parts: Vec<DevTensor>, out: u64, device: usize, stream: usize, bits: usize, group_size: usize,
) -> Result<(), PyFlashError> {
    let [v, s, b] = three(parts, ["values", "scales", "biases"])?;
    let (dtype, fmt, [nb, ns, nh, _]) = quant::check_parts(&dev_spec(&v, "values"), &dev_spec(&s, "scales"), &dev_spec(&b, "biases"), bits, group_size)?;
    let ptrs = QuantPtrs { x: out, values: v.0, scales: s.0, biases: b.0 };
    // SAFETY: as cuda_quantize_kv_device.
    Ok(py.detach(|| unsafe { cuda::dequantize_device(dtype, &fmt, nb * ns * nh, device, stream, ptrs) })?)
}

/// Merges `o_parts` [P, B, Sq, H, Dv] and `lse_parts` [P, B, H, Sq] (device tensors) into
/// `outputs` = [o, lse], queued on `stream`.
#[pyfunction]
fn cuda_merge_states_device(
    py: Python<'_>, o_parts: DevTensor, lse_parts: DevTensor, outputs: [u64; 2], device: usize, stream: usize,
) -> Result<(), PyFlashError> {
    let (dtype, dims) = quant::check_states(&dev_spec(&o_parts, "o_parts"), &dev_spec(&lse_parts, "lse_parts"))?;
    let ptrs = MergePtrs { o_parts: o_parts.0, lse_parts: lse_parts.0, o: outputs[0], lse: outputs[1] };
    // SAFETY: as cuda_quantize_kv_device.
    Ok(py.detach(|| unsafe { cuda::merge_states_device(dtype, dims, device, stream, ptrs) })?)
}

/// A cache argument on a GPU: `[x]`, or `[values, scales, biases]` with `quant` = (bits, group_size).
struct DevCache {
    ptrs: CachePtrs,
    format: Option<quant::QuantFormat>,
    shape: [usize; 4],
    dtype: DType,
}

impl DevCache {
    fn extract(parts: Vec<DevTensor>, quant: Option<(usize, usize)>, name: &'static str) -> Result<Self, FlashError> {
        match (quant, parts.len()) {
            (None, 1) => {
                let x = &parts[0];
                let dtype = DType::parse(&x.2, name)?;
                let shape = <[usize; 4]>::try_from(x.1.as_slice())
                    .map_err(|_| FlashError::Shape(format!("{name} must be [B, S_cache, Hkv, D]; got {:?}", x.1)))?;
                Ok(DevCache { ptrs: CachePtrs { data: x.0, scales: 0, biases: 0 }, format: None, shape, dtype })
            }
            (Some((bits, group_size)), 3) => {
                let [v, s, b] = three(parts, ["values", "scales", "biases"])?;
                let (dtype, fmt, shape) =
                    quant::check_parts(&dev_spec(&v, "values"), &dev_spec(&s, "scales"), &dev_spec(&b, "biases"), bits, group_size)?;
                Ok(DevCache { ptrs: CachePtrs { data: v.0, scales: s.0, biases: b.0 }, format: Some(fmt), shape, dtype })
            }
            _ => Err(FlashError::Internal(format!("{name}: expected [x] or [values, scales, biases]"))),
        }
    }
}

fn three(parts: Vec<DevTensor>, names: [&str; 3]) -> Result<[DevTensor; 3], FlashError> {
    <[DevTensor; 3]>::try_from(parts).map_err(|p| FlashError::Internal(format!("expected the 3 tensors {names:?}, got {}", p.len())))
}

/// Decode on device tensors: q and the caches as (pointer, shape, dtype); `rows` = (seqlens,
/// leftpad), each None or (device pointer of the int32 [B] array, its NumPy copy, which the core
/// checks); `outputs` = [o (like q), lse ([B, H, Sq] f32)], preallocated on the same device.
/// Queued on `stream`; nothing is synchronised.
#[pyfunction]
#[pyo3(signature = (q, k, v, rows, outputs, device, stream, *, k_quant, v_quant, causal, scale, window_left, window_right, softcap, num_splits))]
#[allow(clippy::too_many_arguments)] // the Python keyword arguments
fn cuda_decode_device<'py>(
    py: Python<'py>, q: DevTensor, k: Vec<DevTensor>, v: Vec<DevTensor>, rows: (Option<(u64, Array<'py>)>, Option<(u64, Array<'py>)>),
    outputs: [u64; 2], device: usize, stream: usize, k_quant: Option<(usize, usize)>, v_quant: Option<(usize, usize)>, causal: bool,
    scale: Option<f32>, window_left: Option<usize>, window_right: Option<usize>, softcap: Option<f32>, num_splits: Option<usize>,
) -> Result<(), PyFlashError> {
    let (k, v) = (DevCache::extract(k, k_quant, "k_cache")?, DevCache::extract(v, v_quant, "v_cache")?);
    let p = Decode::new(&dev_spec(&q, "q"), (k.dtype, k.shape), (v.dtype, v.shape), causal, scale, (window_left, window_right), softcap, num_splits)?;
    // Row bounds: the device array for the kernel, its host copy for the checks and the splits.
    let bound = |r: &Option<(u64, Array<'py>)>, name: &'static str, default: i32| -> Result<(u64, Vec<i32>), FlashError> {
        match r {
            Some((ptr, host)) => Ok((*ptr, view::<i32>(&row_bounds(host, name, p.batch)?)?.to_vec())),
            None => Ok((0, vec![default; p.batch])),
        }
    };
    let (sl_ptr, sl) = bound(&rows.0, "cache_seqlens", p.s_cache.min(i32::MAX as usize) as i32)?;
    let (lp_ptr, lp) = bound(&rows.1, "leftpad_k", 0)?;
    let ptrs = DecodePtrs { q: q.0, k: k.ptrs, v: v.ptrs, seqlens: sl_ptr, leftpad: lp_ptr, o: outputs[0], lse: outputs[1] };
    let formats = [k.format.as_ref(), v.format.as_ref()];
    // SAFETY: the Python layer passes contiguous arrays of the checked shapes on `device` (the row
    // bounds: the arrays whose copies are checked), kept alive until the stream has run.
    Ok(py.detach(|| unsafe { cuda::decode_device(&p, formats, (&sl, &lp), device, stream, ptrs) })?)
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
    m.add_function(wrap_pyfunction!(cuda_quantize_kv_device, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_dequantize_kv_device, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_merge_states_device, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_decode_device, m)?)?;
    Ok(())
}
