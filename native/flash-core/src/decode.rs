//! Decode on the CPU: a few new queries (Sq = 1 .. 16) against a KV cache, plain or quantized
//! (quant.rs's format, read and dequantized row by row: no dequantized copy), as reference.py's
//! `decode` defines it. Row b's valid keys are `[leftpad_k[b], cache_seqlens[b])`; causal (and a
//! window) is aligned to their end. One task per (batch row, kv head, split of the keys) loads
//! each key row once for every query head of its GQA group and every query row; the splits'
//! partial states are merged by their logsumexp (quant::merge_states' rule).

use rayon::prelude::*;

use crate::device::Device;
use crate::dtype::DType;
use crate::error::{FlashError, Result};
use crate::problem::{TensorSpec, MAX_HEAD_DIM};
use crate::quant::{self, merge_state, QuantFormat};

/// Most query rows a decode call takes.
pub const MAX_DECODE_ROWS: usize = 16;
/// Keys scored at once per task (one max and one rescale per block and row).
const KEY_BLOCK: usize = 32;
/// Keys per split at least when the number of splits is chosen here.
const MIN_KEYS_PER_SPLIT: usize = 256;

/// A KV cache `[B, S_cache, Hkv, D]` as decode reads it.
#[derive(Clone, Copy)]
pub enum Cache<'a> {
    /// Rows in the call's dtype.
    Plain(&'a [u8]),
    /// quant.rs's format; scales and biases in the call's dtype.
    Quant { fmt: QuantFormat, values: &'a [u32], scales: &'a [u8], biases: &'a [u8] },
}

/// A decode call's sizes and options.
#[derive(Debug, Clone, Copy)]
pub struct Decode {
    pub dtype: DType,
    pub batch: usize,
    pub seq_q: usize,
    pub s_cache: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub scale: f32,
    /// Window sides (None: unbounded); causal caps the right side at 0.
    pub left: Option<usize>,
    pub right: Option<usize>,
    pub softcap: Option<f32>,
    /// Splits of each row's keys (None: chosen from the sizes and the thread count).
    pub num_splits: Option<usize>,
}

impl Decode {
    /// The call's sizes from q's spec and the caches' dtypes and shapes `[B, S_cache, Hkv, D]`
    /// (as quant.rs's checks return them), with the options; every mismatch a clear error.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        q: &TensorSpec, k: (DType, [usize; 4]), v: (DType, [usize; 4]), causal: bool, scale: Option<f32>, window: (Option<usize>, Option<usize>),
        softcap: Option<f32>, num_splits: Option<usize>,
    ) -> Result<Decode> {
        let dtype = DType::parse(q.dtype, q.name)?;
        let Ok([b, sq, h, d]) = <[usize; 4]>::try_from(q.shape) else {
            return Err(FlashError::Shape(format!("{} must be [B, Sq, H, D]; got {:?}", q.name, q.shape)));
        };
        for (name, (dt, shape)) in [("k_cache", k), ("v_cache", v)] {
            if dt != dtype {
                return Err(FlashError::DType(format!("{name} holds {}, q is {}: they must match", dt.name(), dtype.name())));
            }
            if shape[0] != b || shape[3] != d || shape != k.1 {
                return Err(FlashError::Shape(format!(
                    "{name} must be [B, S_cache, Hkv, D] with q's B = {b} and D = {d}, and k and v alike; got k {:?}, v {:?}",
                    k.1, v.1
                )));
            }
        }
        let scale = scale.unwrap_or(1.0 / (d as f32).sqrt());
        if !(scale.is_finite() && scale > 0.0) {
            return Err(FlashError::Unsupported(format!("scale must be a finite positive number, got {scale}")));
        }
        if let Some(c) = softcap {
            if !(c.is_finite() && c > 0.0) {
                return Err(FlashError::Unsupported(format!("softcap must be a finite positive number, got {c}")));
            }
        }
        let p = Decode {
            dtype, batch: b, seq_q: sq, s_cache: k.1[1], heads: h, kv_heads: k.1[2], head_dim: d, causal, scale,
            left: window.0, right: window.1, softcap, num_splits,
        };
        p.check()?;
        Ok(p)
    }

    fn check(&self) -> Result<()> {
        if self.seq_q == 0 || self.seq_q > MAX_DECODE_ROWS {
            return Err(FlashError::Shape(format!("decode takes 1 to {MAX_DECODE_ROWS} query rows; got Sq = {}", self.seq_q)));
        }
        if self.kv_heads == 0 || self.heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(FlashError::Shape(format!("H ({}) must be a positive multiple of Hkv ({})", self.heads, self.kv_heads)));
        }
        if self.head_dim == 0 || self.head_dim > MAX_HEAD_DIM {
            return Err(FlashError::Shape(format!("head dim {} must be in [1, {MAX_HEAD_DIM}]", self.head_dim)));
        }
        if self.num_splits == Some(0) {
            return Err(FlashError::Unsupported("num_splits must be at least 1".into()));
        }
        Ok(())
    }

    /// The window the keys are seen through, (left, right) sides (None: unbounded): causal caps the
    /// right side at 0. Query row i sees the valid keys j with
    /// `seqlens[b] - Sq + i - left <= j <= seqlens[b] - Sq + i + right`.
    pub fn window(&self) -> (Option<usize>, Option<usize>) {
        (self.left, if self.causal { Some(0) } else { self.right })
    }

    /// `cache_seqlens` and `leftpad_k` hold one value per batch row with
    /// `0 <= leftpad_k[b] <= cache_seqlens[b] <= S_cache`: every backend reads only inside the cache.
    pub fn check_rows(&self, seqlens: &[i32], leftpad: &[i32]) -> Result<()> {
        if seqlens.len() != self.batch || leftpad.len() != self.batch {
            return Err(FlashError::Internal("decode: cache_seqlens or leftpad_k has the wrong length".into()));
        }
        for b in 0..self.batch {
            let (lo, hi) = (leftpad[b], seqlens[b]);
            if lo < 0 || lo > hi || hi as usize > self.s_cache {
                return Err(FlashError::Shape(format!("row {b}: need 0 <= leftpad_k ({lo}) <= cache_seqlens ({hi}) <= S_cache ({})", self.s_cache)));
            }
        }
        Ok(())
    }

    /// The buffers of a call on host memory hold what the call implies: q and o `[B, Sq, H, D]`,
    /// lse `[B, H, Sq]`, the caches `[B, S_cache, Hkv, D]`, and valid row bounds.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check_buffers(&self, q: &[u8], k: &Cache, v: &Cache, seqlens: &[i32], leftpad: &[i32], o: &[u8], lse: &[f32]) -> Result<()> {
        self.check()?;
        check_cache("k_cache", k, self)?;
        check_cache("v_cache", v, self)?;
        let (b, sq, h, d) = (self.batch, self.seq_q, self.heads, self.head_dim);
        if q.len() != b * sq * h * d * self.dtype.size_bytes() || o.len() != q.len() || lse.len() != b * h * sq {
            return Err(FlashError::Internal("decode: q, o or lse has the wrong length".into()));
        }
        self.check_rows(seqlens, leftpad)
    }

    fn splits(&self) -> usize {
        self.num_splits.unwrap_or_else(|| {
            let tasks = self.batch * self.kv_heads;
            let want = (2 * rayon::current_num_threads()).div_ceil(tasks.max(1));
            want.clamp(1, self.s_cache.div_ceil(MIN_KEYS_PER_SPLIT).max(1))
        })
    }
}

