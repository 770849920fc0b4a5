//! One `decode_cpu` call timed in Rust, best of REPS, at a chosen cache size (development probe):
//! bf16 q, Hkv = 8, H = 32, D = 128, Sq = 1 (or SQ from the environment), the cache bf16 or quantized (FORMAT `bf16`, `8/64`,
//! `4/32`, ...). Prints GB/s of cache read and ns per (key, kv head). With VAR (or VAR=VALUE), each
//! rep runs twice, without and with the environment variable set (to 1 or VALUE; an A/B switch read
//! by a test build).
//! `RAYON_NUM_THREADS=1 cargo run --release -p flash-core --example decode_probe -- FORMAT B S REPS [VAR]`
use flash_core::decode::{decode_cpu, Cache, Decode};
use flash_core::quant::{quantize, QuantFormat};
use flash_core::DType;
use std::time::Instant;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let fmt = a.get(1).cloned().unwrap_or("bf16".into());
    let b: usize = a.get(2).map_or(4, |x| x.parse().unwrap());
    let s: usize = a.get(3).map_or(32768, |x| x.parse().unwrap());
    let reps: usize = a.get(4).map_or(10, |x| x.parse().unwrap());
    let (hkv, h, d) = (8usize, 32usize, 128usize);
    let sq: usize = std::env::var("SQ").map_or(1, |v| v.parse().unwrap());
    let dt = DType::BF16;
    let rnd = |n: usize, seed: u64| -> Vec<u8> {
        let mut x = seed | 1;
        let f: Vec<f32> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect();
        let mut out = vec![0u8; n * 2];
        dt.store(&f, &mut out, 0);
        out
    };
    let q = rnd(b * sq * h * d, 3);
    let (kx, vx) = (rnd(b * s * hkv * d, 5), rnd(b * s * hkv * d, 7));
    let rows = b * s * hkv;
    let quant = |x: &[u8], bits: usize, gs: usize| {
        let f = QuantFormat::new(bits, gs, d).unwrap();
        let mut v = vec![0u32; rows * f.words()];
        let (mut sc, mut bi) = (
            vec![0u8; rows * f.groups() * 2],
            vec![0u8; rows * f.groups() * 2],
        );
        quantize(dt, &f, x, &mut v, &mut sc, &mut bi).unwrap();
        (f, v, sc, bi)
    };
    let (kq, vq);
    let (k, v, bytes) = if fmt == "bf16" {
        (Cache::Plain(&kx), Cache::Plain(&vx), 2 * kx.len())
    } else {
        let (bits, gs) = fmt.split_once('/').unwrap();
        let (bits, gs) = (bits.parse().unwrap(), gs.parse().unwrap());
        kq = quant(&kx, bits, gs);
        vq = quant(&vx, bits, gs);
        let n = 2 * (kq.1.len() * 4 + kq.2.len() * 2);
        (
            Cache::Quant {
                fmt: kq.0,
                values: &kq.1,
                scales: &kq.2,
                biases: &kq.3,
            },
            Cache::Quant {
                fmt: vq.0,
                values: &vq.1,
                scales: &vq.2,
                biases: &vq.3,
            },
            n,
        )
    };
    let p = Decode {
        dtype: dt,
        batch: b,
        seq_q: sq,
        s_cache: s,
        heads: h,
        kv_heads: hkv,
        head_dim: d,
        causal: true,
        scale: 0.088,
        left: None,
        right: None,
        softcap: None,
        num_splits: None,
    };
    let (mut o, mut lse) = (vec![0u8; b * sq * h * d * 2], vec![0f32; b * sq * h]);
    let var = a.get(5).cloned();
    let mut best = [f64::MAX; 2];
    let sl = vec![s as i32; b];
    let lp = vec![0; b];
    for _ in 0..reps {
        for (i, on) in [false, true].into_iter().enumerate() {
            let Some(var) = &var else {
                if on {
                    continue;
                }
                let t = Instant::now();
                decode_cpu(&p, &q, k, v, &sl, &lp, &mut o, &mut lse).unwrap();
                best[i] = best[i].min(t.elapsed().as_secs_f64());
                continue;
            };
            // VAR or VAR=VALUE: set (to 1 or VALUE) on the second run of each rep.
            let (name, value) = var.split_once('=').unwrap_or((var.as_str(), "1"));
            unsafe {
                if on {
                    std::env::set_var(name, value)
                } else {
                    std::env::remove_var(name)
                }
            };
            let t = Instant::now();
            decode_cpu(&p, &q, k, v, &sl, &lp, &mut o, &mut lse).unwrap();
            best[i] = best[i].min(t.elapsed().as_secs_f64());
        }
    }
    let kh = (b * s * hkv) as f64;
    for (i, best) in best.iter().enumerate() {
        if *best == f64::MAX {
            continue;
        }
        let label = var.as_ref().map_or(String::new(), |v| format!(" {v}={i}"));
        println!("{fmt} B={b} S={s}{label}: best {:.3} ms, {:.2} GB/s, {:.1} ns per key-head (threads {})", best * 1e3, bytes as f64 / best / 1e9, best * 1e9 / kh, rayon::current_num_threads());
    }
}
