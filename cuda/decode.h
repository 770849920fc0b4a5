// decode.h — what the two decode kernels share: decode.cu (tensor cores: fp16 / bf16 at head dims
// 64, 128, 256) and decode_simt.cu (CUDA cores: every dtype, any head dim up to 256). The params,
// a block's work (batch row, kv head, split of the keys, chunk of the query states), the cp.async
// pipeline that brings each K / V / scale tile to shared memory once for every query state of the
// block, and the epilogue that merges the warps' partial states and writes them out. Semantics:
// flash-core's decode.rs (the CPU path) and reference.py's `decode`; host side: cuda/decode.rs.
//
//   q, o            [B, Sq, H, D]            elem_t
//   k, v            [B, S_cache, Hkv, row]   rows of D elem_t, or quantized: D * bits / 32 u32 codes
//                                            (quant.rs's format: x ~ scale * code + bias per group)
//   scales, biases  [B, S_cache, Hkv, D / group_size] elem_t (quantized caches only)
//   lse             [B, H, Sq] f32, natural log; -inf (and o = 0) for a state that sees no key
//   o_part          [splits, B, Sq, H, D] f32, lse_part [splits, B, H, Sq]: with splits > 1 each
//                   split's state, merged by merge.cu (with p.cluster the blocks of a
//                   cluster merge their splits themselves, cluster_merge: no parts)
//
// Row b's valid keys are [leftpad[b], seqlens[b]); query row i sees the valid keys whose index j
// (absolute) lies in [end + i - win_left, end + i + win_right], end = seqlens[b] - Sq (causal: the
// host sets win_right = 0). A query state st = i * G + g is row i of head kvh * G + g (G = H / Hkv):
// a block loads each key once for the STATE_TILE * warp_states states of its chunk.
//
// Defines: FLASH_DTYPE, HEAD_DIM (decode.cu: the head dim; decode_simt.cu: 256, the bound of its
// run-time D), CACHE_BITS (decode.cu only: the caches' bits, 0, 4 or 8), NUM_WARPS, STATE_TILE
// (query states per warp), STAGES (pipeline depth), MIN_BLOCKS (blocks per SM the registers must
// allow; params.h's default 1).
#pragma once
#include "ptx.h"
#include "grid_dep.h"

#ifndef STATE_TILE
#error "STATE_TILE must be defined"
#endif
#ifndef STAGES
#define STAGES 3
#endif

// The caches' bits (0: plain): fixed per kernel where CACHE_BITS is defined (decode.cu: one kernel
// per cache format, which the host picks by p.bits), else read from the params (decode_simt.cu).
#ifdef CACHE_BITS
#define KV_BITS(p) CACHE_BITS
#else
#define KV_BITS(p) ((p).bits)
#endif

// DECODE_TMA: the quantized kernels at D = 128 on Hopper fill their warp-owned stages' K and V rows
// by the tensor copy engine: one box a 16-key block for K and one for V, which one lane of the warp
// issues (a block's rows by cp.async took ~20 warp instructions; the engine filled 4-bit stages
// with no compute in 22 % less time, tools/probe_decode_copy.py, bench/RESULTS.md). The rows land
// dense (DECODE_TMA_ROW bytes: 64 at 4 bits, 128 at 8) with the engine's swizzle of that span
// (row_offset), which keeps the ldmatrix reads free of bank conflicts (decode.cu's lane_unit);
// 80-byte boxes that would have kept the padded rows were no faster than cp.async. The host
// (cuda/decode.rs decode_tma) builds the maps where the kernel is compiled for sm_90+.
#if defined(CACHE_BITS) && (CACHE_BITS == 4 || CACHE_BITS == 8) && HEAD_DIM == 128 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DECODE_TMA 1
#define DECODE_TMA_ROW (HEAD_DIM * CACHE_BITS / 8)
#include "hopper.h"
#else
#define DECODE_TMA 0
#define DECODE_TMA_ROW 0
#endif
// A warp's 16-key blocks of a DECODE_TMA stage (decode.cu sizes the stage to a step's keys, two
// blocks a warp, and checks it).
#if defined(MIN_BLOCKS) && MIN_BLOCKS >= 4 && CACHE_BITS == 8
#define DECODE_TMA_WARP_BLOCKS 1  // four 8-bit blocks an SM: 64-key stages fit the shared memory
#else
#define DECODE_TMA_WARP_BLOCKS 2
#endif

// Where byte o of row r of a stage's K or V rows lies: DECODE_TMA's rows are the copy engine's,
// DECODE_TMA_ROW bytes with its swizzle of that span (16-byte unit o / 16 at unit o / 16 ^ ((r >> 1)
// & 3) in 64-byte rows, ^ (r & 7) in 128-byte ones; the rows' start 1024-byte aligned), so that
// every copy path lays them alike; elsewhere at o.
__device__ __forceinline__ int row_offset(int r, int o) {
#if DECODE_TMA
    const int swizzle = DECODE_TMA_ROW == 64 ? (r >> 1) & 3 : r & 7;
    return (((o >> 4) ^ swizzle) << 4) | (o & 15);
#else
    (void)r;
    return o;
#endif
}

// The host caps unbounded window sides here (and the cache below it), so that index sums fit an int.
#define WINDOW_INF (1 << 30)

// Mirrored field for field by native/flash-core/src/cuda/decode.rs (#[repr(C)]).
struct DecodeParams {
    const elem_t* q;           // [B, Sq, H, D]
    const unsigned char* k;    // [B, S_cache, Hkv, row_bytes]: elem_t rows or u32 codes
    const unsigned char* v;    // as k
    const elem_t* k_scale;     // [B, S_cache, Hkv, D / k_group_size], or null (plain cache)
    const elem_t* k_bias;      // as k_scale
    const elem_t* v_scale;     // [B, S_cache, Hkv, D / v_group_size], or null
    const elem_t* v_bias;      // as v_scale
    const int* seqlens;        // [B], or null: every row holds S_cache keys
    const int* leftpad;        // [B], or null: 0
    elem_t* o;                 // [B, Sq, H, D] (splits == 1)
    float* lse;                // [B, H, Sq] (splits == 1)
    float* o_part;             // [splits, B, Sq, H, D] (splits > 1)
    float* lse_part;           // [splits, B, H, Sq] (splits > 1)
    int batch;                 // B
    int seq_q;                 // Sq (1..16)
    int heads;                 // H
    int kv_heads;              // Hkv
    int head_dim;              // D
    int s_cache;               // S_cache (< WINDOW_INF)
    int group;                 // G = H / Hkv
    int states;                // G * Sq
    int splits;                // splits of each row's visible keys
    int chunks;                // state chunks per (b, kv head): grid.x = Hkv * chunks * splits
    int warp_states;           // WS: warps over state tiles (a power of 2 dividing NUM_WARPS); the
                               // NUM_WARPS / WS warps of a state tile split the keys
    int bits;                  // 0: plain caches; 4 or 8: both quantized
    int k_group_size;          // elements per scale of k (quantized)
    int v_group_size;          // of v
    int row_bytes;             // bytes of one k or v row in global memory
    int win_left;              // window sides, capped at WINDOW_INF (causal: win_right = 0)
    int win_right;
    float scale_log2;          // scale * log2(e) (no softcap)
    float cap_in;              // softcap: scale / softcap (0: none)
    float cap_out;             // softcap * log2(e)
    int cluster;               // 1: the splits of a (b, kv head, chunk) are one thread-block cluster
                               // (grid x split-fastest) that merges them itself (cluster_merge)
    int pad;
};
static_assert(sizeof(DecodeParams) == 13 * 8 + 22 * 4, "decode.rs mirrors this layout");

