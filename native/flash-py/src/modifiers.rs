//! The score modifiers' tensors of a call (ALiBi slopes, sinks): small float32 NumPy arrays the
//! Python layer copied to the host (from the GPU too); the core validates and keeps their values.

use flash_core::{FlashError, FloatArg, ModArgs};
use pyo3::prelude::*;

use crate::arrays::HostArray;

/// A small float32 host array with its values.
pub struct Floats<'py> {
    array: HostArray<'py>,
    values: Vec<f32>,
}

impl<'py> Floats<'py> {
    pub fn extract(obj: &Bound<'py, PyAny>, name: &'static str) -> Result<Self, FlashError> {
        let array = HostArray::extract(obj, name)?;
        // Any other dtype: no values, and the core reports the dtype (it checks it first).
        let values = if array.spec().dtype == "float32" {
            array.bytes().chunks_exact(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect()
        } else {
            Vec::new()
        };
        Ok(Floats { array, values })
    }

    fn arg(&self) -> FloatArg<'_> {
        FloatArg { spec: self.array.spec(), values: &self.values }
    }
}

/// The modifier tensors of one call (`softcap` is an option).
#[derive(Default)]
pub struct Mods<'py> {
    pub alibi_slopes: Option<Floats<'py>>,
    pub sinks: Option<Floats<'py>>,
}

impl Mods<'_> {
    pub fn args(&self) -> ModArgs<'_> {
        ModArgs { alibi_slopes: self.alibi_slopes.as_ref().map(Floats::arg), sinks: self.sinks.as_ref().map(Floats::arg) }
    }
}
