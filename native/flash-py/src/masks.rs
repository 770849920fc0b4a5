//! A call's keyword arguments -> the core's [`Options`] and mask arguments. The Python layer has
//! checked the Python types and converted the arrays (int32 ids, NumPy copies of the small index
//! arrays); the core validates shapes, dtypes and values.

use flash_core::cuda::MaskPtrs;
use flash_core::{FlashError, IndexArg, MaskArgs, MaskBuffers, Mode, Options, Precision, TensorSpec, Window};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::HostArray;
use crate::modifiers::{Floats, Mods};

/// The mask keywords of a padded call (varlen calls take none of them: their batch layout is
/// `cu_seqlens`). `window` is an [`Options`] field, parsed with the others.
const MASK_KEYS: [&str; 4] = ["segment_ids", "seqused_k", "leftpad_k", "block_mask"];

/// A small int32 array (`seqused_k`, `leftpad_k`, `cu_seqlens_*`) on the host, with its values:
/// the core reads them to validate and to size the grid.
pub struct Index<'py> {
    array: HostArray<'py>,
    values: Vec<i32>,
}

impl<'py> Index<'py> {
    pub fn extract(obj: &Bound<'py, PyAny>, name: &'static str) -> Result<Self, FlashError> {
        let array = HostArray::extract(obj, name)?;
        // Any other dtype: no values, and the core reports the dtype (it checks it first).
        let values = if array.spec().dtype == "int32" {
            array.bytes().chunks_exact(4).map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect()
        } else {
            Vec::new()
        };
        Ok(Index { array, values })
    }

    pub fn arg(&self) -> IndexArg<'_> {
        IndexArg { spec: self.array.spec(), values: &self.values }
    }

    /// The array's bytes (for a kernel that reads the values itself).
    pub fn bytes(&self) -> &[u8] {
        self.array.bytes()
    }
}

/// A device array as the Python layer describes it: (pointer, shape, dtype name).
pub type DevTensor = (u64, Vec<usize>, String);

/// A mask tensor on a GPU, named for messages.
pub struct DevArray {
    tensor: DevTensor,
    name: &'static str,
}

impl DevArray {
    pub fn extract(obj: &Bound<'_, PyAny>, name: &'static str) -> Result<Self, FlashError> {
        let tensor = obj
            .extract()
            .map_err(|_| FlashError::Internal(format!("{name} must be passed as (pointer, shape, dtype name)")))?;
        Ok(DevArray { tensor, name })
    }
}

/// What the core needs of a mask tensor, on the host or on a GPU.
pub trait MaskTensor {
    fn spec(&self) -> TensorSpec<'_>;
}

impl MaskTensor for HostArray<'_> {
    fn spec(&self) -> TensorSpec<'_> {
        HostArray::spec(self)
    }
}

impl MaskTensor for DevArray {
    fn spec(&self) -> TensorSpec<'_> {
        let (_, shape, dtype) = &self.tensor;
        TensorSpec { name: self.name, dtype, shape, nbytes: None }
    }
}

/// The mask arguments of one call; `T` holds the data-carrying ones (segment ids, block mask).
pub struct Masks<'py, T> {
    segment_ids: Option<(T, T)>,
    block_mask: Option<T>,
    seqused_k: Option<Index<'py>>,
    leftpad_k: Option<Index<'py>>,
}

impl<T: MaskTensor> Masks<'_, T> {
    pub fn args(&self) -> MaskArgs<'_> {
        MaskArgs {
            segment_ids: self.segment_ids.as_ref().map(|(q, k)| (q.spec(), k.spec())),
            seqused_k: self.seqused_k.as_ref().map(Index::arg),
            leftpad_k: self.leftpad_k.as_ref().map(Index::arg),
            block_mask: self.block_mask.as_ref().map(MaskTensor::spec),
        }
    }
}

impl<'py> Masks<'py, HostArray<'py>> {
    pub fn buffers(&self) -> MaskBuffers<'_> {
        MaskBuffers {
            seg_q: self.segment_ids.as_ref().map(|(q, _)| q.bytes()),
            seg_k: self.segment_ids.as_ref().map(|(_, k)| k.bytes()),
            block_mask: self.block_mask.as_ref().map(HostArray::bytes),
        }
    }
}

