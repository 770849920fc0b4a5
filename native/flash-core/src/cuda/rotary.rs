//! The rotary kernel's launch (cuda/rotary.cu): its params, the vector width a call can take, and
//! the device-pointer and host-memory entry points.

use cudarc::driver::sys as cu;

use super::config;
use super::device::{self, launch, ContextGuard, DeviceBuffer};
use super::host::{download, upload, Stream};
use super::libs;
use crate::error::{FlashError, Result};
use crate::guard::catch_panics;
use crate::rotary::{check_buffers, PositionSource, RotaryIo, RotaryProblem};

/// cuda/rotary.cu's `RotaryParams`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RotaryParams {
    x: u64,
    y: u64,
    cos: u64,
    sin: u64,
    positions: u64,
    rows: i32,
    heads: i32,
    seq: i32,
    head_dim: i32,
    half: i32,
    max_pos: i32,
    offset: i32,
    rot_units: i32,
    units: i32,
    tpr_shift: i32,
    sign: f32,
    _pad: i32,
}

/// Device pointers of a rotary call: [`RotaryIo`]'s buffers on one GPU (same layouts).
#[derive(Debug, Clone, Copy)]
pub struct RotaryPtrs {
    pub x: u64,         // [B, S, H, D] in p.dtype
    pub cos: u64,       // [max_pos, R/2] f32
    pub sin: u64,       // [max_pos, R/2] f32
    pub positions: u64, // [B, S] int32, exactly when p.positions is Array; else 0
    pub y: u64,         // [B, S, H, D] in p.dtype
}

/// The kernel indexes rows, table rows and positions with 32-bit ints.
fn check_supported(p: &RotaryProblem) -> Result<()> {
    let d = &p.dims;
    let rows = d.rows() * d.heads;
    for (what, n) in [("batch * seq * heads", rows), ("max_pos", d.max_pos), ("head_dim", d.head_dim)] {
        if n > i32::MAX as usize {
            return Err(FlashError::Unsupported(format!("rotary: {what} = {n} exceeds the CUDA backend's limit of {}", i32::MAX)));
        }
    }
    Ok(())
}

/// The positions pointer must be given exactly when the problem reads positions.
fn check_positions_ptr(p: &RotaryProblem, ptr: u64) -> Result<()> {
    match (p.positions, ptr) {
        (PositionSource::Array, 0) => Err(FlashError::Internal("the problem has positions but the call passed no pointer".into())),
        (PositionSource::Offset(_), 1..) => Err(FlashError::Internal("the call passed a positions pointer the problem does not read".into())),
        _ => Ok(()),
    }
}

/// Widest vector (elements of x per access) whose accesses are all aligned: D and R/2 multiples of
/// it, x and y aligned to its bytes, the tables to its f32 bytes (16 at most per access).
fn vector_width(p: &RotaryProblem, ptrs: &RotaryPtrs) -> usize {
    let (d, e) = (&p.dims, p.dtype.size_bytes());
    config::rotary_vecs(p.dtype)
        .find(|&v| {
            let table = (4 * v).min(16) as u64;
            d.head_dim % v == 0
                && d.half() % v == 0
                && [ptrs.x, ptrs.y].iter().all(|ptr| ptr % (v * e) as u64 == 0)
                && [ptrs.cos, ptrs.sin].iter().all(|ptr| ptr % table == 0)
        })
        .unwrap_or(1)
}

fn params(p: &RotaryProblem, ptrs: &RotaryPtrs, vec: usize, threads: usize) -> RotaryParams {
    let d = &p.dims;
    let rot_units = d.half() / vec;
    let units = rot_units + (d.head_dim - d.rotary_dim) / vec;
    // Threads per row: the smallest power of two that covers the row, at most a block.
    let tpr = units.next_power_of_two().min(threads);
    RotaryParams {
        x: ptrs.x,
        y: ptrs.y,
        cos: ptrs.cos,
        sin: ptrs.sin,
        positions: ptrs.positions,
        rows: (d.rows() * d.heads) as i32,
        heads: d.heads as i32,
        seq: d.seq as i32,
        head_dim: d.head_dim as i32,
        half: d.half() as i32,
        max_pos: d.max_pos as i32,
        offset: match p.positions {
            PositionSource::Offset(o) => o as i32, // o + S <= max_pos (validated)
            PositionSource::Array => 0,
        },
        rot_units: rot_units as i32,
        units: units as i32,
        tpr_shift: tpr.trailing_zeros() as i32,
        sign: if p.inverse { -1.0 } else { 1.0 },
        _pad: 0,
    }
}

