//! The decode kernels' launch (cuda/decode.h; cuda/decode.cu or cuda/decode_simt.cu, then
//! cuda/merge.cu when the keys are split): their params, how many splits, and the device-pointer
//! and host-memory entry points. The call is flash-core's [`Decode`], validated there; the CPU
//! path (decode.rs) defines the semantics.
//!
//! Grid: x = Hkv * chunks * splits (the kv heads of a split side by side), y = B. A block loads each
//! key of its split once for a chunk of the GQA group's query states (warp_states warps of
//! STATE_TILE states; the other warps of a state tile split the keys). With more than one split,
//! each split's state goes to an f32 workspace `[splits, B, Sq, H, D]` + `[splits, B, H, Sq]`
//! (stream-ordered, freed after the call) and merge.cu combines them by their logsumexp.

use cudarc::driver::sys as cu;

use super::device::{self, ContextGuard, Device, DeviceBuffer};
use super::host::{download, upload, Stream};
use super::kv::{self, bytes_of, bytes_of_mut, MergePtrs};
use super::kv_variants::{decode_candidates, decode_one_wave, decode_plain_past_a_wave, decode_wide};
use super::variant::{Kernel, Variant};
use super::libs;
use super::trace;
use crate::decode::{Cache, Decode};
use crate::error::{FlashError, Result};
use crate::guard::catch_panics;
use crate::quant::QuantFormat;

/// cuda/decode.h's `DecodeParams`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DecodeParams {
    q: u64,
    k: u64,
    v: u64,
    k_scale: u64,
    k_bias: u64,
    v_scale: u64,
    v_bias: u64,
    seqlens: u64,
    leftpad: u64,
    o: u64,
    lse: u64,
    o_part: u64,
    lse_part: u64,
    batch: i32,
    seq_q: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    s_cache: i32,
    group: i32,
    states: i32,
    splits: i32,
    chunks: i32,
    warp_states: i32,
    bits: i32,
    k_group_size: i32,
    v_group_size: i32,
    row_bytes: i32,
    win_left: i32,
    win_right: i32,
    scale_log2: f32,
    cap_in: f32,
    cap_out: f32,
    cluster: i32,
    pad: i32,
}

/// cuda/decode.h's `DecodeTmaParams`: the parameter of the kernels compiled with DECODE_TMA
/// ([`decode_tma`]): the K and V codes' tensor maps, then the params.
#[repr(C, align(128))]
#[derive(Clone, Copy)]
struct DecodeTmaParams {
    k: cu::CUtensorMap,
    v: cu::CUtensorMap,
    p: DecodeParams,
    k_x0: i32,
    v_x0: i32,
}

/// Keys of one of DECODE_TMA's boxes (cuda/decode.h tma_rows): a head's rows of 16 keys.
const TMA_BOX_ROWS: u32 = 16;

/// Whether the decode kernel `kernel` over caches of `bits` at `head_dim` takes [`DecodeTmaParams`]
/// on a GPU of compute capability `cc`: cuda/decode.h's DECODE_TMA (4- and 8-bit caches at D = 128,
/// compiled for sm_90 or later, which every such GPU gets).
fn decode_tma(cc: (i32, i32), kernel: Kernel, bits: usize, head_dim: usize) -> bool {
    cc.0 >= 9 && kernel == Kernel::Decode && (bits == 4 || bits == 8) && head_dim == 128
}

/// The 2-d tensor map of a cache's codes at `ptr` (`rows` rows of `row_bytes` bytes, u8) for
/// DECODE_TMA's boxes (`head_bytes` of a row, a head's: 64 or 128, swizzled over that span), and x0: the map starts at the 16-byte boundary at or below `ptr` (the copy
/// engine's alignment), x0 bytes before it, and each row spans x0 bytes more, so that the last
/// row ends where the cache does.
fn codes_map(ptr: u64, rows: usize, row_bytes: usize, head_bytes: usize) -> Result<(cu::CUtensorMap, i32)> {
    use cu::CUtensorMapSwizzle as Sw;
    let x0 = ptr % 16;
    let swizzle = match head_bytes {
        64 => Sw::CU_TENSOR_MAP_SWIZZLE_64B,
        128 => Sw::CU_TENSOR_MAP_SWIZZLE_128B,
        _ => return Err(FlashError::Internal(format!("decode: no tensor map for {head_bytes}-byte rows"))),
    };
    if row_bytes % 16 != 0 || rows > i32::MAX as usize {
        return Err(FlashError::Internal(format!("decode: no tensor map for {rows} rows of {row_bytes} bytes")));
    }
    let dims = [x0 + row_bytes as u64, rows as u64];
    let strides = [row_bytes as u64];
    let boxes = [head_bytes as u32, TMA_BOX_ROWS];
    let elem_strides = [1u32; 2];
    let mut map = std::mem::MaybeUninit::<cu::CUtensorMap>::zeroed();
    // SAFETY: out-pointer to a zeroed map; the arrays hold rank (2) entries (strides rank - 1).
    device::check("cuTensorMapEncodeTiled", unsafe {
        cu::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            cu::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            2,
            (ptr - x0) as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            cu::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            cu::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            cu::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    })?;
    // SAFETY: written by the driver on success.
    Ok((unsafe { map.assume_init() }, x0 as i32))
}

/// A cache on one GPU: its rows (`[B, S_cache, Hkv, D]` in the dtype, or the u32 codes
/// `[B, S_cache, Hkv, D * bits / 32]`) and, quantized, its scales and biases
/// (`[B, S_cache, Hkv, D / group_size]` in the dtype; 0 for a plain cache).
#[derive(Debug, Clone, Copy)]
pub struct CachePtrs {
    pub data: u64,
    pub scales: u64,
    pub biases: u64,
}

/// Device pointers of a decode call (the layouts of [`crate::decode::decode_cpu`]'s buffers).
#[derive(Debug, Clone, Copy)]
pub struct DecodePtrs {
    pub q: u64, // [B, Sq, H, D]
    pub k: CachePtrs,
    pub v: CachePtrs,
    pub seqlens: u64, // [B] int32, or 0: S_cache
    pub leftpad: u64, // [B] int32, or 0: 0
    pub o: u64,       // [B, Sq, H, D]
    pub lse: u64,     // [B, H, Sq] f32
}

/// cuda/decode.h's WINDOW_INF: window sides are capped here and caches must be shorter, so that
/// the kernels' key arithmetic fits an int.
const KEY_LIMIT: usize = 1 << 30;
/// Keys per split at least when the number of splits is chosen here (a few pipeline stages).
const MIN_KEYS_PER_SPLIT: usize = 256;
/// Most splits chosen here (FlashAttention-2's bound).
const MAX_SPLITS: usize = 128;

