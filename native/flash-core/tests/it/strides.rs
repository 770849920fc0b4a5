//! Strided inputs on the CPU: q, k, v (and the backward's o, dO) read where they lie — a
//! `[B, H, S, D]` transpose, one slot of an interleaved `[B, S, 3, H, D]` qkv, rows with gaps —
//! give results bit-identical to the same call on packed copies, on both paths (fused and
//! materialized), padded and varlen, with masks and sinks. The bytes between a view's elements
//! are NaN, so a misread cannot go unnoticed.

use crate::common::*;
use flash_core::{
    backward_host, forward_host, BackwardIo, DType, Device, FloatArg, ForwardIo, InputStrides, ModArgs, Mode, Problem, Strides,
    TensorSpec,
};

/// How a strided copy of a tensor lies in its buffer.
#[derive(Debug, Clone, Copy)]
enum Layout {
    /// Heads outermost after the batch: `[B, H, S, D]` (varlen `[H, total, D]`).
    HeadsFirst,
    /// Slot 1 of an interleaved `[B, S, 3, H, D]` (varlen `[total, 3, H, D]`).
    Interleaved,
    /// Each row of heads followed by a gap of 5 elements, and each batch by 3 more.
    Gaps,
}

/// `packed` (bytes of a `[B, S, H, D]` or `[total, H, D]` tensor of `dtype`) copied into a
/// buffer laid out as `layout`, NaN everywhere else; returns (buffer from the view's first
/// element, strides).
fn strided(packed: &[u8], dtype: DType, shape: &[usize], layout: Layout) -> (Vec<u8>, Strides) {
    let n = shape.len();
    let (b, s, h, d) = if n == 4 { (shape[0], shape[1], shape[2], shape[3]) } else { (1, shape[0], shape[1], shape[2]) };
    let (st, offset, len) = match layout {
        Layout::HeadsFirst => (Strides { batch: h * s * d, seq: d, head: s * d }, 0, b * h * s * d),
        Layout::Interleaved => (Strides { batch: s * 3 * h * d, seq: 3 * h * d, head: d }, h * d, b * s * 3 * h * d),
        Layout::Gaps => {
            let seq = h * d + 5;
            (Strides { batch: s * seq + 3, seq, head: d }, 0, b * (s * seq + 3))
        }
    };
    let st = if n == 3 { Strides { batch: 0, ..st } } else { st };
    let e = dtype.size_bytes();
    let mut buf = vec![0u8; len * e];
    dtype.store(&vec![f32::NAN; len], &mut buf, 0);
    let mut row = vec![0.0f32; d];
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                dtype.load(packed, ((bi * s + si) * h + hi) * d, &mut row);
                dtype.store(&row, &mut buf, offset + st.at(bi, si, hi));
            }
        }
    }
    buf.drain(..offset * e);
    (buf, st)
}

/// Forward then backward with inputs [q, k, v, d_out] (bytes in p.dtype) at `st` (o at
/// `st.o`: the forward's packed o is copied into that layout first).
fn run(p: &Problem, ins: [&[u8]; 4], st: Option<(InputStrides, Layout)>) -> Outputs {
    let e = p.dtype.size_bytes();
    let (mut o, mut lse) = (vec![0xA5u8; p.o_len() * e], vec![0xA5u8; p.lse_len() * 4]);
    let [q, k, v, d_out] = ins;
    let mut io = ForwardIo::new([q, k, v], [&mut o, &mut lse]);
    if let Some((s, _)) = st {
        io = io.with_strides(s);
    }
    forward_host(Device::Cpu, p, io).unwrap();
    let o_in = match st {
        Some((_, layout)) => strided(&o, p.dtype, &p.o_shape(), layout).0,
        None => o.clone(),
    };
    let (mut dq, mut dk, mut dv) = (vec![0xA5u8; p.q_len() * e], vec![0xA5u8; p.kv_len() * e], vec![0xA5u8; p.v_len() * e]);
    let mut dsinks = vec![0xA5u8; if p.mods.sinks.is_some() { p.dims.heads * 4 } else { 0 }];
    let mut io = BackwardIo::new([d_out, q, k, v, &o_in, &lse], [&mut dq, &mut dk, &mut dv]);
    if p.mods.sinks.is_some() {
        io = io.with_dsinks(&mut dsinks);
    }
    if let Some((s, _)) = st {
        io = io.with_strides(s);
    }
    backward_host(Device::Cpu, p, io).unwrap();
    dq.extend(dsinks); // compared with dq
    Outputs { o, lse, dq, dk, dv }
}

