//! The materialized CPU path (`Mode::Materialized`) against the float64 oracle and against the
//! fused path, under every mask, GQA, Sq != Sk, varlen and each dtype; hidden keys are never read;
//! results do not depend on the thread count. (The dispatch rules themselves: tests/dispatch.rs
//! and tests/test_dispatch.py.)

use crate::common::*;
use flash_core::{DType, Dims, Mode};

/// Forward + backward of the case with `mode`.
fn run_mode(c: &MaskedCase, mode: Mode) -> Outputs {
    let mut p = c.p.clone();
    p.mode = mode;
    run_cpu(&p, [&c.q.0, &c.k.0, &c.v.0, &c.d_out.0], c.buffers())
}

/// Materialized against the oracle (relative error within `tol`) and against fused (within
/// `agree`); -inf in lse and exact zeros where nothing is seen, exactly as the oracle has them.
fn check(c: &MaskedCase, tol: f64, agree: f64) {
    let (m, f, r, dtype) = (run_mode(c, Mode::Materialized), run_mode(c, Mode::Fused), c.reference(), c.p.dtype);
    let lse = decode(DType::F32, &m.lse);
    for (i, (&got, &want)) in lse.iter().zip(&r.lse).enumerate() {
        assert_eq!(got == f32::NEG_INFINITY, want == f64::NEG_INFINITY, "{:?}: lse[{i}] = {got}, want {want}", c.m);
    }
    let tensors = [
        ("o", (&m.o, &f.o), dtype, &r.o, &r.o),
        ("lse", (&m.lse, &f.lse), DType::F32, &r.lse, &r.lse),
        ("dq", (&m.dq, &f.dq), dtype, &r.dq, &r.o),
        ("dk", (&m.dk, &f.dk), dtype, &r.dk, &r.dv),
        ("dv", (&m.dv, &f.dv), dtype, &r.dv, &r.dv),
    ];
    for (name, (mat, fused), dt, want, unseen) in tensors {
        let (mat, fused) = (decode(dt, mat), decode(dt, fused));
        let err = rel_err(&mat, want);
        assert!(err <= tol, "{:?} {dtype:?} {:?}: materialized {name} relative error {err:.3e} > {tol:.1e}", c.p.dims, c.m);
        let fused64: Vec<f64> = fused.iter().map(|&x| x as f64).collect();
        let diff = rel_err(&mat, &fused64);
        assert!(diff <= agree, "{:?} {dtype:?} {:?}: materialized vs fused {name} differ by {diff:.3e} > {agree:.1e}", c.p.dims, c.m);
        if let Some(i) = (0..mat.len()).find(|&i| unseen[i] == 0.0 && mat[i] != 0.0) {
            panic!("{:?} {:?}: {name}[{i}] = {} where nothing is seen", c.p.dims, c.m, mat[i]);
        }
    }
}

fn check_f32(d: Dims, m: Masks) {
    check(&masked_case(d, m, DType::F32, 7 + d.seq_q as u64), 1e-5, 1e-5);
}

#[test]
fn plain_shapes_match_oracle_and_fused() {
    // ExPhil's shape, tiny ones, GQA / MQA, Sq != Sk both ways (rows with no key), odd head dims,
    // sequences past one tile.
    let shapes = [
        dims(4, 60, 60, 4, 4, 64),
        dims(1, 1, 1, 1, 1, 8),
        dims(2, 17, 17, 4, 2, 16),
        dims(1, 1, 97, 8, 1, 40),
        dims(2, 97, 40, 4, 1, 33),
        dims(1, 40, 97, 6, 2, 72),
        dims(1, 130, 300, 2, 2, 128),
        dims(1, 300, 130, 2, 1, 256),
        dims(3, 64, 64, 2, 2, 1),
    ];
    for d in shapes {
        for causal in [true, false] {
            check_f32(d, Masks { causal, ..Masks::default() });
        }
    }
}

#[test]
fn every_dtype() {
    let d = dims(2, 77, 61, 4, 2, 40);
    for causal in [true, false] {
        for (dtype, tol, agree) in [(DType::F32, 1e-5, 1e-5), (DType::F16, 2e-3, 2e-3), (DType::BF16, 1.6e-2, 1.6e-2)] {
            check(&masked_case(d, Masks { causal, ..Masks::default() }, dtype, 5), tol, agree);
        }
    }
}

#[test]
fn windows() {
    for (causal, window) in [(false, (Some(50), Some(20))), (false, (Some(1), Some(0))), (true, (Some(60), None)), (true, (None, Some(5)))] {
        for d in [dims(2, 200, 300, 4, 2, 24), dims(1, 60, 60, 4, 4, 64), dims(1, 300, 130, 2, 1, 16)] {
            check_f32(d, Masks { causal, window, ..Masks::default() });
        }
    }
}

#[test]
fn padding() {
    let cases = [(Some(vec![300, 137]), None), (Some(vec![250, 300]), Some(vec![0, 40])), (None, Some(vec![129, 300])), (Some(vec![0, 300]), None)];
    for (seqused_k, leftpad_k) in cases {
        for causal in [false, true] {
            check_f32(dims(2, 200, 300, 4, 2, 24), Masks { causal, seqused_k: seqused_k.clone(), leftpad_k: leftpad_k.clone(), ..Masks::default() });
        }
    }
}

