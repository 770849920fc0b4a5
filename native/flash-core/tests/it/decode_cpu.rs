//! The CPU decode against a float64 computation written here, on what the Python suite does not
//! sweep: every storage dtype, head dims that are not a multiple of the vector width (plain
//! caches), 4- and 8-bit caches with groups of 32 and 64 in f32 and bf16, K and V in different
//! formats, GQA factors, 1 to 16 query rows, windows, softcap, ragged and empty rows, and forced
//! splits (one key per split included).

use flash_core::decode::{decode_cpu, Cache, Decode};
use flash_core::quant::{dequantize, quantize};
use flash_core::{DType, QuantFormat};

/// A small deterministic generator (xorshift), values in [-2, 2).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    }
    fn bytes(&mut self, dtype: DType, n: usize) -> Vec<u8> {
        let x: Vec<f32> = (0..n).map(|_| self.next()).collect();
        let mut out = vec![0u8; n * dtype.size_bytes()];
        dtype.store(&x, &mut out, 0);
        out
    }
}

fn f64s(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    let mut x = vec![0f32; bytes.len() / dtype.size_bytes()];
    dtype.load(bytes, 0, &mut x);
    x.into_iter().map(f64::from).collect()
}

/// A quantized cache's format, values, scales and biases.
type QuantBufs = (QuantFormat, Vec<u32>, Vec<u8>, Vec<u8>);

/// A cache as decode reads it, and the values the oracle reads (dequantized in f32, unrounded).
struct Stored {
    plain: Vec<u8>,
    quant: Option<QuantBufs>,
    values: Vec<f64>,
}

impl Stored {
    fn new(dtype: DType, x: Vec<u8>, d: usize, quant: Option<(usize, usize)>) -> Stored {
        let Some((bits, gs)) = quant else {
            return Stored { values: f64s(dtype, &x), plain: x, quant: None };
        };
        let fmt = QuantFormat::new(bits, gs, d).unwrap();
        let rows = x.len() / dtype.size_bytes() / d;
        let mut v = vec![0u32; rows * fmt.words()];
        let (mut s, mut b) = (vec![0u8; rows * fmt.groups() * dtype.size_bytes()], vec![0u8; rows * fmt.groups() * dtype.size_bytes()]);
        quantize(dtype, &fmt, &x, &mut v, &mut s, &mut b).unwrap();
        let (mut v2, mut s2, mut b2) = (vec![0u32; v.len()], vec![0u8; s.len()], vec![0u8; b.len()]);
        flash_core::cpu::on_the_pool(|| quantize(dtype, &fmt, &x, &mut v2, &mut s2, &mut b2)).unwrap();
        assert!((&v, &s, &b) == (&v2, &s2, &b2), "quantize on the pool gave other bits");
        // f32 dequantization of the same codes, scales and biases: the oracle's exact input.
        let (sf, bf) = (f64s(dtype, &s), f64s(dtype, &b));
        let (mut s32, mut b32) = (vec![0u8; sf.len() * 4], vec![0u8; bf.len() * 4]);
        DType::F32.store(&sf.iter().map(|&x| x as f32).collect::<Vec<_>>(), &mut s32, 0);
        DType::F32.store(&bf.iter().map(|&x| x as f32).collect::<Vec<_>>(), &mut b32, 0);
        let mut out = vec![0u8; rows * d * 4];
        dequantize(DType::F32, &fmt, &v, &s32, &b32, &mut out).unwrap();
        Stored { values: f64s(DType::F32, &out), plain: Vec::new(), quant: Some((fmt, v, s, b)) }
    }
    fn cache(&self) -> Cache<'_> {
        match &self.quant {
            None => Cache::Plain(&self.plain),
            Some((fmt, v, s, b)) => Cache::Quant { fmt: *fmt, values: v, scales: s, biases: b },
        }
    }
}

/// (o [B, Sq, H, D], lse [B, H, Sq]) in f64.
fn oracle(p: &Decode, q: &[f64], k: &[f64], v: &[f64], seqlens: &[i32], leftpad: &[i32]) -> (Vec<f64>, Vec<f64>) {
    let (b_, sq, h, hkv, d, s_cache) = (p.batch, p.seq_q, p.heads, p.kv_heads, p.head_dim, p.s_cache);
    let (left, right) = p.window();
    let mut o = vec![0f64; b_ * sq * h * d];
    let mut lse = vec![f64::NEG_INFINITY; b_ * h * sq];
    for b in 0..b_ {
        let (lo, hi) = (leftpad[b] as usize, seqlens[b] as usize);
        let off = (hi - lo) as i64 - sq as i64;
        for i in 0..sq {
            for hh in 0..h {
                let kv = hh / (h / hkv);
                let qr = &q[((b * sq + i) * h + hh) * d..][..d];
                let mut scores = Vec::new();
                for j in lo..hi {
                    let rel = (j - lo) as i64;
                    let ii = i as i64;
                    if right.is_some_and(|r| rel > ii + off + r as i64) || left.is_some_and(|l| rel < ii + off - l as i64) {
                        continue;
                    }
                    let kr = &k[((b * s_cache + j) * hkv + kv) * d..][..d];
                    let mut s = p.scale as f64 * qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>();
                    if let Some(c) = p.softcap {
                        s = c as f64 * (s / c as f64).tanh();
                    }
                    scores.push((j, s));
                }
                if scores.is_empty() {
                    continue;
                }
                let m = scores.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|x| (x.1 - m).exp()).sum();
                lse[(b * h + hh) * sq + i] = m + total.ln();
                let out = &mut o[((b * sq + i) * h + hh) * d..][..d];
                for &(j, s) in &scores {
                    let w = (s - m).exp() / total;
                    let vr = &v[((b * s_cache + j) * hkv + kv) * d..][..d];
                    out.iter_mut().zip(vr).for_each(|(a, x)| *a += w * x);
                }
            }
        }
    }
    (o, lse)
}

