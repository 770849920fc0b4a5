//! Rotary embeddings: validation, and every backend against a float64 rotation written here
//! (both layouts, R < D, positions as an array and as an offset, every dtype). The CUDA cases run
//! where a GPU is usable and pass trivially elsewhere.

use crate::common::*;
use flash_core::{
    cuda_available, rotary_host, DType, Device, FlashError, IndexArg, Positions, RotaryIo, RotaryOptions, RotaryProblem, TensorSpec,
};

fn spec<'a>(name: &'a str, dtype: &'a str, shape: &'a [usize]) -> TensorSpec<'a> {
    let elem = match dtype {
        "float16" | "bfloat16" => 2,
        _ => 4,
    };
    TensorSpec { name, dtype, shape, nbytes: Some(shape.iter().product::<usize>() * elem) }
}

/// One call: x [B, S, H, D], tables [P, R/2], positions (array or offset).
#[derive(Clone)]
struct Case {
    b: usize,
    s: usize,
    h: usize,
    d: usize,
    r: usize,
    max_pos: usize,
    interleaved: bool,
    positions: Option<Vec<i32>>,
    offset: i64,
}

struct Inputs {
    x: Vec<u8>,
    x_vals: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

fn inputs(c: &Case, dtype: DType, seed: u64) -> Inputs {
    let mut rng = Rng::new(seed);
    let (x, x_vals) = encode(dtype, &rng.normals(c.b * c.s * c.h * c.d));
    let half = c.r / 2;
    let mut cos = Vec::new();
    let mut sin = Vec::new();
    for p in 0..c.max_pos {
        for i in 0..half {
            let theta = p as f64 * 10000f64.powf(-(i as f64) / half as f64);
            cos.push(theta.cos() as f32);
            sin.push(theta.sin() as f32);
        }
    }
    Inputs { x, x_vals, cos, sin }
}

/// The rotation in float64 (sign -1: the backward).
fn expected(c: &Case, inp: &Inputs, sign: f64) -> Vec<f64> {
    let half = c.r / 2;
    let mut y: Vec<f64> = inp.x_vals.iter().map(|&v| v as f64).collect();
    for bs in 0..c.b * c.s {
        let pos = match &c.positions {
            Some(p) => p[bs] as usize,
            None => bs % c.s + c.offset as usize,
        };
        for h in 0..c.h {
            let row = &mut y[(bs * c.h + h) * c.d..][..c.d];
            for i in 0..half {
                let (cs, sn) = (inp.cos[pos * half + i] as f64, sign * inp.sin[pos * half + i] as f64);
                let (ia, ib) = if c.interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
                let (a, b) = (row[ia], row[ib]);
                row[ia] = a * cs - b * sn;
                row[ib] = b * cs + a * sn;
            }
        }
    }
    y
}

fn run(c: &Case, device: Device, dtype: DType, inverse: bool, x: &[u8], inp: &Inputs) -> Result<Vec<u8>, FlashError> {
    let x_shape = [c.b, c.s, c.h, c.d];
    let t_shape = [c.max_pos, c.r / 2];
    let pos_shape = [c.b, c.s];
    let pos_bytes: Option<Vec<u8>> = c.positions.as_ref().map(|p| p.iter().flat_map(|v| v.to_ne_bytes()).collect());
    let positions = match &c.positions {
        Some(v) => Positions::Array(IndexArg { spec: spec("positions", "int32", &pos_shape), values: v }),
        None => Positions::Offset(c.offset),
    };
    let opts = RotaryOptions { interleaved: c.interleaved, positions };
    let xs = spec("x", dtype.name(), &x_shape);
    let (cs, ss) = (spec("cos", "float32", &t_shape), spec("sin", "float32", &t_shape));
    let p = if inverse { RotaryProblem::backward(&xs, &cs, &ss, &opts)? } else { RotaryProblem::apply(&xs, &cs, &ss, &opts)? };
    let (cos, sin) = (encode(DType::F32, &inp.cos).0, encode(DType::F32, &inp.sin).0);
    let mut y = vec![0xFFu8; x.len()]; // poison: every element must be written
    let io = RotaryIo { x, cos: &cos, sin: &sin, positions: pos_bytes.as_deref(), y: &mut y };
    rotary_host(device, &p, io)?;
    Ok(y)
}

fn cases() -> Vec<Case> {
    let base = Case { b: 2, s: 5, h: 3, d: 16, r: 16, max_pos: 5, interleaved: false, positions: None, offset: 0 };
    vec![
        Case { ..base.clone() },
        Case { interleaved: true, ..base.clone() },
        // R < D (odd pass-through), an offset (decode after a cache)
        Case { d: 13, r: 6, max_pos: 12, offset: 7, ..base.clone() },
        Case { d: 13, r: 6, max_pos: 12, offset: 7, interleaved: true, ..base.clone() },
        // positions per row: packed documents restart at 0
        Case { d: 40, r: 40, max_pos: 9, positions: Some(vec![0, 1, 2, 0, 1, 8, 7, 6, 5, 4]), ..base.clone() },
        Case { d: 72, r: 36, max_pos: 9, positions: Some(vec![3, 3, 3, 0, 0, 1, 2, 3, 4, 5]), interleaved: true, ..base.clone() },
        // one query (decode) with many heads
        Case { b: 3, s: 1, h: 8, d: 128, r: 128, max_pos: 100, offset: 99, ..base.clone() },
    ]
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-6,
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
    }
}

