//! Shared test helpers: random inputs, byte conversion and a float64 reference.

#![allow(dead_code)]

use flash_core::{
    backward_host, forward_host, BackwardIo, DType, Device, Dims, ForwardIo, IndexArg, MaskArgs, MaskBuffers, Options, Problem,
    TensorSpec, Window,
};

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

/// Every mask of a call, as the caller gives it; the oracle reads the rules from these alone.
#[derive(Debug, Clone, Default)]
pub struct Masks {
    pub causal: bool,
    pub window: (Option<usize>, Option<usize>),
    pub seqused_k: Option<Vec<i32>>,              // [B]
    pub leftpad_k: Option<Vec<i32>>,              // [B]
    pub segments: Option<(Vec<i32>, Vec<i32>)>,   // [B, Sq], [B, Sk]
    pub block_mask: Option<(Vec<u8>, [usize; 4])>, // [B or 1, H or 1, ceil(Sq/128), ceil(Sk/128)]
    pub cu_seqlens: Option<(Vec<i32>, Vec<i32>)>, // varlen: [B + 1] each
}

/// One batch row in q viewed as [rows, H, D] and k as [rows, Hkv, D] (v and o at Dv): its first query row and
/// count, its first key row and count, and its valid keys [k_lo, k_hi) (local positions).
#[derive(Debug, Clone, Copy)]
pub struct Span {
    pub q0: usize,
    pub q_len: usize,
    pub k0: usize,
    pub k_len: usize,
    pub k_lo: usize,
    pub k_hi: usize,
}

impl Masks {
    /// The batch rows of a call with q [B, Sq, ...] / k [B, Sk, ...] (or the varlen offsets).
    pub fn spans(&self, batch: usize, seq_q: usize, seq_k: usize) -> Vec<Span> {
        if let Some((cq, ck)) = &self.cu_seqlens {
            let n = |v: &[i32], b: usize| (v[b] as usize, (v[b + 1] - v[b]) as usize);
            return (0..cq.len() - 1)
                .map(|b| {
                    let ((q0, q_len), (k0, k_len)) = (n(cq, b), n(ck, b));
                    Span { q0, q_len, k0, k_len, k_lo: 0, k_hi: k_len }
                })
                .collect();
        }
        (0..batch)
            .map(|b| {
                let k_hi = self.seqused_k.as_ref().map_or(seq_k, |u| u[b] as usize);
                let k_lo = self.leftpad_k.as_ref().map_or(0, |l| l[b] as usize);
                Span { q0: b * seq_q, q_len: seq_q, k0: b * seq_k, k_len: seq_k, k_lo, k_hi }
            })
            .collect()
    }

    /// The rule, brute force: key j of batch row b visible to its query i of head h.
    pub fn sees(&self, s: &Span, (b, h, i, j): (usize, usize, usize, usize), (seq_q, seq_k): (usize, usize)) -> bool {
        if j < s.k_lo || j >= s.k_hi {
            return false;
        }
        let rel = j as i64 - s.k_lo as i64;
        let diag = i as i64 + (s.k_hi - s.k_lo) as i64 - s.q_len as i64;
        let (left, right) = self.window;
        let window = left.is_none_or(|l| rel >= diag - l as i64) && right.is_none_or(|r| rel <= diag + r as i64);
        let segment = self.segments.as_ref().is_none_or(|(sq, sk)| sq[b * seq_q + i] == sk[b * seq_k + j]);
        let block = self.block_mask.as_ref().is_none_or(|(bm, [mb, mh, rows, cols])| {
            let (bb, hh) = (if *mb == 1 { 0 } else { b }, if *mh == 1 { 0 } else { h });
            bm[((bb * mh + hh) * rows + i / 128) * cols + j / 128] != 0
        });
        (!self.causal || rel <= diag) && window && segment && block
    }
}

/// Materialised float64 attention forward and backward without masks beyond `causal`.
pub fn reference(p: &Problem, q: &[f32], k: &[f32], v: &[f32], d_out: &[f32]) -> Reference {
    reference_masked(p, &Masks { causal: p.causal, ..Masks::default() }, q, k, v, d_out)
}

