//! FlashError -> the Python exception hierarchy defined in `flash_nif/errors.py` (each class also
//! subclasses the built-in it refines: ValueError, TypeError, MemoryError or RuntimeError).

use flash_core::FlashError;
use pyo3::prelude::*;

pyo3::import_exception!(flash_nif.errors, ShapeError);
pyo3::import_exception!(flash_nif.errors, DTypeError);
pyo3::import_exception!(flash_nif.errors, UnsupportedError);
pyo3::import_exception!(flash_nif.errors, OutOfMemoryError);
pyo3::import_exception!(flash_nif.errors, DeviceError);
pyo3::import_exception!(flash_nif.errors, CompileError);
pyo3::import_exception!(flash_nif.errors, InternalError);

/// A core error on its way to Python: adapters return `Result<_, PyFlashError>` (or convert into
/// `PyErr`) and use `?` on the core's results.
#[derive(Debug)]
pub struct PyFlashError(pub FlashError);

impl From<FlashError> for PyFlashError {
    fn from(e: FlashError) -> Self {
        PyFlashError(e)
    }
}

impl From<PyFlashError> for PyErr {
    fn from(PyFlashError(e): PyFlashError) -> PyErr {
        let msg = e.to_string();
        match e {
            FlashError::Shape(_) => ShapeError::new_err(msg),
            FlashError::DType(_) => DTypeError::new_err(msg),
            FlashError::Unsupported(_) => UnsupportedError::new_err(msg),
            FlashError::OutOfMemory(_) => OutOfMemoryError::new_err(msg),
            FlashError::CudaUnavailable(_) | FlashError::Cuda { .. } => DeviceError::new_err(msg),
            FlashError::Nvrtc { .. } => CompileError::new_err(msg),
            FlashError::Internal(_) => InternalError::new_err(msg),
        }
    }
}
