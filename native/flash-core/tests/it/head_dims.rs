//! Every head dim from 1 to 256, and v's own head dim Dv (o, dO and dv take Dv; q, k, dq and dk
//! D), on the CPU against the float64 oracle: odd D, Dv < D and Dv > D, with causal, GQA,
//! Sq != Sk, windows, segment ids and varlen batches, in every dtype; the backward's two
//! schedules stay bit-identical.

use crate::common::*;
use flash_core::{DType, Dims};

fn run(c: &MaskedCase) -> Outputs {
    run_cpu(&c.p, [&c.q.0, &c.k.0, &c.v.0, &c.d_out.0], c.buffers())
}

fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
    }
}

/// Outputs of the sizes the problem names, within `tol(dtype)` of the oracle, lse = -inf exactly
/// where the oracle's is.
fn check(c: &MaskedCase) {
    let (out, r, dtype) = (run(c), c.reference(), c.p.dtype);
    let what = format!("{:?} {dtype:?} {:?}", c.p.dims, c.m);
    let e = dtype.size_bytes();
    let sizes = [(out.o.len(), c.p.o_len()), (out.dq.len(), c.p.q_len()), (out.dk.len(), c.p.kv_len()), (out.dv.len(), c.p.v_len())];
    for (got, want) in sizes {
        assert_eq!(got, want * e, "{what}: output sizes");
    }
    let lse = decode(DType::F32, &out.lse);
    for (i, (&got, &want)) in lse.iter().zip(&r.lse).enumerate() {
        assert_eq!(got == f32::NEG_INFINITY, want == f64::NEG_INFINITY, "{what}: lse[{i}] = {got}, want {want}");
    }
    let tensors = [
        ("o", decode(dtype, &out.o), &r.o),
        ("lse", lse, &r.lse),
        ("dq", decode(dtype, &out.dq), &r.dq),
        ("dk", decode(dtype, &out.dk), &r.dk),
        ("dv", decode(dtype, &out.dv), &r.dv),
    ];
    for (name, got, want) in tensors {
        assert_eq!(got.len(), want.len(), "{what}: {name} length");
        let err = rel_err(&got, want);
        assert!(err <= tol(dtype), "{what}: {name} relative error {err:.3e} > {:.1e}", tol(dtype));
    }
}

fn plain(d: Dims, causal: bool, dtype: DType) -> MaskedCase {
    masked_case(d, Masks { causal, ..Masks::default() }, dtype, 3 + d.head_dim as u64 + 7 * d.head_dim_v as u64)
}

/// (D, Dv) pairs: odd D (FlashAttention's test grid has 59 and 111), both ends, Dv < D and Dv > D.
const HEAD_DIMS: [(usize, usize); 12] =
    [(1, 1), (3, 3), (59, 59), (111, 111), (200, 200), (256, 256), (192, 128), (128, 192), (3, 200), (200, 3), (40, 24), (1, 256)];

#[test]
fn every_head_dim_pair_matches_the_oracle() {
    for (d, dv) in HEAD_DIMS {
        for causal in [false, true] {
            check(&plain(with_dv(dims(2, 37, 53, 4, 2, d), dv), causal, DType::F32));
        }
    }
}

#[test]
fn sq_greater_than_sk_with_mqa() {
    for (d, dv) in [(59, 111), (111, 59), (192, 128)] {
        check(&plain(with_dv(dims(1, 130, 70, 3, 1, d), dv), true, DType::F32)); // rows that see no key
        check(&plain(with_dv(dims(1, 1, 140, 4, 1, d), dv), true, DType::F32)); // decode: Sq = 1
    }
}

#[test]
fn every_dtype() {
    for dtype in [DType::F16, DType::BF16] {
        for (d, dv) in [(59, 59), (192, 128), (24, 72), (3, 1)] {
            check(&plain(with_dv(dims(1, 97, 80, 4, 2, d), dv), true, dtype));
        }
    }
}

#[test]
fn masks_with_their_own_dv() {
    let d = with_dv(dims(2, 150, 200, 4, 2, 59), 24);
    let ids = |len: usize, at: usize| (0..2 * len).map(|x| ((x % len) >= at) as i32).collect::<Vec<i32>>();
    let cases = [
        Masks { causal: true, window: (Some(40), None), ..Masks::default() },
        Masks { causal: false, window: (Some(20), Some(7)), ..Masks::default() },
        Masks { causal: true, segments: Some((ids(150, 60), ids(200, 90))), ..Masks::default() },
        Masks { causal: false, seqused_k: Some(vec![200, 77]), leftpad_k: Some(vec![3, 10]), ..Masks::default() },
    ];
    for m in cases {
        check(&masked_case(d, m.clone(), DType::F32, 21));
        check(&masked_case(with_dv(d, 111), m, DType::BF16, 22));
    }
}

#[test]
fn varlen_with_its_own_dv() {
    let cu = (vec![0, 40, 40, 137], vec![0, 55, 60, 160]);
    for (d, dv, dtype) in [(59, 24, DType::F32), (24, 59, DType::F32), (192, 128, DType::F16), (3, 3, DType::BF16)] {
        for causal in [false, true] {
            let m = Masks { causal, window: (Some(30), None), cu_seqlens: Some(cu.clone()), ..Masks::default() };
            check(&masked_case(with_dv(dims(0, 0, 0, 4, 2, d), dv), m, dtype, 5));
        }
    }
}

#[test]
fn the_default_scale_is_that_of_q_and_k() {
    let c = plain(with_dv(dims(1, 4, 4, 1, 1, 59), 128), false, DType::F32);
    assert_eq!(c.p.scale, (1.0 / 59f64.sqrt()) as f32);
}

#[test]
fn backward_does_not_depend_on_the_schedule() {
    // B·Hkv = 2 tasks: one thread runs the fused schedule, three the split one.
    for (d, dv) in [(59, 111), (192, 128)] {
        let c = plain(with_dv(dims(1, 300, 270, 4, 2, d), dv), true, DType::F32);
        let in_pool = |n: usize| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap().install(|| run(&c));
        let first = in_pool(1);
        for n in [2, 3] {
            let again = in_pool(n);
            assert_eq!((&first.o, &first.lse), (&again.o, &again.lse), "forward with {n} threads");
            assert_eq!((&first.dq, &first.dk, &first.dv), (&again.dq, &again.dk, &again.dv), "backward with {n} threads");
        }
    }
}
