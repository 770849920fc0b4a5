//! The attention problem: sizes, dtype and options, validated once for every binding and backend.

use crate::dispatch::Mode;
use crate::dtype::DType;
use crate::error::{FlashError, Result};
use crate::mask::{self, IndexArg, Mask, MaskArgs, Window};
use crate::modifiers::{ModArgs, Modifiers};
use crate::precision::Precision;

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
    /// Softmax scale; `None` means 1/sqrt(D), q and k's head dim (not v's).
    pub scale: Option<f64>,
    /// Backward only: bit-identical gradients run to run. The CPU backward always is; on the GPU
    /// `false` (the default) lets dQ be summed with f32 atomics, which is faster.
    pub deterministic: bool,
    /// Sliding window around the diagonal (see [`Window`]); the default sees every key.
    pub window: Window,
    /// Caps scores at ±softcap with `c · tanh(s / c)` (see [`crate::modifiers`]); `None` = off.
    pub softcap: Option<f64>,
    /// Fused (tiled, O(S) memory) or materialized (whole S×S scores) kernels; `Auto` lets
    /// [`dispatch`](crate::dispatch) choose. `FLASH_NIF_MODE` overrides it.
    pub mode: Mode,
    /// How f32 products are computed on the GPU (see [`crate::precision`]); the CPU is exact f32.
    pub precision: Precision,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            causal: true,
            scale: None,
            deterministic: false,
            window: Window::default(),
            softcap: None,
            mode: Mode::Auto,
            precision: Precision::Exact,
        }
    }
}

/// Sizes of one attention call: q is [batch, seq_q, heads, head_dim], k [batch, seq_k, kv_heads,
/// head_dim], v [batch, seq_k, kv_heads, head_dim_v], o [batch, seq_q, heads, head_dim_v], lse
/// [batch, heads, seq_q]. q and k share D (their dot product is the score); v has its own Dv, which
/// o, dO and dV take (DeepSeek-style attention uses D = 192, Dv = 128).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub batch: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// D: q, k, dq, dk.
    pub head_dim: usize,
    /// Dv: v, o, dO, dv.
    pub head_dim_v: usize,
}