/// The rows of one cache: key row `j` of (b, kv head) dequantized into `out` (f32).
fn load_row(cache: &Cache, dtype: DType, p: &Decode, b: usize, j: usize, kv: usize, out: &mut [f32]) {
    let row = (b * p.s_cache + j) * p.kv_heads + kv;
    match *cache {
        Cache::Plain(x) => dtype.load(x, row * p.head_dim, out),
        Cache::Quant { fmt, values, scales, biases } => {
            let (w, g) = (fmt.words(), fmt.groups() * dtype.size_bytes());
            quant::unpack_row(dtype, &fmt, &values[row * w..][..w], &scales[row * g..][..g], &biases[row * g..][..g], out);
        }
    }
}

/// Checks a cache's buffer lengths against the call.
fn check_cache(name: &str, cache: &Cache, p: &Decode) -> Result<()> {
    let rows = p.batch * p.s_cache * p.kv_heads;
    let es = p.dtype.size_bytes();
    let ok = match *cache {
        Cache::Plain(x) => x.len() == rows * p.head_dim * es,
        Cache::Quant { fmt, values, scales, biases } => {
            fmt.head_dim == p.head_dim
                && values.len() == rows * fmt.words()
                && scales.len() == rows * fmt.groups() * es
                && biases.len() == rows * fmt.groups() * es
        }
    };
    if !ok {
        return Err(FlashError::Internal(format!("decode: {name}'s buffers do not hold [B, S_cache, Hkv, D] = {:?}", [p.batch, p.s_cache, p.kv_heads, p.head_dim])));
    }
    Ok(())
}

