//! Decode's scores over a bf16 or quantized K cache (4- or 8-bit codes) on CPUs with AMX (Intel
//! Sapphire Rapids and later), for bf16 queries: q . k by the tile unit's `tdpbf16ps` (16 keys x
//! states x 32 dims per instruction). A bf16 cache's rows go into the tiles straight from the
//! cache, at its row stride. A quantized cache's codes go in as they are, each group's scale and
//! bias applied after the products in f32, as the GPU's quantized kernels do:
//!   s[st, x] = scale2 · sum over groups G of ( s_G(x) · C_G[x, st] + (b_G(x) - M s_G(x)) · Q_G[st] )
//! with C_G = sum over G's dims of (M + c) q (the tiles' sums) and Q_G = sum over G's dims of q.
//! decode.rs's general path dequantizes every element and takes 16 products per FMA plus a
//! horizontal sum per key and state. The softmax and P V stay on the general path. Taken from 8
//! states per kv head ([`preferred`]: GQA 8, or GQA 4 with 2 query rows and more); at 4 the
//! staging and the tiles cost as much as the FMA path's scores.
//!
//! Codes enter the tiles as bf16, staged by AVX-512 (a tile loads only memory): 4-bit codes
//! as `M + c` with M = 2^7 (the bits 0x4300 | c: one logic op per 32 codes), 8-bit codes as
//! themselves (M = 0; every integer below 2^8 is a bf16). A half block (16 keys, every kv head) is
//! staged, then its tiles run, so that a tile load does not wait behind stores still in flight
//! (a tile load issued behind stores waits for them to drain: bench/RESULTS.md, session 45); the
//! first half's f32 combine runs while the second half's stores drain. The combine takes 16 keys
//! a vector, in the softmax's [states, keys] rows.
//!
//! Exactness: k, (M + c) and q are bf16, their products exact in f32, the sums f32 (round to
//! nearest) as on the general path, up to summation order; the magic M's share cancels in f32
//! (M · Q_G subtracted: ~7 of the 24 bits at 4 bits, as decode_bf16.rs's `scores_q4`; the unit
//! test's 1e-4 holds). The tile unit treats bf16 subnormal inputs as zero and flushes subnormal
//! f32 results: terms below 2^-126, far under the rounding of any score they would add to.
//!
//! Tiles (palette 1), configured per task by [`Scores::new`] (rayon's workers each load their
//! own configuration) and released when it drops: tmm0..tmm3 the sums [16 keys, cols] of four
//! groups (or sets of states: past 16 states a kv head they go in sets of 16 columns) in flight,
//! tmm4 / tmm5 the rows [16 keys, 32 dims] of even / odd chunks, tmm6 / tmm7 q's pairs [16 dim
//! pairs, cols] of those chunks (the tile registers are not renamed: a
//! load into a register the previous products still read would wait for them).

use std::arch::asm;
use std::arch::x86_64::*;

use super::decode_rows::{Plain, Quant, KEY_BLOCK};
use crate::decode::{Cache, Decode};
use crate::dtype::DType;

/// Head dims per tile row (64 bytes of bf16).
const CHUNK: usize = 32;
/// Keys per tile (its rows): a block is staged and multiplied in two halves.
const ROWS: usize = 16;
/// The most groups a row has (groups of at least 32 dims).
const MAX_GROUPS: usize = crate::problem::MAX_HEAD_DIM / CHUNK;
const _: () = assert!(KEY_BLOCK == 2 * ROWS);

/// Whether this file's scores can take the call: bf16 q over a plain bf16 K cache with D a
/// multiple of 32 or a 4- or 8-bit one whose groups are whole chunks of 32 dims (4-bit: D a
/// multiple of 64), and a CPU with AMX that the OS lets this process use ([`available`]).
pub(crate) fn supported(p: &Decode, k: &Cache) -> bool {
    let states = p.heads / p.kv_heads * p.seq_q;
    let cache = match k {
        // (4-bit rows are staged 64 codes at a time.)
        Cache::Quant { fmt, .. } => fmt.group_size.is_multiple_of(CHUNK) && (fmt.bits == 8 || p.head_dim.is_multiple_of(64)),
        Cache::Plain(_) => p.head_dim.is_multiple_of(CHUNK),
    };
    p.dtype == DType::BF16 && cache && states >= 1 && available()
}