#[derive(Clone, Copy, Debug)]
struct Case {
    dtype: DType,
    d: usize,
    sq: usize,
    group: usize,
    k_quant: Option<(usize, usize)>,
    v_quant: Option<(usize, usize)>,
    causal: bool,
    window: (Option<usize>, Option<usize>),
    softcap: Option<f32>,
    splits: Option<usize>,
}

fn base(dtype: DType, d: usize) -> Case {
    Case { dtype, d, sq: 1, group: 4, k_quant: None, v_quant: None, causal: true, window: (None, None), softcap: None, splits: None }
}

fn check(c: Case) {
    let (b, s_cache, hkv) = (3, 150, 2);
    let h = hkv * c.group;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (c.d * 131 + c.sq * 7 + c.group) as u64);
    let q = rng.bytes(c.dtype, b * c.sq * h * c.d);
    let k = Stored::new(c.dtype, rng.bytes(c.dtype, b * s_cache * hkv * c.d), c.d, c.k_quant);
    let v = Stored::new(c.dtype, rng.bytes(c.dtype, b * s_cache * hkv * c.d), c.d, c.v_quant);
    let (seqlens, leftpad) = ([150, 61, 7], [0, 5, 7]); // the last row has no key
    let p = Decode {
        dtype: c.dtype,
        batch: b,
        seq_q: c.sq,
        s_cache,
        heads: h,
        kv_heads: hkv,
        head_dim: c.d,
        causal: c.causal,
        scale: 0.7 / (c.d as f32).sqrt(),
        left: c.window.0,
        right: c.window.1,
        softcap: c.softcap,
        num_splits: c.splits,
    };
    let mut o = vec![0u8; q.len()];
    let mut lse = vec![0f32; b * h * c.sq];
    decode_cpu(&p, &q, k.cache(), v.cache(), &seqlens, &leftpad, &mut o, &mut lse).unwrap();
    // A call this small runs on its calling thread (cpu::par): the pool's threads give the same bits.
    let (mut o_pool, mut lse_pool) = (vec![0u8; o.len()], vec![0f32; lse.len()]);
    flash_core::cpu::on_the_pool(|| decode_cpu(&p, &q, k.cache(), v.cache(), &seqlens, &leftpad, &mut o_pool, &mut lse_pool)).unwrap();
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert!(o == o_pool && bits(&lse) == bits(&lse_pool), "{c:?}: the call on the pool gave other bits");
    let (ro, rlse) = oracle(&p, &f64s(c.dtype, &q), &k.values, &v.values, &seqlens, &leftpad);
    let got = f64s(c.dtype, &o);
    let err = got.iter().zip(&ro).map(|(a, b)| (a - b).powi(2)).sum::<f64>().sqrt() / ro.iter().map(|x| x * x).sum::<f64>().sqrt();
    let tol = match c.dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1e-2,
    };
    assert!(err <= tol, "{c:?}: o's relative error {err}");
    for (i, (&g, &w)) in lse.iter().zip(&rlse).enumerate() {
        assert_eq!(g == f32::NEG_INFINITY, w == f64::NEG_INFINITY, "{c:?}: lse[{i}] = {g}, want {w}");
        if w.is_finite() {
            assert!((g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()), "{c:?}: lse[{i}] = {g}, want {w}");
        }
    }
    // The empty row: o = 0.
    let row = c.sq * h * c.d;
    assert!(got[2 * row..].iter().all(|&x| x == 0.0), "{c:?}: the empty row's o");
}

#[test]
fn decode_plain_caches_in_every_dtype_and_odd_head_dims() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for d in [8, 40, 64, 72, 128, 256] {
            check(base(dtype, d));
        }
    }
}

#[test]
fn decode_quantized_caches_in_every_format() {
    for dtype in [DType::F32, DType::BF16] {
        for d in [64, 128] {
            for q in [(4, 32), (4, 64), (8, 32), (8, 64)] {
                check(Case { k_quant: Some(q), v_quant: Some(q), ..base(dtype, d) });
            }
        }
        // K and V in different formats (each row order undone on its own side).
        check(Case { k_quant: Some((4, 32)), v_quant: Some((8, 64)), ..base(dtype, 128) });
        check(Case { k_quant: None, v_quant: Some((4, 64)), ..base(dtype, 128) });
        check(Case { k_quant: Some((8, 32)), v_quant: None, ..base(dtype, 64) });
    }
}

#[test]
fn decode_query_rows_gqa_and_splits() {
    for (sq, group) in [(1, 1), (1, 8), (4, 4), (16, 1), (16, 4), (3, 5)] {
        for splits in [None, Some(1), Some(3), Some(150)] {
            check(Case { sq, group, splits, ..base(DType::F32, 64) });
            check(Case { sq, group, splits, k_quant: Some((4, 64)), v_quant: Some((4, 64)), ..base(DType::F32, 64) });
        }
    }
}

#[test]
fn decode_windows_and_softcap() {
    let windows = [(Some(16), None), (Some(0), None), (Some(40), Some(3)), (None, Some(0)), (Some(100), Some(100))];
    for causal in [true, false] {
        for window in windows {
            for splits in [None, Some(4)] {
                check(Case { sq: 4, causal, window, splits, ..base(DType::F32, 64) });
            }
        }
    }
    check(Case { softcap: Some(2.0), sq: 4, ..base(DType::F32, 72) });
    check(Case { softcap: Some(0.5), window: (Some(10), None), k_quant: Some((8, 64)), ..base(DType::BF16, 128) });
}
