//! `quantize_kv/3`, `dequantize_kv/3`, `merge_states/2` and `decode/5`: the KV-cache functions of
//! `ExPhil.Native.FlashAttention` (its `KV` module). The core's `quant` and `decode` modules
//! validate and compute; this decodes terms, checks that each binary holds its shape (NumPy
//! guarantees it in Python, a binary does not), and maps errors.
//!
//! A cache argument is a tensor (see [`crate::tensor`]) or
//! `{:quantized, values, scales, biases, bits, group_size}`.

use std::borrow::Cow;

use crate::args::{atom_field, field};
use crate::reply::{guard, Reason};
use crate::tensor::{HostTensor, IndexTensor, Output};
use crate::words::{with_words_mut, words};
use flash_core::decode::{self, Cache, Decode};
use flash_core::{quant, DType, Device, FlashError, QuantFormat};
use rustler::{Atom, Env, Term};

rustler::atoms! {
    quantized,
    causal,
    scale,
    window,
    softcap,
    num_splits,
    device,
    cache_seqlens,
    leftpad_k,
}

/// A non-negative integer argument (the wrapper checks the type; the core checks the value).
fn size(term: Term, name: &str) -> Result<usize, Reason> {
    term.decode().map_err(|_| Reason::argument(format!("{name} must be a non-negative integer")))
}

/// A quantized cache's parts, checked against each other and their format.
struct QuantCache<'a> {
    values: Cow<'a, [u32]>, // [B, S, Hkv, D * bits / 32]
    scales: HostTensor<'a>, // [B, S, Hkv, D / group_size]
    biases: HostTensor<'a>, // same
    fmt: QuantFormat,
    dtype: DType,
    shape: [usize; 4], // the cache's [B, S, Hkv, D]
}

impl<'a> QuantCache<'a> {
    fn decode(parts: [Term<'a>; 3], bits: Term, group_size: Term, names: [&'static str; 3]) -> Result<QuantCache<'a>, Reason> {
        let [v, s, b] = [0, 1, 2].map(|i| HostTensor::decode(parts[i], names[i]));
        let (v, s, b) = (v?, s?, b?);
        let (bits, group_size) = (size(bits, "bits")?, size(group_size, "group_size")?);
        let (dtype, fmt, shape) = quant::check_parts(&v.spec(), &s.spec(), &b.spec(), bits, group_size)?;
        v.check_nbytes(4)?;
        s.check_nbytes(dtype.size_bytes())?;
        b.check_nbytes(dtype.size_bytes())?;
        Ok(QuantCache { values: words(v.bytes()), scales: s, biases: b, fmt, dtype, shape })
    }
}

/// `quantize_kv(x, bits, group_size)` → `{:ok, values, scales, biases}` for x `[B, S, Hkv, D]`:
/// values uint32 `[B, S, Hkv, D * bits / 32]`, scales and biases `[B, S, Hkv, D / group_size]` in
/// x's dtype.
#[rustler::nif(schedule = "DirtyCpu")]
fn quantize_kv<'a>(env: Env<'a>, x: Term<'a>, bits: Term<'a>, group_size: Term<'a>) -> Term<'a> {
    guard(env, || {
        let x = HostTensor::decode(x, "x")?;
        let (bits, group_size) = (size(bits, "bits")?, size(group_size, "group_size")?);
        let (dtype, fmt, [b, s, h, _]) = quant::check_cache(&x.spec(), bits, group_size)?;
        x.check_nbytes(dtype.size_bytes())?;
        let mut values = Output::alloc_elems("values", &[b, s, h, fmt.words()], 4)?;
        let mut scales = Output::alloc("scales", &[b, s, h, fmt.groups()], dtype)?;
        let mut biases = Output::alloc("biases", &[b, s, h, fmt.groups()], dtype)?;
        let (sb, bb) = (scales.bytes_mut(), biases.bytes_mut());
        with_words_mut(values.bytes_mut(), |w| quant::quantize(dtype, &fmt, x.bytes(), w, sb, bb))?;
        Ok(vec![values.encode(env), scales.encode(env), biases.encode(env)])
    })
}

