// mask.h — which (query, key) pairs are visible, and the masking of an mma accumulator tile.
#pragma once
#include "params.h"

// A tile's verdict: does the block visit it at all, and if so, does it need the element mask?
struct TileTest {
    bool visit, mask;
};

#if MASKED
#include "seq.h"
#endif

// Causal alignment is bottom-right: query i sees key j iff j <= i + (Sk - Sq).
__device__ __forceinline__ bool visible(int row, int col, int seqlen_q, int seqlen_k) {
    bool ok = col < seqlen_k;
#if IS_CAUSAL
    ok = ok && col <= row + seqlen_k - seqlen_q;
#endif
    return ok;
}

// Which (query row, key) pairs of one head a block may use: a functor, so that every element mask
// below takes plain and MASKED kernels alike. The plain kernels' is `visible` on the lengths;
// the MASKED kernels' asks the batch row's SeqMask (seq.h).
// It also owns the score modifiers (modifiers.rs): `modify` takes a score in the exp2 domain
// (scale * log2(e) * q.k), already masked (-inf stays -inf), and applies the softcap and ALiBi;
// the plain kernels' returns it untouched, which the compiler folds away.
struct Visibility {
#if MASKED
    const SeqMask* seq;
    int h;
#if MODS
    float slope2;  // this (batch row, head)'s ALiBi slope * log2(e); 0 = none
    __device__ __forceinline__ static Visibility of(const SeqMask& s, int h) {
        const FlashParams& p = *s.p;
        return {&s, h, p.alibi_log2 ? p.alibi_log2[(i64)s.b * p.heads + h] : 0.f};
    }
#else
    __device__ __forceinline__ static Visibility of(const SeqMask& s, int h) { return {&s, h}; }
#endif
    __device__ __forceinline__ bool operator()(int row, int col) const { return seq->sees(h, row, col); }
#if MODS
    // Any modifier to apply (uniform across the block)?
    __device__ __forceinline__ bool modifies() const { return seq->p->softcap_log2 > 0.f || slope2 != 0.f; }
    // ALiBi's signed distance row + diag0 - col as a float. The tiled kernels take it once per
    // thread and tile and add each element's constant offset: an int-to-float conversion per
    // score would cost as much as its exp2 (both quarter-rate).
    __device__ __forceinline__ float dist(int row, int col) const { return (float)(row + seq->diag0() - col); }
    // x: the score of (row, col); dcap receives the softcap's derivative 1 - tanh^2 (1 without one),
    // which the backward multiplies into dS.
    __device__ __forceinline__ float modify(float x, int row, int col, float& dcap) const {
        return modify_at(x, dist(row, col), dcap);
    }
    // modify, given the pair's dist().
    __device__ __forceinline__ float modify_at(float x, float d, float& dcap) const {
        dcap = 1.f;
        const float c2 = seq->p->softcap_log2;
        if (c2 > 0.f && x != NEG_INF) {
            // tanh(y), y = x / c2, in a few instructions (the dK/dV kernels have no registers for
            // tanhf): for |y| >= 1/8, 1 - 2 / (1 + e^{2|y|}) with its sign, e^{2|y|} =
            // 2^{2 log2(e) |x| / c2}; below, where that form cancels (an absolute error of ~6e-8
            // that c2 would magnify), the odd series y - y^3/3 + 2y^5/15 - 17y^7/315.
            const float y = x * seq->p->softcap_inv_log2, y2 = y * y;
            const float e = fast_exp2(2.f * LOG2E * fabsf(y));
            const float series = fmaf(fmaf(fmaf(-17.f / 315.f, y2, 2.f / 15.f), y2, -1.f / 3.f), y2 * y, y);
            const float t = fabsf(y) < 0.125f ? series : copysignf(1.f - __fdividef(2.f, 1.f + e), x);
            x = c2 * t;
            dcap = 1.f - t * t;
        }
        return x - slope2 * fabsf(d);
    }
#else
    __device__ __forceinline__ bool modifies() const { return false; }
    __device__ __forceinline__ float modify(float x, int, int, float& dcap) const {
        dcap = 1.f;
        return x;
    }
#endif
#else
    int seqlen_q, seqlen_k;
    __device__ __forceinline__ bool operator()(int row, int col) const { return visible(row, col, seqlen_q, seqlen_k); }
    __device__ __forceinline__ bool modifies() const { return false; }
    __device__ __forceinline__ float modify(float x, int, int, float& dcap) const {
        dcap = 1.f;
        return x;
    }
#endif
};

// Applies vis.modify to a warp's 16 x (8*NT) accumulator tile (mask_tile's layout and KEY_ROWS).
template <int NT, bool KEY_ROWS = false>
__device__ __forceinline__ void modify_tile(float (&s)[NT][4], int row0, int col0, const Visibility& vis) {
#if MODS
    if (!vis.modifies()) return;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // dist(query, key) of element (nt, e) = d0 +- (8 (e / 2) - 8 nt - e % 2)
    const float d0 = KEY_ROWS ? vis.dist(col0 + 2 * t, row0 + g) : vis.dist(row0 + g, col0 + 2 * t);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float off = (float)((e / 2) * 8 - nt * 8 - (e % 2));
            float dcap;
            s[nt][e] = vis.modify_at(s[nt][e], KEY_ROWS ? d0 - off : d0 + off, dcap);
        }
    }
#endif
}

// Sets invisible entries of a warp's 16 x (8*NT) accumulator tile to -inf. row0 is the tile's first
// row, col0 its first column; lane (g, t) holds rows g, g+8 and columns 8*nt + 2t, 2t+1. Rows are
// queries and columns keys, or with KEY_ROWS (the dK/dV kernel's transposed S^T) the other way
// round. Plain kernels: there, queries past Sq need no mask (their lse is +inf, so their probabilities are zero);
// keys past Sk only matter to the atomic dQ, whose dS K must not see exp2(0 - lse) there.
template <int NT, bool KEY_ROWS = false>
__device__ __forceinline__ void mask_tile(float (&s)[NT][4], int row0, int col0, const Visibility& vis) {
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int row = row0 + g + (e / 2) * 8;
            int col = col0 + nt * 8 + 2 * t + (e % 2);
            const bool ok = KEY_ROWS ? vis(col, row) : vis(row, col);
            if (!ok) s[nt][e] = NEG_INF;
        }
    }
}

// Do a warp's 16 key rows from key0 need mask_tile<NT, true> against query tile m0?
__device__ __forceinline__ bool key_slice_needs_mask(int key0, int m0, int seqlen_q, int seqlen_k) {
    bool need = false;
#if ATOMIC_DQ && !EVEN_N
    need = key0 + 16 > seqlen_k;
#endif
#if IS_CAUSAL
    need = need || (key0 + 15 > m0 + seqlen_k - seqlen_q);
#endif
    return need;
}

// Does key tile [n0, n0 + block_n) need masking for query block [m0, ...)? Only the diagonal tiles
// (causal) and the ragged last tile (when Sk is not a multiple of block_n).
__device__ __forceinline__ bool tile_needs_mask(int m0, int n0, int block_n, int seqlen_q,
                                                int seqlen_k) {
    bool need = false;
#if !EVEN_N
    need = n0 + block_n > seqlen_k;
#endif
#if IS_CAUSAL
    need = need || (n0 + block_n - 1 > m0 + seqlen_k - seqlen_q);
#endif
    return need;
}