/// Every layout, every path: strided results equal the packed ones byte for byte.
fn check(p: &Problem, [q, k, v, d_out]: [&[u8]; 4]) {
    for mode in [Mode::Fused, Mode::Materialized] {
        if mode == Mode::Materialized && p.dims.head_dim_v != p.dims.head_dim {
            continue;
        }
        let mut p = p.clone();
        p.mode = mode;
        let want = run(&p, [q, k, v, d_out], None);
        for layout in [Layout::HeadsFirst, Layout::Interleaved, Layout::Gaps] {
            let dt = p.dtype;
            let (q, sq) = strided(q, dt, &p.q_shape(), layout);
            let (k, sk) = strided(k, dt, &p.kv_shape(), layout);
            let (v, sv) = strided(v, dt, &p.v_shape(), layout);
            let (d_out, so) = strided(d_out, dt, &p.o_shape(), layout);
            let st = InputStrides { q: sq, k: sk, v: sv, o: so, d_out: so };
            let got = run(&p, [&q, &k, &v, &d_out], Some((st, layout)));
            let pairs = [("o", &got.o, &want.o), ("lse", &got.lse, &want.lse), ("dq", &got.dq, &want.dq), ("dk", &got.dk, &want.dk), ("dv", &got.dv, &want.dv)];
            for (name, g, w) in pairs {
                assert!(g == w, "{:?} {dt:?} {mode:?} {layout:?}: strided {name} differs from packed", p.dims);
            }
        }
    }
}

#[test]
fn padded_gqa_causal_and_not() {
    for (dtype, causal, d) in [(DType::F32, true, dims(2, 37, 53, 4, 2, 40)), (DType::F16, false, dims(3, 20, 20, 2, 1, 16)), (DType::BF16, true, dims(1, 70, 33, 3, 3, 24))] {
        let c = case(d, dtype, causal, 11);
        check(&c.p, [&c.q.0, &c.k.0, &c.v.0, &c.d_out.0]);
    }
}

#[test]
fn value_head_dim_of_its_own() {
    let c = case(with_dv(dims(2, 17, 29, 2, 1, 24), 40), DType::F32, true, 5);
    let d_out = encode(DType::F32, &Rng::new(3).normals(c.p.o_len())).0;
    check(&c.p, [&c.q.0, &c.k.0, &c.v.0, &d_out]);
}

#[test]
fn varlen_and_masks() {
    let varlen = Masks { causal: true, cu_seqlens: Some((vec![0, 5, 5, 26], vec![0, 9, 12, 40])), ..Masks::default() };
    let window = Masks { causal: false, window: (Some(6), Some(2)), seqused_k: Some(vec![31, 9]), ..Masks::default() };
    for (m, d) in [(varlen, dims(3, 0, 0, 4, 2, 32)), (window, dims(2, 23, 31, 2, 2, 16))] {
        let c = masked_case(d, m, DType::F32, 9);
        check(&c.p, [&c.q.0, &c.k.0, &c.v.0, &c.d_out.0]);
    }
}

#[test]
fn sinks_read_o_and_d_out_where_they_lie() {
    let c = case(dims(2, 19, 19, 2, 1, 16), DType::F32, true, 13);
    let (shape, values) = ([2usize], [0.5f32, -1.25]);
    let sinks = FloatArg { spec: TensorSpec { name: "sinks", dtype: "float32", shape: &shape, nbytes: None }, values: &values };
    let p = c.p.clone().with_modifiers(&ModArgs { sinks: Some(sinks), ..ModArgs::default() }).unwrap();
    check(&p, [&c.q.0, &c.k.0, &c.v.0, &c.d_out.0]);
}

#[test]
fn a_buffer_shorter_than_its_strides_reach_is_an_error() {
    let c = case(dims(1, 8, 8, 2, 2, 16), DType::F32, false, 1);
    let (q, sq) = strided(&c.q.0, DType::F32, &c.p.q_shape(), Layout::HeadsFirst);
    let packed = InputStrides::packed(&c.p);
    let (mut o, mut lse) = (vec![0u8; c.p.o_len() * 4], vec![0u8; c.p.lse_len() * 4]);
    let io = ForwardIo::new([&q[..q.len() - 4], &c.k.0, &c.v.0], [&mut o, &mut lse]).with_strides(InputStrides { q: sq, ..packed });
    let err = forward_host(Device::Cpu, &c.p, io).unwrap_err().to_string();
    assert!(err.contains("q buffer") && err.contains("strides reach"), "{err}");
}
