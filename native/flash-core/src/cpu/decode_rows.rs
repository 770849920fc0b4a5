//! How decode reads the cache rows of a block of keys: straight into SIMD registers, a vector of
//! head-dim elements at a time, widened (f16, bf16) or dequantized (`scale * code + bias`,
//! quant.rs's format) there — no f32 copy of a row is stored.
//!
//! A block is KEY_BLOCK consecutive keys of one batch row, every kv head: one contiguous stretch
//! of each cache buffer. `block` takes it (prefetching the next, converting a quantized block's
//! scales and biases to f32 in one pass), then `head` points the reader at one kv head's rows.
//!
//! Element order: vector i of a row holds its elements i·LANES .. (i+1)·LANES, except for 4-bit
//! rows, which are read LANES bytes (2·LANES codes) at a time, low nibbles (even elements) in one
//! vector and high nibbles (odd elements) in the next: [`position`] says where element e lands. A
//! dot product does not mind the order when q follows it; the output undoes it.

use std::ops::Range;

use super::vector::Vector;
use crate::decode::{Cache, Decode};
use crate::dtype::DType;

/// Keys per block (a softmax step); a multiple of every vector width.
pub(crate) const KEY_BLOCK: usize = 32;

// The unpacking reads the packed codes as the little-endian bytes they are on every target this
// crate builds for (code i of an 8-bit row is byte i; of a 4-bit row, a nibble of byte i / 2).
#[cfg(target_endian = "big")]
compile_error!("cpu/decode_rows.rs reads quantized codes as little-endian bytes");

/// Vectors of one kv head's rows of the current block.
pub(crate) trait Rows {
    /// Vector `i` of key x's row (x < the block's keys), `position`'s order, zeros past D.
    unsafe fn vector<V: Vector>(&self, x: usize, i: usize) -> V;
    /// Vectors 2c and 2c + 1 of key x's row (both inside the row's vectors).
    #[inline(always)]
    unsafe fn pair<V: Vector>(&self, x: usize, c: usize) -> (V, V) {
        (self.vector(x, 2 * c), self.vector(x, 2 * c + 1))
    }
}

/// Where head-dim element `e` of a row of `cache` sits among a row's vectors of `lanes` lanes.
pub(crate) fn position(cache: &Cache, p: &Decode, lanes: usize, e: usize) -> usize {
    let split = |e: usize| e / (2 * lanes) * (2 * lanes) + (e % 2) * lanes + (e % (2 * lanes)) / 2;
    match cache {
        Cache::Quant { fmt, .. } if fmt.bits == 4 => split(e),
        Cache::Plain(_) if bf16_pairs(p, lanes) => split(e),
        _ => e,
    }
}

/// Whether plain bf16 rows are read 2·LANES elements at a time, even elements in one vector and
/// odd ones in the next (`Vector::load_bf16_pair`): where D is a multiple of 2·LANES.
fn bf16_pairs(p: &Decode, lanes: usize) -> bool {
    p.dtype == DType::BF16 && p.head_dim.is_multiple_of(2 * lanes)
}

/// Plain rows; KIND 0: f32, 1: f16, 2: bf16. Where D is not a multiple of LANES, `head` copies
/// the head's rows into `staging`, zero padded to whole vectors, so that no vector read reaches
/// past a row and the missing lanes are 0.
pub(crate) struct Plain<'a, const KIND: u8> {
    bytes: &'a [u8],
    heads: usize,
    row_bytes: usize, // D elements
    block: usize,     // the block's first row
    nk: usize,
    first: *const u8, // the head's first row
    stride: usize,    // bytes from one key's row to the next
    staging: Vec<u8>, // [KEY_BLOCK, padded D], or empty
    pairs: bool,      // bf16_pairs: vectors 2c and 2c + 1 split elements 2c·LANES .. by parity
}

impl<'a, const KIND: u8> Plain<'a, KIND> {
    const ES: usize = if KIND == 0 { 4 } else { 2 };

