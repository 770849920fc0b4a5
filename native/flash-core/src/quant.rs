//! The KV cache's 4- and 8-bit affine format, bit for bit as reference.py's `quantize_kv` defines
//! it, and merging partial attention states by their logsumexp (the decode issue's building blocks).
//!
//! Each group of `group_size` consecutive head-dim elements x of one cache row (batch row,
//! position, kv head) is stored as codes q in `[0, levels]` (`levels = 2^bits - 1`) with
//! `x ~ scale * q + bias`: `scale = store(f32(max - min) / levels)`, `bias = store(min)`, and
//! `q = rint(f32(x - bias) / scale)` (ties to even, clipped; 0 when scale is 0) from the stored
//! values read back as f32 — float32 arithmetic without fused multiply-adds, so that every
//! implementation gives the same bits. Codes are packed into u32 words from the lowest bits up.
//! Layouts: x `[rows, D]` (rows = B * S * Hkv), values `[rows, D * bits / 32]` u32, scales and
//! biases `[rows, D / group_size]` in x's dtype.

use crate::cpu::par;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{FlashError, Result};
use crate::problem::{TensorSpec, MAX_HEAD_DIM};

/// Code widths the format takes.
pub const QUANT_BITS: [usize; 2] = [4, 8];
/// Group sizes the format takes (elements of the head dim per scale and bias).
pub const QUANT_GROUP_SIZES: [usize; 2] = [32, 64];

/// Rows per rayon task at least: enough bytes per task to amortise scheduling.
const ROWS_PER_TASK: usize = 64;

/// How a cache is quantized, checked against its head dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantFormat {
    pub bits: usize,
    pub group_size: usize,
    pub head_dim: usize,
}

impl QuantFormat {
    pub fn new(bits: usize, group_size: usize, head_dim: usize) -> Result<QuantFormat> {
        if !QUANT_BITS.contains(&bits) {
            return Err(FlashError::Unsupported(format!("bits must be one of {QUANT_BITS:?}; got {bits}")));
        }
        if !QUANT_GROUP_SIZES.contains(&group_size) {
            return Err(FlashError::Unsupported(format!("group_size must be one of {QUANT_GROUP_SIZES:?}; got {group_size}")));
        }
        if head_dim == 0 || head_dim > MAX_HEAD_DIM || !head_dim.is_multiple_of(group_size) {
            return Err(FlashError::Shape(format!(
                "the head dim ({head_dim}) must be a positive multiple of group_size ({group_size}), at most {MAX_HEAD_DIM}"
            )));
        }
        Ok(QuantFormat { bits, group_size, head_dim })
    }

    /// u32 words of one row's codes.
    pub fn words(&self) -> usize {
        self.head_dim * self.bits / 32
    }

    /// Groups (scales, biases) of one row.
    pub fn groups(&self) -> usize {
        self.head_dim / self.group_size
    }

    fn levels(&self) -> f32 {
        ((1u32 << self.bits) - 1) as f32
    }

    /// Checks that buffers of these lengths hold `rows` rows: x (or the dequantized output) in
    /// `dtype` bytes, values in words, scales and biases in `dtype` bytes.
    pub(crate) fn check(&self, dtype: DType, rows: usize, x_bytes: usize, words: usize, scale_bytes: usize, bias_bytes: usize) -> Result<()> {
        let es = dtype.size_bytes();
        let want = [
            ("x", x_bytes, rows * self.head_dim * es),
            ("values", words, rows * self.words()),
            ("scales", scale_bytes, rows * self.groups() * es),
            ("biases", bias_bytes, rows * self.groups() * es),
        ];
        for (name, got, need) in want {
            if got != need {
                return Err(FlashError::Internal(format!("{name}: {got} elements or bytes, expected {need} for {rows} rows")));
            }
        }
        Ok(())
    }
}

