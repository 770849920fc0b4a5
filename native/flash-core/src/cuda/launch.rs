//! Launch planning on device pointers: the params struct the kernels read, which kernel variant
//! runs, and the forward / backward launch sequences on the caller's stream.

use std::sync::Arc;

use cudarc::driver::sys as cu;

use super::config::{self, Spec};
use super::device::{self, launch, ContextGuard, Device, DeviceBuffer};
use super::libs;
use super::pad;
use super::sm90;
use super::trace;
use super::variant::{Kernel, Variant};
use crate::dispatch::{self, Backend, Pass};
use crate::dtype::DType;
use crate::error::{FlashError, Result};
use crate::guard::catch_panics;
use crate::problem::Problem;
use crate::strides::{InputStrides, Strides};

/// The params struct of cuda/params.h, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct FlashParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    o: u64,
    lse: u64,
    pub dout: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    delta: u64,
    lse_log2: u64,
    dq_accum: u64,
    dlse: u64,
    batch: i32,
    seqlen_q: i32,
    seqlen_k: i32,
    heads: i32,
    heads_kv: i32,
    scale: f32,
    scale_log2: f32,
    /// dq_accum's layout: 0 `[B, Sq, H, D]`; 1 the Hopper backward's tiles (params.h's dq_tile_offset).
    dq_tiled: i32,
    pub q_st: KernelStrides,
    pub k_st: KernelStrides,
    pub v_st: KernelStrides,
    pub o_st: KernelStrides,
    pub do_st: KernelStrides,
    dq_st: KernelStrides,
    dk_st: KernelStrides,
    dv_st: KernelStrides,
}

/// params.h's Strides: row r of the call's rows (b * S + i padded, the packed row varlen), head h,
/// of batch row b at r * seq + h * head + b * batch_gap elements.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct KernelStrides {
    pub seq: i64,
    pub head: i64,
    pub batch_gap: i64,
}

impl KernelStrides {
    /// A tensor laid out as `st` whose batch rows hold `rows` rows each (varlen: no batch axis).
    pub(super) fn of(st: Strides, rows: usize, varlen: bool) -> KernelStrides {
        let batch_gap = if varlen { 0 } else { st.batch as i64 - (rows * st.seq) as i64 };
        KernelStrides { seq: st.seq as i64, head: st.head as i64, batch_gap }
    }

    /// The batch stride again (padded calls), for the Hopper kernels' tensor maps.
    pub fn batch(&self, rows: usize) -> i64 {
        self.batch_gap + rows as i64 * self.seq
    }
}

/// The Strides of `p`'s inputs (packed where `strides` is None) into `prm`; the outputs packed.
fn set_strides(prm: &mut FlashParams, p: &Problem, strides: Option<InputStrides>) {
    let packed = InputStrides::packed(p);
    let s = strides.unwrap_or(packed);
    let varlen = p.mask.varlen.is_some();
    let (sq, sk) = (p.dims.seq_q, p.dims.seq_k);
    prm.q_st = KernelStrides::of(s.q, sq, varlen);
    prm.k_st = KernelStrides::of(s.k, sk, varlen);
    prm.v_st = KernelStrides::of(s.v, sk, varlen);
    prm.o_st = KernelStrides::of(s.o, sq, varlen);
    prm.do_st = KernelStrides::of(s.d_out, sq, varlen);
    prm.dq_st = KernelStrides::of(packed.q, sq, varlen);
    prm.dk_st = KernelStrides::of(packed.k, sk, varlen);
    prm.dv_st = KernelStrides::of(packed.v, sk, varlen);
}

/// Whether the kernels read an input laid out as `st` at `ptr` where it lies: its row starts on
/// 16-byte boundaries (they load 16-byte chunks). Else the padding layer copies it first.
pub(super) fn in_place(st: &Strides, ptr: u64, elem: usize) -> bool {
    ptr.is_multiple_of(16) && st.aligned(elem, 16)
}

