//! Variant choice, the launcher's one table: for a kernel, dtype, head dim, causal flag, mask flag,
//! GQA group and key length, which source file, which tiles and which -D defines. `_native.cuda_kernel_variants`
//! exposes it and tests/golden/kernel_variants.json pins it. Shared memory is not decided here:
//! each kernel declares its own (elf.rs reads it from the cubin) and device.rs falls back to the
//! small tiles when the default's does not fit the GPU.

use std::sync::Mutex;

use super::variant::{Kernel, TileSet, Tiles, Variant, ANY_HEAD_DIM};
use crate::dtype::DType;
use crate::error::{FlashError, Result};
use crate::precision::Precision;

/// What a launch specialises a kernel on, besides its tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Spec {
    pub kernel: Kernel,
    pub dtype: DType,
    pub head_dim: usize,
    pub causal: bool,
    /// Windows, padding, segment ids, block masks or varlen (`!Mask::is_plain`): the MASKED kernels,
    /// which take every mask at run time (causal among them, as a window).
    pub masked: bool,
    /// Score modifiers (softcap, ALiBi, sinks; `!Modifiers::is_none`): the MASKED kernels with
    /// MODS=1, which compile them in (implies `masked`).
    pub mods: bool,
    /// Query heads per key/value head.
    pub group: usize,
    /// Sk: EVEN_N drops the ragged-tile mask when it divides BLOCK_N.
    pub seq_k: usize,
    /// f32 on tensor cores (fwd.cu, bwd_dq.cu and bwd_dkdv.cu with cuda/tf32.h; the Hopper f32
    /// kernels cuda/*_sm90_f32.cu): TF32 products per pair, 3 (split TF32, exact) or 1 (TF32); 0: the
    /// SIMT f32 kernels, and every fp16 / bf16 kernel.
    /// [`tf32_terms`] chooses it for a call.
    pub tf32_terms: usize,
    /// The f32 tensor-core products' operands in fp16 (scaled) instead of TF32 (the Hopper f32
    /// kernels: cuda/*_sm90_f32_f16.cu); [`f16_parts`] chooses it for a call.
    pub f16_parts: bool,
}

/// `FLASH_NIF_TF32=0` (read per call) makes `precision="exact"` run the SIMT f32 kernels instead
/// of the split-TF32 one (comparisons, benchmarks); `"tf32"` is unaffected.
pub const TF32_ENV: &str = "FLASH_NIF_TF32";

/// `FLASH_NIF_TF32_PARTS=1` (read per call) makes the Hopper f32 kernels (forward, dQ, dK/dV) take
/// TF32 operands (cuda/*_sm90_f32.cu) instead of fp16 ones (cuda/*_sm90_f32_f16.cu): the same
/// accuracy, for comparisons and benchmarks.
pub const TF32_PARTS_ENV: &str = "FLASH_NIF_TF32_PARTS";

/// Whether a call's f32 tensor-core products take fp16 operands instead of TF32 ones: the Hopper f32
/// kernels', unless `FLASH_NIF_TF32_PARTS=1`. An fp16 part of a power-of-two-scaled operand holds
/// TF32's 11 significant bits at twice its tensor rate (cuda/fwd_sm90_f32_f16.cu): split into two
/// parts under `"exact"` (three products), one under `"tf32"`.
pub fn f16_parts(kernel: Kernel, dtype: DType, tf32_terms: usize) -> bool {
    let tf32_asked = || std::env::var(TF32_PARTS_ENV).map_or(false, |v| v.trim() == "1");
    matches!(kernel, Kernel::FwdSm90 | Kernel::BwdDqSm90 | Kernel::BwdSm90) && dtype == DType::F32 && tf32_terms > 0 && !tf32_asked()
}

/// Fewest keys (Sk) for which `precision="exact"` takes the split-TF32 kernels. A split product
/// keeps ~22 significant bits, so a row that sees a single key gets o = v only to ~2 ulps, where
/// the SIMT kernel is exact (P = 1) — and its dq, exactly 0 in the oracle, is then all error (the
/// backward likewise: dP - delta of such a row is 0 only in exact arithmetic). Short key
/// sequences, where speed does not matter, run SIMT.
pub const MIN_SPLIT_TF32_KEYS: usize = 16;

/// The TF32 products per pair of a call's `kernel` with `seq_k` keys at head dim `head_dim` (see
/// [`Spec::tf32_terms`]); 0 for every dtype but f32, and for the elementwise kernels (which compute
/// in f32 under either precision).
/// - `precision="tf32"`: 1, forward and backward (the portable dQ and dK/dV kernels with or without
///   atomic dQ; the Hopper ones).
/// - `precision="exact"`: 3 (split TF32; its errors against the oracle are within twice the SIMT
///   kernels': tests/test_tf32.py) from MIN_SPLIT_TF32_KEYS keys on, unless `FLASH_NIF_TF32=0`, for
///   - the Hopper kernels (the f32 forward, dK/dV and dQ: cuda/*_sm90_f32.cu) at every head dim they
///     take;
///   - the portable forward at the head dims where split is the faster exact forward: all but the
///     SIMT kernels' (64 and 128, where SIMT measured 0.98-1.05x and 1.08-1.15x split's speed on an
///     H100, split 1.2-1.7x SIMT's at 32, 96 and 256: bench/RESULTS.md).
///
///   The portable backward under `"exact"` stays SIMT: its split-TF32 form (as accurate) measured
///   slower (H100: 25-35 against 33-37 TFLOPS, bench/RESULTS.md).
pub fn tf32_terms(kernel: Kernel, dtype: DType, precision: Precision, seq_k: usize, head_dim: usize) -> usize {
    let split_allowed = || std::env::var(TF32_ENV).map_or(true, |v| v.trim() != "0");
    if dtype != DType::F32 || !has_tf32(kernel) {
        return 0;
    }
    let split = seq_k >= MIN_SPLIT_TF32_KEYS && split_allowed();
    match precision {
        Precision::Exact if kernel.is_sm90() && split => 3,
        Precision::Exact if kernel == Kernel::Fwd && !simt_f32(head_dim) && split => 3,
        Precision::Exact => 0,
        Precision::Tf32 => 1,
    }
}

/// The kernels with a tensor-core f32 form (cuda/tf32.h's mma.sync GEMMs, the Hopper ones' wgmma).
fn has_tf32(kernel: Kernel) -> bool {
    matches!(
        kernel,
        Kernel::Fwd
            | Kernel::FwdSm90
            | Kernel::BwdSm90
            | Kernel::BwdDqSm90
            | Kernel::BwdDq
            | Kernel::BwdDkdv
            | Kernel::BwdDkdvDq
    )
}

/// The variants a launch may use, in order of preference: the default tiles, then the small ones
/// when they differ (or only the development override when one is set).
pub fn candidates(spec: &Spec) -> Vec<Variant> {
    match tile_override(spec.kernel, spec.dtype, spec.head_dim) {
        Some(t) => vec![make_variant(spec, t, TileSet::Override)],
        None => table_candidates(spec),
    }
}

fn table_candidates(spec: &Spec) -> Vec<Variant> {
    let default = variant(spec, TileSet::Default);
    let small = variant(spec, TileSet::Small);
    if small.defines == default.defines {
        vec![default]
    } else {
        vec![default, small]
    }
}

