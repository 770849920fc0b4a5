// decode.cu — decode on tensor cores (mma.sync m16n8k16): fp16 / bf16 queries against a plain or a
// 4- / 8-bit quantized KV cache at head dim HEAD_DIM (64, 128 or 256). The params, the block's work,
// the pipeline and the epilogue are decode.h's; another dtype or head dim runs decode_simt.cu.
//
// A warp takes STATE_TILE = 8 query states and the 16-key blocks wk, wk + WK, ... of each stage,
// STEP_BLOCKS of them per softmax step (their products per block, the softmax once for all).
// Per block:
//   S^T [16 x 8] = K Q^T         per 16 head dims one m16n8k16: A = the block's 16 K rows (or
//                                their codes), B = Q^T (kept in registers for the whole call)
//   online softmax               per state, in the exp2 domain (reduced over the lanes of a column)
//   O^T [D x 8] += V^T P^T       per 16 head dims one m16n8k16: A = V^T (or its codes), B = P^T,
//                                S^T's accumulators packed and transposed (movmatrix)
//
// Head-dim permutations. q.k sums over d, so any bijection of d onto the mma's k index serves if Q
// and K share it, and O^T's rows may be any permutation of d if the store undoes it. Both are
// chosen so that each lane reads whole units (16 bytes, fewer for short rows) of a row, no two
// lanes the same bytes:
//   K: lane t (= lane % 4) owns units t, t + 4, ... of K rows g and g + 8 (g = lane / 4; UK bytes,
//      EK elements each). A unit's elements form pairs P_0, P_1, ... (pair_lo / pair_hi); step r
//      of the unit feeds P_2r to k indices (2t, 2t+1) and P_2r+1 to (2t+8, 2t+9), and Q's B
//      fragment takes the same elements of state g.
//   V: DECODE_PLAIN_LDSM: O^T's m-block mb holds dims 16 mb .. 16 mb + 15 in order (ldmatrix.trans).
//      Else lane g owns units g, g + 8, ... of each V row (UV bytes, EV elements); pair k of its unit
//      j is m-block mb = j * EV / 2 + k, the pair's two elements O^T rows g and g + 8 of that block.
// Pairs of a u32 word: plain rows, its two elements. Quantized caches take their own block steps
// (decode_q4.h, decode_q8.h): codes into the mma undequantized, their own layouts.
#include "decode.h"

#if FLASH_DTYPE == 2
#error "decode.cu takes fp16 / bf16 (mma.sync); fp32 runs decode_simt.cu"
#endif
#if HEAD_DIM != 64 && HEAD_DIM != 128 && HEAD_DIM != 256
#error "decode.cu takes HEAD_DIM 64, 128 or 256 (decode_simt.cu any other)"
#endif
#if CACHE_BITS != 0 && CACHE_BITS != 4 && CACHE_BITS != 8
#error "decode.cu takes CACHE_BITS 0 (plain caches), 4 or 8: one kernel per cache format"
#endif
#if CACHE_BITS != 0 && !((K_GROUP == 32 || K_GROUP == 64) && (V_GROUP == 32 || V_GROUP == 64))
#error "quantized caches: one kernel per pair of group sizes, K_GROUP and V_GROUP 32 or 64"
#endif
#if STATE_TILE != 8 && !(STATE_TILE == 4 && CACHE_BITS == 4 && FLASH_DTYPE == 1 && HEAD_DIM <= 128)
#error "decode.cu's warp tile is 8 query states (the mma's n), or 4 (PAIRED): bf16 q over 4-bit caches at D <= 128, two blocks a step"
#endif

// PAIRED (STATE_TILE 4: at most 4 states a kv head, e.g. GQA 4 at Sq = 1): the mma's 8 columns hold
// the warp's 4 states twice, so that a step's two blocks share one S^T fragment: column 4 b + st
// is block b's state st, in lanes t = 2b, 2b + 1. Each block's K products take Q^T in both column
// halves and a lane keeps its own block's (lane_block); what is per score (the scale terms, the
// softmax, the V weights) then runs once for both blocks, where a tile of 8 spent half its lanes
// on states that do not exist. Block b's V products take P^T with the other block's columns zeroed
// (block_columns), so that O^T's columns 4 .. 7 collect block 1's; the epilogue folds them into
// 0 .. 3. fp16 q keeps the tile of 8 (its kernels spilled with this one at the register cap), and
// so do 8-bit caches (no faster with it; RESULTS, session 48).
#define PAIRED (STATE_TILE == 4)

// This lane's two states (columns 2t, 2t + 1 of S^T and O^T fragments), the first of them; and its
// block of a PAIRED step (0 otherwise).
__device__ __forceinline__ int col_state() { return 2 * (threadIdx.x % (STATE_TILE / 2)); }
__device__ __forceinline__ int lane_block() { return PAIRED ? (threadIdx.x % 4) / 2 : 0; }

#define KEY_BLOCK 16
// 16-key blocks a warp takes per softmax step: quantized caches take two (two independent product
// chains per step, one max and one rescale for both; 3-7 % faster on the H200, bench/RESULTS.md).
// 8-bit rows on Hopper only: their stages grow to 128 keys (2 x 39 KiB at D = 128; with the
// dequantizing kernel before decode_q8.h, 2 x 46 KiB, which left an A100 one block per SM; sm_80
// kept single steps, unmeasured since). A stage holds a multiple of STEP_BLOCKS blocks per warp.
// (D = 256 with K groups of 32 keeps single steps: the pair spills there, at 255 registers; so does
// the four-block 4-bit kernel at 128, kv_variants.rs decode_one_wave, but for its PAIRED tile, whose
// per-score work is shared by the two.)
#if STATE_TILE == 4 || (((CACHE_BITS == 8 && __CUDA_ARCH__ >= 900) || CACHE_BITS == 4) && !(HEAD_DIM == 256 && K_GROUP == 32) && MIN_BLOCKS < 4)
#define STEP_BLOCKS 2
#else
#define STEP_BLOCKS 1
#endif
static_assert(!PAIRED || STEP_BLOCKS == 2, "a PAIRED step takes two blocks");

