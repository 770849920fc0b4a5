//! Bad inputs become the right FlashError, never a panic.

use flash_core::{DType, FlashError, Options, Problem, TensorSpec};

fn named<'a>(name: &'a str, dtype: DType, shape: &'a [usize]) -> TensorSpec<'a> {
    let nbytes = shape.iter().fold(dtype.size_bytes(), |a, &d| a.wrapping_mul(d));
    TensorSpec { name, dtype: dtype.name(), shape, nbytes: Some(nbytes) }
}

fn spec(dtype: DType, shape: &[usize]) -> TensorSpec<'_> {
    named("t", dtype, shape)
}

fn fwd(q: TensorSpec, k: TensorSpec, v: TensorSpec) -> Result<Problem, FlashError> {
    Problem::forward(&q, &k, &v, &Options::default())
}

#[test]
fn forward_errors_name_the_problem() {
    let f = DType::F32;
    let kind = |r: Result<Problem, FlashError>| r.unwrap_err().kind();
    assert_eq!(kind(fwd(spec(f, &[1, 4, 2]), spec(f, &[1, 4, 2, 8]), spec(f, &[1, 4, 2, 8]))), "shape");
    assert_eq!(kind(fwd(spec(f, &[2, 4, 2, 8]), spec(f, &[1, 4, 2, 8]), spec(f, &[1, 4, 2, 8]))), "shape");
    assert_eq!(kind(fwd(spec(f, &[1, 4, 2, 8]), spec(f, &[1, 4, 2, 16]), spec(f, &[1, 4, 2, 16]))), "shape");
    assert_eq!(kind(fwd(spec(f, &[1, 4, 3, 8]), spec(f, &[1, 4, 2, 8]), spec(f, &[1, 4, 2, 8]))), "shape");
    assert_eq!(kind(fwd(spec(f, &[1, 4, 2, 8]), spec(f, &[1, 4, 2, 8]), spec(f, &[1, 5, 2, 8]))), "shape");
    assert_eq!(kind(fwd(spec(f, &[1, 4, 2, 300]), spec(f, &[1, 4, 2, 300]), spec(f, &[1, 4, 2, 300]))), "shape");
    assert_eq!(kind(fwd(spec(f, &[1, 4, 0, 8]), spec(f, &[1, 4, 0, 8]), spec(f, &[1, 4, 0, 8]))), "shape");
    assert_eq!(kind(fwd(spec(f, &[1, 4, 2, 8]), spec(DType::F16, &[1, 4, 2, 8]), spec(f, &[1, 4, 2, 8]))), "dtype");
    let err = fwd(spec(f, &[1, 4, 3, 8]), spec(f, &[1, 4, 2, 8]), spec(f, &[1, 4, 2, 8])).unwrap_err();
    assert!(err.to_string().contains("[1, 4, 3, 8]"), "{err}");
}

#[test]
fn buffer_length_must_match_shape() {
    let shape = [1, 4, 2, 8];
    let mut short = spec(DType::F32, &shape);
    short.nbytes = Some(short.nbytes.unwrap() - 4);
    let err = fwd(short, spec(DType::F32, &shape), spec(DType::F32, &shape)).unwrap_err();
    assert_eq!(err.kind(), "shape");
    assert!(err.to_string().contains("bytes"), "{err}");
}

#[test]
fn overflowing_sizes_are_out_of_memory() {
    let huge = [usize::MAX / 2, 4, 2, 8];
    let err = fwd(spec(DType::F32, &[1, 4, 2, 8]), TensorSpec { nbytes: Some(0), ..spec(DType::F32, &huge) }, spec(DType::F32, &[1, 4, 2, 8]))
        .unwrap_err();
    // The batch mismatch or the overflow, whichever is checked first, never a panic.
    assert!(matches!(err.kind(), "shape" | "out_of_memory"), "{err}");
    let shape = [1usize << 40, 1 << 20, 1, 256];
    let t = TensorSpec { nbytes: None, ..spec(DType::F32, &shape) };
    assert_eq!(fwd(t, t, t).unwrap_err().kind(), "out_of_memory");
}

