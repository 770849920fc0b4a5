//! The materialized CPU path: each task holds the whole score matrix of the head it works on,
//! S = Qs·Kᵀ `[Sq, Sk]` (and, in the backward, dS beside it), takes a plain softmax over each
//! row and forms the products from those matrices — the textbook algorithm, exact to the fused
//! path's bounds, returning the same (o, lse) and gradients.
//!
//! What it buys on short sequences (measured in bench/RESULTS.md, "Dispatch"):
//! * no passes over whole tensors: a task reads its rows of q, k, v (dO, o) straight from the
//!   caller's buffers (at their strides) into scratch that stays in cache, sweeping memory in
//!   order when packed (all its heads of one row, then the next row), and writes its outputs back
//!   the same way. The fused path packs
//!   whole tensors into working layouts first and unpacks after (module `layout`), passes that cost
//!   as much as the attention itself at S = 60;
//! * no online-softmax rescaling, and the hidden parts of S skipped at a 16-row grain (the causal
//!   triangle of a 60 × 60 head is 62 % of the square, not 100 %).
//!
//! Masks go through the fused path's own per-tile functions ([`Visibility::tile`] /
//! [`Visibility::mask_scores`]) in one place, [`scores`]: the same keys are visible and the same
//! elements hidden, and tiles nobody sees are never multiplied.
//!
//! Tasks: one per (batch row, chunk of kv heads) — both passes — owning o / lse / dq of the chunk's
//! query heads and dk / dv of its kv heads: no atomics, bit-identical run to run.

use super::backward::subtract_dlse;
use super::batch::Geometry;
use super::layout::{load_f32, padded_dim, transposed_ld};
use super::matmul::{matmul, Mat};
use super::modify::{sink2, sink_grads, softcap_chain, TileMods};
use super::par;
use super::simd;
use super::transpose::transpose;
use super::tiles::{KeyTile, RowBlock, Visibility};
use crate::dtype::DType;
use crate::error::Result;
use crate::io::{BackwardIo, ForwardIo};
use crate::mask::Seq;
use crate::problem::Problem;
use crate::strides::{InputStrides, Strides};
use std::f32::consts::{LN_2, LOG2_E};
use std::cell::RefCell;
use std::marker::PhantomData;
use std::ops::Range;

/// Rows of S per score step: small enough that the causal triangle and window edges are skipped
/// finely, a multiple of the micro-kernel's row block. A sub-block never crosses a tile (or a
/// block-mask block), so [`Visibility`] answers for it as for the fused path's row blocks.
const SUB_Q: usize = 16;
/// Keys per step of the transposed products (dV += Pᵀ·dO, dK += dSᵀ·Qs).
const SUB_K: usize = 16;
/// A task's scratch aims below this (L2), so chunks of kv heads shrink as sequences grow.
const SCRATCH_TARGET: usize = 1 << 20;
/// Scratch up to this many bytes stays with its thread between calls: an allocation (and its
/// page faults) per rayon job would cost more than the attention of a short sequence.
const KEEP_SCRATCH: usize = 8 << 20;

/// Bytes of the score matrices one task holds: `matrices` × Sq × ld(Sk) f32 (the longest
/// sequence of a varlen call). The forward holds S, the backward S and dS (and, with softcap,
/// the scores' tanh: dispatch asks for 3).
pub fn task_bytes(p: &Problem, matrices: usize) -> u128 {
    let (sq, sk) = (p.dims.seq_q as u128, transposed_ld(p.dims.seq_k) as u128);
    matrices as u128 * sq * sk * 4
}

/// The most tasks a pass can have: batch rows × kv heads (chunks hold one kv head or more).
pub fn tasks(p: &Problem) -> usize {
    p.dims.batch * p.dims.kv_heads
}

/// Kv heads per task: all of them where the batch alone keeps every thread busy (so a task sweeps
/// whole rows of the tensors), fewer for small batches or long sequences.
fn kv_chunk(p: &Problem) -> usize {
    let d = &p.dims;
    let dp = padded_dim(d.head_dim);
    let per_kv_head = 4 * (3 * d.group() * d.seq_q * dp + 3 * d.seq_k * dp + 2 * d.head_dim * transposed_ld(d.seq_k));
    let threads = rayon::current_num_threads().max(1);
    let mut chunk = d.kv_heads;
    while chunk > 1 && (d.batch * d.kv_heads.div_ceil(chunk) < 4 * threads || chunk * per_kv_head > SCRATCH_TARGET) {
        chunk = chunk.div_ceil(2);
    }
    chunk
}

