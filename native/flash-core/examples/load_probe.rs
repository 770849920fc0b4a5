use flash_core::DType;
use std::time::Instant;
fn main() {
    let (b, s, h, d) = (64usize, 60usize, 4usize, 64usize);
    let n = b * s * h * d;
    let srcs: Vec<Vec<u8>> = (0..12).map(|k| (0..n * 4).map(|i| ((i + k) % 251) as u8).collect()).collect();
    let mut dst = vec![0f32; h * s * 64];
    for rep in 0..4 {
        let t = Instant::now();
        for src in &srcs {
        for bi in 0..b { for hi in 0..h { for si in 0..s {
            DType::F32.load(src, ((bi * s + si) * h + hi) * d, &mut dst[si * 64..si * 64 + d]);
        }}}}
        let t2 = Instant::now();
        for src in &srcs {
        for bi in 0..b { for si in 0..s { for hi in 0..h {
            DType::F32.load(src, ((bi * s + si) * h + hi) * d, &mut dst[(hi * s + si) * 64..(hi * s + si) * 64 + d]);
        }}}}
        let t3 = Instant::now();
        println!("rep {rep}: per 4MB cold: per-head strided {:.3} ms, row sweep {:.3} ms", (t2 - t).as_secs_f64() * 1e3 / 12.0, (t3 - t2).as_secs_f64() * 1e3 / 12.0);
    }
    std::hint::black_box(&dst);
}