/// Whether decode takes them where [`supported`]: from 8 states per kv head. The staging, the
/// tile loads and products cost the same for any number of states (a C tile's 16 columns are paid
/// for whether they hold 4 states or 16), where the FMA path's scores cost per state: measured
/// (bench/RESULTS.md, session 51, D = 128, groups of 64, 2 threads past the L3) at 4 states
/// level for 4-bit, 25 % slower for 8-bit and 2-7 % for bf16 (its scores are bound by K's lines
/// reaching the core, not by the FMAs); at 8 states 8-20 % faster (bf16 25 %), at 16 17-30 %,
/// at 32 27-39 %.
pub(crate) fn preferred(p: &Decode) -> bool {
    p.heads / p.kv_heads * p.seq_q >= 8
}

/// AMX-TILE and AMX-BF16 (CPUID), AVX512-BW and AVX512-BF16 (the staging), the OS's permission
/// for the tile data (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process), and not
/// switched off by FLASH_NIF_CPU_AMX=0 (read once). False elsewhere: decode keeps the general path.
pub(crate) fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        if std::env::var("FLASH_NIF_CPU_AMX").is_ok_and(|v| v.trim() == "0") {
            return false;
        }
        // (CPUID leaf 7 reads zeros where it does not exist: no AMX.)
        let id = __cpuid_count(7, 0);
        let (tile, bf16) = (id.edx & (1 << 24) != 0, id.edx & (1 << 22) != 0);
        let avx = std::is_x86_feature_detected!("avx512bw") && std::is_x86_feature_detected!("avx512bf16");
        tile && bf16 && avx && request_tile_data()
    })
}