/// The variant with the tiles of `set` (an unset override means the default tiles).
pub fn variant(spec: &Spec, set: TileSet) -> Variant {
    let (k, dt, d) = (spec.kernel, spec.dtype, spec.head_dim);
    if spec.f16_parts && set != TileSet::Override {
        let t = match k {
            Kernel::BwdDqSm90 => sm90_f32_f16_dq_tiles(d),
            Kernel::BwdSm90 => sm90_f32_f16_dkdv_tiles(d),
            _ => sm90_f32_f16_tiles(d, spec.tf32_terms),
        };
        return make_variant(spec, tiles(t), set);
    }
    if spec.tf32_terms > 0 && set != TileSet::Override {
        return make_variant(spec, tiles(tf32_tiles(k, set, d, spec.tf32_terms)), set);
    }
    let t = match set {
        TileSet::Default => tiles(default_tiles(k, dt, d)),
        TileSet::Small => tiles(small_tiles(k, dt, d)),
        TileSet::Override => return make_variant(spec, tile_override(k, dt, d).unwrap_or_else(|| tiles(default_tiles(k, dt, d))), set),
    };
    let t = if spec.masked || spec.mods { masked_tiles(k, dt, d, t, spec.mods) } else { t };
    make_variant(spec, t, set)
}

/// The masked kernels' tiles: the plain ones, except where the run-time masks' registers make
/// them spill (the fp32 SIMT forward's 128 x 128 tile, on sm_80), and, with modifiers, the
/// atomic-dQ dK/dV kernel at D <= 128, which takes 64 keys per block (its 128-key tile spilled
/// 148-384 bytes on sm_90a with the softcap's chain rule, NVRTC 13.5), and at D = 128 splits the
/// head dim over two warps (4 warps of 64 x 64 spilled 32 bytes, 32-row steps 332).
fn masked_tiles(kernel: Kernel, dtype: DType, d: usize, t: Tiles, mods: bool) -> Tiles {
    if kernel == Kernel::FwdSm90 && d <= 64 {
        // Three consumers at 160 registers spilled 28 bytes with the masks (sm_90a): two at 240.
        Tiles { block_m: 128, num_warps: 12, ..t }
    } else if kernel == Kernel::Fwd && dtype == DType::F32 && simt_f32(d) && t.block_n > 64 {
        Tiles { block_n: 64, ..t }
    } else if mods && kernel == Kernel::BwdDq && dtype != DType::F32 && d <= 64 && t.block_n > 64 {
        Tiles { block_n: 64, ..t } // 128 keys spilled 56 bytes at D = 40 (sm_90a)
    } else if mods && kernel == Kernel::BwdDkdv && dtype != DType::F32 && d <= 64 {
        Tiles { block_m: 64, ..t } // 96 query rows spilled 16 bytes with per-tensor strides (sm_90a)
    } else if mods && matches!(kernel, Kernel::BwdDkdv | Kernel::BwdDkdvDq) && dtype == DType::F32 && simt_f32(d) && t.block_n > 64 {
        Tiles { block_n: 64, ..t } // 128 keys spilled 12-28 bytes with per-tensor strides (sm_90a)
    } else if mods && kernel == Kernel::BwdDkdv && dtype != DType::F32 && d > 64 && d <= 128 {
        Tiles { block_m: 64, block_n: 64, num_warps: 8, d_split: 2, ..t } // 4 warps spilled 8 bytes
    } else if mods && kernel == Kernel::BwdDkdvDq && dtype != DType::F32 && d > 128 {
        Tiles { block_m: 16, ..t } // 32 query rows per step spilled 8 bytes (sm_90a)
    } else if mods && kernel == Kernel::BwdDkdvDq && dtype != DType::F32 && d <= 128 {
        if d <= 64 {
            Tiles { block_m: 64, block_n: 64, num_warps: 4, d_split: 1, ..t }
        } else {
            Tiles { block_m: 64, block_n: 64, num_warps: 8, d_split: 2, ..t }
        }
    } else {
        t
    }
}

/// Every (kernel, dtype, head dim, causal or masked) the library launches, default and small tiles
/// (when they differ), at GQA group 1 with a ragged key length: the group and EVEN_N change a loop
/// bound or fold a branch, not the code's shape. The elementwise kernels have no masked variant
/// (masks change only their launch). Tile overrides do not show here. Then every rotary variant
/// (which takes any head dim at run time). Then the KV-cache kernels' (kv_variants.rs).
pub fn all_variants(head_dims: &[usize]) -> Vec<Variant> {
    let mut out = attention_variants(head_dims);
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        for interleaved in [false, true] {
            out.extend(rotary_vecs(dtype).map(|vec| rotary_variant(dtype, interleaved, vec)));
        }
    }
    out.extend(super::kv_variants::all(head_dims));
    out
}

fn attention_variants(head_dims: &[usize]) -> Vec<Variant> {
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        for &head_dim in head_dims {
            let spec = |kernel, causal, masked, mods| Spec { kernel, dtype, head_dim, causal, masked, mods, group: 1, seq_k: 1, tf32_terms: 0, f16_parts: false };
            out.push(variant(&spec(Kernel::BwdPreprocess, false, false, false), TileSet::Default));
            out.push(variant(&spec(Kernel::BwdDqConvert, false, false, false), TileSet::Default));
            out.push(variant(&spec(Kernel::Pad, false, false, false), TileSet::Default));
            out.push(variant(&spec(Kernel::BwdDsinks, false, true, true), TileSet::Default));
            for k in [Kernel::Fwd, Kernel::BwdDq, Kernel::BwdDkdv, Kernel::BwdDkdvDq] {
                for (causal, masked, mods) in [(false, false, false), (true, false, false), (false, true, false), (false, true, true)] {
                    out.extend(table_candidates(&spec(k, causal, masked, mods)));
                }
            }
            if dtype == DType::F32 {
                // The tensor-core f32 forwards: split TF32 ("exact"), then one TF32 product ("tf32").
                for terms in [3, 1] {
                    for (causal, masked, mods) in [(false, false, false), (true, false, false), (false, true, false), (false, true, true)] {
                        out.extend(table_candidates(&Spec { tf32_terms: terms, ..spec(Kernel::Fwd, causal, masked, mods) }));
                    }
                }
                // Then the tensor-core f32 backwards ("tf32" only: "exact" runs SIMT, see tf32_terms).
                for k in [Kernel::BwdDq, Kernel::BwdDkdv, Kernel::BwdDkdvDq] {
                    for (causal, masked, mods) in [(false, false, false), (true, false, false), (false, true, false), (false, true, true)] {
                        out.extend(table_candidates(&Spec { tf32_terms: 1, ..spec(k, causal, masked, mods) }));
                    }
                }
            }
            if dtype == DType::F32 && super::sm90::F32_HEAD_DIMS.contains(&head_dim) {
                // The Hopper f32 forward: plain problems only (sm90.rs), split products ("exact") and
                // one product ("tf32"), each on fp16 operands and on TF32 ones.
                for (terms, f16_parts) in [(3, true), (3, false), (1, true), (1, false)] {
                    for causal in [false, true] {
                        out.extend(table_candidates(&Spec { tf32_terms: terms, f16_parts, ..spec(Kernel::FwdSm90, causal, false, false) }));
                    }
                }
            }
            if dtype == DType::F32 && super::sm90::F32_BWD_HEAD_DIMS.contains(&head_dim) {
                // The Hopper f32 backward, dQ then dK/dV (each on fp16 and on TF32 operands): plain
                // problems only (sm90.rs), both precisions.
                for (k, f16_parts) in [(Kernel::BwdDqSm90, true), (Kernel::BwdDqSm90, false), (Kernel::BwdSm90, true), (Kernel::BwdSm90, false)] {
                    for terms in [3, 1] {
                        for causal in [false, true] {
                            out.extend(table_candidates(&Spec { tf32_terms: terms, f16_parts, ..spec(k, causal, false, false) }));
                        }
                    }
                }
            }
            if dtype != DType::F32 && super::sm90::HEAD_DIMS.contains(&head_dim) {
                for (causal, masked, mods) in [(false, false, false), (true, false, false), (false, true, false), (false, true, true)] {
                    out.extend(table_candidates(&spec(Kernel::FwdSm90, causal, masked, mods)));
                }
            }
            if dtype != DType::F32 && super::sm90::BWD_HEAD_DIMS.contains(&head_dim) {
                // Masked variants are MODS ones (make_variant): one per (dtype, head dim).
                for (causal, masked) in [(false, false), (true, false), (false, true)] {
                    if !masked || head_dim <= 64 {  // sm90.rs: masks at D = 64 only
                        out.extend(table_candidates(&spec(Kernel::BwdSm90, causal, masked, masked)));
                    }
                }
            }
        }
    }
    out
}

