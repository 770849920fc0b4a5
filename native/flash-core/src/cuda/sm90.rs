//! The Hopper kernels (cuda/fwd_sm90.cu, cuda/bwd_sm90.cu, and in f32 cuda/fwd_sm90_f32_f16.cu or
//! cuda/fwd_sm90_f32.cu, cuda/bwd_dq_sm90_f32.cu and cuda/bwd_dkdv_sm90_f32.cu): when a call takes them, their tensor
//! maps, and their launches.
//!
//! The forward runs on compute capability 9.0 for fp16 / bf16 at D = 64, 128 and 256 (the call's
//! head dim after padding), the backward at D = 64 and 128, both with every mask but varlen batches
//! and every score modifier, unless `FLASH_NIF_SM90=0`. In f32 (one 11-bit product under `"tf32"`,
//! split products under `"exact"`: the forward on scaled fp16 operands unless
//! `FLASH_NIF_TF32_PARTS=1`, the backward on TF32 ones) the forward and the backward (a dQ kernel, then a dK/dV kernel)
//! run at D = 64 and 128, on plain problems (causal or not). Anything else runs the portable
//! kernels, which compute the same function; [`forward_choice`] and [`backward_choice`] say which
//! and why, and `FLASH_NIF_LOG=1` prints it per call.

use cudarc::driver::sys as cu;

use super::device::{self, Device};
use super::launch::{FlashParams, KernelStrides, MaskFields, MaskedParams};
use super::variant::Kernel;
use crate::dtype::DType;
use crate::error::{FlashError, Result};
use crate::problem::Problem;

/// The environment variable that turns the Hopper kernels off (`0`).
pub const SM90_ENV: &str = "FLASH_NIF_SM90";

/// Is the Hopper path allowed by the environment (`FLASH_NIF_SM90` unset or not `0`)?
pub fn enabled() -> bool {
    std::env::var(SM90_ENV).map_or(true, |v| v.trim() != "0")
}

/// Head dims the Hopper forward has kernels for.
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// Head dims the Hopper f32 forward has kernels for.
pub const F32_HEAD_DIMS: [usize; 2] = [64, 128];
/// Head dims the Hopper f32 backward has kernels for (config.rs's sm90_f32_bwd_tiles: two TF32
/// parts of every operand fill the shared memory).
pub const F32_BWD_HEAD_DIMS: [usize; 2] = [64, 128];
/// Head dims the Hopper backward has kernels for (D = 256's K, V, dK and dV do not fit one block's
/// registers and shared memory in this design).
pub const BWD_HEAD_DIMS: [usize; 2] = [64, 128];

/// A tensor the copy engine would read: its pointer, where its rows lie, and its rows per batch row.
pub(super) type MappedTensor = (u64, KernelStrides, usize);

/// Whether `p`'s forward (head dims already the kernels') runs the Hopper kernel on `dev` (`tensors`:
/// q, k, v): Ok(()) when it does, else the reason it does not.
pub(super) fn forward_choice(dev: &Device, p: &Problem, tensors: &[MappedTensor]) -> std::result::Result<(), String> {
    if p.dtype == DType::F32 {
        common_choice(dev, p, tensors, &F32_HEAD_DIMS)?;
        f32_choice(p, Kernel::FwdSm90, "forward")?;
    } else {
        common_choice(dev, p, tensors, &HEAD_DIMS)?;
    }
    fits(dev, p, Kernel::FwdSm90)
}

/// Whether `p`'s backward (head dims already the kernels') runs the Hopper kernels on `dev`
/// (`tensors`: q, k, v, dO): Ok(()) when it does, else the reason it does not.
pub(super) fn backward_choice(dev: &Device, p: &Problem, tensors: &[MappedTensor]) -> std::result::Result<(), String> {
    if p.dtype == DType::F32 {
        // Both kernels write their gradients directly, no atomics: deterministic either way.
        common_choice(dev, p, tensors, &F32_BWD_HEAD_DIMS)?;
        f32_choice(p, Kernel::BwdSm90, "backward")?;
        fits(dev, p, Kernel::BwdDqSm90)?;
        return fits(dev, p, Kernel::BwdSm90);
    }
    common_choice(dev, p, tensors, &BWD_HEAD_DIMS)?;
    if !p.is_plain() && p.dims.head_dim > 64 {
        // Its masked kernel has 224 registers per consumer thread, too few for D = 128's products.
        return Err(format!("masks at head dim {} run the portable kernels", p.dims.head_dim));
    }
    if p.deterministic && !p.is_plain() {
        // The ordered dQ reductions count the key blocks before this one, which a mask may skip.
        return Err("deterministic with masks runs the portable kernels".into());
    }
    fits(dev, p, Kernel::BwdSm90)
}