#if DECODE_TMA
// The kernel's parameter where DECODE_TMA: the K and V codes as 2-d u8 tensors [B * S_cache rows,
// x0 + Hkv * row_bytes] (x0: the bytes the map's base lies below the cache's, which must be 16-byte
// aligned), boxes of DECODE_TMA_ROW bytes x 16 rows, swizzled. Mirrored by decode.rs (DecodeTmaParams).
struct DecodeTmaParams {
    TensorMap k, v;
    DecodeParams p;
    int k_x0, v_x0;
};
#endif

// Scale groups per row of k and of v (0: plain caches): constants in a kernel built per pair of
// group sizes (decode.cu's quantized kernels: K_GROUP, V_GROUP), so that its stage layout, scale
// offsets and copies fold to immediates instead of being recomputed per stage.
#if defined(K_GROUP) && defined(V_GROUP)
__device__ __forceinline__ int groups_k(const DecodeParams&) { return HEAD_DIM / K_GROUP; }
__device__ __forceinline__ int groups_v(const DecodeParams&) { return HEAD_DIM / V_GROUP; }
#else
__device__ __forceinline__ int groups_k(const DecodeParams& p) { return KV_BITS(p) ? p.head_dim / p.k_group_size : 0; }
__device__ __forceinline__ int groups_v(const DecodeParams& p) { return KV_BITS(p) ? p.head_dim / p.v_group_size : 0; }
#endif

// ---- a block's work ------------------------------------------------------------------------------
// blockIdx.x = kvh + Hkv * (chunk + chunks * split) (the kv heads of one split side by side: they
// share the scale rows' sectors in L2), or with p.cluster split + splits * (kvh + Hkv * chunk) (a
// cluster's blocks are consecutive); blockIdx.y = b.
struct DecodeWork {
    int b, kvh, split, chunk;
    int ws, wk;       // this warp's state slot and key lane (warp = wk * WS + ws)
    int state0;       // first state of this warp's tile (may be >= states: an idle warp)
    int end;          // seqlens[b] - Sq: row i's causal end is end + i
    int k0, k1;       // this split's keys, absolute: [k0, k1)
    i64 row0;         // cache row index of key 0 of (b, kvh): rows of key j are row0 + j * Hkv

    __device__ __forceinline__ explicit DecodeWork(const DecodeParams& p) {
        if (p.cluster) {
            split = blockIdx.x % p.splits;
            const int rest = blockIdx.x / p.splits;
            kvh = rest % p.kv_heads;
            chunk = rest / p.kv_heads;
        } else {
            kvh = blockIdx.x % p.kv_heads;
            const int rest = blockIdx.x / p.kv_heads;
            chunk = rest % p.chunks;
            split = rest / p.chunks;
        }
        b = blockIdx.y;
        const int warp = threadIdx.x / 32;
        ws = warp % p.warp_states;
        wk = warp / p.warp_states;
        state0 = (chunk * p.warp_states + ws) * STATE_TILE;
        // Out-of-range lengths (the host checks them) still read nothing outside the cache.
        const int hi = p.seqlens ? min(max(p.seqlens[b], 0), p.s_cache) : p.s_cache;
        const int lo = p.leftpad ? min(max(p.leftpad[b], 0), hi) : 0;
        end = hi - p.seq_q;
        // The keys some row sees: [end - win_left, end + Sq - 1 + win_right] within [lo, hi).
        const int vlo = max(lo, end - p.win_left);
        const int vhi = min(hi, end + p.seq_q + p.win_right);
        const i64 len = max(vhi - vlo, 0);
        k0 = vlo + (int)(len * split / p.splits);
        k1 = vlo + (int)(len * (split + 1) / p.splits);
        row0 = (i64)b * p.s_cache * p.kv_heads + kvh;
    }

    // Query row of state st (states past the last are clamped: their results are never stored).
    __device__ __forceinline__ int row_of(const DecodeParams& p, int st) const { return min(st, p.states - 1) / p.group; }
};

// Row i's visible keys [lo, hi] (inclusive, absolute).
__device__ __forceinline__ int2 visible_keys(const DecodeParams& p, const DecodeWork& w, int i) {
    return make_int2(w.end + i - p.win_left, w.end + i + p.win_right);
}

// The score of q.k in the exp2 domain: scale, then the softcap c * tanh(s / c).
__device__ __forceinline__ float capped_log2(const DecodeParams& p, float qk) { return p.cap_out * tanhf(qk * p.cap_in); }
__device__ __forceinline__ float score_log2(const DecodeParams& p, float qk) {
    return p.cap_in > 0.f ? capped_log2(p, qk) : qk * p.scale_log2;
}
// score_log2 of N scores in place, the softcap test taken once (one uniform branch, not one per score).
template <int N>
__device__ __forceinline__ void scores_log2(const DecodeParams& p, float (&x)[N]) {
    if (p.cap_in > 0.f) {
#pragma unroll
        for (int i = 0; i < N; ++i) x[i] = capped_log2(p, x[i]);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) x[i] *= p.scale_log2;
    }
}

// ---- the shared-memory pipeline ------------------------------------------------------------------
// A stage holds tile_keys consecutive keys: K rows [tile_keys][srow_k] bytes, V rows
// [tile_keys][srow_v], then for quantized caches the k_scale, k_bias, v_scale, v_bias rows
// [tile_keys][sw_k or sw_v] 4-byte words. Every offset is a multiple of 16. Keys past the split's
// end are zero-filled.
struct StageLayout {
    int srow_k, srow_v;   // bytes between rows (the kernel's padding against bank conflicts)
    int sw_k, sw_v;       // 4-byte words per scale row (0: plain)
    int tile_keys;        // a multiple of key_round
    int off_v, off_ks, off_kb, off_vs, off_vb, bytes;
};

// Words that hold a row of `groups` scales (see copy_scales): 16-bit scales, an even count starts
// every row on a word (the tensor is 4-byte aligned); an odd one from any 2-byte boundary.
__host__ __device__ constexpr int scale_words(int groups) {
    return sizeof(elem_t) == 4 ? groups : groups % 2 == 0 ? groups / 2 : (2 * groups + 5) / 4;
}

__host__ __device__ constexpr int round16(int x) { return (x + 15) & ~15; }

