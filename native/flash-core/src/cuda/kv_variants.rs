//! The KV-cache kernels' part of the variant table (config.rs lists them after the others): decode
//! on tensor cores (cuda/decode.cu, fp16 / bf16 at head dims 64, 128, 256) or on CUDA cores
//! (cuda/decode_simt.cu, every dtype, D at run time), the state merge (cuda/merge.cu) and the
//! cache format's conversions (cuda/quantize_kv.cu, cuda/dequantize_kv.cu). Which decode kernel a
//! call gets, with which tiles, is decided here; decode.rs and kv.rs launch them.

use super::config::dtype_code;
use super::variant::{Kernel, TileSet, Tiles, Variant, ANY_HEAD_DIM};
use crate::dtype::DType;

/// Head dims of the tensor-core decode kernel; fp32 and every other head dim run the SIMT one.
pub const DECODE_MMA_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// The shapes a decode kernel may take, in order of preference: warps of a block, each a tile of
/// query states (cuda/decode.h), the depth of its cp.async pipeline (STAGES) and MIN_BLOCKS, for
/// the tensor-core kernel at head dim `d` and cache bits `bits` (the SIMT kernel: `d` =
/// ANY_HEAD_DIM). A tensor-core stage holds 16 plain keys per warp (a D = 128 bf16 stage: 37 KiB);
/// two stages keep one in flight while one is read, and leave room for three blocks or more per
/// H100 SM (43 KiB at D = 64, 74 KiB at D = 128; D = 256 takes 2 warps, 69 KiB), quantized caches
/// filling the same stages with more keys. The plain cache at D = 128 prefers three stages (111 KiB,
/// two blocks per SM: more bytes in flight; 1-4 % faster on the H100, RESULTS), which an sm_86 /
/// sm_89 (99 KiB) cannot hold: the next shape, which fits every GPU, serves there. The SIMT kernel:
/// 3 stages of 32 KiB. MIN_BLOCKS: at D = 128 three blocks need at most 168 registers (ptxas used
/// 132 plain and 149-165 4-bit, by group sizes, with NVRTC 13.5; four blocks at 128 were no
/// faster, RESULTS); 8-bit codes spill under that cap and compile with 2 (ptxas then used 167-168,
/// which still leaves three blocks); elsewhere shared memory bounds the blocks first.
fn decode_shapes(d: usize, bits: usize) -> Vec<(usize, usize, usize)> {
    match (d, bits) {
        (256, _) => vec![(2, 2, 1)],
        (128, 0) => vec![(4, 3, 2), (4, 2, 3)],
        (128, 8) => vec![(4, 2, 2)],
        (128, _) => vec![(4, 2, 3)],
        (64, _) => vec![(4, 2, 1)],
        _ => vec![(4, 3, 1)],
    }
}

/// The cache formats the tensor-core kernel is compiled for (CACHE_BITS: 0 plain, 4 or 8 bits), one
/// kernel each; the SIMT kernel takes the bits at run time.
pub const DECODE_MMA_BITS: [usize; 3] = [0, 4, 8];

/// Warps of the merge and conversion kernels (grid-stride; no shared memory).
pub const ELEMENTWISE_WARPS: usize = 8;

/// The kernel's source file.
pub(super) fn source(kernel: Kernel) -> &'static str {
    match kernel {
        Kernel::Decode => "decode.cu",
        Kernel::DecodeSimt => "decode_simt.cu",
        Kernel::MergeStates => "merge.cu",
        Kernel::QuantizeKv => "quantize_kv.cu",
        _ => "dequantize_kv.cu",
    }
}

/// Query states per warp: the mma's n for the tensor-core kernel, what the registers hold for the
/// SIMT one (each kernel checks its STATE_TILE). A variant carries it as `tiles.block_m`.
fn state_tile(kernel: Kernel) -> usize {
    if kernel == Kernel::Decode {
        8
    } else {
        4
    }
}