/// The tasks: (batch row, kv heads).
fn task_list(p: &Problem) -> Vec<(usize, Range<usize>)> {
    let (hkv, chunk) = (p.dims.kv_heads, kv_chunk(p));
    (0..p.dims.batch).flat_map(|b| (0..hkv).step_by(chunk).map(move |k0| (b, k0..(k0 + chunk).min(hkv)))).collect()
}

/// Forward (layouts in [`ForwardIo`]).
pub fn forward(p: &Problem, io: ForwardIo) -> Result<()> {
    let ForwardIo { q, k, v, o, lse, mask, strides } = io;
    let st = strides.unwrap_or_else(|| InputStrides::packed(p));
    let vis = Visibility::new(p, &mask);
    let outs = (SharedOut::new(o, p.dtype), SharedOut::new(lse, DType::F32));
    let chunk = kv_chunk(p);
    let tasks = task_list(p);
    par::each_init(tasks.len(), Lease::take, |kept, i| {
        let mut w = ForwardScratch::carve(p, chunk, &mut kept.0);
        let next = Ahead::new(p, &[(q, st.q)], &[(k, st.k), (v, st.v)], tasks.get(i + 1));
        forward_task(p, &vis, [(q, st.q), (k, st.k), (v, st.v)], &outs, tasks[i].clone(), &mut w, next)
    });
    Ok(())
}

/// Backward (layouts in [`BackwardIo`]).
pub fn backward(p: &Problem, io: BackwardIo) -> Result<()> {
    let BackwardIo { d_out, q, k, v, o, lse, dq, dk, dv, mask, dsinks, dlse, strides } = io;
    let st = strides.unwrap_or_else(|| InputStrides::packed(p));
    let dlse = dlse.map(|b| load_f32(b, "dlse")).transpose()?; // lse's layout
    let vis = Visibility::new(p, &mask);
    let outs = [SharedOut::new(dq, p.dtype), SharedOut::new(dk, p.dtype), SharedOut::new(dv, p.dtype)];
    let chunk = kv_chunk(p);
    let tasks = task_list(p);
    par::each_init(tasks.len(), Lease::take, |kept, i| {
        let mut w = BackwardScratch::carve(p, chunk, &mut kept.0);
        let next = Ahead::new(p, &[(q, st.q), (d_out, st.d_out), (o, st.o)], &[(k, st.k), (v, st.v)], tasks.get(i + 1));
        let inputs = Inputs { d_out: (d_out, st.d_out), q: (q, st.q), k: (k, st.k), v: (v, st.v), o: (o, st.o), lse };
        backward_task(p, &vis, inputs, dlse.as_deref(), &outs, tasks[i].clone(), &mut w, next)
    });
    if let Some(out) = dsinks {
        DType::F32.store(&sink_grads(p, (d_out, st.d_out), (o, st.o), lse, dlse.as_deref()), out, 0);
    }
    Ok(())
}

thread_local! {
    /// The thread's scratch from its last task (see [`KEEP_SCRATCH`]).
    static KEPT: RefCell<Kept> = RefCell::new(Kept::default());
}

/// A task's scratch memory, carved into the buffers of [`ForwardScratch`] / [`BackwardScratch`]
/// per task. Stale values from earlier tasks are harmless: every value a task reads it has
/// written, except padding columns (zero from the first allocation; loads write only the first
/// D columns), which only reach padding columns of the outputs (never stored).
#[derive(Default)]
struct Kept {
    f: Vec<f32>,
    tiles: Vec<KeyTile>,
    runs: Runs,
    head_runs: Vec<Runs>,
}

/// The thread's [`Kept`] scratch for one rayon job, given back when the job ends.
struct Lease(Kept);

impl Lease {
    /// The thread's kept scratch (empty if another job of this thread holds it).
    fn take() -> Lease {
        Lease(KEPT.with(|k| std::mem::take(&mut *k.borrow_mut())))
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.0.f.len() * 4 > KEEP_SCRATCH {
            return;
        }
        let _ = KEPT.try_with(|k| {
            if let Ok(mut slot) = k.try_borrow_mut() {
                if slot.f.len() <= self.0.f.len() {
                    *slot = std::mem::take(&mut self.0);
                }
            }
        });
    }
}

/// Cuts consecutive buffers off one slice.
struct Carve<'a>(&'a mut [f32]);

impl<'a> Carve<'a> {
    fn next(&mut self, len: usize) -> &'a mut [f32] {
        let (head, rest) = std::mem::take(&mut self.0).split_at_mut(len);
        self.0 = rest;
        head
    }
}

