//! The KV-cache format's conversions and the state merge on the GPU (cuda/quantize_kv.cu,
//! cuda/dequantize_kv.cu, cuda/merge.cu): their params, and the device-pointer and host-memory
//! entry points. Formats and semantics are quant.rs's; quant.rs's checks validate the calls.

use cudarc::driver::sys as cu;

use super::device::{self, launch, ContextGuard, Device, DeviceBuffer};
use super::host::{download, upload, Stream};
use super::kv_variants::{elementwise_variant, merge_block_variant, ELEMENTWISE_WARPS};
use super::libs;
use super::variant::Kernel;
use crate::dtype::DType;
use crate::error::{FlashError, Result};
use crate::guard::catch_panics;
use crate::quant::{check_merge, QuantFormat};

/// cuda/kv_quant.h's `QuantParams`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct QuantParams {
    x: u64,
    values: u64,
    scales: u64,
    biases: u64,
    rows: i64,
    head_dim: i32,
    group_size: i32,
    bits: i32,
    _pad: i32,
}

/// cuda/merge.cu's `MergeParams`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MergeParams {
    o_parts: u64,
    lse_parts: u64,
    o: u64,
    lse: u64,
    parts: i32,
    batch: i32,
    seq_q: i32,
    heads: i32,
    dv: i32,
    parts_f32: i32,
}

/// Device pointers of a cache and its quantized form (quant.rs's layouts on one GPU).
#[derive(Debug, Clone, Copy)]
pub struct QuantPtrs {
    pub x: u64,      // [B, S, Hkv, D] in the dtype (quantize's input, dequantize's output)
    pub values: u64, // [B, S, Hkv, D * bits / 32] u32
    pub scales: u64, // [B, S, Hkv, D / group_size] in the dtype
    pub biases: u64, // as scales
}

/// Device pointers of a merge (quant.rs's `merge_states` layouts on one GPU).
#[derive(Debug, Clone, Copy)]
pub struct MergePtrs {
    pub o_parts: u64,   // [P, B, Sq, H, Dv] in the dtype
    pub lse_parts: u64, // [P, B, H, Sq] f32
    pub o: u64,         // [B, Sq, H, Dv] in the dtype
    pub lse: u64,       // [B, H, Sq] f32
}

/// Most blocks a grid-stride launch takes: more than any GPU runs at once.
const MAX_BLOCKS: usize = 1 << 16;

fn grid_for(items: usize, per_block: usize) -> (u32, u32, u32) {
    (items.div_ceil(per_block).clamp(1, MAX_BLOCKS) as u32, 1, 1)
}

/// A slice of 4-byte values (u32, i32, f32) as its bytes, for the copies.
pub(super) fn bytes_of<T: Copy>(x: &[T]) -> &[u8] {
    // SAFETY: T is a plain 4-byte value type here (u32, i32, f32); any byte view of it is valid.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
}

/// As [`bytes_of`], writable.
pub(super) fn bytes_of_mut<T: Copy>(x: &mut [T]) -> &mut [u8] {
    // SAFETY: as bytes_of; every bit pattern is a valid u32, i32 or f32.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut u8, std::mem::size_of_val(x)) }
}

/// Runs `body` with GPU `device`'s context current (the caller's restored after).
fn on_device<T>(device: usize, body: impl FnOnce(&Device) -> Result<T>) -> Result<T> {
    catch_panics("CUDA", || {
        let dev = device::device(device)?;
        libs::ensure_nvrtc()?;
        let _ctx = ContextGuard::new(&dev)?;
        body(&dev)
    })
}

/// Queues quantize_kv (`kernel` QuantizeKv) or dequantize_kv on `s`.
///
/// # Safety
/// As [`quantize_device`].
unsafe fn run_quant(dev: &Device, kernel: Kernel, dtype: DType, fmt: &QuantFormat, rows: usize, s: cu::CUstream, ptrs: QuantPtrs) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let v = elementwise_variant(kernel, dtype);
    let f = device::function(dev, &v)?;
    let prm = QuantParams {
        x: ptrs.x,
        values: ptrs.values,
        scales: ptrs.scales,
        biases: ptrs.biases,
        rows: rows as i64,
        head_dim: fmt.head_dim as i32,
        group_size: fmt.group_size as i32,
        bits: fmt.bits as i32,
        _pad: 0,
    };
    // quantize: a thread per (row, group); dequantize: a thread per 8 elements.
    let items = if kernel == Kernel::QuantizeKv { rows * fmt.groups() } else { rows * fmt.head_dim / 8 };
    // SAFETY: the caller's pointers, of the sizes the format and rows imply; the params mirror the kernel's.
    unsafe { launch(kernel.entry(), f, grid_for(items, v.threads() as usize), s, &prm) }
}

