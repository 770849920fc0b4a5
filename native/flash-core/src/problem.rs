//! The attention problem: sizes, dtype and options, validated once for every binding and backend.

use crate::dtype::DType;
use crate::error::{FlashError, Result};

/// Largest supported head dimension.
pub const MAX_HEAD_DIM: usize = 256;

/// What a binding knows about one tensor argument before any compute. Every message about the
/// tensor names it as `name`.
#[derive(Debug, Clone, Copy)]
pub struct TensorSpec<'a> {
    /// The argument's name as the caller spells it (Python's `do`, Elixir's `d_out`).
    pub name: &'a str,
    /// Its dtype's name as the binding reads it: "float32", "float16", "bfloat16" (or "f32",
    /// "f16", "bf16"); any other is a dtype error naming the argument.
    pub dtype: &'a str,
    pub shape: &'a [usize],
    /// Length in bytes of the host buffer that holds it (row-major, contiguous); `None` for device
    /// memory, which the caller allocates from the shape.
    pub nbytes: Option<usize>,
}

/// Caller options, identical in every binding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    /// Causal mask aligned bottom-right: query i sees keys j <= i + (Sk - Sq).
    pub causal: bool,
    /// Softmax scale; `None` means 1/sqrt(head_dim).
    pub scale: Option<f64>,
    /// Backward only: bit-identical gradients run to run. The CPU backward always is; on the GPU
    /// `false` (the default) lets dQ be summed with f32 atomics, which is faster.
    pub deterministic: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { causal: true, scale: None, deterministic: false }
    }
}

/// Sizes of one attention call: q is [batch, seq_q, heads, head_dim], k and v are
/// [batch, seq_k, kv_heads, head_dim], lse is [batch, heads, seq_q].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub batch: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Dims {
    /// Query heads per kv head (1 = MHA, heads = MQA).
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.seq_q, self.heads, self.head_dim]
    }
    pub fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.seq_k, self.kv_heads, self.head_dim]
    }
    pub fn lse_shape(&self) -> [usize; 3] {
        [self.batch, self.heads, self.seq_q]
    }
    pub fn q_len(&self) -> usize {
        self.q_shape().iter().product()
    }
    pub fn kv_len(&self) -> usize {
        self.kv_shape().iter().product()
    }
    pub fn lse_len(&self) -> usize {
        self.lse_shape().iter().product()
    }
    /// Signed offset of the causal diagonal: query i sees keys j <= i + diag_offset.
    pub fn diag_offset(&self) -> isize {
        self.seq_k as isize - self.seq_q as isize
    }
}

/// A validated call: every buffer the caller passed has the size these dims imply.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Problem {
    pub dims: Dims,
    pub dtype: DType,
    pub causal: bool,
    /// The resolved softmax scale.
    pub scale: f32,
    /// See [`Options::deterministic`].
    pub deterministic: bool,
}

impl Problem {
    /// Validates the inputs of a forward call.
    pub fn forward(q: &TensorSpec, k: &TensorSpec, v: &TensorSpec, opts: &Options) -> Result<Problem> {
        let (dims, dtype) = check_qkv(q, k, v)?;
        Problem::finish(dims, dtype, opts)
    }

    /// Validates the inputs of a backward call: the forward's inputs plus dO (like q), o (like q)
    /// and lse ([B, H, Sq], float32).
    pub fn backward(
        d_out: &TensorSpec,
        q: &TensorSpec,
        k: &TensorSpec,
        v: &TensorSpec,
        o: &TensorSpec,
        lse: &TensorSpec,
        opts: &Options,
    ) -> Result<Problem> {
        let (dims, dtype) = check_qkv(q, k, v)?;
        let (qn, q_shape) = (q.name, dims.q_shape());
        for t in [d_out, o] {
            let (name, t_dtype) = (t.name, parse_dtype(t)?);
            if t.shape != q_shape {
                let shape = t.shape;
                return Err(FlashError::Shape(format!("{name} has shape {shape:?}; it must match {qn}'s shape {q_shape:?}")));
            }
            if t_dtype != dtype {
                let (got, want) = (t_dtype.name(), dtype.name());
                return Err(FlashError::DType(format!("{name} has dtype {got}; it must match {qn}'s dtype {want}")));
            }
            check_nbytes(t, t_dtype)?;
        }
        check_lse_dtype(lse)?;
        if lse.shape != dims.lse_shape() {
            return Err(FlashError::Shape(format!(
                "{} has shape {:?}; expected [batch, heads, seq_q] = {:?}",
                lse.name,
                lse.shape,
                dims.lse_shape()
            )));
        }
        check_nbytes(lse, DType::F32)?;
        Problem::finish(dims, dtype, opts)
    }

