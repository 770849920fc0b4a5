//! The CUDA backend's masked kernels (windows, padding, segment ids, block masks, varlen batches)
//! against a brute-force float64 reference, forward and both backward paths. Skips (passes) where
//! no GPU is usable.

#![cfg(feature = "cuda")]

use crate::common::*;
use flash_core::cuda::config::{candidates, tf32_terms, Spec};
use flash_core::cuda::{self, Kernel};
use flash_core::{BackwardIo, DType, ForwardIo, IndexArg, MaskArgs, MaskBuffers, Options, Problem, TensorSpec, Window, MASK_BLOCK};

/// A block mask's entry of (b, h, m, n).
type BlockFn = fn(usize, usize, usize, usize) -> u8;

/// One masked call's layout: padded (`[B, Sq, ...]` with optional padding, segment ids, block mask)
/// or varlen (lengths of each sequence).
#[derive(Clone)]
enum Layout {
    Padded {
        batch: usize,
        seq_q: usize,
        seq_k: usize,
        seqused_k: Option<Vec<i32>>,
        leftpad_k: Option<Vec<i32>>,
        /// Segment ids of each batch row's queries and keys, from (batch row, position).
        segments: Option<fn(usize, usize) -> i32>,
        /// Block mask heads (1 = broadcast) and its entries from (b, h, m, n).
        block_mask: Option<(usize, BlockFn)>,
    },
    Varlen { q_lens: Vec<usize>, k_lens: Vec<usize> },
}

struct Scenario {
    name: &'static str,
    layout: Layout,
    causal: bool,
    window: Window,
    heads: usize,
    kv_heads: usize,
}

/// A built call: the problem, its host inputs (bytes, and the f32 values they hold) and mask data.
struct Call {
    p: Problem,
    q: (Vec<u8>, Vec<f32>),
    k: (Vec<u8>, Vec<f32>),
    v: (Vec<u8>, Vec<f32>),
    d_out: (Vec<u8>, Vec<f32>),
    seg_q: Option<Vec<i32>>,
    seg_k: Option<Vec<i32>>,
    block_mask: Option<Vec<u8>>,
}