/// o `[B, Sq, H, D]` (in the call's dtype) and lse `[B, H, Sq]` (f32, natural log) of `q`
/// `[B, Sq, H, D]` against the caches; `seqlens` and `leftpad` `[B]` bound each row's keys (the
/// caller has checked 0 <= leftpad <= seqlen <= S_cache).
#[allow(clippy::too_many_arguments)]
pub fn decode_cpu(p: &Decode, q: &[u8], k: Cache, v: Cache, seqlens: &[i32], leftpad: &[i32], o: &mut [u8], lse: &mut [f32]) -> Result<()> {
    p.check_buffers(q, &k, &v, seqlens, leftpad, o, lse)?;
    let (b_, sq, h, hkv, d) = (p.batch, p.seq_q, p.heads, p.kv_heads, p.head_dim);
    let es = p.dtype.size_bytes();
    let splits = p.splits();
    let group = h / hkv;
    let states = group * sq; // per task: (query head in the group, query row)
    // Partial states per (b, kv head, split): o [states, D] (normalised) and lse [states].
    let tasks = b_ * hkv * splits;
    let mut part_o = vec![0f32; tasks * states * d];
    let mut part_lse = vec![f32::NEG_INFINITY; tasks * states];
    part_o.par_chunks_mut(states * d).zip(part_lse.par_chunks_mut(states)).enumerate().for_each(|(t, (po, pl))| {
        let (b, kv, s) = (t / (hkv * splits), (t / splits) % hkv, t % splits);
        let (lo, hi) = (leftpad[b] as usize, seqlens[b] as usize);
        let n = hi - lo;
        let (k0, k1) = (lo + n * s / splits, lo + n * (s + 1) / splits);
        decode_task(p, q, &k, &v, b, kv, (lo, hi), (k0, k1), po, pl);
    });
    // Merge the splits into o [B, Sq, H, D] and lse [B, H, Sq] (quant::merge_state's rule).
    let lse_ptr = quant::SyncPtr(lse.as_mut_ptr());
    o.par_chunks_mut(h * d * es).enumerate().for_each(|(row, out)| {
        let (b, i) = (row / sq, row % sq);
        let (mut acc, mut part) = (vec![0f32; d], vec![0f32; d]);
        for hh in 0..h {
            let state = (hh % group) * sq + i;
            let at = |s: usize| ((b * hkv + hh / group) * splits + s) * states + state;
            let value = merge_state(splits, |s| part_lse[at(s)], |s, buf| buf.copy_from_slice(&part_o[at(s) * d..][..d]), &mut acc, &mut part);
            p.dtype.store(&acc, out, hh * d);
            // SAFETY: (b, hh, i) is written by the task of row (b, i) only.
            unsafe { *lse_ptr.get().add((b * h + hh) * sq + i) = value };
        }
    });
    Ok(())
}

