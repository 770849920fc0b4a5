// block.h — the block's rows, lengths and offsets, and the tiles it visits.
#pragma once
#include "params.h"
#include "mask.h"

// ---- the block's rows, lengths and offsets -------------------------------------------------------
// Every tiled kernel opens with one of the two structs below, built from the params and blockIdx:
// they are the one place where a block's query and key ranges, sequence lengths, strides and base
// offsets are computed.

// First key after which no key is visible to any row of the query block [m0, m0 + block_m).
__device__ __forceinline__ int key_end(int m0, int block_m, int seqlen_q, int seqlen_k) {
#if IS_CAUSAL
    int e = m0 + block_m + seqlen_k - seqlen_q;
    return e < 0 ? 0 : (e < seqlen_k ? e : seqlen_k);
#else
    return seqlen_k;
#endif
}

// First query row (a multiple of block_m) whose tile can see a key of the block starting at n0:
// causal skips the query tiles above the diagonal. The dK/dV kernels' twin of key_end.
__device__ __forceinline__ int first_query_tile(int n0, int block_m, int seqlen_q, int seqlen_k) {
#if IS_CAUSAL
    const int first_query = n0 - (seqlen_k - seqlen_q);
    return first_query > 0 ? first_query / block_m * block_m : 0;
#else
    return 0;
#endif
}

#if defined(BLOCK_M) && defined(BLOCK_N)  // the tiled kernels

// A key tile a query block visits: its first key and (MASKED) whether it needs the element mask.
struct KeyTile {
    int n0;
#if MASKED
    bool mask;
#endif
};

// A (query head, query tile) pair a key block visits: its iteration index (see KeyBlock) and
// (MASKED) whether it needs the element mask.
struct QueryTile {
    int it;
#if MASKED
    bool mask;
#endif
};

// The key tiles of a query block as the double-buffered tensor-core kernels walk them: iteration
// j's tile, the next one (QueryBlock::look_ahead finds it at the top of the iteration, so that its
// loads can start) and the shared-memory buffer parity. Plain: tile j starts at j * BLOCK_N.
struct KeyWalk {
    int j;
#if MASKED
    KeyTile cur, nxt;
    int n_end;
    __device__ __forceinline__ bool more() const { return cur.n0 < n_end; }
    __device__ __forceinline__ bool has_next() const { return nxt.n0 < n_end; }
    __device__ __forceinline__ int n0() const { return cur.n0; }
    __device__ __forceinline__ int next_n0() const { return nxt.n0; }
    __device__ __forceinline__ void advance() {
        cur = nxt;
        ++j;
    }
#else
    int n_tiles;
    __device__ __forceinline__ bool more() const { return j < n_tiles; }
    __device__ __forceinline__ bool has_next() const { return j + 1 < n_tiles; }
    __device__ __forceinline__ int n0() const { return j * BLOCK_N; }
    __device__ __forceinline__ int next_n0() const { return (j + 1) * BLOCK_N; }
    __device__ __forceinline__ void advance() { ++j; }
#endif
    __device__ __forceinline__ int buf() const { return j & 1; }
    __device__ __forceinline__ int next_buf() const { return (j + 1) & 1; }
};

// The (query head, query tile) iterations of a key block, walked like KeyWalk. Plain: every
// iteration in turn, the buffer parity that of the iteration.
struct QueryWalk {
#if MASKED
    QueryTile cur, nxt;
    int j, n_iter;
    __device__ __forceinline__ bool more() const { return cur.it < n_iter; }
    __device__ __forceinline__ bool has_next() const { return nxt.it < n_iter; }
    __device__ __forceinline__ int it() const { return cur.it; }
    __device__ __forceinline__ int next_it() const { return nxt.it; }
    __device__ __forceinline__ int buf() const { return j & 1; }
    __device__ __forceinline__ void advance() {
        cur = nxt;
        ++j;
    }
#else
    int it_, n_iter;
    __device__ __forceinline__ bool more() const { return it_ < n_iter; }
    __device__ __forceinline__ bool has_next() const { return it_ + 1 < n_iter; }
    __device__ __forceinline__ int it() const { return it_; }
    __device__ __forceinline__ int next_it() const { return it_ + 1; }
    __device__ __forceinline__ int buf() const { return it_ & 1; }
    __device__ __forceinline__ void advance() { ++it_; }
#endif
};