fn bytes_i32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn build(s: &Scenario, dtype: DType, head_dim: usize, seed: u64) -> Call {
    let (h, hkv, d) = (s.heads, s.kv_heads, head_dim);
    let opts = Options { causal: s.causal, scale: None, deterministic: false, window: s.window, ..Options::default() };
    let mut rng = Rng::new(seed);
    let spec = |name, shape, bytes: &Vec<u8>| TensorSpec { name, dtype: dtype.name(), shape, nbytes: Some(bytes.len()) };
    match &s.layout {
        Layout::Varlen { q_lens, k_lens } => {
            let (tq, tk) = (q_lens.iter().sum::<usize>(), k_lens.iter().sum::<usize>());
            let (qs, ks) = ([tq, h, d], [tk, hkv, d]);
            let q = encode(dtype, &rng.normals(tq * h * d));
            let k = encode(dtype, &rng.normals(tk * hkv * d));
            let v = encode(dtype, &rng.normals(tk * hkv * d));
            let d_out = encode(dtype, &rng.normals(tq * h * d));
            let (cq, ck) = (cumulative(q_lens), cumulative(k_lens));
            let cs = [cq.len()];
            let i32spec = |name| TensorSpec { name, dtype: "int32", shape: &cs, nbytes: None };
            let (aq, ak) = (IndexArg { spec: i32spec("cu_seqlens_q"), values: &cq }, IndexArg { spec: i32spec("cu_seqlens_k"), values: &ck });
            let p = Problem::varlen_forward(&spec("q", &qs, &q.0), &spec("k", &ks, &k.0), &spec("v", &ks, &v.0), &aq, &ak, &opts).unwrap();
            Call { p, q, k, v, d_out, seg_q: None, seg_k: None, block_mask: None }
        }
        Layout::Padded { batch, seq_q, seq_k, seqused_k, leftpad_k, segments, block_mask } => {
            let (b, sq, sk) = (*batch, *seq_q, *seq_k);
            let (qs, ks) = ([b, sq, h, d], [b, sk, hkv, d]);
            let q = encode(dtype, &rng.normals(b * sq * h * d));
            let k = encode(dtype, &rng.normals(b * sk * hkv * d));
            let v = encode(dtype, &rng.normals(b * sk * hkv * d));
            let d_out = encode(dtype, &rng.normals(b * sq * h * d));
            let seg_q = segments.map(|f| (0..b * sq).map(|x| f(x / sq, x % sq)).collect::<Vec<i32>>());
            let seg_k = segments.map(|f| (0..b * sk).map(|x| f(x / sk, x % sk)).collect::<Vec<i32>>());
            let (mb, nb) = (sq.div_ceil(MASK_BLOCK), sk.div_ceil(MASK_BLOCK));
            let bm = block_mask.map(|(bh, f)| {
                let mut out = Vec::new();
                for bi in 0..b {
                    for hi in 0..bh {
                        for m in 0..mb {
                            for n in 0..nb {
                                out.push(f(bi, hi, m, n));
                            }
                        }
                    }
                }
                (bh, out)
            });
            let used_arg = seqused_k.as_ref().map(|u| (u.clone(), [b]));
            let pad_arg = leftpad_k.as_ref().map(|u| (u.clone(), [b]));
            let (sqs, sks) = ([b, sq], [b, sk]);
            let bm_shape = bm.as_ref().map(|(bh, _)| [b, *bh, mb, nb]);
            let args = MaskArgs {
                segment_ids: seg_q.as_ref().map(|_| {
                    (TensorSpec { name: "seg_q", dtype: "int32", shape: &sqs, nbytes: None }, TensorSpec { name: "seg_k", dtype: "int32", shape: &sks, nbytes: None })
                }),
                seqused_k: used_arg.as_ref().map(|(u, s)| IndexArg { spec: TensorSpec { name: "seqused_k", dtype: "int32", shape: s, nbytes: None }, values: u }),
                leftpad_k: pad_arg.as_ref().map(|(u, s)| IndexArg { spec: TensorSpec { name: "leftpad_k", dtype: "int32", shape: s, nbytes: None }, values: u }),
                block_mask: bm_shape.as_ref().map(|s| TensorSpec { name: "block_mask", dtype: "uint8", shape: s, nbytes: None }),
            };
            let p = Problem::forward_masked(&spec("q", &qs, &q.0), &spec("k", &ks, &k.0), &spec("v", &ks, &v.0), &opts, &args).unwrap();
            Call { p, q, k, v, d_out, seg_q, seg_k, block_mask: bm.map(|(_, m)| m) }
        }
    }
}

/// Does row i of (b, h) see key j (local positions)? The mask's own bounds, then the data masks.
fn sees(c: &Call, b: usize, h: usize, i: usize, j: usize) -> bool {
    let m = &c.p.mask;
    let s = m.seq(b);
    let (lo, hi) = m.key_bounds(&s, i);
    if j < lo || j >= hi {
        return false;
    }
    let d = &c.p.dims;
    if let (Some(sq), Some(sk)) = (&c.seg_q, &c.seg_k) {
        if sq[b * d.seq_q + i] != sk[b * d.seq_k + j] {
            return false;
        }
    }
    match (&c.block_mask, m.block_mask) {
        (Some(bm), Some(shape)) => bm[shape.index(b, h, i / MASK_BLOCK, j / MASK_BLOCK)] != 0,
        _ => true,
    }
}