/// A quantized cache's parts as a binding describes them, checked against each other and the
/// format: values u32 `[B, S, Hkv, D * bits / 32]`, scales and biases `[B, S, Hkv, D / group_size]`
/// in one float dtype. Returns (that dtype, the format, the cache's shape `[B, S, Hkv, D]`).
pub fn check_parts(values: &TensorSpec, scales: &TensorSpec, biases: &TensorSpec, bits: usize, group_size: usize) -> Result<(DType, QuantFormat, [usize; 4])> {
    if values.dtype != "uint32" {
        return Err(FlashError::DType(format!("{} must be uint32; got {}", values.name, values.dtype)));
    }
    let dtype = DType::parse(scales.dtype, scales.name)?;
    if biases.dtype != scales.dtype {
        return Err(FlashError::DType(format!("{} ({}) and {} ({}) must have one dtype", scales.name, scales.dtype, biases.name, biases.dtype)));
    }
    let [b, s, h, words] = rank4(values)?;
    if !QUANT_BITS.contains(&bits) {
        return Err(FlashError::Unsupported(format!("bits must be one of {QUANT_BITS:?}; got {bits}")));
    }
    let fmt = QuantFormat::new(bits, group_size, words * 32 / bits)?;
    for part in [scales, biases] {
        if part.shape != [b, s, h, fmt.groups()] {
            return Err(FlashError::Shape(format!(
                "{} must be [B, S, Hkv, D / group_size] = {:?} for {} {:?} ({bits} bits, D = {}); got {:?}",
                part.name, [b, s, h, fmt.groups()], values.name, values.shape, fmt.head_dim, part.shape
            )));
        }
    }
    Ok((dtype, fmt, [b, s, h, fmt.head_dim]))
}

/// A cache tensor to quantize, `[B, S, Hkv, D]` in float32 / float16 / bfloat16, and its format.
pub fn check_cache(x: &TensorSpec, bits: usize, group_size: usize) -> Result<(DType, QuantFormat, [usize; 4])> {
    let dtype = DType::parse(x.dtype, x.name)?;
    let shape = rank4(x)?;
    Ok((dtype, QuantFormat::new(bits, group_size, shape[3])?, shape))
}

/// Partial attention states to merge: `o_parts [P, B, Sq, H, Dv]` (float) and `lse_parts
/// [P, B, H, Sq]` float32. Returns (o's dtype, [P, B, Sq, H, Dv]).
pub fn check_states(o_parts: &TensorSpec, lse_parts: &TensorSpec) -> Result<(DType, [usize; 5])> {
    let dtype = DType::parse(o_parts.dtype, o_parts.name)?;
    if lse_parts.dtype != "float32" {
        return Err(FlashError::DType(format!("{} must be float32; got {}", lse_parts.name, lse_parts.dtype)));
    }
    let Ok([p, b, sq, h, dv]) = <[usize; 5]>::try_from(o_parts.shape) else {
        return Err(FlashError::Shape(format!("{} must be [P, B, Sq, H, Dv]; got {:?}", o_parts.name, o_parts.shape)));
    };
    if lse_parts.shape != [p, b, h, sq] {
        return Err(FlashError::Shape(format!(
            "{} must be [P, B, H, Sq] = {:?} for {} {:?}; got {:?}",
            lse_parts.name, [p, b, h, sq], o_parts.name, o_parts.shape, lse_parts.shape
        )));
    }
    Ok((dtype, [p, b, sq, h, dv]))
}

fn rank4(x: &TensorSpec) -> Result<[usize; 4]> {
    <[usize; 4]>::try_from(x.shape).map_err(|_| FlashError::Shape(format!("{} must be [B, S, Hkv, D]; got {:?}", x.name, x.shape)))
}

