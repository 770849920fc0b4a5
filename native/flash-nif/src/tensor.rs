//! Tensors crossing the NIF boundary.
//!
//! In: `{data, [d0, d1, ...], dtype_name}` where `data` is a native-endian, row-major binary
//! (any alignment; sub-binaries are fine) and `dtype_name` is "float32", "float16" or "bfloat16"
//! ("int32" and "uint8" for masks, "uint32" for quantized cache codes; anything else reaches the
//! core's validation, which names the accepted types).
//! Out: `{data, {d0, d1, ...}}`, `data` a fresh binary written in place by the core.

use crate::reply::Reason;
use flash_core::{DType, FlashError, FloatArg, IndexArg, TensorSpec};
use rustler::sys::{enif_alloc_binary, ErlNifBinary};
use rustler::types::tuple::make_tuple;
use rustler::{Binary, Encoder, Env, OwnedBinary, Term};
use std::mem::MaybeUninit;

/// An input tensor, borrowing the caller's binary (no copy).
pub struct HostTensor<'a> {
    name: &'a str,
    data: Binary<'a>,
    shape: Vec<usize>,
    dtype: String,
}

impl<'a> HostTensor<'a> {
    /// Decodes argument `name`; a malformed term is an `:argument` error naming it.
    pub fn decode(term: Term<'a>, name: &'a str) -> Result<HostTensor<'a>, Reason> {
        let malformed = || {
            Reason::argument(format!(
                "{name} must be {{data :: binary, shape :: [non_neg_integer], dtype_name :: String.t}}"
            ))
        };
        let (data, shape, dtype): (Term<'a>, Term<'a>, Term<'a>) =
            term.decode().map_err(|_| malformed())?;
        let data: Binary<'a> = data.decode().map_err(|_| malformed())?;
        let shape: Vec<usize> = shape.decode().map_err(|_| malformed())?;
        let dtype: String = dtype.decode().map_err(|_| malformed())?;
        Ok(HostTensor { name, data, shape, dtype })
    }

    pub fn spec(&self) -> TensorSpec<'_> {
        TensorSpec {
            name: self.name,
            dtype: &self.dtype,
            shape: &self.shape,
            nbytes: Some(self.data.len()),
        }
    }

    /// The binary's bytes, for as long as the call's terms live.
    pub fn bytes(&self) -> &'a [u8] {
        self.data.as_slice()
    }

    /// The binary must hold exactly the shape's elements of `elem` bytes. The core's forward and
    /// rotary checks do this themselves; the KV-cache functions take NumPy's word for it, so the
    /// NIF checks (after the core has named the dtype, before any kernel reads).
    pub fn check_nbytes(&self, elem: usize) -> Result<(), Reason> {
        let need = self.shape.iter().try_fold(elem, |acc, &d| acc.checked_mul(d));
        match need {
            Some(n) if n == self.data.len() => Ok(()),
            Some(n) => Err(FlashError::Shape(format!(
                "{} has shape {:?} and dtype {}, which needs {n} bytes, but its buffer holds {} bytes",
                self.name,
                self.shape,
                self.dtype,
                self.data.len()
            ))
            .into()),
            None => Err(FlashError::OutOfMemory(format!("{} with shape {:?} is too large to address", self.name, self.shape)).into()),
        }
    }
}

/// A small int32 tensor whose values the core reads on the host (`seqused_k`, `leftpad_k`,
/// `cu_seqlens_*`).
pub struct IndexTensor<'a> {
    tensor: HostTensor<'a>,
    values: Vec<i32>,
}

impl<'a> IndexTensor<'a> {
    pub fn decode(term: Term<'a>, name: &'a str) -> Result<IndexTensor<'a>, Reason> {
        let tensor = HostTensor::decode(term, name)?;
        // Read as int32 whatever the dtype: the core checks dtype and byte count before the values.
        let values = tensor.bytes().chunks_exact(4).map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect();
        Ok(IndexTensor { tensor, values })
    }

    pub fn arg(&self) -> IndexArg<'_> {
        IndexArg { spec: self.tensor.spec(), values: &self.values }
    }

    /// The tensor's bytes (for a kernel that reads the values itself).
    pub fn bytes(&self) -> &[u8] {
        self.tensor.bytes()
    }
}

/// A small float32 tensor whose values the core reads on the host (`alibi_slopes`, `sinks`).
pub struct FloatTensor<'a> {
    tensor: HostTensor<'a>,
    values: Vec<f32>,
}

impl<'a> FloatTensor<'a> {
    pub fn decode(term: Term<'a>, name: &'a str) -> Result<FloatTensor<'a>, Reason> {
        let tensor = HostTensor::decode(term, name)?;
        // Read as float32 whatever the dtype: the core checks dtype and shape before the values.
        let values = tensor.bytes().chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect();
        Ok(FloatTensor { tensor, values })
    }

    pub fn arg(&self) -> FloatArg<'_> {
        FloatArg { spec: self.tensor.spec(), values: &self.values }
    }
}

/// An output tensor: a binary of exactly the size its shape and dtype need.
pub struct Output {
    data: OwnedBinary,
    shape: Vec<usize>,
}

impl Output {
    /// Allocates the (uninitialised) binary for output `name`. Unlike `OwnedBinary::new`, which
    /// aborts the whole VM when the allocation fails, a failure is an `:out_of_memory` error.
    pub fn alloc(name: &str, shape: &[usize], dtype: DType) -> Result<Output, Reason> {
        Output::alloc_elems(name, shape, dtype.size_bytes())
    }

    /// As [`Output::alloc`], for elements of `elem` bytes (the u32 codes of a quantized cache).
    pub fn alloc_elems(name: &str, shape: &[usize], elem: usize) -> Result<Output, Reason> {
        let nbytes = shape
            .iter()
            .try_fold(elem, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                FlashError::OutOfMemory(format!(
                    "{name} with shape {shape:?} is too large to address"
                ))
            })?;
        let mut raw = MaybeUninit::<ErlNifBinary>::uninit();
        // SAFETY: enif_alloc_binary initialises `raw` when it returns non-zero; OwnedBinary then
        // owns it and releases it on drop (or hands it to the VM in `encode`).
        let data = unsafe {
            if enif_alloc_binary(nbytes, raw.as_mut_ptr()) == 0 {
                return Err(FlashError::OutOfMemory(format!(
                    "cannot allocate {nbytes} bytes for {name} with shape {shape:?}"
                ))
                .into());
            }
            OwnedBinary::from_raw(raw.assume_init())
        };
        Ok(Output {
            data,
            shape: shape.to_vec(),
        })
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.data.as_mut_slice()
    }

    /// `{binary, shape_tuple}`; the binary is handed to the VM without a copy.
    pub fn encode<'a>(self, env: Env<'a>) -> Term<'a> {
        let dims: Vec<Term<'a>> = self.shape.iter().map(|d| d.encode(env)).collect();
        let shape = make_tuple(env, &dims);
        let data = self.data.release(env).encode(env);
        make_tuple(env, &[data, shape])
    }
}