/// The f32 Hopper kernels' own conditions (`pass`: "forward" or "backward"): plain problems, and
/// under `"exact"` the split TF32 that [`super::config::tf32_terms`] allows.
fn f32_choice(p: &Problem, kernel: Kernel, pass: &str) -> std::result::Result<(), String> {
    if !p.is_plain() {
        return Err("float32 with masks or score modifiers runs the portable kernels".into());
    }
    let d = &p.dims;
    if super::config::tf32_terms(kernel, p.dtype, p.precision, d.seq_k, d.head_dim) == 0 {
        return Err(format!(
            "float32 \"exact\" runs the Hopper f32 {pass}'s split TF32 only with {} keys or more and not {}=0",
            super::config::MIN_SPLIT_TF32_KEYS,
            super::config::TF32_ENV
        ));
    }
    Ok(())
}

fn common_choice(dev: &Device, p: &Problem, tensors: &[MappedTensor], head_dims: &[usize]) -> std::result::Result<(), String> {
    if dev.cc != (9, 0) {
        return Err(format!("compute capability {}.{} is not 9.0", dev.cc.0, dev.cc.1));
    }
    if !enabled() {
        return Err(format!("{SM90_ENV}=0"));
    }
    if !head_dims.contains(&p.dims.head_dim) {
        return Err(format!("head dim {} is not one of {head_dims:?}", p.dims.head_dim));
    }
    if p.mask.varlen.is_some() {
        return Err("varlen batches run the portable kernels".into());
    }
    if p.dims.seq_k == 0 {
        return Err("no keys".into());
    }
    if tensors.iter().any(|(x, _, _)| x % 16 != 0) {
        return Err("the tensors must be 16-byte aligned for the tensor copy engine".into());
    }
    // The copy engine takes strides of 16 bytes up to 2^40, not 0 (a broadcast axis); the f32
    // kernel's 16-byte loads need the same of every row start.
    let e = p.dtype.size_bytes() as i64;
    for &(_, st, rows) in tensors {
        let ok = |s: i64| s > 0 && (s * e) % 16 == 0 && s * e < 1 << 40;
        if !(ok(st.seq) && ok(st.head) && (p.dims.batch == 1 || ok(st.batch(rows)))) {
            return Err("strides the tensor copy engine cannot take (0, or not 16-byte multiples)".into());
        }
    }
    Ok(())
}

/// A GPU (or FLASH_NIF_MAX_SMEM) that gives a block less shared memory than the kernel needs.
fn fits(dev: &Device, p: &Problem, kernel: Kernel) -> std::result::Result<(), String> {
    match super::launch::kernel_variant(dev, p, kernel) {
        Err(FlashError::Unsupported(why)) => Err(why),
        _ => Ok(()), // a compile error surfaces from the launch itself
    }
}

/// The kernel parameter of cuda/fwd_sm90.cu: the tensor maps of q, k, v, then the params
/// ([`FlashParams`], or for the MASKED variants [`MaskedParams`]).
#[repr(C)]
#[derive(Clone, Copy)]
struct Sm90Params<P> {
    tq: cu::CUtensorMap,
    tk: cu::CUtensorMap,
    tv: cu::CUtensorMap,
    p: P,
}

/// The 4-d tensor map (D, heads, rows, batch) of a [B, S, H, D] tensor at `ptr` laid out as `st`,
/// read in boxes of 64 elements (128 bytes, swizzled) x 1 head x `box_rows` rows x 1 batch row.
/// Rows past S arrive as zeros.
#[allow(clippy::too_many_arguments)] // one tensor's pointer, layout and box
fn tensor_map(ptr: u64, st: &KernelStrides, dtype: DType, batch: usize, rows: usize, heads: usize, d: usize, box_rows: usize) -> Result<cu::CUtensorMap> {
    use cu::CUtensorMapDataType as T;
    let data_type = match dtype {
        DType::F16 => T::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::BF16 => T::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F32 => return Err(FlashError::Internal("no float32 tensor maps".into())),
    };
    let e = dtype.size_bytes() as u64;
    let dims = [d as u64, heads as u64, rows as u64, batch as u64];
    // A single batch row's batch stride is never stepped over: any valid value serves.
    let batch_stride = if batch == 1 { (rows as i64 * st.seq).max(1) } else { st.batch(rows) };
    let strides = [st.head as u64 * e, st.seq as u64 * e, batch_stride as u64 * e];
    let boxes = [64u32, 1, box_rows as u32, 1];
    let elem_strides = [1u32; 4];
    let mut map = std::mem::MaybeUninit::<cu::CUtensorMap>::zeroed();
    // SAFETY: out-pointer to a zeroed map; the arrays hold rank (4) entries (strides rank - 1).
    device::check("cuTensorMapEncodeTiled", unsafe {
        cu::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type,
            4,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            cu::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            cu::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    })?;
    // SAFETY: written by the driver on success.
    Ok(unsafe { map.assume_init() })
}