impl Dims {
    /// Query heads per kv head (1 = MHA, heads = MQA).
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.seq_q, self.heads, self.head_dim]
    }
    /// k and dk (v's is [`Dims::v_shape`]).
    pub fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.seq_k, self.kv_heads, self.head_dim]
    }
    /// v and dv.
    pub fn v_shape(&self) -> [usize; 4] {
        [self.batch, self.seq_k, self.kv_heads, self.head_dim_v]
    }
    /// o and dO.
    pub fn o_shape(&self) -> [usize; 4] {
        [self.batch, self.seq_q, self.heads, self.head_dim_v]
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
    pub fn v_len(&self) -> usize {
        self.v_shape().iter().product()
    }
    pub fn o_len(&self) -> usize {
        self.o_shape().iter().product()
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
/// For a varlen call `dims.batch` is the number of sequences and `dims.seq_q` / `dims.seq_k` the
/// longest ones (the kernels' grid); the tensors' shapes are [`Problem::q_shape`] and friends.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub dims: Dims,
    pub dtype: DType,
    pub causal: bool,
    /// The resolved softmax scale.
    pub scale: f32,
    /// See [`Options::deterministic`].
    pub deterministic: bool,
    /// Which keys each row sees (always set; [`Mask::is_plain`] when only `causal` masks).
    pub mask: Mask,
    /// Score modifiers ([`Modifiers::is_none`] when none is given).
    pub mods: Modifiers,
    /// See [`Options::mode`] (as the caller gave it; [`dispatch`](crate::dispatch) resolves it).
    pub mode: Mode,
    /// See [`Options::precision`].
    pub precision: Precision,
}

impl Problem {
    /// Validates the inputs of a forward call without mask tensors.
    pub fn forward(q: &TensorSpec, k: &TensorSpec, v: &TensorSpec, opts: &Options) -> Result<Problem> {
        Problem::forward_masked(q, k, v, opts, &MaskArgs::default())
    }

    /// Validates the inputs of a forward call and its mask tensors.
    pub fn forward_masked(q: &TensorSpec, k: &TensorSpec, v: &TensorSpec, opts: &Options, masks: &MaskArgs) -> Result<Problem> {
        let (dims, dtype) = check_qkv(q, k, v)?;
        Problem::finish(dims, dtype, opts, masks)
    }

    /// Validates a packed variable-length forward: q `[total_q, H, D]`, k/v `[total_k, Hkv, D]`,
    /// cu_seqlens `[B + 1]` int32.
    pub fn varlen_forward(
        q: &TensorSpec, k: &TensorSpec, v: &TensorSpec, cu_q: &IndexArg, cu_k: &IndexArg, opts: &Options,
    ) -> Result<Problem> {
        let (q4, k4, v4) = (varlen_shape(q)?, varlen_shape(k)?, varlen_shape(v)?);
        let (dims, dtype) = check_qkv(&with_shape(q, &q4), &with_shape(k, &k4), &with_shape(v, &v4))
            .map_err(|e| shown_as_given(e, &[(&q4, q.shape), (&k4, k.shape), (&v4, v.shape)]))?;
        Problem::finish_varlen(dims, dtype, opts, cu_q, cu_k)
    }

    /// Validates a packed variable-length backward: the forward's inputs plus dO and o
    /// (`[total_q, H, Dv]`) and lse (`[H, total_q]`, float32).
    #[allow(clippy::too_many_arguments)] // the call's six tensors, two offsets and its options
    pub fn varlen_backward(
        d_out: &TensorSpec, q: &TensorSpec, k: &TensorSpec, v: &TensorSpec, o: &TensorSpec, lse: &TensorSpec,
        cu: [&IndexArg; 2], opts: &Options,
    ) -> Result<Problem> {
        let p = Problem::varlen_forward(q, k, v, cu[0], cu[1], opts)?;
        check_like_o(&[d_out, o], q, &p.o_shape(), p.dtype)?;
        check_lse(lse, &p.lse_shape())?;
        Ok(p)
    }

    /// Validates the inputs of a backward call without mask tensors.
    pub fn backward(
        d_out: &TensorSpec,
        q: &TensorSpec,
        k: &TensorSpec,
        v: &TensorSpec,
        o: &TensorSpec,
        lse: &TensorSpec,
        opts: &Options,
    ) -> Result<Problem> {
        Problem::backward_masked([d_out, q, k, v, o, lse], opts, &MaskArgs::default())
    }

    /// Validates the inputs of a backward call, `[d_out, q, k, v, o, lse]`: the forward's inputs
    /// plus dO and o ([B, Sq, H, Dv], q's dtype) and lse ([B, H, Sq], float32), and the forward's
    /// mask tensors.
    pub fn backward_masked(t: [&TensorSpec; 6], opts: &Options, masks: &MaskArgs) -> Result<Problem> {
        let [d_out, q, k, v, o, lse] = t;
        let (dims, dtype) = check_qkv(q, k, v)?;
        check_like_o(&[d_out, o], q, &dims.o_shape(), dtype)?;
        check_lse(lse, &dims.lse_shape())?;
        Problem::finish(dims, dtype, opts, masks)
    }

    fn finish(dims: Dims, dtype: DType, opts: &Options, masks: &MaskArgs) -> Result<Problem> {
        let shape = (dims.batch, dims.seq_q, dims.seq_k, dims.heads);
        let mask = mask::padded(shape, opts.causal, opts.window, masks)?;
        Problem::with_mask(dims, dtype, opts, mask)
    }

    fn finish_varlen(dims: Dims, dtype: DType, opts: &Options, cu_q: &IndexArg, cu_k: &IndexArg) -> Result<Problem> {
        let totals = (dims.seq_q, dims.seq_k); // check_qkv saw [1, total, H, D]
        let (mask, batch, max_q, max_k) = mask::varlen(totals, cu_q, cu_k, opts.causal, opts.window)?;
        let dims = Dims { batch, seq_q: max_q, seq_k: max_k, ..dims };
        Problem::with_mask(dims, dtype, opts, mask)
    }

    fn with_mask(dims: Dims, dtype: DType, opts: &Options, mask: Mask) -> Result<Problem> {
        let scale = match opts.scale {
            None => 1.0 / (dims.head_dim as f64).sqrt(),
            Some(s) if s.is_finite() && s > 0.0 => s,
            Some(s) => {
                return Err(FlashError::Unsupported(format!(
                    "scale must be a finite positive number, got {s}"
                )))
            }
        };
        let mods = Modifiers::with_softcap(opts.softcap)?;
        Ok(Problem { dims, dtype, causal: opts.causal, scale: scale as f32, deterministic: opts.deterministic, mask, mods, mode: opts.mode, precision: opts.precision })
    }

    /// The same problem with the modifier tensors of `args` (ALiBi slopes, sinks) validated
    /// against its batch and heads; `softcap` came with the options.
    pub fn with_modifiers(self, args: &ModArgs) -> Result<Problem> {
        let mods = self.mods.clone().with_tensors(args, self.dims.batch, self.dims.heads)?;
        Ok(Problem { mods, ..self })
    }

    /// The backward's optional `dlse` (the loss's gradient with respect to lse): float32 with
    /// lse's shape ([`Problem::lse_shape`]).
    pub fn check_dlse(&self, dlse: &TensorSpec) -> Result<()> {
        check_lse_dtype(dlse)?;
        let want = self.lse_shape();
        if dlse.shape != want.as_slice() {
            return Err(FlashError::Shape(format!("{} has shape {:?}; it must have lse's shape {want:?}", dlse.name, dlse.shape)));
        }
        check_nbytes(dlse, DType::F32)
    }

    /// True when the call needs the general kernels: a mask beyond causal, or a modifier.
    pub fn is_plain(&self) -> bool {
        self.mask.is_plain() && self.mods.is_none()
    }

    /// Shapes of the call's tensors: padded `[B, Sq, H, D]` (q, dq), `[B, Sk, Hkv, D]` (k, dk),
    /// `[B, Sk, Hkv, Dv]` (v, dv), `[B, Sq, H, Dv]` (o, dO), `[B, H, Sq]` (lse); varlen
    /// `[total_q, H, D]`, `[total_k, Hkv, D]`, `[total_k, Hkv, Dv]`, `[total_q, H, Dv]`,
    /// `[H, total_q]`.
    pub fn q_shape(&self) -> Vec<usize> {
        self.rows_shape(true, self.dims.head_dim)
    }
    pub fn kv_shape(&self) -> Vec<usize> {
        self.rows_shape(false, self.dims.head_dim)
    }
    pub fn v_shape(&self) -> Vec<usize> {
        self.rows_shape(false, self.dims.head_dim_v)
    }
    pub fn o_shape(&self) -> Vec<usize> {
        self.rows_shape(true, self.dims.head_dim_v)
    }
    /// The query side's (`query`) or the key side's tensor of head dim `width`.
    fn rows_shape(&self, query: bool, width: usize) -> Vec<usize> {
        let d = &self.dims;
        let heads = if query { d.heads } else { d.kv_heads };
        match (self.mask.varlen, query) {
            (Some(v), true) => vec![v.total_q, heads, width],
            (Some(v), false) => vec![v.total_k, heads, width],
            (None, true) => vec![d.batch, d.seq_q, heads, width],
            (None, false) => vec![d.batch, d.seq_k, heads, width],
        }
    }
    pub fn lse_shape(&self) -> Vec<usize> {
        match self.mask.varlen {
            Some(v) => vec![self.dims.heads, v.total_q],
            None => self.dims.lse_shape().to_vec(),
        }
    }
    /// Element counts of q (and dq), of k (and dk), of v (and dv), of o (and dO) and of lse.
    pub fn q_len(&self) -> usize {
        self.q_shape().iter().product()
    }
    pub fn kv_len(&self) -> usize {
        self.kv_shape().iter().product()
    }
    pub fn v_len(&self) -> usize {
        self.v_shape().iter().product()
    }
    pub fn o_len(&self) -> usize {
        self.o_shape().iter().product()
    }
    pub fn lse_len(&self) -> usize {
        self.lse_shape().iter().product()
    }
    /// Rows of q viewed as `[rows, H, D]` (B·Sq, or total_q) and of k as `[rows, Hkv, D]`.
    pub fn q_rows(&self) -> usize {
        self.q_shape()[..self.q_shape().len() - 2].iter().product()
    }
    pub fn k_rows(&self) -> usize {
        self.kv_shape()[..self.kv_shape().len() - 2].iter().product()
    }
    /// Index in lse of (batch row b, head h, its query row 0): padded `[B, H, Sq]`, varlen `[H, total_q]`.
    pub fn lse_base(&self, b: usize, h: usize) -> usize {
        match self.mask.varlen {
            Some(v) => h * v.total_q + self.mask.seq(b).q_start,
            None => (b * self.dims.heads + h) * self.dims.seq_q,
        }
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

/// dO and o must have the shape `o_shape` (q's with v's head dim) and q's dtype.
fn check_like_o(ts: &[&TensorSpec], q: &TensorSpec, o_shape: &[usize], dtype: DType) -> Result<()> {
    let qn = q.name;
    for t in ts {
        let (name, t_dtype) = (t.name, parse_dtype(t)?);
        if t.shape != o_shape {
            let shape = t.shape;
            let want = if o_shape.last() == q.shape.last() {
                format!("it must match {qn}'s shape {o_shape:?}")
            } else {
                format!("it must be {qn}'s shape with v's head_dim, {o_shape:?}")
            };
            return Err(FlashError::Shape(format!("{name} has shape {shape:?}; {want}")));
        }
        if t_dtype != dtype {
            let (got, want) = (t_dtype.name(), dtype.name());
            return Err(FlashError::DType(format!("{name} has dtype {got}; it must match {qn}'s dtype {want}")));
        }
        check_nbytes(t, t_dtype)?;
    }
    Ok(())
}

fn check_lse(lse: &TensorSpec, want: &[usize]) -> Result<()> {
    check_lse_dtype(lse)?;
    if lse.shape != want {
        let layout = if want.len() == 2 { "[heads, total_q]" } else { "[batch, heads, seq_q]" };
        return Err(FlashError::Shape(format!("{} has shape {:?}; expected {layout} = {want:?}", lse.name, lse.shape)));
    }
    check_nbytes(lse, DType::F32)
}

/// A varlen tensor `[total, heads, head_dim]` seen as `[1, total, heads, head_dim]`.
fn varlen_shape(t: &TensorSpec) -> Result<[usize; 4]> {
    match t.shape {
        &[n, h, d] => Ok([1, n, h, d]),
        s => Err(FlashError::Shape(format!(
            "{} must have rank 3 [total, heads, head_dim] in a varlen call; got shape {s:?}",
            t.name
        ))),
    }
}

/// check_qkv's messages name the [1, total, H, D] views; the caller gave [total, H, D].
fn shown_as_given(e: FlashError, views: &[(&[usize; 4], &[usize])]) -> FlashError {
    let fix = |mut m: String| {
        for (view, given) in views {
            m = m.replace(&format!("{view:?}"), &format!("{given:?}"));
        }
        m.replace("must have rank 4 [batch, seq, heads, head_dim]", "must have rank 3 [total, heads, head_dim]")
    };
    match e {
        FlashError::Shape(m) => FlashError::Shape(fix(m)),
        FlashError::DType(m) => FlashError::DType(fix(m)),
        FlashError::Unsupported(m) => FlashError::Unsupported(fix(m)),
        other => other,
    }
}

fn with_shape<'a>(t: &TensorSpec<'a>, shape: &'a [usize]) -> TensorSpec<'a> {
    TensorSpec { shape, ..*t }
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
    // v has k's batch, keys and heads; its head dim (Dv) is its own.
    if k.shape[..3] != v.shape[..3] {
        let (ks, vs) = (k.shape, v.shape);
        return Err(FlashError::Shape(format!(
            "{kn} has shape {ks:?} but {vn} has shape {vs:?}; they must match but for the last (head_dim) axis"
        )));
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
        head_dim_v: v.shape[3],
    };
    if dims.head_dim == 0 || dims.head_dim > MAX_HEAD_DIM {
        return Err(FlashError::Shape(format!(
            "head_dim must be between 1 and {MAX_HEAD_DIM}; {qn} has shape {qs:?}"
        )));
    }
    if dims.head_dim_v == 0 || dims.head_dim_v > MAX_HEAD_DIM {
        return Err(FlashError::Shape(format!(
            "{vn}'s head_dim must be between 1 and {MAX_HEAD_DIM}; {vn} has shape {:?}",
            v.shape
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
