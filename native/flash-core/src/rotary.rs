//! Rotary position embeddings (RoPE), forward and backward: the problem, validated once for every
//! binding and backend (the kernels are `cpu/rotary.rs` and `cuda/rotary.cu`).
//!
//! | tensor          | shape            | dtype           |
//! |-----------------|------------------|-----------------|
//! | x, y, dy, dx    | [B, S, H, D]     | f32, f16, bf16  |
//! | cos, sin        | [max_pos, R/2]   | f32             |
//! | positions       | [B, S]           | int32 (or an offset) |
//!
//! The tables rotate the first R = 2·cos.shape[1] <= D dims of each head; dims R..D pass through.
//! Row (b, s) takes table row p = positions[b, s], or s + offset. Angle i of that row turns the
//! pair (x[i], x[i + R/2]) (half-split, GPT-NeoX, the default) or (x[2i], x[2i + 1]) (interleaved,
//! GPT-J):
//!
//!   y[a] = x[a]·cos[p, i] − x[b]·sin[p, i],   y[b] = x[b]·cos[p, i] + x[a]·sin[p, i]
//!
//! The backward is the transpose, a rotation by −θ (sin negated). Arithmetic is f32; results are
//! stored in x's dtype.

use crate::dtype::DType;
use crate::error::{FlashError, Result};
use crate::mask::IndexArg;
use crate::problem::TensorSpec;

/// Which table row each (b, s) row of x takes.
#[derive(Debug, Clone, Copy)]
pub enum Positions<'a> {
    /// Row (b, s) takes s + offset (0: the tables' first rows; a decode step's cache length).
    Offset(i64),
    /// int32 `[B, S]`, each value in [0, max_pos) (packed documents, decode with ragged caches).
    /// Its data travels in the call's io ([`RotaryIo::positions`] / `cuda::RotaryPtrs`).
    Array(IndexArg<'a>),
}

impl Default for Positions<'_> {
    fn default() -> Self {
        Positions::Offset(0)
    }
}

/// Caller options, identical in every binding (`interleaved`, `positions`).
#[derive(Debug, Clone, Copy, Default)]
pub struct RotaryOptions<'a> {
    /// Pairs (2i, 2i + 1) (GPT-J) instead of (i, i + R/2) (GPT-NeoX).
    pub interleaved: bool,
    pub positions: Positions<'a>,
}

/// Sizes of one rotary call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RotaryDims {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// R: the rotated dims (even, 2 <= R <= D).
    pub rotary_dim: usize,
    /// Rows of the tables.
    pub max_pos: usize,
}

impl RotaryDims {
    pub fn x_shape(&self) -> [usize; 4] {
        [self.batch, self.seq, self.heads, self.head_dim]
    }
    pub fn x_len(&self) -> usize {
        self.x_shape().iter().product()
    }
    /// R/2: the angles per table row.
    pub fn half(&self) -> usize {
        self.rotary_dim / 2
    }
    pub fn table_len(&self) -> usize {
        self.max_pos * self.half()
    }
    /// B·S: the rows that take one position each.
    pub fn rows(&self) -> usize {
        self.batch * self.seq
    }
}

/// Where the validated call finds each row's position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PositionSource {
    /// s + offset (checked: offset + S <= max_pos).
    Offset(usize),
    /// The positions array, int32 `[B, S]` (checked: every value in [0, max_pos)).
    Array,
}

/// A validated rotary call: every buffer the caller passed has the size these dims imply, and
/// every position it will read lies in the tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RotaryProblem {
    pub dims: RotaryDims,
    pub dtype: DType,
    pub interleaved: bool,
    /// The backward: rotation by −θ (the forward's transpose and inverse).
    pub inverse: bool,
    pub positions: PositionSource,
}

impl RotaryProblem {
    /// Validates `rotary.apply(x, cos, sin)`.
    pub fn apply(x: &TensorSpec, cos: &TensorSpec, sin: &TensorSpec, opts: &RotaryOptions) -> Result<RotaryProblem> {
        RotaryProblem::new(x, cos, sin, opts, false)
    }

    /// Validates `rotary.backward(dy, cos, sin)`: the gradient of x given dy, the gradient of y
    /// (the same tables and options as the forward).
    pub fn backward(dy: &TensorSpec, cos: &TensorSpec, sin: &TensorSpec, opts: &RotaryOptions) -> Result<RotaryProblem> {
        RotaryProblem::new(dy, cos, sin, opts, true)
    }

    fn new(x: &TensorSpec, cos: &TensorSpec, sin: &TensorSpec, opts: &RotaryOptions, inverse: bool) -> Result<RotaryProblem> {
        let dtype = DType::parse(x.dtype, x.name)?;
        let &[batch, seq, heads, head_dim] = x.shape else {
            return Err(FlashError::Shape(format!(
                "{} must have rank 4 [batch, seq, heads, head_dim]; got shape {:?}",
                x.name, x.shape
            )));
        };
        check_nbytes(x, dtype.size_bytes())?;
        let (max_pos, half) = check_tables(cos, sin)?;
        let rotary_dim = 2 * half;
        if rotary_dim > head_dim {
            return Err(FlashError::Shape(format!(
                "{} has shape {:?}: it rotates R = 2 * {half} = {rotary_dim} dims, more than {}'s head_dim {head_dim} \
                 (shape {:?}); the tables must be [max_pos, R/2] with R <= head_dim",
                cos.name, cos.shape, x.name, x.shape
            )));
        }
        let dims = RotaryDims { batch, seq, heads, head_dim, rotary_dim, max_pos };
        let positions = check_positions(&opts.positions, &dims, cos.name)?;
        Ok(RotaryProblem { dims, dtype, interleaved: opts.interleaved, inverse, positions })
    }
}