/// The caches' bits on the GPU (0: plain): both plain, or both quantized with the same bits and
/// `p`'s head dim (their group sizes may differ).
fn cache_bits(p: &Decode, k: Option<&QuantFormat>, v: Option<&QuantFormat>) -> Result<usize> {
    for f in [k, v].into_iter().flatten() {
        if f.head_dim != p.head_dim {
            return Err(FlashError::Internal(format!("decode: a cache's format has head dim {}, the call {}", f.head_dim, p.head_dim)));
        }
    }
    match (k, v) {
        (None, None) => Ok(0),
        (Some(a), Some(b)) if a.bits == b.bits => Ok(a.bits),
        _ => Err(FlashError::Unsupported(
            "decode on the GPU takes k_cache and v_cache both plain, or both quantized with the same bits; dequantize one \
             (flash_nif.dequantize_kv) or quantize both alike"
                .into(),
        )),
    }
}

/// What the kernels take: sizes that fit their ints and grid, and pointers aligned for their
/// loads (the scales are read in 4-byte words).
fn check_supported(p: &Decode, ptrs: &DecodePtrs) -> Result<()> {
    if p.s_cache >= KEY_LIMIT {
        return Err(FlashError::Unsupported(format!("decode on the GPU takes caches of fewer than {KEY_LIMIT} keys; got S_cache = {}", p.s_cache)));
    }
    if p.batch > 65535 {
        return Err(FlashError::Unsupported(format!("decode on the GPU takes at most 65535 batch rows; got {}", p.batch)));
    }
    // Rows are copied in the widest units their addresses allow (2 bytes at least).
    let es = p.dtype.size_bytes() as u64;
    let aligned = [("q", ptrs.q, es), ("o", ptrs.o, es), ("lse", ptrs.lse, 4), ("k_cache", ptrs.k.data, 2), ("v_cache", ptrs.v.data, 2)];
    for (name, ptr, align) in aligned {
        if ptr % align != 0 {
            return Err(FlashError::Unsupported(format!("decode: {name}'s data is not aligned to {align} bytes; pass a copy")));
        }
    }
    for (name, c) in [("k_cache", &ptrs.k), ("v_cache", &ptrs.v)] {
        if c.scales % 4 != 0 || c.biases % 4 != 0 {
            return Err(FlashError::Unsupported(format!(
                "decode on the GPU reads {name}'s scales and biases in 4-byte words: pass arrays aligned to 4 bytes (a copy)"
            )));
        }
    }
    Ok(())
}

/// The keys the rows of the call see at most: per row the valid keys, narrowed by the window.
fn max_visible_keys(p: &Decode, seqlens: &[i32], leftpad: &[i32]) -> usize {
    let (left, right) = p.window();
    let (left, right) = (left.map_or(i64::MAX / 4, |x| x as i64), right.map_or(i64::MAX / 4, |x| x as i64));
    seqlens
        .iter()
        .zip(leftpad)
        .map(|(&hi, &lo)| {
            let (hi, lo) = (hi as i64, lo as i64);
            let end = hi - p.seq_q as i64;
            let span = hi.min(end + p.seq_q as i64 + right) - lo.max(end - left);
            span.max(0) as usize
        })
        .max()
        .unwrap_or(0)
}

/// The most splits of rows of `max_keys` keys: MIN_KEYS_PER_SPLIT keys a split at least, MAX_SPLITS.
fn max_splits(max_keys: usize) -> usize {
    max_keys.div_ceil(MIN_KEYS_PER_SPLIT).clamp(1, MAX_SPLITS)
}

/// Splits of each row's keys for `blocks` blocks per split on a GPU of `sms` SMs that runs `lanes`
/// of them per SM: one split when the blocks nearly fill those lanes; else the fewest splits whose
/// waves are within 95 % of the best efficiency (waves / whole waves; FlashAttention-2's rule, at
/// its 85 % more splits than the best were chosen), each split keeping MIN_KEYS_PER_SPLIT keys at
/// least.
fn choose_splits(blocks: usize, sms: usize, lanes: usize, max_keys: usize) -> usize {
    let slots = (sms * lanes).max(1);
    let max_splits = max_splits(max_keys);
    if blocks * 5 >= slots * 4 || max_splits == 1 {
        return 1;
    }
    let efficiency = |s: usize| {
        let waves = (blocks * s) as f64 / slots as f64;
        waves / waves.ceil()
    };
    let best = (1..=max_splits).map(efficiency).fold(0.0, f64::max);
    (1..=max_splits).find(|&s| efficiency(s) >= 0.95 * best).unwrap_or(1)
}

/// Blocks per SM the splits aim at: a plain cache's tensor-core kernel is memory bound and one
/// block's stages keep an SM's share of the bandwidth busy (more blocks only add splits to merge
/// and a ragged last wave); the quantized and CUDA-core kernels are bound by their instruction
/// chains, and two blocks per SM hide them best. H200, bench/decode.py --splits (RESULTS):
/// bf16 8 x 8192 2 splits 74.8 us against 78.9 at 4, 1 x 131072 16 splits 134 against 144 at 32;
/// 4-bit and 8-bit best at 4 and 32 splits (256 blocks) on those shapes.
fn split_lanes(plain_mma: bool, blocks_per_sm: u32) -> usize {
    (if plain_mma { 1 } else { 2 }).min(blocks_per_sm.max(1) as usize)
}

/// The splits of a call that leaves the count to the library: choose_splits at split_lanes'
/// blocks per SM, but the 4-bit tensor-core kernel (`q4_mma`) at three where they fit and the
/// splits stay within one trip of the merge (`one_trip`: kv.rs merge_one_trip_parts; past it the
/// merge's tail grows: 7.4 us at 48 parts by a warp per state, RESULTS, session 47). H200, the same
/// kernel with the count forced, graph periods: 8 x 8192 6 splits 31.8-32.0 us against 32.6 at 4,
/// 4 x 16384 12 splits 31.6 against 32.2-32.4 at 8 (session 47); with the merge's block per state,
/// 2 x 32768 24 splits 31.9-32.0 against 32.4-32.5 at 16, 1 x 131072 48 splits 53.1-53.2 against
/// 55.4-55.9 at 32 (session 48).
fn auto_splits(plain_mma: bool, q4_mma: bool, blocks_per_sm: u32, blocks: usize, sms: usize, max_keys: usize, one_trip: usize) -> usize {
    if q4_mma && blocks_per_sm >= 3 {
        let splits = choose_splits(blocks, sms, 3, max_keys);
        if splits <= one_trip {
            return splits;
        }
    }
    choose_splits(blocks, sms, split_lanes(plain_mma, blocks_per_sm), max_keys)
}