// The layout of a stage of at most `budget` bytes for rows padded to srow_k / srow_v and scale rows
// of sw_k / sw_v words (0: a plain cache). Constant where its arguments are (decode.cu sizes its
// shared memory by it).
__host__ __device__ constexpr StageLayout layout_of(int srow_k, int srow_v, int sw_k, int sw_v, int budget, int key_round) {
    StageLayout L{};
    L.srow_k = srow_k;
    L.srow_v = srow_v;
    L.sw_k = sw_k;
    L.sw_v = sw_v;
    // Per key, with 16 bytes of slack per scale array for the rounding of its offset.
    const int per_key = srow_k + srow_v + 8 * (sw_k + sw_v);
    const int slack = sw_k + sw_v ? 4 * 16 : 0;
    const int blocks = (budget - slack) / per_key / key_round;
    L.tile_keys = (blocks > 1 ? blocks : 1) * key_round;
    const int n = L.tile_keys;
    L.off_v = n * srow_k;
    L.off_ks = round16(L.off_v + n * srow_v);
    L.off_kb = round16(L.off_ks + n * 4 * sw_k);
    L.off_vs = round16(L.off_kb + n * 4 * sw_k);
    L.off_vb = round16(L.off_vs + n * 4 * sw_v);
    L.bytes = round16(L.off_vb + n * 4 * sw_v);
#if DECODE_TMA
    // Every stage's rows 1024-byte aligned, as the copy engine's swizzle needs (row_offset): 32-key
    // 8-bit stages (8704 bytes) are not by themselves.
    L.bytes = (L.bytes + 1023) / 1024 * 1024;
#endif
    return L;
}

__device__ __forceinline__ StageLayout stage_layout(const DecodeParams& p, int srow_k, int srow_v, int budget,
                                                    int key_round) {
    return layout_of(srow_k, srow_v, scale_words(groups_k(p)), scale_words(groups_v(p)), budget, key_round);
}

// The caches' rows are read once: their copies ask L2 to evict them first (DECODE_STREAM_HINT: the
// copy engine's boxes, FastCopy's and WarpCopy's 16-byte copies; load_stage's copy_unit, for f32
// caches and rows not 16-byte aligned, not measured, keeps plain ones), so that what is read again
// — q, the code, the splits' parts — stays. Not the scale and bias words (the 4-byte copies below):
// a 32-byte sector of them holds every kv head's words of a key, which the other heads' blocks read
// from L2 soon after (evicted first, 8-bit 8 x 8192 took 41.1 us instead of 38.7, bench/RESULTS.md
// session 58).
#ifndef DECODE_STREAM_HINT
#define DECODE_STREAM_HINT 1
#endif
__device__ __forceinline__ unsigned long long stream_policy() {
    unsigned long long pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}

// cp.async of 8 and 4 bytes (through L1; 16 bytes is ptx.h's cp_async16). When !valid the bytes
// are zero-filled and src is not read.
__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool valid) {
    int n = valid ? 8 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async4_u32(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) { cp_async4_u32(smem_addr(dst), src, valid); }
// Unpredicated: every byte read (no source-size operand).
__device__ __forceinline__ void cp_async4_u32_all(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void stream_cp_async16_u32_all(u32 dst, const void* src) {
#if DECODE_STREAM_HINT
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, 16, %2;" ::"r"(dst), "l"(src), "l"(stream_policy()));
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
#endif
}
// ptx.h's cp_async16_u32 with the stream's hint.
__device__ __forceinline__ void stream_cp_async16_u32(u32 dst, const void* src, bool valid) {
#if DECODE_STREAM_HINT
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0), "l"(stream_policy()));
#else
    cp_async16_u32(dst, src, valid);
#endif
}

// Copies `unit` bytes (16, 8 or 4: cp.async; 2: a plain load and store, for rows whose size or
// address allows nothing wider).
__device__ __forceinline__ void copy_unit(unsigned char* dst, const unsigned char* src, int unit, bool valid) {
    if (unit == 16) {
        cp_async16(dst, src, valid);
    } else if (unit == 8) {
        cp_async8(dst, src, valid);
    } else if (unit == 4) {
        cp_async4(dst, src, valid);
    } else {
        *reinterpret_cast<u16*>(dst) = valid ? *reinterpret_cast<const u16*>(src) : (u16)0;
    }
}

// Which rows and chunks of a stage's rows this thread copies: chunk c0, c0 + cstep, ... of rows
// r0, r0 + rstep, ... (one division per kernel, none per copy).
struct CopyMap {
    int r0, rstep, c0, cstep, chunks;
    __device__ __forceinline__ CopyMap(int row_bytes, int unit) {
        chunks = row_bytes / unit;
        const int tpr = min(chunks, NUM_THREADS);  // threads per row
        rstep = NUM_THREADS / tpr;
        r0 = threadIdx.x / tpr;
        c0 = threadIdx.x % tpr;
        cstep = tpr;
        if (r0 >= rstep) r0 = 1 << 30;  // a thread past the last whole row copies nothing
    }
};

// The widest copy unit that divides the rows and both caches' addresses.
__device__ __forceinline__ int copy_unit_bytes(const DecodeParams& p) {
    const unsigned long long a = (unsigned long long)p.k | (unsigned long long)p.v | (unsigned long long)p.row_bytes;
    return (a & 15) == 0 ? 16 : (a & 7) == 0 ? 8 : (a & 3) == 0 ? 4 : 2;
}

// Rows of keys [key0, key0 + nrows) of one (b, kv head) of a cache into dst; keys >= key_end are
// zero-filled.
__device__ __forceinline__ void copy_rows(unsigned char* dst, int srow, const unsigned char* cache, const DecodeParams& p,
                                          const DecodeWork& w, int key0, int key_end, int nrows, const CopyMap& m,
                                          int unit) {
    for (int r = m.r0; r < nrows; r += m.rstep) {
        const bool valid = key0 + r < key_end;
        const unsigned char* src = valid ? cache + (w.row0 + (i64)(key0 + r) * p.kv_heads) * p.row_bytes : cache;
        for (int c = m.c0; c < m.chunks; c += m.cstep) copy_unit(dst + r * srow + row_offset(r, c * unit), valid ? src + c * unit : cache, unit, valid);
    }
}

// The scale (or bias) rows of keys [key0, key0 + nrows): the `groups` elements of row r start at
// element e = (row0 + (key0 + r) * Hkv) * groups of the tensor; the sw words from the one holding
// element e are copied (4-byte cp.async: the host checks the tensor is 4-byte aligned), so element g
// of the row sits at ScaleOffset + g of the copied words. A word that would cross the tensor's
// end gets its first half by a plain load; keys >= key_end are zero. m: CopyMap(4 * sw, 4).
__device__ __forceinline__ void copy_scales(u32* dst, int sw, const elem_t* tensor, int groups, const DecodeParams& p,
                                            const DecodeWork& w, int key0, int key_end, int nrows, const CopyMap& m) {
    const unsigned char* base = reinterpret_cast<const unsigned char*>(tensor);
    const i64 end_bytes = (i64)p.batch * p.s_cache * p.kv_heads * groups * (i64)sizeof(elem_t);
    for (int r = m.r0; r < nrows; r += m.rstep) {
        const bool valid = key0 + r < key_end;
        const i64 first = ((w.row0 + (i64)(key0 + r) * p.kv_heads) * groups * (i64)sizeof(elem_t)) & ~(i64)3;
        for (int word = m.c0; word < sw; word += m.cstep) {
            const i64 at = first + 4 * word;
            u32* d = dst + r * sw + word;
            if (!valid || at + 4 <= end_bytes) {
                cp_async4(d, valid ? base + at : base, valid);
            } else {
                *d = at + 2 <= end_bytes ? (u32) * reinterpret_cast<const u16*>(base + at) : 0u;
            }
        }
    }
}