fn tiles((block_m, block_n, num_warps, d_split, min_blocks): (usize, usize, usize, usize, usize)) -> Tiles {
    Tiles { block_m, block_n, num_warps, d_split, min_blocks }
}

/// (block_m, block_n, num_warps, d_split, min_blocks) per kernel, dtype and head dim. Chosen by
/// tools/sweep.py on an H100 (bench/RESULTS.md has the numbers); min_blocks = 2 caps the forward at
/// 128 registers so that two 8-warp blocks share an SM.
fn default_tiles(kernel: Kernel, dtype: DType, d: usize) -> (usize, usize, usize, usize, usize) {
    if kernel == Kernel::BwdPreprocess {
        return (32, 1, 8, 1, 1); // 8 warps of 4 rows (block_m rows a block)
    }
    if kernel.is_elementwise() {
        return (8, 1, 8, 1, 1); // 8 warps, one row each
    }
    // The Hopper forward: a producer warpgroup and consumer warpgroups of 64 query rows each (taking
    // turns): three at D = 64 (192 rows), two above; the 4th value is STAGES, the depth of the K
    // and V rings (tools/sweep_sm90.py on an H100; bench/RESULTS.md).
    if kernel == Kernel::FwdSm90 {
        return match d {
            ..=64 => (192, 128, 16, 4, 1),
            ..=128 => (128, 176, 12, 2, 1),
            _ => (128, 80, 12, 2, 1),
        };
    }
    // The Hopper backward: 128 keys per block (two consumer warpgroups of 64), 128 query rows per
    // step at D = 64 (64-row steps were 64 x 64 x 64 products: too short) and 64 at D = 128, Q and
    // dO STAGES = 2 deep (cuda/bwd_sm90.cu; D = 64 and 128 only).
    if kernel == Kernel::BwdDqSm90 || (kernel == Kernel::BwdSm90 && dtype == DType::F32) {
        return sm90_f32_bwd_tiles(kernel, 3, d);
    }
    if kernel == Kernel::BwdSm90 {
        return (if d <= 64 { 128 } else { 64 }, 128, 12, 2, 1);
    }
    // The atomic-dQ dK/dV kernel takes 128 keys per block on 8 warps (the deterministic one: 64 on
    // 4): half the dQ atomics per query, and 8 warps per SM at D = 128 where 4-warp blocks of
    // 115 KiB fit only once. Measured +4-10 % backward on an H100 (bench/RESULTS.md).
    if kernel == Kernel::BwdDkdvDq && dtype != DType::F32 && d <= 128 {
        return if d <= 64 { (96, 128, 8, 1, 1) } else { (64, 128, 8, 1, 1) };
    }
    let kernel = if kernel == Kernel::BwdDkdvDq { Kernel::BwdDkdv } else { kernel };
    if dtype == DType::F32 {
        let (bm, bn) = match kernel {
            Kernel::Fwd if simt_f32(d) => (128, if d <= 64 { 128 } else { 64 }),
            Kernel::Fwd if d <= 64 => (128, 64),
            Kernel::Fwd if d <= 128 => (64, 64),
            Kernel::Fwd => (32, 16),
            Kernel::BwdDq if simt_f32(d) => (if d <= 64 { 128 } else { 64 }, 64),
            Kernel::BwdDkdv if simt_f32(d) => (64, if d <= 64 { 128 } else { 64 }),
            Kernel::BwdDq if d <= 64 => (64, 64),
            Kernel::BwdDq if d <= 128 => (64, 32),
            Kernel::BwdDkdv if d <= 128 => (64, 64),
            _ => (16, 16),
        };
        return (bm, bn, 8, 1, 1);
    }
    match kernel {
        // The forward's 4th value is M_TILES: 16-row tiles per warp (2 = each K/V fragment read
        // from shared memory feeds two mma's).
        Kernel::Fwd if d <= 64 => (128, 64, 4, 2, 1),
        Kernel::Fwd if d <= 128 => (128, 32, 4, 2, 1),
        Kernel::Fwd => (64, 32, 4, 1, 1),
        Kernel::BwdDq if d <= 64 => (64, 128, 4, 1, 1),
        Kernel::BwdDq if d <= 128 => (64, 64, 4, 1, 1),
        Kernel::BwdDq => (64, 32, 4, 1, 1),
        _ if d <= 64 => (96, 64, 4, 1, 1), // 128 x 64 needs 255 regs and spills on sm_80 (NVRTC 13.5)
        _ if d <= 128 => (64, 64, 4, 1, 1),
        _ => (32, 64, 8, 2, 1),
    }
}

/// Tiles for GPUs whose blocks get less shared memory than [`default_tiles`] asks for (sm_86 /
/// sm_89: 99 KiB): every variant here needs at most 101376 bytes (the compile check verifies it).
fn small_tiles(kernel: Kernel, dtype: DType, d: usize) -> (usize, usize, usize, usize, usize) {
    if kernel.is_elementwise() || kernel.is_sm90() {
        return default_tiles(kernel, dtype, d);
    }
    let kernel = if kernel == Kernel::BwdDkdvDq { Kernel::BwdDkdv } else { kernel };
    if dtype == DType::F32 {
        let (bm, bn) = match kernel {
            Kernel::Fwd if d <= 64 => (64, 64),
            Kernel::Fwd if d <= 128 => (64, 32),
            Kernel::Fwd => (32, 16),
            Kernel::BwdDkdv if simt_f32(d) => (64, if d <= 64 { 32 } else { 16 }),
            Kernel::BwdDq if simt_f32(d) => if d <= 64 { (64, 32) } else { (32, 32) },
            _ if d <= 64 => (64, 64),
            _ if d <= 128 => (32, 32),
            _ => (16, 16),
        };
        return (bm, bn, 8, 1, 1);
    }
    match kernel {
        Kernel::Fwd if d <= 128 => default_tiles(kernel, dtype, d),
        Kernel::Fwd => (32, 32, 2, 1, 1),
        Kernel::BwdDq if d <= 64 => default_tiles(kernel, dtype, d),
        Kernel::BwdDq if d <= 128 => (64, 32, 4, 1, 1),
        Kernel::BwdDq => (32, 32, 2, 1, 1),
        _ if d <= 64 => default_tiles(kernel, dtype, d),
        _ if d <= 128 => (32, 64, 4, 1, 1),
        _ => (16, 32, 4, 2, 1),
    }
}