impl Masks<'_, DevArray> {
    pub fn ptrs(&self) -> MaskPtrs {
        let ptr = |t: Option<&DevArray>| t.map_or(0, |t| t.tensor.0);
        MaskPtrs {
            seg_q: ptr(self.segment_ids.as_ref().map(|(q, _)| q)),
            seg_k: ptr(self.segment_ids.as_ref().map(|(_, k)| k)),
            block_mask: ptr(self.block_mask.as_ref()),
        }
    }
}

/// Reads one mask tensor argument (host array or device description).
pub type Reader<'a, 'py, T> = &'a dyn Fn(&Bound<'py, PyAny>, &'static str) -> Result<T, FlashError>;

/// A call's keyword arguments: the core's [`Options`] (`causal`, `scale`, `deterministic`,
/// `window`, `softcap`, `mode`, `precision`), the modifier tensors and, when the call takes them, the mask tensors.
pub struct Parsed<'py, T> {
    pub opts: Options,
    pub masks: Masks<'py, T>,
    pub mods: Mods<'py>,
}

/// Parses a call's keyword arguments; one left out keeps the core's default. `masks` says how to
/// read the mask tensors; without it the mask keywords are unknown options (varlen calls).
pub fn parse<'py, T>(
    kwargs: Option<&Bound<'py, PyDict>>,
    masks: Option<Reader<'_, 'py, T>>,
) -> Result<Parsed<'py, T>, FlashError> {
    let mut opts = Options::default();
    let mut m = Masks { segment_ids: None, block_mask: None, seqused_k: None, leftpad_k: None };
    let mut mods = Mods::default();
    let bad = |what: &str| FlashError::Unsupported(what.to_string());
    for (key, value) in kwargs.into_iter().flat_map(|d| d.iter()) {
        let key = key.extract::<String>().unwrap_or_default();
        match (key.as_str(), masks) {
            ("causal", _) => opts.causal = value.extract().map_err(|_| bad("causal must be a bool"))?,
            ("scale", _) => opts.scale = value.extract().map_err(|_| bad("scale must be a number or None"))?,
            ("deterministic", _) => opts.deterministic = value.extract().map_err(|_| bad("deterministic must be a bool"))?,
            ("softcap", _) => opts.softcap = value.extract().map_err(|_| bad("softcap must be a number or None"))?,
            ("alibi_slopes", _) => mods.alibi_slopes = Some(Floats::extract(&value, "alibi_slopes")?),
            ("sinks", _) => mods.sinks = Some(Floats::extract(&value, "sinks")?),
            ("precision", _) => {
                let name: String = value.extract().map_err(|_| bad("precision must be \"exact\" or \"tf32\""))?;
                opts.precision = Precision::parse(&name)?;
            }
            ("mode", _) => {
                let name: String = value.extract().map_err(|_| bad("mode must be \"auto\", \"fused\" or \"materialized\""))?;
                opts.mode = Mode::parse(&name)?;
            }
            ("window", _) => {
                let (left, right) = value.extract().map_err(|_| {
                    bad(&format!("window must be a (left, right) tuple of non-negative ints or None; got {value}"))
                })?;
                opts.window = Window { left, right };
            }
            ("segment_ids", Some(read)) => {
                let (q, k): (Bound<PyAny>, Bound<PyAny>) =
                    value.extract().map_err(|_| bad("segment_ids must be a (seg_q, seg_k) tuple"))?;
                m.segment_ids = Some((read(&q, "segment_ids[0]")?, read(&k, "segment_ids[1]")?));
            }
            ("block_mask", Some(read)) => m.block_mask = Some(read(&value, "block_mask")?),
            ("seqused_k", Some(_)) => m.seqused_k = Some(Index::extract(&value, "seqused_k")?),
            ("leftpad_k", Some(_)) => m.leftpad_k = Some(Index::extract(&value, "leftpad_k")?),
            (other, None) if MASK_KEYS.contains(&other) => {
                return Err(FlashError::Unsupported(format!(
                    "{other} is not an option of varlen calls (their batch layout is cu_seqlens)"
                )))
            }
            (other, _) => return Err(FlashError::Unsupported(format!("unknown option {other:?}"))),
        }
    }
    Ok(Parsed { opts, masks: m, mods })
}

/// The options and modifiers of a call without mask tensors (varlen).
pub fn options<'py>(kwargs: Option<&Bound<'py, PyDict>>) -> Result<(Options, Mods<'py>), FlashError> {
    let p = parse::<()>(kwargs, None)?;
    Ok((p.opts, p.mods))
}