/// Materialised float64 attention forward and backward under `m` (the oracle for the core's own
/// tests). Only p's sizes and scale are read; lse is [B, H, Sq] padded, [H, total_q] varlen.
pub fn reference_masked(p: &Problem, m: &Masks, q: &[f32], k: &[f32], v: &[f32], d_out: &[f32]) -> Reference {
    let Dims { batch, seq_q, seq_k, heads, kv_heads, head_dim: d, head_dim_v: dv } = p.dims;
    let g = heads / kv_heads;
    let spans = m.spans(batch, seq_q, seq_k);
    let total_q = q.len() / (heads * d);
    // q, dq [rows, H, D]; o, dO [rows, H, Dv]; k, dk [rows, Hkv, D]; v, dv [rows, Hkv, Dv].
    let qi = |row: usize, h: usize, x: usize| (row * heads + h) * d + x;
    let oi = |row: usize, h: usize, x: usize| (row * heads + h) * dv + x;
    let ki = |row: usize, h: usize, x: usize| (row * kv_heads + h / g) * d + x;
    let vi = |row: usize, h: usize, x: usize| (row * kv_heads + h / g) * dv + x;
    let lse_at = |b: usize, h: usize, i: usize| match m.cu_seqlens {
        Some(_) => h * total_q + spans[b].q0 + i,
        None => (b * heads + h) * seq_q + i,
    };
    let (mut o, mut lse) = (vec![0.0; d_out.len()], vec![f64::NEG_INFINITY; total_q * heads]);
    let (mut dq, mut dk, mut dvs) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    let scale = p.scale as f64;
    for (b, s) in spans.iter().enumerate() {
        for h in 0..heads {
            for i in 0..s.q_len {
                let keys: Vec<usize> = (0..s.k_len).filter(|&j| m.sees(s, (b, h, i, j), (seq_q, seq_k))).collect();
                if keys.is_empty() {
                    continue;
                }
                let (qr, kr) = (s.q0 + i, |j: usize| s.k0 + j);
                let sc: Vec<f64> =
                    keys.iter().map(|&j| (0..d).map(|x| q[qi(qr, h, x)] as f64 * k[ki(kr(j), h, x)] as f64).sum::<f64>() * scale).collect();
                let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
                let pr: Vec<f64> = sc.iter().map(|x| (x - mx).exp() / l).collect();
                lse[lse_at(b, h, i)] = mx + l.ln();
                for x in 0..dv {
                    o[oi(qr, h, x)] = keys.iter().zip(&pr).map(|(&j, pj)| pj * v[vi(kr(j), h, x)] as f64).sum();
                }
                let dov: Vec<f64> = (0..dv).map(|x| d_out[oi(qr, h, x)] as f64).collect();
                let delta: f64 = (0..dv).map(|x| dov[x] * o[oi(qr, h, x)]).sum();
                for (&j, &pj) in keys.iter().zip(&pr) {
                    let dp: f64 = (0..dv).map(|x| dov[x] * v[vi(kr(j), h, x)] as f64).sum();
                    let ds = pj * (dp - delta);
                    for x in 0..d {
                        dq[qi(qr, h, x)] += scale * ds * k[ki(kr(j), h, x)] as f64;
                        dk[ki(kr(j), h, x)] += scale * ds * q[qi(qr, h, x)] as f64;
                    }
                    for x in 0..dv {
                        dvs[vi(kr(j), h, x)] += pj * dov[x];
                    }
                }
            }
        }
    }
    Reference { o, lse, dq, dk, dv: dvs }
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
    let v = encode(dtype, &rng.normals(dims.v_len()));
    let d_out = encode(dtype, &rng.normals(dims.o_len()));
    let (qs, kvs, vs) = (dims.q_shape(), dims.kv_shape(), dims.v_shape());
    let spec = |name, shape, bytes: &Vec<u8>| TensorSpec { name, dtype: dtype.name(), shape, nbytes: Some(bytes.len()) };
    let (q_spec, k_spec, v_spec) = (spec("q", &qs[..], &q.0), spec("k", &kvs[..], &k.0), spec("v", &vs[..], &v.0));
    let p = Problem::forward(&q_spec, &k_spec, &v_spec, &Options { causal, scale: None, deterministic: false, ..Options::default() }).unwrap();
    Case { p, q, k, v, d_out }
}

pub fn dims(batch: usize, seq_q: usize, seq_k: usize, heads: usize, kv_heads: usize, head_dim: usize) -> Dims {
    Dims { batch, seq_q, seq_k, heads, kv_heads, head_dim, head_dim_v: head_dim }
}

/// [`dims`] with v's own head dim.
pub fn with_dv(d: Dims, head_dim_v: usize) -> Dims {
    Dims { head_dim_v, ..d }
}

/// A masked (or varlen) problem with random inputs rounded to `dtype`. For varlen, `dims` gives
/// heads and head dims; the row counts come from `m.cu_seqlens`.
pub struct MaskedCase {
    pub p: Problem,
    pub m: Masks,
    pub q: (Vec<u8>, Vec<f32>),
    pub k: (Vec<u8>, Vec<f32>),
    pub v: (Vec<u8>, Vec<f32>),
    pub d_out: (Vec<u8>, Vec<f32>),
    pub seg_bytes: Option<(Vec<u8>, Vec<u8>)>,
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

impl MaskedCase {
    /// The mask buffers of the call.
    pub fn buffers(&self) -> MaskBuffers<'_> {
        MaskBuffers {
            seg_q: self.seg_bytes.as_ref().map(|s| &s.0[..]),
            seg_k: self.seg_bytes.as_ref().map(|s| &s.1[..]),
            block_mask: self.m.block_mask.as_ref().map(|b| &b.0[..]),
        }
    }

