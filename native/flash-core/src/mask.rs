//! Which keys each query row may see: the window, the per-batch key ranges (padding, packed
//! variable-length batches), segment ids and the block mask — validated once here, read by every
//! backend. All masks intersect; a row that sees no key gives o = 0, lse = -inf, zero gradients.
//!
//! Coordinates: batch row `b` owns query rows `[0, q_len)` and key rows `[0, k_len)` counted from
//! its [`Seq`]'s `q_start` / `k_start` (in q viewed as `[rows, H, D]`, k as `[rows, Hkv, D]`).
//! Its valid keys are `[k_lo, k_hi)`; key `j` has relative index `j - k_lo`, and
//! `off = (k_hi - k_lo) - q_len` aligns causal masks and windows bottom-right.
//! Segment ids and the block mask are indexed by these local positions (`[B, Sq]`, `[B, Sk]`,
//! blocks of [`MASK_BLOCK`]).

use crate::error::{FlashError, Result};
use crate::problem::TensorSpec;

/// Rows and columns of one block-mask entry (FlexAttention's block size).
pub const MASK_BLOCK: usize = 128;

/// A sliding window around the bottom-right diagonal: query i sees relative keys in
/// `[i + off - left, i + off + right]`; `None` is unbounded on that side. Negative values are an
/// error (checked by [`Problem`](crate::Problem)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Window {
    pub left: Option<i64>,
    pub right: Option<i64>,
}

/// A small int32 argument (`seqused_k`, `leftpad_k`: `[B]`; `cu_seqlens_*`: `[B + 1]`) as the
/// binding read it: its description, and its values on the host (device arrays are copied first).
#[derive(Debug, Clone, Copy)]
pub struct IndexArg<'a> {
    pub spec: TensorSpec<'a>,
    pub values: &'a [i32],
}

/// The mask tensors of a padded call, as the binding describes them; `None` = not given.
/// Segment ids are int32 `[B, Sq]` / `[B, Sk]`; the block mask is bool/uint8
/// `[B or 1, H or 1, ceil(Sq/128), ceil(Sk/128)]`. Their data travels in the call's io
/// ([`MaskBuffers`] on the host, `cuda::MaskPtrs` on a GPU).
#[derive(Debug, Clone, Copy, Default)]
pub struct MaskArgs<'a> {
    pub segment_ids: Option<(TensorSpec<'a>, TensorSpec<'a>)>,
    pub seqused_k: Option<IndexArg<'a>>,
    pub leftpad_k: Option<IndexArg<'a>>,
    pub block_mask: Option<TensorSpec<'a>>,
}

/// Host bytes of the data-carrying masks (native-endian int32 ids, one byte per block entry).
#[derive(Debug, Clone, Copy, Default)]
pub struct MaskBuffers<'a> {
    pub seg_q: Option<&'a [u8]>,      // [B, Sq] int32
    pub seg_k: Option<&'a [u8]>,      // [B, Sk] int32
    pub block_mask: Option<&'a [u8]>, // [Bm, Hm, Mb, Nb] uint8 (0 = hidden)
}

/// One batch row's queries and keys (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seq {
    /// First query row of this batch row in q viewed as `[rows, H, D]`.
    pub q_start: usize,
    pub q_len: usize,
    /// First key row in k viewed as `[rows, Hkv, D]`.
    pub k_start: usize,
    /// Keys stored for this batch row (Sk padded, the sequence length varlen).
    pub k_len: usize,
    /// Valid keys: local positions `[k_lo, k_hi)`.
    pub k_lo: usize,
    pub k_hi: usize,
}

impl Seq {
    /// Bottom-right alignment: query i's diagonal is at relative key index i + off.
    pub fn diag_offset(&self) -> i64 {
        (self.k_hi - self.k_lo) as i64 - self.q_len as i64
    }
}

/// Shape of a block mask: batch and head extents are 1 (broadcast) or B and H.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMaskShape {
    pub batch: usize,
    pub heads: usize,
    pub rows: usize, // ceil(Sq / 128)
    pub cols: usize, // ceil(Sk / 128)
}