/// Quantizes `rows` cache rows on GPU `device`, queued on `stream` (nothing synchronised).
///
/// # Safety
/// The pointers must be device memory of that GPU with [`QuantPtrs`]' layouts for `rows` rows of
/// `fmt` in `dtype`, valid until `stream` reaches this work; `stream` (a CUstream as an integer,
/// 0 = legacy default) must belong to the device's primary context.
pub unsafe fn quantize_device(dtype: DType, fmt: &QuantFormat, rows: usize, device: usize, stream: usize, ptrs: QuantPtrs) -> Result<()> {
    // SAFETY: the caller's guarantees, passed on.
    on_device(device, |dev| unsafe { run_quant(dev, Kernel::QuantizeKv, dtype, fmt, rows, stream as cu::CUstream, ptrs) })
}

/// Dequantizes `rows` cache rows into `ptrs.x` on GPU `device`, queued on `stream`.
///
/// # Safety
/// As [`quantize_device`].
pub unsafe fn dequantize_device(dtype: DType, fmt: &QuantFormat, rows: usize, device: usize, stream: usize, ptrs: QuantPtrs) -> Result<()> {
    // SAFETY: the caller's guarantees, passed on.
    on_device(device, |dev| unsafe { run_quant(dev, Kernel::DequantizeKv, dtype, fmt, rows, stream as cu::CUstream, ptrs) })
}

/// [`crate::quant::quantize`] on host memory through GPU `device` (copy in, convert, copy out).
pub fn quantize_host(device: usize, dtype: DType, fmt: &QuantFormat, x: &[u8], values: &mut [u32], scales: &mut [u8], biases: &mut [u8]) -> Result<()> {
    let rows = x.len() / (fmt.head_dim * dtype.size_bytes());
    fmt.check(dtype, rows, x.len(), values.len(), scales.len(), biases.len())?;
    on_device(device, |dev| {
        let s = Stream::new()?;
        let xb = upload(x, &s)?;
        let vb = DeviceBuffer::alloc(values.len() * 4, s.0)?;
        let (sb, bb) = (DeviceBuffer::alloc(scales.len(), s.0)?, DeviceBuffer::alloc(biases.len(), s.0)?);
        let ptrs = QuantPtrs { x: xb.ptr, values: vb.ptr, scales: sb.ptr, biases: bb.ptr };
        // SAFETY: buffers sized from the format and rows, on this device, ordered on stream s.
        unsafe { run_quant(dev, Kernel::QuantizeKv, dtype, fmt, rows, s.0, ptrs)? };
        download(bytes_of_mut(values), &vb, &s)?;
        download(scales, &sb, &s)?;
        download(biases, &bb, &s)?;
        s.sync()
    })
}

/// [`crate::quant::dequantize`] on host memory through GPU `device`.
pub fn dequantize_host(device: usize, dtype: DType, fmt: &QuantFormat, values: &[u32], scales: &[u8], biases: &[u8], out: &mut [u8]) -> Result<()> {
    let rows = values.len() / fmt.words();
    fmt.check(dtype, rows, out.len(), values.len(), scales.len(), biases.len())?;
    on_device(device, |dev| {
        let s = Stream::new()?;
        let (vb, sb, bb) = (upload(bytes_of(values), &s)?, upload(scales, &s)?, upload(biases, &s)?);
        let xb = DeviceBuffer::alloc(out.len(), s.0)?;
        let ptrs = QuantPtrs { x: xb.ptr, values: vb.ptr, scales: sb.ptr, biases: bb.ptr };
        // SAFETY: as quantize_host.
        unsafe { run_quant(dev, Kernel::DequantizeKv, dtype, fmt, rows, s.0, ptrs)? };
        download(out, &xb, &s)?;
        s.sync()
    })
}

/// The merge's sizes [P, B, Sq, H, Dv] must fit the kernel's ints.
fn check_merge_dims(dims: [usize; 5]) -> Result<()> {
    let [p, b, sq, h, dv] = dims;
    if dims.iter().any(|&n| n > i32::MAX as usize) || (b * sq * h).checked_mul(dv).is_none() {
        return Err(FlashError::Unsupported(format!("merge_states: sizes [P, B, Sq, H, Dv] = {:?} exceed the CUDA backend's limits", [p, b, sq, h, dv])));
    }
    Ok(())
}

/// Parts a warp of cuda/merge.cu takes in one memory trip (its MERGE_CHUNK; a unit test reads it
/// there).
pub(super) const MERGE_CHUNK: usize = 16;

/// Parts the merge takes in about one memory trip: a warp's trip for each warp of a block
/// (merge_block_variant's kernel, cuda/merge.cu merge_state_block).
pub(super) const fn merge_one_trip_parts() -> usize {
    ELEMENTWISE_WARPS * MERGE_CHUNK
}

/// Whether the merge takes a block per state (decode's f32 parts, more than one warp's trip and at
/// most one trip of the block), else a warp per state.
fn merges_by_block(parts: usize, dv: usize, parts_f32: bool) -> bool {
    parts_f32 && dv.is_multiple_of(4) && parts > MERGE_CHUNK && parts <= merge_one_trip_parts()
}