/// Queues the kernel on `s` (the device's context current).
///
/// # Safety
/// As [`rotary_device`].
unsafe fn run(dev: &device::Device, p: &RotaryProblem, s: cu::CUstream, ptrs: RotaryPtrs) -> Result<()> {
    if p.dims.x_len() == 0 {
        return Ok(());
    }
    check_positions_ptr(p, ptrs.positions)?;
    let vec = vector_width(p, &ptrs);
    let v = config::rotary_variant(p.dtype, p.interleaved, vec);
    let f = device::function(dev, &v)?;
    let threads = v.threads() as usize;
    let prm = params(p, &ptrs, vec, threads);
    let rows_per_block = threads >> prm.tpr_shift;
    let blocks = (prm.rows as usize).div_ceil(rows_per_block) as u32;
    // SAFETY: the caller's pointers, of the sizes p implies; the params mirror the kernel's.
    unsafe { launch("flash_rotary", f, (blocks, 1, 1), s, &prm) }
}

/// Rotary embeddings on device memory (forward, or backward when `p.inverse`), queued on `stream`
/// with nothing synchronised.
///
/// # Safety
/// The pointers must be device memory of GPU `device` with the sizes `p` implies ([`RotaryPtrs`]'
/// layouts; `positions` holding the values `p` was validated with), valid until `stream` reaches
/// this work; `stream` (a CUstream as an integer, 0 = legacy default) must belong to that
/// device's primary context.
pub unsafe fn rotary_device(p: &RotaryProblem, device: usize, stream: usize, ptrs: RotaryPtrs) -> Result<()> {
    catch_panics("CUDA", || {
        check_supported(p)?;
        let dev = device::device(device)?;
        libs::ensure_nvrtc()?;
        let _ctx = ContextGuard::new(&dev)?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { run(&dev, p, stream as cu::CUstream, ptrs) }
    })
}

/// Rotary embeddings on host memory through GPU `device` (copy in, compute, copy out; synchronous).
pub fn rotary_host(p: &RotaryProblem, device: usize, io: RotaryIo) -> Result<()> {
    check_buffers(p, &io)?;
    catch_panics("CUDA", || {
        check_supported(p)?;
        let dev = device::device(device)?;
        libs::ensure_nvrtc()?;
        let _ctx = ContextGuard::new(&dev)?;
        let s = Stream::new()?;
        let (x, cos, sin) = (upload(io.x, &s)?, upload(io.cos, &s)?, upload(io.sin, &s)?);
        let positions = io.positions.map(|b| upload(b, &s)).transpose()?;
        let y = DeviceBuffer::alloc(io.y.len(), s.0)?;
        let ptrs = RotaryPtrs { x: x.ptr, cos: cos.ptr, sin: sin.ptr, positions: positions.as_ref().map_or(0, |b| b.ptr), y: y.ptr };
        // SAFETY: buffers sized from the problem, on this device, ordered on stream s.
        unsafe { run(&dev, p, s.0, ptrs)? };
        download(io.y, &y, &s)?;
        s.sync()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::rotary::RotaryDims;

    fn problem(dtype: DType, head_dim: usize, rotary_dim: usize) -> RotaryProblem {
        let dims = RotaryDims { batch: 2, seq: 3, heads: 4, head_dim, rotary_dim, max_pos: 8 };
        RotaryProblem { dims, dtype, interleaved: false, inverse: true, positions: PositionSource::Offset(1) }
    }

    const ALIGNED: RotaryPtrs = RotaryPtrs { x: 1 << 20, cos: 2 << 20, sin: 3 << 20, positions: 0, y: 4 << 20 };

    #[test]
    fn params_struct_matches_the_kernel_layout() {
        // 5 pointers, then 10 ints, a float and a pad int (cuda/rotary.cu).
        assert_eq!(std::mem::size_of::<RotaryParams>(), 5 * 8 + 12 * 4);
    }

    #[test]
    fn vector_width_is_the_widest_aligned_one() {
        assert_eq!(vector_width(&problem(DType::BF16, 128, 128), &ALIGNED), 8);
        assert_eq!(vector_width(&problem(DType::F32, 128, 64), &ALIGNED), 4);
        assert_eq!(vector_width(&problem(DType::BF16, 40, 40), &ALIGNED), 4); // R/2 = 20
        assert_eq!(vector_width(&problem(DType::F16, 72, 36), &ALIGNED), 2); // R/2 = 18
        assert_eq!(vector_width(&problem(DType::F16, 7, 6), &ALIGNED), 1); // odd D
        let shifted = RotaryPtrs { x: ALIGNED.x + 4, ..ALIGNED };
        assert_eq!(vector_width(&problem(DType::BF16, 128, 128), &shifted), 2);
        let table = RotaryPtrs { cos: ALIGNED.cos + 8, ..ALIGNED };
        assert_eq!(vector_width(&problem(DType::BF16, 128, 128), &table), 2);
    }

    #[test]
    fn a_row_is_covered_by_a_power_of_two_of_threads() {
        let p = problem(DType::BF16, 96, 64); // 32 angles / 8 + 32 copied / 8 = 8 units
        let prm = params(&p, &ALIGNED, 8, 256);
        assert_eq!((prm.rot_units, prm.units, prm.tpr_shift, prm.sign, prm.offset), (4, 8, 3, -1.0, 1));
        let p = problem(DType::F32, 1024, 1024); // 512 units: a block per row, looping
        assert_eq!(params(&p, &ALIGNED, 1, 256).tpr_shift, 8);
    }
}
