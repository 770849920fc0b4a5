//! FlashError -> the Python exception hierarchy defined in `flash_nif/errors.py`.

use flash_core::FlashError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// Name of the Python class (in `flash_nif.errors`) raised for an error.
fn class_name(e: &FlashError) -> &'static str {
    match e {
        FlashError::Shape(_) => "ShapeError",
        FlashError::DType(_) => "DTypeError",
        FlashError::Unsupported(_) => "UnsupportedError",
        FlashError::OutOfMemory(_) => "OutOfMemoryError",
        FlashError::CudaUnavailable(_) | FlashError::Cuda { .. } => "DeviceError",
        FlashError::Nvrtc { .. } => "CompileError",
        FlashError::Internal(_) => "InternalError",
    }
}

pub fn to_pyerr(py: Python<'_>, e: FlashError) -> PyErr {
    let class = py
        .import("flash_nif.errors")
        .and_then(|m| m.getattr(class_name(&e)));
    match class {
        Ok(cls) => PyErr::from_type(cls.cast_into().expect("exception class"), e.to_string()),
        Err(_) => PyRuntimeError::new_err(e.to_string()),
    }
}