#[test]
fn scale_must_be_finite_and_positive() {
    let s = spec(DType::F32, &[1, 4, 2, 8]);
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let err = Problem::forward(&s, &s, &s, &Options { causal: true, scale: Some(bad), deterministic: false, ..Options::default() }).unwrap_err();
        assert_eq!(err.kind(), "unsupported");
    }
    let p = Problem::forward(&s, &s, &s, &Options { causal: false, scale: None, deterministic: false, ..Options::default() }).unwrap();
    assert!((p.scale - 8f32.sqrt().recip()).abs() < 1e-7);
}

#[test]
fn backward_checks_d_out_o_and_lse() {
    let f = DType::F32;
    let (q, kv) = ([1usize, 4, 2, 8], [1usize, 4, 1, 8]);
    let bwd = |d_out: TensorSpec, o: TensorSpec, lse: TensorSpec| {
        Problem::backward(&d_out, &spec(f, &q), &spec(f, &kv), &spec(f, &kv), &o, &lse, &Options::default())
    };
    assert!(bwd(spec(f, &q), spec(f, &q), spec(f, &[1, 2, 4])).is_ok());
    assert_eq!(bwd(spec(f, &[1, 4, 2, 4]), spec(f, &q), spec(f, &[1, 2, 4])).unwrap_err().kind(), "shape");
    assert_eq!(bwd(spec(f, &q), spec(f, &q), spec(f, &[1, 4, 2])).unwrap_err().kind(), "shape");
    assert_eq!(bwd(spec(f, &q), spec(f, &q), spec(DType::F16, &[1, 2, 4])).unwrap_err().kind(), "dtype");
    assert_eq!(bwd(spec(DType::BF16, &q), spec(f, &q), spec(f, &[1, 2, 4])).unwrap_err().kind(), "dtype");
}

#[test]
fn dtype_names() {
    assert_eq!(DType::parse("bfloat16", "q").unwrap(), DType::BF16);
    let err = DType::parse("float64", "k").unwrap_err();
    assert_eq!(err.kind(), "dtype");
    assert!(err.to_string().contains("k has dtype float64"));
}

#[test]
fn messages_use_the_callers_names() {
    let f = DType::F32;
    let (q, kv, lse) = ([1usize, 4, 2, 8], [1usize, 4, 1, 8], [1usize, 2, 4]);
    let bwd = |d_out: TensorSpec, lse: TensorSpec| {
        let (q, k, v, o) = (named("q", f, &q), named("k", f, &kv), named("v", f, &kv), named("o", f, &q));
        Problem::backward(&d_out, &q, &k, &v, &o, &lse, &Options::default()).unwrap_err()
    };
    let err = bwd(named("do", f, &[1, 4, 2, 4]), named("lse", f, &lse));
    assert_eq!(err.to_string(), "do has shape [1, 4, 2, 4]; it must match q's shape [1, 4, 2, 8]");
    let err = bwd(named("dO", DType::F16, &q), named("lse", f, &lse));
    assert!(err.to_string().starts_with("dO has dtype float16"), "{err}");
    let err = Problem::forward(&named("query", DType::BF16, &q), &named("k", f, &kv), &named("v", f, &kv), &Options::default());
    assert!(err.unwrap_err().to_string().contains("query has dtype bfloat16"));
}

#[test]
fn lse_must_be_float32_whatever_its_dtype() {
    let f = DType::F32;
    let (q, kv, lse) = ([1usize, 4, 2, 8], [1usize, 4, 1, 8], [1usize, 2, 4]);
    for dtype in ["float64", "float16", "int32", "bfloat16"] {
        let lse = TensorSpec { name: "lse", dtype, shape: &lse, nbytes: None };
        let (q, k, v) = (named("q", f, &q), named("k", f, &kv), named("v", f, &kv));
        let err = Problem::backward(&q, &q, &k, &v, &q, &lse, &Options::default()).unwrap_err();
        assert_eq!(err.kind(), "dtype");
        assert_eq!(err.to_string(), format!("lse has dtype {dtype}; it must be float32"));
    }
}

#[test]
fn device_memory_has_no_byte_count_to_check() {
    let shape = [1usize, 4, 2, 8];
    let t = TensorSpec { nbytes: None, ..spec(DType::F16, &shape) };
    assert!(Problem::forward(&t, &t, &t, &Options::default()).is_ok());
}