// A block of a kernel gridded over query tiles (fwd, bwd_dq): grid (ceil(Sq / BLOCK_M), H, B).
// It owns query rows [m0, m0 + BLOCK_M) of head h of batch b and reads keys [n_begin(), n_end())
// of kv head hkv, tile by tile: first_tile(), next_tile(t), ... while t.n0 < n_end() (or with a
// KeyWalk); MASKED blocks visit only the tiles some row sees (key_tile). Causal grids run the
// heaviest blocks (the last rows) first. (A persistent kernel names its tile's block itself.) Offsets are computed where they are asked for, as the
// kernels did before this struct (same code, same registers).
struct QueryBlock {
    int b, h, hkv;       // batch, query head, its key/value head
    int m0;              // first query row
    int Sq, Sk;          // query and key sequence lengths (MASKED: this batch row's q_len, k_len)
#if MASKED
    SeqMask seq;         // this batch row
    int r_end;           // min(m0 + BLOCK_M, Sq): rows [m0, r_end) are real
    int n_lo, n_hi;      // keys [n_lo, n_hi) pass some row's window (n_lo a multiple of BLOCK_N)
    IdRange ids;         // segment ids of rows [m0, r_end)
#endif

    __device__ __forceinline__ explicit QueryBlock(const FlashParams& p)
        : QueryBlock(p, IS_CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x, blockIdx.y, blockIdx.z) {}
    // Query block m_block of head h of batch row b (a persistent grid's tile).
    __device__ __forceinline__ QueryBlock(const FlashParams& p, int m_block, int h_, int b_) {
        h = h_;
        b = b_;
        hkv = h / GQA_GROUP;
        m0 = m_block * BLOCK_M;
#if MASKED
        seq = SeqMask::load(p, b);
        Sq = seq.q_len;
        Sk = seq.k_len;
        r_end = imin(m0 + BLOCK_M, Sq);
        n_lo = n_hi = 0;
        ids = {0, 0};
        if (m0 < Sq) {  // else empty(): the block returns before reading anything
            const int lo = seq.key_lo(m0), hi = seq.key_hi(r_end - 1);  // bounds grow with the row
            n_lo = lo / BLOCK_N * BLOCK_N;
            n_hi = lo < hi ? hi : n_lo;
            if (seq.has_segments()) ids = id_range(seq.seg_q(), m0, r_end);
        }
#else
        Sq = p.seqlen_q;
        Sk = p.seqlen_k;
#endif
    }
    // No row of this batch row is in the block (MASKED: the grid covers the longest sequence).
    __device__ __forceinline__ bool empty() const { return MASKED && m0 >= Sq; }
#if MASKED
    __device__ __forceinline__ int n_begin() const { return n_lo; }
    __device__ __forceinline__ int n_end() const { return n_hi; }
    // Visit keys [n0, n0 + BLOCK_N), and mask them?
    __device__ __forceinline__ TileTest key_tile(int n0) const {
        return seq.test(h, m0, r_end, n0, n0 + BLOCK_N, ids, true);
    }
    // The first tile from n0 on that the block visits (n0 >= n_end(): none). After a hidden tile,
    // skip probes (seq.h) jump over the runs of hidden tiles that follow, 32 mask blocks or a few
    // hundred segment ids at a time, instead of testing them tile by tile.
    __device__ __forceinline__ KeyTile walk(int n0) const {
        while (n0 < n_hi) {
            const TileTest t = key_tile(n0);
            if (t.visit) return {n0, t.mask};
            n0 += BLOCK_N;
            for (int n; n0 < n_hi && (n = seq.skip<true>(h, m0, r_end, n0, n_hi, ids, BLOCK_N)) > n0;) n0 = n;
        }
        return {n_hi, false};
    }
    __device__ __forceinline__ bool tile_mask(KeyTile t) const { return t.mask; }
    __device__ __forceinline__ KeyWalk key_walk() const {
        const KeyTile t = walk(n_lo);
        return {0, t, t, n_hi};
    }
    __device__ __forceinline__ void look_ahead(KeyWalk& w) const { w.nxt = walk(w.cur.n0 + BLOCK_N); }
    __device__ __forceinline__ bool tile_mask(const KeyWalk& w) const { return w.cur.mask; }
    // The call's row (params.h's Strides) of this batch row's query 0 and key 0.
    __device__ __forceinline__ i64 q_row0() const { return seq.q_start; }
    __device__ __forceinline__ i64 k_row0() const { return seq.k_start; }
    // Element offset of (h, row 0) in lse, lse_log2, delta.
    __device__ __forceinline__ i64 stat_base(const FlashParams& p) const {
        return (i64)seq.q_start * p.stat_q_mul + (i64)h * p.stat_h_stride;
    }
    // Which (row, key) pairs of this block's head are visible (mask.h).
    __device__ __forceinline__ Visibility vis() const { return Visibility::of(seq, h); }
    // The head's attention sink in the exp2 domain (-inf: none), the online softmax's start.
    __device__ __forceinline__ float sink2(const FlashParams& p) const { return MODS && p.sinks_log2 ? p.sinks_log2[h] : NEG_INF; }
#else
    __device__ __forceinline__ int n_begin() const { return 0; }
    // Keys [0, n_end()) are visible to some row of the block: n_tiles() tiles of BLOCK_N.
    __device__ __forceinline__ int n_end() const { return key_end(m0, BLOCK_M, Sq, Sk); }
    __device__ __forceinline__ int n_tiles() const { return (n_end() + BLOCK_N - 1) / BLOCK_N; }
    __device__ __forceinline__ KeyTile walk(int n0) const { return {n0}; }
    __device__ __forceinline__ bool tile_mask(KeyTile t) const { return tile_needs_mask(m0, t.n0, BLOCK_N, Sq, Sk); }
    __device__ __forceinline__ KeyWalk key_walk() const { return {0, n_tiles()}; }
    __device__ __forceinline__ void look_ahead(KeyWalk&) const {}
    __device__ __forceinline__ bool tile_mask(const KeyWalk& w) const { return tile_needs_mask(m0, w.n0(), BLOCK_N, Sq, Sk); }
    __device__ __forceinline__ i64 q_row0() const { return (i64)b * Sq; }
    __device__ __forceinline__ i64 k_row0() const { return (i64)b * Sk; }
    __device__ __forceinline__ i64 stat_base(const FlashParams& p) const { return stat_offset(p, b, h); }
    __device__ __forceinline__ Visibility vis() const { return {Sq, Sk}; }
    __device__ __forceinline__ float sink2(const FlashParams&) const { return NEG_INF; }
#endif
    // Element offsets of (row 0, h) in a query-side tensor laid out as st (q, o, do, dq), and of
    // (key 0, hkv) in a key-side one (k, v); rows st.seq apart.
    __device__ __forceinline__ i64 q_at(const Strides& st) const { return row_at(st, b, q_row0(), h); }
    __device__ __forceinline__ i64 kv_at(const Strides& st) const { return row_at(st, b, k_row0(), hkv); }
    // The key tiles the block visits, in order: first_tile(), next_tile(t), ... while t.n0 < n_end().
    __device__ __forceinline__ KeyTile first_tile() const { return walk(n_begin()); }
    __device__ __forceinline__ KeyTile next_tile(KeyTile t) const { return walk(t.n0 + BLOCK_N); }
    // lse_log2 and delta of query row `row` (backward): +inf and 0 past Sq, so that P = 0 there.
    __device__ __forceinline__ void row_stats(const FlashParams& p, int row, float& lse2, float& dlt) const {
        const i64 idx = stat_base(p) + row;
        lse2 = row < Sq ? p.lse_log2[idx] : POS_INF;
        dlt = row < Sq ? p.delta[idx] : 0.f;
    }
};