/// The MASKED kernels' params: FlashParams, then the mask fields (cuda/params.h's `#if MASKED`
/// part), so that the plain kernels' params stay as they were.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct MaskedParams {
    pub base: FlashParams,
    pub mask: MaskFields,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct MaskFields {
    seqs: u64,
    seg_q: u64,
    seg_k: u64,
    block_mask: u64,
    bm_batch_stride: i64,
    bm_head_stride: i64,
    bm_cols: i32,
    win_left: i32,
    win_right: i32,
    stat_q_mul: i32,
    stat_h_stride: i32,
    _pad2: i32,
    alibi_log2: u64,
    sinks_log2: u64,
    dsinks: u64,
    softcap_log2: f32,
    softcap_inv_log2: f32,
}

/// Device pointers of the data-carrying masks ([`MaskBuffers`](crate::MaskBuffers)' layouts on
/// one GPU); 0 = not given.
#[derive(Debug, Clone, Copy, Default)]
pub struct MaskPtrs {
    pub seg_q: u64,      // [B, Sq] int32
    pub seg_k: u64,      // [B, Sk] int32
    pub block_mask: u64, // [Bm, Hm, ceil(Sq/128), ceil(Sk/128)] uint8
}

/// Device pointers of a forward call: [`ForwardIo`](crate::ForwardIo)'s buffers on one GPU (same
/// layouts).
#[derive(Debug, Clone, Copy)]
pub struct ForwardPtrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub mask: MaskPtrs,
    /// Where q, k and v's rows lie (None: packed); o is packed.
    pub strides: Option<InputStrides>,
}

/// Device pointers of a backward call: [`BackwardIo`](crate::BackwardIo)'s buffers on one GPU.
#[derive(Debug, Clone, Copy)]
pub struct BackwardPtrs {
    pub d_out: u64,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    /// With sinks: f32 [H], receives dsinks; else 0.
    pub dsinks: u64,
    /// Optional gradient of lse, f32 like lse (0: none); the preprocess takes delta - dlse.
    pub dlse: u64,
    pub mask: MaskPtrs,
    /// Where d_out, q, k, v and o's rows lie (None: packed); dq, dk and dv are packed.
    pub strides: Option<InputStrides>,
}

fn check_supported(p: &Problem) -> Result<()> {
    for (what, n) in [("seq_q", p.dims.seq_q), ("seq_k", p.dims.seq_k), ("heads", p.dims.heads)] {
        if n > i32::MAX as usize {
            return Err(FlashError::Unsupported(format!("{what} = {n} exceeds the CUDA backend's limit")));
        }
    }
    if !p.is_plain() {
        // The masked kernels hold rows, window bounds and their sums in int32 (cuda/seq.h).
        let (sq, sk) = (p.dims.seq_q, p.dims.seq_k);
        if sq + sk > MASKED_MAX_KEYS {
            return Err(FlashError::Unsupported(format!(
                "with windows, padding, segment ids, block masks or varlen batches the CUDA backend takes seq_q + seq_k up to {MASKED_MAX_KEYS}; got {sq} + {sk}"
            )));
        }
        for (what, n) in [("query rows", p.q_rows()), ("key rows", p.k_rows())] {
            if n > i32::MAX as usize {
                return Err(FlashError::Unsupported(format!("{n} {what} exceed the CUDA backend's limit")));
            }
        }
    }
    Ok(())
}

/// Largest seq_q + seq_k of a masked call: twice it still fits an int32 (window arithmetic).
const MASKED_MAX_KEYS: usize = 1 << 29;

/// The mask pointers must be given exactly when the problem has the masks (the kernels read what
/// the problem says is there).
fn check_mask_ptrs(p: &Problem, m: &MaskPtrs) -> Result<()> {
    let segs = p.mask.segments;
    let blocks = p.mask.block_mask.is_some();
    for (name, given, want) in [("seg_q", m.seg_q, segs), ("seg_k", m.seg_k, segs), ("block_mask", m.block_mask, blocks)] {
        if (given != 0) != want {
            let (has, ptr) = (if want { "has" } else { "has no" }, if given != 0 { "a" } else { "no" });
            return Err(FlashError::Internal(format!("the problem {has} {name} but the call passed {ptr} device pointer for it")));
        }
    }
    Ok(())
}