/// Quantizes `x` (rows of the format's head dim in `dtype`) into `values`, `scales` and `biases`.
pub fn quantize(dtype: DType, fmt: &QuantFormat, x: &[u8], values: &mut [u32], scales: &mut [u8], biases: &mut [u8]) -> Result<()> {
    let es = dtype.size_bytes();
    let rows = x.len() / (fmt.head_dim * es).max(1);
    fmt.check(dtype, rows, x.len(), values.len(), scales.len(), biases.len())?;
    let (xr, wr, gr) = (fmt.head_dim * es, fmt.words(), fmt.groups() * es);
    let chunk = ROWS_PER_TASK;
    let tasks: Vec<_> = x.chunks(xr * chunk).zip(values.chunks_mut(wr * chunk)).zip(scales.chunks_mut(gr * chunk)).zip(biases.chunks_mut(gr * chunk)).collect();
    par::call(par::pass_ns(x.len() as f64), || {
        par::each(tasks, |(((x, v), s), b)| {
            for r in 0..x.len() / xr {
                quantize_row(dtype, fmt, &x[r * xr..(r + 1) * xr], &mut v[r * wr..(r + 1) * wr], &mut s[r * gr..(r + 1) * gr], &mut b[r * gr..(r + 1) * gr]);
            }
        })
    });
    Ok(())
}

fn quantize_row(dtype: DType, fmt: &QuantFormat, x: &[u8], words: &mut [u32], scales: &mut [u8], biases: &mut [u8]) {
    let (d, gs, bits) = (fmt.head_dim, fmt.group_size, fmt.bits);
    let mut xs = [0f32; MAX_HEAD_DIM];
    dtype.load(x, 0, &mut xs[..d]);
    words.fill(0);
    let per_word = 32 / bits;
    for g in 0..fmt.groups() {
        let group = &xs[g * gs..(g + 1) * gs];
        let lo = group.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = group.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Store, then read back: the codes come from the stored (rounded) scale and bias.
        let mut stored = [0f32; 1];
        dtype.store(&[(hi - lo) / fmt.levels()], scales, g);
        dtype.load(scales, g, &mut stored);
        let scale = stored[0];
        dtype.store(&[lo], biases, g);
        dtype.load(biases, g, &mut stored);
        let bias = stored[0];
        for (e, &x) in group.iter().enumerate() {
            let q = if scale > 0.0 { ((x - bias) / scale).round_ties_even().clamp(0.0, fmt.levels()) as u32 } else { 0 };
            let i = g * gs + e;
            words[i / per_word] |= q << ((i % per_word) * bits);
        }
    }
}

/// Dequantizes `values`, `scales` and `biases` into `out` (rows of the head dim in `dtype`):
/// `scale * q + bias` in f32, rounded to `dtype`.
pub fn dequantize(dtype: DType, fmt: &QuantFormat, values: &[u32], scales: &[u8], biases: &[u8], out: &mut [u8]) -> Result<()> {
    let es = dtype.size_bytes();
    let rows = values.len() / fmt.words();
    fmt.check(dtype, rows, out.len(), values.len(), scales.len(), biases.len())?;
    let (xr, wr, gr) = (fmt.head_dim * es, fmt.words(), fmt.groups() * es);
    let chunk = ROWS_PER_TASK;
    let ns = par::pass_ns(out.len() as f64); // before out is lent to the tasks
    let tasks: Vec<_> = out.chunks_mut(xr * chunk).zip(values.chunks(wr * chunk)).zip(scales.chunks(gr * chunk)).zip(biases.chunks(gr * chunk)).collect();
    par::call(ns, || {
        par::each(tasks, |(((o, v), s), b)| {
            for r in 0..o.len() / xr {
                dequantize_row(dtype, fmt, &v[r * wr..(r + 1) * wr], &s[r * gr..(r + 1) * gr], &b[r * gr..(r + 1) * gr], &mut o[r * xr..(r + 1) * xr]);
            }
        })
    });
    Ok(())
}

fn dequantize_row(dtype: DType, fmt: &QuantFormat, words: &[u32], scales: &[u8], biases: &[u8], out: &mut [u8]) {
    let mut xs = [0f32; MAX_HEAD_DIM];
    unpack_row(dtype, fmt, words, scales, biases, &mut xs[..fmt.head_dim]);
    dtype.store(&xs[..fmt.head_dim], out, 0);
}