// Plain caches: V^T's fragments by ldmatrix.trans and the K products in two chains (pv_block,
// qk_block). They cut the block loop 297 -> 264 instructions and pay where four two-warp blocks
// share an SM and the compute's latency shows (kv_variants.rs decode_plain_past_a_wave: 256 x 256
// and 128 x 512 -2 %), but the kernels of one block an SM ran slower with them, replayed back to
// back (8 x 8192 +6 to +19 %, 1 x 131072 +2 to +6 %; faster alone under ncu: bench/RESULTS.md
// session 61). A define, so that a probe may set it (FLASH_NIF_NVRTC_DEFINES).
#ifndef DECODE_PLAIN_LDSM
#define DECODE_PLAIN_LDSM (CACHE_BITS == 0 && MIN_BLOCKS >= 4)
#endif

// Geometry of a cache whose elements take BITS bits (0: plain elem_t rows).
template <int BITS>
struct Geom {
    enum : int {
        EBITS = BITS ? BITS : 16,
        ROW = HEAD_DIM * EBITS / 8,          // bytes of a row
        UK = ROW / 4 < 16 ? ROW / 4 : 16,    // bytes of a K unit
        NK = ROW / (4 * UK),                 // K units per lane
        EK = UK * 8 / EBITS,                 // elements of a K unit
        UV = ROW / 8 < 16 ? ROW / 8 : 16,    // bytes of a V unit
        NV = ROW / (8 * UV),                 // V units per lane
        EV = UV * 8 / EBITS,                 // elements of a V unit
        EPW = 32 / EBITS,                    // elements per u32 word
        PPW = EPW / 2,                       // pairs per word
        // Row strides in shared memory that keep the reads above free of bank conflicts: the two K
        // rows of a quarter warp (LDS.128) 64 bytes apart mod 128; the four V rows 2t (t = 0..3) of
        // a warp phase 32 bytes apart, and the eight of an ldmatrix phase 16 (DECODE_PLAIN_LDSM).
        // Quantized caches (decode_q4.h, decode_q8.h): K and V rows an odd number of 16-byte units
        // apart (ldmatrix, ldmatrix.trans), or DECODE_TMA's swizzled 64-byte rows (decode.h
        // row_offset).
        SROW_K = BITS != 0 ? (DECODE_TMA ? ROW : ROW + 16) : ROW % 128 == 0 ? ROW + 64 : ROW,
        SROW_V = BITS != 0 && DECODE_TMA ? ROW : ROW + 16,
    };
};

// The stage budget: 16 plain keys per warp (quantized rows are smaller and fill it with more), or a
// step's keys per warp of this format if more (scale rows: at most 4 of groups of 32 per key, or one
// word each, plus stage_layout's 64 bytes of slack).
#define SCALE_KEY_BYTES (CACHE_BITS == 0 ? 0 : HEAD_DIM / 4 > 16 ? HEAD_DIM / 4 : 16)
#define PLAIN_STAGE_BYTES (KEY_BLOCK * NUM_WARPS * (Geom<0>::SROW_K + Geom<0>::SROW_V))
// A stage's keys are whole steps of every warp (stage_layout's key_round); DECODE_TMA's, the copy
// engine's blocks of every warp.
#define STAGE_KEY_ROUND (KEY_BLOCK * (DECODE_TMA ? DECODE_TMA_WARP_BLOCKS : STEP_BLOCKS) * NUM_WARPS)
#define STEP_STAGE_BYTES \
    (STAGE_KEY_ROUND * (Geom<CACHE_BITS>::SROW_K + Geom<CACHE_BITS>::SROW_V + SCALE_KEY_BYTES) + (CACHE_BITS ? 64 : 0))
// DECODE_TMA: a step's keys exactly (128 keys of 64- or 128-byte rows: 18-20 or 34-36 KiB,
// 1024-byte multiples, so that every stage's rows start 1024-byte aligned for the swizzle).
#define STAGE_BYTES (DECODE_TMA ? STEP_STAGE_BYTES : PLAIN_STAGE_BYTES > STEP_STAGE_BYTES ? PLAIN_STAGE_BYTES : STEP_STAGE_BYTES)
static_assert(PARTIALS_BYTES(HEAD_DIM) + BLOCK_STATES_BYTES(HEAD_DIM) <= STAGES * STAGE_BYTES, "the epilogue reuses the stages");

// The stages, with WarpCopy's table after them (WARP_COPY_KERNEL; where the stages leave room,
// within STAGES * STAGE_BYTES: the 4-bit kernel at D = 128 keeps three blocks per SM).
#if CACHE_BITS
#define DECODE_LAYOUT \
    layout_of(Geom<CACHE_BITS>::SROW_K, Geom<CACHE_BITS>::SROW_V, scale_words(HEAD_DIM / K_GROUP), scale_words(HEAD_DIM / V_GROUP), \
              STAGE_BYTES, STAGE_KEY_ROUND)
#define DECODE_LAYOUT_BYTES DECODE_LAYOUT.bytes
#else
#define DECODE_LAYOUT_BYTES STAGE_BYTES
#endif
#if DECODE_TMA
static_assert(DECODE_LAYOUT.tile_keys == DECODE_TMA_WARP_BLOCKS * KEY_BLOCK * NUM_WARPS,
              "DECODE_TMA: a stage holds DECODE_TMA_WARP_BLOCKS blocks a warp (decode.h tma_rows)");
static_assert(DECODE_LAYOUT_BYTES % 1024 == 0 && DECODE_LAYOUT.off_v % 1024 == 0,
              "DECODE_TMA: every stage's K and V rows start 1024-byte aligned (the swizzle, decode.h row_offset)");
#endif
#define DECODE_TABLE_END (STAGES * DECODE_LAYOUT_BYTES + WARP_COPY_TABLE_BYTES(KEY_BLOCK))
// DECODE_TMA: its barriers after the table (which the epilogue's partials stay below), and 1024
// bytes to align the stages for the swizzle.
#define DECODE_SMEM_END (DECODE_TABLE_END + DECODE_TMA_BARRIER_BYTES)
static_assert(!DECODE_TMA || PARTIALS_BYTES(HEAD_DIM) + BLOCK_STATES_BYTES(HEAD_DIM) <= DECODE_TABLE_END, "the epilogue leaves the barriers be");
FLASH_EXPORT_SMEM((DECODE_SMEM_END > STAGES * STAGE_BYTES ? DECODE_SMEM_END : STAGES * STAGE_BYTES) + (DECODE_TMA ? 1024 : 0))

