// seq.h — what the MASKED kernels know of one batch row (mask.rs's coordinates): where its queries
// and keys live, which keys each row sees, and the tile tests that let a block skip hidden tiles
// and mask elements on boundary tiles only.
//
// Batch row b owns query rows [0, q_len) from row q_start of q viewed [rows, H, D], and keys
// [0, k_len) from row k_start of k viewed [rows, Hkv, D]; its valid keys are [k_lo, k_hi). Row i
// sees key j iff
//   max(k_lo, i + diag0 - left) <= j < min(k_hi, i + diag0 + right + 1)   (diag0 = k_hi - q_len:
//   the window around the bottom-right diagonal), and
//   seg_q[i] == seg_k[j] when segment ids are given, and block_mask[i / 128][j / 128] != 0 when a
//   block mask is given.
// A side of the window the caller left unbounded arrives as Sq + Sk, which no row can reach (the
// host keeps Sq + Sk below 2^29, so this int arithmetic cannot overflow).
#pragma once

#define MASK_BLOCK 128  // rows and columns of one block-mask entry (mask.rs's MASK_BLOCK)

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// Minimum and maximum of an int over the warp (every lane takes part).
__device__ __forceinline__ int warp_min(int x) {
    int r;
    asm volatile("redux.sync.min.s32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(x));
    return r;
}
__device__ __forceinline__ int warp_max(int x) {
    int r;
    asm volatile("redux.sync.max.s32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(x));
    return r;
}

// The segment ids of a block's own rows (or keys): their minimum and maximum (lo > hi: none).
struct IdRange {
    int lo, hi;
};

// The id range of ids[i0, i1). Each warp computes it alone, with no barrier (every warp gets the
// same answer), so any thread may call it as long as its whole warp does.
__device__ __forceinline__ IdRange id_range(const int* ids, int i0, int i1) {
    int lo = 0x7fffffff, hi = -0x7fffffff - 1;
    for (int i = i0 + (int)(threadIdx.x % 32); i < i1; i += 32) {
        const int x = ids[i];
        lo = imin(lo, x);
        hi = imax(hi, x);
    }
    return {warp_min(lo), warp_max(hi)};
}

// Whether some id of ids[i0, i1) falls in r (the tile may hold a visible pair: a test by range, so
// it can answer yes for a tile with none), and whether every one equals r's single id (every pair
// matches). Warp-wide like id_range.
struct IdMatch {
    bool any, all;
};
__device__ __forceinline__ IdMatch id_match(const int* ids, int i0, int i1, IdRange r) {
    bool any = false, all = r.lo == r.hi;
    for (int i = i0 + (int)(threadIdx.x % 32); i < i1; i += 32) {
        const int x = ids[i];
        any = any || (x >= r.lo && x <= r.hi);
        all = all && x == r.lo;
    }
    return {__any_sync(0xffffffffu, any) != 0, __all_sync(0xffffffffu, all) != 0};
}

// One batch row: its six numbers from the host's table, the rest read from the params where it is
// used (param reads are free operands, so they take no register across the kernels' loops).
struct SeqMask {
    const FlashParams* p;
    int b;
    int q_start, q_len, k_start, k_len, k_lo, k_hi;

    __device__ __forceinline__ static SeqMask load(const FlashParams& p, int b) {
        const int* s = p.seqs + 6 * b;
        return {&p, b, s[0], s[1], s[2], s[3], s[4], s[5]};
    }
    __device__ __forceinline__ int diag0() const { return k_hi - q_len; }  // row 0's diagonal key
    __device__ __forceinline__ int left() const { return p->win_left; }
    __device__ __forceinline__ int right() const { return p->win_right; }
    // This batch row's segment ids ([q_len], [k_len]; null when none) and its block mask at head h
    // ([Mb, Nb]; null when none).
    __device__ __forceinline__ const int* seg_q() const { return p->seg_q + (i64)b * p->seqlen_q; }
    __device__ __forceinline__ const int* seg_k() const { return p->seg_k + (i64)b * p->seqlen_k; }
    __device__ __forceinline__ const unsigned char* block_mask(int h) const {
        return p->block_mask ? p->block_mask + (i64)b * p->bm_batch_stride + (i64)h * p->bm_head_stride : nullptr;
    }
    __device__ __forceinline__ bool has_segments() const { return p->seg_q != nullptr; }

    // Keys [key_lo(i), key_hi(i)) pass row i's window and padding (none when lo >= hi).
    __device__ __forceinline__ int key_lo(int i) const { return imax(k_lo, diag0() + i - left()); }
    __device__ __forceinline__ int key_hi(int i) const { return imin(k_hi, diag0() + i + right() + 1); }
    // Rows [row_lo(c0), row_hi(c1)) may see some key of [c0, c1) (valid keys; mask.rs's query_range).
    __device__ __forceinline__ int row_lo(int c0) const { return imax(0, c0 - right() - diag0()); }
    __device__ __forceinline__ int row_hi(int c1) const { return imin(q_len, c1 - 1 + left() - diag0() + 1); }

    // Does row i (of head h) see key j? Rows past q_len see nothing: a tile's rows may run past it.
    __device__ __forceinline__ bool sees(int h, int i, int j) const {
        if (i >= q_len || j < key_lo(i) || j >= key_hi(i)) return false;
        if (has_segments() && seg_q()[i] != seg_k()[j]) return false;
        const unsigned char* bm = block_mask(h);
        return !bm || bm[(i64)(i / MASK_BLOCK) * p->bm_cols + j / MASK_BLOCK] != 0;
    }

    // One probe of a skip scan over the other side's tiles, for blocks whose tiles mostly hide
    // (segment ids, block masks). The block's own side is [o0, o1) (query rows when KEYS, else its
    // valid keys) with segment id range `own`; the other side's tiles of `step` start at x0 (keys
    // when KEYS, else query rows of head h), and x_end bounds the scan (<= k_hi, resp. <= q_len).
    // Returns x0 when it cannot rule out tile x0, else x0 + k * step (k >= 1) such that no pair
    // of the block's side with [x0, x0 + k * step) is visible (x_end or past it: none is left).
    // Block mask first: each lane tests one 128-block, a ballot finds the first one that is on
    // among 32; then segment ids: SKIP_IDS ids per warp in one round of independent loads. Every
    // warp computes the same answer (uniform across the block; the whole warp must call it).
    template <bool KEYS, int SKIP_IDS = 256>
    __device__ __forceinline__ int skip(int h, int o0, int o1, int x0, int x_end, IdRange own, int step) const {
        const int lane = (int)(threadIdx.x % 32);
        if (const unsigned char* bm = block_mask(h)) {
            const int base = x0 / MASK_BLOCK, last = (x_end - 1) / MASK_BLOCK, c = base + lane;
            bool on = false;
            if (c <= last)
                for (int o = o0 / MASK_BLOCK; o <= (o1 - 1) / MASK_BLOCK; ++o)
                    on = on || bm[KEYS ? (i64)o * p->bm_cols + c : (i64)c * p->bm_cols + o] != 0;
            const unsigned bits = __ballot_sync(0xffffffffu, on);
            if (!bits && (base + 32) * MASK_BLOCK >= x_end) return x_end;
            const int first = (base + (bits ? __ffs(bits) - 1 : 32)) * MASK_BLOCK;
            const int x = x0 + imax(0, (first - x0) / step) * step;
            if (x > x0) return x;
        }
        if (has_segments()) {
            constexpr int U = SKIP_IDS / 32;
            const int* ids = KEYS ? seg_k() : seg_q();
            const int s0 = imax(x0, KEYS ? k_lo : 0), s1 = imin(x0 + SKIP_IDS, x_end);
            int x[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int j = s0 + 32 * u + lane;
                x[u] = j < s1 ? ids[j] : 0;
            }
            int hit = s1;  // the first id of [s0, s1) in own (s1: none)
#pragma unroll
            for (int u = U - 1; u >= 0; --u) {
                const int j = s0 + 32 * u + lane;
                const unsigned bits = __ballot_sync(0xffffffffu, j < s1 && x[u] >= own.lo && x[u] <= own.hi);
                if (bits) hit = s0 + 32 * u + __ffs(bits) - 1;
            }
            if (hit >= x_end) return x_end;
            return x0 + imax(0, (hit - x0) / step) * step;
        }
        return x0;
    }

    // Rows [r0, r1) (r1 <= q_len) x keys [c0, c1) of head h, by window and padding, then block mask,
    // then segment ids: the block's own side's ids are `own`, the other side's are read here (the
    // keys' when scan_keys). Every warp computes the same verdict (uniform across the block).
    __device__ __forceinline__ TileTest test(int h, int r0, int r1, int c0, int c1, IdRange own,
                                             bool scan_keys) const {
        const int v0 = imax(c0, k_lo), v1 = imin(c1, k_hi);  // the tile's valid keys
        if (r0 >= r1 || v0 >= v1) return {false, false};
        bool inside = key_lo(r1 - 1) <= c0 && c1 <= key_hi(r0);  // the last row's lo, the first's hi
        if (const unsigned char* bm = block_mask(h)) {
            bool any = false, all = true;
            for (int bi = r0 / MASK_BLOCK; bi <= (r1 - 1) / MASK_BLOCK; ++bi)
                for (int bj = v0 / MASK_BLOCK; bj <= (v1 - 1) / MASK_BLOCK; ++bj) {
                    const bool on = bm[(i64)bi * p->bm_cols + bj] != 0;
                    any = any || on;
                    all = all && on;
                }
            if (!any) return {false, false};
            inside = inside && all;
        }
        if (has_segments()) {
            const IdMatch m = scan_keys ? id_match(seg_k(), v0, v1, own) : id_match(seg_q(), r0, r1, own);
            if (!m.any) return {false, false};
            inside = inside && m.all;
        }
        return {true, !inside};
    }
};