/// cos and sin: float32 `[max_pos, R/2]`, one shape, R/2 >= 1. Returns (max_pos, R/2).
fn check_tables(cos: &TensorSpec, sin: &TensorSpec) -> Result<(usize, usize)> {
    for t in [cos, sin] {
        match DType::parse(t.dtype, t.name) {
            Ok(DType::F32) => {}
            _ => return Err(FlashError::DType(format!("{} has dtype {}; it must be float32", t.name, t.dtype))),
        }
        if t.shape.len() != 2 {
            return Err(FlashError::Shape(format!(
                "{} must have rank 2 [max_pos, rotary_dim / 2]; got shape {:?}",
                t.name, t.shape
            )));
        }
        check_nbytes(t, 4)?;
    }
    if cos.shape != sin.shape {
        return Err(FlashError::Shape(format!(
            "{} has shape {:?} but {} has shape {:?}; they must match",
            cos.name, cos.shape, sin.name, sin.shape
        )));
    }
    let (max_pos, half) = (cos.shape[0], cos.shape[1]);
    if half == 0 {
        return Err(FlashError::Shape(format!(
            "{} has shape {:?}: it must hold at least one angle per row ([max_pos, rotary_dim / 2])",
            cos.name, cos.shape
        )));
    }
    Ok((max_pos, half))
}

/// Every row's position must be a row of the tables: an error, never a read past them.
fn check_positions(pos: &Positions, d: &RotaryDims, table: &str) -> Result<PositionSource> {
    let max_pos = d.max_pos;
    match *pos {
        Positions::Offset(off) => {
            let Ok(off) = usize::try_from(off) else {
                return Err(FlashError::Unsupported(format!("positions offset must be a non-negative integer; got {off}")));
            };
            if d.seq > 0 && off.checked_add(d.seq).is_none_or(|end| end > max_pos) {
                return Err(FlashError::Shape(format!(
                    "positions {off}..{} (offset {off} + seq {}) are outside the tables' [0, max_pos = {max_pos}) \
                     ({table} has {max_pos} rows)",
                    off.saturating_add(d.seq),
                    d.seq
                )));
            }
            Ok(PositionSource::Offset(off))
        }
        Positions::Array(a) => {
            let t = &a.spec;
            if !crate::mask::is_int32(t.dtype) {
                return Err(FlashError::DType(format!("{} has dtype {}; it must be int32", t.name, t.dtype)));
            }
            let want = [d.batch, d.seq];
            if t.shape != want {
                return Err(FlashError::Shape(format!(
                    "{} has shape {:?}; expected [batch, seq] = {want:?}",
                    t.name, t.shape
                )));
            }
            check_nbytes(t, 4)?;
            if a.values.len() != d.rows() {
                return Err(FlashError::Internal(format!("{}: {} values for shape {want:?}", t.name, a.values.len())));
            }
            if let Some(i) = a.values.iter().position(|&p| p < 0 || p as usize >= max_pos) {
                let (b, s) = (i / d.seq.max(1), i % d.seq.max(1));
                return Err(FlashError::Shape(format!(
                    "{}[{b}, {s}] = {} is outside the tables' rows [0, max_pos = {max_pos})",
                    t.name, a.values[i]
                )));
            }
            Ok(PositionSource::Array)
        }
    }
}

/// The buffer (if the caller gave its length) must hold exactly the elements the shape names, and
/// their byte count must not overflow.
fn check_nbytes(t: &TensorSpec, elem: usize) -> Result<()> {
    let bytes = t
        .shape
        .iter()
        .try_fold(elem, |acc, &d| acc.checked_mul(d))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| FlashError::OutOfMemory(format!("{} with shape {:?} is too large to address", t.name, t.shape)))?;
    match t.nbytes {
        Some(n) if n != bytes => Err(FlashError::Shape(format!(
            "{} has shape {:?} and dtype {}, which needs {bytes} bytes, but its buffer holds {n} bytes",
            t.name, t.shape, t.dtype
        ))),
        _ => Ok(()),
    }
}

/// The host buffers of one rotary call: native-endian, row-major, contiguous bytes whose sizes the
/// call's [`RotaryProblem`] implies (checked by every backend before it reads them).
#[derive(Debug)]
pub struct RotaryIo<'a> {
    pub x: &'a [u8],                 // [B, S, H, D] in p.dtype (dy for the backward)
    pub cos: &'a [u8],               // [max_pos, R/2] f32
    pub sin: &'a [u8],               // [max_pos, R/2] f32
    pub positions: Option<&'a [u8]>, // [B, S] int32, exactly when p.positions is Array
    pub y: &'a mut [u8],             // [B, S, H, D] in p.dtype (dx for the backward)
}

/// The buffers must have the sizes `p` implies (the kernels trust them).
pub(crate) fn check_buffers(p: &RotaryProblem, io: &RotaryIo) -> Result<()> {
    let d = &p.dims;
    let x = d.x_len() * p.dtype.size_bytes();
    let t = d.table_len() * 4;
    for (name, got, want) in [("x", io.x.len(), x), ("cos", io.cos.len(), t), ("sin", io.sin.len(), t), ("y", io.y.len(), x)] {
        if got != want {
            return Err(FlashError::Shape(format!("{name} buffer holds {got} bytes; the problem needs {want}")));
        }
    }
    match (p.positions, io.positions) {
        (PositionSource::Array, Some(b)) if b.len() == d.rows() * 4 => Ok(()),
        (PositionSource::Offset(_), None) => Ok(()),
        (src, b) => Err(FlashError::Internal(format!(
            "positions buffer: {:?} bytes for a problem whose positions are {src:?}",
            b.map(<[u8]>::len)
        ))),
    }
}