/// The next task's input rows (usually this thread's next task: rayon hands each thread a run of
/// consecutive tasks), asked of the caches a little at a time while this task computes. The
/// hardware prefetchers follow the rows a task reads, but not into the next batch row, and at
/// S = 60 reading inputs from memory would otherwise take as long as the products.
struct Ahead<'a> {
    regions: Vec<&'a [u8]>,
    at: (usize, usize), // (region, byte)
    step: usize,        // bytes per call of `more`
}

impl<'a> Ahead<'a> {
    /// The rows of `task` in the q-like tensors (q, dO, o) and the k-like ones (k, v).
    fn new(p: &Problem, q_like: &[Input<'a>], k_like: &[Input<'a>], task: Option<&(usize, Range<usize>)>) -> Self {
        let mut regions = Vec::new();
        if let Some((b, kv)) = task {
            let (qr, kr) = task_rows(p, *b, kv);
            let elem = p.dtype.size_bytes();
            regions.extend(k_like.iter().map(|&t| kr.bytes(t, elem)));
            regions.extend(q_like.iter().map(|&t| qr.bytes(t, elem)));
        }
        let total: usize = regions.iter().map(|r| r.len()).sum();
        let steps = (p.dims.group() * p.dims.seq_q.div_ceil(SUB_Q)).max(1);
        Ahead { regions, at: (0, 0), step: total.div_ceil(steps).next_multiple_of(64) }
    }

    /// Prefetches the next part (into L2).
    fn more(&mut self) {
        let mut left = self.step;
        while left > 0 && self.at.0 < self.regions.len() {
            let r = self.regions[self.at.0];
            let end = (self.at.1 + left).min(r.len());
            for off in (self.at.1..end).step_by(64) {
                prefetch(&r[off..]);
            }
            left -= end - self.at.1;
            self.at = if end == r.len() { (self.at.0 + 1, 0) } else { (self.at.0, end) };
        }
    }
}

#[inline(always)]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults; the address is inside `bytes` anyway.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        _mm_prefetch::<_MM_HINT_T1>(bytes.as_ptr() as *const i8)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// An output buffer of the caller that parallel tasks write, each its own elements.
struct SharedOut<'a> {
    ptr: *mut u8,
    len: usize,
    dtype: DType,
    _buf: PhantomData<&'a mut [u8]>,
}

// SAFETY: tasks write disjoint elements (see `store`); the buffer outlives them (the borrow).
unsafe impl Sync for SharedOut<'_> {}

impl<'a> SharedOut<'a> {
    fn new(buf: &'a mut [u8], dtype: DType) -> Self {
        SharedOut { ptr: buf.as_mut_ptr(), len: buf.len(), dtype, _buf: PhantomData }
    }

    /// Stores `src` as elements `start..start + src.len()` (bounds checked).
    ///
    /// SAFETY: no other task touches these elements meanwhile. Each element of o, lse and dq
    /// belongs to one (batch row, query head), each of dk and dv to one (batch row, kv head), and
    /// each of those to exactly one task.
    unsafe fn store(&self, start: usize, src: &[f32]) {
        let size = self.dtype.size_bytes();
        let (at, n) = (start * size, src.len() * size);
        assert!(at.checked_add(n).is_some_and(|end| end <= self.len), "output store out of bounds");
        let dst = std::slice::from_raw_parts_mut(self.ptr.add(at), n);
        self.dtype.store(src, dst, 0);
    }
}

/// An input buffer and where its rows lie.
type Input<'a> = (&'a [u8], Strides);

/// The backward's inputs; lse is f32 `[B, H, Sq]` (`[H, total_q]` varlen), always packed.
struct Inputs<'a> {
    d_out: Input<'a>,
    q: Input<'a>,
    k: Input<'a>,
    v: Input<'a>,
    o: Input<'a>,
    lse: &'a [u8],
}

/// Heads `heads` of a `[PB, R, n_heads, D]` tensor (see [`Geometry`]) at the rows of one batch
/// row: rows `row0..row0 + rows` of packed batch `pb`.
#[derive(Clone)]
struct Rows {
    pb: usize,
    row0: usize,
    rows: usize,
    heads: Range<usize>,
    d: usize,
    /// The tensor's packed strides: those of the outputs (dq like q, o like q; dk, dv like k).
    packed: Strides,
}

impl Rows {
    /// Element index of (row i, head h, 0) in a tensor at strides `st`.
    fn at(&self, st: Strides, i: usize, h: usize) -> usize {
        st.at(self.pb, self.row0 + i, h)
    }

    /// Reads the heads into `dst` `[heads, rows, Dp]` (head-major; each element times `scale`;
    /// padding columns left as they are: zero), sweeping memory in order (when packed).
    fn load(&self, (src, st): Input, dtype: DType, scale: f32, dst: &mut [f32]) {
        let (d, dp) = (self.d, padded_dim(self.d));
        for i in 0..self.rows {
            for (j, h) in self.heads.clone().enumerate() {
                let row = &mut dst[(j * self.rows + i) * dp..][..d];
                dtype.load(src, self.at(st, i, h), row);
                if scale != 1.0 {
                    row.iter_mut().for_each(|x| *x *= scale);
                }
            }
        }
    }