// Elements (within its u32 word) of pair k of the word.
template <int BITS>
__device__ __forceinline__ constexpr int pair_lo(int k) { return 2 * k; }
template <int BITS>
__device__ __forceinline__ constexpr int pair_hi(int k) { return 2 * k + 1; }

// Element (within its unit) of the low (hi = 0) or high member of pair P of the unit.
template <int BITS>
__device__ __forceinline__ constexpr int pair_elem(int P, int hi) {
    using G = Geom<BITS>;
    return (P / G::PPW) * G::EPW + (hi ? pair_hi<BITS>(P % G::PPW) : pair_lo<BITS>(P % G::PPW));
}

// decode_q4.h's magic: a 4-bit code under the high byte of 2^7 (bf16) or 2^10 (fp16) reads as
// 2^k + code, exact.
#if FLASH_DTYPE == 1
#define MAGIC_BYTES 0x43434343u  // bf16 2^7 = 0x4300: its high byte in every byte
#else
#define MAGIC_BYTES 0x64646464u  // fp16 2^10 = 0x6400
#endif

// U bytes of shared memory (a unit) as u32 words.
template <int U>
__device__ __forceinline__ void load_unit(u32 (&w)[U / 4], const unsigned char* src) {
    if constexpr (U == 16) {
        const uint4 v = *reinterpret_cast<const uint4*>(src);
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if constexpr (U == 8) {
        const uint2 v = *reinterpret_cast<const uint2*>(src);
        w[0] = v.x, w[1] = v.y;
    } else {
        w[0] = *reinterpret_cast<const u32*>(src);
    }
}

// Element G of a key's scale row of N 16-bit elements, as f32; `half`: the row's ScaleOffset. Rows
// of an even N start at a word (ScaleOffset is 0 there), so one 32-bit load serves two elements
// and bf16's high one needs only a mask (was a 16-bit load and a shift each).
template <int N>
__device__ __forceinline__ float scale_value(const unsigned char* row, int half, int G) {
    if constexpr (N % 2 == 0) {
        const u32 w = reinterpret_cast<const u32*>(row)[G / 2];
#if FLASH_DTYPE == 1
        return __uint_as_float(G % 2 ? w & 0xffff0000u : w << 16);
#else
        return to_float((u16)(G % 2 ? w >> 16 : w & 0xffffu));
#endif
    } else {
        return to_float(reinterpret_cast<const u16*>(row)[half + G]);
    }
}

// Q^T's B fragments of this lane, the same shape for every format: [(unit j, step r), b0 | b1] as
// packed pairs, qa[2 (j EK / 4 + r) + f] (state g of the warp's tile; zero past the last state).
#define Q_REGS (HEAD_DIM / 8)

template <int BITS>
__device__ __forceinline__ void load_q(u32 (&qa)[Q_REGS], const DecodeParams& p, const DecodeWork& w) {
    using G = Geom<BITS>;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int st = w.state0 + g;
    const bool ok = st < p.states;
    const int i = w.row_of(p, st), h = w.kvh * p.group + (ok ? st % p.group : 0);
    const u16* q = reinterpret_cast<const u16*>(p.q) + (((i64)w.b * p.seq_q + i) * p.heads + h) * HEAD_DIM;
#pragma unroll
    for (int j = 0; j < G::NK; ++j) {
        const int base = (t + 4 * j) * G::EK;
#pragma unroll
        for (int r = 0; r < G::EK / 4; ++r) {
#pragma unroll
            for (int f = 0; f < 2; ++f) {
                const int P = 2 * r + f;
                const u32 lo = ok ? q[base + pair_elem<BITS>(P, 0)] : 0u;
                const u32 hi = ok ? q[base + pair_elem<BITS>(P, 1)] : 0u;
                qa[2 * (j * (G::EK / 4) + r) + f] = lo | (hi << 16);
            }
        }
    }
}

// The pairs of unit u of a K row.
template <int BITS>
__device__ __forceinline__ void k_unit(u32 (&pairs)[Geom<BITS>::EK / 2], const unsigned char* row, int u) {
    load_unit<Geom<BITS>::UK>(pairs, row + u * Geom<BITS>::UK);
}

// s = S^T of a 16-key block of a plain cache: this lane's K rows are r (key g) and r8 (key g + 8).
// DECODE_PLAIN_LDSM: two chains of products (a unit's even and odd k steps), added at the end, so
// that the block's scores wait on half as many dependent mmas (ncu: "wait" stalls led the four-block
// kernel's samples at two warps a scheduler).
template <int BITS>
__device__ __forceinline__ void qk_block(float (&s)[4], const u32 (&qa)[Q_REGS], const unsigned char* r, const unsigned char* r8) {
    using G = Geom<BITS>;
    static_assert(G::EK / 4 == 2, "a unit: two k steps, one a chain");
    constexpr bool CHAINS = DECODE_PLAIN_LDSM;
    const int t = threadIdx.x % 4;
    float s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < G::NK; ++j) {
        u32 pg[G::EK / 2], pg8[G::EK / 2];
        k_unit<BITS>(pg, r, t + 4 * j);
        k_unit<BITS>(pg8, r8, t + 4 * j);
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            const int at = 2 * (j * 2 + x);
            const u32 a[4] = {pg[2 * x], pg8[2 * x], pg[2 * x + 1], pg8[2 * x + 1]};
            mma16816(CHAINS && x ? s1 : s, a, qa[at], qa[at + 1]);
        }
    }
    if constexpr (CHAINS) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[e] += s1[e];
    }
}