/// The f32 tensor-core kernels' tiles (cuda/tf32.h under fwd.cu, bwd_dq.cu, bwd_dkdv.cu), masked
/// or not. f32 rows take twice the shared memory of 16-bit ones; the small tiles need at most
/// 101376 bytes. Not swept on a GPU yet (bench/RESULTS.md).
fn tf32_tiles(kernel: Kernel, set: TileSet, d: usize, terms: usize) -> (usize, usize, usize, usize, usize) {
    match kernel {
        Kernel::FwdSm90 => sm90_f32_tiles(d, terms),
        Kernel::BwdSm90 | Kernel::BwdDqSm90 => sm90_f32_bwd_tiles(kernel, terms, d),
        Kernel::BwdDq => tf32_dq_tiles(set, d),
        Kernel::BwdDkdv | Kernel::BwdDkdvDq => tf32_dkdv_tiles(set, d),
        _ => tf32_fwd_tiles(set, d),
    }
}

/// The Hopper f32 forward's (cuda/fwd_sm90_f32.cu: a producer warpgroup and two consumer warpgroups
/// of 64 query rows; the 4th value is STAGES, the depth of the V^T ring, sm90_f32_k_stages the K
/// ring's). Q, K and V^T are held as two TF32 parts each: D = 64 takes 64 keys a tile, two stages of
/// each (64 + 64 + 64 KiB); D = 128 32 keys, one K stage and two V^T stages (128 + 32 + 64 = 224 KiB
/// of the 227: two of each would need 256). V^T is the deeper ring because its stage is released
/// last in a consumer's iteration (after P V), K's early (after S). "tf32" (`terms` = 1) holds one
/// part of each: at D = 64 three stages of both (32 + 48 + 48 KiB; +4-5 % at 8192 keys on an H100,
/// the same at 2048); at 128 the exact kernel's rings (two K and three V^T measured 2-6 % slower).
/// Hopper only, so the small tiles are the same.
fn sm90_f32_tiles(d: usize, terms: usize) -> (usize, usize, usize, usize, usize) {
    match (d <= 64, terms == 1) {
        (true, false) => (128, 64, 12, 2, 1),
        (true, true) => (128, 64, 12, 3, 1),
        (false, _) => (128, 32, 12, 2, 1),
    }
}

/// The Hopper f32 forward on fp16 operands (cuda/fwd_sm90_f32_f16.cu; D = 64 and 128): two consumer
/// warpgroups of 64 query rows, 64 keys a tile, two K and two V stages (the 4th value, STAGES; the
/// K ring as deep): under "exact" at D = 128 Q's two parts 64 KiB and the rings 128 KiB. (32 keys
/// a tile, whose ss products read Q's 64 rows per 32 keys: 15-20 % slower at D = 128, H200.) Under
/// "tf32" at D = 64 128 keys a tile: its products are small, so each tile's fixed costs (the
/// exponent's barrier, the mbarriers, the softmax's reductions) weigh; one part leaves the
/// registers for S's 64 floats a thread.
fn sm90_f32_f16_tiles(d: usize, terms: usize) -> (usize, usize, usize, usize, usize) {
    (128, if d <= 64 && terms == 1 { 128 } else { 64 }, 12, 2, 1)
}

/// The Hopper f32 dQ kernel on fp16 operands (cuda/bwd_dq_sm90_f32_f16.cu): two consumer warpgroups
/// of 64 query rows, two stages of K and V; 64 keys a tile at D = 64 (Q, dO 64 KiB, stages 64 KiB),
/// 32 at D = 128 (Q, dO 128 KiB and stages 64 KiB: two stages of 64 keys would need 256).
fn sm90_f32_f16_dq_tiles(d: usize) -> (usize, usize, usize, usize, usize) {
    (128, if d <= 64 { 64 } else { 32 }, 12, 2, 1)
}

/// The Hopper f32 dK/dV kernel on fp16 operands (cuda/bwd_dkdv_sm90_f32_f16.cu): 32 query rows a step,
/// three stages of Q and dO; at D = 64 128 keys (each consumer warpgroup 64, all four products), at
/// D = 128 64 keys (one consumer dV, the other dK: both gradients and a fresh slice would not fit
/// a consumer's registers). K and V 64 KiB either way, a stage 16 KiB (D = 64) or 32 (D = 128).
fn sm90_f32_f16_dkdv_tiles(d: usize) -> (usize, usize, usize, usize, usize) {
    (32, if d <= 64 { 128 } else { 64 }, 12, 3, 1)
}

/// The depth of the Hopper f32 forward's ring of raw f32 tiles on fp16 parts (cuda/fwd_sm90_f32_f16.cu:
/// cp.async copies that many tiles ahead of their conversion; 0: each tile loaded when converted).
/// Under `"tf32"` the producer's loads bounded the kernel: four tiles ahead measured 4-13 % faster at
/// S = 2048; `"exact"` is bound by its products (RESULTS.md, session 37). `FLASH_NIF_RAW_STAGES=<n>`
/// overrides it for measurements (the kernel asserts that its shared memory fits).
fn sm90_f32_f16_raw_stages(terms: usize) -> usize {
    if let Some(n) = std::env::var(RAW_STAGES_ENV).ok().and_then(|v| v.trim().parse().ok()) {
        return n;
    }
    if terms == 1 { 4 } else { 0 }
}
const RAW_STAGES_ENV: &str = "FLASH_NIF_RAW_STAGES";

/// The depth of the Hopper f32 forward's K ring (see sm90_f32_tiles).
fn sm90_f32_k_stages(d: usize, terms: usize) -> usize {
    match (d <= 64, terms == 1) {
        (true, false) => 2,
        (true, true) => 3,
        (false, _) => 1,
    }
}