/// The tensor-core kernel's PAIRED tile (cuda/decode.cu): 4 states a warp, whose step's two blocks
/// share the mma's 8 columns, so that the per-score work (scale terms, softmax, V weights) runs
/// once for both, where the tile of 8 spends half its lanes on states that do not exist. bf16 q
/// over 4-bit caches at head dims up to 128 where a kv head has at most this many states (GQA 4 or
/// less at Sq = 1): the default kernels (two blocks a step already), and decode_one_wave's at groups
/// of 64 (which then take two blocks a step too). H200, graph, 4-bit: 8 x 8192 30.9-31.3 us against
/// 32.2, 1 x 131072 51.5-51.6 against 53.0-53.1 (RESULTS, session 54). fp16 q (and 8-bit caches,
/// no faster) keep the tile of 8: they spilled with it.
const PAIRED_STATE_TILE: usize = 4;

fn paired(dtype: DType, head_dim: usize, bits: usize, states: usize) -> bool {
    dtype == DType::BF16 && bits == 4 && head_dim <= 128 && states <= PAIRED_STATE_TILE
}

/// The tensor-core kernel's query states per warp for `states` a kv head: the PAIRED tile where
/// paired() allows, else the tile of 8.
fn mma_state_tile(dtype: DType, head_dim: usize, bits: usize, states: usize) -> usize {
    if paired(dtype, head_dim, bits, states) { PAIRED_STATE_TILE } else { state_tile(Kernel::Decode) }
}

/// Whether decode at this dtype and head dim runs on tensor cores.
pub fn decode_uses_mma(dtype: DType, head_dim: usize) -> bool {
    dtype != DType::F32 && DECODE_MMA_HEAD_DIMS.contains(&head_dim)
}

/// The group sizes (k, v) the quantized tensor-core kernels are compiled for, one kernel each: the
/// groups' layout is fixed in the kernel (the products take the codes as they are and each group's
/// scale and bias afterwards, cuda/decode_q4.h and decode_q8.h), so that the stage layout, scale
/// offsets and copies fold to immediates.
pub const DECODE_QUANT_GROUPS: [(usize, usize); 4] = [(64, 64), (32, 32), (64, 32), (32, 64)];

/// The decode kernels a call over caches of `bits` (0: plain) in groups of `groups` = (k, v)
/// elements (quantized caches) with `states` query states a kv head (GQA group x Sq) may use, in
/// order of preference (device.rs's `choose` takes the first whose shared memory fits the GPU); the
/// last fits every GPU the library runs on.
pub fn decode_candidates(dtype: DType, head_dim: usize, bits: usize, groups: (usize, usize), states: usize) -> Vec<Variant> {
    let mma = decode_uses_mma(dtype, head_dim);
    let shapes = if mma { decode_shapes(head_dim, bits) } else { decode_shapes(ANY_HEAD_DIM, 0) };
    let kernel = if mma { Kernel::Decode } else { Kernel::DecodeSimt };
    let tile = if mma { mma_state_tile(dtype, head_dim, bits, states) } else { state_tile(kernel) };
    let last = shapes.len() - 1;
    // The fallback that fits every GPU is the small tile set (compiled and checked where small
    // tiles launch; kernels.py).
    let set = |i: usize| if i == last && last > 0 { TileSet::Small } else { TileSet::Default };
    shapes.into_iter().enumerate().map(|(i, shape)| decode_variant(dtype, head_dim, bits, groups, shape, tile, set(i))).collect()
}