/// Whether a plain cache's grid of `blocks` that the automatic count leaves unsplit at one block an
/// SM or fewer (blocks_per_sm fitting two) takes two splits merged as a cluster instead: the second
/// block an SM doubles the stages in flight. H200, bf16, graph, us: 16 x 4096 (128 blocks) 69.3 at
/// two splits against 74.0-75.6 at one (86 -> 92 % of the copy); 32 x 2048 (256 blocks, one split)
/// and 64 x 1024 slower at two (RESULTS, session 51).
fn pairs_fill_one_block_an_sm(blocks: usize, sms: usize, blocks_per_sm: u32, max_keys: usize) -> bool {
    blocks <= sms && blocks * CLUSTER_SPLITS <= sms * blocks_per_sm as usize && max_keys >= CLUSTER_SPLITS * MIN_KEYS_PER_SPLIT
}

/// Whether a plain cache's unsplit grid of `blocks`, past one block an SM, takes two splits merged
/// as a cluster on Hopper's kernel of `wave_blocks` two-warp blocks an SM (decode_plain_past_a_wave),
/// because the pairs share the SMs more evenly: within one wave, the busiest SM runs ceil(blocks /
/// sms) of them (device::alone), and the mean share of that (`evenness`) grows by a tenth or more.
/// H200, bf16, graph, us, unsplit / two splits (RESULTS, session 63): 24 x 2730 (192 blocks:
/// evenness 0.73 -> 0.97) 73.4 / 70.0 (86 -> 90 % of the copy); 40 x 1638, 36 x 1820 and 50 x 1310,
/// whose pairs need a second wave, 9-20 % slower at two.
fn pairs_even_the_sms(blocks: usize, sms: usize, wave_blocks: usize, max_keys: usize) -> bool {
    let evenness = |n: usize| n as f64 / (sms * n.div_ceil(sms)).max(1) as f64;
    let pairs = blocks * CLUSTER_SPLITS;
    blocks > sms && pairs <= sms * wave_blocks && max_keys >= CLUSTER_SPLITS * MIN_KEYS_PER_SPLIT && evenness(pairs) >= evenness(blocks) + 0.1
}

/// Whether `grid` blocks need more than one wave at `blocks_per_sm` blocks an SM but fit one at
/// `one_wave_blocks` (decode_one_wave's kernels: four, eight or sixteen, where the 4-bit kernel
/// runs three and the 8-bit one two).
fn needs_one_wave_kernel(grid: usize, sms: usize, blocks_per_sm: u32, one_wave_blocks: usize) -> bool {
    grid > sms * blocks_per_sm as usize && grid <= sms * one_wave_blocks
}

/// The splits with which `items` (b, kv head, chunk) groups take decode_one_wave's kernel, or None:
/// where `splits` need more than one wave at `blocks_per_sm` (the chosen kernel's), those splits if
/// they fit one at `one_wave_blocks` and fill 3/5 of it, else (the count left to the library) the
/// most splits that wave holds, if they fill 3/5 of it (32 x 2048 4-bit at Hkv 8 on 132 SMs: 3
/// splits, 768 blocks, become 2 splits, 512 blocks). H200, graph, us (RESULTS, sessions 62-63):
/// 48 x 1365 8-bit (384 blocks, 73 % of the four-block kernel's wave) 45.7 -> 38.1, 50 x 1310 4-bit
/// (400) 35.4 -> 31.9, 24 x 2730 8-bit (4 splits, 73 % of eight blocks an SM) 44.5 -> 42.4; 20 x
/// 3276 8-bit's 8 splits (61 % of sixteen one-warp blocks an SM) 48.0 against 41.1 at the four-block
/// kernel's 3 (91 %), which choose_splits, counting several waves, passed over; but 36 x 1820
/// 4-bit's 4 splits, 55 % of sixteen one-warp blocks an SM, 35.5 -> 40.4 (its 7 kept).
fn one_wave_splits(items: usize, splits: usize, asked: bool, sms: usize, (blocks_per_sm, one_wave_blocks): (u32, usize),
                   keys: usize, one_trip: usize) -> Option<usize> {
    if items * splits <= sms * blocks_per_sm as usize {
        return None;
    }
    let (grid, wave) = (items * splits, sms * one_wave_blocks);
    let fills = |grid: usize| 5 * grid >= 3 * wave;
    let fits = needs_one_wave_kernel(grid, sms, blocks_per_sm, one_wave_blocks) && fills(grid);
    let splits = if asked || fits {
        splits
    } else {
        let most = (wave / items.max(1)).min(max_splits(keys)).min(one_trip);
        if most == 0 || !fills(items * most) {
            return None;
        }
        most
    };
    needs_one_wave_kernel(items * splits, sms, blocks_per_sm, one_wave_blocks).then_some(splits)
}

/// Keys a block reads at most for which a grid past one wave of every one-wave kernel still takes
/// the one of most blocks an SM (short_rows_past_every_wave).
const SHORT_ROW_KEYS: usize = 256;

/// Whether a quantized grid of `grid` blocks, past one wave of the one-wave kernel of most blocks
/// an SM (`most_blocks`), takes it anyway: where each block reads few keys its fixed set-up and end
/// outweigh its stream, and more of them in flight an SM hide those. H200, graph, us, default /
/// sixteen one-warp blocks an SM (RESULTS, session 62): 8-bit 1024 x 64 206 -> 65, 512 x 128 102
/// -> 49, 2200 x 256 545 -> 355; 4-bit 1024 x 64 135 -> 52, 512 x 128 69 -> 38.5, 2200 x 256 360
/// -> 243; but 320 x 2048 8-bit 361 -> 475, 4-bit 248 -> 381, and 512 x 1024 4-bit 207 -> 245.
fn short_rows_past_every_wave(grid: usize, sms: usize, most_blocks: usize, keys: usize, splits: usize) -> bool {
    grid > sms * most_blocks && keys.div_ceil(splits.max(1)) <= SHORT_ROW_KEYS
}

/// Whether `items` (b, kv head, chunk) groups over caches of `bits` take decode_wide's kernel
/// unsplit: one eight-warp block an SM each, where they fill at least wide_fill(bits) of the SMs
/// and at most all (the other kernels split such grids to fill two or three blocks an SM, and pay
/// the merge's ~3 us tail).
fn fills_the_sms_unsplit(items: usize, sms: usize, bits: usize) -> bool {
    items <= sms && items as f64 >= wide_fill(bits) * sms as f64
}