    /// Reads the heads into the transposed `dst` `[heads, D, ld]`, SUB_K rows at a time
    /// through `tmp` `[SUB_K, D]`.
    fn load_transposed(&self, (src, st): Input, dtype: DType, ld: usize, tmp: &mut [f32], dst: &mut [f32]) {
        let d = self.d;
        for i0 in (0..self.rows).step_by(SUB_K) {
            let n = SUB_K.min(self.rows - i0);
            for (j, h) in self.heads.clone().enumerate() {
                for (r, row) in tmp.chunks_exact_mut(d).take(n).enumerate() {
                    dtype.load(src, self.at(st, i0 + r, h), row);
                }
                transpose(tmp, d, n, d, &mut dst[j * d * ld + i0..], ld);
            }
        }
    }

    /// The bytes from these rows' first element to their last in a tensor at strides `st` of
    /// `elem` bytes per element (other elements in between; strides are never negative, so the
    /// first row and head come first and the last last).
    fn bytes<'s>(&self, (src, st): Input<'s>, elem: usize) -> &'s [u8] {
        if self.rows == 0 || self.heads.is_empty() {
            return &[];
        }
        let (first, end) = (self.at(st, 0, self.heads.start), self.at(st, self.rows - 1, self.heads.end - 1) + self.d);
        &src[(first * elem).min(src.len())..(end * elem).min(src.len())]
    }

    /// Writes `src` `[heads, rows, Dp]` (first D columns, each times `scale`) to the heads.
    ///
    /// SAFETY: the rows of these heads belong to the calling task (see [`SharedOut::store`]).
    unsafe fn store(&self, src: &mut [f32], scale: f32, out: &SharedOut) {
        let (d, dp) = (self.d, padded_dim(self.d));
        for i in 0..self.rows {
            for (j, h) in self.heads.clone().enumerate() {
                let row = &mut src[(j * self.rows + i) * dp..][..d];
                if scale != 1.0 {
                    row.iter_mut().for_each(|x| *x *= scale);
                }
                out.store(self.at(self.packed, i, h), row);
            }
        }
    }
}

/// The query and key rows of one task: batch row b's queries of the query heads of kv heads `kv`.
fn task_rows(p: &Problem, b: usize, kv: &Range<usize>) -> (Rows, Rows) {
    let (d, g, geo, seq) = (p.dims.head_dim, p.dims.group(), Geometry::new(p), p.mask.seq(b));
    let pb = geo.batch_of(b);
    let (q_packed, k_packed) = (Strides::packed(&geo.q4()), Strides::packed(&geo.kv4()));
    let qr = Rows { pb, row0: geo.query_offset(&seq, b), rows: seq.q_len, heads: kv.start * g..kv.end * g, d, packed: q_packed };
    let kr = Rows { pb, row0: geo.key_offset(&seq, b), rows: seq.k_len, heads: kv.clone(), d, packed: k_packed };
    (qr, kr)
}

/// The sub-blocks of `SUB_Q` query rows of batch row b, head h.
fn sub_blocks(b: usize, h: usize, seq: Seq) -> impl Iterator<Item = RowBlock> {
    (0..seq.q_len).step_by(SUB_Q).map(move |r0| RowBlock { b, h, seq, r0, r1: (r0 + SUB_Q).min(seq.q_len) })
}

/// Runs of adjacent visible tiles of one sub-block, left to right: `[c0, c1)` key ranges. The
/// products use only these keys: the keys between runs belong to tiles the mask hides, which
/// (like the fused path) this path never reads, so garbage there cannot reach the outputs.
type Runs = Vec<(usize, usize)>;