// Where key j's scale row starts in its copied words, in elements: 16-bit scales, the parity of its
// first element (row0 + j * Hkv) * groups (copy_scales copies from the word holding it); f32, 0.
// Element g of the row is at offset(j) + g.
struct ScaleOffset {
    int base, step;  // offset(j) = base ^ (j & step)
    __device__ __forceinline__ ScaleOffset(const DecodeParams& p, const DecodeWork& w, int groups) {
        const int odd = sizeof(elem_t) == 2 ? groups & 1 : 0;
        base = (int)(w.row0 & odd);
        step = p.kv_heads & odd;
    }
    __device__ __forceinline__ int operator()(int key) const { return base ^ (key & step); }
};

// How this thread copies a stage: the rows' unit, and its share of rows and scale words.
struct StageCopy {
    int unit;
    CopyMap rows, scales_k, scales_v;
    __device__ __forceinline__ StageCopy(const DecodeParams& p, const StageLayout& L, int unit_)
        : unit(unit_), rows(p.row_bytes, unit_), scales_k(4 * max(L.sw_k, 1), 4), scales_v(4 * max(L.sw_v, 1), 4) {}
};

// The common case in few instructions per copy: rows of whole 16-byte chunks, scale rows at one
// offset within their first word (copy_scales' words), power-of-2 counts of chunks and of scale
// words per row, and a batch row's cache within 4 GiB. Sources are block-uniform 64-bit addresses
// of key 0 of (b, kv head) plus u32 byte offsets per key; a thread copies chunk c of rows r,
// r + step, ... of K and V (one offset for both), and word c of the scale rows of its rows (one
// offset for a scale and its bias). Everything but `ok` is derived per stage from the params (no
// registers held across the block loop). Other calls take load_stage's general copies.
static_assert((NUM_THREADS & (NUM_THREADS - 1)) == 0, "FastCopy shares rows by shifts");
struct FastCopy {
    bool ok;

    __device__ __forceinline__ FastCopy(const DecodeParams& p, const StageLayout& L) {
        // Every key's scale row starts at the same offset within a word (ScaleOffset's parity fixed).
        const bool words = sizeof(elem_t) == 4 || (groups_k(p) % 2 == 0 && groups_v(p) % 2 == 0) || p.kv_heads % 2 == 0;
        const bool pow2 = is_pow2(p.row_bytes / 16) && is_pow2(max(L.sw_k, 1)) && is_pow2(max(L.sw_v, 1));
        ok = copy_unit_bytes(p) == 16 && words && pow2 && (i64)p.s_cache * p.kv_heads * p.row_bytes <= 0xffffffffll;
    }
    __device__ __forceinline__ static bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

    // This thread's first row, row step and unit of rows of `units` units (a power of 2, as is
    // NUM_THREADS: shifts, no divisions, and every thread has a row).
    __device__ __forceinline__ static int3 share(int units) {
        const int lg = __ffs(min(units, NUM_THREADS)) - 1;  // log2 of the threads per row
        return make_int3(threadIdx.x >> lg, NUM_THREADS >> lg, threadIdx.x & ((1 << lg) - 1));
    }

    // The sources of a pair of arrays a stage copies alike: K and V rows (key j's unit z at 16 z + j
    // stride from key 0's row), or scale and bias rows (key j's word c at 4 c + j stride from the
    // word holding key 0's first element). u32 offsets: a batch row's cache is within 4 GiB (ok).
    struct Src {
        const unsigned char *a, *b;
        u32 stride;
        // Byte `off` of key key0 + r's row into da (from a) and db (from b), BYTES of each; keys >=
        // key_end zero-filled (their source: key 0's row, never read).
        template <int BYTES>
        __device__ __forceinline__ void copy(u32 da, u32 db, int key0, int key_end, int r, u32 off) const {
            const bool valid = key0 + r < key_end;
            const u32 at = valid ? (u32)(key0 + r) * stride + off : 0u;
            copy_bytes<BYTES>(da, a + at, valid);
            copy_bytes<BYTES>(db, b + at, valid);
        }
        // The same from one of them (b if second) into d.
        template <int BYTES>
        __device__ __forceinline__ void copy_one(u32 d, bool second, int key0, int key_end, int r, u32 off) const {
            const bool valid = key0 + r < key_end;
            const u32 at = valid ? (u32)(key0 + r) * stride + off : 0u;
            copy_bytes<BYTES>(d, (second ? b : a) + at, valid);
        }
        template <int BYTES>
        __device__ __forceinline__ static void copy_bytes(u32 d, const void* src, bool valid) {
            if constexpr (BYTES == 16) stream_cp_async16_u32(d, src, valid);
            else cp_async4_u32(d, src, valid);
        }
    };
    __device__ __forceinline__ static Src rows(const DecodeParams& p, const DecodeWork& w) {
        return {p.k + w.row0 * p.row_bytes, p.v + w.row0 * p.row_bytes, (u32)(p.kv_heads * p.row_bytes)};
    }
    __device__ __forceinline__ static Src scale_rows(const elem_t* s, const elem_t* b, int groups, const DecodeParams& p,
                                                     const DecodeWork& w) {
        const i64 first = (w.row0 * groups * (i64)sizeof(elem_t)) & ~(i64)3;
        return {reinterpret_cast<const unsigned char*>(s) + first, reinterpret_cast<const unsigned char*>(b) + first,
                (u32)(p.kv_heads * groups * (int)sizeof(elem_t))};
    }

    // Scale and bias rows (sw words each, `groups` elements) of the stage.
    __device__ __forceinline__ static void scales(u32 ds, u32 db, const elem_t* s, const elem_t* b, int groups, int sw,
                                                  const DecodeParams& p, const DecodeWork& w, int key0, int key_end, int n) {
        const int3 t = share(sw);
        const Src src = scale_rows(s, b, groups, p, w);
        // Unrolled: a copy's address registers are read after it issues, so a loop that reuses
        // them waits on each copy (long-scoreboard stalls at the loop's branch, ncu).
#pragma unroll 4
        for (int r = t.x; r < n; r += t.y) {
            const u32 d = 4 * (r * sw + t.z);
            src.copy<4>(ds + d, db + d, key0, key_end, r, 4 * t.z);
        }
    }

    // The stage at shared address `stage` holding keys [key0, key0 + tile_keys).
    __device__ __forceinline__ static void load(u32 stage, const StageLayout& L, const DecodeParams& p, const DecodeWork& w,
                                                int key0, int key_end) {
        const int n = L.tile_keys;
        const int3 t = share(p.row_bytes / 16);
        const Src src = rows(p, w);
#pragma unroll 4  // as scales'
        for (int r = t.x; r < n; r += t.y) {
            src.copy<16>(stage + r * L.srow_k + row_offset(r, 16 * t.z), stage + L.off_v + r * L.srow_v + row_offset(r, 16 * t.z), key0, key_end, r, 16 * t.z);
        }
        if (KV_BITS(p)) {
            scales(stage + L.off_ks, stage + L.off_kb, p.k_scale, p.k_bias, groups_k(p), L.sw_k, p, w, key0, key_end, n);
            scales(stage + L.off_vs, stage + L.off_vb, p.v_scale, p.v_bias, groups_v(p), L.sw_v, p, w, key0, key_end, n);
        }
    }