    fn new(p: &Decode, bytes: &'a [u8], lanes: usize) -> Self {
        let d = p.head_dim;
        let staging = if d.is_multiple_of(lanes) { Vec::new() } else { vec![0u8; KEY_BLOCK * d.next_multiple_of(lanes) * Self::ES] };
        let pairs = KIND == 2 && bf16_pairs(p, lanes);
        Plain { bytes, heads: p.kv_heads, row_bytes: d * Self::ES, block: 0, nk: 0, first: bytes.as_ptr(), stride: 0, staging, pairs }
    }

    fn head(&mut self, kv: usize) {
        let (rb, nk) = (self.row_bytes, self.nk);
        if nk == 0 {
            return;
        }
        let step = self.heads * rb;
        let rows = &self.bytes[(self.block + kv) * rb..][..(nk - 1) * step + rb];
        if self.staging.is_empty() {
            (self.first, self.stride) = (rows.as_ptr(), step);
        } else {
            let padded = self.staging.len() / KEY_BLOCK;
            for x in 0..nk {
                self.staging[x * padded..][..rb].copy_from_slice(&rows[x * step..][..rb]);
            }
            (self.first, self.stride) = (self.staging.as_ptr(), padded);
        }
    }

    #[inline(always)]
    unsafe fn widen<V: Vector>(p: *const u8) -> V {
        match KIND {
            0 => V::load(p as *const f32),
            1 => V::load_f16(p),
            _ => V::load_bf16(p),
        }
    }
}

impl<const KIND: u8> Plain<'_, KIND> {
    /// Key x's row of the current head (x < the block's keys): D elements, or the padded staging
    /// copy's.
    #[inline(always)]
    pub(crate) unsafe fn row(&self, x: usize) -> *const u8 {
        self.first.add(x * self.stride)
    }
    /// Key x's row of kv head kv in the cache (x < the block's keys), whichever head is current
    /// (the cache's, never the staging copy's).
    #[inline(always)]
    pub(crate) unsafe fn row_of(&self, kv: usize, x: usize) -> *const u8 {
        self.bytes.as_ptr().add((self.block + x * self.heads + kv) * self.row_bytes)
    }
    /// Bytes from one key's row of a kv head to the next in the cache.
    pub(crate) fn stride(&self) -> usize {
        self.heads * self.row_bytes
    }
}

impl<const KIND: u8> Rows for Plain<'_, KIND> {
    #[inline(always)]
    unsafe fn vector<V: Vector>(&self, x: usize, i: usize) -> V {
        if KIND == 2 && self.pairs {
            let (a, b) = self.pair::<V>(x, i / 2);
            return if i.is_multiple_of(2) { a } else { b };
        }
        Self::widen(self.first.add(x * self.stride + i * V::LANES * Self::ES))
    }

    #[inline(always)]
    unsafe fn pair<V: Vector>(&self, x: usize, c: usize) -> (V, V) {
        let at = self.first.add(x * self.stride + 2 * c * V::LANES * Self::ES);
        if KIND == 2 && self.pairs {
            V::load_bf16_pair(at)
        } else {
            (Self::widen(at), Self::widen(at.add(V::LANES * Self::ES)))
        }
    }
}

/// Quantized rows of BITS-bit codes, with the block's scales and biases as f32.
pub(crate) struct Quant<'a, const BITS: usize> {
    values: &'a [u32],
    scales: &'a [u8],
    biases: &'a [u8],
    dtype: DType, // the scales' and biases'
    heads: usize,
    words: usize,
    groups: usize,
    group_shift: u32, // log2(group size)
    block: usize,     // the block's first row
    nk: usize,
    first: *const u8, // the head's first row of codes
    stride: usize,    // bytes from one key's codes to the next
    scale: Vec<f32>,  // the block's [KEY_BLOCK, Hkv, groups]
    bias: Vec<f32>,
    head: usize, // the head's first entry in scale and bias
}