/// Decode on host memory (layouts as [`decode_cpu`]'s) on `device` (GPU 0 for CUDA: the caches are
/// copied there, which costs more than the CPU's pass over them unless they are reused).
#[allow(clippy::too_many_arguments)]
pub fn decode_host(device: Device, p: &Decode, q: &[u8], k: Cache, v: Cache, seqlens: &[i32], leftpad: &[i32], o: &mut [u8], lse: &mut [f32]) -> Result<()> {
    match device {
        Device::Cpu => decode_cpu(p, q, k, v, seqlens, leftpad, o, lse),
        #[cfg(feature = "cuda")]
        Device::Cuda => crate::cuda::decode_host(p, 0, q, k, v, seqlens, leftpad, o, lse),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(FlashError::CudaUnavailable(crate::device::cuda_unavailable_reason().unwrap_or_default())),
    }
}

/// One task: keys [k0, k1) of batch row b, kv head kv, for the group's query heads and rows.
/// Writes each state's normalised o and its lse (-inf: no visible key in the range).
#[allow(clippy::too_many_arguments)]
fn decode_task(p: &Decode, q: &[u8], k: &Cache, v: &Cache, b: usize, kv: usize, (lo, hi): (usize, usize), (k0, k1): (usize, usize), po: &mut [f32], pl: &mut [f32]) {
    let (sq, h, d) = (p.seq_q, p.heads, p.head_dim);
    let group = h / p.kv_heads;
    let states = group * sq;
    let mut qs = vec![0f32; states * d]; // [g, i, D]
    for g in 0..group {
        for i in 0..sq {
            p.dtype.load(q, ((b * sq + i) * h + kv * group + g) * d, &mut qs[(g * sq + i) * d..][..d]);
        }
    }
    // Row i's visible relative keys: [i + off - left, i + off + right] within [0, n).
    let off = (hi - lo) as i64 - sq as i64;
    let (left, right) = p.window();
    let (mut m, mut l) = (vec![f32::NEG_INFINITY; states], vec![0f32; states]);
    po.fill(0.0);
    let (mut kb, mut vb) = (vec![0f32; KEY_BLOCK * d], vec![0f32; KEY_BLOCK * d]);
    let mut sc = [0f32; KEY_BLOCK];
    let mut j0 = k0;
    while j0 < k1 {
        let nk = (k1 - j0).min(KEY_BLOCK);
        for x in 0..nk {
            load_row(k, p.dtype, p, b, j0 + x, kv, &mut kb[x * d..][..d]);
            load_row(v, p.dtype, p, b, j0 + x, kv, &mut vb[x * d..][..d]);
        }
        for state in 0..states {
            let i = (state % sq) as i64;
            let qrow = &qs[state * d..][..d];
            let mut mx = m[state];
            for x in 0..nk {
                let rel = (j0 + x - lo) as i64;
                let seen = right.is_none_or(|r| rel <= i + off + r as i64) && left.is_none_or(|lf| rel >= i + off - lf as i64);
                sc[x] = if seen {
                    let s = p.scale * dot(qrow, &kb[x * d..][..d]);
                    p.softcap.map_or(s, |c| c * (s / c).tanh())
                } else {
                    f32::NEG_INFINITY
                };
                mx = mx.max(sc[x]);
            }
            if mx == f32::NEG_INFINITY {
                continue;
            }
            let alpha = (m[state] - mx).exp();
            let acc = &mut po[state * d..][..d];
            acc.iter_mut().for_each(|a| *a *= alpha);
            let mut sum = 0f32;
            for x in 0..nk {
                let e = (sc[x] - mx).exp();
                if e != 0.0 {
                    sum += e;
                    acc.iter_mut().zip(&vb[x * d..][..d]).for_each(|(a, v)| *a += e * v);
                }
            }
            l[state] = l[state] * alpha + sum;
            m[state] = mx;
        }
        j0 += nk;
    }
    for state in 0..states {
        if l[state] > 0.0 {
            po[state * d..][..d].iter_mut().for_each(|a| *a /= l[state]);
            pl[state] = m[state] + l[state].ln();
        }
    }
}

/// a . b with 8 independent partial sums (which the compiler vectorises; a single running sum
/// it may not reorder).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut part = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            part[l] += x[l] * y[l];
        }
    }
    part.iter().sum::<f32>() + tail
}