/// THE score step of this path (the fused path's per-tile step, over whole rows of S): for rows
/// `rb`, S[r, c] = Qs[r]·K[c] in exp2 units on every tile the mask lets some row see, each tile
/// masked by [`Visibility::mask_scores`]; -inf on the keys between runs of such tiles. Fills
/// `runs` (empty: the rows see no key); keys outside the first and last run are hidden.
///
/// q: [br, Dp] (times scale·log2 e); kt: [D, ld]; s: [br, ld] (the rows' part of S);
/// tiles: reused scratch.
#[allow(clippy::too_many_arguments)] // the tile step's operands, as the fused path passes them
fn scores(vis: &Visibility, rb: &RowBlock, d: usize, q: &[f32], kt: &[f32], ld: usize, s: &mut [f32], tiles: &mut Vec<KeyTile>, runs: &mut Runs, mods: Option<(&TileMods, Option<&mut [f32]>)>) {
    let (br, dp) = (rb.rows(), padded_dim(d));
    let (mods, mut tanh) = match mods {
        Some((m, t)) => (Some(m), t),
        None => (None, None),
    };
    tiles.clear();
    tiles.extend(vis.key_blocks(rb).filter_map(|blk| vis.tile(rb, blk)));
    runs.clear();
    for t in tiles.iter() {
        // Left to right: a tile's product may spill into the next tile's first (padding)
        // columns, which that tile then overwrites.
        matmul(br, t.cols(), d, &mut s[t.c0..], ld, false, Mat::rows(q, dp), &kt[t.c0..], ld);
        if let Some(m) = mods {
            // The score modifiers, before the masks (modifiers.rs's order), as the fused path.
            m.apply(&mut s[t.c0..], ld, rb, t, tanh.as_deref_mut().map(|x| &mut x[t.c0..]));
        }
        if t.masked() {
            vis.mask_scores(&mut s[t.c0..], ld, rb, t);
        }
        match runs.last_mut() {
            Some(run) if run.1 == t.c0 => run.1 = t.c1,
            _ => runs.push((t.c0, t.c1)),
        }
    }
    for w in runs.windows(2) {
        for row in s.chunks_mut(ld).take(br) {
            row[w[0].1..w[1].0].fill(f32::NEG_INFINITY);
        }
    }
}

/// The keys from the first run's start to the last run's end.
fn span(runs: &Runs) -> Option<(usize, usize)> {
    Some((runs.first()?.0, runs.last()?.1))
}

/// One forward task's working memory (sized for the longest sequence).
struct ForwardScratch<'a> {
    q: &'a mut [f32],     // [heads, Sq, Dp], times scale·log2 e; then O
    kt: &'a mut [f32],    // [kv heads, D, ld]
    v: &'a mut [f32],     // [kv heads, Sk, Dp]
    s: &'a mut [f32],     // [Sq, ld]: one head's scores, then its probabilities
    o: &'a mut [f32],     // [SUB_Q, Dp]
    lse: &'a mut [f32],   // [Sq]
    tmp: &'a mut [f32],   // [SUB_K, D]
    m: &'a mut [f32],     // [SUB_Q]
    l: &'a mut [f32],     // [SUB_Q]
    alpha: &'a mut [f32], // [SUB_Q]
    tiles: &'a mut Vec<KeyTile>,
    runs: &'a mut Runs,
}

impl<'a> ForwardScratch<'a> {
    fn carve(p: &Problem, kv_chunk: usize, kept: &'a mut Kept) -> Self {
        let (sq, sk, d, g) = (p.dims.seq_q, p.dims.seq_k, p.dims.head_dim, p.dims.group());
        let (dp, ld) = (padded_dim(d), transposed_ld(sk));
        let lens = [kv_chunk * g * sq * dp, kv_chunk * d * ld, kv_chunk * sk * dp, sq * ld, SUB_Q * dp, sq, SUB_K * d, SUB_Q, SUB_Q, SUB_Q];
        let Kept { f, tiles, runs, .. } = kept;
        if f.len() < lens.iter().sum() {
            f.resize(lens.iter().sum(), 0.0);
        }
        let mut c = Carve(f);
        let mut next = |i: usize| c.next(lens[i]);
        ForwardScratch {
            q: next(0),
            kt: next(1),
            v: next(2),
            s: next(3),
            o: next(4),
            lse: next(5),
            tmp: next(6),
            m: next(7),
            l: next(8),
            alpha: next(9),
            tiles,
            runs,
        }
    }
}