    pub fn reference(&self) -> Reference {
        reference_masked(&self.p, &self.m, &self.q.1, &self.k.1, &self.v.1, &self.d_out.1)
    }
}

pub fn masked_case(dims: Dims, m: Masks, dtype: DType, seed: u64) -> MaskedCase {
    let (d, dv) = (dims.head_dim, dims.head_dim_v);
    let (q_shape, kv_shape, v_shape): (Vec<usize>, Vec<usize>, Vec<usize>) = match &m.cu_seqlens {
        Some((cq, ck)) => {
            let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
            (vec![tq, dims.heads, d], vec![tk, dims.kv_heads, d], vec![tk, dims.kv_heads, dv])
        }
        None => (dims.q_shape().to_vec(), dims.kv_shape().to_vec(), dims.v_shape().to_vec()),
    };
    let (ql, kl, vl): (usize, usize, usize) = (q_shape.iter().product(), kv_shape.iter().product(), v_shape.iter().product());
    let mut rng = Rng::new(seed);
    let q = encode(dtype, &rng.normals(ql));
    let k = encode(dtype, &rng.normals(kl));
    let v = encode(dtype, &rng.normals(vl));
    let d_out = encode(dtype, &rng.normals(ql / d.max(1) * dv));
    let p = masked_problem(&m, dtype, [&q_shape, &kv_shape, &v_shape]);
    let seg_bytes = m.segments.as_ref().map(|(sq, sk)| (i32_bytes(sq), i32_bytes(sk)));
    MaskedCase { p, m, q, k, v, d_out, seg_bytes }
}

fn int_arg<'a>(name: &'a str, values: &'a [i32], shape: &'a [usize]) -> IndexArg<'a> {
    IndexArg { spec: TensorSpec { name, dtype: "int32", shape, nbytes: Some(values.len() * 4) }, values }
}

/// Validates the call through the public entry points (forward_masked or varlen_forward).
fn masked_problem(m: &Masks, dtype: DType, [q_shape, kv_shape, v_shape]: [&[usize]; 3]) -> Problem {
    let elems = |s: &[usize]| s.iter().product::<usize>();
    let spec = |name, shape| TensorSpec { name, dtype: dtype.name(), shape, nbytes: Some(elems(shape) * dtype.size_bytes()) };
    let (q, k, v) = (spec("q", q_shape), spec("k", kv_shape), spec("v", v_shape));
    let window = Window { left: m.window.0.map(|x| x as i64), right: m.window.1.map(|x| x as i64) };
    let opts = Options { causal: m.causal, scale: None, deterministic: false, window, ..Options::default() };
    let int_shapes: Vec<[usize; 1]> = [&m.seqused_k, &m.leftpad_k].iter().map(|a| [a.as_ref().map_or(0, |v| v.len())]).collect();
    if let Some((cq, ck)) = &m.cu_seqlens {
        let shape = [cq.len()];
        return Problem::varlen_forward(&q, &k, &v, &int_arg("cu_seqlens_q", cq, &shape), &int_arg("cu_seqlens_k", ck, &shape), &opts).unwrap();
    }
    let (b, sq) = (q_shape[0], q_shape[1]);
    let (seg_q_shape, seg_k_shape) = ([b, sq], [b, kv_shape[1]]);
    let segment_ids = m.segments.as_ref().map(|(a, c)| {
        let int = |name, shape, n: usize| TensorSpec { name, dtype: "int32", shape, nbytes: Some(n * 4) };
        (int("q_segment_ids", &seg_q_shape[..], a.len()), int("kv_segment_ids", &seg_k_shape[..], c.len()))
    });
    let block_mask =
        m.block_mask.as_ref().map(|(bytes, shape)| TensorSpec { name: "block_mask", dtype: "uint8", shape: &shape[..], nbytes: Some(bytes.len()) });
    let args = MaskArgs {
        segment_ids,
        seqused_k: m.seqused_k.as_ref().map(|u| int_arg("seqused_k", u, &int_shapes[0])),
        leftpad_k: m.leftpad_k.as_ref().map(|l| int_arg("leftpad_k", l, &int_shapes[1])),
        block_mask,
    };
    Problem::forward_masked(&q, &k, &v, &opts, &args).unwrap()
}

/// What one forward + backward on the CPU wrote.
pub struct Outputs {
    pub o: Vec<u8>,
    pub lse: Vec<u8>,
    pub dq: Vec<u8>,
    pub dk: Vec<u8>,
    pub dv: Vec<u8>,
}

