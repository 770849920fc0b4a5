//! Decode's inner loop on the CPU: one task is the keys `[k0, k1)` of one (batch row, kv head) for
//! every query head of its GQA group and every query row (the task's "states"). Per block of
//! KEY_BLOCK keys, each K and V row is read once from the cache into SIMD registers (decode_rows:
//! widened or dequantized there), scored against all states (dot products finished LANES at a
//! time by `Vector::sum_each`) and folded into the states by simd's online softmax; states go
//! through the block in register-held groups of up to 8. bf16 queries over plain bf16 caches take
//! both products as AVX512-BF16 dot products where the CPU has them at full rate (decode_bf16.rs);
//! bf16 queries over a bf16 or quantized K take the scores on the AMX tiles where the CPU has them
//! and a kv head has 8 states or more (decode_amx.rs).

use std::f32::consts::{LN_2, LOG2_E};

#[cfg(target_arch = "x86_64")]
use super::decode_amx;
#[cfg(target_arch = "x86_64")]
use super::decode_bf16;
#[cfg(target_arch = "x86_64")]
use super::decode_vnni;
use super::decode_rows::{position, Plain, Quant, Reader, Rows, KEY_BLOCK};
use super::simd::{self, isa, Isa};
#[cfg(target_arch = "x86_64")]
use super::vector::x86;
use super::vector::{Scalar, Vector};
use crate::decode::{Cache, Decode};
use crate::problem::MAX_HEAD_DIM;

/// Pieces of a head's share of the next block's prefetch, asked for as its work goes (`run`'s
/// `ask`): 0 before the scores, 1 halfway through them, 2 after them, 3 after the softmax, then
/// V_PARTS0.. spread over P V's columns.
const AHEAD_PARTS: usize = 8;
const V_PARTS0: usize = 4;

/// The widest vector (f32 lanes) of any instruction set here.
const MAX_LANES: usize = 16;
const _: () = assert!(KEY_BLOCK.is_multiple_of(MAX_LANES));

/// One task's place in the call: batch row `b`, the row's valid keys `[lo, hi)` and the task's
/// share `[k0, k1)` of them, for every kv head.
#[derive(Clone, Copy)]
pub(crate) struct Task {
    pub b: usize,
    pub lo: usize,
    pub hi: usize,
    pub k0: usize,
    pub k1: usize,
}