/// The quantized tensor-core kernels at D = 128 with four, eight or sixteen blocks an SM
/// (ONE_WAVE_SHAPES; 128 registers, one 16-key block a softmax step, decode.cu STEP_BLOCKS), in
/// order of blocks an SM, which decode.rs takes only on Hopper where one fits a grid in one wave
/// that the chosen kernel needs more for. Elsewhere the 128-register code, slower per block, loses
/// (H200, bf16 q, graph, us, two steps a block at 128 registers / three blocks: 64 x 1024
/// 32.1-32.3 / 33.9-34.4, but 8 x 8192 36.6-36.8 / 32.2-32.3; RESULTS, session 50); where it fits,
/// 128 x 512 4-bit 39.3 -> 32.0-32.3 us and 8-bit 54.7 -> 42.9-43.1 at eight blocks, 256 x 256
/// 49.9-50.1 -> 37.0 and 71.1-72.0 -> 45.1-45.2 at sixteen (session 51). 4-bit at four blocks: equal K and V group
/// sizes only (the mixed pairs spill at 128 registers); 8-bit: groups of 64 (32 spill), with
/// 64-key stages at four blocks (decode.h DECODE_TMA_WARP_BLOCKS). `states`: query states a kv head;
/// where paired() allows, groups of 64 take the PAIRED tile here too (two blocks a step at 128
/// registers). H200, graph, 4-bit, us, tile 8 / PAIRED (RESULTS, session 54): 64 x 1024 (four
/// blocks an SM) 31.5-32.3 / 28.9-29.0, 32 x 2048 34.9-36.0 / 31.9-32.2, 128 x 512 (eight)
/// 32.3-32.7 / 29.5-29.7, 256 x 256 (sixteen) 37.4-37.7 / 34.2-34.5. They spill a few bytes outside
/// the block step (flash_nif.kernels' SPILL_ALLOWANCE says where).
pub fn decode_one_wave(dtype: DType, head_dim: usize, bits: usize, groups: (usize, usize), states: usize) -> Vec<Variant> {
    let fits = match bits {
        4 => groups.0 == groups.1,
        8 => groups == (64, 64),
        _ => false,
    };
    if !(decode_uses_mma(dtype, head_dim) && head_dim == 128 && fits) {
        return Vec::new();
    }
    ONE_WAVE_SHAPES
        .iter()
        .filter(|&&(warps, _, _)| warps == 4 || groups == (64, 64))
        .map(|&shape| {
            let tile = if groups == (64, 64) { mma_state_tile(dtype, head_dim, bits, states) } else { state_tile(Kernel::Decode) };
            decode_variant(dtype, head_dim, bits, groups, shape, tile, TileSet::Default)
        })
        .collect()
}

/// The plain tensor-core kernel at D = 128 with four two-warp blocks an SM, three stages each (as
/// the default's two four-warp blocks: the same stages in flight an SM, twice the blocks, each
/// block's fixed time overlapped by more), which decode.rs takes on Hopper for grids past one wave
/// of the default. H200, bf16, graph, us, default / this: 64 x 1024 71.6-71.7 / 67.9-68.0, 128 x 512
/// 76.8-76.9 / 73.1-73.2, 256 x 256 81.5-81.9 / 78.0-78.1, 48 x 1365 79.8-80.0 / 71.0-71.2 (RESULTS,
/// session 51); one-warp blocks, fewer bytes in flight, were slower. 56832 bytes of shared memory:
/// four fit Hopper's SM only (decode.rs checks the occupancy).
pub fn decode_plain_past_a_wave(dtype: DType, head_dim: usize) -> Option<Variant> {
    (decode_uses_mma(dtype, head_dim) && head_dim == 128).then(|| decode_variant(dtype, head_dim, 0, (0, 0), (2, 3, 4), state_tile(Kernel::Decode), TileSet::Default))
}

/// The quantized tensor-core kernel at D = 128 in wide blocks, one an SM (WIDE_SHAPE: eight warps
/// under 255 registers, two steps a warp as the default's, spill-free), which decode.rs takes on
/// Hopper for groups that nearly fill the SMs at one block each, unsplit: no merge. H200, bf16 q,
/// graph, 16 x 4096 (128 groups on 132 SMs), us, default (two or three splits and the merge) /
/// this: 8-bit 41.9-42.2 / 39.9-40.2 (80 -> 84-85 % of the copy), 4-bit 30.8-30.9 / 29.6-29.9
/// (58 -> 60 %); sixteen-warp blocks (128 registers) and twelve (4-bit) were slower, and two wide
/// blocks a group merged as a cluster (8-bit 8 x 8192, 1-2 % faster) cost the other kernels more
/// through the epilogue code they share (RESULTS, session 55). `states`: query states a kv head
/// (the PAIRED tile where paired() allows).
pub fn decode_wide(dtype: DType, head_dim: usize, bits: usize, groups: (usize, usize), states: usize) -> Option<Variant> {
    if !(decode_uses_mma(dtype, head_dim) && head_dim == 128 && bits != 0) {
        return None;
    }
    Some(decode_variant(dtype, head_dim, bits, groups, WIDE_SHAPE, mma_state_tile(dtype, head_dim, bits, states), TileSet::Default))
}

