//! Times the tile products the kernels issue (single thread) at the shapes of one tile, in
//! GFLOP/s per CPU-second (robust to other load on the machine).
use flash_core::cpu::matmul::{matmul, Mat};
use flash_core::cpu::simd;

fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks: f64 = fields.get(11).and_then(|u| u.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}

fn main() {
    // (m, n, k, A transposed): S = Q·Kᵀ, O += P·V, dK += dSᵀ·Q, D = 128 variants.
    // (m, n, k, A transposed, leading dimension of B): ldb = 2048 and 2064 are the transposed K
    // of S = 2048 without and with padding against L1 set conflicts.
    for &(m, n, k, ta, ldb) in &[
        (64usize, 128usize, 64usize, false, 128usize),
        (64, 128, 64, false, 2048),
        (64, 128, 64, false, 2064),
        (64, 128, 128, false, 8192),
        (64, 128, 128, false, 8208),
        (64, 64, 128, false, 64),
        (128, 64, 64, true, 64),
        (64, 128, 128, false, 128),
    ] {
        let a = vec![0.5f32; 256 * 256];
        let b = vec![0.25f32; 128 * ldb + 256];
        let mut c = vec![0f32; 256 * 256];
        let am = if ta { Mat::transposed(&a, m) } else { Mat::rows(&a, k) };
        let iters = 20000;
        let t0 = cpu_seconds();
        for _ in 0..iters {
            matmul(m, n, k, &mut c, n, true, am, &b, ldb);
        }
        let dt = (cpu_seconds() - t0) / iters as f64;
        println!("m{m} n{n} k{k} transA={ta} ldb={ldb}: {:.2} us, {:.1} GF/s", dt * 1e6, 2.0 * (m * n * k) as f64 / dt / 1e9);
    }
    // The elementwise step of one forward tile and one backward tile (64 x 128).
    let (rows, cols) = (64usize, 128usize);
    let mut s: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 1000) as f32 * 0.01 - 5.0).collect();
    let mut dp = s.clone();
    let (mut m, mut l, mut alpha) = (vec![0.0f32; rows], vec![0.0f32; rows], vec![0.0f32; rows]);
    let (lse2, delta) = (vec![6.0f32; rows], vec![0.1f32; rows]);
    let iters = 20000;
    let t0 = cpu_seconds();
    for _ in 0..iters {
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        simd::online_softmax(&mut s, cols, cols, &mut m, &mut l, &mut alpha);
    }
    let dt = (cpu_seconds() - t0) / iters as f64;
    println!("online_softmax 64x128: {:.2} us, {:.2} ns/element", dt * 1e6, dt * 1e9 / (rows * cols) as f64);
    let t0 = cpu_seconds();
    for _ in 0..iters {
        simd::probs_and_dscores(&mut s, &mut dp, cols, cols, &lse2, &delta);
    }
    let dt = (cpu_seconds() - t0) / iters as f64;
    println!("probs_and_dscores 64x128: {:.2} us, {:.2} ns/element", dt * 1e6, dt * 1e9 / (rows * cols) as f64);
}