/// `dequantize_kv([values, scales, biases], bits, group_size)` → `{:ok, x}`, x `[B, S, Hkv, D]`
/// in the scales' dtype.
#[rustler::nif(schedule = "DirtyCpu")]
fn dequantize_kv<'a>(env: Env<'a>, parts: Term<'a>, bits: Term<'a>, group_size: Term<'a>) -> Term<'a> {
    guard(env, || {
        let names = ["values", "scales", "biases"];
        let c = QuantCache::decode(crate::tensors(parts, names)?, bits, group_size, names)?;
        let mut out = Output::alloc("x", &c.shape, c.dtype)?;
        quant::dequantize(c.dtype, &c.fmt, &c.values, c.scales.bytes(), c.biases.bytes(), out.bytes_mut())?;
        Ok(vec![out.encode(env)])
    })
}

/// `merge_states(o_parts, lse_parts)` → `{:ok, o, lse}`: o_parts `[P, B, Sq, H, Dv]` (float),
/// lse_parts `[P, B, H, Sq]` float32; o `[B, Sq, H, Dv]` in o_parts' dtype, lse `[B, H, Sq]`.
#[rustler::nif(schedule = "DirtyCpu")]
fn merge_states<'a>(env: Env<'a>, o_parts: Term<'a>, lse_parts: Term<'a>) -> Term<'a> {
    guard(env, || {
        let (op, lp) = (HostTensor::decode(o_parts, "o_parts")?, HostTensor::decode(lse_parts, "lse_parts")?);
        let (dtype, [p, b, sq, h, dv]) = quant::check_states(&op.spec(), &lp.spec())?;
        op.check_nbytes(dtype.size_bytes())?;
        lp.check_nbytes(4)?;
        let mut o = Output::alloc("o", &[b, sq, h, dv], dtype)?;
        let mut lse = Output::alloc("lse", &[b, h, sq], DType::F32)?;
        let (lp, ob) = (words::<f32>(lp.bytes()), o.bytes_mut());
        with_words_mut(lse.bytes_mut(), |l| quant::merge_states(dtype, p, b, sq, h, dv, op.bytes(), &lp, ob, l))?;
        Ok(vec![o.encode(env), lse.encode(env)])
    })
}