/// The Hopper f32 backward's (head dims 64 and 128: sm90::F32_BWD_HEAD_DIMS), the 4th value STAGES.
/// Its shared memory holds two TF32 parts of each operand, and TF32 wgmma takes K-major operands
/// only, so the transposed ones are copies of their own:
/// - dK / dV (cuda/bwd_dkdv_sm90_f32.cu): at D = 64 128 keys a block (two consumer warpgroups of
///   64), 32 query rows a step: K and V 128 KiB, and one stage of Q, Q^T, dO and dO^T 64 KiB = 192
///   KiB under "exact" (3 TF32 terms); "tf32" (one term, one part of each) takes two stages in 128
///   KiB. At D = 128 64 keys (the two consumers split the products: one computes dV, the other dK),
///   16 query rows a step: the same 128 + 64 KiB (+4 KiB passing P^T); "tf32" three stages in 208
///   KiB (H200, S = 2048: 10 % faster than two, the same at 8192 causal; 32 rows a step in 200 KiB
///   2 % slower).
/// - dQ (cuda/bwd_dq_sm90_f32.cu): 128 query rows a block (two consumer warpgroups), 32 keys a
///   step: at D = 64 Q and dO 128 KiB, and 2 stages of K, V and K^T 96 KiB = 224 KiB ("tf32" at
///   D = 128 the same bytes: its dQ 28 % faster than with exact's, H200); at D = 128 under "exact"
///   one consumer warpgroup of 64 rows, 16 keys a step, the same bytes.
///
/// Hopper only, so the small tiles are the same.
fn sm90_f32_bwd_tiles(kernel: Kernel, terms: usize, d: usize) -> (usize, usize, usize, usize, usize) {
    let exact = terms == 3;
    match (kernel, d <= 64) {
        (Kernel::BwdDqSm90, false) if exact => (64, 16, 8, 2, 1),
        (Kernel::BwdDqSm90, _) => (128, 32, 12, 2, 1),
        (_, true) => (32, 128, 12, if exact { 1 } else { 2 }, 1),
        (_, false) => (16, 64, 12, if exact { 1 } else { 3 }, 1),
    }
}

/// The forward's (M_TILES = 1 in the 4th place: two 16-row tiles per warp, as the 16-bit forward
/// takes, spilled with the split operands, NVRTC 13.5). The default D <= 128 tiles need at most
/// 135168 bytes (an A100 has 166912), D > 128 204800 (Hopper only). Registers (sm_80 / sm_90a,
/// TF32_TERMS = 3): 170 / 176 at D = 64, 201 / 207 at D = 128, 255 / 254 at D = 256, no spills.
fn tf32_fwd_tiles(set: TileSet, d: usize) -> (usize, usize, usize, usize, usize) {
    match (set, d) {
        (TileSet::Small, ..=128) => (64, 32, 4, 1, 1),
        (TileSet::Small, _) => (32, 16, 2, 1, 1),
        (_, ..=64) => (128, 64, 8, 1, 1),
        (_, ..=128) => (128, 32, 8, 1, 1),
        (_, _) => (64, 32, 4, 1, 1),
    }
}

/// dQ's (bwd_dq.cu: 16 query rows a warp, BLOCK_M = 16 * warps). The default D <= 128 tiles need
/// at most 202752 bytes (D <= 64: 139264), D > 128 199680.
fn tf32_dq_tiles(set: TileSet, d: usize) -> (usize, usize, usize, usize, usize) {
    match (set, d) {
        (TileSet::Small, ..=64) => (64, 32, 4, 1, 1),
        (TileSet::Small, ..=128) => (64, 16, 4, 1, 1),
        (TileSet::Small, _) => (16, 16, 1, 1, 1),
        (_, ..=64) => (128, 64, 8, 1, 1),
        (_, ..=128) => (128, 32, 8, 1, 1),
        (_, _) => (64, 16, 4, 1, 1),
    }
}

/// dK/dV's, with or without atomic dQ (bwd_dkdv.cu: 16 keys a warp slice, BLOCK_N * D_SPLIT = 16 *
/// warps). A warp holds dK and dV of 64 head-dim columns at most (D_SPLIT = 2 at D <= 128, 4
/// above) and 32 query rows a step: 128 columns or 64 rows took 255 registers and spilled with the
/// split operands (NVRTC 13.5). The default tiles need at most 144640 bytes at D <= 128 (fit an
/// A100), 135808 above.
fn tf32_dkdv_tiles(set: TileSet, d: usize) -> (usize, usize, usize, usize, usize) {
    match (set, d) {
        (TileSet::Small, ..=64) => (32, 64, 4, 1, 1),
        (TileSet::Small, ..=128) => (16, 32, 4, 2, 1),
        (TileSet::Small, _) => (16, 16, 4, 4, 1),
        (_, ..=64) => (32, 128, 8, 1, 1),
        (_, ..=128) => (32, 64, 8, 2, 1),
        (_, _) => (16, 32, 8, 4, 1),
    }
}

/// Head dims with the fast fp32 SIMT kernels (cuda/simt_f32.h); other head dims use the generic ones.
fn simt_f32(d: usize) -> bool {
    d % 64 == 0 && d <= 128
}

fn source(kernel: Kernel, dtype: DType, d: usize, tf32_terms: usize, f16_parts: bool) -> &'static str {
    match (kernel, dtype) {
        (Kernel::FwdSm90, DType::F32) if f16_parts => "fwd_sm90_f32_f16.cu",
        (Kernel::BwdDqSm90, DType::F32) if f16_parts => "bwd_dq_sm90_f32_f16.cu",
        (Kernel::BwdSm90, DType::F32) if f16_parts => "bwd_dkdv_sm90_f32_f16.cu",
        (Kernel::Fwd, DType::F32) if tf32_terms > 0 => "fwd.cu",
        (Kernel::BwdDq, DType::F32) if tf32_terms > 0 => "bwd_dq.cu",
        (Kernel::BwdDkdv | Kernel::BwdDkdvDq, DType::F32) if tf32_terms > 0 => "bwd_dkdv.cu",
        (Kernel::Fwd, DType::F32) if simt_f32(d) => "fwd_f32_simt.cu",
        (Kernel::Fwd, DType::F32) => "fwd_f32.cu",
        (Kernel::BwdDkdv | Kernel::BwdDkdvDq, DType::F32) if simt_f32(d) => "bwd_dkdv_f32_simt.cu",
        (Kernel::BwdDq, DType::F32) if simt_f32(d) => "bwd_dq_f32_simt.cu",
        (Kernel::BwdDq, DType::F32) => "bwd_dq_f32.cu",
        (Kernel::BwdDkdv | Kernel::BwdDkdvDq, DType::F32) => "bwd_dkdv_f32.cu",
        (Kernel::Fwd, _) => "fwd.cu",
        (Kernel::FwdSm90, DType::F32) => "fwd_sm90_f32.cu",
        (Kernel::FwdSm90, _) => "fwd_sm90.cu",
        (Kernel::BwdSm90, DType::F32) => "bwd_dkdv_sm90_f32.cu",
        (Kernel::BwdSm90, _) => "bwd_sm90.cu",
        (Kernel::BwdDqSm90, _) => "bwd_dq_sm90_f32.cu",
        (Kernel::BwdDq, _) => "bwd_dq.cu",
        (Kernel::BwdDkdv | Kernel::BwdDkdvDq, _) => "bwd_dkdv.cu",
        (Kernel::BwdPreprocess, _) => "bwd_preprocess.cu",
        (Kernel::BwdDqConvert, _) => "bwd_dq_convert.cu",
        (Kernel::BwdDsinks, _) => "bwd_dsinks.cu",
        (Kernel::Pad, _) => "pad.cu",
        (Kernel::Rotary, _) => "rotary.cu",
        (Kernel::Decode | Kernel::DecodeSimt | Kernel::MergeStates | Kernel::QuantizeKv | Kernel::DequantizeKv, _) => {
            super::kv_variants::source(kernel)
        }
    }
}

/// FLASH_DTYPE (cuda/params.h).
pub(super) fn dtype_code(d: DType) -> i64 {
    match d {
        DType::F16 => 0,
        DType::BF16 => 1,
        DType::F32 => 2,
    }
}