fn params(p: &Problem) -> FlashParams {
    let d = &p.dims;
    let none = KernelStrides { seq: 0, head: 0, batch_gap: 0 };
    let mut prm = FlashParams {
        q: 0,
        k: 0,
        v: 0,
        o: 0,
        lse: 0,
        dout: 0,
        dq: 0,
        dk: 0,
        dv: 0,
        delta: 0,
        lse_log2: 0,
        dq_accum: 0,
        dlse: 0,
        batch: d.batch as i32,
        seqlen_q: d.seq_q as i32,
        seqlen_k: d.seq_k as i32,
        heads: d.heads as i32,
        heads_kv: d.kv_heads as i32,
        scale: p.scale,
        scale_log2: p.scale * std::f32::consts::LOG2_E,
        dq_tiled: 0,
        q_st: none,
        k_st: none,
        v_st: none,
        o_st: none,
        do_st: none,
        dq_st: none,
        dk_st: none,
        dv_st: none,
    };
    set_strides(&mut prm, p, None);
    prm
}

/// A masked call's mask fields: its device pointers, the uploaded tables (batch rows, modifiers)
/// and the window and layout numbers.
fn mask_fields(p: &Problem, ptrs: &MaskPtrs, t: &Tables) -> MaskFields {
    let (d, m) = (&p.dims, &p.mask);
    // An unbounded window side (or one past every key) is Sq + Sk, which no row reaches.
    let open = (d.seq_q + d.seq_k) as i32;
    let side = |s: Option<usize>| s.map_or(open, |x| x.min(open as usize) as i32);
    // lse index of (b, h, i): q_start * stat_q_mul + h * stat_h_stride + i.
    let (stat_q_mul, stat_h_stride) = match m.varlen {
        Some(v) => (1, v.total_q as i32),
        None => (d.heads as i32, d.seq_q as i32),
    };
    let bm = m.block_mask;
    let bm_batch_stride = bm.map_or(0, |s| if s.batch == 1 { 0 } else { (s.heads * s.rows * s.cols) as i64 });
    let bm_head_stride = bm.map_or(0, |s| if s.heads == 1 { 0 } else { (s.rows * s.cols) as i64 });
    let cap2 = p.mods.softcap.map_or(0.0, |c| c * std::f32::consts::LOG2_E);
    MaskFields {
        seqs: t.seqs.ptr,
        seg_q: ptrs.seg_q,
        seg_k: ptrs.seg_k,
        block_mask: ptrs.block_mask,
        bm_batch_stride,
        bm_head_stride,
        bm_cols: bm.map_or(0, |s| s.cols as i32),
        win_left: side(m.left),
        win_right: side(m.right),
        stat_q_mul,
        stat_h_stride,
        _pad2: 0,
        alibi_log2: t.alibi.map_or(0, |x| x),
        sinks_log2: t.sinks.map_or(0, |x| x),
        dsinks: 0,
        softcap_log2: cap2,
        softcap_inv_log2: if cap2 > 0.0 { 1.0 / cap2 } else { 0.0 },
    }
}

/// The general kernels' tables on the device: the batch-row table and, after it, the modifiers'
/// f32 tables (ALiBi slopes [B, H] and sinks [H], times log2(e)) in the same buffer.
struct Tables {
    seqs: DeviceBuffer,
    alibi: Option<u64>,
    sinks: Option<u64>,
}