/// Float64 forward and backward over the call's own layout (q rows [rows, H, D], lse via lse_base),
/// and which elements of dq and of dk/dv belong to a row or key that takes part in some visible
/// pair (the others must be exactly 0).
fn reference(c: &Call) -> (Reference, Vec<bool>, Vec<bool>) {
    let p = &c.p;
    let (h_n, hkv, d) = (p.dims.heads, p.dims.kv_heads, p.dims.head_dim);
    let g = h_n / hkv;
    let (q, k, v, dout) = (&c.q.1, &c.k.1, &c.v.1, &c.d_out.1);
    let (mut o, mut lse) = (vec![0.0; q.len()], vec![f64::NEG_INFINITY; p.lse_len()]);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; k.len()]);
    let (mut q_used, mut k_used) = (vec![false; q.len()], vec![false; k.len()]);
    let scale = p.scale as f64;
    for b in 0..p.dims.batch {
        let s = p.mask.seq(b);
        for h in 0..h_n {
            let qi = |i: usize, x: usize| ((s.q_start + i) * h_n + h) * d + x;
            let ki = |j: usize, x: usize| ((s.k_start + j) * hkv + h / g) * d + x;
            for i in 0..s.q_len {
                let keys: Vec<usize> = (0..s.k_len).filter(|&j| sees(c, b, h, i, j)).collect();
                if keys.is_empty() {
                    continue;
                }
                let sc: Vec<f64> = keys.iter().map(|&j| (0..d).map(|x| q[qi(i, x)] as f64 * k[ki(j, x)] as f64).sum::<f64>() * scale).collect();
                let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
                let pr: Vec<f64> = sc.iter().map(|x| (x - mx).exp() / l).collect();
                lse[p.lse_base(b, h) + i] = mx + l.ln();
                for x in 0..d {
                    o[qi(i, x)] = keys.iter().zip(&pr).map(|(&j, pj)| pj * v[ki(j, x)] as f64).sum();
                }
                let delta: f64 = (0..d).map(|x| dout[qi(i, x)] as f64 * o[qi(i, x)]).sum();
                for (&j, &pj) in keys.iter().zip(&pr) {
                    let dp: f64 = (0..d).map(|x| dout[qi(i, x)] as f64 * v[ki(j, x)] as f64).sum();
                    let ds = pj * (dp - delta);
                    for x in 0..d {
                        (q_used[qi(i, x)], k_used[ki(j, x)]) = (true, true);
                        dq[qi(i, x)] += scale * ds * k[ki(j, x)] as f64;
                        dk[ki(j, x)] += scale * ds * q[qi(i, x)] as f64;
                        dv[ki(j, x)] += pj * dout[qi(i, x)] as f64;
                    }
                }
            }
        }
    }
    (Reference { o, lse, dq, dk, dv }, q_used, k_used)
}

fn mask_buffers<'a>(c: &'a Call, seg: &'a (Option<Vec<u8>>, Option<Vec<u8>>)) -> MaskBuffers<'a> {
    MaskBuffers { seg_q: seg.0.as_deref(), seg_k: seg.1.as_deref(), block_mask: c.block_mask.as_deref() }
}

/// The call's variants (the default tiles: the GPU's first candidates).
fn variants(p: &Problem) -> Vec<cuda::Variant> {
    let kernels = [Kernel::Fwd, Kernel::BwdDq, Kernel::BwdDkdv, Kernel::BwdDkdvDq, Kernel::BwdPreprocess, Kernel::BwdDqConvert];
    kernels
        .into_iter()
        .map(|kernel| {
            let spec = Spec { kernel, dtype: p.dtype, head_dim: p.dims.head_dim, causal: p.causal, masked: true, mods: false, group: p.dims.group(), seq_k: p.dims.seq_k, tf32_terms: tf32_terms(kernel, p.dtype, p.precision, p.dims.seq_k, p.dims.head_dim), f16_parts: false };
            candidates(&spec).remove(0)
        })
        .collect()
}

/// Compiles every variant the test launches, in parallel (the launches then find them cached).
fn warm(calls: &[Problem], arch: &str) {
    let mut vs: Vec<cuda::Variant> = calls.iter().flat_map(variants).collect();
    vs.dedup();
    let jobs = std::thread::available_parallelism().map_or(4, |n| n.get());
    for r in cuda::compile_report(&vs, &[arch.to_string()], jobs, false).unwrap() {
        r.outcome.unwrap_or_else(|e| panic!("{}: {e}", r.variant.name()));
    }
}

