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

#[test]
fn v_has_its_own_head_dim() {
    let f = DType::F32;
    let (q, k) = ([1usize, 4, 2, 59], [1usize, 6, 1, 59]);
    for dv in [1, 24, 59, 128, 256] {
        let v = [1, 6, 1, dv];
        let p = fwd(named("q", f, &q), named("k", f, &k), named("v", f, &v)).unwrap();
        assert_eq!((p.dims.head_dim, p.dims.head_dim_v), (59, dv));
        assert_eq!((p.o_shape(), p.v_shape(), p.q_shape(), p.kv_shape()), (vec![1, 4, 2, dv], v.to_vec(), q.to_vec(), k.to_vec()));
        assert_eq!(p.scale, (1.0 / 59f64.sqrt()) as f32, "the default scale is 1/sqrt(D), not Dv");
    }
    for dv in [0, 257] {
        let err = fwd(named("q", f, &q), named("k", f, &k), named("v", f, &[1, 6, 1, dv])).unwrap_err();
        assert_eq!(err.kind(), "shape");
        assert!(err.to_string().starts_with("v's head_dim must be between 1 and 256"), "{err}");
    }
    // v keeps k's batch, keys and heads.
    for v in [[1, 5, 1, 24], [1, 6, 2, 24], [2, 6, 1, 24]] {
        let err = fwd(named("q", f, &q), named("k", f, &k), named("v", f, &v)).unwrap_err();
        assert_eq!(err.kind(), "shape");
        assert!(err.to_string().contains("but for the last (head_dim) axis"), "{err}");
    }
}

#[test]
fn backward_o_and_d_out_take_vs_head_dim() {
    let f = DType::F32;
    let (q, k, v, o, lse) = ([1usize, 4, 2, 59], [1usize, 6, 1, 59], [1usize, 6, 1, 24], [1usize, 4, 2, 24], [1usize, 2, 4]);
    let bwd = |d_out: &[usize], o: &[usize]| {
        let (q, k, v, lse) = (named("q", f, &q), named("k", f, &k), named("v", f, &v), named("lse", f, &lse));
        Problem::backward(&named("do", f, d_out), &q, &k, &v, &named("o", f, o), &lse, &Options::default())
    };
    let p = bwd(&o, &o).unwrap();
    assert_eq!((p.o_len(), p.v_len(), p.q_len()), (4 * 2 * 24, 6 * 24, 4 * 2 * 59));
    let err = bwd(&o, &q).unwrap_err();
    assert_eq!(err.to_string(), "o has shape [1, 4, 2, 59]; it must be q's shape with v's head_dim, [1, 4, 2, 24]");
    let err = bwd(&q, &o).unwrap_err();
    assert!(err.to_string().starts_with("do has shape [1, 4, 2, 59]"), "{err}");
    let err = bwd(&[1, 4, 2, 25], &o).unwrap_err();
    assert_eq!(err.kind(), "shape");
}

#[test]
fn varlen_v_has_its_own_head_dim() {
    let f = DType::F32;
    let cu = [0, 3, 7];
    let shape = [3usize];
    let arg = |name| flash_core::IndexArg { spec: TensorSpec { name, dtype: "int32", shape: &shape, nbytes: None }, values: &cu };
    let (q, k, v) = (named("q", f, &[7, 2, 3]), named("k", f, &[7, 1, 3]), named("v", f, &[7, 1, 200]));
    let p = Problem::varlen_forward(&q, &k, &v, &arg("cu_seqlens_q"), &arg("cu_seqlens_k"), &Options::default()).unwrap();
    assert_eq!((p.o_shape(), p.v_shape(), p.q_rows(), p.k_rows()), (vec![7, 2, 200], vec![7, 1, 200], 7, 7));
    let bad = named("v", f, &[6, 1, 200]);
    let err = Problem::varlen_forward(&q, &k, &bad, &arg("cu_seqlens_q"), &arg("cu_seqlens_k"), &Options::default()).unwrap_err();
    assert!(err.to_string().contains("[6, 1, 200]") && err.to_string().contains("[7, 1, 3]"), "{err}");
}