/// The least share of the SMs decode_wide's unsplit blocks must fill. H200 (132 SMs), bf16 q, Hkv 8,
/// graph, us, default / wide (RESULTS, session 55): 8-bit 16 x 4096 (0.97 of the SMs) 42.0-42.2 /
/// 39.9-40.2, 15 x 4096 (0.91) 43.3-43.4 / 38.2-38.6, 13 x 4096 (0.79) 38.5-38.6 / 36.7-36.9, 12 x 4096
/// (0.73) 37.8-37.9 / 35.9-36.2; 4-bit 30.8 / 29.6-29.9, 32.0-32.2 / 28.8-29.3, 28.3-28.6 /
/// 28.4-28.8, but 25.0-25.2 / 28.3-28.4 (the 4-bit kernel wants more warps an SM than eight).
fn wide_fill(bits: usize) -> f64 {
    if bits == 8 { 0.7 } else { 0.85 }
}

/// How a call runs: the states' partition, the splits, and whether the splits of a group are one
/// thread-block cluster that merges them in the kernel (no merge kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    warp_states: usize,
    chunks: usize,
    splits: usize,
    cluster: bool,
}

/// The splits a cluster merges (at most cuda/decode.h's MAX_CLUSTER_SPLITS, the bound of
/// cluster_merge's per-split registers).
const CLUSTER_SPLITS: usize = 2;

/// Whether the splits merge inside the kernel, as a cluster: Hopper's tensor-core kernel over a
/// plain cache (`bits` 0) with CLUSTER_SPLITS splits. Its splits aim at one block per SM
/// (split_lanes). H200, bf16, cluster against merge kernel (RESULTS, session 42): 8 x 8192 (2
/// splits) 73.8-74.4 us against 77.7-79.3, but 4 x 16384 (4 splits) 89.6-92.4 against 75.7-76.8 and
/// 2 x 32768 (8 splits) 90.2-92.0 against 77.0-77.6. The quantized kernels' splits (two or three
/// blocks per SM) ran slower as clusters too (8-bit 8 x 8192: 52.5 -> 77.9 us). Older GPUs, other
/// split counts and the CUDA-core kernel take the merge kernel.
fn cluster_merges(cc: (i32, i32), kernel: Kernel, bits: usize, splits: usize) -> bool {
    cc.0 >= 9 && kernel == Kernel::Decode && bits == 0 && splits == CLUSTER_SPLITS
}

/// `v`'s function and warp_states where it can stand in for the chosen kernel: its partition of
/// `states` takes the same `chunks` (blocks a split) and the GPU holds its MIN_BLOCKS an SM (the
/// one-wave and past-a-wave kernels are chosen for those blocks an SM).
fn takes_the_same_blocks(dev: &Device, v: &Variant, states: usize, chunks: usize) -> Result<Option<(device::Function, usize)>> {
    let (warp_states, c) = partition(states, v.tiles.block_m, v.tiles.num_warps);
    if c != chunks {
        return Ok(None);
    }
    let f = device::function(dev, v)?;
    Ok((f.blocks_per_sm as usize >= v.tiles.min_blocks).then_some((f, warp_states)))
}

/// The states' partition for a kernel of `warps` warps of `state_tile` states each: warp_states
/// warps (a power of 2, at most `warps`) over the state tiles, chunks of them across the grid.
fn partition(states: usize, state_tile: usize, warps: usize) -> (usize, usize) {
    let tiles = states.div_ceil(state_tile).max(1);
    let warp_states = tiles.next_power_of_two().min(warps);
    (warp_states, tiles.div_ceil(warp_states))
}

fn params(p: &Decode, bits: usize, k_gs: usize, v_gs: usize, plan: Plan, ptrs: &DecodePtrs, work: (u64, u64)) -> DecodeParams {
    let (left, right) = p.window();
    let cap = |x: Option<usize>| x.map_or(KEY_LIMIT, |x| x.min(KEY_LIMIT)) as i32;
    let row_bytes = if bits == 0 { p.head_dim * p.dtype.size_bytes() } else { p.head_dim * bits / 8 };
    let (cap_in, cap_out) = p.softcap.map_or((0.0, 0.0), |c| (p.scale / c, c * std::f32::consts::LOG2_E));
    DecodeParams {
        q: ptrs.q,
        k: ptrs.k.data,
        v: ptrs.v.data,
        k_scale: ptrs.k.scales,
        k_bias: ptrs.k.biases,
        v_scale: ptrs.v.scales,
        v_bias: ptrs.v.biases,
        seqlens: ptrs.seqlens,
        leftpad: ptrs.leftpad,
        o: ptrs.o,
        lse: ptrs.lse,
        o_part: work.0,
        lse_part: work.1,
        batch: p.batch as i32,
        seq_q: p.seq_q as i32,
        heads: p.heads as i32,
        kv_heads: p.kv_heads as i32,
        head_dim: p.head_dim as i32,
        s_cache: p.s_cache as i32,
        group: (p.heads / p.kv_heads) as i32,
        states: (p.heads / p.kv_heads * p.seq_q) as i32,
        splits: plan.splits as i32,
        chunks: plan.chunks as i32,
        warp_states: plan.warp_states as i32,
        bits: bits as i32,
        k_group_size: k_gs as i32,
        v_group_size: v_gs as i32,
        row_bytes: row_bytes as i32,
        win_left: cap(left),
        win_right: cap(right),
        scale_log2: p.scale * std::f32::consts::LOG2_E,
        cap_in,
        cap_out,
        cluster: plan.cluster as i32,
        pad: 0,
    }
}