/// Batch row b, kv heads `kv` and their query heads: o and lse.
fn forward_task(p: &Problem, vis: &Visibility, [q, k, v]: [Input; 3], (o, lse): &(SharedOut, SharedOut), (b, kv): (usize, Range<usize>), w: &mut ForwardScratch, mut next: Ahead) {
    let seq = p.mask.seq(b);
    let (sq, sk) = (seq.q_len, seq.k_len);
    let (d, g) = (p.dims.head_dim, p.dims.group());
    let (dp, ld) = (padded_dim(d), transposed_ld(p.dims.seq_k));
    let (qr, kr) = task_rows(p, b, &kv);
    qr.load(q, p.dtype, p.scale * LOG2_E, w.q);
    kr.load_transposed(k, p.dtype, ld, w.tmp, w.kt);
    kr.load(v, p.dtype, 1.0, w.v);

    for (j, h) in qr.heads.clone().enumerate() {
        let kj = j / g; // this head's kv head within the chunk
        let (kt, v) = (&w.kt[kj * d * ld..][..d * ld], &w.v[kj * sk * dp..][..sk * dp]);
        let q_head = &mut w.q[j * sq * dp..][..sq * dp];
        for rb in sub_blocks(b, h, seq) {
            next.more();
            let (r0, br) = (rb.r0, rb.rows());
            let (m, l, alpha) = (&mut w.m[..br], &mut w.l[..br], &mut w.alpha[..br]);
            // A sink starts every row: max = sink, sum = 1 (as the fused path).
            let sink = sink2(p, h);
            m.fill(sink.unwrap_or(f32::NEG_INFINITY));
            l.fill(if sink.is_some() { 1.0 } else { 0.0 });
            let s = &mut w.s[r0 * ld..];
            let o_rows = &mut w.o[..br * dp];
            let mods = (!p.mods.is_none()).then(|| TileMods::new(p, &rb));
            scores(vis, &rb, d, &q_head[r0 * dp..(r0 + br) * dp], kt, ld, s, w.tiles, w.runs, mods.as_ref().map(|m| (m, None)));
            match span(w.runs) {
                Some((c0, c1)) => {
                    simd::online_softmax(&mut s[c0..], c1 - c0, ld, m, l, alpha);
                    for (i, &(a, z)) in w.runs.iter().enumerate() {
                        matmul(br, d, z - a, o_rows, dp, i > 0, Mat::rows(&s[a..], ld), &v[a * dp..], dp);
                    }
                }
                None => o_rows.fill(0.0),
            }
            for r in 0..br {
                let (row, out) = (&o_rows[r * dp..(r + 1) * dp], &mut q_head[(r0 + r) * dp..(r0 + r + 1) * dp]);
                if l[r] == 0.0 {
                    // The row sees no key (and has no sink): o = 0, lse = -inf.
                    out.fill(0.0);
                    w.lse[r0 + r] = f32::NEG_INFINITY;
                } else {
                    let inv = 1.0 / l[r];
                    out.iter_mut().zip(row).for_each(|(x, &y)| *x = y * inv);
                    w.lse[r0 + r] = (m[r] + l[r].log2()) * LN_2;
                }
            }
        }
        // SAFETY: lse entries of (b, h) belong to this task alone.
        unsafe { lse.store(p.lse_base(b, h), &w.lse[..sq]) };
    }
    // SAFETY: rows of o of this task's query heads belong to it alone.
    unsafe { qr.store(w.q, 1.0, o) };
}

/// One backward task's working memory (sized for the longest sequence).
struct BackwardScratch<'a> {
    k: &'a mut [f32],     // [kv heads, Sk, Dp]
    kt: &'a mut [f32],    // [kv heads, D, ld]
    vt: &'a mut [f32],    // [kv heads, D, ld]
    dk: &'a mut [f32],    // [kv heads, Sk, Dp], in units of dSᵀ·Qs
    dv: &'a mut [f32],    // [kv heads, Sk, Dp]
    q: &'a mut [f32],     // [heads, Sq, Dp], times scale·log2 e
    d_out: &'a mut [f32], // [heads, Sq, Dp]
    dq: &'a mut [f32],    // [heads, Sq, Dp], in units of dS·K
    s: &'a mut [f32],     // [Sq, ld]: one head's scores, then P
    ds: &'a mut [f32],    // [Sq, ld]: dP = dO·Vᵀ, then dS
    tanh: &'a mut [f32],  // [Sq, ld] with softcap (tanh of the scores, for dS's chain rule), else empty
    lse2: &'a mut [f32],  // [heads, Sq], log2 units, +inf for rows that see no key
    delta: &'a mut [f32], // [heads, Sq]
    tmp: &'a mut [f32],   // [SUB_K, D]
    tiles: &'a mut Vec<KeyTile>,
    runs: &'a mut Vec<Runs>, // per sub-block of one head
}