impl BlockMaskShape {
    /// Index of block (m, n) of (b, h) in the row-major mask.
    pub fn index(&self, b: usize, h: usize, m: usize, n: usize) -> usize {
        let (b, h) = (if self.batch == 1 { 0 } else { b }, if self.heads == 1 { 0 } else { h });
        ((b * self.heads + h) * self.rows + m) * self.cols + n
    }
    pub fn len(&self) -> usize {
        self.batch * self.heads * self.rows * self.cols
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Packed variable-length batch (`cu_seqlens` convention): q `[total_q, H, D]`, k/v
/// `[total_k, Hkv, D]`, lse `[H, total_q]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Varlen {
    pub total_q: usize,
    pub total_k: usize,
}

/// Everything that decides visibility, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Mask {
    pub causal: bool,
    /// Effective window bounds (causal caps `right` at 0); `None` = unbounded.
    pub left: Option<usize>,
    pub right: Option<usize>,
    /// Segment ids given (padded calls only).
    pub segments: bool,
    pub block_mask: Option<BlockMaskShape>,
    /// Padding given (`seqused_k` or `leftpad_k`).
    pub padded_keys: bool,
    pub varlen: Option<Varlen>,
    /// Padded calls: Sq and Sk (varlen: the longest sequences).
    pub seq_q: usize,
    pub seq_k: usize,
    /// One entry per batch row when padding or varlen is given, else empty (see [`Mask::seq`]).
    seqs: Vec<Seq>,
}

impl Mask {
    /// Batch row b's queries and keys.
    pub fn seq(&self, b: usize) -> Seq {
        match self.seqs.get(b) {
            Some(s) => *s,
            None => Seq { q_start: b * self.seq_q, q_len: self.seq_q, k_start: b * self.seq_k, k_len: self.seq_k, k_lo: 0, k_hi: self.seq_k },
        }
    }

    /// True when only `causal` (or nothing) masks: the plain kernels apply.
    pub fn is_plain(&self) -> bool {
        self.left.is_none()
            && (self.right.is_none() || (self.causal && self.right == Some(0)))
            && !self.segments
            && self.block_mask.is_none()
            && !self.padded_keys
            && self.varlen.is_none()
    }

    /// Window and padding bounds of query row i of `seq`, as local key positions `[lo, hi)`
    /// (empty when lo >= hi). Segment ids and the block mask narrow this further.
    pub fn key_bounds(&self, seq: &Seq, i: usize) -> (usize, usize) {
        let diag = seq.k_lo as i64 + i as i64 + seq.diag_offset(); // local position of the diagonal
        let lo = self.left.map_or(seq.k_lo as i64, |l| (diag - l as i64).max(seq.k_lo as i64));
        let hi = self.right.map_or(seq.k_hi as i64, |r| (diag + r as i64 + 1).min(seq.k_hi as i64));
        (lo.max(0) as usize, hi.max(lo.max(0)) as usize)
    }

    /// Keys `[lo, hi)` that some row of `[r0, r1)` may see (window and padding only).
    pub fn key_range(&self, seq: &Seq, r0: usize, r1: usize) -> (usize, usize) {
        if r0 >= r1 {
            return (0, 0);
        }
        // Bounds move monotonically with i: the first row has the lowest lo, the last the highest hi.
        let (lo, _) = self.key_bounds(seq, r0);
        let (_, hi) = self.key_bounds(seq, r1 - 1);
        (lo, hi.max(lo))
    }

    /// Query rows `[lo, hi)` (within `[0, q_len)`) that may see some key of `[c0, c1)`.
    pub fn query_range(&self, seq: &Seq, c0: usize, c1: usize) -> (usize, usize) {
        let (c0, c1) = (c0.max(seq.k_lo), c1.min(seq.k_hi));
        if c0 >= c1 || seq.q_len == 0 {
            return (0, 0);
        }
        // Row i sees key j iff diag(i) - left <= j <= diag(i) + right, diag(i) = k_lo + off + i.
        let base = seq.k_lo as i64 + seq.diag_offset();
        let lo = self.right.map_or(0, |r| c0 as i64 - r as i64 - base).max(0);
        let hi = self.left.map_or(seq.q_len as i64, |l| c1 as i64 - 1 + l as i64 - base + 1).min(seq.q_len as i64);
        if lo >= hi {
            (0, 0)
        } else {
            (lo as usize, hi as usize)
        }
    }