/// Queues decode on `s` (the device's context current): the kernel, then the merge of the splits.
/// `formats`: the caches' (None: plain); `rows`: host copies of the row bounds the device
/// pointers hold (checked by the caller), which size the splits.
///
/// # Safety
/// As [`decode_device`].
unsafe fn run(dev: &Device, p: &Decode, formats: [Option<&QuantFormat>; 2], rows: (&[i32], &[i32]), s: cu::CUstream, ptrs: DecodePtrs) -> Result<()> {
    let bits = cache_bits(p, formats[0], formats[1])?;
    check_supported(p, &ptrs)?;
    if p.batch == 0 {
        return Ok(());
    }
    let gs = |f: Option<&QuantFormat>| f.map_or(0, |f| f.group_size);
    let group = p.heads / p.kv_heads;
    let v = device::choose(dev, &decode_candidates(p.dtype, p.head_dim, bits, (gs(formats[0]), gs(formats[1])), group * p.seq_q))?;
    let f = device::function(dev, &v)?;
    let (warp_states, chunks) = partition(group * p.seq_q, v.tiles.block_m, v.tiles.num_warps);
    let blocks = p.kv_heads * chunks;
    let (sms, keys, one_trip) = (dev.sm_count.max(1) as usize, max_visible_keys(p, rows.0, rows.1), kv::merge_one_trip_parts());
    let splits = match p.num_splits {
        Some(n) => n,
        None => {
            let mma = v.kernel == Kernel::Decode;
            let n = auto_splits(bits == 0 && mma, bits == 4 && mma, f.blocks_per_sm, p.batch * blocks, sms, keys, one_trip);
            let past_a_wave = decode_plain_past_a_wave(p.dtype, p.head_dim).filter(|_| dev.cc.0 >= 9 && bits == 0);
            let paired = n == 1
                && cluster_merges(dev.cc, v.kernel, bits, CLUSTER_SPLITS)
                && (pairs_fill_one_block_an_sm(p.batch * blocks, sms, f.blocks_per_sm, keys)
                    || past_a_wave.is_some_and(|v2| pairs_even_the_sms(p.batch * blocks, sms, v2.tiles.min_blocks, keys)));
            if paired { CLUSTER_SPLITS } else { n }
        }
    };
    // The grid in one wave of a one-wave kernel (4- or 8-bit; four blocks an SM, else eight, else
    // sixteen) where the chosen one needs more: with the splits asked for, or those of its blocks an
    // SM; the same blocks a split (its warps may partition the states otherwise). Hopper only
    // (measured on the H200; the copy engine's stages there, cp.async elsewhere).
    let (mut v, mut f, mut warp_states, mut splits) = (v, f, warp_states, splits);
    if dev.cc.0 >= 9 {
        for v1 in decode_one_wave(p.dtype, p.head_dim, bits, (gs(formats[0]), gs(formats[1])), group * p.seq_q) {
            let lanes = (f.blocks_per_sm, v1.tiles.min_blocks);
            let Some(splits1) = one_wave_splits(p.batch * blocks, splits, p.num_splits.is_some(), sms, lanes, keys, one_trip) else {
                continue;
            };
            if let Some((f1, ws1)) = takes_the_same_blocks(dev, &v1, group * p.seq_q, chunks)? {
                (v, f, warp_states, splits) = (v1, f1, ws1, splits1);
                break;
            }
        }
    }
    // Short rows past a wave of every one-wave kernel: the one of most blocks an SM, the same splits.
    if dev.cc.0 >= 9 {
        if let Some(vm) = decode_one_wave(p.dtype, p.head_dim, bits, (gs(formats[0]), gs(formats[1])), group * p.seq_q).pop() {
            if short_rows_past_every_wave(p.batch * blocks * splits, sms, vm.tiles.min_blocks, keys, splits) {
                if let Some((fm, ws)) = takes_the_same_blocks(dev, &vm, group * p.seq_q, chunks)? {
                    (v, f, warp_states) = (vm, fm, ws);
                }
            }
        }
    }
    // Groups that nearly fill the SMs at one block each: one wide block each, unsplit (Hopper).
    if dev.cc.0 >= 9 && p.num_splits.is_none_or(|n| n == 1) && fills_the_sms_unsplit(p.batch * blocks, sms, bits) {
        if let Some(vw) = decode_wide(p.dtype, p.head_dim, bits, (gs(formats[0]), gs(formats[1])), group * p.seq_q) {
            if let Some((fw, ws)) = takes_the_same_blocks(dev, &vw, group * p.seq_q, chunks)? {
                (v, f, warp_states, splits) = (vw, fw, ws, 1);
            }
        }
    }
    // A plain grid past one wave of the default kernel: four two-warp blocks an SM (Hopper: their
    // shared memory fits four there only), the same blocks a split.
    if dev.cc.0 >= 9 && bits == 0 && p.batch * blocks * splits > sms * f.blocks_per_sm as usize {
        if let Some(v2) = decode_plain_past_a_wave(p.dtype, p.head_dim) {
            if let Some((f2, ws2)) = takes_the_same_blocks(dev, &v2, group * p.seq_q, chunks)? {
                (v, f, warp_states) = (v2, f2, ws2);
            }
        }
    }
    let grid_x = blocks.checked_mul(splits).filter(|&n| n <= i32::MAX as usize).ok_or_else(|| {
        FlashError::Unsupported(format!("decode: {splits} splits of {blocks} blocks exceed the CUDA grid; ask for fewer num_splits"))
    })?;
    let cluster = cluster_merges(dev.cc, v.kernel, bits, splits);
    let plan = Plan { warp_states, chunks, splits, cluster };
    // With splits, each split's state lands in the workspace and the merge writes o and lse (or,
    // as a cluster, the kernel merges them).
    let states = p.batch * p.seq_q * p.heads;
    // One allocation for both (each is a stream-ordered call on the host's per-call path): o_part
    // [splits, B, Sq, H, D] f32, then lse_part [splits, B, H, Sq] f32 at a 256-byte boundary.
    let lse_at = (splits * states * p.head_dim * 4).next_multiple_of(256);
    let work = if splits > 1 && !cluster { Some(DeviceBuffer::alloc(lse_at + splits * states * 4, s)?) } else { None };
    let work_ptrs = work.as_ref().map_or((0, 0), |w| (w.ptr, w.ptr + lse_at as u64));
    let prm = params(p, bits, gs(formats[0]), gs(formats[1]), plan, &ptrs, work_ptrs);
    let grid = (grid_x as u32, p.batch as u32, 1);
    // A grid within one wave, launched dependent (Hopper), keeps its share of every SM
    // (device::alone): at most as many blocks an SM as it places there itself.
    let n = grid_x * p.batch;
    let f = if dev.cc.0 >= 9 && n <= sms * f.blocks_per_sm as usize { device::alone(dev, f, n.div_ceil(sms) as u32)? } else { f };
    let merge = if splits == 1 { "unsplit" } else if cluster { "merged as a cluster" } else { "merge kernel" };
    trace::decode_plan(&v, (grid.0, grid.1), splits, merge, f.blocks_per_sm);
    if cluster {
        // SAFETY: as below; the cluster's blocks are the splits of one group (the kernel's order).
        unsafe { device::launch_cluster(v.kernel.entry(), f, grid, splits as u32, s, &prm)? };
    } else if decode_tma(dev.cc, v.kernel, bits, p.head_dim) {
        let (rows, row_bytes) = (p.batch * p.s_cache, p.kv_heads * prm.row_bytes as usize);
        let head = prm.row_bytes as usize;
        let ((k, k_x0), (v_map, v_x0)) = (codes_map(prm.k, rows, row_bytes, head)?, codes_map(prm.v, rows, row_bytes, head)?);
        let tp = DecodeTmaParams { k, v: v_map, p: prm, k_x0, v_x0 };
        // SAFETY: as below; the maps span the caches' codes exactly.
        unsafe { device::launch_dependent(dev, v.kernel.entry(), f, grid, s, &tp)? };
    } else {
        // SAFETY: the caller's pointers and the workspace, of the sizes p implies; the params mirror
        // the kernel's, which waits for the stream's previous kernel before it reads (decode.h).
        unsafe { device::launch_dependent(dev, v.kernel.entry(), f, grid, s, &prm)? };
    }
    if work.is_some() {
        let mp = MergePtrs { o_parts: work_ptrs.0, lse_parts: work_ptrs.1, o: ptrs.o, lse: ptrs.lse };
        // SAFETY: the workspace just written on s, and the caller's outputs.
        unsafe { kv::merge(dev, p.dtype, [splits, p.batch, p.seq_q, p.heads, p.head_dim], mp, true, s)? };
    }
    Ok(())
}