impl<'a> BackwardScratch<'a> {
    fn carve(p: &Problem, kv_chunk: usize, kept: &'a mut Kept) -> Self {
        let (sq, sk, d, g) = (p.dims.seq_q, p.dims.seq_k, p.dims.head_dim, p.dims.group());
        let (dp, ld) = (padded_dim(d), transposed_ld(sk));
        let heads = kv_chunk * g;
        let (kvm, qm) = (kv_chunk * sk * dp, heads * sq * dp);
        let tanh = if p.mods.softcap.is_some() { sq * ld } else { 0 };
        let lens = [kvm, kv_chunk * d * ld, kv_chunk * d * ld, kvm, kvm, qm, qm, qm, sq * ld, sq * ld, heads * sq, heads * sq, SUB_K * d, tanh];
        let Kept { f, tiles, head_runs, .. } = kept;
        head_runs.resize_with(sq.div_ceil(SUB_Q), Runs::new);
        if f.len() < lens.iter().sum() {
            f.resize(lens.iter().sum(), 0.0);
        }
        let mut c = Carve(f);
        let mut next = |i: usize| c.next(lens[i]);
        BackwardScratch {
            k: next(0),
            kt: next(1),
            vt: next(2),
            dk: next(3),
            dv: next(4),
            q: next(5),
            d_out: next(6),
            dq: next(7),
            s: next(8),
            ds: next(9),
            lse2: next(10),
            delta: next(11),
            tmp: next(12),
            tanh: next(13),
            tiles,
            runs: head_runs,
        }
    }
}

/// Batch row b, kv heads `kv` and their query heads: dq of the query heads, dk and dv of `kv`.
/// P = exp2(S - lse2), dP = dO·Vᵀ, dS = P ∘ (dP - delta); dQ = dS·K (times scale on the way
/// out), dV = Pᵀ·dO, dK = dSᵀ·Qs (times ln 2 on the way out).
#[allow(clippy::too_many_arguments)] // the call's buffers, the task and its scratch
fn backward_task(
    p: &Problem, vis: &Visibility, inputs: Inputs, dlse: Option<&[f32]>, [dq, dk, dv]: &[SharedOut; 3],
    (b, kv): (usize, Range<usize>), w: &mut BackwardScratch, mut next: Ahead,
) {
    let Inputs { d_out, q, k, v, o, lse } = inputs;
    let seq = p.mask.seq(b);
    let (sq, sk) = (seq.q_len, seq.k_len);
    let (d, g) = (p.dims.head_dim, p.dims.group());
    let (dp, ld) = (padded_dim(d), transposed_ld(p.dims.seq_k));
    let (qr, kr) = task_rows(p, b, &kv);
    kr.load(k, p.dtype, 1.0, w.k);
    for j in 0..kv.len() {
        transpose(&w.k[j * sk * dp..], dp, sk, d, &mut w.kt[j * d * ld..], ld);
    }
    kr.load_transposed(v, p.dtype, ld, w.tmp, w.vt);
    qr.load(q, p.dtype, p.scale * LOG2_E, w.q);
    qr.load(d_out, p.dtype, 1.0, w.d_out);
    row_stats(p, &qr, b, o, lse, dlse, w);
    let kv_len = kv.len() * sk * dp;
    w.dk[..kv_len].fill(0.0);
    w.dv[..kv_len].fill(0.0);

    for (j, h) in qr.heads.clone().enumerate() {
        let kj = j / g;
        let head = j * sq * dp..(j + 1) * sq * dp;
        let (q_head, do_head) = (&w.q[head.clone()], &w.d_out[head.clone()]);
        let dq_head = &mut w.dq[head];
        let (kt, vt) = (&w.kt[kj * d * ld..][..d * ld], &w.vt[kj * d * ld..][..d * ld]);
        let k_head = &w.k[kj * sk * dp..][..sk * dp];
        let (lse2, delta) = (&w.lse2[j * sq..][..sq], &w.delta[j * sq..][..sq]);
        for (i, rb) in sub_blocks(b, h, seq).enumerate() {
            next.more();
            let (r0, br) = (rb.r0, rb.rows());
            let rows = r0 * dp..(r0 + br) * dp;
            let (s, ds) = (&mut w.s[r0 * ld..], &mut w.ds[r0 * ld..]);
            let runs = &mut w.runs[i];
            let mods = (!p.mods.is_none()).then(|| TileMods::new(p, &rb));
            let softcap = p.mods.softcap.is_some();
            let tanh = if softcap { Some(&mut w.tanh[r0 * ld..]) } else { None };
            scores(vis, &rb, d, &q_head[rows.clone()], kt, ld, s, w.tiles, runs, mods.as_ref().map(|m| (m, tanh)));
            if runs.is_empty() {
                dq_head[rows.clone()].fill(0.0);
            }
            for (n, &(a, z)) in runs.iter().enumerate() {
                let (lse2, delta) = (&lse2[r0..r0 + br], &delta[r0..r0 + br]);
                matmul(br, z - a, d, &mut ds[a..], ld, false, Mat::rows(&do_head[rows.clone()], dp), &vt[a..], ld);
                simd::probs_and_dscores(&mut s[a..], &mut ds[a..], z - a, ld, lse2, delta);
                if softcap {
                    softcap_chain(&mut ds[a..], &w.tanh[r0 * ld + a..], br, z - a, ld);
                }
                matmul(br, d, z - a, &mut dq_head[rows.clone()], dp, n > 0, Mat::rows(&ds[a..], ld), &k_head[a * dp..], dp);
            }
        }
        // dV += Pᵀ·dO and dK += dSᵀ·Qs over the keys some row sees, SUB_K keys at a time, each
        // against the sub-blocks whose span holds them; P and dS are zero elsewhere in between.
        let runs = &w.runs[..sq.div_ceil(SUB_Q)];
        let spans: Vec<Option<(usize, usize)>> = runs.iter().map(span).collect();
        let Some((lo, hi)) = spans.iter().flatten().fold(None, |u: Option<(usize, usize)>, &(a, z)| {
            Some(u.map_or((a, z), |(x, y)| (x.min(a), y.max(z))))
        }) else {
            continue;
        };
        for (i, sub) in runs.iter().enumerate() {
            // The gaps of [lo, hi) around and between this sub-block's runs.
            let edges: Vec<usize> = std::iter::once(lo).chain(sub.iter().flat_map(|&(a, z)| [a, z])).chain([hi]).collect();
            for r in i * SUB_Q..((i + 1) * SUB_Q).min(sq) {
                for gap in edges.chunks_exact(2).filter(|g| g[0] < g[1]) {
                    w.s[r * ld + gap[0]..r * ld + gap[1]].fill(0.0);
                    w.ds[r * ld + gap[0]..r * ld + gap[1]].fill(0.0);
                }
            }
        }
        let (dk_head, dv_head) = (&mut w.dk[kj * sk * dp..][..sk * dp], &mut w.dv[kj * sk * dp..][..sk * dp]);
        for c in (lo..hi).step_by(SUB_K) {
            let c1 = (c + SUB_K).min(hi);
            let hits = |s: &Option<(usize, usize)>| s.is_some_and(|(a, z)| a < c1 && c < z);
            let (Some(first), Some(last)) = (spans.iter().position(hits), spans.iter().rposition(hits)) else { continue };
            let (r0, r1) = (first * SUB_Q, ((last + 1) * SUB_Q).min(sq));
            let (pt, dst) = (Mat::transposed(&w.s[r0 * ld + c..], ld), Mat::transposed(&w.ds[r0 * ld + c..], ld));
            matmul(c1 - c, d, r1 - r0, &mut dv_head[c * dp..], dp, true, pt, &do_head[r0 * dp..], dp);
            matmul(c1 - c, d, r1 - r0, &mut dk_head[c * dp..], dp, true, dst, &q_head[r0 * dp..], dp);
        }
    }
    // SAFETY: the rows of this task's query heads (dq) and kv heads (dk, dv) belong to it alone.
    unsafe {
        qr.store(w.dq, p.scale, dq);
        kr.store(w.dk, LN_2, dk);
        kr.store(w.dv, 1.0, dv);
    }
}