/// Queues the merge of `dims` = [P, B, Sq, H, Dv] on `s`; `parts_f32`: o_parts holds f32 (decode's
/// partial states), else the dtype.
///
/// # Safety
/// As [`merge_states_device`].
pub(super) unsafe fn merge(dev: &Device, dtype: DType, dims: [usize; 5], ptrs: MergePtrs, parts_f32: bool, s: cu::CUstream) -> Result<()> {
    check_merge_dims(dims)?;
    let [parts, batch, seq_q, heads, dv] = dims;
    let states = batch * seq_q * heads;
    if states == 0 {
        return Ok(());
    }
    let block_per_state = merges_by_block(parts, dv, parts_f32);
    let v = if block_per_state { merge_block_variant(dtype) } else { elementwise_variant(Kernel::MergeStates, dtype) };
    let f = device::function(dev, &v)?;
    let prm = MergeParams {
        o_parts: ptrs.o_parts,
        lse_parts: ptrs.lse_parts,
        o: ptrs.o,
        lse: ptrs.lse,
        parts: parts as i32,
        batch: batch as i32,
        seq_q: seq_q as i32,
        heads: heads as i32,
        dv: dv as i32,
        parts_f32: parts_f32 as i32,
    };
    // A warp per state (a block with block_per_state), launched dependent on the kernel before it on
    // s (decode's, which releases it before its epilogue; the merge waits for that kernel's end
    // before reading the parts).
    let grid = grid_for(states, if block_per_state { 1 } else { v.tiles.num_warps });
    // SAFETY: the caller's pointers, of the sizes dims imply; the params mirror the kernel's, which
    // waits for the prior grid.
    unsafe { device::launch_dependent(dev, "flash_merge_states", f, grid, s, &prm) }
}

/// Merges `dims` = [P, B, Sq, H, Dv] partial states on GPU `device`, queued on `stream`.
///
/// # Safety
/// The pointers must be device memory of that GPU with [`MergePtrs`]' layouts, valid until
/// `stream` reaches this work; `stream` must belong to the device's primary context.
pub unsafe fn merge_states_device(dtype: DType, dims: [usize; 5], device: usize, stream: usize, ptrs: MergePtrs) -> Result<()> {
    // SAFETY: the caller's guarantees, passed on.
    on_device(device, |dev| unsafe { merge(dev, dtype, dims, ptrs, false, stream as cu::CUstream) })
}

/// [`crate::quant::merge_states`] on host memory through GPU `device`.
pub fn merge_states_host(device: usize, dtype: DType, dims: [usize; 5], o_parts: &[u8], lse_parts: &[f32], o: &mut [u8], lse: &mut [f32]) -> Result<()> {
    let [p, b, sq, h, dv] = dims;
    check_merge(dtype, p, b, sq, h, dv, o_parts.len(), lse_parts.len(), o.len(), lse.len())?;
    on_device(device, |dev| {
        let s = Stream::new()?;
        let (op, lp) = (upload(o_parts, &s)?, upload(bytes_of(lse_parts), &s)?);
        let (ob, lb) = (DeviceBuffer::alloc(o.len(), s.0)?, DeviceBuffer::alloc(lse.len() * 4, s.0)?);
        let ptrs = MergePtrs { o_parts: op.ptr, lse_parts: lp.ptr, o: ob.ptr, lse: lb.ptr };
        // SAFETY: buffers sized from dims, on this device, ordered on stream s.
        unsafe { merge(dev, dtype, dims, ptrs, false, s.0)? };
        download(o, &ob, &s)?;
        download(bytes_of_mut(lse), &lb, &s)?;
        s.sync()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_structs_match_the_kernels() {
        // 4 pointers, an i64, 4 ints (cuda/kv_quant.h); 4 pointers, 6 ints (cuda/merge.cu).
        assert_eq!(std::mem::size_of::<QuantParams>(), 4 * 8 + 8 + 4 * 4);
        assert_eq!(std::mem::size_of::<MergeParams>(), 4 * 8 + 6 * 4);
    }

    #[test]
    fn the_merge_chunk_is_the_kernels() {
        let src = super::super::sources::FILES.iter().find(|(n, _)| *n == "merge.cu").expect("merge.cu is embedded").1;
        assert!(src.contains(&format!("#define MERGE_CHUNK {MERGE_CHUNK}\n")), "cuda/merge.cu's MERGE_CHUNK is kv.rs's");
        assert!(merges_by_block(17, 128, true) && merges_by_block(128, 4, true));
        assert!(!merges_by_block(16, 128, true) && !merges_by_block(129, 128, true));
        assert!(!merges_by_block(40, 128, false) && !merges_by_block(40, 126, true));
        assert_eq!(merge_block_variant(DType::F32).tiles.num_warps * MERGE_CHUNK, merge_one_trip_parts());
    }

    #[test]
    fn grids_stride_past_their_cap() {
        assert_eq!(grid_for(0, 256).0, 1);
        assert_eq!(grid_for(257, 256).0, 2);
        assert_eq!(grid_for(usize::MAX / 2, 256).0 as usize, MAX_BLOCKS);
    }
}
