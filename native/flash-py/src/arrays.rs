//! NumPy arrays <-> the core's byte buffers. The Python layer has already made every input
//! C-contiguous in native byte order; this re-checks it so nothing is ever misread.

use flash_core::{DType, FlashError, TensorSpec};
use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// A borrowed NumPy array viewed as bytes, with its dtype and shape.
pub struct HostArray<'py> {
    pub array: Bound<'py, PyUntypedArray>,
    pub dtype: DType,
    shape: Vec<usize>,
}

impl<'py> HostArray<'py> {
    pub fn extract(obj: &Bound<'py, PyAny>, arg: &str) -> Result<Self, FlashError> {
        let array = obj.cast::<PyUntypedArray>().map_err(|_| {
            FlashError::DType(format!("{arg} must be a NumPy array, got {}", type_name(obj)))
        })?;
        let dtype_name: String = attr(obj, &["dtype", "name"]).unwrap_or_default();
        let dtype = DType::parse(&dtype_name, arg)?;
        let native: bool = attr(obj, &["dtype", "isnative"]).unwrap_or(false);
        if !array.is_c_contiguous() || !native {
            return Err(FlashError::Shape(format!(
                "{arg} must be C-contiguous in native byte order (flash_nif's Python functions convert it)"
            )));
        }
        Ok(HostArray { array: array.clone(), dtype, shape: array.shape().to_vec() })
    }

    pub fn nbytes(&self) -> usize {
        self.array.len() * self.dtype.size_bytes()
    }

    pub fn spec(&self) -> TensorSpec<'_> {
        TensorSpec { dtype: self.dtype, shape: &self.shape, nbytes: self.nbytes() }
    }

    /// The array's bytes. Valid while `self` (which holds a reference to the array) lives.
    pub fn bytes(&self) -> &[u8] {
        let n = self.nbytes();
        if n == 0 {
            return &[];
        }
        // SAFETY: C-contiguous array of n bytes, kept alive by self.array.
        unsafe { std::slice::from_raw_parts((*self.array.as_array_ptr()).fields.data as *const u8, n) }
    }

    /// The array's bytes, writable: only for arrays this module has just allocated.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&self) -> &mut [u8] {
        let n = self.nbytes();
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