// The 8 x 8 b16 matrix whose rows the lanes hold as mma fragments (lane l: row l / 4, columns
// 2 (l % 4) and + 1), transposed in the same layout.
__device__ __forceinline__ u32 transpose8x8(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

// o += V^T P^T for a 16-key block of a plain cache whose first V row is `rows` (stride SROW_V);
// bp0 / bp1: P^T's B fragment.
#if DECODE_PLAIN_LDSM
// One ldmatrix.x4.trans per m-block mb gives V^T's A fragment as it lies (rows: dims 16 mb + g and
// + 8; columns: keys 2t, 2t + 1 and + 8): lanes 8j .. 8j + 7 address keys 8 (j / 2) .. + 7 at dims
// 16 mb + 8 (j % 2).
__device__ __forceinline__ void pv_block(float (&o)[HEAD_DIM / 16][4], const unsigned char* rows, u32 bp0, u32 bp1) {
    const int lane = threadIdx.x % 32;
    const u32 at = smem_addr(rows) + ((lane & 7) + 8 * (lane >> 4)) * Geom<0>::SROW_V + 16 * ((lane >> 3) & 1);
#pragma unroll
    for (int mb = 0; mb < HEAD_DIM / 16; ++mb) {
        u32 a[4];
        ldmatrix_x4_trans(a, at + 32 * mb);
        mma16816(o[mb], a, bp0, bp1);
    }
}
#else
// Four 16-byte loads (this lane's V rows: keys 2t, 2t + 1, 2t + 8, 2t + 9) and a PRMT a register.
__device__ __forceinline__ int v_row(int n) { return 2 * (threadIdx.x % 4) + (n & 1) + (n >> 1) * 8; }
__device__ __forceinline__ void pv_block(float (&o)[HEAD_DIM / 16][4], const unsigned char* rows, u32 bp0, u32 bp1) {
    using G = Geom<0>;
    const int g = (threadIdx.x % 32) / 4;
#pragma unroll
    for (int j = 0; j < G::NV; ++j) {
        const int u = g + 8 * j;
        u32 words[4][G::UV / 4];
#pragma unroll
        for (int n = 0; n < 4; ++n) load_unit<G::UV>(words[n], rows + v_row(n) * G::SROW_V + u * G::UV);
#pragma unroll
        for (int x = 0; x < G::UV / 4; ++x) {
            // m rows g (the words' low elements) and g + 8 (high), k columns (keys) 2t, 2t+1 | 2t+8, 2t+9.
            const u32 a[4] = {__byte_perm(words[0][x], words[1][x], 0x5410), __byte_perm(words[0][x], words[1][x], 0x7632),
                              __byte_perm(words[2][x], words[3][x], 0x5410), __byte_perm(words[2][x], words[3][x], 0x7632)};
            mma16816(o[j * (G::EV / 2) + x], a, bp0, bp1);
        }
    }
}
#endif

// Max and sum over the lanes of a state's columns of S^T (the 8 lanes of one t: the keys of a
// state; PAIRED, the 16 lanes of t and t ^ 2: both blocks' keys). Every lane of them gets the result.
#define COLUMN_XOR0 (PAIRED ? 2 : 4)
__device__ __forceinline__ float column_max(float x) {
#pragma unroll
    for (int o = COLUMN_XOR0; o < 32; o *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float column_sum(float x) {
#pragma unroll
    for (int o = COLUMN_XOR0; o < 32; o *= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// How far (log2 units) a state's running maximum may lag behind its scores: the maximum moves only
// when a step's exceeds it by more than this, so after the first steps the accumulators seldom take
// a rescale (it measured half the 4-bit kernel's steps with random scores and exact moves). Exact
// either way: P = 2^(s - m) then lies below 2^MAX_LAG, which bf16 / fp16 P, f32 sums and o hold.
// 8-bit caches too, whose fp16 V weights P s f follow the largest (decode_weights.h) whatever P's
// range; not yet the 4-bit ones under fp16 queries (the same weights; not measured).
#if CACHE_BITS == 0 || CACHE_BITS == 8 || (CACHE_BITS == 4 && FLASH_DTYPE == 1)
#define MAX_LAG 8.f
#else
#define MAX_LAG 0.f
#endif
// Whether a step first asks by one vote if any lane's scores pass their state's m + MAX_LAG, and
// takes the columns' maxima (a chain of shuffles: 13 % of the 4-bit kernel's stall samples, ncu)
// only then: the 4-bit kernels under bf16 q, 1-4 % faster (bench/RESULTS.md, session 57), and the
// 8-bit ones (with the lag, and decode_weights.h's vote: 0.3-1.5 %, session 58). Not the plain
// cache's (memory bound: 0-5 % slower), nor D = 128 4-bit with K groups of 32 and V groups of 64
// (its PAIRED kernel, at the 168-register cap, then spills a word reloaded once a stage, and 64 x
// 1024 ran 1-2 % slower).
#if (CACHE_BITS == 4 && FLASH_DTYPE == 1 && !(HEAD_DIM == 128 && K_GROUP == 32 && V_GROUP == 64)) || CACHE_BITS == 8
#define MAX_VOTE 1
#else
#define MAX_VOTE 0
#endif

// The softmax step of NB 16-key blocks in S^T's layout (x[b]: keys g, g + 8 of states 2t, 2t + 1;
// block b's keys key_base[b] + g ..; the stage's keys end at key_end), one max and one rescale for
// all of them: masks, updates m and l of the lane's states and leaves P in x and the factors the
// accumulators take in alpha. Returns whether any lane's alpha is not 1 (warp-uniform); on_move(alpha)
// runs then too, inside the step's rare path (where the callers need no flag across it).
struct NoMove {
    __device__ __forceinline__ void operator()(const float (&)[2]) const {}
};
template <int NB, typename OnMove = NoMove>
__device__ __forceinline__ bool softmax_step(float (&x)[NB][4], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             const DecodeParams& p, const int (&key_base)[NB], int key_end,
                                             const int2 (&vis)[2], OnMove&& on_move = OnMove()) {
    const int g = (threadIdx.x % 32) / 4;
    scores_log2(p, reinterpret_cast<float(&)[NB * 4]>(x));
    // Most steps lie inside the stage's keys and every state's visible ones: with several blocks a
    // step, one vote skips their masks there (the blocks' keys rise with b; a PAIRED step's two are
    // in one fragment, NB 1). Not for a single block (its four masks cost about what the vote does:
    // the plain cache measured 1 % slower with it, RESULTS), nor at D = 256 (the two paths' registers
    // spill there).
    const int kmin = key_base[0], kmax = key_base[NB - 1] + KEY_BLOCK - 1;
    const bool inside = kmax < key_end && kmin >= max(vis[0].x, vis[1].x) && kmax <= min(vis[0].y, vis[1].y);
    if ((NB == 1 && !PAIRED) || HEAD_DIM > 128 || !__all_sync(0xffffffffu, inside)) {
#pragma unroll
        for (int b = 0; b < NB; ++b) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key_base[b] + g + (e >> 1) * 8, c = e & 1;
                const bool ok = key < key_end && key >= vis[c].x && key <= vis[c].y;
                x[b][e] = ok ? x[b][e] : NEG_INF;
            }
        }
    }
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int b = 0; b < NB; ++b) {
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e & 1] = fmaxf(mx[e & 1], x[b][e]);
    }
    // MAX_VOTE: the columns' maxima only in the steps where some lane's scores pass m + MAX_LAG (one
    // vote); in the others no maximum moves. The same m either way.
    bool moved = false;
    alpha[0] = alpha[1] = 1.f;
    if (!MAX_VOTE || __any_sync(0xffffffffu, mx[0] > m[0] + MAX_LAG || mx[1] > m[1] + MAX_LAG)) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float m_step = column_max(mx[c]);
            const float m_new = m_step > m[c] + MAX_LAG ? m_step : m[c];
            alpha[c] = fast_exp2(m[c] - (m_new == NEG_INF ? 0.f : m_new));
            m[c] = m_new;
        }
        // Once the maxima settle most blocks change none: the callers skip the multiplies.
        moved = __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f);
        if (moved) on_move(alpha);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const float m_use = m[c] == NEG_INF ? 0.f : m[c];  // no -inf - -inf
        float sum = 0.f;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            x[b][c] = fast_exp2(x[b][c] - m_use);
            x[b][c + 2] = fast_exp2(x[b][c + 2] - m_use);
            sum += x[b][c] + x[b][c + 2];
        }
        l[c] = l[c] * alpha[c] + sum;
    }
    return moved;
}

