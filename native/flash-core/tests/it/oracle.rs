//! The CPU backend against a float64 reference, over options, dtypes and odd sizes.

use crate::common::*;
use flash_core::DType;

fn run(c: &Case) -> Outputs {
    run_cpu(&c.p, [&c.q.0, &c.k.0, &c.v.0, &c.d_out.0], Default::default())
}

fn check(dims: flash_core::Dims, dtype: DType, causal: bool, tol: f64) {
    let c = case(dims, dtype, causal, 7 + dims.seq_q as u64);
    let out = run(&c);
    let r = reference(&c.p, &c.q.1, &c.k.1, &c.v.1, &c.d_out.1);
    let lse = decode(DType::F32, &out.lse);
    for (i, (&got, &want)) in lse.iter().zip(&r.lse).enumerate() {
        assert_eq!(got == f32::NEG_INFINITY, want == f64::NEG_INFINITY, "lse[{i}] = {got}, want {want}");
    }
    let errs = [
        ("o", rel_err(&decode(dtype, &out.o), &r.o)),
        ("lse", rel_err(&lse, &r.lse)),
        ("dq", rel_err(&decode(dtype, &out.dq), &r.dq)),
        ("dk", rel_err(&decode(dtype, &out.dk), &r.dk)),
        ("dv", rel_err(&decode(dtype, &out.dv), &r.dv)),
    ];
    for (name, err) in errs {
        assert!(err <= tol, "{dims:?} {dtype:?} causal={causal}: {name} relative error {err:.3e} > {tol:.1e}");
    }
}

#[test]
fn f32_matches_reference_over_shapes() {
    for causal in [false, true] {
        for d in [8, 40, 64, 72] {
            check(dims(2, 97, 97, 4, 2, d), DType::F32, causal, 1e-5);
        }
        check(dims(1, 1, 33, 2, 1, 16), DType::F32, causal, 1e-5); // Sq = 1, MQA
        check(dims(1, 150, 70, 3, 3, 24), DType::F32, causal, 1e-5); // Sq > Sk: rows with no key
        check(dims(1, 70, 150, 4, 1, 32), DType::F32, causal, 1e-5); // Sq < Sk, MQA
        check(dims(1, 130, 130, 1, 1, 256), DType::F32, causal, 1e-5); // largest head dim
        check(dims(1, 200, 300, 2, 2, 1), DType::F32, causal, 1e-5); // smallest head dim
    }
}

#[test]
fn half_precision_matches_reference() {
    // Inputs are exactly representable; the error is the output rounding plus f32 arithmetic.
    for causal in [false, true] {
        check(dims(1, 97, 80, 4, 2, 40), DType::F16, causal, 2e-3);
        check(dims(1, 97, 80, 4, 2, 40), DType::BF16, causal, 1.6e-2);
    }
}

#[test]
fn backward_is_bit_identical_across_runs() {
    for kv_heads in [1, 3] {
        let c = case(dims(1, 300, 257, 3, kv_heads, 48), DType::F32, true, 11);
        let (a, b) = (run(&c), run(&c));
        assert_eq!((a.dq, a.dk, a.dv), (b.dq, b.dk, b.dv));
    }
}

#[test]
fn rows_without_keys_give_zero_output_and_gradients() {
    let c = case(dims(1, 40, 10, 1, 1, 8), DType::F32, true, 3);
    let out = run(&c);
    let (o, lse, dq) = (decode(DType::F32, &out.o), decode(DType::F32, &out.lse), decode(DType::F32, &out.dq));
    // Query i sees keys j <= i - 30: rows 0..30 see none.
    for i in 0..30 {
        assert_eq!(lse[i], f32::NEG_INFINITY);
        assert!(o[i * 8..(i + 1) * 8].iter().all(|&x| x == 0.0));
        assert!(dq[i * 8..(i + 1) * 8].iter().all(|&x| x == 0.0));
    }
    assert!(lse[30..].iter().all(|x| x.is_finite()));
}

#[test]
fn empty_keys_and_empty_batch() {
    for d in [dims(1, 5, 0, 2, 1, 8), dims(0, 5, 5, 2, 1, 8), dims(1, 0, 5, 2, 1, 8)] {
        for causal in [false, true] {
            let c = case(d, DType::F32, causal, 1);
            let out = run(&c);
            assert!(decode(DType::F32, &out.o).iter().all(|&x| x == 0.0));
            assert!(decode(DType::F32, &out.lse).iter().all(|&x| x == f32::NEG_INFINITY));
            assert!(decode(DType::F32, &out.dk).iter().all(|&x| x == 0.0));
        }
    }
}

#[test]
fn nan_input_gives_nan_output() {
    let mut c = case(dims(1, 20, 20, 1, 1, 8), DType::F32, false, 5);
    c.q.0[0..4].copy_from_slice(&f32::NAN.to_ne_bytes());
    let out = run(&c);
    let o = decode(DType::F32, &out.o);
    assert!(o[..8].iter().all(|x| x.is_nan()), "row 0 must be NaN");
    assert!(o[8..].iter().all(|x| x.is_finite()), "other rows are unaffected");
}