/// One row's values in f32, `scale * q + bias`: its words, and its scales and biases (`dtype`
/// bytes).
pub(crate) fn unpack_row(dtype: DType, fmt: &QuantFormat, words: &[u32], scales: &[u8], biases: &[u8], out: &mut [f32]) {
    let mut sc = [0f32; MAX_HEAD_DIM / 32];
    let mut bi = [0f32; MAX_HEAD_DIM / 32];
    dtype.load(scales, 0, &mut sc[..fmt.groups()]);
    dtype.load(biases, 0, &mut bi[..fmt.groups()]);
    match fmt.bits {
        4 => unpack::<4>(words, &sc, &bi, fmt.group_size, out),
        _ => unpack::<8>(words, &sc, &bi, fmt.group_size, out),
    }
}

// Compile-time widths: the shifts and the word walk unroll (no division per element).
fn unpack<const BITS: usize>(words: &[u32], sc: &[f32], bi: &[f32], group_size: usize, out: &mut [f32]) {
    let (per_word, mask) = (32 / BITS, (1u32 << BITS) - 1);
    for (g, group) in out.chunks_exact_mut(group_size).enumerate() {
        let (s, b) = (sc[g], bi[g]);
        let w0 = g * group_size / per_word;
        for (w, xs) in words[w0..w0 + group_size / per_word].iter().zip(group.chunks_exact_mut(per_word)) {
            for (e, x) in xs.iter_mut().enumerate() {
                *x = s * ((w >> (e * BITS)) & mask) as f32 + b;
            }
        }
    }
}

/// Attention over the union of disjoint key sets from each set's state: `o_parts [P, rows, H, Dv]`
/// (in `dtype`) and `lse_parts [P, B, H, Sq]` (f32, natural log) -> `o [rows, H, Dv]` and
/// `lse [B, H, Sq]` with rows = B * Sq: `lse = log(sum_p exp(lse_p))`, `o = sum_p exp(lse_p - lse)
/// o_p` (f32). Parts whose lse is -inf weigh nothing; a row no part saw gives o = 0, lse = -inf.
#[allow(clippy::too_many_arguments)]
pub fn merge_states(dtype: DType, parts: usize, batch: usize, seq_q: usize, heads: usize, dv: usize, o_parts: &[u8], lse_parts: &[f32], o: &mut [u8], lse: &mut [f32]) -> Result<()> {
    check_merge(dtype, parts, batch, seq_q, heads, dv, o_parts.len(), lse_parts.len(), o.len(), lse.len())?;
    let (states, row_bytes) = (batch * heads * seq_q, heads * dv * dtype.size_bytes());
    // One task per (b, i) query row: its H heads' lse are strided by Sq in [B, H, Sq].
    let lse_ptr = SyncPtr(lse.as_mut_ptr());
    par::call(par::pass_ns(o_parts.len() as f64), || par::chunks_mut(o, row_bytes.max(1), |row, out| {
        let (b, i) = (row / seq_q.max(1), row % seq_q.max(1));
        let mut acc = vec![0f32; dv];
        let mut part = vec![0f32; dv];
        for h in 0..heads {
            let state = (b * heads + h) * seq_q + i;
            let value = merge_state(parts, |p| lse_parts[p * states + state], |p, buf| dtype.load(o_parts, ((p * batch * seq_q + row) * heads + h) * dv, buf), &mut acc, &mut part);
            dtype.store(&acc, out, h * dv);
            // SAFETY: state = (b, h, i) is written by the task of row (b, i) only.
            unsafe { *lse_ptr.get().add(state) = value };
        }
    }));
    Ok(())
}

/// One state's merge, merge_states' rule: `lse_of(p)` is its lse in part p and `load(p, buf)` its o
/// there (each read only for parts that weigh something); `acc` receives the merged o (0 when no
/// part saw the state), `part` is scratch of acc's length. Returns the merged lse.
pub(crate) fn merge_state(parts: usize, lse_of: impl Fn(usize) -> f32, mut load: impl FnMut(usize, &mut [f32]), acc: &mut [f32], part: &mut [f32]) -> f32 {
    let m = (0..parts).map(&lse_of).fold(f32::NEG_INFINITY, f32::max);
    acc.fill(0.0);
    if !m.is_finite() {
        return f32::NEG_INFINITY;
    }
    let mut total = 0f32;
    for p in 0..parts {
        let w = (lse_of(p) - m).exp();
        if w == 0.0 {
            continue;
        }
        total += w;
        load(p, part);
        acc.iter_mut().zip(part.iter()).for_each(|(a, x)| *a += w * x);
    }
    acc.iter_mut().for_each(|a| *a /= total);
    m + total.ln()
}