    fn finish(dims: Dims, dtype: DType, opts: &Options) -> Result<Problem> {
        let scale = match opts.scale {
            None => 1.0 / (dims.head_dim as f64).sqrt(),
            Some(s) if s.is_finite() && s > 0.0 => s,
            Some(s) => {
                return Err(FlashError::Unsupported(format!(
                    "scale must be a finite positive number, got {s}"
                )))
            }
        };
        Ok(Problem { dims, dtype, causal: opts.causal, scale: scale as f32, deterministic: opts.deterministic })
    }

    /// Number of keys query row `row` may see (causal: a prefix; 0 when it sees none).
    pub fn keys_visible(&self, row: usize) -> usize {
        if !self.causal {
            return self.dims.seq_k;
        }
        let last = row as isize + self.dims.diag_offset();
        (last + 1).clamp(0, self.dims.seq_k as isize) as usize
    }
}

fn parse_dtype(t: &TensorSpec) -> Result<DType> {
    DType::parse(t.dtype, t.name)
}

/// lse's own rule, checked on its dtype name before any generic message: float32 only.
fn check_lse_dtype(lse: &TensorSpec) -> Result<()> {
    match DType::parse(lse.dtype, lse.name) {
        Ok(DType::F32) => Ok(()),
        _ => Err(FlashError::DType(format!("{} has dtype {}; it must be float32", lse.name, lse.dtype))),
    }
}

fn check_qkv(q: &TensorSpec, k: &TensorSpec, v: &TensorSpec) -> Result<(Dims, DType)> {
    let (dtype, k_dtype, v_dtype) = (parse_dtype(q)?, parse_dtype(k)?, parse_dtype(v)?);
    for t in [q, k, v] {
        if t.shape.len() != 4 {
            return Err(FlashError::Shape(format!(
                "{} must have rank 4 [batch, seq, heads, head_dim]; got shape {:?}",
                t.name, t.shape
            )));
        }
    }
    let (qn, kn, vn) = (q.name, k.name, v.name);
    for (t, t_dtype) in [(k, k_dtype), (v, v_dtype)] {
        if t_dtype != dtype {
            let (name, got, want) = (t.name, t_dtype.name(), dtype.name());
            return Err(FlashError::DType(format!(
                "{name} has dtype {got} but {qn} has dtype {want}; {qn}, {kn} and {vn} must share one dtype"
            )));
        }
    }
    if k.shape != v.shape {
        let (ks, vs) = (k.shape, v.shape);
        return Err(FlashError::Shape(format!("{kn} has shape {ks:?} but {vn} has shape {vs:?}; they must match")));
    }
    let (qs, ks) = (q.shape, k.shape);
    if qs[0] != ks[0] {
        return Err(FlashError::Shape(format!(
            "batch mismatch: {qn} has shape {qs:?} (batch {}) but {kn} has shape {ks:?} (batch {})",
            qs[0], ks[0]
        )));
    }
    if qs[3] != ks[3] {
        return Err(FlashError::Shape(format!(
            "head_dim mismatch: {qn} has shape {qs:?} (head_dim {}) but {kn} has shape {ks:?} (head_dim {})",
            qs[3], ks[3]
        )));
    }
    let dims = Dims {
        batch: qs[0],
        seq_q: qs[1],
        seq_k: ks[1],
        heads: qs[2],
        kv_heads: ks[2],
        head_dim: qs[3],
    };
    if dims.head_dim == 0 || dims.head_dim > MAX_HEAD_DIM {
        return Err(FlashError::Shape(format!(
            "head_dim must be between 1 and {MAX_HEAD_DIM}; {qn} has shape {qs:?}"
        )));
    }
    if dims.heads == 0 || dims.kv_heads == 0 {
        return Err(FlashError::Shape(format!(
            "heads must be at least 1: {qn} has shape {qs:?}, {kn} has shape {ks:?}"
        )));
    }
    if !dims.heads.is_multiple_of(dims.kv_heads) {
        return Err(FlashError::Shape(format!(
            "{qn}'s heads ({}) must be a multiple of {kn}/{vn}'s heads ({}) (GQA); {qn} has shape {qs:?}, {kn} has shape {ks:?}",
            dims.heads, dims.kv_heads
        )));
    }
    for t in [q, k, v] {
        check_nbytes(t, dtype)?;
    }
    Ok((dims, dtype))
}

/// The buffer (if the caller gave its length) must hold exactly the elements the shape names,
/// and their byte count must not overflow.
fn check_nbytes(t: &TensorSpec, dtype: DType) -> Result<()> {
    let bytes = t
        .shape
        .iter()
        .try_fold(dtype.size_bytes(), |acc, &d| acc.checked_mul(d))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            FlashError::OutOfMemory(format!("{} with shape {:?} is too large to address", t.name, t.shape))
        })?;
    match t.nbytes {
        Some(n) if n != bytes => Err(FlashError::Shape(format!(
            "{} has shape {:?} and dtype {}, which needs {bytes} bytes, but its buffer holds {n} bytes",
            t.name,
            t.shape,
            dtype.name(),
        ))),
        _ => Ok(()),
    }
}