fn check_backend(device: Device) {
    for (n, c) in cases().iter().enumerate() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let inp = inputs(c, dtype, 7 + n as u64);
            for inverse in [false, true] {
                let y = run(c, device, dtype, inverse, &inp.x, &inp).unwrap();
                let want = expected(c, &inp, if inverse { -1.0 } else { 1.0 });
                let err = rel_err(&decode(dtype, &y), &want);
                assert!(err <= tolerance(dtype), "case {n} {dtype:?} inverse={inverse} on {device:?}: error {err}");
                // dims R..D pass through bit for bit
                let e = dtype.size_bytes();
                for row in y.chunks(c.d * e).zip(inp.x.chunks(c.d * e)) {
                    assert_eq!(row.0[c.r * e..], row.1[c.r * e..], "case {n}: pass-through dims changed");
                }
            }
            // backward(apply(x)) == x: the inverse rotation
            let y = run(c, device, dtype, false, &inp.x, &inp).unwrap();
            let back = run(c, device, dtype, true, &y, &inp).unwrap();
            let want: Vec<f64> = inp.x_vals.iter().map(|&v| v as f64).collect();
            let err = rel_err(&decode(dtype, &back), &want);
            assert!(err <= 2.0 * tolerance(dtype), "case {n} {dtype:?} round trip on {device:?}: error {err}");
        }
    }
}

#[test]
fn cpu_matches_the_float64_rotation() {
    check_backend(Device::Cpu);
}

#[test]
fn cuda_matches_the_float64_rotation() {
    if !cuda_available() {
        return; // no GPU here
    }
    check_backend(Device::Cuda);
}

fn validate(x: &[usize], tables: (&[usize], &[usize]), opts: RotaryOptions) -> Result<RotaryProblem, FlashError> {
    RotaryProblem::apply(&spec("x", "bfloat16", x), &spec("cos", "float32", tables.0), &spec("sin", "float32", tables.1), &opts)
}

fn message(r: Result<RotaryProblem, FlashError>) -> (String, String) {
    let e = r.expect_err("must be an error");
    (e.kind().to_string(), e.to_string())
}