/// The buffer lengths of a merge: o_parts and o in `dtype` bytes, lse_parts and lse in f32.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_merge(dtype: DType, parts: usize, batch: usize, seq_q: usize, heads: usize, dv: usize, o_parts: usize, lse_parts: usize, o: usize, lse: usize) -> Result<()> {
    let (states, row_bytes) = (batch * heads * seq_q, heads * dv * dtype.size_bytes());
    let want = [
        ("o_parts", o_parts, parts * batch * seq_q * row_bytes),
        ("lse_parts", lse_parts, parts * states),
        ("o", o, batch * seq_q * row_bytes),
        ("lse", lse, states),
    ];
    for (name, got, need) in want {
        if got != need {
            return Err(FlashError::Internal(format!("merge_states: {name} holds {got}, expected {need}")));
        }
    }
    Ok(())
}

/// [`quantize`] on `device` (GPU 0 for CUDA: copied in, converted, copied out).
pub fn quantize_host(device: Device, dtype: DType, fmt: &QuantFormat, x: &[u8], values: &mut [u32], scales: &mut [u8], biases: &mut [u8]) -> Result<()> {
    match device {
        Device::Cpu => quantize(dtype, fmt, x, values, scales, biases),
        #[cfg(feature = "cuda")]
        Device::Cuda => crate::cuda::quantize_host(0, dtype, fmt, x, values, scales, biases),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(no_cuda()),
    }
}

/// [`dequantize`] on `device`.
pub fn dequantize_host(device: Device, dtype: DType, fmt: &QuantFormat, values: &[u32], scales: &[u8], biases: &[u8], out: &mut [u8]) -> Result<()> {
    match device {
        Device::Cpu => dequantize(dtype, fmt, values, scales, biases, out),
        #[cfg(feature = "cuda")]
        Device::Cuda => crate::cuda::dequantize_host(0, dtype, fmt, values, scales, biases, out),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(no_cuda()),
    }
}

/// [`merge_states`] on `device`.
#[allow(clippy::too_many_arguments)]
pub fn merge_states_host(
    device: Device, dtype: DType, parts: usize, batch: usize, seq_q: usize, heads: usize, dv: usize, o_parts: &[u8], lse_parts: &[f32], o: &mut [u8],
    lse: &mut [f32],
) -> Result<()> {
    match device {
        Device::Cpu => merge_states(dtype, parts, batch, seq_q, heads, dv, o_parts, lse_parts, o, lse),
        #[cfg(feature = "cuda")]
        Device::Cuda => crate::cuda::merge_states_host(0, dtype, [parts, batch, seq_q, heads, dv], o_parts, lse_parts, o, lse),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(no_cuda()),
    }
}

#[cfg(not(feature = "cuda"))]
fn no_cuda() -> FlashError {
    FlashError::CudaUnavailable(crate::device::cuda_unavailable_reason().unwrap_or_default())
}

