//! The CPU backend under windows, padding, segment ids, block masks and varlen batches against
//! the float64 oracle (alone and combined), and the properties its kernels promise: hidden keys
//! are never read, varlen equals padding, the backward does not depend on the thread count.

use crate::common::*;
use flash_core::{DType, Dims};

fn run(c: &MaskedCase) -> Outputs {
    run_cpu(&c.p, [&c.q.0, &c.k.0, &c.v.0, &c.d_out.0], c.buffers())
}

/// Outputs against the oracle: relative errors within `tol`, lse = -inf exactly where a row sees
/// nothing, and exact zeros for rows that see nothing and keys that no row sees (padding
/// included): there the oracle's o (for q-like tensors) or dv (for k-like ones) is exactly 0.
fn check(c: &MaskedCase, tol: f64) {
    let (out, r, dtype) = (run(c), c.reference(), c.p.dtype);
    let lse = decode(DType::F32, &out.lse);
    for (i, (&got, &want)) in lse.iter().zip(&r.lse).enumerate() {
        assert_eq!(got == f32::NEG_INFINITY, want == f64::NEG_INFINITY, "{:?}: lse[{i}] = {got}, want {want}", c.m);
    }
    let tensors = [
        ("o", decode(dtype, &out.o), &r.o, &r.o),
        ("lse", lse, &r.lse, &r.lse),
        ("dq", decode(dtype, &out.dq), &r.dq, &r.o),
        ("dk", decode(dtype, &out.dk), &r.dk, &r.dv),
        ("dv", decode(dtype, &out.dv), &r.dv, &r.dv),
    ];
    for (name, got, want, unseen) in tensors {
        let err = rel_err(&got, want);
        assert!(err <= tol, "{:?} {dtype:?} {:?}: {name} relative error {err:.3e} > {tol:.1e}", c.p.dims, c.m);
        if let Some(i) = (0..got.len()).find(|&i| unseen[i] == 0.0 && got[i] != 0.0) {
            panic!("{:?} {:?}: {name}[{i}] = {} where nothing is seen", c.p.dims, c.m, got[i]);
        }
    }
}

fn f32_case(d: Dims, m: Masks) -> MaskedCase {
    masked_case(d, m, DType::F32, 7 + d.seq_q as u64)
}

fn base() -> Dims {
    dims(2, 200, 300, 4, 2, 24)
}

#[test]
fn windows_match_reference() {
    let windows = [
        (false, (Some(50), Some(20))),
        (false, (Some(1), Some(0))),
        (false, (None, Some(30))),
        (false, (Some(70), None)),
        (true, (Some(100), None)),
        (true, (None, Some(5))),
    ];
    for (causal, window) in windows {
        for d in [base(), dims(1, 300, 130, 2, 1, 16)] {
            check(&f32_case(d, Masks { causal, window, ..Masks::default() }), 1e-5);
        }
    }
}

#[test]
fn padding_matches_reference() {
    let cases = [
        (Some(vec![300, 137]), None),
        (Some(vec![250, 300]), Some(vec![0, 40])),
        (None, Some(vec![129, 300])), // batch row 1: no key, every row sees nothing
        (Some(vec![0, 300]), None),
        (Some(vec![77, 200]), Some(vec![77, 3])),
    ];
    for (seqused_k, leftpad_k) in cases {
        for causal in [false, true] {
            check(&f32_case(base(), Masks { causal, seqused_k: seqused_k.clone(), leftpad_k: leftpad_k.clone(), ..Masks::default() }), 1e-5);
        }
    }
}

#[test]
fn segment_ids_match_reference() {
    let d = base();
    let sorted = (
        per_batch(2, |b| sorted_ids(200, &[[30, 150][b], 170])),
        per_batch(2, |b| sorted_ids(300, &[[100, 200][b], 260])),
    );
    let mut rng = Rng::new(3);
    let random = |n: usize, rng: &mut Rng| rng.normals(n).iter().map(|&x| (x > 0.0) as i32 + (x > 1.0) as i32).collect::<Vec<i32>>();
    let random = (random(400, &mut rng), random(600, &mut rng));
    let mut absent = sorted.clone(); // segment 9 of queries 0..40 has no key: those rows see nothing
    absent.0[..40].fill(9);
    for segments in [sorted, random, absent] {
        for causal in [false, true] {
            check(&f32_case(d, Masks { causal, segments: Some(segments.clone()), ..Masks::default() }), 1e-5);
        }
    }
}

#[test]
fn block_masks_match_reference() {
    for (mb, mh) in [(2, 4), (1, 4), (2, 1), (1, 1)] {
        for causal in [false, true] {
            let m = Masks { causal, block_mask: Some(block_mask([mb, mh, 2, 3], (mb * 10 + mh) as u64)), ..Masks::default() };
            check(&f32_case(base(), m), 1e-5);
        }
    }
    let mut hidden_row = block_mask([1, 1, 2, 3], 5); // query block 1 sees nothing
    hidden_row.0[3..6].fill(0);
    check(&f32_case(base(), Masks { block_mask: Some(hidden_row), ..Masks::default() }), 1e-5);
}