/// Forward, then backward from its o and lse, on the CPU. Inputs [q, k, v, d_out] as bytes in
/// p.dtype; outputs start poisoned, so every element must be written.
pub fn run_cpu(p: &Problem, [q, k, v, d_out]: [&[u8]; 4], mask: MaskBuffers) -> Outputs {
    let e = p.dtype.size_bytes();
    let (ql, kvl, vl, ol, ll) = (p.q_len() * e, p.kv_len() * e, p.v_len() * e, p.o_len() * e, p.lse_len() * 4);
    let (mut o, mut lse) = (vec![0xA5u8; ol], vec![0xA5u8; ll]);
    forward_host(Device::Cpu, p, ForwardIo::new([q, k, v], [&mut o, &mut lse]).with_mask(mask)).unwrap();
    let (mut dq, mut dk, mut dv) = (vec![0xA5u8; ql], vec![0xA5u8; kvl], vec![0xA5u8; vl]);
    let io = BackwardIo::new([d_out, q, k, v, &o, &lse], [&mut dq, &mut dk, &mut dv]).with_mask(mask);
    backward_host(Device::Cpu, p, io).unwrap();
    Outputs { o, lse, dq, dk, dv }
}

// ---- mask builders ----

/// Ids that step up by one at each boundary: sorted segments, as packed sequences have.
pub fn sorted_ids(len: usize, bounds: &[usize]) -> Vec<i32> {
    (0..len).map(|i| bounds.iter().filter(|&&b| b <= i).count() as i32).collect()
}

/// Per batch row b, `ids(b)` over `len` positions, flattened to [B, len].
pub fn per_batch(batch: usize, ids: impl Fn(usize) -> Vec<i32>) -> Vec<i32> {
    (0..batch).flat_map(ids).collect()
}

/// A pseudo-random block mask of `shape` hiding about a third of its blocks.
pub fn block_mask(shape: [usize; 4], seed: u64) -> (Vec<u8>, [usize; 4]) {
    let n = shape.iter().product();
    (Rng::new(seed).normals(n).iter().map(|&x| (x > -0.45) as u8).collect(), shape)
}

/// Sequence lengths to varlen offsets.
pub fn cumulative(lens: &[usize]) -> Vec<i32> {
    let mut cu = vec![0];
    for &l in lens {
        cu.push(cu[cu.len() - 1] + l as i32);
    }
    cu
}

/// Window, segment ids, padding and a block mask together (masks.rs, materialized.rs).
pub fn combined(d: Dims, causal: bool, window: (Option<usize>, Option<usize>)) -> Masks {
    let (b, sq, sk) = (d.batch, d.seq_q, d.seq_k);
    Masks {
        causal,
        window,
        seqused_k: Some((0..b).map(|i| (sk - 9 * i) as i32).collect()),
        leftpad_k: Some((0..b).map(|i| (13 * i).min(sk - 9 * i) as i32).collect()),
        segments: Some((per_batch(b, |i| sorted_ids(sq, &[sq / 3 + i])), per_batch(b, |i| sorted_ids(sk, &[sk / 2 - i])))),
        block_mask: Some(block_mask([b, 1, sq.div_ceil(128), sk.div_ceil(128)], 17)),
        ..Masks::default()
    }
}

/// An f32 case whose keys and values are NaN wherever no row may look: left padding [0, 100), a
/// block-mask column hidden for all [256, 384), a segment no query has [384, 512), past seqused_k
/// [600, 640) (masks.rs, materialized.rs: a kernel that reads them gives NaN).
pub fn hidden_keys_case(seed: u64) -> MaskedCase {
    let d = dims(1, 130, 640, 2, 1, 16);
    let mut blocks = (vec![1u8; 10], [1, 1, 2, 5]);
    (blocks.0[2], blocks.0[7]) = (0, 0);
    let seg_k: Vec<i32> = (0..640).map(|j| if (384..512).contains(&j) { 7 } else { (j >= 250) as i32 }).collect();
    let m = Masks {
        seqused_k: Some(vec![600]),
        leftpad_k: Some(vec![100]),
        segments: Some((sorted_ids(130, &[65]), seg_k)),
        block_mask: Some(blocks),
        ..Masks::default()
    };
    let mut c = masked_case(d, m, DType::F32, seed);
    let row = d.kv_heads * d.head_dim;
    for j in (0..100).chain(256..512).chain(600..640) {
        for t in [&mut c.k, &mut c.v] {
            t.1[j * row..(j + 1) * row].fill(f32::NAN);
            t.0[j * row * 4..(j + 1) * row * 4].copy_from_slice(&f32::NAN.to_ne_bytes().repeat(row));
        }
    }
    c
}