    /// Whether every row of `[r0, r1)` sees every key of `[c0, c1)` by window and padding (no
    /// element mask needed for them; segment ids and the block mask are checked apart).
    pub fn tile_inside(&self, seq: &Seq, r0: usize, r1: usize, c0: usize, c1: usize) -> bool {
        if r0 >= r1 || c0 >= c1 {
            return true;
        }
        // Both bounds grow with i: the last row's lo and the first row's hi are the tightest.
        let (lo, _) = self.key_bounds(seq, r1 - 1);
        let (_, hi) = self.key_bounds(seq, r0);
        lo <= c0 && c1 <= hi
    }
}

/// Integer dtype names the bindings report for int32 and for bool/uint8 masks.
pub(crate) fn is_int32(dtype: &str) -> bool {
    matches!(dtype, "int32" | "i32" | "s32")
}
pub(crate) fn is_byte_mask(dtype: &str) -> bool {
    matches!(dtype, "bool" | "uint8" | "u8")
}

fn check_dtype(t: &TensorSpec, ok: fn(&str) -> bool, want: &str) -> Result<()> {
    if ok(t.dtype) {
        Ok(())
    } else {
        Err(FlashError::DType(format!("{} has dtype {}; it must be {want}", t.name, t.dtype)))
    }
}

fn check_shape(t: &TensorSpec, want: &[usize], what: &str) -> Result<()> {
    if t.shape != want {
        return Err(FlashError::Shape(format!("{} has shape {:?}; expected {what} = {want:?}", t.name, t.shape)));
    }
    let bytes = want.iter().product::<usize>() * if is_int32(t.dtype) { 4 } else { 1 };
    match t.nbytes {
        Some(n) if n != bytes => Err(FlashError::Shape(format!(
            "{} has shape {:?}, which needs {bytes} bytes, but its buffer holds {n} bytes",
            t.name, t.shape
        ))),
        _ => Ok(()),
    }
}

fn index_values<'a>(arg: &IndexArg<'a>, len: usize, what: &str) -> Result<&'a [i32]> {
    check_dtype(&arg.spec, is_int32, "int32")?;
    check_shape(&arg.spec, &[len], what)?;
    if arg.values.len() != len {
        return Err(FlashError::Internal(format!("{}: {} values for shape [{len}]", arg.spec.name, arg.values.len())));
    }
    Ok(arg.values)
}

/// Checks a window's sides and folds causal into it.
pub(crate) fn window_bounds(w: Window, causal: bool) -> Result<(Option<usize>, Option<usize>)> {
    let side = |v: Option<i64>, name: &str| match v {
        Some(x) if x < 0 => Err(FlashError::Unsupported(format!(
            "window {name} must be a non-negative integer or None (unbounded); got {x}"
        ))),
        Some(x) => Ok(Some(x as usize)),
        None => Ok(None),
    };
    let (left, right) = (side(w.left, "left")?, side(w.right, "right")?);
    // Causal caps the right side at 0 (any given right is >= 0, so the cap is 0).
    let right = if causal { Some(0) } else { right };
    Ok((left, right))
}