/// Runs one scenario forward and backward (both paths); returns what differs from the reference.
fn check(s: &Scenario, dtype: DType, head_dim: usize) -> Vec<String> {
    let mut bad = Vec::new();
    let c = build(s, dtype, head_dim, 11 + head_dim as u64);
    let (r, q_used, k_used) = reference(&c);
    let e = dtype.size_bytes();
    let (ql, kl, ll) = (c.p.q_len() * e, c.p.kv_len() * e, c.p.lse_len() * 4);
    let seg = (c.seg_q.as_deref().map(bytes_i32), c.seg_k.as_deref().map(bytes_i32));
    let what = format!("{} {dtype:?} d={head_dim}", s.name);
    let (mut o, mut lse) = (vec![0xA5u8; ql], vec![0xA5u8; ll]); // poisoned: all must be written
    let io = ForwardIo::new([&c.q.0, &c.k.0, &c.v.0], [&mut o, &mut lse]).with_mask(mask_buffers(&c, &seg));
    if let Err(err) = cuda::forward_host(&c.p, 0, io) {
        return vec![format!("{what}: forward failed: {err}")];
    }
    let lse_f = decode(DType::F32, &lse);
    let empty = lse_f.iter().zip(&r.lse).filter(|(g, w)| (**g == f32::NEG_INFINITY) != (**w == f64::NEG_INFINITY)).count();
    if empty > 0 {
        bad.push(format!("{what}: {empty} lse entries disagree on -inf (rows that see no key)"));
    }
    let tol = match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 5e-3,
        DType::BF16 => 3e-2,
    };
    let mut errs = vec![("o", rel_err(&decode(dtype, &o), &r.o)), ("lse", rel_err(&lse_f, &r.lse))];
    for deterministic in [false, true] {
        let p = Problem { deterministic, ..c.p.clone() };
        let (mut dq, mut dk, mut dv) = (vec![0xA5u8; ql], vec![0xA5u8; kl], vec![0xA5u8; kl]);
        let io = BackwardIo::new([&c.d_out.0, &c.q.0, &c.k.0, &c.v.0, &o, &lse], [&mut dq, &mut dk, &mut dv]).with_mask(mask_buffers(&c, &seg));
        if let Err(err) = cuda::backward_host(&p, 0, io) {
            bad.push(format!("{what} deterministic={deterministic}: backward failed: {err}"));
            continue;
        }
        let tag = if deterministic { "det" } else { "atomic" };
        for (name, got, want, used) in [("dq", &dq, &r.dq, &q_used), ("dk", &dk, &r.dk, &k_used), ("dv", &dv, &r.dv, &k_used)] {
            let got = decode(dtype, got);
            let nonfinite = got.iter().filter(|x| !x.is_finite()).count();
            // Keys nobody sees and rows that see nothing get exactly zero.
            let nonzero = got.iter().zip(used.iter()).filter(|(g, u)| !**u && **g != 0.0).count();
            if nonfinite + nonzero > 0 {
                bad.push(format!("{what} {tag}: {name} has {nonfinite} non-finite values and {nonzero} non-zero ones in rows or keys outside every visible pair"));
            }
            errs.push((name, rel_err(&got, want) / 2.0)); // gradients: twice the tolerance
        }
    }
    for (name, err) in &errs {
        if *err > tol || err.is_nan() {
            bad.push(format!("{what}: {name} relative error {err:.3e} > {tol:.1e}"));
        }
    }
    let worst = errs.iter().map(|e| e.1).fold(0.0, f64::max);
    eprintln!("{} {what}: worst relative error {worst:.2e} (tolerance {tol:.0e})", if bad.is_empty() { "ok  " } else { "FAIL" });
    bad
}