/// Runs one task: `po [Hkv, states, D]` receives each state's normalised o and `pl [Hkv, states]`
/// its lse (natural log; -inf and o = 0 where no key of `[k0, k1)` is visible). A kv head's states
/// are ordered (query head in its group, query row).
pub(crate) fn task(p: &Decode, q: &[u8], k: &Cache, v: &Cache, t: Task, po: &mut [f32], pl: &mut [f32]) {
    // SAFETY: isa() only reports instruction sets the CPU has; `run` checks its buffers' bounds.
    unsafe {
        match isa() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if decode_bf16::preferred() && decode_bf16::paths(p, k, v).any() => avx512_bf16(p, q, k, v, t, po, pl),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if decode_amx::preferred(p) && decode_amx::supported(p, k) => avx512_amx(p, q, k, v, t, po, pl),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if decode_vnni::usable(p, k) && t.k1 - t.k0 >= decode_vnni::MIN_KEYS => avx512_vnni(p, q, k, v, t, po, pl),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => avx512(p, q, k, v, t, po, pl),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2(p, q, k, v, t, po, pl),
            _ => run::<Scalar, false, false, false>(p, q, k, v, t, po, pl),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn avx512(p: &Decode, q: &[u8], k: &Cache, v: &Cache, t: Task, po: &mut [f32], pl: &mut [f32]) {
    run::<x86::Avx512, false, false, false>(p, q, k, v, t, po, pl)
}

/// AVX-512 with the scores over a bf16 or quantized K on the AMX tiles (decode_amx.rs; `supported` has
/// checked the call).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,f16c,avx512bf16")]
unsafe fn avx512_amx(p: &Decode, q: &[u8], k: &Cache, v: &Cache, t: Task, po: &mut [f32], pl: &mut [f32]) {
    run::<x86::Avx512, false, true, false>(p, q, k, v, t, po, pl)
}

/// AVX-512 with both products by bf16 dot products (decode_bf16.rs; `usable` has checked the call).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,f16c,avx512bf16")]
unsafe fn avx512_bf16(p: &Decode, q: &[u8], k: &Cache, v: &Cache, t: Task, po: &mut [f32], pl: &mut [f32]) {
    run::<x86::Avx512, true, false, false>(p, q, k, v, t, po, pl)
}

/// AVX-512 with the scores over a 4-bit K by byte dot products (decode_vnni.rs; `usable` has
/// checked the call).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,f16c,avx512vnni,avx512vbmi")]
unsafe fn avx512_vnni(p: &Decode, q: &[u8], k: &Cache, v: &Cache, t: Task, po: &mut [f32], pl: &mut [f32]) {
    run::<x86::Avx512, false, false, true>(p, q, k, v, t, po, pl)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2(p: &Decode, q: &[u8], k: &Cache, v: &Cache, t: Task, po: &mut [f32], pl: &mut [f32]) {
    run::<x86::Avx2, false, false, false>(p, q, k, v, t, po, pl)
}

/// Which products take decode_bf16.rs's bf16 dot products (x86 with AVX512-BF16, bf16 q; see
/// its `paths`): q . k over a plain or a 4-bit K, P V over a plain V.
#[derive(Clone, Copy, Default)]
pub(crate) struct DotPaths {
    pub k_plain: bool,
    pub k_q4: bool,
    pub v_plain: bool,
}

impl DotPaths {
    pub(crate) fn any(self) -> bool {
        self.k_plain || self.k_q4 || self.v_plain
    }
}

/// The task's keys go block by block, and within a block kv head by kv head: a block's rows (all
/// heads of KEY_BLOCK consecutive keys) are one contiguous stretch of the cache, read while the
/// next block's is prefetched (a share per head, in AHEAD_PARTS pieces), so memory is read as one
/// stream (a kv head's rows alone are strided by the other heads', which measured ~3x slower to
/// read). DOT: both products by bf16 dot products (decode_bf16.rs; x86 AVX-512 only). AMX: the
/// scores over a bf16 or quantized K by the tile unit (decode_amx.rs; x86 AVX-512 only; whole blocks).
/// VNNI: the scores over a 4-bit K by byte dot products (decode_vnni.rs; x86 AVX512-VNNI only).
#[inline(always)]
unsafe fn run<V: Vector, const DOT: bool, const AMX: bool, const VNNI: bool>(p: &Decode, q: &[u8], k: &Cache, v: &Cache, t: Task, po: &mut [f32], pl: &mut [f32]) {
    let (sq, h, hkv, d) = (p.seq_q, p.heads, p.kv_heads, p.head_dim);
    let group = h / hkv;
    let states = group * sq; // per kv head
    let nvec = d.div_ceil(V::LANES);
    let dp = nvec * V::LANES; // q and acc rows, zero padded
    assert!(po.len() == hkv * states * d && pl.len() == hkv * states && d <= MAX_HEAD_DIM && t.k1 <= p.s_cache);
    // q [Hkv, nvec, states, LANES] (the states' vector i side by side) in K's order, times
    // scale · log2(e): scores in exp2 units (simd's softmax).
    let at = |st: usize, pos: usize| ((pos / V::LANES) * states + st) * V::LANES + pos % V::LANES;
    let mut qs = vec![0f32; hkv * states * dp];
    let mut row = [0f32; MAX_HEAD_DIM];
    for kv in 0..hkv {
        for g in 0..group {
            for i in 0..sq {
                p.dtype.load(q, ((t.b * sq + i) * h + kv * group + g) * d, &mut row[..d]);
                let dst = &mut qs[kv * states * dp..][..states * dp];
                for (e, &x) in row[..d].iter().enumerate() {
                    dst[at(g * sq + i, position(k, p, V::LANES, e))] = x * p.scale * LOG2_E;
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    let dot = if DOT { decode_bf16::paths(p, k, v) } else { DotPaths::default() };
    #[cfg(not(target_arch = "x86_64"))]
    let dot = DotPaths::default();
    // Dot products over K: q as raw bf16 [Hkv, operands, states, 32] in the operands' order,
    // unscaled (plain: the cache's, D / 32 operands; 4-bit: q4_dim's, 4 per 128 dims, 0 past D),
    // and for 4-bit each group's sum of q [Hkv, states, groups].
    let ops = if dot.k_plain { d / 32 } else if dot.k_q4 { 4 * d.div_ceil(128) } else { 0 };
    let (k_gs, k_groups) = match k {
        Cache::Quant { fmt, .. } => (fmt.group_size, fmt.groups()),
        Cache::Plain(_) => (d, 1),
    };
    let mut qb = vec![0u16; hkv * states * ops * 32];
    let mut qsum = vec![0f32; if dot.k_q4 { hkv * states * k_groups } else { 0 }];
    if ops > 0 {
        // The slot of dim e among an operand set's words: (operand, word).
        let mut slot = vec![(0usize, 0usize); d];
        for o in 0..ops {
            for w in 0..32 {
                #[cfg(target_arch = "x86_64")]
                let e = if dot.k_q4 { decode_bf16::q4_dim(o / 4, o % 4, w) } else { o * 32 + w };
                #[cfg(not(target_arch = "x86_64"))]
                let e = o * 32 + w;
                if e < d {
                    slot[e] = (o, w);
                }
            }
        }
        for kv in 0..hkv {
            for (g, i) in (0..group).flat_map(|g| (0..sq).map(move |i| (g, i))) {
                let st = g * sq + i;
                let src = &q[((t.b * sq + i) * h + kv * group + g) * d * 2..][..d * 2];
                for (e, x) in src.chunks_exact(2).enumerate() {
                    let (o, w) = slot[e];
                    let bits = u16::from_le_bytes([x[0], x[1]]);
                    qb[((kv * ops + o) * states + st) * 32 + w] = bits;
                    if dot.k_q4 {
                        qsum[(kv * states + st) * k_groups + e / k_gs] += f32::from_bits((bits as u32) << 16);
                    }
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    let mut amx = AMX.then(|| decode_amx::Scores::new(p, q, k, |kv, st| (t.b * sq + st % sq) * h + kv * group + st / sq));
    #[cfg(target_arch = "x86_64")]
    let vnni = (VNNI && decode_vnni::usable(p, k)).then(|| decode_vnni::Query::new(p, q, k, |kv, st| (t.b * sq + st % sq) * h + kv * group + st / sq));
    #[cfg(target_arch = "x86_64")]
    let mut vnni_v = (VNNI && V::LANES == 16 && decode_vnni::usable_v(p, v)).then(|| decode_vnni::PvWork::new(p, v));
    let mut acc = vec![0f32; hkv * states * dp]; // as qs, V's order, unnormalised
    let mut pw = vec![0u32; if dot.v_plain { states * KEY_BLOCK / 2 } else { 0 }]; // P as bf16 pairs
    // Scores, then probabilities [states, KEY_BLOCK] of one kv head ([Hkv, states, KEY_BLOCK]
    // where the AMX tiles take every head's scores of a block first).
    let mut s_all = vec![0f32; if AMX { hkv } else { 1 } * states * KEY_BLOCK];
    let (mut m, mut l) = (vec![f32::NEG_INFINITY; hkv * states], vec![0f32; hkv * states]);
    let mut alpha = vec![0f32; states];
    // Query row i sees the relative keys [i + off - left, i + off + right] of [0, n).
    let off = (t.hi - t.lo) as i64 - sq as i64;
    let (left, right) = p.window();
    let softcap2 = p.softcap.map(|c| c * LOG2_E);
    let (mut kr, mut vr) = (Reader::new(k, p, V::LANES), Reader::new(v, p, V::LANES));
    let row0 = t.b * p.s_cache * hkv; // the cache row of (b, key 0, kv head 0)
    let mut j0 = t.k0;
    while j0 < t.k1 {
        let nk = (t.k1 - j0).min(KEY_BLOCK);
        // The block's rows (every kv head), and the next block's, prefetched a share per head.
        let rows = row0 + j0 * hkv..row0 + (j0 + nk) * hkv;
        let ahead = (rows.end, (t.k1 - j0 - nk).min(KEY_BLOCK) * hkv);
        kr.block(rows.clone());
        vr.block(rows);
        // The tiles' scores of a whole block, every head (`amx_block`): the codes are staged a
        // half block at a time, and the tiles' latencies and their sums' way back through memory
        // are paid once a block, not per head.
        #[cfg(target_arch = "x86_64")]
        let amx_block = AMX && nk == KEY_BLOCK;
        #[cfg(target_arch = "x86_64")]
        if let (true, Some(a)) = (amx_block, amx.as_mut()) {
            match &kr {
                Reader::Q4(r) => a.block(r, p.scale * LOG2_E, &mut s_all),
                Reader::Q8(r) => a.block(r, p.scale * LOG2_E, &mut s_all),
                Reader::Bf16(r) => a.block_plain(r, p.scale * LOG2_E, &mut s_all),
                _ => unreachable!("decode_amx::supported takes bf16 and quantized K caches only"),
            }
        }
        for kv in 0..hkv {
            let s = &mut s_all[if AMX { kv } else { 0 } * states * KEY_BLOCK..][..states * KEY_BLOCK];
            // This head's share of the next block, asked for in AHEAD_PARTS pieces as its work
            // goes rather than at once (a burst of prefetches stalls the core on its fill buffers
            // before the products start).
            let share = ahead.0 + ahead.1 * kv / hkv..ahead.0 + ahead.1 * (kv + 1) / hkv;
            let (qs, acc) = (&qs[kv * states * dp..][..states * dp], &mut acc[kv * states * dp..][..states * dp]);
            let (m, l) = (&mut m[kv * states..][..states], &mut l[kv * states..][..states]);
            kr.head(kv);
            vr.head(kv);
            // Parts 0..=i not yet asked for (the products ask inside their loops; other paths get
            // theirs at the steps' ends).
            let asked = std::cell::Cell::new(0usize);
            let ask = |i: usize| {
                while asked.get() <= i.min(AHEAD_PARTS - 1) {
                    let j = asked.get();
                    if j == 0 {
                        kr.prefetch(share.clone(), true);
                        vr.prefetch(share.clone(), true);
                    }
                    let part = share.start + share.len() * j / AHEAD_PARTS..share.start + share.len() * (j + 1) / AHEAD_PARTS;
                    kr.prefetch(part.clone(), false);
                    vr.prefetch(part, false);
                    asked.set(j + 1);
                }
            };
            ask(0);
            let qb = &qb[kv * states * ops * 32..][..states * ops * 32];
            match &kr {
                #[cfg(target_arch = "x86_64")]
                Reader::Q4(_) | Reader::Q8(_) | Reader::Bf16(_) if amx_block => {}
                #[cfg(target_arch = "x86_64")]
                Reader::Bf16(r) if dot.k_plain => decode_bf16::scores(r, qb, states, ops, nk, p.scale * LOG2_E, s),
                #[cfg(target_arch = "x86_64")]
                Reader::Q4(r) if vnni.is_some() => decode_vnni::scores_q4(r, vnni.as_ref().unwrap(), kv, nk, p.scale * LOG2_E, s),
                #[cfg(target_arch = "x86_64")]
                Reader::Q4(r) if dot.k_q4 => {
                    let qsum = &qsum[kv * states * k_groups..][..states * k_groups];
                    decode_bf16::scores_q4(r, qb, qsum, k_gs, d, states, nk, p.scale * LOG2_E, s)
                }
                _ => scores::<V>(&kr, qs, states, nvec, nk, s, &ask),
            }
            ask(2);
            for st in 0..states {
                let row = &mut s[st * KEY_BLOCK..][..nk];
                if let Some(c2) = softcap2 {
                    simd::softcap(row, c2, None);
                }
                // Row i sees the block's columns [first, end); the rest -inf (after the softcap,
                // which would make -inf finite).
                let (i, rel0) = ((st % sq) as i64, (j0 - t.lo) as i64);
                let first = left.map_or(0, |lf| (i + off - lf as i64 - rel0).clamp(0, nk as i64) as usize);
                let end = right.map_or(nk, |r| (i + off + r as i64 + 1 - rel0).clamp(first as i64, nk as i64) as usize);
                row[..first].fill(f32::NEG_INFINITY);
                row[end..].fill(f32::NEG_INFINITY);
            }
            simd::online_softmax(s, nk, KEY_BLOCK, m, l, &mut alpha);
            ask(V_PARTS0 - 1);
            match &vr {
                #[cfg(target_arch = "x86_64")]
                Reader::Bf16(r) if dot.v_plain => decode_bf16::accumulate(r, s, &alpha, states, d / 32, nk, acc, &mut pw),
                #[cfg(target_arch = "x86_64")]
                Reader::Q4(r) if vnni_v.is_some() => decode_vnni::accumulate_q4(r, s, &alpha, nk, acc, vnni_v.as_mut().unwrap()),
                _ => accumulate::<V>(&vr, s, &alpha, states, nvec, nk, acc, &ask),
            }
            ask(AHEAD_PARTS - 1);
        }
        j0 += nk;
    }
    for st in 0..hkv * states {
        let out = &mut po[st * d..][..d];
        if l[st] > 0.0 {
            let (a, inv) = (&acc[st / states * states * dp..][..states * dp], 1.0 / l[st]);
            for (e, o) in out.iter_mut().enumerate() {
                *o = a[at(st % states, v_position(dot, p, v, V::LANES, e))] * inv;
            }
            pl[st] = (m[st] + l[st].log2()) * LN_2;
        } else {
            out.fill(0.0);
            pl[st] = f32::NEG_INFINITY;
        }
    }
}

/// Where V's head-dim element e sits in the accumulators (decode_bf16.rs's orders for its paths).
fn v_position(dot: DotPaths, p: &Decode, v: &Cache, lanes: usize, e: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    if dot.v_plain {
        return decode_bf16::v_position(e);
    }
    let _ = dot;
    position(v, p, lanes, e)
}

/// Calls `$f::<V, Format, N, NV>` for the reader's format over the states in groups of N = 8, 4,
/// 2, 1 (register-held; one pass over the block's rows per group): `$f(rows, first state, args..)`.
/// NV: the row's vector count `$nvec` where it is 8 (a compile-time count: the loops over a row
/// unroll; D = 128 under AVX-512, D = 64 under AVX2), else 0 (`$f` reads its nvec argument).
macro_rules! by_format_and_group {
    ($f:ident, $nvec:expr, $reader:expr, $states:expr, $($arg:expr),*) => {
        match $nvec {
            8 => by_format_and_group!(@format $f, 8, $reader, $states, $($arg),*),
            _ => by_format_and_group!(@format $f, 0, $reader, $states, $($arg),*),
        }
    };
    (@format $f:ident, $nv:tt, $reader:expr, $states:expr, $($arg:expr),*) => {
        match $reader {
            Reader::F32(r) => groups!($f, $nv, Plain<'_, 0>, r, $states, $($arg),*),
            Reader::F16(r) => groups!($f, $nv, Plain<'_, 1>, r, $states, $($arg),*),
            Reader::Bf16(r) => groups!($f, $nv, Plain<'_, 2>, r, $states, $($arg),*),
            Reader::Q8(r) => groups!($f, $nv, Quant<'_, 8>, r, $states, $($arg),*),
            Reader::Q4(r) => groups!($f, $nv, Quant<'_, 4>, r, $states, $($arg),*),
        }
    };
}

macro_rules! groups {
    ($f:ident, $nv:tt, $fmt:ty, $r:expr, $states:expr, $($arg:expr),*) => {{
        let mut st = 0;
        while $states - st >= 8 {
            $f::<V, $fmt, 8, $nv>($r, st, $($arg),*);
            st += 8;
        }
        if $states - st >= 4 {
            $f::<V, $fmt, 4, $nv>($r, st, $($arg),*);
            st += 4;
        }
        if $states - st >= 2 {
            $f::<V, $fmt, 2, $nv>($r, st, $($arg),*);
            st += 2;
        }
        if $states - st >= 1 {
            $f::<V, $fmt, 1, $nv>($r, st, $($arg),*);
        }
    }};
}

/// s[st, x] = qs[st] · k[x] for the block's keys x < nk (columns past nk, up to the next multiple
/// of LANES, hold finite leftovers nobody reads); qs `[nvec, states, LANES]`.
#[inline(always)]
unsafe fn scores<V: Vector>(kr: &Reader, qs: &[f32], states: usize, nvec: usize, nk: usize, s: &mut [f32], ask: &dyn Fn(usize)) {
    assert!(qs.len() == nvec * states * V::LANES && s.len() == states * KEY_BLOCK && nk <= KEY_BLOCK);
    by_format_and_group!(score_group, nvec, kr, states, qs.as_ptr(), states, nvec, nk, s.as_mut_ptr(), ask);
}

/// States st0 .. st0 + N of [`scores`]: per key, N dot products in registers, the row's vectors
/// read once (in pairs); every LANES keys, their partial sums reduced together.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn score_group<V: Vector, F: Rows, const N: usize, const NV: usize>(rows: &F, st0: usize, qs: *const f32, states: usize, nvec: usize, nk: usize, s: *mut f32, ask: &dyn Fn(usize)) {
    let nvec = if NV > 0 { NV } else { nvec };
    let q = |i: usize| qs.add((i * states + st0) * V::LANES); // state st0's vector i; the group's follow
    let mut part = [[V::zero(); MAX_LANES]; N];
    let mut x0 = 0;
    while x0 < nk {
        for x in x0..(x0 + V::LANES).min(nk) {
            // Two sums per state (even and odd vectors): 2N chains of FMAs, half as long.
            let (mut a0, mut a1) = ([V::zero(); N], [V::zero(); N]);
            for c in 0..nvec / 2 {
                let (k0, k1) = rows.pair::<V>(x, c);
                let (q0, q1) = (q(2 * c), q(2 * c + 1));
                for n in 0..N {
                    a0[n] = a0[n].fma(V::load(q0.add(n * V::LANES)), k0);
                    a1[n] = a1[n].fma(V::load(q1.add(n * V::LANES)), k1);
                }
            }
            if nvec % 2 == 1 {
                let (k0, q0) = (rows.vector::<V>(x, nvec - 1), q(nvec - 1));
                for (n, a) in a0.iter_mut().enumerate() {
                    *a = a.fma(V::load(q0.add(n * V::LANES)), k0);
                }
            }
            for n in 0..N {
                part[n][x - x0] = a0[n].add(a1[n]);
            }
        }
        for (n, part) in part.iter().enumerate() {
            V::sum_each(&part[..V::LANES]).store(s.add((st0 + n) * KEY_BLOCK + x0));
        }
        // The next block's prefetch: part 1 halfway through the first group's keys.
        if st0 == 0 && 2 * (x0 + V::LANES) >= nk {
            ask(1);
        }
        x0 += V::LANES;
    }
}

/// acc[st] = alpha[st] · acc[st] + sum over x < nk of p[st, x] · v[x]; acc `[nvec, states, LANES]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate<V: Vector>(vr: &Reader, p: &[f32], alpha: &[f32], states: usize, nvec: usize, nk: usize, acc: &mut [f32], ask: &dyn Fn(usize)) {
    assert!(acc.len() == nvec * states * V::LANES && p.len() == states * KEY_BLOCK && alpha.len() == states && nk <= KEY_BLOCK);
    by_format_and_group!(accumulate_group, nvec, vr, states, p.as_ptr(), alpha.as_ptr(), states, nvec, nk, acc.as_mut_ptr(), ask);
}

/// States st0 .. st0 + N of [`accumulate`], two vector columns of acc at a time in registers.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate_group<V: Vector, F: Rows, const N: usize, const NV: usize>(
    rows: &F,
    st0: usize,
    p: *const f32,
    alpha: *const f32,
    states: usize,
    nvec: usize,
    nk: usize,
    acc: *mut f32,
    ask: &dyn Fn(usize),
) {
    let nvec = if NV > 0 { NV } else { nvec };
    let a_at = |i: usize| acc.add((i * states + st0) * V::LANES);
    let p = p.add(st0 * KEY_BLOCK);
    let mut al = [V::zero(); N];
    for (n, a) in al.iter_mut().enumerate() {
        *a = V::splat(*alpha.add(st0 + n));
    }
    for c in 0..nvec / 2 {
        // The next block's prefetch: the P V parts across the first group's columns.
        if st0 == 0 {
            ask(V_PARTS0 + (AHEAD_PARTS - V_PARTS0) * c / (nvec / 2));
        }
        let (c0, c1) = (a_at(2 * c), a_at(2 * c + 1));
        let (mut a0, mut a1) = ([V::zero(); N], [V::zero(); N]);
        for n in 0..N {
            a0[n] = V::load(c0.add(n * V::LANES)).mul(al[n]);
            a1[n] = V::load(c1.add(n * V::LANES)).mul(al[n]);
        }
        for x in 0..nk {
            let (v0, v1) = rows.pair::<V>(x, c);
            for n in 0..N {
                let pn = V::splat(*p.add(n * KEY_BLOCK + x));
                a0[n] = a0[n].fma(pn, v0);
                a1[n] = a1[n].fma(pn, v1);
            }
        }
        for n in 0..N {
            a0[n].store(c0.add(n * V::LANES));
            a1[n].store(c1.add(n * V::LANES));
        }
    }
    if nvec % 2 == 1 {
        let c0 = a_at(nvec - 1);
        let mut a0 = [V::zero(); N];
        for n in 0..N {
            a0[n] = V::load(c0.add(n * V::LANES)).mul(al[n]);
        }
        for x in 0..nk {
            let v0 = rows.vector::<V>(x, nvec - 1);
            for (n, a) in a0.iter_mut().enumerate() {
                *a = a.fma(V::splat(*p.add(n * KEY_BLOCK + x)), v0);
            }
        }
        for (n, a) in a0.iter().enumerate() {
            a.store(c0.add(n * V::LANES));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the generic `$check::<V>()` for the scalar vector and for each instruction set this
    /// machine has (inside a function compiled for that set).
    macro_rules! on_every_vector {
        ($check:ident) => {{
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
            unsafe fn on_avx512() {
                $check::<x86::Avx512>()
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn on_avx2() {
                $check::<x86::Avx2>()
            }
            // SAFETY: each set runs only where isa() reports it.
            unsafe {
                $check::<Scalar>();
                #[cfg(target_arch = "x86_64")]
                {
                    if matches!(isa(), Isa::Avx512) {
                        on_avx512();
                    }
                    if matches!(isa(), Isa::Avx512 | Isa::Avx2) {
                        on_avx2();
                    }
                }
            }
        }};
    }

    /// sum_each on every instruction set this machine has: lane i is the sum of input i.
    #[test]
    fn sum_each_sums_each_input() {
        unsafe fn check<V: Vector>() {
            let n = V::LANES;
            let data: Vec<f32> = (0..n * n).map(|i| ((i * 7919) % 1009) as f32 - 500.0).collect();
            let xs: Vec<V> = (0..n).map(|i| V::load(data.as_ptr().add(i * n))).collect();
            let mut out = vec![0f32; n];
            V::sum_each(&xs).store(out.as_mut_ptr());
            for i in 0..n {
                assert_eq!(out[i], data[i * n..(i + 1) * n].iter().sum::<f32>(), "lane {i} of {n}");
            }
        }
        on_every_vector!(check);
    }

    /// reduce_max on every instruction set this machine has: the largest lane, NaN lanes skipped
    /// (all NaN: -inf), as a scalar fold.
    #[test]
    fn reduce_max_skips_nan() {
        unsafe fn check<V: Vector>() {
            let n = V::LANES;
            for case in 0..4 * n {
                let mut data: Vec<f32> = (0..n).map(|i| (((i + case) * 7919) % 1009) as f32 - 500.0).collect();
                if case >= n {
                    data[case % n] = f32::NAN; // one NaN lane, anywhere
                }
                if case >= 3 * n {
                    data.fill(f32::NAN);
                }
                let want = data.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
                assert_eq!(V::load(data.as_ptr()).reduce_max(), want, "case {case} of {n} lanes");
            }
        }
        on_every_vector!(check);
    }

    /// One task on every instruction set this machine has (and the scalar one) gives the same
    /// states: plain f16 and bf16 rows with D = 40 (a partial vector), bf16 rows at D = 64 / 96 (the
    /// bf16 dot products where the CPU has them, which round P to bf16: o to that rounding), 4-bit
    /// K at D = 64 / 128 / 192 (its codes into the dot products: half a 128-dim chunk, odd group
    /// counts; V 4-bit too at D = 128), 8-bit rows, K and V in different formats, 1 to 4 query
    /// rows (5, 8, 15, 16 and 20 states: groups of 8, 4, 2 and 1). With bf16 q the bf16 or quantized K's scores take the AMX
    /// tiles where the CPU has them (two whole blocks and a partial one; 1 to 6 groups).
    #[test]
    fn every_instruction_set_agrees() {
        use crate::dtype::DType;
        use crate::quant::{quantize, QuantFormat};
        let rand = |n: usize, seed: u64| -> Vec<f32> {
            let mut x = seed | 1;
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
                })
                .collect()
        };
        let (b, s, hkv) = (1usize, 70usize, 2usize);
        // bf16 at D = 64 and 96 with a plain K: the bf16 dot products where the CPU has them
        // (decode_bf16.rs; 2 and 3 operands per row).
        let cases = [
            (DType::F16, 40, None),
            (DType::BF16, 40, None),
            (DType::BF16, 64, None),
            (DType::BF16, 96, None),
            (DType::BF16, 64, Some((4, 32))),
            (DType::BF16, 192, Some((4, 64))),
            (DType::BF16, 128, Some((4, 32))),
            (DType::BF16, 128, Some((4, 64))),
            (DType::BF16, 192, Some((4, 32))),
            (DType::F16, 128, Some((4, 64))),
            (DType::F16, 64, Some((4, 32))),
            (DType::BF16, 128, Some((8, 64))),
            (DType::BF16, 96, Some((8, 32))),
            (DType::F32, 128, Some((8, 64))),
        ];
        for (dtype, d, quant) in cases {
            // (GQA group, query rows): 5, 15, 8, 16 and 20 states a kv head.
            for (group, sq) in [(5usize, 1usize), (5, 3), (4, 2), (4, 4), (5, 4)] {
                let bytes = |x: &[f32]| {
                    let mut out = vec![0u8; x.len() * dtype.size_bytes()];
                    dtype.store(x, &mut out, 0);
                    out
                };
                let q = bytes(&rand(b * sq * hkv * group * d, 3));
                let (kx, vx) = (bytes(&rand(b * s * hkv * d, 5)), bytes(&rand(b * s * hkv * d, 7)));
                let quantize_rows = |x: &[u8], (bits, gs): (usize, usize)| {
                    let fmt = QuantFormat::new(bits, gs, d).unwrap();
                    let rows = b * s * hkv;
                    let mut v = vec![0u32; rows * fmt.words()];
                    let (mut sc, mut bi) = (vec![0u8; rows * fmt.groups() * dtype.size_bytes()], vec![0u8; rows * fmt.groups() * dtype.size_bytes()]);
                    quantize(dtype, &fmt, x, &mut v, &mut sc, &mut bi).unwrap();
                    (fmt, v, sc, bi)
                };
                let quantized = quant.map(|qf| quantize_rows(&kx, qf));
                let k = match &quantized {
                    Some((fmt, v, sc, bi)) => Cache::Quant { fmt: *fmt, values: v, scales: sc, biases: bi },
                    None => Cache::Plain(&kx),
                };
                // V plain (K and V in different formats when K is quantized), or 4-bit as K at D = 128.
                let vq = quant.filter(|&(bits, _)| bits == 4 && d == 128).map(|qf| quantize_rows(&vx, qf));
                let v = match &vq {
                    Some((fmt, vv, sc, bi)) => Cache::Quant { fmt: *fmt, values: vv, scales: sc, biases: bi },
                    None => Cache::Plain(&vx),
                };
                let p = Decode {
                    dtype, batch: b, seq_q: sq, s_cache: s, heads: hkv * group, kv_heads: hkv, head_dim: d, causal: true, scale: 0.3,
                    left: Some(50), right: None, softcap: None, num_splits: None,
                };
                let t = Task { b: 0, lo: 3, hi: s, k0: 3, k1: s };
                let n = hkv * group * sq;
                let go = |f: &dyn Fn(&mut [f32], &mut [f32])| {
                    let (mut po, mut pl) = (vec![0f32; n * d], vec![0f32; n]);
                    f(&mut po, &mut pl);
                    (po, pl)
                };
                // SAFETY: each set runs only where isa() reports it.
                let want = go(&|po, pl| unsafe { run::<Scalar, false, false, false>(&p, &q, &k, &v, t, po, pl) });
                // The bf16 dot products (decode_bf16.rs) where the CPU has them, whether or not
                // task() prefers them here.
                #[cfg(target_arch = "x86_64")]
                let paths = if matches!(isa(), Isa::Avx512) { super::decode_bf16::paths(&p, &k, &v) } else { DotPaths::default() };
                #[cfg(not(target_arch = "x86_64"))]
                let paths = DotPaths::default();
                #[cfg(target_arch = "x86_64")]
                let task_dot = paths.any() && super::decode_bf16::preferred();
                #[cfg(not(target_arch = "x86_64"))]
                let task_dot = false;
                // The AMX scores (decode_amx.rs) where this machine has them, whether or not
                // task() prefers them for this many states.
                #[cfg(target_arch = "x86_64")]
                let amx = matches!(isa(), Isa::Avx512) && super::decode_amx::supported(&p, &k);
                #[cfg(target_arch = "x86_64")]
                let task_amx = amx && !task_dot && super::decode_amx::preferred(&p);
                #[cfg(not(target_arch = "x86_64"))]
                let task_amx = false;
                // The byte dot products over a 4-bit K (decode_vnni.rs) where this machine has them.
                #[cfg(target_arch = "x86_64")]
                let vnni = matches!(isa(), Isa::Avx512) && super::decode_vnni::usable(&p, &k);
                #[cfg(target_arch = "x86_64")]
                let task_vnni = vnni && !task_dot && !task_amx && t.k1 - t.k0 >= super::decode_vnni::MIN_KEYS;
                #[cfg(not(target_arch = "x86_64"))]
                let task_vnni = false;
                // (states, by the dot products, by the AMX scores, by the byte dot products)
                let mut got = vec![(go(&|po, pl| task(&p, &q, &k, &v, t, po, pl)), task_dot, task_amx, task_vnni)];
                #[cfg(target_arch = "x86_64")]
                {
                    if matches!(isa(), Isa::Avx512 | Isa::Avx2) {
                        got.push((go(&|po, pl| unsafe { avx2(&p, &q, &k, &v, t, po, pl) }), false, false, false));
                    }
                    // The AVX-512 builds task() did not take.
                    if task_dot || task_amx || task_vnni {
                        got.push((go(&|po, pl| unsafe { avx512(&p, &q, &k, &v, t, po, pl) }), false, false, false));
                    }
                    if !task_dot && paths.any() {
                        got.push((go(&|po, pl| unsafe { avx512_bf16(&p, &q, &k, &v, t, po, pl) }), true, false, false));
                    }
                    if amx && !task_amx {
                        got.push((go(&|po, pl| unsafe { avx512_amx(&p, &q, &k, &v, t, po, pl) }), false, true, false));
                    }
                    if vnni && !task_vnni {
                        got.push((go(&|po, pl| unsafe { avx512_vnni(&p, &q, &k, &v, t, po, pl) }), false, false, true));
                    }
                }
                // The dot products round P to bf16 over a plain V: their states then agree to that
                // rounding (norm-wise; a misplaced element would be off by O(1)). Over a 4-bit K the
                // magic offset cancels in f32 (~7 bits of 24): 1e-4, as over a quantized K by the
                // AMX tiles (each group's scale after its sum, the 4-bit magic cancelled), and as by
                // the byte dot products (q rounded at 2^-14 of each group's largest element).
                for ((po, pl), dot, amx, vnni) in got {
                    // The 16-bit P V over a 4-bit V rounds P s_G at 2^-15 of each block's largest:
                    // o to that rounding, norm-wise too (measured ~6e-5), lse as the scores'.
                    #[cfg(target_arch = "x86_64")]
                    let vnni_v = vnni && super::decode_vnni::usable_v(&p, &v);
                    #[cfg(not(target_arch = "x86_64"))]
                    let vnni_v = false;
                    let normwise = if dot && paths.v_plain { Some((4e-3, 1e-5)) } else if vnni_v { Some((2e-4, 1e-4)) } else { None };
                    if let Some((o_tol, lse_tol)) = normwise {
                        let err = po.iter().zip(&want.0).map(|(a, w)| (a - w) * (a - w)).sum::<f32>().sqrt();
                        let norm = want.0.iter().map(|w| w * w).sum::<f32>().sqrt();
                        assert!(err <= o_tol * norm, "{dtype:?} d={d} {quant:?} sq={sq} (dot products: {dot}, VNNI: {vnni}): o's relative error {}", err / norm);
                        for (a, w) in pl.iter().zip(&want.1) {
                            assert!((a - w).abs() <= lse_tol * (1.0 + w.abs()), "{dtype:?} d={d} sq={sq}: lse {a} vs {w}");
                        }
                        continue;
                    }
                    let tol = if (dot && paths.k_q4) || ((amx || vnni) && quant.is_some()) { 1e-4 } else { 1e-5 };
                    for (i, (a, w)) in po.iter().zip(&want.0).chain(pl.iter().zip(&want.1)).enumerate() {
                        assert!((a - w).abs() <= tol * (1.0 + w.abs()), "{dtype:?} d={d} {quant:?} group={group} sq={sq} (dot products: {dot}, AMX: {amx}, VNNI: {vnni}): [{i}] {a} vs {w}");
                    }
                }
            }
        }
    }

    /// 4-bit rows and bf16 rows read in pairs of vectors put the head dim in a permuted order.
    #[test]
    fn positions_are_permutations() {
        use crate::dtype::DType;
        let fmt = crate::quant::QuantFormat::new(4, 32, 128).unwrap();
        let q4 = Cache::Quant { fmt, values: &[], scales: &[], biases: &[] };
        let p = |dtype: DType, d: usize| Decode {
            dtype, batch: 1, seq_q: 1, s_cache: 1, heads: 1, kv_heads: 1, head_dim: d, causal: false, scale: 1.0,
            left: None, right: None, softcap: None, num_splits: None,
        };
        let (bf16, f16, plain) = (p(DType::BF16, 128), p(DType::F16, 128), Cache::Plain(&[]));
        for lanes in [1, 8, 16] {
            for (c, p) in [(&q4, &bf16), (&plain, &bf16), (&plain, &f16)] {
                let mut seen = [false; 128];
                for e in 0..128 {
                    seen[position(c, p, lanes, e)] = true;
                }
                assert!(seen.iter().all(|&s| s), "{lanes} lanes");
            }
        }
        let at = |c: &Cache, p: &Decode, lanes: usize, es: [usize; 4]| es.map(|e| position(c, p, lanes, e));
        assert_eq!(at(&q4, &bf16, 16, [0, 1, 2, 33]), [0, 16, 1, 48]);
        assert_eq!(at(&q4, &bf16, 1, [5, 1, 2, 3]), [5, 1, 2, 3]);
        assert_eq!(at(&q4, &bf16, 8, [1, 17, 2, 3]), [8, 24, 1, 9]);
        // bf16 pairs as the 4-bit order; f16, and bf16 whose D is not a multiple of 2 · LANES, in order.
        assert_eq!(at(&plain, &bf16, 16, [0, 1, 2, 33]), [0, 16, 1, 48]);
        assert_eq!(at(&plain, &f16, 16, [0, 1, 2, 33]), [0, 1, 2, 33]);
        assert_eq!(at(&plain, &p(DType::BF16, 48), 16, [0, 1, 2, 33]), [0, 1, 2, 33]);
    }
}