// Accumulators in O^T's layout (columns states 2t, 2t + 1) times the step's factors.
template <int N>
__device__ __forceinline__ void rescale(float (&acc)[N][4], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i][0] *= alpha[0], acc[i][1] *= alpha[1], acc[i][2] *= alpha[0], acc[i][3] *= alpha[1];
}

// Per-lane sums of states 2t, 2t + 1 times the step's factors.
template <int N>
__device__ __forceinline__ void rescale_pairs(float (&acc)[N][2], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i][0] *= alpha[0], acc[i][1] *= alpha[1];
}

// P^T's B fragment: lane (g, t) needs P[state g][keys 2t, 2t+1 | 2t+8, 2t+9]; S^T gave it
// P[states 2t, 2t+1][key g | g+8], the transposed 8 x 8 blocks.
__device__ __forceinline__ void p_fragment(const float (&x)[4], u32& bp0, u32& bp1) {
    bp0 = transpose8x8(pack2(x[0], x[1]));
    bp1 = transpose8x8(pack2(x[2], x[3]));
}

// The frame of a step over NB 16-key blocks of a stage (block b: rows r0[b] .. r0[b] + 15, keys
// key0 + r0[b] ..): each block's S^T by qk(b, x[b]) (x[b] zeroed; rows keys g and g + 8, columns
// states 2t and 2t + 1), one softmax step of states 2t and 2t + 1 for all (m, l: theirs; vis: their
// visible keys), settle(x, alpha, moved) (the accumulators take the step's factors alpha where
// `moved`: a maximum moved), then each block's O^T by pv(b, x[b]).
template <int NB, typename QK, typename Settle, typename PV>
__device__ __forceinline__ void step_blocks(float (&m)[2], float (&l)[2], const DecodeParams& p, int key0, int nkeys,
                                            const int (&r0)[NB], const int2 (&vis)[2], QK&& qk, Settle&& settle, PV&& pv) {
    float x[NB][4];
    int key_base[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        key_base[b] = key0 + r0[b];
        x[b][0] = x[b][1] = x[b][2] = x[b][3] = 0.f;
        qk(b, x[b]);
    }
    float alpha[2];
    settle(x, alpha, softmax_step<NB>(x, m, l, alpha, p, key_base, key0 + nkeys, vis));
#pragma unroll
    for (int b = 0; b < NB; ++b) pv(b, x[b]);
}

// step_blocks for a plain cache (qk_block, pv_block).
template <int NB>
__device__ __forceinline__ void block_step(float (&o)[HEAD_DIM / 16][4], float (&m)[2], float (&l)[2], const u32 (&qa)[Q_REGS],
                                           const unsigned char* stage, const StageLayout& L, const DecodeParams& p,
                                           int key0, int nkeys, const int (&r0)[NB], const int2 (&vis)[2]) {
    using G = Geom<0>;
    const int g = (threadIdx.x % 32) / 4;
    step_blocks<NB>(
        m, l, p, key0, nkeys, r0, vis,
        [&](int b, float (&x)[4]) {
            const int r = r0[b] + g;
            qk_block<0>(x, qa, stage + r * G::SROW_K, stage + (r + 8) * G::SROW_K);
        },
        [&](const float (&)[NB][4], const float (&alpha)[2], bool moved) {
            if (moved) rescale(o, alpha);
        },
        [&](int b, const float (&x)[4]) {
            u32 bp0, bp1;
            p_fragment(x, bp0, bp1);
            pv_block(o, stage + L.off_v + r0[b] * G::SROW_V, bp0, bp1);
        });
}

// Quantized caches: the V groups whose weights' sums take the codes' magic offset off once, at
// the end (o's m-blocks past HEAD_DIM / 16, one per group: decode_q4.h, decode_q8.h), where the
// registers allow (at most two groups; more spilled at D = 128); else each block's products take it
// off by a second mma per m-block.
#define V_SUMS(GV) (HEAD_DIM / (GV) <= 2 ? HEAD_DIM / (GV) : 0)

#include "decode_weights.h"

// This lane's row in an ldmatrix over a 16-row block whose rows start at shared address `rows`,
// `srow` bytes apart: lanes 8j .. 8j + 7 address rows 8 (j % 2) .. + 7.
__device__ __forceinline__ u32 lane_row(u32 rows, int srow) {
    const int lane = threadIdx.x % 32;
    return rows + ((lane & 7) + 8 * ((lane >> 3) & 1)) * srow;
}
// The address of unit u + j / 2 of that row (lanes 8j ..: matrix j of an .x4 takes unit u + j / 2),
// where decode.h's row_offset lays it (the block's rows 1024-byte aligned under DECODE_TMA).
__device__ __forceinline__ u32 lane_unit(u32 row, int u) {
    const int lane = threadIdx.x % 32;
#if DECODE_TMA
    return row + row_offset(lane & 7, 16 * (u + (lane >> 4)));
#else
    return row + 16 * (lane >> 4) + 16 * u;  // u an immediate offset
#endif
}