/// A decode cache argument, plain (in q's dtype) or quantized.
enum CacheArg<'a> {
    Plain(HostTensor<'a>, DType, [usize; 4]),
    Quant(QuantCache<'a>),
}

impl<'a> CacheArg<'a> {
    fn decode(term: Term<'a>, name: &'static str, parts: [&'static str; 3]) -> Result<CacheArg<'a>, Reason> {
        if let Ok((tag, v, s, b, bits, group_size)) = term.decode::<(Atom, Term, Term, Term, Term, Term)>() {
            if tag == quantized() {
                return Ok(CacheArg::Quant(QuantCache::decode([v, s, b], bits, group_size, parts)?));
            }
        }
        let x = HostTensor::decode(term, name)?;
        let spec = x.spec();
        let dtype = DType::parse(spec.dtype, name)?;
        let shape = <[usize; 4]>::try_from(spec.shape)
            .map_err(|_| FlashError::Shape(format!("{name} must be [B, S_cache, Hkv, D]; got {:?}", spec.shape)))?;
        x.check_nbytes(dtype.size_bytes())?;
        Ok(CacheArg::Plain(x, dtype, shape))
    }

    /// (dtype, `[B, S_cache, Hkv, D]`), as `Decode::new` takes them.
    fn described(&self) -> (DType, [usize; 4]) {
        match self {
            CacheArg::Plain(_, dtype, shape) => (*dtype, *shape),
            CacheArg::Quant(c) => (c.dtype, c.shape),
        }
    }

    fn cache(&self) -> Cache<'_> {
        match self {
            CacheArg::Plain(x, _, _) => Cache::Plain(x.bytes()),
            CacheArg::Quant(c) => Cache::Quant { fmt: c.fmt, values: &c.values, scales: c.scales.bytes(), biases: c.biases.bytes() },
        }
    }
}

/// `%{causal: boolean, scale: nil | float, window: {nil | integer, nil | integer}, softcap: nil |
/// float, num_splits: nil | integer, device: atom}`, every key present.
struct DecodeOptions {
    causal: bool,
    scale: Option<f32>,
    window: (Option<usize>, Option<usize>),
    softcap: Option<f32>,
    num_splits: Option<usize>,
    device: Device,
}

impl DecodeOptions {
    fn decode(map: Term) -> Result<DecodeOptions, Reason> {
        let scale: Option<f64> = field(map, scale(), "scale", "nil or a float")?;
        let softcap: Option<f64> = field(map, softcap(), "softcap", "nil or a float")?;
        Ok(DecodeOptions {
            causal: field(map, causal(), "causal", "a boolean")?,
            scale: scale.map(|s| s as f32),
            window: field(map, window(), "window", "{nil | non_neg_integer, nil | non_neg_integer}")?,
            softcap: softcap.map(|c| c as f32),
            num_splits: field(map, num_splits(), "num_splits", "nil or a non-negative integer")?,
            device: Device::parse(&atom_field(map, device(), "device")?)?,
        })
    }
}

/// Row lengths or offsets: int32 `[B]` (`name` in `lengths`), or `default` for every row.
fn lengths(map: Term, key: Atom, name: &'static str, batch: usize, default: i32) -> Result<Vec<i32>, Reason> {
    let Ok(term) = map.map_get(key) else { return Ok(vec![default; batch]) };
    let t = IndexTensor::decode(term, name)?;
    let spec = t.arg().spec;
    if spec.dtype != "int32" {
        return Err(FlashError::DType(format!("{name} has dtype {}; it must be int32", spec.dtype)).into());
    }
    if spec.shape != [batch] {
        return Err(FlashError::Shape(format!("{name} has shape {:?}; expected [B] = [{batch}]", spec.shape)).into());
    }
    if t.bytes().len() != 4 * batch {
        return Err(FlashError::Shape(format!("{name} has shape [{batch}], which needs {} bytes, but its buffer holds {} bytes", 4 * batch, t.bytes().len())).into());
    }
    Ok(t.arg().values.to_vec())
}

/// The backend is the core's: the CPU, or GPU 0 through host copies (a missing GPU is an error).
#[allow(clippy::too_many_arguments)]
fn run(device: Device, p: &Decode, q: &[u8], k: Cache, v: Cache, seqlens: &[i32], leftpad: &[i32], o: &mut [u8], lse: &mut [f32]) -> Result<(), FlashError> {
    decode::decode_host(device, p, q, k, v, seqlens, leftpad, o, lse)
}

/// `decode(q, k_cache, v_cache, lengths, options)` → `{:ok, o, lse}` for q `[B, Sq, H, D]` and
/// caches `[B, S_cache, Hkv, D]`; lengths `%{cache_seqlens: t, leftpad_k: t}` (int32 `[B]`, each
/// optional: S_cache and 0), options as [`DecodeOptions`]. o is `[B, Sq, H, D]` in q's dtype, lse
/// `[B, H, Sq]` float32.
#[rustler::nif(schedule = "DirtyCpu")]
fn decode<'a>(env: Env<'a>, q: Term<'a>, k_cache: Term<'a>, v_cache: Term<'a>, lens: Term<'a>, opts: Term<'a>) -> Term<'a> {
    guard(env, || {
        let o = DecodeOptions::decode(opts)?;
        let q = HostTensor::decode(q, "q")?;
        let k = CacheArg::decode(k_cache, "k_cache", ["k_cache.values", "k_cache.scales", "k_cache.biases"])?;
        let v = CacheArg::decode(v_cache, "v_cache", ["v_cache.values", "v_cache.scales", "v_cache.biases"])?;
        let p = Decode::new(&q.spec(), k.described(), v.described(), o.causal, o.scale, o.window, o.softcap, o.num_splits)?;
        q.check_nbytes(p.dtype.size_bytes())?;
        if !lens.is_map() {
            return Err(Reason::argument("lengths must be a map".into()));
        }
        let s_cache = i32::try_from(p.s_cache).map_err(|_| FlashError::Shape(format!("S_cache = {} does not fit int32", p.s_cache)))?;
        let seqlens = lengths(lens, cache_seqlens(), "cache_seqlens", p.batch, s_cache)?;
        let leftpad = lengths(lens, leftpad_k(), "leftpad_k", p.batch, 0)?;
        let mut out = Output::alloc("o", &[p.batch, p.seq_q, p.heads, p.head_dim], p.dtype)?;
        let mut lse = Output::alloc("lse", &[p.batch, p.heads, p.seq_q], DType::F32)?;
        let ob = out.bytes_mut();
        with_words_mut(lse.bytes_mut(), |l| run(o.device, &p, q.bytes(), k.cache(), v.cache(), &seqlens, &leftpad, ob, l))?;
        Ok(vec![out.encode(env), lse.encode(env)])
    })
}
