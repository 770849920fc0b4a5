//! Shared test helpers: random inputs, byte conversion and a float64 reference.

#![allow(dead_code)]

use flash_core::{DType, Dims, Options, Problem, TensorSpec};

/// Deterministic pseudo-random normals (xorshift + Box-Muller); never all zeros.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn normals(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let (u, v) = (self.uniform(), self.uniform());
                ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
            })
            .collect()
    }
}

/// Values rounded to `dtype`, as bytes and as the f32 values those bytes hold.
pub fn encode(dtype: DType, values: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = vec![0u8; values.len() * dtype.size_bytes()];
    dtype.store(values, &mut bytes, 0);
    (bytes.clone(), decode(dtype, &bytes))
}

pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0.0f32; bytes.len() / dtype.size_bytes()];
    dtype.load(bytes, 0, &mut out);
    out
}

/// Relative norm error ||got - want|| / ||want|| over entries where want is finite.
pub fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        if w.is_finite() {
            num += (g as f64 - w).powi(2);
            den += w * w;
        }
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

pub struct Reference {
    pub o: Vec<f64>,
    pub lse: Vec<f64>,
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

/// Materialised float64 attention forward and backward (the oracle for the core's own tests).
pub fn reference(p: &Problem, q: &[f32], k: &[f32], v: &[f32], d_out: &[f32]) -> Reference {
    let Dims { batch, seq_q, seq_k, heads, kv_heads, head_dim: d } = p.dims;
    let g = heads / kv_heads;
    let qi = |b: usize, i: usize, h: usize, x: usize| ((b * seq_q + i) * heads + h) * d + x;
    let ki = |b: usize, j: usize, h: usize, x: usize| ((b * seq_k + j) * kv_heads + h / g) * d + x;
    let (mut o, mut lse) = (vec![0.0; q.len()], vec![f64::NEG_INFINITY; batch * heads * seq_q]);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; k.len()]);
    let scale = p.scale as f64;
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..seq_q {
                let visible = p.keys_visible(i);
                if visible == 0 {
                    continue;
                }
                let s: Vec<f64> = (0..visible)
                    .map(|j| (0..d).map(|x| q[qi(b, i, h, x)] as f64 * k[ki(b, j, h, x)] as f64).sum::<f64>() * scale)
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
                let pr: Vec<f64> = s.iter().map(|x| (x - m).exp() / l).collect();
                lse[(b * heads + h) * seq_q + i] = m + l.ln();
                for x in 0..d {
                    o[qi(b, i, h, x)] = (0..visible).map(|j| pr[j] * v[ki(b, j, h, x)] as f64).sum();
                }
                let dov: Vec<f64> = (0..d).map(|x| d_out[qi(b, i, h, x)] as f64).collect();
                let delta: f64 = (0..d).map(|x| dov[x] * o[qi(b, i, h, x)]).sum();
                for j in 0..visible {
                    let dp: f64 = (0..d).map(|x| dov[x] * v[ki(b, j, h, x)] as f64).sum();
                    let ds = pr[j] * (dp - delta);
                    for x in 0..d {
                        dq[qi(b, i, h, x)] += scale * ds * k[ki(b, j, h, x)] as f64;
                        dk[ki(b, j, h, x)] += scale * ds * q[qi(b, i, h, x)] as f64;
                        dv[ki(b, j, h, x)] += pr[j] * dov[x];
                    }
                }
            }
        }
    }
    Reference { o, lse, dq, dk, dv }
}

/// A problem with random inputs rounded to `dtype`.
pub struct Case {
    pub p: Problem,
    pub q: (Vec<u8>, Vec<f32>),
    pub k: (Vec<u8>, Vec<f32>),
    pub v: (Vec<u8>, Vec<f32>),
    pub d_out: (Vec<u8>, Vec<f32>),
}

pub fn case(dims: Dims, dtype: DType, causal: bool, seed: u64) -> Case {
    let mut rng = Rng::new(seed);
    let q = encode(dtype, &rng.normals(dims.q_len()));
    let k = encode(dtype, &rng.normals(dims.kv_len()));
    let v = encode(dtype, &rng.normals(dims.kv_len()));
    let d_out = encode(dtype, &rng.normals(dims.q_len()));
    let (qs, kvs) = (dims.q_shape(), dims.kv_shape());
    let spec = |name, shape, bytes: &Vec<u8>| TensorSpec { name, dtype: dtype.name(), shape, nbytes: Some(bytes.len()) };
    let (q_spec, k_spec, v_spec) = (spec("q", &qs[..], &q.0), spec("k", &kvs[..], &k.0), spec("v", &kvs[..], &v.0));
    let p = Problem::forward(&q_spec, &k_spec, &v_spec, &Options { causal, scale: None, deterministic: false, ..Options::default() }).unwrap();
    Case { p, q, k, v, d_out }
}

pub fn dims(batch: usize, seq_q: usize, seq_k: usize, heads: usize, kv_heads: usize, head_dim: usize) -> Dims {
    Dims { batch, seq_q, seq_k, heads, kv_heads, head_dim }
}