    // A warp's own share of the stage when it alone reads its blocks (WS = 1): blocks wk, wk +
    // NUM_WARPS, ... of ROWS rows each, and their scale words. The stage's regions are then written
    // and read by one warp only, so a __syncwarp stands for the block's barrier and the warps'
    // pipelines run apart (no warp waits for the slowest at every stage).
    template <int ROWS>
    __device__ __forceinline__ static void load_warp(u32 stage, const StageLayout& L, const DecodeParams& p, const DecodeWork& w,
                                                     int key0, int key_end) {
        const int lane = threadIdx.x % 32, units = p.row_bytes / 16;  // a power of 2, at most 32 (ok)
        const int lg = __ffs(units) - 1;
        const int i0 = lane >> lg, z = lane & (units - 1), pass = 32 >> lg;  // rows i0, i0 + pass, ... of a block
        const Src src = rows(p, w);
        const Src k_scales = scale_rows(p.k_scale, p.k_bias, groups_k(p), p, w);
        const Src v_scales = scale_rows(p.v_scale, p.v_bias, groups_v(p), p, w);
        for (int rb = w.wk * ROWS; rb < L.tile_keys; rb += NUM_WARPS * ROWS) {
#pragma unroll 4
            for (int i = i0; i < ROWS; i += pass) {
                const int r = rb + i;
                src.copy<16>(stage + r * L.srow_k + row_offset(r, 16 * z), stage + L.off_v + r * L.srow_v + row_offset(r, 16 * z), key0, key_end, r, 16 * z);
            }
            if (KV_BITS(p)) {
                scales_warp<ROWS>(stage + L.off_ks, stage + L.off_kb, k_scales, L.sw_k, key0, key_end, rb);
                scales_warp<ROWS>(stage + L.off_vs, stage + L.off_vb, v_scales, L.sw_v, key0, key_end, rb);
            }
        }
    }

    // The scale and bias words (sw a row) of rows rb .. rb + ROWS - 1: lane e takes word e % sw of row
    // (e / sw) % ROWS of the scales (e < ROWS sw) or the biases.
    template <int ROWS>
    __device__ __forceinline__ static void scales_warp(u32 ds, u32 db, const Src& src, int sw, int key0, int key_end, int rb) {
        for (int e = threadIdx.x % 32; e < 2 * ROWS * sw; e += 32) {
            const bool bias = e >= ROWS * sw;
            const int k = bias ? e - ROWS * sw : e;
            const int r = rb + k / sw, c = k % sw;
            src.copy_one<4>((bias ? db : ds) + 4 * (r * sw + c), bias, key0, key_end, r, 4 * c);
        }
    }
};

// A type picked at compile time (no <type_traits> under NVRTC), and pipeline's stand-in for
// WarpCopy where there is none.
template <bool C, typename A, typename B>
struct Pick {
    using type = A;
};
template <typename A, typename B>
struct Pick<false, A, B> {
    using type = B;
};
struct NoCopy {
    enum : int { TABLE_BYTES = 0 };
    __device__ __forceinline__ NoCopy(unsigned char*, const DecodeParams&, const DecodeWork&) {}
    __device__ __forceinline__ void load(u32, const StageLayout&, const DecodeWork&, int, int) const {}
};

#if defined(CACHE_BITS) && defined(K_GROUP) && defined(V_GROUP)
// FastCopy::load_warp for a quantized kernel, whose rows and scale rows have sizes fixed at compile
// time. Each lane's sources at key 0 are found once per call and kept in shared memory (a table
// of 64-bit pointers only that lane reads: no barrier), so that a block's copy is a table load, a
// 32-bit offset added to the pointer and the cp.async. load_warp rebuilt every address from the
// parameters: ~80 instructions a 16-key block at 4 bits, 28 % of the kernel's stall samples (ncu,
// bench/RESULTS.md); registers would not hold the pointers (ptxas rebuilt them). A block wholly
// inside the keys takes its copies unpredicated. ROWS rows a block; where pipeline's `own` holds.
template <int ROWS>
struct WarpCopy {
    template <int GROUPS>
    struct ScaleRows {
        enum : int {
            SW = scale_words(GROUPS),
            COPIES = 2 * ROWS * SW / 32,  // a lane's words of a block's scale and bias rows
        };
        static_assert(2 * ROWS * SW % 32 == 0, "every lane copies as many scale words");
        // Lane `lane`'s copy j: a bias word or a scale one, and its word k of the block's rows
        // (row k / SW, word k % SW), as FastCopy::scales_warp orders them.
        __device__ __forceinline__ static int2 entry(int lane, int j) {
            const int e = lane + 32 * j, bias = e >= ROWS * SW;
            return make_int2(bias, bias ? e - ROWS * SW : e);
        }
    };
    using KS = ScaleRows<HEAD_DIM / K_GROUP>;
    using VS = ScaleRows<HEAD_DIM / V_GROUP>;
    enum : int {
        ROW_BYTES = HEAD_DIM * CACHE_BITS / 8,
        UNITS = ROW_BYTES / 16,  // 16-byte units of a row
        PASS = 32 / UNITS,       // rows one pass of the warp copies
        ROW_COPIES = ROWS / PASS,
        TABLE_ROWS = DECODE_TMA ? 0 : ROW_COPIES,  // DECODE_TMA: the rows come by boxes
        // The table, per warp: TABLE_ROWS pairs (K, V) of row pointers, then KS::COPIES k and
        // VS::COPIES v scale pointers, each entry for all 32 lanes side by side.
        TABLE_WARP_BYTES = 32 * (16 * TABLE_ROWS + 8 * (KS::COPIES + VS::COPIES)),
        TABLE_BYTES = NUM_WARPS * TABLE_WARP_BYTES,
    };

    unsigned char* table;  // this lane's first entry
    u32 stride, k_stride, v_stride;  // bytes between keys: rows, k and v scale rows