/// Decode on device memory, queued on `stream` with nothing synchronised. `formats`: the caches'
/// quantized formats (None: plain rows); `rows`: host copies of the values behind `ptrs.seqlens`
/// and `ptrs.leftpad` (S_cache and 0 where those are 0), checked here: they size the splits.
///
/// # Safety
/// The pointers must be device memory of GPU `device` with [`DecodePtrs`]' layouts for `p` and
/// `formats`, valid until `stream` reaches this work (the device row bounds holding the values
/// of `rows`); `stream` (a CUstream as an integer, 0 = legacy default) must belong to that device's
/// primary context.
pub unsafe fn decode_device(
    p: &Decode, formats: [Option<&QuantFormat>; 2], rows: (&[i32], &[i32]), device: usize, stream: usize, ptrs: DecodePtrs,
) -> Result<()> {
    p.check_rows(rows.0, rows.1)?;
    catch_panics("CUDA", || {
        let dev = device::device(device)?;
        libs::ensure_nvrtc()?;
        let _ctx = ContextGuard::new(&dev)?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { run(&dev, p, formats, rows, stream as cu::CUstream, ptrs) }
    })
}

/// A cache's buffers on the GPU (dropped after the call).
struct CacheUpload {
    bufs: Vec<DeviceBuffer>,
    format: Option<QuantFormat>,
}

impl CacheUpload {
    fn new(c: &Cache, s: &Stream) -> Result<CacheUpload> {
        Ok(match *c {
            Cache::Plain(x) => CacheUpload { bufs: vec![upload(x, s)?], format: None },
            Cache::Quant { fmt, values, scales, biases } => {
                CacheUpload { bufs: vec![upload(bytes_of(values), s)?, upload(scales, s)?, upload(biases, s)?], format: Some(fmt) }
            }
        })
    }

    fn ptrs(&self) -> CachePtrs {
        let at = |i: usize| self.bufs.get(i).map_or(0, |b| b.ptr);
        CachePtrs { data: at(0), scales: at(1), biases: at(2) }
    }
}