// N consecutive 16-byte chunks u0 .. u0 + N - 1 of a 16-key block's quantized V rows (decode_q4.h,
// decode_q8.h): xv[j][h] = the 16-bit column g of chunk u0 + j of keys 2t + 8h and 2t + 8h + 1 (low
// and high half), by ldmatrix.trans; `row`: this lane's (lane_row; rows an odd number of 16-byte
// units apart, or DECODE_TMA's swizzled ones).
template <int N>
__device__ __forceinline__ void v_columns(u32 (&xv)[N][2], u32 row, int u0) {
#pragma unroll
    for (int j = 0; j + 1 < N; j += 2) {
        u32 r[4];
        ldmatrix_x4_trans(r, lane_unit(row, u0 + j));
        xv[j][0] = r[0], xv[j][1] = r[1], xv[j + 1][0] = r[2], xv[j + 1][1] = r[3];
    }
    if constexpr (N % 2 == 1) {
        u32 r[2];
        ldmatrix_x2_trans(r, lane_unit(row, u0 + N - 1));  // lanes 0 .. 15's addresses
        xv[N - 1][0] = r[0], xv[N - 1][1] = r[1];
    }
}

// Block b's columns of a PAIRED step's P^T fragment (lanes g = 4b .. 4b + 3 hold them), the other
// block's zero.
__device__ __forceinline__ u32 block_columns(u32 frag, int b) { return (int)(threadIdx.x % 32) / 16 == b ? frag : 0u; }

// The settle of a quantized step over NB blocks (block b: rows r0[b] .., keys key0 + r0[b] ..; the
// stage's v scale rows at vs, sw_v words each): where the V weights P s go into fp16, f follows
// them (decode_weights.h); else the accumulators take the step's factors.
template <int GV, int NB, int NO>
__device__ __forceinline__ void settle_quant(const float (&x)[NB][4], const float (&alpha)[2], bool moved, bool fp16_weights,
                                             WeightRange& w, float (&o)[NO][4], float (&cv)[HEAD_DIM / GV][2],
                                             const unsigned char* vs, int sw_v, const int (&r0)[NB], int key0,
                                             const ScaleOffset& v_off) {
    if (fp16_weights) {
        const int g = (threadIdx.x % 32) / 4;
        float smax[NB], smax8[NB];
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const int r = r0[b] + g, r8 = r + 8;
            smax[b] = max_v_scale<GV>(vs + r * 4 * sw_v, v_off(key0 + r));
            smax8[b] = max_v_scale<GV>(vs + r8 * 4 * sw_v, v_off(key0 + r8));
        }
        settle_weights<NB>(x, alpha, moved, smax, smax8, w, o, cv);
    } else if (moved) {
        rescale(o, alpha);
        rescale_pairs(cv, alpha);
    }
}

// x (S^T of a 16-key block: rows keys g, g + 8, columns states 2t, 2t + 1) takes a head-dim group's
// terms s acc + b qs of a quantized cache (s, b: key g's, s8, b8: key g + 8's; qs: the states').
// The first group assigns (0 + z does not fold: -0); the others chain into it by FFMAs (an FADD
// each summed the groups' terms).
__device__ __forceinline__ void group_scores(float (&x)[4], const float (&acc)[4], float s, float s8, float b, float b8,
                                             const float (&qs)[2], bool first) {
    const float sr[4] = {s, s, s8, s8}, br[4] = {b, b, b8, b8};
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = fmaf(sr[e], acc[e], first ? br[e] * qs[e % 2] : fmaf(br[e], qs[e % 2], x[e]));
}

#include "decode_q4.h"

#include "decode_q8.h"

// step_blocks for a 4- or 8-bit cache (BITS; decode_q4.h, decode_q8.h), K groups of GK and V
// groups of GV elements; cv: the V groups' bias accumulators, w: the V weights' range (fp16
// weights: 8-bit, and 4-bit under fp16 queries), qinv: the states' q scaling undone (8-bit).
template <int BITS, int GK, int GV, int NB>
__device__ __forceinline__ void block_step_quant(float (&o)[HEAD_DIM / 16 + V_SUMS(GV)][4], float (&cv)[HEAD_DIM / GV][2], WeightRange& w,
                                                 const float (&qinv)[2], float (&m)[2], float (&l)[2], const u32 (&qa)[Q_REGS],
                                                 const float (&qs)[HEAD_DIM / GK][2], const unsigned char* stage,
                                                 u32 stage_s, const StageLayout& L, const DecodeParams& p, int key0, int nkeys,
                                                 const int (&r0)[NB], const int2 (&vis)[2], const ScaleOffset& k_off,
                                                 const ScaleOffset& v_off) {
    constexpr bool q8 = BITS == 8;
    constexpr int srow_k = q8 ? Q8::SROW_K : Q4::SROW_K, srow_v = q8 ? Q8::SROW_V : Q4::SROW_V;
    const int g = (threadIdx.x % 32) / 4;
    const unsigned char* ks = stage + L.off_ks;
    const unsigned char* kb = stage + L.off_kb;
    const unsigned char* vs = stage + L.off_vs;
    const unsigned char* vb = stage + L.off_vb;
    step_blocks<NB>(
        m, l, p, key0, nkeys, r0, vis,
        [&](int b, float (&x)[4]) {
            const int r = r0[b] + g, r8 = r + 8;
            const u32 rows = stage_s + r0[b] * srow_k;
            if constexpr (q8) {
                q8_qk<GK>(x, qa, qs, qinv, rows, ks + r * 4 * L.sw_k, kb + r * 4 * L.sw_k, ks + r8 * 4 * L.sw_k,
                          kb + r8 * 4 * L.sw_k, k_off(key0 + r), k_off(key0 + r8));
            } else {
                q4_qk<GK>(x, qa, qs, qinv[0], rows, ks + r * 4 * L.sw_k, kb + r * 4 * L.sw_k, ks + r8 * 4 * L.sw_k,
                          kb + r8 * 4 * L.sw_k, k_off(key0 + r), k_off(key0 + r8));
            }
        },
        [&](const float (&x)[NB][4], const float (&alpha)[2], bool moved) {
            settle_quant<GV>(x, alpha, moved, q8 || FLASH_DTYPE == 0, w, o, cv, vs, L.sw_v, r0, key0, v_off);
        },
        [&](int b, const float (&x)[4]) {
            const int r = r0[b] + g, r8 = r + 8;
            const u32 rows = stage_s + L.off_v + r0[b] * srow_v;
            if constexpr (q8) {
                q8_pv<GV>(o, cv, x, w, rows, vs + r * 4 * L.sw_v, vb + r * 4 * L.sw_v, vs + r8 * 4 * L.sw_v,
                          vb + r8 * 4 * L.sw_v, v_off(key0 + r), v_off(key0 + r8));
            } else {
                q4_pv<GV>(o, cv, x, w, rows, vs + r * 4 * L.sw_v, vb + r * 4 * L.sw_v, vs + r8 * 4 * L.sw_v,
                          vb + r8 * 4 * L.sw_v, v_off(key0 + r), v_off(key0 + r8));
            }
        });
}

