//! NumPy arrays <-> the core's byte buffers. The Python layer has already made every input
//! C-contiguous in native byte order; this re-checks it so nothing is ever misread.

use flash_core::{FlashError, TensorSpec};
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// A borrowed NumPy array viewed as bytes, with its name, dtype name and shape (the core
/// validates them).
pub struct HostArray<'py> {
    pub array: Bound<'py, PyUntypedArray>,
    name: &'static str,
    dtype: String,
    shape: Vec<usize>,
    nbytes: usize,
}

impl<'py> HostArray<'py> {
    /// Argument `name` of a call (the name in every message about it).
    pub fn extract(obj: &Bound<'py, PyAny>, name: &'static str) -> Result<Self, FlashError> {
        let array = obj.cast::<PyUntypedArray>().map_err(|_| {
            FlashError::DType(format!("{name} must be a NumPy array, got {}", type_name(obj)))
        })?;
        let descr = array.dtype();
        if !array.is_c_contiguous() || !descr.is_native_byteorder().unwrap_or(true) {
            return Err(FlashError::Shape(format!(
                "{name} must be C-contiguous in native byte order (flash_nif's Python functions convert it)"
            )));
        }
        let dtype = attr(obj, &["dtype", "name"]).unwrap_or_default();
        let nbytes = array.len() * descr.itemsize();
        Ok(HostArray { array: array.clone(), name, dtype, shape: array.shape().to_vec(), nbytes })
    }

    pub fn spec(&self) -> TensorSpec<'_> {
        TensorSpec { name: self.name, dtype: &self.dtype, shape: &self.shape, nbytes: Some(self.nbytes) }
    }

    /// The array's bytes. Valid while `self` (which holds a reference to the array) lives.
    pub fn bytes(&self) -> &[u8] {
        let n = self.nbytes;
        if n == 0 {
            return &[];
        }
        // SAFETY: C-contiguous array of n bytes, kept alive by self.array.
        unsafe { std::slice::from_raw_parts((*self.array.as_array_ptr()).fields.data as *const u8, n) }
    }

    /// The array's bytes, writable: only for arrays this module has just allocated.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&self) -> &mut [u8] {
        let n = self.nbytes;
        if n == 0 {
            return &mut [];
        }
        // SAFETY: a fresh C-contiguous array of n bytes owned by this call, not shared.
        unsafe { std::slice::from_raw_parts_mut((*self.array.as_array_ptr()).fields.data as *mut u8, n) }
    }
}

/// `numpy.empty(shape, dtype=like.dtype)` for an output.
pub fn empty_like_dtype<'py>(py: Python<'py>, shape: &[usize], like: &HostArray<'py>) -> Result<HostArray<'py>, FlashError> {
    let dtype = like.array.getattr("dtype").map_err(|e| numpy_error(py, e, shape))?;
    empty(py, shape, dtype)
}

/// `numpy.empty(shape, dtype="float32")`.
pub fn empty_f32<'py>(py: Python<'py>, shape: &[usize]) -> Result<HostArray<'py>, FlashError> {
    empty(py, shape, pyo3::types::PyString::new(py, "float32").into_any())
}

fn empty<'py>(py: Python<'py>, shape: &[usize], dtype: Bound<'py, PyAny>) -> Result<HostArray<'py>, FlashError> {
    let out = PyTuple::new(py, shape)
        .and_then(|dims| py.import("numpy")?.call_method1("empty", (dims, dtype)))
        .map_err(|e| numpy_error(py, e, shape))?;
    HostArray::extract(&out, "output")
}

/// NumPy's MemoryError becomes OutOfMemory; anything else is a bug here.
fn numpy_error(py: Python<'_>, e: PyErr, shape: &[usize]) -> FlashError {
    if e.is_instance_of::<pyo3::exceptions::PyMemoryError>(py) {
        FlashError::OutOfMemory(format!("cannot allocate an output of shape {shape:?}"))
    } else {
        FlashError::Internal(format!("numpy.empty{shape:?} failed: {e}"))
    }
}

fn attr<'py, T: for<'a> FromPyObject<'a, 'py>>(obj: &Bound<'py, PyAny>, path: &[&str]) -> Option<T> {
    let mut cur = obj.clone();
    for name in path {
        cur = cur.getattr(*name).ok()?;
    }
    cur.extract().ok()
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}