// A block of a kernel gridded over key tiles (bwd_dkdv): grid (ceil(Sk / BLOCK_N), Hkv, B). It owns
// keys [n0, n0 + BLOCK_N) of kv head hkv of batch b and visits n_iter (query head, query tile)
// pairs: the GQA_GROUP query heads of hkv, and in each the m_tiles query tiles from m_start on,
// with a QueryWalk (or, per head, rows [m_start, m_stop()) tile by tile, asking query_tile);
// MASKED blocks visit only the tiles with a row that sees one of its keys.
struct KeyBlock {
    int b, hkv;          // batch, key/value head
    int n0;              // first key row
    int Sq, Sk;          // query and key sequence lengths (MASKED: this batch row's q_len, k_len)
    i64 accum_stride;    // element distance between rows of dq_accum ([.., H, D], packed)
    int m_first;         // first query tile (index) with a row that sees a key of the block
    int m_start;         // its first row, m_first * BLOCK_M
    int m_tiles;         // query tiles per head from m_first on
    int n_iter;          // m_tiles * GQA_GROUP
#if MASKED
    SeqMask seq;         // this batch row
    IdRange ids;         // segment ids of the block's valid keys
#endif

    __device__ __forceinline__ explicit KeyBlock(const FlashParams& p) : KeyBlock(p, blockIdx.x) {}
    // Key block n_block of kv head hkv, batch b (a kernel that orders its blocks itself).
    __device__ __forceinline__ KeyBlock(const FlashParams& p, int n_block, int kv_head = blockIdx.y, int batch = blockIdx.z) {
        n0 = n_block * BLOCK_N;
        hkv = kv_head;
        b = batch;
#if MASKED
        seq = SeqMask::load(p, b);
        Sq = seq.q_len;
        Sk = seq.k_len;
        m_first = m_tiles = 0;
        ids = {0, 0};
        const int c0 = imax(n0, seq.k_lo), c1 = imin(n0 + BLOCK_N, seq.k_hi);  // the valid keys
        if (c0 < c1) {
            const int r0 = seq.row_lo(c0), r1 = seq.row_hi(c1);
            if (r0 < r1) {
                m_first = r0 / BLOCK_M;
                m_tiles = (r1 + BLOCK_M - 1) / BLOCK_M - m_first;
            }
            if (seq.has_segments()) ids = id_range(seq.seg_k(), c0, c1);
        }
#else
        Sq = p.seqlen_q;
        Sk = p.seqlen_k;
#endif
        accum_stride = (i64)p.heads * HEAD_DIM;
#if !MASKED
        m_first = first_query_tile(n0, BLOCK_M, Sq, Sk) / BLOCK_M;
        const int all_tiles = (Sq + BLOCK_M - 1) / BLOCK_M;
        m_tiles = all_tiles > m_first ? all_tiles - m_first : 0;
#endif
        n_iter = m_tiles * GQA_GROUP;
        m_start = m_first * BLOCK_M;
    }
    // No key of this batch row is in the block (MASKED: the grid covers the longest sequence).
    __device__ __forceinline__ bool empty() const { return MASKED && n0 >= Sk; }
    // Iteration it < n_iter: its query head, and the first row of its query tile.
    __device__ __forceinline__ int head(int it) const { return hkv * GQA_GROUP + it / m_tiles; }
    __device__ __forceinline__ int query_row(int it) const { return (m_first + it % m_tiles) * BLOCK_M; }
    // One past the last query row the block visits in each head.
    __device__ __forceinline__ int m_stop() const { return MASKED ? m_start + m_tiles * BLOCK_M : Sq; }
#if MASKED
    // Visit query rows [m0, m0 + BLOCK_M) of head h, and mask them?
    __device__ __forceinline__ TileTest query_tile(int h, int m0) const {
        return seq.test(h, m0, imin(m0 + BLOCK_M, Sq), n0, n0 + BLOCK_N, ids, false);
    }
    // The first iteration from it on that the block visits (it >= n_iter: none). Tile by tile: the
    // skip probes (next_row) would push the tensor-core dK/dV kernels, at the register limit
    // already, into spills.
    __device__ __forceinline__ QueryTile walk(int it) const {
        for (; it < n_iter; ++it) {
            const TileTest t = query_tile(head(it), query_row(it));
            if (t.visit) return {it, t.mask};
        }
        return {n_iter, false};
    }
    // The first query tile (row) of head h from tile m0 on that skip probes (seq.h) cannot rule out
    // (m_stop(): none): 32 mask blocks or 128 segment ids a probe. For the fp32 dK/dV kernel,
    // which walks each head's tiles itself.
    __device__ __forceinline__ int next_row(int h, int m0) const {
        const int c0 = imax(n0, seq.k_lo), c1 = imin(n0 + BLOCK_N, seq.k_hi);  // the valid keys
        const int row_end = imin(m_stop(), Sq);
        for (int x; m0 < row_end && (x = seq.skip<false, 128>(h, c0, c1, m0, row_end, ids, BLOCK_M)) > m0;) m0 = x;
        return m0 < row_end ? m0 : m_stop();
    }
    __device__ __forceinline__ QueryWalk query_walk() const {
        const QueryTile t = walk(0);
        return {t, t, 0, n_iter};
    }
    __device__ __forceinline__ void look_ahead(QueryWalk& w) const { w.nxt = walk(w.cur.it + 1); }
    // Does the walk's current iteration need the element mask?
    __device__ __forceinline__ bool tile_mask(const QueryWalk& w) const { return w.cur.mask; }
    // The call's row (params.h's Strides) of this batch row's query 0 and key 0.
    __device__ __forceinline__ i64 q_row0() const { return seq.q_start; }
    __device__ __forceinline__ i64 k_row0() const { return seq.k_start; }
    // Element offset of (h, row 0) in lse_log2, delta.
    __device__ __forceinline__ i64 stat_base(const FlashParams& p, int h) const {
        return (i64)seq.q_start * p.stat_q_mul + (i64)h * p.stat_h_stride;
    }
    __device__ __forceinline__ Visibility vis(int h) const { return Visibility::of(seq, h); }
#else
    __device__ __forceinline__ TileTest query_tile(int, int) const { return {true, false}; }
    __device__ __forceinline__ QueryWalk query_walk() const { return {0, n_iter}; }
    __device__ __forceinline__ void look_ahead(QueryWalk&) const {}
    __device__ __forceinline__ i64 q_row0() const { return (i64)b * Sq; }
    __device__ __forceinline__ i64 k_row0() const { return (i64)b * Sk; }
    __device__ __forceinline__ i64 stat_base(const FlashParams& p, int h) const { return stat_offset(p, b, h); }
    __device__ __forceinline__ Visibility vis(int) const { return {Sq, Sk}; }
#endif
    // Element offsets of (key 0, hkv) in a key-side tensor laid out as st (k, v, dk, dv), of (row 0,
    // h) in a query-side one (q, do); rows st.seq apart. And of (row 0, h) in dq_accum (packed,
    // rows accum_stride apart).
    __device__ __forceinline__ i64 kv_at(const Strides& st) const { return row_at(st, b, k_row0(), hkv); }
    __device__ __forceinline__ i64 q_at(const Strides& st, int h) const { return row_at(st, b, q_row0(), h); }
    __device__ __forceinline__ i64 accum_base(const FlashParams& p, int h) const { return (q_row0() * p.heads + h) * HEAD_DIM; }
    // Does warp slice key0 (its 16 keys) need the element mask in the walk's current iteration?
    // Plain kernels refine per slice (only the diagonal's and the ragged end's); MASKED ones take
    // the tile's verdict.
    __device__ __forceinline__ bool slice_mask(const QueryWalk& w, int key0) const {
#if MASKED
        return tile_mask(w);
#else
        return key_slice_needs_mask(key0, query_row(w.it()), Sq, Sk);
#endif
    }
};
#endif