impl<'a, const BITS: usize> Quant<'a, BITS> {
    fn new(p: &Decode, fmt: &crate::quant::QuantFormat, values: &'a [u32], scales: &'a [u8], biases: &'a [u8]) -> Self {
        let n = KEY_BLOCK * p.kv_heads * fmt.groups();
        Quant {
            values,
            scales,
            biases,
            dtype: p.dtype,
            heads: p.kv_heads,
            words: fmt.words(),
            groups: fmt.groups(),
            group_shift: fmt.group_size.trailing_zeros(),
            block: 0,
            nk: 0,
            first: values.as_ptr() as *const u8,
            stride: p.kv_heads * fmt.words() * 4,
            scale: vec![0.0; n],
            bias: vec![0.0; n],
            head: 0,
        }
    }

    /// The block's scales and biases (contiguous, every head) to f32, one vectorised pass each.
    fn convert(&mut self) {
        let (at, n) = (self.block * self.groups, self.nk * self.heads * self.groups);
        self.dtype.load(self.scales, at, &mut self.scale[..n]);
        self.dtype.load(self.biases, at, &mut self.bias[..n]);
    }

    fn head(&mut self, kv: usize) {
        if self.nk == 0 {
            return;
        }
        let (w, step) = (self.words, self.heads * self.words);
        let rows = &self.values[(self.block + kv) * w..][..(self.nk - 1) * step + w];
        self.first = rows.as_ptr() as *const u8;
        self.head = kv * self.groups;
    }
}

impl<const BITS: usize> Quant<'_, BITS> {
    /// Key x's row of codes of the current head (x < the block's keys).
    #[inline(always)]
    pub(crate) unsafe fn row(&self, x: usize) -> *const u8 {
        self.first.add(x * self.stride)
    }
    /// Key x's scales and biases (f32, `groups` each) of the current head.
    #[inline(always)]
    pub(crate) unsafe fn scales(&self, x: usize) -> (*const f32, *const f32) {
        let at = x * self.heads * self.groups + self.head;
        (self.scale.as_ptr().add(at), self.bias.as_ptr().add(at))
    }
    /// Floats from one key's scales to the next's.
    pub(crate) fn scale_stride(&self) -> usize {
        self.heads * self.groups
    }
    /// Key x's row of codes of kv head kv (x < the block's keys), whichever head is current.
    #[inline(always)]
    pub(crate) unsafe fn row_of(&self, kv: usize, x: usize) -> *const u8 {
        (self.values.as_ptr() as *const u8).add((self.block + x * self.heads + kv) * self.words * 4)
    }
    /// Key x's scales and biases (f32, `groups` each) of kv head kv, whichever head is current.
    #[inline(always)]
    pub(crate) unsafe fn scales_of(&self, kv: usize, x: usize) -> (*const f32, *const f32) {
        let at = (x * self.heads + kv) * self.groups;
        (self.scale.as_ptr().add(at), self.bias.as_ptr().add(at))
    }
}

impl<const BITS: usize> Rows for Quant<'_, BITS> {
    #[inline(always)]
    unsafe fn vector<V: Vector>(&self, x: usize, i: usize) -> V {
        let (a, b) = self.pair::<V>(x, i / 2);
        if i.is_multiple_of(2) {
            a
        } else {
            b
        }
    }

    /// A pair of vectors lies in one group (2 · LANES <= 32 <= group size): one scale and bias.
    #[inline(always)]
    unsafe fn pair<V: Vector>(&self, x: usize, c: usize) -> (V, V) {
        let row = self.first.add(x * self.stride);
        let at = x * self.heads * self.groups + self.head + ((2 * c * V::LANES) >> self.group_shift);
        let (s, b) = (V::splat(*self.scale.get_unchecked(at)), V::splat(*self.bias.get_unchecked(at)));
        if BITS == 8 {
            let p = row.add(2 * c * V::LANES);
            (b.fma(V::load_u8(p), s), b.fma(V::load_u8(p.add(V::LANES)), s))
        } else {
            // LANES bytes: 2 · LANES codes, the even elements' then the odd ones'.
            V::load_u4_dequant(row.add(c * V::LANES), s, b)
        }
    }
}