#[test]
fn combined_masks_over_dtypes() {
    let d = dims(2, 150, 260, 6, 2, 40);
    for (causal, window) in [(true, (Some(90), None)), (false, (Some(60), Some(40)))] {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F16, 2e-3), (DType::BF16, 1.6e-2)] {
            check(&masked_case(d, combined(d, causal, window), dtype, 21), tol);
        }
    }
}

#[test]
fn odd_sizes_match_reference() {
    let shapes = [dims(2, 1, 97, 2, 1, 8), dims(2, 97, 20, 2, 2, 1), dims(1, 257, 200, 3, 1, 72), dims(3, 64, 129, 2, 1, 16)];
    for d in shapes {
        for (causal, window) in [(false, (Some(7), Some(3))), (true, (Some(40), None)), (false, (None, None))] {
            check(&f32_case(d, combined(d, causal, window)), 1e-5);
        }
    }
    let no_keys = dims(1, 5, 0, 2, 1, 8);
    let m = Masks { causal: true, window: (Some(1), None), seqused_k: Some(vec![0]), block_mask: Some((vec![], [1, 1, 1, 0])), ..Masks::default() };
    check(&f32_case(no_keys, m), 1e-5);
}

#[test]
fn varlen_matches_reference() {
    // Empty sequences on either side, Sq > Sk and Sq < Sk, several tiles.
    let cu = (cumulative(&[0, 5, 130, 64, 1, 200, 3]), cumulative(&[3, 0, 100, 300, 1, 129, 0]));
    let windows = [(false, (None, None)), (true, (None, None)), (true, (Some(40), None)), (false, (Some(20), Some(10)))];
    for (causal, window) in windows {
        let m = Masks { causal, window, cu_seqlens: Some(cu.clone()), ..Masks::default() };
        check(&masked_case(dims(7, 0, 0, 4, 2, 24), m, DType::F32, 31), 1e-5);
    }
    let m = Masks { causal: true, window: (Some(70), None), cu_seqlens: Some(cu), ..Masks::default() };
    check(&masked_case(dims(7, 0, 0, 4, 4, 40), m, DType::F16, 32), 2e-3);
}

#[test]
fn varlen_equals_padded_batch_with_seqused_k() {
    let (b, sq, sk, h, hkv, d) = (3, 150, 200, 4, 2, 32);
    let used = [200usize, 0, 131];
    for (causal, window) in [(true, (None, None)), (false, (Some(30), Some(50)))] {
        let seqused_k = Some(used.iter().map(|&u| u as i32).collect());
        let padded = f32_case(dims(b, sq, sk, h, hkv, d), Masks { causal, window, seqused_k, ..Masks::default() });
        // The same data packed: every batch row keeps its Sq queries, and its used keys.
        let cu_seqlens = Some((cumulative(&[sq; 3]), cumulative(&used)));
        let mut varlen = f32_case(dims(b, 0, 0, h, hkv, d), Masks { causal, window, cu_seqlens, ..Masks::default() });
        let row = hkv * d * 4; // bytes per key row
        let keys = |t: &[u8]| (0..b).flat_map(|i| t[i * sk * row..(i * sk + used[i]) * row].to_vec()).collect::<Vec<u8>>();
        (varlen.q.0, varlen.d_out.0) = (padded.q.0.clone(), padded.d_out.0.clone());
        (varlen.k.0, varlen.v.0) = (keys(&padded.k.0), keys(&padded.v.0));
        let (x, y) = (run(&padded), run(&varlen));
        assert_eq!((&x.o, &x.dq), (&y.o, &y.dq), "o and dq (same layout)");
        assert_eq!((keys(&x.dk), keys(&x.dv)), (y.dk, y.dv), "dk, dv of the used keys");
        let lse_padded = (0..h).flat_map(|hh| (0..b).flat_map(move |i| ((i * h + hh) * sq * 4..(i * h + hh + 1) * sq * 4).collect::<Vec<_>>()));
        assert_eq!(lse_padded.map(|i| x.lse[i]).collect::<Vec<u8>>(), y.lse, "lse, [B, H, Sq] against [H, total_q]");
        let unused = (0..b).flat_map(|i| x.dk[(i * sk + used[i]) * row..(i + 1) * sk * row].iter().chain(&x.dv[(i * sk + used[i]) * row..(i + 1) * sk * row]));
        assert!(unused.copied().all(|byte| byte == 0), "padding keys get zero gradients");
    }
}

#[test]
fn backward_does_not_depend_on_thread_count() {
    // B·Hkv = 2 tasks: one thread runs the fused schedule, three the split one.
    let d = dims(1, 300, 280, 4, 2, 32);
    let c = f32_case(d, combined(d, false, (Some(100), Some(60))));
    let in_pool = |n: usize| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap().install(|| run(&c));
    let first = in_pool(1);
    for n in [1, 3, 3] {
        let again = in_pool(n);
        assert_eq!((&first.o, &first.lse), (&again.o, &again.lse), "forward with {n} threads");
        assert_eq!((&first.dq, &first.dk, &first.dv), (&again.dq, &again.dk, &again.dv), "backward with {n} threads");
    }
}

#[test]
fn hidden_keys_are_never_read() {
    // The case's seed as f32_case's (7 + Sq).
    check(&hidden_keys_case(7 + 130), 1e-5);
}