    __device__ __forceinline__ WarpCopy(unsigned char* table_base, const DecodeParams& p, const DecodeWork& w) {
        const int lane = threadIdx.x % 32, z = lane % UNITS, i0 = lane / UNITS;
        const int warp = threadIdx.x / 32;
        table = table_base + warp * TABLE_WARP_BYTES;
        const FastCopy::Src rows = FastCopy::rows(p, w);
        const FastCopy::Src ks = FastCopy::scale_rows(p.k_scale, p.k_bias, HEAD_DIM / K_GROUP, p, w);
        const FastCopy::Src vs = FastCopy::scale_rows(p.v_scale, p.v_bias, HEAD_DIM / V_GROUP, p, w);
        stride = rows.stride, k_stride = ks.stride, v_stride = vs.stride;
        unsigned char* t = table + 16 * lane;
#pragma unroll
        for (int i = 0; i < TABLE_ROWS; ++i) {
            const u32 off = (u32)(i0 + i * PASS) * stride + 16 * z;
            ulonglong2 e;
            e.x = reinterpret_cast<unsigned long long>(rows.a + off);
            e.y = reinterpret_cast<unsigned long long>(rows.b + off);
            *reinterpret_cast<ulonglong2*>(t + 32 * 16 * i) = e;
        }
        fill_scales<KS>(table + 32 * 16 * TABLE_ROWS, ks);
        fill_scales<VS>(table + 32 * (16 * TABLE_ROWS + 8 * KS::COPIES), vs);
    }
    template <typename S>
    __device__ __forceinline__ void fill_scales(unsigned char* t, const FastCopy::Src& src) const {
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int j = 0; j < S::COPIES; ++j) {
            const int2 bk = S::entry(lane, j);
            const int k = bk.y;
            const unsigned char* a = (bk.x ? src.b : src.a) + (u32)(k / S::SW) * src.stride + 4 * (k % S::SW);
            *reinterpret_cast<unsigned long long*>(t + 8 * (lane + 32 * j)) = reinterpret_cast<unsigned long long>(a);
        }
    }

    // The lane's table entries, read once per stage: used at once, an entry waited for its load
    // (short scoreboard), and address registers reused at once waited for the copy to read them
    // (long scoreboard; ncu).
    struct Entries {
        ulonglong2 rows[TABLE_ROWS ? TABLE_ROWS : 1];  // K, V
        unsigned long long ks[KS::COPIES], vs[VS::COPIES];
    };
    __device__ __forceinline__ Entries entries() const {
        const int lane = threadIdx.x % 32;
        Entries e;
#pragma unroll
        for (int i = 0; i < TABLE_ROWS; ++i) e.rows[i] = *reinterpret_cast<const ulonglong2*>(table + 16 * (lane + 32 * i));
        const unsigned char* ks = table + 32 * 16 * TABLE_ROWS;
        const unsigned char* vs = ks + 32 * 8 * KS::COPIES;
#pragma unroll
        for (int j = 0; j < KS::COPIES; ++j) e.ks[j] = *reinterpret_cast<const unsigned long long*>(ks + 8 * (lane + 32 * j));
#pragma unroll
        for (int j = 0; j < VS::COPIES; ++j) e.vs[j] = *reinterpret_cast<const unsigned long long*>(vs + 8 * (lane + 32 * j));
        return e;
    }

    // This warp's blocks of the stage at shared address `stage` holding keys [key0, key0 +
    // tile_keys) (keys from key_end on zero-filled): blocks wk, wk + NUM_WARPS, ... (as
    // FastCopy::load_warp).
    __device__ __forceinline__ void load(u32 stage, const StageLayout& L, const DecodeWork& w, int key0, int key_end) const {
        const Entries e = entries();
#if DECODE_TMA
        // The copy engine's stages hold DECODE_TMA_WARP_BLOCKS blocks a warp (decode.cu checks the
        // layout): a stage wholly inside the keys (all but a split's last) takes them unrolled and
        // unpredicated, one test a stage (the loop below cost ~75 instructions a stage, ncu).
        if (key_end - key0 >= L.tile_keys) {
#pragma unroll
            for (int j = 0; j < DECODE_TMA_WARP_BLOCKS; ++j) block<true>(e, stage, L, key0, (w.wk + j * NUM_WARPS) * ROWS, ROWS);
            return;
        }
#endif
        for (int r0 = w.wk * ROWS; r0 < L.tile_keys; r0 += NUM_WARPS * ROWS) {
            const int valid = key_end - key0 - r0;  // rows of the block inside the keys
            if (valid >= ROWS) {
                block<true>(e, stage, L, key0, r0, valid);
            } else {
                block<false>(e, stage, L, key0, r0, valid);
            }
        }
    }

    template <bool FULL>
    __device__ __forceinline__ void block(const Entries& e, u32 stage, const StageLayout& L, int key0, int r0, int valid) const {
        const int lane = threadIdx.x % 32, z = lane % UNITS, i0 = lane / UNITS;
        const u32 at = (u32)(key0 + r0) * stride;
#pragma unroll
        for (int i = 0; i < TABLE_ROWS; ++i) {
            const unsigned char* k = reinterpret_cast<const unsigned char*>(e.rows[i].x);
            const unsigned char* v = reinterpret_cast<const unsigned char*>(e.rows[i].y);
            const int r = r0 + i0 + i * PASS;
            const u32 dk = stage + r * L.srow_k + row_offset(r, 16 * z), dv = stage + L.off_v + r * L.srow_v + row_offset(r, 16 * z);
            if (FULL) {
                stream_cp_async16_u32_all(dk, k + at);
                stream_cp_async16_u32_all(dv, v + at);
            } else {
                const bool ok = i0 + i * PASS < valid;
                stream_cp_async16_u32(dk, ok ? k + at : k, ok);
                stream_cp_async16_u32(dv, ok ? v + at : v, ok);
            }
        }
        scales<KS, FULL>(e.ks, stage + L.off_ks, stage + L.off_kb, (u32)(key0 + r0) * k_stride, r0, valid);
        scales<VS, FULL>(e.vs, stage + L.off_vs, stage + L.off_vb, (u32)(key0 + r0) * v_stride, r0, valid);
    }
    // The block's scale and bias words (rows r0 .., S::SW words each) into the stage arrays at ds / db.
    template <typename S, bool FULL>
    __device__ __forceinline__ static void scales(const unsigned long long (&src)[S::COPIES], u32 ds, u32 db, u32 at, int r0, int valid) {
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int j = 0; j < S::COPIES; ++j) {
            const int2 bk = S::entry(lane, j);
            const int k = bk.y;
            const unsigned char* a = reinterpret_cast<const unsigned char*>(src[j]);
            const u32 d = (bk.x ? db : ds) + 4 * (r0 * S::SW + k);
            if (FULL) {
                cp_async4_u32_all(d, a + at);
            } else {
                const bool ok = k / S::SW < valid;
                cp_async4_u32(d, ok ? a + at : a, ok);
            }
        }
    }
};
// Where WarpCopy serves: quantized rows up to D = 128 (more pointers spilled at D = 256).
#define WARP_COPY_KERNEL (CACHE_BITS > 0 && HEAD_DIM <= 128)
#define WARP_COPY_TABLE_BYTES(OWN_ROWS) (WARP_COPY_KERNEL ? WarpCopy<OWN_ROWS>::TABLE_BYTES : 0)
#else
#define WARP_COPY_TABLE_BYTES(OWN_ROWS) 0
#endif

// Issues the copies of the stage holding keys [key0, key0 + tile_keys).
__device__ __forceinline__ void load_stage(unsigned char* stage, const StageLayout& L, const DecodeParams& p,
                                           const DecodeWork& w, int key0, const StageCopy& c) {
    const int n = L.tile_keys;
    copy_rows(stage, L.srow_k, p.k, p, w, key0, w.k1, n, c.rows, c.unit);
    copy_rows(stage + L.off_v, L.srow_v, p.v, p, w, key0, w.k1, n, c.rows, c.unit);
    if (KV_BITS(p)) {
        const int gk = groups_k(p), gv = groups_v(p);
        copy_scales(reinterpret_cast<u32*>(stage + L.off_ks), L.sw_k, p.k_scale, gk, p, w, key0, w.k1, n, c.scales_k);
        copy_scales(reinterpret_cast<u32*>(stage + L.off_kb), L.sw_k, p.k_bias, gk, p, w, key0, w.k1, n, c.scales_k);
        copy_scales(reinterpret_cast<u32*>(stage + L.off_vs), L.sw_v, p.v_scale, gv, p, w, key0, w.k1, n, c.scales_v);
        copy_scales(reinterpret_cast<u32*>(stage + L.off_vb), L.sw_v, p.v_bias, gv, p, w, key0, w.k1, n, c.scales_v);
    }
}