fn scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "window + seqused_k + leftpad_k",
            layout: Layout::Padded { batch: 2, seq_q: 150, seq_k: 260, seqused_k: Some(vec![260, 190]), leftpad_k: Some(vec![0, 33]), segments: None, block_mask: None },
            causal: false,
            window: Window { left: Some(70), right: Some(5) },
            heads: 4,
            kv_heads: 2,
        },
        Scenario {
            name: "causal + segment ids + block mask",
            layout: Layout::Padded {
                batch: 2,
                seq_q: 200,
                seq_k: 270,
                seqused_k: None,
                leftpad_k: None,
                // Batch row 0: sorted documents; row 1: interleaved ids.
                segments: Some(|b, x| if b == 0 { (x / 70) as i32 } else { ((x / 9) % 3) as i32 }),
                block_mask: Some((2, |b, h, m, n| u8::from((h != 1 || m != 1 || n != 1) && (b != 1 || n != 0 || m != 0)))),
            },
            causal: true,
            window: Window::default(),
            heads: 2,
            kv_heads: 1,
        },
        Scenario {
            // Long runs of hidden tiles for the skip probes: 4300 keys (x in [300, 4600)) with an
            // id no query has between the near and far keys each query sees, and in head 1 33
            // block-mask columns off in a row (more than one 32-block probe).
            name: "long hidden runs: segment ids + block mask",
            layout: Layout::Padded {
                batch: 1,
                seq_q: 300,
                seq_k: 5000,
                seqused_k: None,
                leftpad_k: None,
                segments: Some(|_, x| if x < 300 { (x / 120) as i32 } else if x < 4600 { 5 } else { ((x - 4600) / 120) as i32 }),
                block_mask: Some((2, |_, h, m, n| u8::from(h == 0 || n < 2 || (n > 34 && !(m == 1 && n == 36))))),
            },
            causal: false,
            window: Window::default(),
            heads: 2,
            kv_heads: 1,
        },
        Scenario {
            name: "varlen causal + left window",
            layout: Layout::Varlen { q_lens: vec![130, 0, 257, 5], k_lens: vec![100, 50, 300, 1] },
            causal: true,
            window: Window { left: Some(90), right: None },
            heads: 4,
            kv_heads: 2,
        },
        Scenario {
            name: "varlen",
            layout: Layout::Varlen { q_lens: vec![64, 1, 200], k_lens: vec![64, 129, 17] },
            causal: false,
            window: Window::default(),
            heads: 2,
            kv_heads: 2,
        },
    ]
}

#[test]
fn masked_kernels_match_the_reference() {
    if cuda::available().is_err() {
        eprintln!("no usable GPU: skipped");
        return;
    }
    let arch = cuda::info(0).unwrap().arch;
    let ss = scenarios();
    let configs = [(DType::F16, 64), (DType::BF16, 128), (DType::F32, 64), (DType::F32, 40), (DType::F16, 40), (DType::BF16, 256)];
    let t = std::time::Instant::now();
    let calls: Vec<Problem> = configs.iter().flat_map(|&(dt, d)| ss.iter().map(move |s| build(s, dt, d, 0).p)).collect();
    warm(&calls, &arch);
    eprintln!("compiled in {:.1} s", t.elapsed().as_secs_f64());
    let mut bad = Vec::new();
    for (dtype, d) in configs {
        for s in &ss {
            bad.extend(check(s, dtype, d));
        }
    }
    eprintln!("checked in {:.1} s", t.elapsed().as_secs_f64());
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Runs without a GPU: every scenario is a valid masked call with a finite reference.
#[test]
fn scenarios_are_valid_masked_calls() {
    for s in scenarios() {
        let c = build(&s, DType::F32, 8, 1);
        assert!(!c.p.mask.is_plain(), "{}", s.name);
        let (r, _, _) = reference(&c);
        assert!(r.o.iter().all(|x| x.is_finite()), "{}", s.name);
        assert_eq!(variants(&c.p).len(), 6);
    }
}