fn make_variant(spec: &Spec, t: Tiles, tile_set: TileSet) -> Variant {
    let Spec { kernel, dtype, head_dim, causal, mods, group, seq_k, tf32_terms, f16_parts, .. } = *spec;
    // The Hopper backward's masked kernels always compile the modifiers in (run-time values: none
    // is the identity): without them its D = 128 kernel spilled 28 bytes (sm_90a, NVRTC 13.0).
    let mods = mods || (kernel == Kernel::BwdSm90 && spec.masked);
    let masked = spec.masked || mods;
    let mut defines: Vec<(&'static str, i64)> =
        vec![("FLASH_DTYPE", dtype_code(dtype)), ("HEAD_DIM", head_dim as i64), ("NUM_WARPS", t.num_warps as i64)];
    if kernel == Kernel::BwdDsinks {
        defines.push(("MASKED", 1)); // the sinks live in the MASKED params
    }
    if kernel == Kernel::BwdPreprocess {
        defines.push(("BLOCK_M", t.block_m as i64)); // rows a block
    }
    if !kernel.is_elementwise() {
        // Masked kernels take causal as a window and mask ragged key tiles at run time.
        defines.push(("IS_CAUSAL", (causal && !masked) as i64));
        if masked {
            defines.push(("MASKED", 1));
        }
        if mods {
            defines.push(("MODS", 1));
        }
        defines.extend([
            ("GQA_GROUP", group as i64),
            ("BLOCK_M", t.block_m as i64),
            ("BLOCK_N", t.block_n as i64),
            ("EVEN_N", (!masked && seq_k % t.block_n == 0) as i64),
        ]);
        if (kernel == Kernel::BwdDkdv || kernel == Kernel::BwdDkdvDq) && (dtype != DType::F32 || tf32_terms > 0) {
            defines.push(("D_SPLIT", t.d_split as i64));
        }
        if kernel == Kernel::BwdDkdvDq {
            defines.push(("ATOMIC_DQ", 1));
        }
        if kernel == Kernel::Fwd && (dtype != DType::F32 || tf32_terms > 0) {
            defines.push(("M_TILES", t.d_split as i64));
        }
        if tf32_terms > 0 {
            defines.push(("TF32_TERMS", tf32_terms as i64));
        }
        if f16_parts {
            defines.push(("F16_PARTS", 1));
        }
        if kernel == Kernel::FwdSm90 {
            defines.push(("STAGES", t.d_split as i64));
            if f16_parts {
                defines.push(("K_STAGES", t.d_split as i64));
                defines.push(("RAW_STAGES", sm90_f32_f16_raw_stages(tf32_terms) as i64));
            } else if dtype == DType::F32 {
                defines.push(("K_STAGES", sm90_f32_k_stages(head_dim, tf32_terms) as i64));
            } else {
                // The consumer warpgroups take turns issuing their products (cuda/fwd_sm90.cu).
                defines.push(("PINGPONG", (t.num_warps >= 12) as i64));
            }
        }
        if kernel == Kernel::BwdSm90 || kernel == Kernel::BwdDqSm90 {
            defines.push(("STAGES", t.d_split as i64));
        }
        defines.push(("MIN_BLOCKS", t.min_blocks as i64));
    }
    Variant { kernel, dtype, head_dim, source: source(kernel, dtype, head_dim, tf32_terms, f16_parts), tiles: t, tile_set, defines }
}

/// Warps per block of the rotary kernel (one row of x per 2^k threads; see cuda/rotary.cu).
const ROTARY_WARPS: usize = 8;

/// The rotary kernel's vector widths for `dtype`, widest first: elements per access, at most 16
/// bytes of x (cuda/rotary.cu's VEC). The launcher takes the widest the call's sizes and pointers allow.
pub fn rotary_vecs(dtype: DType) -> impl Iterator<Item = usize> {
    [8, 4, 2, 1].into_iter().filter(move |v| v * dtype.size_bytes() <= 16)
}

/// The rotary kernel for `dtype`, layout and vector width (forward and backward: the sign of the
/// angle is a run-time parameter).
pub fn rotary_variant(dtype: DType, interleaved: bool, vec: usize) -> Variant {
    let t = Tiles { block_m: 1, block_n: 1, num_warps: ROTARY_WARPS, d_split: 1, min_blocks: 1 };
    let defines = vec![
        ("FLASH_DTYPE", dtype_code(dtype)),
        ("NUM_WARPS", ROTARY_WARPS as i64),
        ("INTERLEAVED", interleaved as i64),
        ("VEC", vec as i64),
    ];
    let source = source(Kernel::Rotary, dtype, ANY_HEAD_DIM, 0, false);
    Variant { kernel: Kernel::Rotary, dtype, head_dim: ANY_HEAD_DIM, source, tiles: t, tile_set: TileSet::Default, defines }
}

/// Development hook (tools/sweep*.py): tiles forced on every launch of one (kernel, dtype, head
/// dim) in this process, with no small-tile fallback.
static OVERRIDES: Mutex<Vec<((Kernel, DType, usize), Tiles)>> = Mutex::new(Vec::new());

/// Sets (Some) or clears (None) the tiles of one (kernel, dtype, head dim) for this process.
pub fn set_tile_override(kernel: Kernel, dtype: DType, head_dim: usize, tiles: Option<Tiles>) -> Result<()> {
    if let Some(t) = tiles {
        if kernel.is_elementwise() || kernel.is_decode() {
            return Err(FlashError::Unsupported(format!("{} has no tiles to override", kernel.name())));
        }
        if [t.block_m, t.block_n, t.num_warps, t.d_split, t.min_blocks].contains(&0) {
            return Err(FlashError::Unsupported(format!("tile sizes must be positive; got {t:?}")));
        }
    }
    let mut o = OVERRIDES.lock().map_err(|_| FlashError::Internal("tile overrides poisoned".into()))?;
    o.retain(|(key, _)| *key != (kernel, dtype, head_dim));
    o.extend(tiles.map(|t| ((kernel, dtype, head_dim), t)));
    Ok(())
}

fn tile_override(kernel: Kernel, dtype: DType, head_dim: usize) -> Option<Tiles> {
    let o = OVERRIDES.lock().ok()?;
    o.iter().find(|(key, _)| *key == (kernel, dtype, head_dim)).map(|(_, t)| *t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kernel: Kernel, dtype: DType, head_dim: usize) -> Spec {
        Spec { kernel, dtype, head_dim, causal: true, masked: false, mods: false, group: 2, seq_k: 97, tf32_terms: 0, f16_parts: false }
    }

    #[test]
    fn the_hopper_f32_kernels_take_fp16_operands() {
        for k in [Kernel::FwdSm90, Kernel::BwdDqSm90, Kernel::BwdSm90] {
            assert!(f16_parts(k, DType::F32, 3) && f16_parts(k, DType::F32, 1), "{k:?}");
            assert!(!f16_parts(k, DType::F32, 0) && !f16_parts(k, DType::BF16, 0), "{k:?}");
            for d in [64, 128] {
                for terms in [3, 1] {
                    let v = variant(&Spec { tf32_terms: terms, f16_parts: true, ..spec(k, DType::F32, d) }, TileSet::Default);
                    assert!(v.source.ends_with("_sm90_f32_f16.cu"), "{}", v.source);
                    assert_eq!(v.math(), if terms == 3 { "3xf16" } else { "1xf16" });
                    let t = variant(&Spec { tf32_terms: terms, f16_parts: false, ..spec(k, DType::F32, d) }, TileSet::Default);
                    assert!(t.source.ends_with("_sm90_f32.cu") && t.name() != v.name(), "{}", t.source);
                }
            }
        }
        assert!(!f16_parts(Kernel::Fwd, DType::F32, 3), "the portable kernels keep TF32 parts");
    }

    #[test]
    fn warps_cover_the_tile() {
        for v in all_variants(&(8..=256).step_by(8).collect::<Vec<_>>()) {
            let t = v.tiles;
            if v.dtype != DType::F32 || v.defines.iter().any(|(k, _)| *k == "TF32_TERMS") {
                match v.kernel {
                    Kernel::Fwd => assert_eq!(t.block_m, 16 * t.num_warps * t.d_split, "{}", v.name()),
                    Kernel::FwdSm90 => assert_eq!(t.block_m, 64 * (t.num_warps / 4 - 1), "{}", v.name()),
                    // The f32 dK/dV kernel at D = 128: both consumer warpgroups on the same 64 keys.
                    Kernel::BwdSm90 if v.dtype == DType::F32 && v.head_dim == 128 => assert_eq!(t.block_n, 64, "{}", v.name()),
                    Kernel::BwdSm90 => assert_eq!(t.block_n, 64 * (t.num_warps / 4 - 1), "{}", v.name()),
                    Kernel::BwdDqSm90 => assert_eq!(t.block_m, 64 * (t.num_warps / 4 - 1), "{}", v.name()),
                    Kernel::BwdDq => assert_eq!(t.block_m, 16 * t.num_warps, "{}", v.name()),
                    Kernel::BwdDkdv | Kernel::BwdDkdvDq => {
                        assert_eq!(t.block_n * t.d_split, 16 * t.num_warps, "{}", v.name())
                    }
                    Kernel::BwdPreprocess | Kernel::BwdDqConvert | Kernel::BwdDsinks | Kernel::Pad | Kernel::Rotary => {}
                    Kernel::Decode | Kernel::DecodeSimt | Kernel::MergeStates | Kernel::QuantizeKv | Kernel::DequantizeKv => {}
                }
            }
        }
    }

    #[test]
    fn even_n_follows_the_key_length() {
        let v = variant(&Spec { seq_k: 256, ..spec(Kernel::Fwd, DType::BF16, 64) }, TileSet::Default);
        assert!(v.defines.contains(&("EVEN_N", 1)));
        let v = variant(&spec(Kernel::Fwd, DType::BF16, 64), TileSet::Default);
        assert!(v.defines.contains(&("EVEN_N", 0)));
        assert!(!v.defines.iter().any(|(k, _)| *k == "EVEN_M"));
    }

    #[test]
    fn masked_variants_fold_causal_and_the_ragged_tile_into_run_time() {
        let v = variant(&Spec { masked: true, seq_k: 256, ..spec(Kernel::Fwd, DType::BF16, 64) }, TileSet::Default);
        for d in [("MASKED", 1), ("IS_CAUSAL", 0), ("EVEN_N", 0)] {
            assert!(v.defines.contains(&d), "{:?}", v.defines);
        }
        let plain = variant(&spec(Kernel::Fwd, DType::BF16, 64), TileSet::Default);
        assert!(!plain.defines.iter().any(|(k, _)| *k == "MASKED"), "plain names stay as they were");
        let e = variant(&Spec { masked: true, ..spec(Kernel::BwdPreprocess, DType::BF16, 64) }, TileSet::Default);
        assert!(!e.defines.iter().any(|(k, _)| *k == "MASKED"));
    }

    #[test]
    fn rotary_variants_take_any_head_dim_and_at_most_16_bytes_per_access() {
        let rotary: Vec<Variant> = all_variants(&[64]).into_iter().filter(|v| v.kernel == Kernel::Rotary).collect();
        assert_eq!(rotary.len(), 2 * (4 + 4 + 3), "f16 / bf16: VEC 8, 4, 2, 1; f32: 4, 2, 1; both layouts");
        for v in &rotary {
            assert_eq!((v.head_dim, v.source), (ANY_HEAD_DIM, "rotary.cu"));
            let vec = v.defines.iter().find(|(k, _)| *k == "VEC").unwrap().1 as usize;
            assert!(vec * v.dtype.size_bytes() <= 16, "{}", v.name());
            assert!(!v.defines.iter().any(|(k, _)| *k == "HEAD_DIM"), "{}", v.name());
        }
        assert_eq!(rotary_variant(DType::BF16, true, 8).name(), "rotary_bf16_num_warps8_interleaved1_vec8");
    }

    #[test]
    fn f32_forward_runs_on_tensor_cores_by_precision() {
        assert_eq!(tf32_terms(Kernel::Fwd, DType::F32, Precision::Tf32, 1, 64), 1);
        if std::env::var(TF32_ENV).is_err() {
            for d in [8, 32, 40, 72, 96, 136, 256] {
                assert_eq!(tf32_terms(Kernel::Fwd, DType::F32, Precision::Exact, MIN_SPLIT_TF32_KEYS, d), 3, "D = {d}");
            }
        }
        for d in [64, 128] {
            assert_eq!(tf32_terms(Kernel::Fwd, DType::F32, Precision::Exact, 4096, d), 0, "D = {d}: SIMT is faster");
        }
        assert_eq!(tf32_terms(Kernel::Fwd, DType::F32, Precision::Exact, MIN_SPLIT_TF32_KEYS - 1, 96), 0, "short keys: SIMT");
        for (k, dt) in [(Kernel::BwdPreprocess, DType::F32), (Kernel::BwdDqConvert, DType::F32), (Kernel::Fwd, DType::BF16), (Kernel::BwdDkdvDq, DType::F16)] {
            for p in [Precision::Exact, Precision::Tf32] {
                assert_eq!(tf32_terms(k, dt, p, 4096, 96), 0, "{k:?} {dt:?} {p:?}");
            }
        }
        for (terms, math) in [(3, "3xtf32"), (1, "tf32")] {
            for d in [8, 40, 64, 72, 128, 136, 256] {
                for set in [TileSet::Default, TileSet::Small] {
                    let v = variant(&Spec { tf32_terms: terms, ..spec(Kernel::Fwd, DType::F32, d) }, set);
                    assert_eq!((v.source, v.math()), ("fwd.cu", math), "{}", v.name());
                    assert!(v.name().contains(&format!("_m_tiles1_tf32_terms{terms}_")), "{}", v.name());
                }
            }
        }
        let simt = variant(&spec(Kernel::Fwd, DType::F32, 64), TileSet::Default);
        assert_eq!((simt.source, simt.math()), ("fwd_f32_simt.cu", "f32-simt"));
        assert!(!simt.defines.iter().any(|(k, _)| *k == "TF32_TERMS" || *k == "M_TILES"), "SIMT names stay as they were");
    }

    #[test]
    fn f32_backward_runs_on_tf32_tensor_cores_by_precision() {
        let bwd = [(Kernel::BwdDq, "bwd_dq.cu"), (Kernel::BwdDkdv, "bwd_dkdv.cu"), (Kernel::BwdDkdvDq, "bwd_dkdv.cu")];
        for (k, src) in bwd {
            assert_eq!(tf32_terms(k, DType::F32, Precision::Tf32, 1, 96), 1, "{k:?}");
            if std::env::var(TF32_ENV).is_err() {
                assert_eq!(tf32_terms(k, DType::F32, Precision::Exact, MIN_SPLIT_TF32_KEYS, 96), 0, "{k:?}: exact runs SIMT");
            }
            assert_eq!(tf32_terms(k, DType::F32, Precision::Exact, MIN_SPLIT_TF32_KEYS - 1, 96), 0, "{k:?}: short keys run SIMT");
            for (terms, math) in [(3, "3xtf32"), (1, "tf32")] {
                for d in [8, 40, 64, 72, 128, 136, 256] {
                    for set in [TileSet::Default, TileSet::Small] {
                        for (masked, mods) in [(false, false), (true, false), (true, true)] {
                            let v = variant(&Spec { tf32_terms: terms, masked, mods, ..spec(k, DType::F32, d) }, set);
                            assert_eq!((v.source, v.math()), (src, math), "{}", v.name());
                            assert!(v.name().contains(&format!("_tf32_terms{terms}_")), "{}", v.name());
                            if k != Kernel::BwdDq {
                                // DPAD / D_SPLIT must stay a multiple of the mma k step; at most 64 columns a warp.
                                let ds = v.tiles.d_split;
                                assert!(v.defines.contains(&("D_SPLIT", ds as i64)), "{}", v.name());
                                assert!(d.next_multiple_of(8 * ds) / ds <= 64, "{}", v.name());
                            }
                            assert_eq!(v.defines.contains(&("ATOMIC_DQ", 1)), k == Kernel::BwdDkdvDq, "{}", v.name());
                        }
                    }
                }
            }
        }
        for (k, src) in [(Kernel::BwdDq, "bwd_dq_f32_simt.cu"), (Kernel::BwdDkdvDq, "bwd_dkdv_f32_simt.cu")] {
            let simt = variant(&spec(k, DType::F32, 64), TileSet::Default);
            assert_eq!((simt.source, simt.math()), (src, "f32-simt"));
            assert!(!simt.defines.iter().any(|(k, _)| *k == "TF32_TERMS" || *k == "D_SPLIT"), "SIMT names stay as they were");
        }
    }

    #[test]
    fn hopper_f32_backward_is_split_tf32_under_exact() {
        for k in [Kernel::BwdSm90, Kernel::BwdDqSm90] {
            assert_eq!(tf32_terms(k, DType::F32, Precision::Tf32, 1, 64), 1, "{k:?}");
            if std::env::var(TF32_ENV).is_err() {
                assert_eq!(tf32_terms(k, DType::F32, Precision::Exact, MIN_SPLIT_TF32_KEYS, 64), 3, "{k:?}");
            }
            let short = tf32_terms(k, DType::F32, Precision::Exact, MIN_SPLIT_TF32_KEYS - 1, 64);
            assert_eq!(short, 0, "{k:?}: short keys");
            for dt in [DType::F16, DType::BF16] {
                assert_eq!(tf32_terms(k, dt, Precision::Tf32, 4096, 64), 0, "{k:?} {dt:?}");
            }
        }
        let (dkdv, dq) = (Kernel::BwdSm90, Kernel::BwdDqSm90);
        assert_eq!((dq.name(), dq.entry(), dq.is_sm90()), ("bwd_dq_sm90", "flash_bwd_dq_sm90", true));
        // (kernel, head dim, source, tiles under "exact", under "tf32")
        let want = [
            (dkdv, 64, "bwd_dkdv_sm90_f32.cu", (32, 128, 12, 1, 1), (32, 128, 12, 2, 1)),
            (dq, 64, "bwd_dq_sm90_f32.cu", (128, 32, 12, 2, 1), (128, 32, 12, 2, 1)),
            (dkdv, 128, "bwd_dkdv_sm90_f32.cu", (16, 64, 12, 1, 1), (16, 64, 12, 3, 1)),
            (dq, 128, "bwd_dq_sm90_f32.cu", (64, 16, 8, 2, 1), (128, 32, 12, 2, 1)),
        ];
        for (k, d, src, exact_tiles, tf32_tiles) in want {
            for (terms, math, t) in [(3i64, "3xtf32", exact_tiles), (1, "tf32", tf32_tiles)] {
                for set in [TileSet::Default, TileSet::Small] {
                    let v = variant(&Spec { tf32_terms: terms as usize, ..spec(k, DType::F32, d) }, set);
                    assert_eq!((v.source, v.math(), v.tiles), (src, math, tiles(t)), "{}", v.name());
                    let (stages, rows) = (t.3 as i64, t.0 as i64);
                    for def in [("TF32_TERMS", terms), ("STAGES", stages), ("BLOCK_M", rows), ("IS_CAUSAL", 1)] {
                        assert!(v.defines.contains(&def), "{}: {def:?}", v.name());
                    }
                    let name = format!("{}_f32_d{d}_num_warps{}_is_causal1_gqa_group2_", k.name(), t.2);
                    assert!(v.name().starts_with(&name), "{}", v.name());
                }
            }
        }
        // The 16-bit Hopper backward keeps its file and tiles.
        let v = variant(&spec(dkdv, DType::BF16, 64), TileSet::Default);
        assert_eq!((v.source, v.tiles), ("bwd_sm90.cu", tiles((128, 128, 12, 2, 1))));
        // The table lists both kernels, both precisions, on fp16 and on TF32 operands, causal or not,
        // at the Hopper f32 backward's head dims only.
        let table = attention_variants(&[64, 128, 256]);
        for k in [dkdv, dq] {
            let f32s: Vec<_> = table.iter().filter(|v| v.kernel == k && v.dtype == DType::F32).collect();
            assert_eq!(f32s.len(), 16, "{k:?}");
            assert!(f32s.iter().all(|v| v.head_dim <= 128 && !v.defines.iter().any(|(d, _)| *d == "MASKED")));
        }
    }

    #[test]
    fn small_tiles_follow_the_default_only_when_they_differ() {
        assert_eq!(candidates(&spec(Kernel::Fwd, DType::BF16, 64)).len(), 1);
        let c = candidates(&spec(Kernel::Fwd, DType::BF16, 256));
        assert_eq!(c.iter().map(|v| v.tile_set).collect::<Vec<_>>(), [TileSet::Default, TileSet::Small]);
    }

    #[test]
    fn an_override_replaces_both_tile_sets_until_cleared() {
        // A head dim no other test uses: the override is process-wide.
        let (k, dt, d) = (Kernel::BwdDq, DType::F16, 248);
        let t = Tiles { block_m: 32, block_n: 32, num_warps: 2, d_split: 1, min_blocks: 1 };
        set_tile_override(k, dt, d, Some(t)).unwrap();
        let c = candidates(&spec(k, dt, d));
        assert_eq!((c.len(), c[0].tiles, c[0].tile_set), (1, t, TileSet::Override));
        set_tile_override(k, dt, d, None).unwrap();
        assert_eq!(candidates(&spec(k, dt, d))[0].tile_set, TileSet::Default);
        assert!(set_tile_override(Kernel::BwdPreprocess, dt, d, Some(t)).is_err());
    }
}