/// A cache's rows for one task, in whichever format it is stored.
pub(crate) enum Reader<'a> {
    F32(Plain<'a, 0>),
    F16(Plain<'a, 1>),
    Bf16(Plain<'a, 2>),
    Q8(Quant<'a, 8>),
    Q4(Quant<'a, 4>),
}

impl<'a> Reader<'a> {
    /// A reader of `cache` for vectors of `lanes` lanes.
    pub(crate) fn new(cache: &Cache<'a>, p: &Decode, lanes: usize) -> Reader<'a> {
        match *cache {
            Cache::Plain(bytes) => match p.dtype {
                DType::F32 => Reader::F32(Plain::new(p, bytes, lanes)),
                DType::F16 => Reader::F16(Plain::new(p, bytes, lanes)),
                DType::BF16 => Reader::Bf16(Plain::new(p, bytes, lanes)),
            },
            Cache::Quant { fmt, values, scales, biases } if fmt.bits == 4 => Reader::Q4(Quant::new(p, &fmt, values, scales, biases)),
            Cache::Quant { fmt, values, scales, biases } => Reader::Q8(Quant::new(p, &fmt, values, scales, biases)),
        }
    }

    /// Takes the block of cache rows `rows` (nk <= KEY_BLOCK keys, every kv head: rows.len() =
    /// nk · Hkv).
    pub(crate) fn block(&mut self, rows: Range<usize>) {
        match self {
            Reader::F32(r) => (r.block, r.nk) = (rows.start, rows.len() / r.heads),
            Reader::F16(r) => (r.block, r.nk) = (rows.start, rows.len() / r.heads),
            Reader::Bf16(r) => (r.block, r.nk) = (rows.start, rows.len() / r.heads),
            Reader::Q8(r) => {
                (r.block, r.nk) = (rows.start, rows.len() / r.heads);
                r.convert();
            }
            Reader::Q4(r) => {
                (r.block, r.nk) = (rows.start, rows.len() / r.heads);
                r.convert();
            }
        }
    }

    /// Asks for the lines of cache rows `rows` ahead of their use, so that the cache streams in
    /// while a block is computed: their values (`scales` false) or their scales and biases (true;
    /// a few bytes a row, so asked for once per stretch of rows, not per piece of it).
    #[inline]
    pub(crate) fn prefetch(&self, rows: Range<usize>, scales: bool) {
        let parts = self.parts();
        for &(bytes, rb) in if scales { &parts[1..] } else { &parts[..1] } {
            let end = (rows.end * rb).min(bytes.len());
            prefetch(&bytes[(rows.start * rb).min(end)..end]);
        }
    }

    /// Points the reader at kv head `kv`'s rows of the block.
    pub(crate) fn head(&mut self, kv: usize) {
        match self {
            Reader::F32(r) => r.head(kv),
            Reader::F16(r) => r.head(kv),
            Reader::Bf16(r) => r.head(kv),
            Reader::Q8(r) => r.head(kv),
            Reader::Q4(r) => r.head(kv),
        }
    }

    /// The buffers a row lives in, with their bytes per row (0: none).
    fn parts(&self) -> [(&'a [u8], usize); 3] {
        match self {
            Reader::F32(r) => [(r.bytes, r.row_bytes), (&[], 0), (&[], 0)],
            Reader::F16(r) => [(r.bytes, r.row_bytes), (&[], 0), (&[], 0)],
            Reader::Bf16(r) => [(r.bytes, r.row_bytes), (&[], 0), (&[], 0)],
            Reader::Q8(Quant { values, scales, biases, words, groups, dtype, .. }) | Reader::Q4(Quant { values, scales, biases, words, groups, dtype, .. }) => {
                let es = dtype.size_bytes();
                [(as_bytes(values), words * 4), (scales, groups * es), (biases, groups * es)]
            }
        }
    }
}

fn as_bytes(words: &[u32]) -> &[u8] {
    // SAFETY: u8 has no alignment and every bit pattern; the bytes live as long as the words.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, words.len() * 4) }
}

/// Asks for every cache line of `bytes`.
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..bytes.len()).step_by(64) {
        // SAFETY: a prefetch of an address inside the slice; it never faults or writes.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T2 }>(bytes.as_ptr().add(line) as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}