// A PAIRED step over a 4-bit cache's two blocks (r0[b]: block b's first row; the rest as
// block_step_quant's, whose step it replaces): both blocks' K products, each lane keeping its own
// block's (rows rl + g, + 8), then the scale terms, the softmax and the V weights once for both.
template <int GK, int GV>
__device__ __forceinline__ void block_step_paired(float (&o)[HEAD_DIM / 16 + V_SUMS(GV)][4], float (&cv)[HEAD_DIM / GV][2], WeightRange& w,
                                                  float (&m)[2], float (&l)[2], const u32 (&qa)[Q_REGS],
                                                  const float (&qs)[HEAD_DIM / GK][2], float kf, const unsigned char* stage, u32 stage_s,
                                                  const StageLayout& L, const DecodeParams& p, int key0, int nkeys, const int (&r0)[2],
                                                  const int2 (&vis)[2], const ScaleOffset& k_off, const ScaleOffset& v_off) {
    constexpr int NGK = HEAD_DIM / GK;
    const int rl = lane_block() ? r0[1] : r0[0], r = rl + (threadIdx.x % 32) / 4, r8 = r + 8;
    const int sk = r * 4 * L.sw_k, sk8 = r8 * 4 * L.sw_k, sv = r * 4 * L.sw_v, sv8 = r8 * 4 * L.sw_v;
    float x[1][4];
    {
        // Both blocks' products a chunk pair (a group or two) at a time, this lane's kept: fewer live
        // registers than both blocks' whole rows (the 128-register kernels spilled with those).
        float acc[NGK][4];
#pragma unroll
        for (int c = 0; c < Q4::CHUNKS; c += 2) {
            float acc1[NGK][4];
            q4_qk_products<GK>(acc, qa, stage_s + r0[0] * Q4::SROW_K, c, c + 2);
            q4_qk_products<GK>(acc1, qa, stage_s + r0[1] * Q4::SROW_K, c, c + 2);
#pragma unroll
            for (int G = c * 32 / GK; G < (c + 2) * 32 / GK; ++G)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[G][e] = lane_block() ? acc1[G][e] : acc[G][e];
        }
        q4_qk_terms<GK>(x[0], acc, qs, kf, stage + L.off_ks + sk, stage + L.off_kb + sk, stage + L.off_ks + sk8,
                        stage + L.off_kb + sk8, k_off(key0 + r), k_off(key0 + r8));
    }
    const int key_base[1] = {key0 + rl};
    float alpha[2];
    // bf16 q: the weights need no range (decode_weights.h). Where MAX_VOTE, the rescale runs inside
    // the step's rare path (no flag across it: 1 % faster at 1 x 131072); elsewhere after it (the
    // K32 / V64 kernel, at the register cap, spilled with it inside).
    const auto rescale_all = [&](const float (&a)[2]) {
        rescale(o, a);
        rescale_pairs(cv, a);
    };
    if constexpr (MAX_VOTE) {
        softmax_step<1>(x, m, l, alpha, p, key_base, key0 + nkeys, vis, rescale_all);
    } else if (softmax_step<1>(x, m, l, alpha, p, key_base, key0 + nkeys, vis)) {
        rescale_all(alpha);
    }
    q4_pv<GV, 2>(o, cv, x[0], w, stage_s + L.off_v + r0[0] * Q4::SROW_V, stage + L.off_vs + sv, stage + L.off_vb + sv,
                 stage + L.off_vs + sv8, stage + L.off_vb + sv8, v_off(key0 + r), v_off(key0 + r8), stage_s + L.off_v + r0[1] * Q4::SROW_V);
}

// The warp's partial o (plain caches) into shared memory: states 2t, 2t + 1 at the head dims of
// pv_block's rows.
__device__ __forceinline__ void store_partial_o(float* dst, const float (&o)[HEAD_DIM / 16][4]) {
    const int t = threadIdx.x % 4, g = (threadIdx.x % 32) / 4;
#pragma unroll
    for (int mb = 0; mb < HEAD_DIM / 16; ++mb) {
#if DECODE_PLAIN_LDSM
        const int d_lo = 16 * mb + g, d_hi = d_lo + 8;
#else
        using G = Geom<0>;
        const int j = mb / (G::EV / 2), P = mb % (G::EV / 2), base = (g + 8 * j) * G::EV;
        const int d_lo = base + pair_elem<0>(P, 0), d_hi = base + pair_elem<0>(P, 1);
#endif
        dst[2 * t * HEAD_DIM + d_lo] = o[mb][0];
        dst[(2 * t + 1) * HEAD_DIM + d_lo] = o[mb][1];
        dst[2 * t * HEAD_DIM + d_hi] = o[mb][2];
        dst[(2 * t + 1) * HEAD_DIM + d_hi] = o[mb][3];
    }
}