#if DECODE_TMA
// Lane 0 of warp wk: the K and V boxes of the warp's blocks wk, wk + NUM_WARPS, ... (ROWS rows each)
// of the stage at shared address `stage`, holding keys [key0, ..), completing on mbarrier `bar`.
// Rows past the split's keys arrive too (the next keys, or zeros past the tensor): masked, as
// zero-filled rows are, and their scale words are zero.
template <int ROWS>
__device__ __forceinline__ void tma_rows(const DecodeTmaParams& tp, u32 stage, const StageLayout& L, const DecodeWork& w, int key0,
                                         u32 bar) {
    // The operands made warp-uniform (a shuffle from lane 0), so that the copies read them from
    // uniform registers: per-lane operands cost each copy a loop over the active lanes (ELECT,
    // R2UR; 66 instructions a 16-key block, 18 % of the kernel's stall samples, ncu).
    const int y = __shfl_sync(0xffffffffu, w.b * tp.p.s_cache + key0, 0);
    const int x = __shfl_sync(0xffffffffu, w.kvh * tp.p.row_bytes, 0);
    const int first = __shfl_sync(0xffffffffu, w.wk * ROWS, 0);
    const u32 dst = __shfl_sync(0xffffffffu, stage, 0), b = __shfl_sync(0xffffffffu, bar, 0);
    if (elect_one()) {
        mbar_expect_tx(b, 2 * ROWS * DECODE_TMA_ROW * DECODE_TMA_WARP_BLOCKS);  // boxes of ROWS rows
#pragma unroll
        for (int j = 0; j < DECODE_TMA_WARP_BLOCKS; ++j) {
            const int r0 = first + j * NUM_WARPS * ROWS;
#if DECODE_STREAM_HINT
            tma_load_2d_hint(dst + r0 * L.srow_k, &tp.k, tp.k_x0 + x, y + r0, b, stream_policy());
            tma_load_2d_hint(dst + L.off_v + r0 * L.srow_v, &tp.v, tp.v_x0 + x, y + r0, b, stream_policy());
#else
            tma_load_2d(dst + r0 * L.srow_k, &tp.k, tp.k_x0 + x, y + r0, b);
            tma_load_2d(dst + L.off_v + r0 * L.srow_v, &tp.v, tp.v_x0 + x, y + r0, b);
#endif
        }
    }
}
#endif
// The mbarriers DECODE_TMA's warps wait on, one per warp and stage, after WarpCopy's table.
#define DECODE_TMA_BARRIER_BYTES (DECODE_TMA ? 8 * NUM_WARPS * STAGES : 0)