/// A raw pointer the row tasks share, each writing its own elements.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(pub(crate) *mut f32);
// SAFETY: the tasks write disjoint elements (see merge_states).
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(x: &[f32]) -> Vec<u8> {
        x.iter().flat_map(|v| v.to_ne_bytes()).collect()
    }

    fn f32_of(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    #[test]
    fn codes_pack_from_the_lowest_bits() {
        for (bits, word) in [(4usize, 0x7654_3210u32), (8, 0x0302_0100)] {
            let levels = (1usize << bits) - 1;
            let mut x: Vec<f32> = (0..32).map(|i| (i % (levels + 1)) as f32).collect();
            x[31] = levels as f32; // min 0, max levels: scale 1, codes = x
            let fmt = QuantFormat::new(bits, 32, 32).unwrap();
            let (mut v, mut s, mut b) = (vec![0u32; fmt.words()], vec![0u8; 4], vec![0u8; 4]);
            quantize(DType::F32, &fmt, &f32_bytes(&x), &mut v, &mut s, &mut b).unwrap();
            assert_eq!((v[0], f32_of(&s)[0], f32_of(&b)[0]), (word, 1.0, 0.0));
            let mut out = vec![0u8; 32 * 4];
            dequantize(DType::F32, &fmt, &v, &s, &b, &mut out).unwrap();
            assert_eq!(f32_of(&out), x);
        }
    }

    #[test]
    fn round_trip_within_half_a_step_and_constant_groups_exact() {
        let (rows, d) = (300, 128);
        let mut x: Vec<f32> = (0..rows * d).map(|i| ((i * 2654435761usize) % 1000) as f32 / 97.0 - 5.0).collect();
        x[..64].fill(0.37); // a constant group
        for (bits, gs) in [(4, 32), (4, 64), (8, 32), (8, 64)] {
            let fmt = QuantFormat::new(bits, gs, d).unwrap();
            let mut v = vec![0u32; rows * fmt.words()];
            let (mut s, mut b) = (vec![0u8; rows * fmt.groups() * 4], vec![0u8; rows * fmt.groups() * 4]);
            quantize(DType::F32, &fmt, &f32_bytes(&x), &mut v, &mut s, &mut b).unwrap();
            let mut out = vec![0u8; rows * d * 4];
            dequantize(DType::F32, &fmt, &v, &s, &b, &mut out).unwrap();
            let (y, sc) = (f32_of(&out), f32_of(&s));
            for i in 0..rows * d {
                let step = sc[i / gs];
                assert!((y[i] - x[i]).abs() <= 0.5 * step * (1.0 + 1e-5) + 1e-6, "bits {bits} gs {gs} i {i}");
            }
            assert!(y[..64].iter().all(|&v| v == 0.37f32));
        }
    }

    #[test]
    fn bad_formats_are_errors() {
        assert!(QuantFormat::new(3, 32, 64).is_err());
        assert!(QuantFormat::new(4, 48, 96).is_err());
        assert!(QuantFormat::new(4, 64, 96).is_err());
        assert!(QuantFormat::new(8, 32, 512).is_err());
        let fmt = QuantFormat::new(4, 32, 64).unwrap();
        assert!(quantize(DType::F32, &fmt, &[0u8; 64 * 4], &mut [0u32; 7], &mut [0u8; 8], &mut [0u8; 8]).is_err());
    }

    #[test]
    fn merged_states_weigh_parts_by_their_lse() {
        // Two parts, one (b, i) row, two heads, Dv = 2: head 0 seen by both, head 1 by neither.
        let o_parts = f32_bytes(&[1.0, 2.0, 9.0, 9.0, /* part 1 */ 3.0, 4.0, 9.0, 9.0]);
        // lse_parts [P, B, H, Sq]: part 0 saw nothing, part 1 saw head 0.
        let lse_parts = [f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY];
        let (mut o, mut lse) = (vec![0u8; 4 * 4], vec![0f32; 2]);
        merge_states(DType::F32, 2, 1, 1, 2, 2, &o_parts, &lse_parts, &mut o, &mut lse).unwrap();
        assert_eq!(f32_of(&o), vec![3.0, 4.0, 0.0, 0.0]);
        assert_eq!((lse[0], lse[1]), (0.0, f32::NEG_INFINITY));
        let lse_parts = [2.0f32.ln(), f32::NEG_INFINITY, 2.0f32.ln(), f32::NEG_INFINITY];
        merge_states(DType::F32, 2, 1, 1, 2, 2, &o_parts, &lse_parts, &mut o, &mut lse).unwrap();
        assert_eq!(f32_of(&o)[..2], [2.0, 3.0]);
        assert!((lse[0] - 4.0f32.ln()).abs() < 1e-6);
    }
}
