//! How fast cold inputs can be read at ExPhil's shape ([64, 60, 4, 64] f32, 4 MiB, twelve copies
//! so that they do not stay in L3), in the two orders the CPU paths could use: one head at a time
//! (rows 1 KiB apart) or all heads of a row, then the next row (memory order). Single thread.
//! `cargo run --release -p flash-core --example load_probe`
use flash_core::DType;
use std::time::Instant;

fn main() {
    let (b, s, h, d) = (64usize, 60usize, 4usize, 64usize);
    let n = b * s * h * d;
    let copies: Vec<Vec<u8>> = (0..12).map(|c| (0..n * 4).map(|i| ((i + c) % 251) as u8).collect()).collect();
    let mut dst = vec![0f32; h * s * 64];
    for round in 0..4 {
        let t0 = Instant::now();
        for src in &copies {
            for bi in 0..b {
                for hi in 0..h {
                    for si in 0..s {
                        DType::F32.load(src, ((bi * s + si) * h + hi) * d, &mut dst[si * 64..si * 64 + d]);
                    }
                }
            }
        }
        let t1 = Instant::now();
        for src in &copies {
            for bi in 0..b {
                for si in 0..s {
                    for hi in 0..h {
                        let at = (hi * s + si) * 64;
                        DType::F32.load(src, ((bi * s + si) * h + hi) * d, &mut dst[at..at + d]);
                    }
                }
            }
        }
        let t2 = Instant::now();
        let per = |dt: std::time::Duration| dt.as_secs_f64() * 1e3 / copies.len() as f64;
        println!("round {round}, ms per cold 4 MiB: head by head {:.3}, row sweep {:.3}", per(t1 - t0), per(t2 - t1));
    }
    std::hint::black_box(&dst);
}