#[test]
fn segment_ids() {
    let d = dims(2, 200, 300, 4, 2, 24);
    let sorted = (per_batch(2, |b| sorted_ids(200, &[[30, 150][b], 170])), per_batch(2, |b| sorted_ids(300, &[[100, 200][b], 260])));
    let mut rng = Rng::new(3);
    let random = |n: usize, rng: &mut Rng| rng.normals(n).iter().map(|&x| (x > 0.0) as i32 + (x > 1.0) as i32).collect::<Vec<i32>>();
    let random = (random(400, &mut rng), random(600, &mut rng));
    let mut absent = sorted.clone();
    absent.0[..40].fill(9);
    for segments in [sorted, random, absent] {
        for causal in [false, true] {
            check_f32(d, Masks { causal, segments: Some(segments.clone()), ..Masks::default() });
        }
    }
}

#[test]
fn block_masks() {
    for (mb, mh) in [(2, 4), (1, 1)] {
        for causal in [false, true] {
            let m = Masks { causal, block_mask: Some(block_mask([mb, mh, 2, 3], (mb * 10 + mh) as u64)), ..Masks::default() };
            check_f32(dims(2, 200, 300, 4, 2, 24), m);
        }
    }
    // A hidden middle column: runs of visible tiles with a gap between them.
    let gap = (vec![1, 0, 1, 1, 0, 1], [1, 1, 2, 3]);
    check_f32(dims(1, 200, 300, 2, 1, 24), Masks { block_mask: Some(gap), ..Masks::default() });
}

#[test]
fn combined_masks_over_dtypes() {
    let d = dims(2, 150, 260, 6, 2, 40);
    for (causal, window) in [(true, (Some(90), None)), (false, (Some(60), Some(40)))] {
        for (dtype, tol, agree) in [(DType::F32, 1e-5, 1e-5), (DType::F16, 2e-3, 2e-3), (DType::BF16, 1.6e-2, 1.6e-2)] {
            check(&masked_case(d, combined(d, causal, window), dtype, 21), tol, agree);
        }
    }
    let no_keys = dims(1, 5, 0, 2, 1, 8);
    let m = Masks { causal: true, window: (Some(1), None), seqused_k: Some(vec![0]), block_mask: Some((vec![], [1, 1, 1, 0])), ..Masks::default() };
    check_f32(no_keys, m);
}

#[test]
fn varlen() {
    let cu = (cumulative(&[0, 5, 130, 64, 1, 60, 3]), cumulative(&[3, 0, 100, 300, 1, 60, 0]));
    for (causal, window) in [(false, (None, None)), (true, (None, None)), (true, (Some(40), None)), (false, (Some(20), Some(10)))] {
        let m = Masks { causal, window, cu_seqlens: Some(cu.clone()), ..Masks::default() };
        check(&masked_case(dims(7, 0, 0, 4, 2, 24), m, DType::F32, 31), 1e-5, 1e-5);
    }
    let m = Masks { causal: true, window: (Some(70), None), cu_seqlens: Some(cu), ..Masks::default() };
    check(&masked_case(dims(7, 0, 0, 4, 4, 40), m, DType::F16, 32), 2e-3, 2e-3);
}

#[test]
fn hidden_keys_are_never_read() {
    check(&hidden_keys_case(3), 1e-5, 1e-5);
}

#[test]
fn results_do_not_depend_on_thread_count() {
    // Few (batch row, kv head) pairs for many threads, and many for few.
    for d in [dims(1, 150, 140, 4, 2, 32), dims(6, 60, 60, 4, 4, 64)] {
        let c = masked_case(d, combined(d, true, (Some(50), None)), DType::F32, 9);
        let in_pool = |n: usize| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap().install(|| run_mode(&c, Mode::Materialized));
        let first = in_pool(1);
        for n in [2, 3, 8] {
            let again = in_pool(n);
            assert_eq!((&first.o, &first.lse), (&again.o, &again.lse), "forward with {n} threads");
            assert_eq!((&first.dq, &first.dk, &first.dv), (&again.dq, &again.dk, &again.dv), "backward with {n} threads");
        }
    }
}

#[test]
fn small_calls_on_the_calling_thread_give_the_pools_bits() {
    // ExPhil's 60-frame window and a smaller one: both below cpu::par's small-call size, so they
    // run inline unless `on_the_pool` says otherwise; both paths and a fused / materialized pair.
    for d in [dims(1, 60, 60, 4, 4, 64), dims(2, 17, 33, 4, 2, 32)] {
        let c = masked_case(d, combined(d, true, (Some(20), None)), DType::F32, 11);
        for mode in [Mode::Materialized, Mode::Fused] {
            let (inline, pooled) = (run_mode(&c, mode), flash_core::cpu::on_the_pool(|| run_mode(&c, mode)));
            assert_eq!((&inline.o, &inline.lse), (&pooled.o, &pooled.lse), "{d:?} {mode:?}: forward");
            assert_eq!((&inline.dq, &inline.dk, &inline.dv), (&pooled.dq, &pooled.dk, &pooled.dv), "{d:?} {mode:?}: backward");
        }
    }
}
