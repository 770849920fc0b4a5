//! Decode on the CPU: a few new queries (Sq = 1 .. 16) against a KV cache, plain or quantized
//! (quant.rs's format, read and dequantized row by row: no dequantized copy), as reference.py's
//! `decode` defines it. Row b's valid keys are `[leftpad_k[b], cache_seqlens[b])`; causal (and a
//! window) is aligned to their end. One task per (batch row, split of the keys) streams the split's
//! stretch of the cache once (every kv head of a block of keys is one contiguous stretch), each key
//! row read once for every query head of its GQA group and every query row, in SIMD registers
//! (cpu::decode); the splits' partial states are merged by their logsumexp (quant::merge_states'
//! rule). A small call runs on its calling thread (cpu::par).

use crate::cpu::{self, par};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{FlashError, Result};
use crate::problem::{TensorSpec, MAX_HEAD_DIM};
use crate::quant::{self, merge_state, QuantFormat};

/// Most query rows a decode call takes.
pub const MAX_DECODE_ROWS: usize = 16;
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

    /// The relative keys `[r0, r1)` of a row with `n` valid keys that some query row sees
    /// (`window`'s rule for query rows 0 .. Sq); empty as (0, 0).
    pub fn seen(&self, n: usize) -> (usize, usize) {
        let (left, right) = self.window();
        let off = n as i64 - self.seq_q as i64; // query row i's keys end at i + off (+ right)
        let r0 = left.map_or(0, |l| (off - l as i64).clamp(0, n as i64));
        let r1 = right.map_or(n as i64, |r| (self.seq_q as i64 + off + r as i64).clamp(0, n as i64));
        if r1 > r0 {
            (r0 as usize, r1 as usize)
        } else {
            (0, 0)
        }
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
            // Tasks are (batch row, split): a few per thread for balance.
            let want = (4 * rayon::current_num_threads()).div_ceil(self.batch.max(1));
            want.clamp(1, self.s_cache.div_ceil(MIN_KEYS_PER_SPLIT).max(1))
        })
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
    let states = group * sq; // per kv head: (query head in the group, query row)
    // One core's time: every state's products with every key row, K and V.
    let ns = par::attention_ns((b_ * p.s_cache * hkv * states * 2 * d) as f64);
    par::call(ns, || {
        // Partial states per (b, split, kv head): o [states, D] (normalised) and lse [states]; one
        // task per (b, split) takes every kv head (cpu::decode reads the cache as one stream).
        let tasks = b_ * splits;
        let mut part_o = vec![0f32; tasks * hkv * states * d];
        let mut part_lse = vec![f32::NEG_INFINITY; tasks * hkv * states];
        let parts: Vec<_> = part_o.chunks_mut(hkv * states * d).zip(part_lse.chunks_mut(hkv * states)).enumerate().collect();
        par::each(parts, |(t, (po, pl))| {
            let (b, s) = (t / splits, t % splits);
            let (lo, hi) = (leftpad[b] as usize, seqlens[b] as usize);
            // Split the keys some query row sees, not the whole row: a window leaves no split idle.
            let (r0, r1) = p.seen(hi - lo);
            let (k0, k1) = (lo + r0 + (r1 - r0) * s / splits, lo + r0 + (r1 - r0) * (s + 1) / splits);
            cpu::decode::task(p, q, &k, &v, cpu::decode::Task { b, lo, hi, k0, k1 }, po, pl);
        });
        // Merge the splits into o [B, Sq, H, D] and lse [B, H, Sq] (quant::merge_state's rule).
        let lse_ptr = quant::SyncPtr(lse.as_mut_ptr());
        par::chunks_mut(o, h * d * es, |row, out| {
            let (b, i) = (row / sq, row % sq);
            let (mut acc, mut part) = (vec![0f32; d], vec![0f32; d]);
            for hh in 0..h {
                let state = (hh % group) * sq + i;
                let at = |s: usize| ((b * splits + s) * hkv + hh / group) * states + state;
                let value = merge_state(splits, |s| part_lse[at(s)], |s, buf| buf.copy_from_slice(&part_o[at(s) * d..][..d]), &mut acc, &mut part);
                p.dtype.store(&acc, out, hh * d);
                // SAFETY: (b, hh, i) is written by the task of row (b, i) only.
                unsafe { *lse_ptr.get().add((b * h + hh) * sq + i) = value };
            }
        });
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