/// The general kernels' [`Tables`] on the device (stream-ordered on `s`): the per-batch-row
/// table, int32 [B, 6]: q_start, q_len, k_start, k_len, k_lo, k_hi (cuda/seq.h), then the
/// modifiers' f32 tables; None for a plain problem.
fn upload_tables(p: &Problem, s: cu::CUstream) -> Result<Option<Tables>> {
    if p.is_plain() {
        return Ok(None);
    }
    // One 4-byte word per entry: the int32 rows, then the f32 tables as their bits.
    let mut words: Vec<u32> = (0..p.dims.batch)
        .flat_map(|b| {
            let q = p.mask.seq(b);
            [q.q_start, q.q_len, q.k_start, q.k_len, q.k_lo, q.k_hi].map(|x| x as i32 as u32)
        })
        .collect();
    let log2 = |v: &Vec<f32>| v.iter().map(|x| (x * std::f32::consts::LOG2_E).to_bits()).collect::<Vec<u32>>();
    let alibi_at = p.mods.alibi.as_ref().map(|a| {
        let at = words.len();
        words.extend(log2(a));
        at
    });
    let sinks_at = p.mods.sinks.as_ref().map(|a| {
        let at = words.len();
        words.extend(log2(a));
        at
    });
    let bytes = words.len().max(1) * 4;
    let buf = DeviceBuffer::alloc(bytes, s)?;
    // SAFETY: the buffer holds `bytes`; a copy from pageable memory has read its source when the
    // call returns, so `words` may go.
    device::check("cuMemcpyHtoDAsync", unsafe {
        cu::cuMemcpyHtoDAsync_v2(buf.ptr, words.as_ptr() as *const std::ffi::c_void, words.len() * 4, s)
    })?;
    let at = |i: Option<usize>| i.map(|i| buf.ptr + (i * 4) as u64);
    let (alibi, sinks) = (at(alibi_at), at(sinks_at));
    Ok(Some(Tables { seqs: buf, alibi, sinks }))
}

/// Launches a tiled kernel with `prm`, extended by the mask fields when the call is masked (its
/// variants are then the MASKED ones, which read them).
///
/// # Safety
/// As [`launch`].
unsafe fn launch_tiled(name: &str, f: device::Function, grid: (u32, u32, u32), s: cu::CUstream, prm: &FlashParams, mask: Option<&MaskFields>) -> Result<()> {
    // SAFETY: the caller's guarantees; each struct mirrors its kernel's params.
    unsafe {
        match mask {
            None => launch(name, f, grid, s, prm),
            Some(m) => launch(name, f, grid, s, &MaskedParams { base: *prm, mask: *m }),
        }
    }
}

/// The params of the elementwise kernels (bwd_preprocess, bwd_dq_convert), which walk q's rows
/// and lse as [B, Sq, H] and [B, H, Sq]: a varlen call's [total_q, H] and [H, total_q] are the
/// same walk with B = 1 and Sq = total_q.
fn elementwise_params(prm: &FlashParams, p: &Problem) -> FlashParams {
    match p.mask.varlen {
        Some(v) => FlashParams { batch: 1, seqlen_q: v.total_q as i32, ..*prm },
        None => *prm,
    }
}

pub(super) fn grid_over(n: usize, block: usize) -> u32 {
    n.div_ceil(block) as u32
}

pub(super) fn kernel_variant(dev: &Device, p: &Problem, kernel: Kernel) -> Result<Variant> {
    let d = &p.dims;
    let (masked, mods) = (!p.is_plain(), !p.mods.is_none());
    let tf32_terms = config::tf32_terms(kernel, p.dtype, p.precision, d.seq_k, d.head_dim);
    let f16_parts = config::f16_parts(kernel, p.dtype, tf32_terms);
    let spec =
        Spec { kernel, dtype: p.dtype, head_dim: d.head_dim, causal: p.causal, masked, mods, group: d.group(), seq_k: d.seq_k, tf32_terms, f16_parts };
    device::choose(dev, &config::candidates(&spec))
}

/// What every CUDA call does first, once: check that this backend takes `p`, open GPU `device`,
/// load NVRTC, and make the device's primary context current until the guard drops.
pub(super) fn prepare(p: &Problem, device: usize) -> Result<(Arc<Device>, ContextGuard)> {
    check_supported(p)?;
    let dev = device::device(device)?;
    libs::ensure_nvrtc()?;
    let ctx = ContextGuard::new(&dev)?;
    Ok((dev, ctx))
}