/// decode_wide's (warps, stages, blocks an SM).
const WIDE_SHAPE: (usize, usize, usize) = (8, 2, 1);

/// decode_one_wave's kernels, (warps, stages, blocks an SM) in order of blocks an SM: the same 16
/// warps an SM as four blocks of four, eight of two or sixteen of one, so that twice or four times
/// the grid fits a wave. Eight and sixteen blocks take groups of 64 only (the fp16 4-bit groups of
/// 32 spill 40 bytes on sm_80 at two warps).
const ONE_WAVE_SHAPES: [(usize, usize, usize); 3] = [(4, 2, 4), (2, 2, 8), (1, 2, 16)];

/// `st`: query states per warp (state_tile's, or PAIRED_STATE_TILE).
fn decode_variant(dtype: DType, head_dim: usize, bits: usize, (k_group, v_group): (usize, usize),
                  (warps, stages, min_blocks): (usize, usize, usize), st: usize, tile_set: TileSet) -> Variant {
    let mma = decode_uses_mma(dtype, head_dim);
    let kernel = if mma { Kernel::Decode } else { Kernel::DecodeSimt };
    let mut defines = vec![("FLASH_DTYPE", dtype_code(dtype))];
    if mma {
        defines.extend([("HEAD_DIM", head_dim as i64), ("CACHE_BITS", bits as i64)]);
        if bits != 0 {
            defines.extend([("K_GROUP", k_group as i64), ("V_GROUP", v_group as i64)]);
        }
    }
    defines.extend([("NUM_WARPS", warps as i64), ("STATE_TILE", st as i64), ("STAGES", stages as i64), ("MIN_BLOCKS", min_blocks as i64)]);
    // block_m: query states per warp; block_n: keys per softmax step.
    let tiles = Tiles { block_m: st, block_n: if mma { 16 } else { 4 }, num_warps: warps, d_split: 1, min_blocks };
    let head_dim = if mma { head_dim } else { ANY_HEAD_DIM };
    Variant { kernel, dtype, head_dim, source: source(kernel), tiles, tile_set, defines }
}

/// The merge or conversion kernel for `dtype`.
pub fn elementwise_variant(kernel: Kernel, dtype: DType) -> Variant {
    let tiles = Tiles { block_m: 1, block_n: 1, num_warps: ELEMENTWISE_WARPS, d_split: 1, min_blocks: 1 };
    let defines = vec![("FLASH_DTYPE", dtype_code(dtype)), ("NUM_WARPS", ELEMENTWISE_WARPS as i64)];
    Variant { kernel, dtype, head_dim: ANY_HEAD_DIM, source: source(kernel), tiles, tile_set: TileSet::Default, defines }
}

/// The merge kernel that takes a block per state (cuda/merge.cu MERGE_BY_BLOCK), for decode's f32
/// parts past one warp's trip (kv.rs).
pub fn merge_block_variant(dtype: DType) -> Variant {
    let mut v = elementwise_variant(Kernel::MergeStates, dtype);
    v.defines.push(("MERGE_BY_BLOCK", 1));
    v
}