#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let ret: isize;
    // SAFETY: the arch_prctl system call (158 on x86-64) with a request that only grants this
    // process the right to use the tile registers; it reads and writes no memory of ours.
    unsafe {
        asm!("syscall", inlateout("rax") 158isize => ret, in("rdi") ARCH_REQ_XCOMP_PERM, in("rsi") XFEATURE_XTILEDATA,
             lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// 32 staged bf16 codes: one chunk of a staged row, a cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u16; CHUNK]);

/// Where staged position `i` (0..32) of a 32-dim chunk takes its dim from, within the chunk: the
/// 4-bit staging puts a chunk's 16 low nibbles (even dims) first, then its 16 high ones (odd).
fn staged_dim(bits: usize, i: usize) -> usize {
    if bits == 4 {
        if i < 16 {
            2 * i
        } else {
            2 * (i - 16) + 1
        }
    } else {
        i
    }
}

/// One task's tile state: q of every kv head as the tiles' B operand, its group sums, the staged
/// codes of half a block and the tiles' sums.
pub(crate) struct Scores {
    d: usize,
    states: usize,
    cols: usize, // a C tile's columns: min(states, 16)
    sets: usize, // sets of `cols` states (the last one's missing states have q = 0)
    hkv: usize,
    groups: usize,
    magic: f32,
    qv: Vec<u32>,    // q as raw bf16 pairs [Hkv, sets, D / 32, 16 pairs, cols] in the staged order
    qsum: Vec<f32>,  // each group's sum of q [Hkv, groups, states]
    stage: Vec<Line>, // codes as bf16 [Hkv, 16 keys, D / 32]
    sums: Vec<f32>,  // the tiles' sums [Hkv, sets, groups, KEY_BLOCK, cols]
}

impl Scores {
    /// Configures this thread's tiles and stages q for the K cache `k`; `row_of(kv, st)` is q's
    /// row (in units of D elements) of kv head kv's state st. The caller has checked [`supported`].
    pub(crate) unsafe fn new(p: &Decode, q: &[u8], k: &Cache, row_of: impl Fn(usize, usize) -> usize) -> Scores {
        let (d, hkv) = (p.head_dim, p.kv_heads);
        // A plain cache: one group of D dims, no scale (its sums are the scores).
        let (bits, gs) = match k {
            Cache::Quant { fmt, .. } => (fmt.bits, fmt.group_size),
            Cache::Plain(_) => (16, d),
        };
        let states = p.heads / hkv * p.seq_q;
        let groups = d / gs;
        assert!(states >= 1 && gs.is_multiple_of(CHUNK) && d.is_multiple_of(gs));
        let (cols, chunks) = (states.min(ROWS), d / CHUNK);
        let sets = states.div_ceil(cols);
        let mut c = Config { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        let s4 = (cols * 4) as u16;
        for (t, colsb) in [(0, s4), (1, s4), (2, s4), (3, s4), (4, 64), (5, 64), (6, s4), (7, s4)] {
            c.rows[t] = ROWS as u8;
            c.colsb[t] = colsb;
        }
        asm!("ldtilecfg [{}]", in(reg) &c as *const Config, options(nostack, readonly));
        let (mut qv, mut qsum) = (vec![0u32; hkv * sets * d / 2 * cols], vec![0f32; hkv * groups * states]);
        let bf16 = |e: &[u8], i: usize| u16::from_le_bytes([e[2 * i], e[2 * i + 1]]);
        for kv in 0..hkv {
            for st in 0..states {
                let src = &q[row_of(kv, st) * d * 2..][..d * 2];
                // Pair r of chunk j: staged positions 2r and 2r + 1 (low half: the first).
                for (j, r) in (0..chunks).flat_map(|j| (0..ROWS).map(move |r| (j, r))) {
                    let (lo, hi) = (bf16(src, j * CHUNK + staged_dim(bits, 2 * r)), bf16(src, j * CHUNK + staged_dim(bits, 2 * r + 1)));
                    qv[(((kv * sets + st / cols) * chunks + j) * ROWS + r) * cols + st % cols] = lo as u32 | (hi as u32) << 16;
                }
                for e in 0..d {
                    qsum[(kv * groups + e / gs) * states + st] += f32::from_bits((bf16(src, e) as u32) << 16);
                }
            }
        }
        Scores {
            d,
            states,
            cols,
            sets,
            hkv,
            groups,
            magic: if bits == 4 { 128.0 } else { 0.0 },
            qv,
            qsum,
            stage: vec![Line([0; CHUNK]); hkv * ROWS * d / CHUNK],
            sums: vec![0.0; hkv * sets * groups * KEY_BLOCK * cols],
        }
    }

    /// s[kv, st, x] = scale2 · q[st] . k[x] for every kv head and the KEY_BLOCK keys of the
    /// reader's block (a whole one); s `[Hkv, states, KEY_BLOCK]`.
    #[inline(always)]
    pub(crate) unsafe fn block<const BITS: usize>(&mut self, r: &Quant<'_, BITS>, scale2: f32, s: &mut [f32]) {
        let (states, hkv, d) = (self.states, self.hkv, self.d);
        assert!(s.len() == hkv * states * KEY_BLOCK);
        let combine = |this: &Self, half: usize, s: &mut [f32]| {
            for kv in 0..hkv {
                let (sc, bi) = r.scales_of(kv, half * ROWS);
                this.combine(Some((sc, bi, r.scale_stride())), kv, half, scale2, s.as_mut_ptr().add(kv * states * KEY_BLOCK + half * ROWS));
            }
        };
        for half in 0..2 {
            for kv in 0..hkv {
                for x in 0..ROWS {
                    let dst = self.stage.as_mut_ptr().add((kv * ROWS + x) * d / CHUNK);
                    stage::<BITS>(r.row_of(kv, half * ROWS + x), d, dst as *mut u16);
                }
            }
            // The first half's combine while the second's staging drains (its tile loads wait
            // for those stores).
            if half == 1 {
                combine(self, 0, s);
            }
            for kv in 0..hkv {
                let staged = self.stage.as_ptr().add(kv * ROWS * d / CHUNK) as *const u8;
                self.products(kv, half, staged, d * 2);
            }
        }
        combine(self, 1, s);
    }

    /// [`block`](Self::block) over a plain bf16 K: the tiles load the rows straight from the cache
    /// (at its row stride), nothing staged.
    #[inline(always)]
    pub(crate) unsafe fn block_plain(&mut self, r: &Plain<'_, 2>, scale2: f32, s: &mut [f32]) {
        let (states, hkv) = (self.states, self.hkv);
        assert!(s.len() == hkv * states * KEY_BLOCK && self.groups == 1);
        for half in 0..2 {
            for kv in 0..hkv {
                self.products(kv, half, r.row_of(kv, half * ROWS), r.stride());
            }
        }
        for half in 0..2 {
            for kv in 0..hkv {
                self.combine(None, kv, half, scale2, s.as_mut_ptr().add(kv * states * KEY_BLOCK + half * ROWS));
            }
        }
    }

    /// The f32 combine of kv head kv's half block `half`, 16 keys a vector (the softmax's rows
    /// `s[st, ..]`, of KEY_BLOCK floats): each group's scales and biases gathered across the keys
    /// (strided by the other heads' and groups'), the tiles' sums [16 keys, cols] read a state's
    /// column at a time. `scales`: the half block's first key's scales and biases (f32) and the
    /// floats from one key's to the next's; None for a plain cache (scale 1, bias 0).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn combine(&self, scales: Option<(*const f32, *const f32, usize)>, kv: usize, half: usize, scale2: f32, s: *mut f32) {
        let (states, cols, groups) = (self.states, self.cols, self.groups);
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let by_state = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(cols as i32));
        let (mut sg, mut off) = ([_mm512_set1_ps(1.0); MAX_GROUPS], [_mm512_setzero_ps(); MAX_GROUPS]);
        if let Some((sc, bi, stride)) = scales {
            let by_key = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(stride as i32));
            for g in 0..groups {
                sg[g] = _mm512_i32gather_ps::<4>(by_key, sc.add(g));
                // b_G - M s_G: the magic's share of the tiles' sums.
                off[g] = _mm512_fnmadd_ps(_mm512_set1_ps(self.magic), sg[g], _mm512_i32gather_ps::<4>(by_key, bi.add(g)));
            }
        }
        for t in 0..self.sets {
            let sums = self.sums.as_ptr().add(((kv * self.sets + t) * groups * KEY_BLOCK + half * ROWS) * cols);
            // State st = t · cols + col: set t's column col.
            for col in 0..cols.min(states - t * cols) {
                let st = t * cols + col;
                let mut acc = _mm512_setzero_ps();
                for g in 0..groups {
                    acc = _mm512_fmadd_ps(off[g], _mm512_set1_ps(self.qsum[(kv * groups + g) * states + st]), acc);
                    acc = _mm512_fmadd_ps(sg[g], _mm512_i32gather_ps::<4>(by_state, sums.add(g * KEY_BLOCK * cols + col)), acc);
                }
                _mm512_storeu_ps(s.add(st * KEY_BLOCK), _mm512_mul_ps(acc, _mm512_set1_ps(scale2)));
            }
        }
    }

    /// Kv head kv's tile sums of half block `half`, every group, into `sums`: its 16 keys' rows
    /// of bf16 at `a0`, `astride` bytes apart (staged codes, or a plain cache's rows).
    #[inline(always)]
    unsafe fn products(&mut self, kv: usize, half: usize, a0: *const u8, astride: usize) {
        let (cols, d) = (self.cols, self.d);
        let chunks = d / CHUNK;
        let per_group = chunks / self.groups;
        let qstride = cols * 4;
        // Chunk j's operands: tmm4 / tmm6 (even j) or tmm5 / tmm7 (odd).
        macro_rules! chunk {
            ($c:literal, $j:expr, $a:literal, $q:literal, $qv:expr) => {
                asm!(
                    concat!("tileloadd tmm", $q, ", [{q} + {qs} * 1]"),
                    concat!("tileloadd tmm", $a, ", [{a} + {as} * 1]"),
                    concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $q),
                    q = in(reg) $qv.add($j * ROWS * cols),
                    qs = in(reg) qstride,
                    a = in(reg) a0.add($j * CHUNK * 2),
                    as = in(reg) astride,
                    options(nostack, readonly),
                )
            };
        }
        // Set t's group g's sums in tmm((t · groups + g) % 4).
        macro_rules! group {
            ($c:literal, $t:expr, $g:expr, $qv:expr) => {{
                let qv = $qv;
                asm!(concat!("tilezero tmm", $c), options(nostack, nomem));
                for j in $g * per_group..($g + 1) * per_group {
                    if j % 2 == 0 {
                        chunk!($c, j, "4", "6", qv);
                    } else {
                        chunk!($c, j, "5", "7", qv);
                    }
                }
                let out = self.sums.as_mut_ptr().add((((kv * self.sets + $t) * self.groups + $g) * KEY_BLOCK + half * ROWS) * cols);
                asm!(concat!("tilestored [{o} + {qs} * 1], tmm", $c), o = in(reg) out, qs = in(reg) qstride, options(nostack));
            }};
        }
        for t in 0..self.sets {
            let qv = self.qv.as_ptr().add((kv * self.sets + t) * chunks * ROWS * cols);
            for g in 0..self.groups {
                match (t * self.groups + g) % 4 {
                    0 => group!("0", t, g, qv),
                    1 => group!("1", t, g, qv),
                    2 => group!("2", t, g, qv),
                    _ => group!("3", t, g, qv),
                }
            }
        }
    }
}