/// Decode on host memory through GPU `device` (copy in, compute, copy out; synchronous): the
/// buffers of [`crate::decode::decode_cpu`].
#[allow(clippy::too_many_arguments)]
pub fn decode_host(p: &Decode, device: usize, q: &[u8], k: Cache, v: Cache, seqlens: &[i32], leftpad: &[i32], o: &mut [u8], lse: &mut [f32]) -> Result<()> {
    p.check_buffers(q, &k, &v, seqlens, leftpad, o, lse)?;
    catch_panics("CUDA", || {
        let dev = device::device(device)?;
        libs::ensure_nvrtc()?;
        let _ctx = ContextGuard::new(&dev)?;
        let s = Stream::new()?;
        let qb = upload(q, &s)?;
        let (kc, vc) = (CacheUpload::new(&k, &s)?, CacheUpload::new(&v, &s)?);
        let (sl, lp) = (upload(bytes_of(seqlens), &s)?, upload(bytes_of(leftpad), &s)?);
        let (ob, lb) = (DeviceBuffer::alloc(o.len(), s.0)?, DeviceBuffer::alloc(lse.len() * 4, s.0)?);
        let ptrs = DecodePtrs { q: qb.ptr, k: kc.ptrs(), v: vc.ptrs(), seqlens: sl.ptr, leftpad: lp.ptr, o: ob.ptr, lse: lb.ptr };
        // SAFETY: buffers sized from the problem (checked above), on this device, ordered on stream s.
        unsafe { run(&dev, p, [kc.format.as_ref(), vc.format.as_ref()], (seqlens, leftpad), s.0, ptrs)? };
        download(o, &ob, &s)?;
        download(bytes_of_mut(lse), &lb, &s)?;
        s.sync()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    fn call(b: usize, sq: usize, h: usize, hkv: usize, s_cache: usize) -> Decode {
        Decode {
            dtype: DType::BF16,
            batch: b,
            seq_q: sq,
            s_cache,
            heads: h,
            kv_heads: hkv,
            head_dim: 128,
            causal: true,
            scale: 0.1,
            left: None,
            right: None,
            softcap: None,
            num_splits: None,
        }
    }

    #[test]
    fn params_struct_matches_the_kernel_layout() {
        // 13 pointers, 17 ints, 3 floats, the cluster flag and its padding (cuda/decode.h).
        assert_eq!(std::mem::size_of::<DecodeParams>(), 13 * 8 + 17 * 4 + 3 * 4 + 2 * 4);
        assert_eq!(std::mem::size_of::<DecodeParams>() % 8, 0);
    }

    #[test]
    fn states_fill_warps_then_chunks() {
        assert_eq!(partition(4, 8, 4), (1, 1)); // GQA 4, Sq 1: one warp tile, the warps split keys
        assert_eq!(partition(32, 8, 4), (4, 1));
        assert_eq!(partition(128, 8, 4), (4, 4)); // GQA 8 x Sq 16: 16 tiles, 4 chunks
        assert_eq!(partition(12, 4, 4), (4, 1));
        assert_eq!(partition(20, 4, 4), (4, 2));
        assert_eq!(partition(24, 8, 2), (2, 2));
    }

    #[test]
    fn splits_fill_the_gpu_when_rows_are_few() {
        // Hkv = 8 on 132 SMs: B = 1, S = 128k, one block per SM (plain) or two (quantized).
        assert_eq!(choose_splits(8, 132, 1, 131072), 16);
        assert_eq!(choose_splits(8, 132, 2, 131072), 32);
        assert_eq!(choose_splits(64, 132, 1, 8192), 2); // B = 8, S = 8k
        assert_eq!(choose_splits(64, 132, 2, 8192), 4);
        assert_eq!(choose_splits(512, 132, 2, 1024), 1); // B = 64: the rows fill it
        assert_eq!(choose_splits(8, 132, 2, 200), 1); // too few keys to split
        assert_eq!(choose_splits(8, 132, 2, 1000), 4); // at most a split per 256 keys
        assert_eq!((split_lanes(true, 2), split_lanes(false, 3), split_lanes(false, 1)), (1, 2, 1));
    }

    #[test]
    fn four_bit_splits_take_three_blocks_an_sm_within_one_merge_trip() {
        // Hkv = 8 on 132 SMs; (plain_mma, q4_mma, blocks_per_sm, blocks, sms, keys, one_trip).
        let trip = kv::merge_one_trip_parts();
        assert_eq!(trip, 128);
        assert_eq!(auto_splits(false, true, 3, 64, 132, 8192, trip), 6); // 8 x 8192
        assert_eq!(auto_splits(false, true, 3, 32, 132, 16384, trip), 12); // 4 x 16384
        assert_eq!(auto_splits(false, true, 3, 16, 132, 32768, trip), 24); // 2 x 32768
        assert_eq!(auto_splits(false, true, 3, 8, 132, 131072, trip), 48); // 1 x 131072
        assert_eq!(auto_splits(false, true, 3, 16, 132, 32768, 16), 16); // 24 would pass a trip of 16
        assert_eq!(auto_splits(false, true, 2, 64, 132, 8192, trip), 4); // only two fit
        assert_eq!(auto_splits(false, false, 2, 64, 132, 8192, trip), 4); // 8-bit
        assert_eq!(auto_splits(true, false, 2, 64, 132, 8192, trip), 2); // plain
        assert_eq!(auto_splits(false, true, 3, 512, 132, 1024, trip), 1); // the rows fill the GPU
    }

    #[test]
    fn a_plain_grid_of_one_block_an_sm_pairs_its_splits() {
        // H200 (132 SMs, two plain blocks each), Hkv 8: 16 x 4096 (128 blocks) pairs; 32 x 2048
        // (256) and a GPU with one block an SM do not; nor do keys too few for two splits.
        assert!(pairs_fill_one_block_an_sm(128, 132, 2, 4096) && pairs_fill_one_block_an_sm(132, 132, 2, 512));
        assert!(!pairs_fill_one_block_an_sm(256, 132, 2, 2048) && !pairs_fill_one_block_an_sm(133, 132, 2, 4096));
        assert!(!pairs_fill_one_block_an_sm(128, 132, 1, 4096) && !pairs_fill_one_block_an_sm(128, 132, 2, 511));
    }

    #[test]
    fn pairs_even_the_sms_where_one_split_leaves_them_uneven() {
        // 24 x 2730 at Hkv 8 (192 blocks): 0.73 -> 0.97; 20 x 3276 (160): 0.61 -> 0.81.
        assert!(pairs_even_the_sms(192, 132, 4, 2730) && pairs_even_the_sms(160, 132, 4, 3276));
        // 32 x 2048 (256): 0.97 either way; 36 x 1820 (288): pairs past a wave of four; 128 blocks:
        // one an SM (pairs_fill_one_block_an_sm's); too few keys to split.
        assert!(!pairs_even_the_sms(256, 132, 4, 2048) && !pairs_even_the_sms(288, 132, 4, 1820));
        assert!(!pairs_even_the_sms(128, 132, 4, 4096) && !pairs_even_the_sms(192, 132, 4, 511));
    }

    #[test]
    fn visible_keys_follow_the_window() {
        let mut p = call(2, 4, 8, 2, 1000);
        assert_eq!(max_visible_keys(&p, &[1000, 300], &[0, 100]), 1000);
        p.left = Some(63); // row 3 sees 64 keys ending at the last; row 0 three earlier
        assert_eq!(max_visible_keys(&p, &[1000, 300], &[0, 100]), 67);
        assert_eq!(max_visible_keys(&p, &[0, 0], &[0, 0]), 0);
        p.causal = false;
        p.left = None;
        p.right = Some(0);
        assert_eq!(max_visible_keys(&p, &[10], &[8]), 2);
    }

    #[test]
    fn mixed_cache_formats_are_refused() {
        let p = call(1, 1, 8, 2, 64);
        let f4 = QuantFormat::new(4, 64, 128).unwrap();
        let f8 = QuantFormat::new(8, 32, 128).unwrap();
        let f4b = QuantFormat::new(4, 32, 128).unwrap();
        assert_eq!(cache_bits(&p, None, None).unwrap(), 0);
        assert_eq!(cache_bits(&p, Some(&f4), Some(&f4b)).unwrap(), 4);
        assert!(matches!(cache_bits(&p, Some(&f4), Some(&f8)), Err(FlashError::Unsupported(_))));
        assert!(matches!(cache_bits(&p, None, Some(&f8)), Err(FlashError::Unsupported(_))));
    }

    #[test]
    fn the_one_wave_kernel_serves_grids_one_block_an_sm_past_a_wave() {
        // H200: 132 SMs, three 4-bit blocks each, four in the kernel; 64 x 1024 (Hkv 8) is 512 blocks.
        assert!(needs_one_wave_kernel(512, 132, 3, 4) && needs_one_wave_kernel(397, 132, 3, 4) && needs_one_wave_kernel(528, 132, 3, 4));
        assert!(!needs_one_wave_kernel(396, 132, 3, 4) && !needs_one_wave_kernel(529, 132, 3, 4) && !needs_one_wave_kernel(768, 132, 3, 4));
        // The 8-bit kernel's two blocks an SM: from 265 to 528 blocks.
        assert!(needs_one_wave_kernel(265, 132, 2, 4) && needs_one_wave_kernel(512, 132, 2, 4));
        assert!(!needs_one_wave_kernel(264, 132, 2, 4) && !needs_one_wave_kernel(529, 132, 2, 4));
    }

    #[test]
    fn the_one_wave_kernel_takes_the_splits_that_fit_it() {
        // H200 (132 SMs, three 4-bit blocks each), Hkv 8: 64 x 1024 unsplit; 32 x 2048 from 3
        // splits to 2; 8 x 8192 (6 splits, 384 blocks) and 128 x 512 (1024 blocks) keep theirs.
        let trip = kv::merge_one_trip_parts();
        assert_eq!(one_wave_splits(512, 1, false, 132, (3, 4), 1024, trip), Some(1));
        assert_eq!(one_wave_splits(256, 3, false, 132, (3, 4), 2048, trip), Some(2));
        assert_eq!(one_wave_splits(64, 6, false, 132, (3, 4), 8192, trip), None);
        assert_eq!(one_wave_splits(1024, 1, false, 132, (3, 4), 512, trip), None);
        // Eight blocks an SM: 128 x 512 (1024 blocks), past four.
        assert_eq!(one_wave_splits(1024, 1, false, 132, (3, 8), 512, trip), Some(1));
        // 8-bit (two blocks an SM): 64 x 1024 unsplit, 512 blocks; 8 x 8192's 4 splits fit a wave.
        assert_eq!(one_wave_splits(512, 1, false, 132, (2, 4), 1024, trip), Some(1));
        assert_eq!(one_wave_splits(64, 4, false, 132, (2, 4), 8192, trip), None);
        // 48 x 1365 8-bit (384 blocks unsplit): one wave of the four-block kernel, ~3 blocks an SM;
        // 4-bit at 400 blocks (past three an SM by 4) likewise.
        assert_eq!(one_wave_splits(384, 1, false, 132, (2, 4), 1365, trip), Some(1));
        assert_eq!(one_wave_splits(400, 1, false, 132, (3, 4), 1310, trip), Some(1));
        // 36 x 1820 4-bit: 4 splits (1152 blocks) fill 55 % of sixteen blocks an SM; 7 fill 95 %.
        assert_eq!(one_wave_splits(288, 4, false, 132, (3, 16), 1820, trip), Some(7));
        // 20 x 3276 (160 groups): the four-block kernel's 3 splits, where choose_splits found 8
        // (8-bit) or 13 (4-bit) over several waves; 17 x 3855 (136): 3 fill 77 % of its wave.
        assert_eq!(one_wave_splits(160, 8, false, 132, (2, 4), 3276, trip), Some(3));
        assert_eq!(one_wave_splits(160, 13, false, 132, (3, 4), 3276, trip), Some(3));
        assert_eq!(one_wave_splits(136, 15, false, 132, (3, 4), 3855, trip), Some(3));
        // 36 x 1820 (288): one split fills 55 % of the four-block wave (none), three 82 % of eight.
        assert_eq!(one_wave_splits(288, 7, false, 132, (2, 4), 1820, trip), None);
        assert_eq!(one_wave_splits(288, 7, false, 132, (2, 8), 1820, trip), Some(3));
        // Too few keys for more splits: 160 groups of 256 keys take one split at most (30 %).
        assert_eq!(one_wave_splits(160, 8, false, 132, (2, 4), 256, trip), None);
        // A count asked for is kept: the kernel only where it fits those splits.
        assert_eq!(one_wave_splits(256, 3, true, 132, (3, 4), 2048, trip), None);
        assert_eq!(one_wave_splits(256, 2, true, 132, (3, 4), 2048, trip), Some(2));
    }

    #[test]
    fn short_rows_past_every_wave_take_the_most_blocks_an_sm() {
        // H200 (132 SMs), Hkv 8, sixteen blocks an SM at most: 512 x 128 (4096 blocks) and
        // 2200 x 256 do; 256 x 256 (2048 blocks) fits a wave; 512 x 1024's rows are long.
        assert!(short_rows_past_every_wave(4096, 132, 16, 128, 1) && short_rows_past_every_wave(17600, 132, 16, 256, 1));
        assert!(!short_rows_past_every_wave(2048, 132, 16, 256, 1) && !short_rows_past_every_wave(4096, 132, 16, 1024, 1));
        assert!(short_rows_past_every_wave(4096, 132, 16, 1024, 4) && !short_rows_past_every_wave(4096, 132, 16, 1024, 3));
    }

    #[test]
    fn wide_blocks_take_groups_that_nearly_fill_the_sms() {
        // 132 SMs, Hkv 8: 16 x 4096 is 128 groups. 4-bit from 113 groups (85 %), 8-bit from 93 (70 %).
        assert!(fills_the_sms_unsplit(128, 132, 4) && fills_the_sms_unsplit(113, 132, 4) && fills_the_sms_unsplit(132, 132, 4));
        assert!(!fills_the_sms_unsplit(112, 132, 4) && !fills_the_sms_unsplit(133, 132, 4) && !fills_the_sms_unsplit(96, 132, 4));
        assert!(fills_the_sms_unsplit(96, 132, 8) && fills_the_sms_unsplit(93, 132, 8) && !fills_the_sms_unsplit(92, 132, 8));
        assert!(!fills_the_sms_unsplit(133, 132, 8) && !fills_the_sms_unsplit(64, 132, 8));
    }

    #[test]
    fn splits_merge_as_a_cluster_on_hopper_only() {
        assert!(cluster_merges((9, 0), Kernel::Decode, 0, 2));
        assert!(!cluster_merges((9, 0), Kernel::Decode, 0, 1) && !cluster_merges((9, 0), Kernel::Decode, 0, 4));
        assert!(!cluster_merges((9, 0), Kernel::Decode, 0, 8) && !cluster_merges((9, 0), Kernel::Decode, 0, 9));
        assert!(!cluster_merges((8, 0), Kernel::Decode, 0, 4) && !cluster_merges((9, 0), Kernel::DecodeSimt, 0, 4));
        assert!(!cluster_merges((9, 0), Kernel::Decode, 8, 4) && !cluster_merges((9, 0), Kernel::Decode, 4, 2));
    }

    #[test]
    fn window_sides_are_capped_for_the_kernel() {
        let mut p = call(1, 2, 8, 8, 64);
        let ptrs = DecodePtrs { q: 0, k: CachePtrs { data: 0, scales: 0, biases: 0 }, v: CachePtrs { data: 0, scales: 0, biases: 0 }, seqlens: 0, leftpad: 0, o: 0, lse: 0 };
        let plan = Plan { warp_states: 1, chunks: 1, splits: 1, cluster: false };
        let prm = params(&p, 0, 0, 0, plan, &ptrs, (0, 0));
        assert_eq!((prm.win_left, prm.win_right, prm.row_bytes, prm.states), (1 << 30, 0, 256, 2));
        p.causal = false;
        p.left = Some(5);
        p.softcap = Some(20.0);
        let prm = params(&p, 4, 64, 32, plan, &ptrs, (0, 0));
        assert_eq!((prm.win_left, prm.win_right, prm.row_bytes, prm.bits), (5, 1 << 30, 64, 4));
        assert!((prm.cap_in - 0.1 / 20.0).abs() < 1e-9 && prm.cap_out > 28.0);
    }
}