// The kernel's work for K and V groups of GK and GV elements (quantized caches; 0 for plain ones).
template <int GK, int GV>
__device__ __forceinline__ void decode_block(const DecodeParams& p, const void* tma = nullptr) {
    wait_for_prior_grid();  // launched dependent (decode.rs): the stream's previous kernel may write q or the caches
    unsigned char* smem = &shared_memory<unsigned char>();
#if DECODE_TMA
    smem += (1024 - smem_addr(smem) % 1024) % 1024;  // the swizzled stages: 1024-byte aligned
#endif
    const DecodeWork w(p);
    const int g = (threadIdx.x % 32) / 4;
    using G = Geom<CACHE_BITS>;
    const StageLayout L = stage_layout(p, G::SROW_K, G::SROW_V, STAGE_BYTES, STAGE_KEY_ROUND);
    const bool active = w.state0 < p.states;
    const int wk_n = NUM_WARPS / p.warp_states;
    constexpr bool q4 = CACHE_BITS == 4, q8 = CACHE_BITS == 8;
    constexpr int NGK = CACHE_BITS ? HEAD_DIM / GK : 1, NGV = CACHE_BITS ? HEAD_DIM / GV : 1;

    u32 qa[Q_REGS];
    float qs[NGK][2];
    float qinv[2] = {1.f, 1.f};  // the states' q scaling, undone (decode_q8.h; 4-bit: qinv[0], decode_q4.h's kf)
    WeightRange wr;  // quantized: the V weights' range (decode_weights.h)
    if constexpr (q4) {
        q4_load_q<GK>(qa, qs, qinv[0], p, w);
    } else if constexpr (q8) {
        q8_load_q<GK>(qa, qs, qinv, p, w);
    } else {
        load_q<0>(qa, p, w);
    }
    // This lane's columns of S^T and O^T: states cs and cs + 1.
    const int cs = col_state();
    const int2 vis[2] = {visible_keys(p, w, w.row_of(p, w.state0 + cs)), visible_keys(p, w, w.row_of(p, w.state0 + cs + 1))};
    // Quantized: past HEAD_DIM / 16, each V group's sums of the weights (decode_q4.h, decode_q8.h).
    constexpr int NO = HEAD_DIM / 16 + (CACHE_BITS ? V_SUMS(GV) : 0);
    float o[NO][4], cv[NGV][2];
#pragma unroll
    for (int mb = 0; mb < NO; ++mb) o[mb][0] = o[mb][1] = o[mb][2] = o[mb][3] = 0.f;
#pragma unroll
    for (int i = 0; i < NGV; ++i) cv[i][0] = cv[i][1] = 0.f;
    // States 2t, 2t + 1: running max (log2 domain) and this lane's part of the sum.
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

    const ScaleOffset k_off(p, w, groups_k(p)), v_off(p, w, groups_v(p));

    // Quantized caches in warp-owned stages (decode.h pipeline; 2-6 % faster on the H200); plain ones
    // keep the block's shared copies (bf16 1 x 131072 was 2 % slower warp-owned, bench/RESULTS.md).
    pipeline<CACHE_BITS ? KEY_BLOCK : 0>(smem, L, p, w, [&](const unsigned char* stage, int key0, int nkeys) {
        if (!active) return;
        const u32 stage_s = smem_addr(stage);  // the stage's shared-space address, once per stage
        // A warp's blocks: wk, wk + wk_n, ... of the stage; a step takes STEP_BLOCKS of them (the
        // last may lie past nkeys: zero-filled rows, masked).
        for (int r0 = w.wk * KEY_BLOCK; r0 < nkeys; r0 += STEP_BLOCKS * wk_n * KEY_BLOCK) {
            int rows[STEP_BLOCKS];
#pragma unroll
            for (int b = 0; b < STEP_BLOCKS; ++b) rows[b] = r0 + b * wk_n * KEY_BLOCK;
            if constexpr (PAIRED) {
                block_step_paired<GK, GV>(o, cv, wr, m, l, qa, qs, qinv[0], stage, stage_s, L, p, key0, nkeys, rows, vis, k_off, v_off);
            } else if constexpr (CACHE_BITS != 0) {
                block_step_quant<CACHE_BITS, GK, GV, STEP_BLOCKS>(o, cv, wr, qinv, m, l, qa, qs, stage, stage_s, L, p, key0, nkeys, rows,
                                                                  vis, k_off, v_off);
            } else {
                block_step<STEP_BLOCKS>(o, m, l, qa, stage, L, p, key0, nkeys, rows, vis);
            }
        }
    }, tma);

#if PAIRED
    // Block 1's columns of O^T (lanes t ^ 2) into block 0's: both lanes then hold the same sums, and
    // both store them (the same values to the same places).
#pragma unroll
    for (int mb = 0; mb < NO; ++mb)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mb][e] += __shfl_xor_sync(0xffffffffu, o[mb][e], 2);
#endif
    // Partials: m, l and o of states cs, cs + 1 (lanes g = 0 write m and l; o undoes the V pairs).
    l[0] = column_sum(l[0]);
    l[1] = column_sum(l[1]);
    const Partials part(smem, HEAD_DIM);
    const int row = (threadIdx.x / 32) * STATE_TILE;
    if (g == 0) {
        part.m[row + cs] = m[0], part.l[row + cs] = l[0];
        part.m[row + cs + 1] = m[1], part.l[row + cs + 1] = l[1];
    }
    if constexpr (q4) {
        store_quant_partial_o<GV>(part.o + row * HEAD_DIM, o, cv, wr, Q4_MAGIC_SUMS, Q4_V_UNIT, [g](int mb) { return make_int2(q4_group<GV>(mb), q4_dim_of(mb, g)); });
    } else if constexpr (q8) {
        store_quant_partial_o<GV>(part.o + row * HEAD_DIM, o, cv, wr, Q8_MAGIC_SUMS, 1.f, [g](int mb) { return make_int2(q8_group<GV>(mb), q8_dim_of(mb, g)); });
    } else {
        store_partial_o(part.o + row * HEAD_DIM, o);
    }
    __syncthreads();
    store_states(p, w, part);
    if (p.cluster) cluster_merge(p, w, smem);
}

#if DECODE_TMA
extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS) flash_decode(const __grid_constant__ DecodeTmaParams tp) {
    decode_block<K_GROUP, V_GROUP>(tp.p, &tp);  // the maps are read where they lie, in the parameter space
}
#else
extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS) flash_decode(const DecodeParams p) {
#if CACHE_BITS != 0
    decode_block<K_GROUP, V_GROUP>(p);  // the host picks the kernel by the caches' group sizes
#else
    decode_block<0, 0>(p);
#endif
}
#endif
