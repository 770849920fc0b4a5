//! NumPy arrays <-> the core's byte buffers. The Python layer has already made every input
//! C-contiguous in native byte order — except the attention inputs, which it passes as views the
//! core can read in place ([`HostArray::extract_view`]); this re-checks both so nothing is ever
//! misread.

use flash_core::{FlashError, Strides, TensorSpec};
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
    /// Element strides, one per axis (a C-contiguous array's row-major ones, whatever NumPy
    /// reports on its axes of length 1).
    strides: Vec<i64>,
    /// Bytes from the first element to one past the last: `nbytes` for a C-contiguous array.
    span: usize,
    /// Not C-contiguous: read at `strides`.
    view: bool,
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
        Ok(Self::described(obj, array, name))
    }

    /// As [`extract`](Self::extract), and also a view whose strides are non-negative multiples of
    /// its itemsize with a contiguous last axis: the CPU kernels read it in place. Any other view
    /// (negative or odd strides, a strided last axis, another byte order) is an error here;
    /// flash_nif's Python functions copy those first.
    pub fn extract_view(obj: &Bound<'py, PyAny>, name: &'static str) -> Result<Self, FlashError> {
        let array = obj.cast::<PyUntypedArray>().map_err(|_| {
            FlashError::DType(format!("{name} must be a NumPy array, got {}", type_name(obj)))
        })?;
        if array.is_c_contiguous() {
            return Self::extract(obj, name);
        }
        let descr = array.dtype();
        let (item, shape, bytes) = (descr.itemsize() as isize, array.shape(), array.strides());
        let last_ok = shape.last().is_none_or(|&n| n <= 1 || bytes.last() == Some(&item));
        if !descr.is_native_byteorder().unwrap_or(true) || item == 0 || bytes.iter().any(|&b| b < 0 || b % item != 0) || !last_ok {
            return Err(FlashError::Shape(format!(
                "{name} has byte strides {bytes:?} (itemsize {item}): a view is read in place only with non-negative strides \
                 that are multiples of the itemsize, a contiguous last axis and native byte order \
                 (flash_nif's Python functions copy any other)"
            )));
        }
        let mut a = Self::described(obj, array, name);
        (a.view, a.strides) = (true, bytes.iter().map(|&b| (b / item) as i64).collect());
        // Elements from the first to one past the last: strides are non-negative, so the last
        // element is the one at the largest index of every axis.
        if a.nbytes > 0 {
            let last: usize = shape.iter().zip(&a.strides).map(|(&n, &st)| (n - 1) * st as usize).sum();
            a.span = (last + 1) * item as usize;
        }
        Ok(a)
    }

    /// The array described as C-contiguous (a view's caller then sets its strides and span).
    fn described(obj: &Bound<'py, PyAny>, array: &Bound<'py, PyUntypedArray>, name: &'static str) -> Self {
        let dtype = dtype_name(obj, array);
        let nbytes = array.len() * array.dtype().itemsize();
        let mut strides: Vec<i64> = array.shape().iter().rev().scan(1i64, |inner, &n| {
            let st = *inner;
            *inner *= n as i64;
            Some(st)
        }).collect();
        strides.reverse();
        HostArray { array: array.clone(), name, dtype, shape: array.shape().to_vec(), nbytes, strides, span: nbytes, view: false }
    }

    /// The core's description of where this `[B, S, H, D]` (varlen `[total, H, D]`) input's rows lie.
    pub fn core_strides(&self) -> Result<Strides, FlashError> {
        Strides::from_axes(self.name, &self.shape, &self.strides)
    }

    /// Whether this is a view (not C-contiguous): its call then needs the inputs' strides.
    pub fn is_view(&self) -> bool {
        self.view
    }

    pub fn spec(&self) -> TensorSpec<'_> {
        TensorSpec { name: self.name, dtype: &self.dtype, shape: &self.shape, nbytes: Some(self.nbytes) }
    }

    /// The array's bytes, from its first element to its last (a view's other bytes in between).
    /// Valid while `self` (which holds a reference to the array) lives.
    pub fn bytes(&self) -> &[u8] {
        let n = self.span;
        if n == 0 {
            return &[];
        }
        // SAFETY: NumPy guarantees every element of the array (a view included) exists in memory
        // kept alive by self.array; with non-negative strides they lie in the `span` bytes from
        // the data pointer (a C-contiguous array: its nbytes).
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

/// NumPy's name of the array's dtype ("float32", "bfloat16", ...). `dtype.name` is a Python
/// property that costs ~1.8 us a call (seven a decode call: most of a small call's host time), so
/// NumPy's own types are named from their kind and size here, and user types (ml_dtypes' bfloat16,
/// float8s) are asked once per type number and remembered.
fn dtype_name(obj: &Bound<'_, PyAny>, array: &Bound<'_, PyUntypedArray>) -> String {
    const USER_TYPES: std::ffi::c_int = 256; // NPY_USERDEF: numbers below are NumPy's own
    static USER_NAMES: std::sync::Mutex<Vec<(std::ffi::c_int, String)>> = std::sync::Mutex::new(Vec::new());
    let descr = array.dtype();
    let num = descr.num();
    if num < USER_TYPES {
        let base = match descr.kind() {
            b'f' => "float",
            b'i' => "int",
            b'u' => "uint",
            b'c' => "complex",
            b'b' => return "bool".into(),
            _ => "",
        };
        if !base.is_empty() {
            return format!("{base}{}", 8 * descr.itemsize());
        }
    } else if let Some((_, name)) = USER_NAMES.lock().unwrap().iter().find(|(n, _)| *n == num) {
        return name.clone();
    }
    let name: String = attr(obj, &["dtype", "name"]).unwrap_or_default();
    if num >= USER_TYPES && !name.is_empty() {
        USER_NAMES.lock().unwrap().push((num, name.clone()));
    }
    name
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}
