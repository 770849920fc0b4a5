//! The CUDA backend's padding layer (cuda/pad.rs): any D and v's own Dv against the float64
//! reference, plain and masked, forward and both backward paths, every dtype, outputs poisoned
//! first. Skips (passes) where no GPU is usable.

#![cfg(feature = "cuda")]

use crate::common::*;
use flash_core::cuda;
use flash_core::{BackwardIo, DType, ForwardIo, Problem};

fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 5e-3,
        DType::BF16 => 3e-2,
    }
}

/// Forward and both backward paths of `c` on GPU 0; what differs from the reference.
fn check(c: &MaskedCase) -> Vec<String> {
    let (p, dtype) = (&c.p, c.p.dtype);
    let what = format!("{:?} {dtype:?} {:?}", p.dims, c.m);
    let r = c.reference();
    let e = dtype.size_bytes();
    let (mut o, mut lse) = (vec![0xA5u8; p.o_len() * e], vec![0xA5u8; p.lse_len() * 4]);
    if let Err(err) = cuda::forward_host(p, 0, ForwardIo::new([&c.q.0, &c.k.0, &c.v.0], [&mut o, &mut lse]).with_mask(c.buffers())) {
        return vec![format!("{what}: forward failed: {err}")];
    }
    let mut errs = vec![("o", rel_err(&decode(dtype, &o), &r.o)), ("lse", rel_err(&decode(DType::F32, &lse), &r.lse))];
    let mut bad = Vec::new();
    for deterministic in [false, true] {
        let p = Problem { deterministic, ..p.clone() };
        let (mut dq, mut dk, mut dv) = (vec![0xA5u8; p.q_len() * e], vec![0xA5u8; p.kv_len() * e], vec![0xA5u8; p.v_len() * e]);
        let io = BackwardIo::new([&c.d_out.0, &c.q.0, &c.k.0, &c.v.0, &o, &lse], [&mut dq, &mut dk, &mut dv]).with_mask(c.buffers());
        if let Err(err) = cuda::backward_host(&p, 0, io) {
            bad.push(format!("{what} deterministic={deterministic}: backward failed: {err}"));
            continue;
        }
        for (name, got, want) in [("dq", &dq, &r.dq), ("dk", &dk, &r.dk), ("dv", &dv, &r.dv)] {
            errs.push((name, rel_err(&decode(dtype, got), want) / 2.0)); // gradients: twice the tolerance
        }
    }
    for (name, err) in errs {
        if err > tol(dtype) || err.is_nan() {
            bad.push(format!("{what}: {name} relative error {err:.3e} > {:.1e}", tol(dtype)));
        }
    }
    bad
}

#[test]
fn padding_layer_matches_the_reference() {
    if cuda::available().is_err() {
        eprintln!("no usable GPU: skipped");
        return;
    }
    let mut bad = Vec::new();
    let window = Masks { causal: true, window: (Some(40), None), ..Masks::default() };
    let varlen = Masks { causal: true, cu_seqlens: Some((vec![0, 40, 40, 137], vec![0, 55, 60, 160])), ..Masks::default() };
    for (d, dv) in [(1, 1), (3, 3), (59, 59), (111, 111), (200, 200), (192, 128), (128, 192), (3, 200), (256, 8)] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let padded = with_dv(dims(2, 97, 130, 4, 2, d), dv);
            bad.extend(check(&masked_case(padded, Masks { causal: true, ..Masks::default() }, dtype, 1)));
            bad.extend(check(&masked_case(padded, window.clone(), dtype, 2)));
            bad.extend(check(&masked_case(with_dv(dims(0, 0, 0, 4, 2, d), dv), varlen.clone(), dtype, 3)));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