/// The mask of a padded call with dims (B, Sq, Sk, H).
pub(crate) fn padded(
    (batch, seq_q, seq_k, heads): (usize, usize, usize, usize),
    causal: bool,
    window: Window,
    args: &MaskArgs,
) -> Result<Mask> {
    let (left, right) = window_bounds(window, causal)?;
    let used = args.seqused_k.as_ref().map(|a| index_values(a, batch, "[batch]")).transpose()?;
    let pad = args.leftpad_k.as_ref().map(|a| index_values(a, batch, "[batch]")).transpose()?;
    let mut seqs = Vec::new(); // bounded by the arrays the caller gave, never by B alone
    for b in (0..batch).filter(|_| used.is_some() || pad.is_some()) {
        let hi = used.map_or(seq_k as i64, |u| u[b] as i64);
        let lo = pad.map_or(0, |p| p[b] as i64);
        if let Some(u) = used {
            if !(0..=seq_k as i64).contains(&(u[b] as i64)) {
                let name = args.seqused_k.as_ref().map_or("seqused_k", |a| a.spec.name);
                return Err(FlashError::Shape(format!("{name}[{b}] = {} is outside [0, Sk = {seq_k}]", u[b])));
            }
        }
        if let Some(p) = pad {
            let name = args.leftpad_k.as_ref().map_or("leftpad_k", |a| a.spec.name);
            if !(0..=seq_k as i64).contains(&(p[b] as i64)) {
                return Err(FlashError::Shape(format!("{name}[{b}] = {} is outside [0, Sk = {seq_k}]", p[b])));
            }
            if lo > hi {
                return Err(FlashError::Shape(format!(
                    "{name}[{b}] = {lo} is past the end of the valid keys ({hi}); it must be at most seqused_k[{b}]"
                )));
            }
        }
        let (lo, hi) = (lo as usize, hi as usize);
        seqs.push(Seq { q_start: b * seq_q, q_len: seq_q, k_start: b * seq_k, k_len: seq_k, k_lo: lo, k_hi: hi });
    }
    if let Some((sq, sk)) = &args.segment_ids {
        check_dtype(sq, is_int32, "int32")?;
        check_dtype(sk, is_int32, "int32")?;
        check_shape(sq, &[batch, seq_q], "[batch, seq_q]")?;
        check_shape(sk, &[batch, seq_k], "[batch, seq_k]")?;
    }
    let block_mask = match &args.block_mask {
        None => None,
        Some(t) => {
            check_dtype(t, is_byte_mask, "bool or uint8")?;
            let (rows, cols) = (seq_q.div_ceil(MASK_BLOCK), seq_k.div_ceil(MASK_BLOCK));
            let s = t.shape;
            let ok = s.len() == 4 && (s[0] == 1 || s[0] == batch) && (s[1] == 1 || s[1] == heads) && s[2] == rows && s[3] == cols;
            if !ok {
                return Err(FlashError::Shape(format!(
                    "{} has shape {s:?}; expected [{batch} or 1, {heads} or 1, ceil(Sq/128) = {rows}, ceil(Sk/128) = {cols}]",
                    t.name
                )));
            }
            let shape = BlockMaskShape { batch: s[0], heads: s[1], rows, cols };
            check_shape(t, s, "its shape")?;
            Some(shape)
        }
    };
    Ok(Mask {
        causal,
        left,
        right,
        segments: args.segment_ids.is_some(),
        block_mask,
        padded_keys: used.is_some() || pad.is_some(),
        varlen: None,
        seq_q,
        seq_k,
        seqs,
    })
}

