//! Times forward and backward on the CPU from Rust (no binding) at one shape, f32, causal:
//! `cargo run --release -p flash-core --example short_rows -- B S H D [iters]` (default ExPhil's
//! 64 60 4 64). Prints median ms per call and GFLOP/s (causal flops counted as half).
use flash_core::{backward_host, forward_host, BackwardIo, Device, ForwardIo, Options, Problem, TensorSpec};
use std::time::Instant;

/// CPU seconds of the whole process (all threads; robust to other load on the machine).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (b, s, h, d) = match args[..] {
        [b, s, h, d, ..] => (b, s, h, d),
        _ => (64, 60, 4, 64),
    };
    let iters = args.get(4).copied().unwrap_or(200);
    let shape = [b, s, h, d];
    let n = b * s * h * d;
    let rand = |seed: u32| -> Vec<u8> {
        let mut x = seed.wrapping_mul(2654435761).max(1);
        (0..n).flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            ((x as f32 / u32::MAX as f32) * 2.0 - 1.0).to_ne_bytes()
        }).collect()
    };
    let (q, k, v, d_out) = (rand(1), rand(2), rand(3), rand(4));
    let spec = |name| TensorSpec { name, dtype: "float32", shape: &shape, nbytes: Some(n * 4) };
    let lse_shape = [b, h, s];
    let lse_spec = TensorSpec { name: "lse", dtype: "float32", shape: &lse_shape, nbytes: Some(b * h * s * 4) };
    let opts = Options::default();
    let pf = Problem::forward(&spec("q"), &spec("k"), &spec("v"), &opts).unwrap();
    let pb = Problem::backward(&spec("do"), &spec("q"), &spec("k"), &spec("v"), &spec("o"), &lse_spec, &opts).unwrap();
    let (mut o, mut lse) = (vec![0u8; n * 4], vec![0u8; b * h * s * 4]);
    let (mut dq, mut dk, mut dv) = (vec![0u8; n * 4], vec![0u8; n * 4], vec![0u8; n * 4]);
    let mut fwd = Vec::new();
    let mut bwd = Vec::new();
    let mut cpu0 = 0.0;
    for i in 0..iters + 3 {
        if i == 3 {
            cpu0 = cpu_seconds();
        }
        let t0 = Instant::now();
        forward_host(Device::Cpu, &pf, ForwardIo::new([&q, &k, &v], [&mut o, &mut lse])).unwrap();
        let t1 = Instant::now();
        backward_host(Device::Cpu, &pb, BackwardIo::new([&d_out, &q, &k, &v, &o, &lse], [&mut dq, &mut dk, &mut dv])).unwrap();
        let t2 = Instant::now();
        if i >= 3 {
            fwd.push((t1 - t0).as_secs_f64() * 1e3);
            bwd.push((t2 - t1).as_secs_f64() * 1e3);
        }
    }
    let median = |x: &mut Vec<f64>| {
        x.sort_by(|a, b| a.partial_cmp(b).unwrap());
        x[x.len() / 2]
    };
    let cpu_ms = (cpu_seconds() - cpu0) / iters as f64 * 1e3;
    let (f, bw) = (median(&mut fwd), median(&mut bwd));
    let flops = 4.0 * (b * h * s * s * d) as f64 / 2.0 * 3.5;
    println!(
        "B={b} S={s} H={h} D={d}: fwd {f:.3} ms, bwd {bw:.3} ms, total {:.3} ms, {:.1} GFLOP/s; {cpu_ms:.2} CPU-ms per fwd+bwd ({} threads)",
        f + bw,
        flops / (f + bw) / 1e6,
        flash_core::cpu::threads()
    );
}