/// Launches the Hopper forward for `p` with `prm` (pointers set).
///
/// # Safety
/// As [`super::launch::forward_device`]; [`forward_choice`] must have accepted `p`.
pub(super) unsafe fn forward(dev: &Device, p: &Problem, s: cu::CUstream, prm: &FlashParams, mask: Option<&MaskFields>) -> Result<()> {
    if p.dtype == DType::F32 {
        // SAFETY: the caller's guarantees, passed on.
        return unsafe { forward_f32(dev, p, s, prm) };
    }
    let d = &p.dims;
    let v = super::launch::kernel_variant(dev, p, Kernel::FwdSm90)?;
    let f = device::function(dev, &v)?;
    let (bm, bn) = (v.tiles.block_m, v.tiles.block_n);
    let (tq, tk, tv) = (
        tensor_map(prm.q, &prm.q_st, p.dtype, d.batch, d.seq_q, d.heads, d.head_dim, bm)?,
        tensor_map(prm.k, &prm.k_st, p.dtype, d.batch, d.seq_k, d.kv_heads, d.head_dim, bn)?,
        tensor_map(prm.v, &prm.v_st, p.dtype, d.batch, d.seq_k, d.kv_heads, d.head_dim, bn)?,
    );
    // Plain non-causal calls: persistent, a block per SM at most, each walking tiles (query block,
    // head, batch row) with a fixed stride. Causal and masked tiles differ in work, which a fixed
    // stride would share out unevenly (measured 0.57-0.77x cuDNN causal against 0.76-1.05x): a
    // block per tile, heaviest first, which the hardware hands to SMs as they free up.
    let tiles = d.seq_q.div_ceil(bm) * d.heads * d.batch;
    if tiles > i32::MAX as usize {
        return Err(FlashError::Unsupported(format!("{tiles} query tiles exceed the Hopper forward's limit")));
    }
    let uniform = !p.causal && p.is_plain();
    let blocks = if uniform { tiles.min(dev.sm_count.max(1) as usize) } else { tiles };
    let grid = (blocks as u32, 1, 1);
    super::trace::kernel("forward", &v);
    // SAFETY: the caller's guarantees; each struct mirrors its kernel's parameter.
    unsafe {
        match mask {
            None => device::launch(v.kernel.entry(), f, grid, s, &Sm90Params { tq, tk, tv, p: *prm }),
            Some(m) => device::launch(v.kernel.entry(), f, grid, s, &Sm90Params { tq, tk, tv, p: MaskedParams { base: *prm, mask: *m } }),
        }
    }
}

/// Launches the Hopper f32 forward (cuda/fwd_sm90_f32.cu) for `p` with `prm`: its producer warps
/// read q, k, v through the params' strides (no tensor maps), a block per query tile, causal
/// heaviest first, as the portable forward.
///
/// # Safety
/// As [`forward`].
unsafe fn forward_f32(dev: &Device, p: &Problem, s: cu::CUstream, prm: &FlashParams) -> Result<()> {
    let d = &p.dims;
    let v = super::launch::kernel_variant(dev, p, Kernel::FwdSm90)?;
    let f = device::function(dev, &v)?;
    let grid = (super::launch::grid_over(d.seq_q, v.tiles.block_m), d.heads as u32, d.batch as u32);
    super::trace::kernel("forward", &v);
    // SAFETY: the caller's guarantees; the kernel takes FlashParams by value.
    unsafe { device::launch(v.kernel.entry(), f, grid, s, prm) }
}

/// The kernel parameter of cuda/bwd_sm90.cu: the tensor maps of q, k, v, dO, the deterministic
/// mode's semaphores, then the params ([`FlashParams`] or [`MaskedParams`]).
#[repr(C)]
#[derive(Clone, Copy)]
struct Sm90BwdParams<P> {
    tq: cu::CUtensorMap,
    tk: cu::CUtensorMap,
    tv: cu::CUtensorMap,
    tdo: cu::CUtensorMap,
    dq_sem: u64,
    m_blocks: i32,
    _pad: i32,
    p: P,
}

/// The Hopper backward's query tiles for `p`: (rows per tile, tiles per head). dq_accum holds
/// `[B, H, tiles * rows, D]` f32 in params.h's dq_tile_offset layout (whole tiles: the kernel adds a
/// tile in one piece); the deterministic mode's semaphores are `[B, H, tiles]` int32.
pub(super) fn backward_query_tiles(dev: &Device, p: &Problem) -> Result<(usize, usize)> {
    let rows = super::launch::kernel_variant(dev, p, Kernel::BwdSm90)?.tiles.block_m;
    Ok((rows, p.dims.seq_q.div_ceil(rows)))
}