#[test]
fn bad_calls_are_clear_errors() {
    let ok = RotaryOptions::default();
    let p = validate(&[2, 4, 3, 8], (&[4, 3], &[4, 3]), ok).unwrap();
    assert_eq!((p.dims.rotary_dim, p.dims.max_pos, p.inverse), (6, 4, false));

    let (kind, msg) = message(validate(&[2, 4, 3, 8], (&[4, 5], &[4, 5]), ok));
    assert_eq!(kind, "shape");
    assert!(msg.contains("R = 2 * 5 = 10") && msg.contains("head_dim 8"), "{msg}");
    let (kind, msg) = message(validate(&[2, 4, 3, 8], (&[4, 3], &[5, 3]), ok));
    assert!(kind == "shape" && msg.contains("cos has shape [4, 3] but sin has shape [5, 3]"), "{msg}");
    let (kind, msg) = message(validate(&[2, 4, 3, 8], (&[4, 0], &[4, 0]), ok));
    assert!(kind == "shape" && msg.contains("at least one angle"), "{msg}");
    let (kind, msg) = message(validate(&[2, 4, 3, 8], (&[12], &[12]), ok));
    assert!(kind == "shape" && msg.contains("rank 2"), "{msg}");
    let (kind, msg) = message(validate(&[2, 4, 8], (&[4, 3], &[4, 3]), ok));
    assert!(kind == "shape" && msg.contains("x must have rank 4"), "{msg}");

    // positions: an offset past the tables, a negative one, values out of range, wrong shape / dtype
    let (kind, msg) = message(validate(&[2, 4, 3, 8], (&[4, 3], &[4, 3]), RotaryOptions { positions: Positions::Offset(1), ..ok }));
    assert!(kind == "shape" && msg.contains("max_pos = 4"), "{msg}");
    let (kind, msg) = message(validate(&[2, 4, 3, 8], (&[9, 3], &[9, 3]), RotaryOptions { positions: Positions::Offset(-1), ..ok }));
    assert!(kind == "unsupported" && msg.contains("non-negative"), "{msg}");
    let values = [0, 1, 2, 3, 0, 4, 2, 3];
    let arg = |shape, dtype, values| Positions::Array(IndexArg { spec: spec("positions", dtype, shape), values });
    let (kind, msg) = message(validate(&[2, 4, 3, 8], (&[4, 3], &[4, 3]), RotaryOptions { positions: arg(&[2, 4], "int32", &values), ..ok }));
    assert!(kind == "shape" && msg.contains("positions[1, 1] = 4 is outside"), "{msg}");
    let negative = [0, 1, 2, 3, 0, 1, -2, 3];
    let (_, msg) = message(validate(&[2, 4, 3, 8], (&[4, 3], &[4, 3]), RotaryOptions { positions: arg(&[2, 4], "int32", &negative), ..ok }));
    assert!(msg.contains("positions[1, 2] = -2"), "{msg}");
    let (kind, msg) = message(validate(&[2, 4, 3, 8], (&[4, 3], &[4, 3]), RotaryOptions { positions: arg(&[8], "int32", &values), ..ok }));
    assert!(kind == "shape" && msg.contains("expected [batch, seq] = [2, 4]"), "{msg}");
    let (kind, _) = message(validate(&[2, 4, 3, 8], (&[4, 3], &[4, 3]), RotaryOptions { positions: arg(&[2, 4], "float32", &values), ..ok }));
    assert_eq!(kind, "dtype");
    let fine = [0, 1, 2, 3, 3, 2, 1, 0];
    assert!(validate(&[2, 4, 3, 8], (&[4, 3], &[4, 3]), RotaryOptions { positions: arg(&[2, 4], "int32", &fine), ..ok }).is_ok());

    // dtypes: x a float type, tables float32
    let t = [4usize, 3];
    let e = RotaryProblem::apply(&spec("x", "int32", &[2, 4, 3, 8]), &spec("cos", "float32", &t), &spec("sin", "float32", &t), &ok);
    assert_eq!(e.unwrap_err().kind(), "dtype");
    let e = RotaryProblem::apply(&spec("x", "float32", &[2, 4, 3, 8]), &spec("cos", "float16", &t), &spec("sin", "float32", &t), &ok);
    let e = e.unwrap_err();
    assert!(e.kind() == "dtype" && e.to_string().contains("cos has dtype float16; it must be float32"), "{e}");
    // a buffer that does not match its shape
    let short = TensorSpec { nbytes: Some(10), ..spec("x", "float32", &[2, 4, 3, 8]) };
    let e = RotaryProblem::apply(&short, &spec("cos", "float32", &t), &spec("sin", "float32", &t), &ok).unwrap_err();
    assert_eq!(e.kind(), "shape");
    // the backward names its own argument
    let e = RotaryProblem::backward(&spec("dy", "float32", &[2, 4, 3]), &spec("cos", "float32", &t), &spec("sin", "float32", &t), &ok);
    assert!(e.unwrap_err().to_string().starts_with("dy must have rank 4"));
}

#[test]
fn buffers_that_do_not_match_the_problem_are_refused() {
    let t = [4usize, 3];
    let p = RotaryProblem::apply(&spec("x", "float32", &[1, 2, 1, 6]), &spec("cos", "float32", &t), &spec("sin", "float32", &t), &Default::default()).unwrap();
    let (x, tab) = (vec![0u8; 48], vec![0u8; 48]);
    let mut y = vec![0u8; 44];
    let io = RotaryIo { x: &x, cos: &tab, sin: &tab, positions: None, y: &mut y };
    assert_eq!(rotary_host(Device::Cpu, &p, io).unwrap_err().kind(), "shape");
    let mut y = vec![0u8; 48];
    let pos = vec![0u8; 8];
    let io = RotaryIo { x: &x, cos: &tab, sin: &tab, positions: Some(&pos), y: &mut y };
    assert_eq!(rotary_host(Device::Cpu, &p, io).unwrap_err().kind(), "internal");
}

#[test]
fn empty_tensors_are_fine() {
    let t = [0usize, 4];
    let p = RotaryProblem::apply(&spec("x", "float16", &[3, 0, 2, 8]), &spec("cos", "float32", &t), &spec("sin", "float32", &t), &Default::default()).unwrap();
    let io = RotaryIo { x: &[], cos: &[], sin: &[], positions: None, y: &mut [] };
    rotary_host(Device::Cpu, &p, io).unwrap();
}