/// Forward on device memory: o = softmax(scale q k^T) v, lse = its logsumexp, under `p.mask`
/// (windows, padding, segment ids, block masks and varlen batches run the MASKED kernels). A head
/// dim the kernels do not take (D not a multiple of 8, or v's Dv != D) goes through the padding
/// layer ([`pad`]), which allocates stream-ordered workspace ([`pad::workspace_bytes`]).
///
/// # Safety
/// The pointers must be device memory of GPU `device` with the sizes `p` implies (q
/// `p.q_shape()`, k `p.kv_shape()`, v `p.v_shape()`, o `p.o_shape()` in `p.dtype`, lse
/// `p.lse_shape()` f32; the mask pointers
/// [`MaskPtrs`]' layouts, given exactly when `p` has those masks), valid until `stream` reaches
/// this work; `stream` (a CUstream as an integer, 0 = legacy default) must belong to that
/// device's primary context.
pub unsafe fn forward_device(p: &Problem, device: usize, stream: usize, ptrs: ForwardPtrs) -> Result<()> {
    catch_panics("CUDA", || {
        let (dev, _ctx) = prepare(p, device)?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { forward(&dev, p, stream as cu::CUstream, ptrs) }
    })
}

/// Backward on device memory: dq, dk, dv from dO, q, k, v, o and lse. Allocates two lse-sized f32
/// buffers of workspace (stream-ordered) for delta and the log2-domain lse, and on the atomic-dQ
/// path (and the 16-bit Hopper kernel's) a q-sized one more for the f32 dQ sums (the Hopper kernel's
/// deterministic mode: and an int32 per 64-row dQ tile; masked: the [B, 6] int32 batch-row table);
/// through the padding layer ([`pad`]) the q-sized one is at the kernels' head dim, and the copies
/// of [`pad::workspace_bytes`] come on top.
///
/// # Safety
/// As [`forward_device`], for every pointer in `ptrs`.
pub unsafe fn backward_device(p: &Problem, device: usize, stream: usize, ptrs: BackwardPtrs) -> Result<()> {
    catch_panics("CUDA", || {
        let (dev, _ctx) = prepare(p, device)?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { backward(&dev, p, stream as cu::CUstream, ptrs) }
    })
}

/// The forward's launch on a [`prepare`]d device (its context current): the kernels directly
/// when they take `p`'s head dims, else through the padding layer.
///
/// # Safety
/// As [`forward_device`].
pub(super) unsafe fn forward(dev: &Device, p: &Problem, s: cu::CUstream, ptrs: ForwardPtrs) -> Result<()> {
    check_mask_ptrs(p, &ptrs.mask)?;
    dispatch::choose(p, Backend::Cuda, Pass::Forward)?; // fused only: refuses an explicit materialized
    // SAFETY: the caller's guarantees, passed on.
    unsafe {
        match pad::needed(&p.dims) || !pad::inputs_in_place(p, &pad::forward_inputs(p, &ptrs)) {
            false => forward_kernels(dev, p, s, ptrs),
            true => pad::forward(dev, p, s, ptrs),
        }
    }
}

/// The forward's kernel on a problem whose head dims the kernels take (D = Dv, a multiple of 8).
///
/// # Safety
/// As [`forward_device`].
pub(super) unsafe fn forward_kernels(dev: &Device, p: &Problem, s: cu::CUstream, ptrs: ForwardPtrs) -> Result<()> {
    let d = &p.dims;
    if d.batch == 0 || d.seq_q == 0 {
        return Ok(());
    }
    let mut prm = params(p);
    (prm.q, prm.k, prm.v, prm.o, prm.lse) = (ptrs.q, ptrs.k, ptrs.v, ptrs.o, ptrs.lse);
    set_strides(&mut prm, p, ptrs.strides);
    let tables = upload_tables(p, s)?;
    let mask = tables.as_ref().map(|t| mask_fields(p, &ptrs.mask, t));
    let (sq, sk) = (d.seq_q, d.seq_k);
    match sm90::forward_choice(dev, p, &[(prm.q, prm.q_st, sq), (prm.k, prm.k_st, sk), (prm.v, prm.v_st, sk)]) {
        // SAFETY: the caller's guarantees, passed on; the tables are freed stream-ordered after it.
        Ok(()) => return unsafe { sm90::forward(dev, p, s, &prm, mask.as_ref()) },
        Err(why) => trace::fallback("forward", &why),
    }
    let v = kernel_variant(dev, p, Kernel::Fwd)?;
    let f = device::function(dev, &v)?;
    trace::kernel("forward", &v);
    let grid = (grid_over(d.seq_q, v.tiles.block_m), d.heads as u32, d.batch as u32);
    // SAFETY: the caller guarantees the pointers; the table is freed stream-ordered after the launch.
    unsafe { launch_tiled("flash_fwd", f, grid, s, &prm, mask.as_ref()) }
}