// Runs compute(stage, key0, nkeys) over the split's tiles, each brought in by a STAGES-deep cp.async
// pipeline: one group committed per tile slot (empty ones too, so the wait counts stay fixed), and
// one load site (the first STAGES - 1 turns only load). Returns with every copy landed and every
// thread past its last compute (the shared memory is free for reuse), the dependent grid released.
// OWN_ROWS > 0: the kernel's warp wk reads blocks wk, wk + NUM_WARPS, ... of OWN_ROWS rows of each
// stage, so with one warp per key lane (WS = 1) every warp copies its own blocks and waits for them
// alone (FastCopy::load_warp); 0, or WS > 1: the block copies each stage together.
template <int OWN_ROWS, typename Compute>
__device__ __forceinline__ void pipeline(unsigned char* smem, const StageLayout& L, const DecodeParams& p,
                                         const DecodeWork& w, Compute&& compute, const void* tma = nullptr) {
    const StageCopy copy(p, L, copy_unit_bytes(p));
    const FastCopy fast(p, L);
    const bool own = OWN_ROWS > 0 && fast.ok && p.warp_states == 1 && p.row_bytes <= 512;
    // WarpCopy where it serves (WARP_COPY_KERNEL), its table after the stages.
#if defined(CACHE_BITS) && defined(K_GROUP) && defined(V_GROUP)
    constexpr bool WARP_COPY = OWN_ROWS > 0 && WARP_COPY_KERNEL;
    using Copier = typename Pick<WARP_COPY, WarpCopy<OWN_ROWS>, NoCopy>::type;
#else
    constexpr bool WARP_COPY = false;
    using Copier = NoCopy;
#endif
    const Copier warp_copy(smem + STAGES * L.bytes, p, w);  // its table after the stages
    const u32 smem_u32 = smem_addr(smem);
    const int tiles = (w.k1 - w.k0 + L.tile_keys - 1) / L.tile_keys;
    // DECODE_TMA with warp-owned stages (WarpCopy then copies the scale words only): this warp's
    // barriers, after the table; elsewhere the rows come by cp.async as everywhere.
    const bool boxes = DECODE_TMA && own && WARP_COPY;
    const u32 bars = smem_u32 + STAGES * L.bytes + Copier::TABLE_BYTES + 8 * STAGES * (threadIdx.x / 32);
#if DECODE_TMA
    const DecodeTmaParams& tp = *static_cast<const DecodeTmaParams*>(tma);
    if (boxes && threadIdx.x % 32 == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(bars + 8 * s, 1);
        mbar_fence_init();
    }
    __syncwarp();
#else
    (void)tma;
#endif
#pragma unroll 1
    for (int t = 1 - STAGES; t < tiles; ++t) {
        if (t >= 0) {
            cp_async_wait<STAGES - 2>();
#if DECODE_TMA
            if (boxes) mbar_wait(bars + 8 * (t % STAGES), (t / STAGES) & 1);
#endif
            if (own) {
                __syncwarp();  // the warp's share of tile t landed; the warp is done with tile t - 1
            } else {
                __syncthreads();  // tile t landed for every thread; every thread is done with tile t - 1
            }
        }
        const int next = t + STAGES - 1;
        if (next < tiles) {
            const int stage = next % STAGES, key0 = w.k0 + next * L.tile_keys;
            if (own && WARP_COPY) {
                warp_copy.load(smem_u32 + stage * L.bytes, L, w, key0, w.k1);
#if DECODE_TMA
                tma_rows<OWN_ROWS>(tp, smem_u32 + stage * L.bytes, L, w, key0, bars + 8 * stage);
#endif
            } else if (own) {
                FastCopy::load_warp<OWN_ROWS>(smem_u32 + stage * L.bytes, L, p, w, key0, w.k1);
            } else if (fast.ok) {
                FastCopy::load(smem_u32 + stage * L.bytes, L, p, w, key0, w.k1);
            } else {
                load_stage(smem + stage * L.bytes, L, p, w, key0, copy);
            }
        }
        cp_async_commit();
        if (t >= 0) {
            const int key0 = w.k0 + t * L.tile_keys;
            compute(smem + (t % STAGES) * L.bytes, key0, min(L.tile_keys, w.k1 - key0));
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    // Only the epilogue is left: the next kernel (the splits' merge, or the next call's decode: both
    // launched dependent) may be scheduled now and wait for this grid's end instead of being
    // launched after it.
    release_dependent_grid();
}

// ---- the epilogue --------------------------------------------------------------------------------
// Each warp leaves its tile's partial states in shared memory: o [NUM_WARPS][STATE_TILE][D] f32
// (unnormalised: o / l is the warp's output), m (log2 domain) and l [NUM_WARPS][STATE_TILE]. The
// NUM_WARPS / WS warps of a state tile are merged by their logsumexp, and each state is written:
// o (elem_t) and lse with one split, else o_part and lse_part. A state no key reached gives o = 0
// and lse = -inf.
struct Partials {
    float* o;
    float* m;
    float* l;
    __device__ __forceinline__ Partials(unsigned char* smem, int d) {
        o = reinterpret_cast<float*>(smem);
        m = o + NUM_WARPS * STATE_TILE * d;
        l = m + NUM_WARPS * STATE_TILE;
    }
};

// Shared memory the partials take at head dim d.
#define PARTIALS_BYTES(d) (NUM_WARPS * STATE_TILE * ((d) + 2) * 4)

// With p.cluster, each block's merged states wait in shared memory for cluster_merge, after the
// partials: o [WS * STATE_TILE][d] f32 (normalised) and lse [WS * STATE_TILE] (natural log).
struct BlockStates {
    float* o;
    float* lse;
    __device__ __forceinline__ BlockStates(unsigned char* smem, int d) {
        o = reinterpret_cast<float*>(smem + PARTIALS_BYTES(d));
        lse = o + NUM_WARPS * STATE_TILE * d;
    }
};
#define BLOCK_STATES_BYTES(d) (NUM_WARPS * STATE_TILE * ((d) + 1) * 4)

// The block's rank in its cluster, a shared address of the block of rank r, a 4-byte load from
// another block's shared memory, and a barrier over the cluster's threads (Hopper; the host sets
// p.cluster nowhere else).
#define MAX_CLUSTER_SPLITS 8  // the most cluster_merge takes (the portable cluster size); decode.rs's CLUSTER_SPLITS is at most this
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 cluster_map(u32 addr, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ float ld_cluster_f32(u32 addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// With p.cluster, called by every thread of every block of the cluster after store_states: the
// splits' states merged by their logsumexp, written as o and lse (f32 expf / logf, as merge.cu).
// As store_states, a warp takes whole states (the cluster's warps in turn) and its lanes the
// columns: the states' lse are read once, not per element. The barriers: every block's states are
// in place before any is read, and no block leaves (its shared memory with it) before all have read.
__device__ __forceinline__ void cluster_merge(const DecodeParams& p, const DecodeWork& w, unsigned char* smem) {
    cluster_sync();
    const int d = p.head_dim, n = p.splits, rank = (int)cluster_rank(), lane = threadIdx.x % 32;
    const BlockStates mine(smem, d);
    const u32 o_at = smem_addr(mine.o), lse_at = smem_addr(mine.lse);
    const int slots = p.warp_states * STATE_TILE;
    for (int slot = rank * NUM_WARPS + threadIdx.x / 32; slot < slots; slot += n * NUM_WARPS) {
        const int st = w.chunk * slots + slot;
        if (st >= p.states) continue;
        float f[MAX_CLUSTER_SPLITS], mx = NEG_INF;  // each split's lse, then its weight
#pragma unroll
        for (int k = 0; k < MAX_CLUSTER_SPLITS; ++k) {
            f[k] = k < n ? ld_cluster_f32(cluster_map(lse_at + 4 * slot, k)) : NEG_INF;
            mx = fmaxf(mx, f[k]);
        }
        float l = 0.f;
#pragma unroll
        for (int k = 0; k < MAX_CLUSTER_SPLITS; ++k) {
            f[k] = k < n && mx != NEG_INF ? expf(f[k] - mx) : 0.f;
            l += f[k];
        }
        const bool seen = l > 0.f;
        const int i = st / p.group, h = w.kvh * p.group + st % p.group;
        elem_t* o = p.o + (((i64)w.b * p.seq_q + i) * p.heads + h) * d;
        for (int col = lane; col < d; col += 32) {
            float acc = 0.f;
#pragma unroll
            for (int k = 0; k < MAX_CLUSTER_SPLITS; ++k) {
                if (k < n && mx != NEG_INF) acc += f[k] * ld_cluster_f32(cluster_map(o_at + 4 * (slot * d + col), k));
            }
            o[col] = from_float(seen ? acc / l : 0.f);
        }
        if (lane == 0) p.lse[((i64)w.b * p.heads + h) * p.seq_q + i] = seen ? mx + logf(l) : NEG_INF;
    }
    cluster_sync();
}
#else
__device__ __forceinline__ void cluster_merge(const DecodeParams&, const DecodeWork&, unsigned char*) {}
#endif

// Called by every thread after the warps' partials are in place (and a __syncthreads). A warp
// takes whole states (slots warp, warp + NUM_WARPS, ...) and its lanes the columns, so that a
// state's merge weights and output offsets are found once, not once per element (per element,
// the divisions by D and the GQA group took ~40 instructions of 8 a thread: ncu, bench/RESULTS.md).
__device__ __forceinline__ void store_states(const DecodeParams& p, const DecodeWork& w, const Partials& part) {
    const int d = p.head_dim, ws_n = p.warp_states, wk_n = NUM_WARPS / ws_n;
    const int lane = threadIdx.x % 32;
    for (int slot = threadIdx.x / 32; slot < ws_n * STATE_TILE; slot += NUM_WARPS) {  // ws * STATE_TILE + state in the tile
        const int ws = slot / STATE_TILE, sl = slot % STATE_TILE;
        const int st = (w.chunk * ws_n + ws) * STATE_TILE + sl;
        if (st >= p.states) continue;
        float mx = NEG_INF;
        for (int k = 0; k < wk_n; ++k) mx = fmaxf(mx, part.m[(k * ws_n + ws) * STATE_TILE + sl]);
        float l = 0.f, f[NUM_WARPS];  // the key lanes' weights
#pragma unroll
        for (int k = 0; k < NUM_WARPS; ++k) {
            const int at = (k * ws_n + ws) * STATE_TILE + sl;
            f[k] = k < wk_n && mx != NEG_INF ? fast_exp2(part.m[at] - mx) : 0.f;
            if (k < wk_n) l += f[k] * part.l[at];
        }
        const bool seen = l > 0.f;
        const float lse = seen ? (mx + fast_log2(l)) * LN2 : NEG_INF;
        const int i = st / p.group, h = w.kvh * p.group + st % p.group;
        const BlockStates mine(reinterpret_cast<unsigned char*>(part.o), d);
        const i64 sb = (i64)w.split * p.batch + w.b;
        const i64 row = p.cluster ? (i64)slot * d
                        : p.splits == 1 ? (((i64)w.b * p.seq_q + i) * p.heads + h) * d
                                        : ((sb * p.seq_q + i) * p.heads + h) * d;
        // One reciprocal a state, not a division (and its slow-path call) a column: store_states took
        // ~1 us a state (stamps probe), and the one-warp 4-bit kernel's code 7240 -> 5528 instructions.
        const float inv_l = seen ? 1.f / l : 0.f;
        for (int col = lane; col < d; col += 32) {
            float acc = 0.f;
#pragma unroll
            for (int k = 0; k < NUM_WARPS; ++k) {
                if (k < wk_n) acc += f[k] * part.o[((k * ws_n + ws) * STATE_TILE + sl) * d + col];
            }
            const float out = seen ? acc * inv_l : 0.f;  // 0, whatever an unseen state's partials hold
            if (p.cluster) {
                mine.o[row + col] = out;
            } else if (p.splits == 1) {
                p.o[row + col] = from_float(out);
            } else {
                p.o_part[row + col] = out;
            }
        }
        if (lane == 0) {
            if (p.cluster) {
                mine.lse[slot] = lse;
            } else if (p.splits == 1) {
                p.lse[((i64)w.b * p.heads + h) * p.seq_q + i] = lse;
            } else {
                p.lse_part[(sb * p.heads + h) * p.seq_q + i] = lse;
            }
        }
    }
}