/// Launches the Hopper backward for `p` with `prm` (pointers and workspace set: delta, lse_log2 and
/// the zeroed dq_accum; `dq_sem`, zeroed `[B, H, tiles]` int32 (backward_query_tiles) or 0 for unordered dQ
/// reductions).
///
/// # Safety
/// As [`super::launch::backward_device`]; [`backward_choice`] must have accepted `p`.
pub(super) unsafe fn backward(dev: &Device, p: &Problem, s: cu::CUstream, prm: &FlashParams, mask: Option<&MaskFields>, dq_sem: u64) -> Result<()> {
    let d = &p.dims;
    let v = super::launch::kernel_variant(dev, p, Kernel::BwdSm90)?;
    let f = device::function(dev, &v)?;
    let (bm, bn) = (v.tiles.block_m, v.tiles.block_n);
    let (tq, tk, tv, tdo) = (
        tensor_map(prm.q, &prm.q_st, p.dtype, d.batch, d.seq_q, d.heads, d.head_dim, bm)?,
        tensor_map(prm.k, &prm.k_st, p.dtype, d.batch, d.seq_k, d.kv_heads, d.head_dim, bn)?,
        tensor_map(prm.v, &prm.v_st, p.dtype, d.batch, d.seq_k, d.kv_heads, d.head_dim, bn)?,
        tensor_map(prm.dout, &prm.do_st, p.dtype, d.batch, d.seq_q, d.heads, d.head_dim, bm)?,
    );
    let m_blocks = d.seq_q.div_ceil(bm) as i32;
    let grid = (super::launch::grid_over(d.seq_k, bn), d.kv_heads as u32, d.batch as u32);
    super::trace::kernel("backward", &v);
    let params = |p| Sm90BwdParams { tq, tk, tv, tdo, dq_sem, m_blocks, _pad: 0, p };
    // SAFETY: the caller's guarantees; each struct mirrors the kernel's parameter.
    unsafe {
        match mask {
            None => device::launch(v.kernel.entry(), f, grid, s, &params(*prm)),
            Some(m) => {
                let prm = MaskedParams { base: *prm, mask: *m };
                let params = Sm90BwdParams { tq, tk, tv, tdo, dq_sem, m_blocks, _pad: 0, p: prm };
                device::launch(v.kernel.entry(), f, grid, s, &params)
            }
        }
    }
}

/// Launches the Hopper f32 backward for `p` with `prm` (pointers set, and the preprocess's delta
/// and lse_log2): cuda/bwd_dq_sm90_f32.cu (a block per query tile, dQ), then
/// cuda/bwd_dkdv_sm90_f32.cu (a block per key tile, dK and dV). Both read q, k, v and dO through
/// the params' strides (no tensor maps) and write their gradients directly: no dq_accum.
///
/// # Safety
/// As [`super::launch::backward_device`]; [`backward_choice`] must have accepted `p`.
pub(super) unsafe fn backward_f32(dev: &Device, p: &Problem, s: cu::CUstream, prm: &FlashParams) -> Result<()> {
    let d = &p.dims;
    let vq = super::launch::kernel_variant(dev, p, Kernel::BwdDqSm90)?;
    let vk = super::launch::kernel_variant(dev, p, Kernel::BwdSm90)?;
    let (fq, fk) = (device::function(dev, &vq)?, device::function(dev, &vk)?);
    let q_grid = (super::launch::grid_over(d.seq_q, vq.tiles.block_m), d.heads as u32, d.batch as u32);
    let kv_grid = (super::launch::grid_over(d.seq_k, vk.tiles.block_n), d.kv_heads as u32, d.batch as u32);
    super::trace::kernel("backward", &vk); // info() names the dK/dV kernel, as on the other paths
    // SAFETY: the caller's guarantees; both kernels take FlashParams by value.
    unsafe {
        device::launch(vq.kernel.entry(), fq, q_grid, s, prm)?;
        device::launch(vk.kernel.entry(), fk, kv_grid, s, prm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_struct_matches_the_kernel_layout() {
        // Three 128-byte, 128-aligned tensor maps, then FlashParams (cuda/fwd_sm90.cu).
        assert_eq!(std::mem::offset_of!(Sm90Params<FlashParams>, p), 3 * 128);
        assert_eq!(std::mem::offset_of!(Sm90Params<MaskedParams>, p), 3 * 128);
        assert_eq!(std::mem::align_of::<Sm90Params<MaskedParams>>(), 128);
        // bwd_sm90.cu: four maps, the semaphore pointer and two ints, then the params.
        assert_eq!(std::mem::offset_of!(Sm90BwdParams<FlashParams>, dq_sem), 4 * 128);
        assert_eq!(std::mem::offset_of!(Sm90BwdParams<MaskedParams>, p), 4 * 128 + 16);
    }
}