/// The backward's launches on a [`prepare`]d device (its context current): the kernels directly
/// when they take `p`'s head dims, else through the padding layer.
///
/// # Safety
/// As [`backward_device`].
pub(super) unsafe fn backward(dev: &Device, p: &Problem, s: cu::CUstream, ptrs: BackwardPtrs) -> Result<()> {
    check_mask_ptrs(p, &ptrs.mask)?;
    dispatch::choose(p, Backend::Cuda, Pass::Backward)?; // fused only: refuses an explicit materialized
    if p.mods.sinks.is_some() != (ptrs.dsinks != 0) {
        return Err(FlashError::Internal("dsinks' device pointer must be given exactly when the problem has sinks".into()));
    }
    // SAFETY: the caller's guarantees, passed on.
    unsafe {
        match pad::needed(&p.dims) || !pad::inputs_in_place(p, &pad::backward_inputs(p, &ptrs)) {
            false => backward_kernels(dev, p, s, ptrs),
            true => pad::backward(dev, p, s, ptrs),
        }
    }
}

/// The backward's kernels on a problem whose head dims the kernels take (D = Dv, a multiple of 8).
///
/// # Safety
/// As [`backward_device`].
pub(super) unsafe fn backward_kernels(dev: &Device, p: &Problem, s: cu::CUstream, ptrs: BackwardPtrs) -> Result<()> {
    let d = &p.dims;
    if d.batch == 0 {
        return Ok(());
    }
    let stats = p.lse_len();
    let tables = upload_tables(p, s)?;
    let mut mask = tables.as_ref().map(|t| mask_fields(p, &ptrs.mask, t));
    if let Some(m) = mask.as_mut() {
        m.dsinks = ptrs.dsinks;
    }
    let mask = mask.as_ref();
    let mut prm = params(p);
    (prm.q, prm.k, prm.v, prm.o, prm.lse, prm.dout) = (ptrs.q, ptrs.k, ptrs.v, ptrs.o, ptrs.lse, ptrs.d_out);
    (prm.dq, prm.dk, prm.dv, prm.dlse) = (ptrs.dq, ptrs.dk, ptrs.dv, ptrs.dlse);
    set_strides(&mut prm, p, ptrs.strides);
    // The 16-bit Hopper kernel adds dQ into dq_accum (in key-block order when deterministic), the f32
    // Hopper backward computes it in its own kernel; else the default adds it with atomics and the
    // deterministic backward computes it in its own kernel.
    let (sq, sk) = (d.seq_q, d.seq_k);
    let tensors = [(prm.q, prm.q_st, sq), (prm.k, prm.k_st, sk), (prm.v, prm.v_st, sk), (prm.dout, prm.do_st, sq)];
    let hopper = match sm90::backward_choice(dev, p, &tensors) {
        Ok(()) => true,
        Err(why) => {
            trace::fallback("backward", &why);
            false
        }
    };
    // The Hopper f32 backward writes dQ from its own kernel: no dq_accum, no conversion.
    let hopper_f32 = hopper && p.dtype == DType::F32;
    let atomic_dq = !hopper_f32 && (hopper || !p.deterministic);
    let vp = kernel_variant(dev, p, Kernel::BwdPreprocess)?;
    let fp = device::function(dev, &vp)?;
    // The 16-bit Hopper kernel's dq_accum is in whole tiles (params.h's dq_tile_offset): Sq rounded up.
    let tiled = hopper && !hopper_f32;
    let (tile_rows, tiles) = if tiled { sm90::backward_query_tiles(dev, p)? } else { (0, 0) };
    let dq_len = match (tiled, atomic_dq) {
        (true, _) => d.batch * d.heads * tiles * tile_rows * d.head_dim,
        (false, true) => p.q_len(),
        (false, false) => 0,
    };
    prm.dq_tiled = tiled as i32;
    let sem_len = if tiled && p.deterministic { d.batch * d.heads * tiles } else { 0 };
    // Each part on a 128-byte boundary (the Hopper kernel's bulk reductions need 16).
    let stats_pad = stats.next_multiple_of(32);
    let work = DeviceBuffer::alloc((2 * stats_pad + dq_len + sem_len) * 4, s)?;
    prm.delta = work.ptr;
    prm.lse_log2 = work.ptr + (stats_pad * 4) as u64;
    prm.dq_accum = work.ptr + (2 * stats_pad * 4) as u64;
    let dq_sem = if sem_len > 0 { prm.dq_accum + (dq_len * 4) as u64 } else { 0 };
    let kv_grid = |v: &Variant| (grid_over(d.seq_k, v.tiles.block_n), d.kv_heads as u32, d.batch as u32);
    let rows = elementwise_params(&prm, p);
    // SAFETY: caller-guaranteed pointers; workspace sized above; one stream orders the
    // preprocess (and the zeroing of dq_accum) before the gradient kernels, the conversion
    // after them and the workspace free after everything.
    unsafe {
        launch("flash_bwd_preprocess", fp, (grid_over(p.q_rows() * d.heads, vp.tiles.block_m), 1, 1), s, &rows)?;
        if hopper_f32 {
            sm90::backward_f32(dev, p, s, &prm)?;
        } else if atomic_dq {
            let vc = kernel_variant(dev, p, Kernel::BwdDqConvert)?;
            let fc = device::function(dev, &vc)?;
            device::check("cuMemsetD32Async", cu::cuMemsetD32Async(prm.dq_accum, 0, dq_len + sem_len, s))?;
            if hopper {
                sm90::backward(dev, p, s, &prm, mask, dq_sem)?;
            } else {
                let vk = kernel_variant(dev, p, Kernel::BwdDkdvDq)?;
                let fk = device::function(dev, &vk)?;
                trace::kernel("backward", &vk);
                launch_tiled("flash_bwd_dkdv(atomic dQ)", fk, kv_grid(&vk), s, &prm, mask)?;
            }
            let pairs = p.q_len() / 2;
            let blocks = grid_over(pairs, vc.threads() as usize).min(8 * dev.sm_count.max(1) as u32);
            launch("flash_bwd_dq_convert", fc, (blocks, 1, 1), s, &rows)?;
        } else {
            let vq = kernel_variant(dev, p, Kernel::BwdDq)?;
            let vk = kernel_variant(dev, p, Kernel::BwdDkdv)?;
            let (fq, fk) = (device::function(dev, &vq)?, device::function(dev, &vk)?);
            trace::kernel("backward", &vk);
            let q_grid = (grid_over(d.seq_q, vq.tiles.block_m), d.heads as u32, d.batch as u32);
            launch_tiled("flash_bwd_dq", fq, q_grid, s, &prm, mask)?;
            launch_tiled("flash_bwd_dkdv", fk, kv_grid(&vk), s, &prm, mask)?;
        }
        if let (Some(m), true) = (mask, p.mods.sinks.is_some()) {
            let vs = kernel_variant(dev, p, Kernel::BwdDsinks)?;
            let fs = device::function(dev, &vs)?;
            launch("flash_bwd_dsinks", fs, (d.heads as u32, 1, 1), s, &MaskedParams { base: rows, mask: *m })?;
        }
    }
    drop(work);
    drop(tables);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_struct_matches_the_kernel_layout() {
        // 13 pointers, 5 ints, 2 floats, dq_tiled, then 8 Strides of 3 i64 (cuda/params.h).
        let base = 13 * 8 + 8 * 4 + 8 * 3 * 8;
        assert_eq!(std::mem::offset_of!(FlashParams, q_st), 13 * 8 + 8 * 4);
        assert_eq!(std::mem::size_of::<FlashParams>(), base);
        // MASKED: then 4 pointers, 2 i64 strides, 5 ints and 1 pad int; then the modifiers' 3
        // pointers and 2 floats.
        assert_eq!(std::mem::offset_of!(MaskedParams, mask), base);
        assert_eq!(std::mem::size_of::<MaskedParams>(), base + 4 * 8 + 2 * 8 + 6 * 4 + 3 * 8 + 2 * 4);
    }
}