/// Every KV-cache variant: the tensor-core decode kernels of `head_dims` (those it takes), one per
/// cache format; then per dtype the SIMT decode kernel, the merge and the conversions (which take
/// any head dim).
pub fn all(head_dims: &[usize]) -> Vec<Variant> {
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for &d in head_dims.iter().filter(|d| DECODE_MMA_HEAD_DIMS.contains(d)) {
            for bits in DECODE_MMA_BITS {
                if bits != 0 {
                    for groups in DECODE_QUANT_GROUPS {
                        out.extend(decode_candidates(dtype, d, bits, groups, usize::MAX));
                        if paired(dtype, d, bits, PAIRED_STATE_TILE) {
                            out.extend(decode_candidates(dtype, d, bits, groups, PAIRED_STATE_TILE));
                        }
                        out.extend(decode_one_wave(dtype, d, bits, groups, usize::MAX));
                        let one_wave_paired = decode_one_wave(dtype, d, bits, groups, PAIRED_STATE_TILE);
                        out.extend(one_wave_paired.into_iter().filter(|v| v.tiles.block_m == PAIRED_STATE_TILE));
                        let wide = decode_wide(dtype, d, bits, groups, usize::MAX);
                        let wide_paired = decode_wide(dtype, d, bits, groups, PAIRED_STATE_TILE).filter(|v| v.tiles.block_m == PAIRED_STATE_TILE);
                        out.extend(wide.into_iter().chain(wide_paired));
                    }
                } else {
                    out.extend(decode_candidates(dtype, d, bits, (0, 0), usize::MAX));
                    out.extend(decode_plain_past_a_wave(dtype, d));
                }
            }
        }
    }
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        out.extend(decode_candidates(dtype, ANY_HEAD_DIM, 0, (0, 0), usize::MAX));
        for kernel in [Kernel::MergeStates, Kernel::QuantizeKv, Kernel::DequantizeKv] {
            out.push(elementwise_variant(kernel, dtype));
        }
        out.push(merge_block_variant(dtype));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_takes_tensor_cores_at_its_head_dims_only() {
        let v = decode_candidates(DType::BF16, 128, 4, (64, 32), 8);
        assert_eq!((v[0].kernel, v[0].head_dim, v.len()), (Kernel::Decode, 128, 1));
        assert_eq!(v[0].name(), "decode_bf16_d128_cache_bits4_k_group64_v_group32_num_warps4_state_tile8_stages2_min_blocks3");
        // The plain cache prefers three stages; two fit every GPU.
        let names: Vec<String> = decode_candidates(DType::BF16, 128, 0, (0, 0), 4).iter().map(Variant::name).collect();
        assert_eq!(names, ["decode_bf16_d128_cache_bits0_num_warps4_state_tile8_stages3_min_blocks2", "decode_bf16_d128_cache_bits0_num_warps4_state_tile8_stages2_min_blocks3"]);
        let sets: Vec<TileSet> = decode_candidates(DType::BF16, 128, 0, (0, 0), 4).iter().map(|v| v.tile_set).collect();
        assert_eq!(sets, [TileSet::Default, TileSet::Small]);
        assert_eq!(decode_candidates(DType::F16, 256, 4, (32, 32), 4)[0].name(), "decode_f16_d256_cache_bits4_k_group32_v_group32_num_warps2_state_tile8_stages2_min_blocks1");
        assert_eq!(decode_candidates(DType::BF16, 128, 8, (32, 64), 4)[0].name(), "decode_bf16_d128_cache_bits8_k_group32_v_group64_num_warps4_state_tile8_stages2_min_blocks2");
        // At most 4 states a kv head: the PAIRED tile, bf16 q over 4-bit caches at D <= 128 only.
        assert_eq!(decode_candidates(DType::BF16, 128, 4, (64, 64), 4)[0].name(), "decode_bf16_d128_cache_bits4_k_group64_v_group64_num_warps4_state_tile4_stages2_min_blocks3");
        assert_eq!(decode_candidates(DType::BF16, 64, 4, (32, 64), 2)[0].tiles.block_m, 4);
        for (dtype, d, bits, states) in [(DType::BF16, 128, 4, 5), (DType::F16, 128, 4, 4), (DType::BF16, 128, 8, 4), (DType::BF16, 256, 4, 4)] {
            assert_eq!(decode_candidates(dtype, d, bits, (64, 64), states)[0].tiles.block_m, 8);
        }
        let names: Vec<String> = decode_one_wave(DType::BF16, 128, 4, (64, 64), 8).iter().map(Variant::name).collect();
        assert_eq!(names, ["decode_bf16_d128_cache_bits4_k_group64_v_group64_num_warps4_state_tile8_stages2_min_blocks4",
                           "decode_bf16_d128_cache_bits4_k_group64_v_group64_num_warps2_state_tile8_stages2_min_blocks8",
                           "decode_bf16_d128_cache_bits4_k_group64_v_group64_num_warps1_state_tile8_stages2_min_blocks16"]);
        let tiles: Vec<usize> = decode_one_wave(DType::BF16, 128, 4, (64, 64), 4).iter().map(|v| v.tiles.block_m).collect();
        assert_eq!(tiles, [PAIRED_STATE_TILE; 3]);
        assert!(decode_one_wave(DType::F16, 128, 4, (64, 64), 4).iter().all(|v| v.tiles.block_m == 8));
        assert!(decode_one_wave(DType::BF16, 128, 4, (32, 32), 4).iter().all(|v| v.tiles.block_m == 8));
        assert!(decode_one_wave(DType::BF16, 128, 8, (32, 32), 8).is_empty() && decode_one_wave(DType::BF16, 64, 4, (64, 64), 8).is_empty());
        assert!(decode_one_wave(DType::F16, 128, 4, (64, 32), 8).is_empty());
        assert_eq!(decode_one_wave(DType::F16, 128, 4, (32, 32), 8).len(), 1);
        assert_eq!(decode_one_wave(DType::F16, 128, 8, (64, 64), 8).len(), 3);
        assert_eq!(decode_wide(DType::BF16, 128, 8, (64, 32), 4).unwrap().name(), "decode_bf16_d128_cache_bits8_k_group64_v_group32_num_warps8_state_tile8_stages2_min_blocks1");
        assert_eq!(decode_wide(DType::BF16, 128, 4, (64, 64), 4).unwrap().tiles.block_m, PAIRED_STATE_TILE);
        assert!(decode_wide(DType::BF16, 128, 0, (0, 0), 4).is_none() && decode_wide(DType::F16, 64, 4, (64, 64), 4).is_none());
        assert_eq!(decode_plain_past_a_wave(DType::BF16, 128).unwrap().name(), "decode_bf16_d128_cache_bits0_num_warps2_state_tile8_stages3_min_blocks4");
        assert!(decode_plain_past_a_wave(DType::BF16, 64).is_none() && decode_plain_past_a_wave(DType::F32, 128).is_none());
        for (dtype, d) in [(DType::F32, 128), (DType::BF16, 96), (DType::F16, 40)] {
            let v = decode_candidates(dtype, d, 4, (32, 32), 4);
            assert_eq!((v.len(), v[0].kernel, v[0].head_dim), (1, Kernel::DecodeSimt, ANY_HEAD_DIM));
            assert!(!v[0].defines.iter().any(|(k, _)| *k == "HEAD_DIM"));
        }
    }

    #[test]
    fn the_table_lists_each_variant_once() {
        let all = all(&[8, 64, 128, 256]);
        let mut names: Vec<String> = all.iter().map(Variant::name).collect();
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n);
        // 2 dtypes x 3 head dims x (plain, 4 group pairs of 8-bit and of 4-bit), + the plain D =
        // 128 fallback and the D = 128 one-wave kernels (four blocks an SM: 4-bit 2 equal group pairs,
        // 8-bit 64/64; eight and sixteen: 4- and 8-bit 64/64) and the plain one past a wave; 3 dtypes x
        // (simt, merge, quantize, dequantize, merge by block); and bf16's PAIRED 4-bit kernels at D 64
        // and 128 (4 group pairs each) and its one-wave ones (groups 64: four, eight, sixteen blocks);
        // the wide D = 128 kernels (2 dtypes x 8 quantized group pairs, and bf16's PAIRED 4-bit ones).
        assert_eq!(n, 2 * (3 * 9 + 1 + 3 + 2 * 2 + 1) + 3 * 5 + 2 * 4 + 3 + 2 * 8 + 4);
        let tile_ok = |v: &Variant| v.tiles.block_m == state_tile(v.kernel) || (v.kernel == Kernel::Decode && v.tiles.block_m == PAIRED_STATE_TILE);
        assert!(all.iter().all(|v| tile_ok(v) || !v.kernel.is_decode()));
    }
}