impl Drop for Scores {
    fn drop(&mut self) {
        // SAFETY: releases this thread's tile state (configured by `new`).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// A row of D codes (`row`: D · BITS / 8 bytes) as bf16 into `dst` (D elements, 64-byte aligned),
/// [`staged_dim`]'s order within each chunk of 32: 4-bit `M + c` (0x4300 | c), 8-bit c.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn stage<const BITS: usize>(row: *const u8, d: usize, dst: *mut u16) {
    if BITS == 4 {
        let (low, magic) = (_mm512_set1_epi16(0x000f), _mm512_set1_epi16(0x4300));
        // 32 bytes (64 codes) at a time: byte i as a word, then its nibbles; chunk 0 takes the
        // low and high nibbles of bytes 0..16, chunk 1 those of bytes 16..32.
        for i in 0..d / 64 {
            let w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(row.add(32 * i) as *const __m256i));
            // (w & 0xf) | 0x4300 (ternary-logic table: A & B | C).
            let lo = _mm512_ternarylogic_epi32::<0xea>(w, low, magic);
            let hi = _mm512_ternarylogic_epi32::<0xea>(_mm512_srli_epi16::<4>(w), low, magic);
            _mm512_store_si512(dst.add(64 * i) as *mut __m512i, _mm512_shuffle_i64x2::<0x44>(lo, hi));
            _mm512_store_si512(dst.add(64 * i + 32) as *mut __m512i, _mm512_shuffle_i64x2::<0xee>(lo, hi));
        }
    } else {
        // 32 codes at a time: to f32 (exact), then to bf16 (exact below 2^8).
        for i in 0..d / 32 {
            let a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(32 * i) as *const __m128i)));
            let b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(32 * i + 16) as *const __m128i)));
            _mm512_store_si512(dst.add(32 * i) as *mut __m512i, std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(b, a)));
        }
    }
}