/// The mask of a varlen call from its cumulative lengths (`[B + 1]`, 0 first, non-decreasing,
/// ending at total_q / total_k). Returns it with (B, max q_len, max k_len).
pub(crate) fn varlen(
    (total_q, total_k): (usize, usize),
    cu_q: &IndexArg,
    cu_k: &IndexArg,
    causal: bool,
    window: Window,
) -> Result<(Mask, usize, usize, usize)> {
    let (left, right) = window_bounds(window, causal)?;
    for a in [cu_q, cu_k] {
        check_dtype(&a.spec, is_int32, "int32")?;
        if a.spec.shape.len() != 1 || a.spec.shape[0] == 0 {
            return Err(FlashError::Shape(format!(
                "{} must have shape [batch + 1] (at least one value); got {:?}",
                a.spec.name, a.spec.shape
            )));
        }
    }
    if cu_q.spec.shape != cu_k.spec.shape {
        return Err(FlashError::Shape(format!(
            "{} has shape {:?} but {} has shape {:?}; both are [batch + 1]",
            cu_q.spec.name, cu_q.spec.shape, cu_k.spec.name, cu_k.spec.shape
        )));
    }
    let batch = cu_q.spec.shape[0] - 1;
    let cq = index_values(cu_q, batch + 1, "[batch + 1]")?;
    let ck = index_values(cu_k, batch + 1, "[batch + 1]")?;
    for (a, v, total, what) in [(cu_q, cq, total_q, "q"), (cu_k, ck, total_k, "k")] {
        let name = a.spec.name;
        if v[0] != 0 {
            return Err(FlashError::Shape(format!("{name}[0] must be 0; got {}", v[0])));
        }
        if let Some(b) = (0..batch).find(|&b| v[b + 1] < v[b]) {
            return Err(FlashError::Shape(format!(
                "{name} must be non-decreasing; {name}[{}] = {} < {name}[{b}] = {}",
                b + 1,
                v[b + 1],
                v[b]
            )));
        }
        if v[batch] as i64 != total as i64 {
            return Err(FlashError::Shape(format!(
                "{name}[{batch}] = {} must equal the number of packed {what} rows ({total})",
                v[batch]
            )));
        }
    }
    let seqs: Vec<Seq> = (0..batch)
        .map(|b| {
            let (q0, q1, k0, k1) = (cq[b] as usize, cq[b + 1] as usize, ck[b] as usize, ck[b + 1] as usize);
            Seq { q_start: q0, q_len: q1 - q0, k_start: k0, k_len: k1 - k0, k_lo: 0, k_hi: k1 - k0 }
        })
        .collect();
    let max_q = seqs.iter().map(|s| s.q_len).max().unwrap_or(0);
    let max_k = seqs.iter().map(|s| s.k_len).max().unwrap_or(0);
    let mask = Mask {
        causal,
        left,
        right,
        segments: false,
        block_mask: None,
        padded_keys: false,
        varlen: Some(Varlen { total_q, total_k }),
        seq_q: max_q,
        seq_k: max_k,
        seqs,
    };
    Ok((mask, batch, max_q, max_k))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(q_len: usize, k_len: usize, k_lo: usize, k_hi: usize) -> Seq {
        Seq { q_start: 0, q_len, k_start: 0, k_len, k_lo, k_hi }
    }

    fn mask(causal: bool, left: Option<usize>, right: Option<usize>) -> Mask {
        Mask { causal, left, right, segments: false, block_mask: None, padded_keys: false, varlen: None, seq_q: 0, seq_k: 0, seqs: vec![] }
    }

    /// Brute force: key j visible to row i by window and padding.
    fn sees(m: &Mask, s: &Seq, i: usize, j: usize) -> bool {
        let rel = j as i64 - s.k_lo as i64;
        let diag = i as i64 + s.diag_offset();
        j >= s.k_lo && j < s.k_hi && m.left.is_none_or(|l| rel >= diag - l as i64) && m.right.is_none_or(|r| rel <= diag + r as i64)
    }

    #[test]
    fn ranges_agree_with_brute_force() {
        let seqs = [seq(7, 11, 2, 9), seq(11, 7, 0, 7), seq(5, 5, 1, 1), seq(9, 13, 3, 13), seq(0, 4, 0, 4)];
        let windows = [(None, None), (Some(0), Some(0)), (Some(2), None), (None, Some(1)), (Some(3), Some(2))];
        for s in &seqs {
            for &(l, r) in &windows {
                for causal in [false, true] {
                    let (l, r) = window_bounds(Window { left: l.map(|x| x as i64), right: r.map(|x| x as i64) }, causal).unwrap();
                    let m = mask(causal, l, r);
                    for i in 0..s.q_len {
                        let (lo, hi) = m.key_bounds(s, i);
                        for j in 0..s.k_len {
                            assert_eq!(sees(&m, s, i, j), j >= lo && j < hi, "{s:?} {l:?} {r:?} i={i} j={j}");
                        }
                    }
                    for r0 in 0..s.q_len {
                        for r1 in r0 + 1..=s.q_len {
                            for c0 in 0..s.k_len {
                                for c1 in c0 + 1..=s.k_len {
                                    let any = (r0..r1).any(|i| (c0..c1).any(|j| sees(&m, s, i, j)));
                                    let all = (r0..r1).all(|i| (c0..c1).all(|j| sees(&m, s, i, j)));
                                    let (kl, kh) = m.key_range(s, r0, r1);
                                    let keys_hit = (c0..c1).any(|j| j >= kl && j < kh);
                                    assert!(!any || keys_hit, "key_range misses a visible key");
                                    let (ql, qh) = m.query_range(s, c0, c1);
                                    let rows_hit = (r0..r1).any(|i| i >= ql && i < qh);
                                    assert!(!any || rows_hit, "query_range misses a visible row");
                                    assert_eq!(all, m.tile_inside(s, r0, r1, c0, c1), "tile_inside {r0}..{r1} x {c0}..{c1}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