/// Σ x·y in 16 interleaved partial sums (which vectorise; a single running sum would not).
fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (xc, yc) = (x.chunks_exact(16), y.chunks_exact(16));
    let tail: f32 = xc.remainder().iter().zip(yc.remainder()).map(|(a, b)| a * b).sum();
    for (a, b) in xc.zip(yc) {
        for i in 0..16 {
            acc[i] += a[i] * b[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// lse2 (log2 units; +inf where lse = -inf, so that P = 0) and delta = rowsum(dO ∘ O) of the
/// task's query heads, from the o and lse passed in (as the oracle does), less dlse where given.
/// Needs w.d_out loaded.
fn row_stats(p: &Problem, qr: &Rows, b: usize, (o, o_st): Input, lse: &[u8], dlse: Option<&[f32]>, w: &mut BackwardScratch) {
    let (sq, dp, d) = (qr.rows, padded_dim(qr.d), qr.d);
    for i in 0..sq {
        for (j, h) in qr.heads.clone().enumerate() {
            let o_row = &mut w.tmp[..d];
            p.dtype.load(o, qr.at(o_st, i, h), o_row);
            let dor = &w.d_out[(j * sq + i) * dp..][..d];
            w.delta[j * sq + i] = dot(o_row, dor);
        }
    }
    for (j, h) in qr.heads.clone().enumerate() {
        let lse2 = &mut w.lse2[j * sq..][..sq];
        DType::F32.load(lse, p.lse_base(b, h), lse2);
        for x in lse2.iter_mut() {
            *x = if *x == f32::NEG_INFINITY { f32::INFINITY } else { *x * LOG2_E };
        }
        if let Some(g) = dlse {
            subtract_dlse(&mut w.delta[j * sq..][..sq], lse2, &g[p.lse_base(b, h)..][..sq]);
        }
    }
}
