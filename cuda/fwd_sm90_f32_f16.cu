// fwd_sm90_f32_f16.cu — the f32 attention forward for Hopper (sm_90a) with its products on fp16
// warpgroup MMA (m64nNk16, f32 accumulators): each f32 operand x is held as two fp16 parts of
// a power-of-two-scaled copy, x 2^e = big + small, big = f16(x 2^e), small = f16(x 2^e - big)
// (x 2^e - big is exact in f32), and a b ~ big_a small_b + small_a big_b + big_a big_b, unscaled
// by 2^-(e_a + e_b). 11 + 11 significant bits, as split TF32 (fwd_sm90_f32.cu), at twice TF32's
// tensor rate and half its shared-memory bytes.
//
// The scaling keeps both parts normal fp16: e brings a tile's largest |x| into [2^14, 2^15), so
// big <= 2^15 < 65504, and every element down to 2^-17 of that largest one keeps a normal small
// part (fp16's normals start at 2^-14; below, the error stays under 2^-39 of the tile's largest
// element: absolute, which is what the scores' softmax and o's sums feel). One exponent per Q tile
// (BLOCK_N rows: a consumer warpgroup's 64, or at BLOCK_N 128 both's), per key tile (K, V);
// P = exp2(...) <= 1 takes a fixed 2^15.
//
// D = 64 and 128, plain problems (causal or not, GQA), both precisions: TF32_TERMS = 3 ("exact":
// two parts, three products) or 1 ("tf32": the big part, one product). Grid (ceil(Sq / BLOCK_M), H,
// B), causal heaviest first; NUM_WARPS = 12:
// - warpgroup 0, the producer: Q's BLOCK_N-row tiles, then K_0, V_0, K_1, V_1, ..., each from global
//   memory into registers (with RAW_STAGES > 0 through a ring of raw f32 buffers that cp.async fills
//   that many tiles ahead: RawRing), finds the tile's exponent (a max over the warpgroup), and stores
//   the parts into 128-byte-swizzled [D / 64][rows][64] column blocks (fwd_sm90.cu's layout: Q and
//   K read K-major, V MN-major), the exponent beside them; then arrives on the stage's mbarrier.
// - warpgroups 1, 2 own 64 query rows each (warp w: 16 rows, the mma.sync accumulator layout).
//   Per key tile j: P_{j-1} V_{j-1} one 64-column slice at a time (rs: P's parts in registers),
//   each slice summed in a fresh accumulator and added to O in f32 times 2^-(15 + e_v) (one chain
//   over every key tile would bias o with the tensor cores' truncating adds, see
//   fwd_sm90_f32.cu); then S_j = Q K_j^T (ss, chained from zero) and its softmax (the scale times
//   the tile's 2^-(e_q + e_k)). Issued one after the other, so that P's parts and a slice are dead
//   while S_j's registers are live (overlapping them spilled at D = 128, and measured slower); the
//   other consumer warpgroup's products fill the tensor cores meanwhile.
//
// Shared memory (TERMS fp16 parts each): Q TERMS BLOCK_M D 2 bytes, K and V TERMS BLOCK_N D 2 bytes a
//   stage. "exact" at D = 128: BLOCK_M 128, BLOCK_N 64, two K and two V stages: 64 + 64 + 64 KiB =
//   192 KiB; at D = 64 96 KiB; "tf32" half that. Then the raw ring, RAW_STAGES tiles of BLOCK_N D 4
//   bytes (D = 128: 32 KiB).
#include "sm90_f16_parts.h"
#include "tile.h"
#include "block.h"
#include "softmax.h"
#include "fwd_store.h"

#define CONSUMERS (NUM_WARPS / 4 - 1)
#ifndef STAGES
#define STAGES 2
#endif
#ifndef K_STAGES
#define K_STAGES STAGES
#endif
#if !F16_PARTS || FLASH_DTYPE != 2 || CONSUMERS != 2 || BLOCK_M != 64 * CONSUMERS || (BLOCK_N != 64 && BLOCK_N != 128) || MASKED
#error "fwd_sm90_f32_f16: f32, two consumer warpgroups of 64 rows, BLOCK_N 64 or 128, plain"
#endif

#define COL_BLOCKS (HEAD_DIM / 64)                     // 64-element (128-byte) column blocks of a row
#define P_EXP 15                                       // P's scale: P 2^15 <= 2^15
// Registers after setmaxnreg (run_roles checks the split): the producer holds one K or V tile (D = 128:
// 64 floats) and its addresses; a consumer O (64), S (32), P's parts (32) and a P V slice (32).
#define PRODUCER_REGS 120
#define CONSUMER_REGS 192

// Shared memory, from a base aligned to the swizzle's period: Q [TERMS][D / 64][BLOCK_M][64];
// K [K_STAGES][TERMS][D / 64][BLOCK_N][64]; V [STAGES][the same]; the raw ring [RAW_STAGES][BLOCK_N][D]
// f32; the exponents (int): Q's per raw tile (Q_TILES), K's and V's per stage, and the producer's
// max exchange (2 slots of 4 warps); the mbarriers.
constexpr u32 SMEM_Q = 0;
constexpr u32 SMEM_K = SMEM_Q + TERMS * H_PART_BYTES(BLOCK_M);
constexpr u32 SMEM_V = SMEM_K + K_STAGES * TERMS * H_PART_BYTES(BLOCK_N);
// The producer's ring of raw f32 tiles (Q's tiles, then K_0, V_0, K_1, ...), RAW_STAGES deep
// (config.rs chooses; 0: none, each tile loaded when converted).
#ifndef RAW_STAGES
#define RAW_STAGES 0
#endif
constexpr u32 SMEM_RAW = SMEM_V + STAGES * TERMS * H_PART_BYTES(BLOCK_N);
using Raw = RawRing<BLOCK_N, RAW_STAGES>;
constexpr u32 SMEM_EXP = SMEM_RAW + Raw::BYTES;
#define Q_TILES (BLOCK_M / BLOCK_N)  // Q's raw tiles (exponents): one per consumer warpgroup, or one for both
constexpr u32 EXP_Q = 0, EXP_K = Q_TILES, EXP_V = EXP_K + K_STAGES, EXP_XCHG = EXP_V + STAGES;
constexpr u32 SMEM_BARS = SMEM_EXP + 4 * ((EXP_XCHG + 8 + 1) / 2 * 2);
constexpr u32 SMEM_END = SMEM_BARS + 8 * (1 + 2 * K_STAGES + 2 * STAGES);
static_assert(SWIZZLED_SMEM_BYTES(SMEM_END) <= SM90_SMEM_MAX, "fwd_sm90_f32_f16: shared memory");
FLASH_EXPORT_SMEM(SWIZZLED_SMEM_BYTES(SMEM_END))

struct SmemAt {
    u32 base;
    __device__ __forceinline__ u32 q() const { return base + SMEM_Q; }
    __device__ __forceinline__ u32 k(u32 s) const { return base + SMEM_K + s * TERMS * H_PART_BYTES(BLOCK_N); }
    __device__ __forceinline__ u32 v(u32 s) const { return base + SMEM_V + s * TERMS * H_PART_BYTES(BLOCK_N); }
    __device__ __forceinline__ Raw raw() const { return {base + SMEM_RAW}; }
    __device__ __forceinline__ u32 exp(u32 i) const { return base + SMEM_EXP + 4 * i; }
    __device__ __forceinline__ u32 q_full() const { return base + SMEM_BARS; }
    __device__ __forceinline__ u32 k_full(u32 s) const { return base + SMEM_BARS + 8 * (1 + s); }
    __device__ __forceinline__ u32 k_empty(u32 s) const { return base + SMEM_BARS + 8 * (1 + K_STAGES + s); }
    __device__ __forceinline__ u32 v_full(u32 s) const { return base + SMEM_BARS + 8 * (1 + 2 * K_STAGES + s); }
    __device__ __forceinline__ u32 v_empty(u32 s) const { return base + SMEM_BARS + 8 * (1 + 2 * K_STAGES + STAGES + s); }
};

using KRing = Ring<K_STAGES>;
using VRing = Ring<STAGES>;

// Raw tile t: Q's rows BLOCK_N t.. (t < Q_TILES), then K_j (t = Q_TILES + 2 j) and V_j (t = Q_TILES
// + 2 j + 1), each BLOCK_N rows with one exponent.
struct RawSource {
    const float* src;
    i64 stride;
    int r0, nrows;
};
__device__ __forceinline__ RawSource raw_source(const FlashParams& p, const QueryBlock& blk, int t) {
    if (t < Q_TILES) return {p.q + blk.q_at(p.q_st), p.q_st.seq, blk.m0 + BLOCK_N * t, blk.Sq};
    const int j = (t - Q_TILES) / 2;
    if ((t - Q_TILES) % 2 == 0) return {p.k + blk.kv_at(p.k_st), p.k_st.seq, j * BLOCK_N, blk.Sk};
    return {p.v + blk.kv_at(p.v_st), p.v_st.seq, j * BLOCK_N, blk.Sk};
}

__device__ __forceinline__ void produce(const FlashParams& p, const QueryBlock& blk, const SmemAt smem) {
    const Raw raw = smem.raw();
    const int raw_tiles = Q_TILES + 2 * blk.key_walk().n_tiles;
    auto copy = [&](int t) {
        const RawSource r = raw_source(p, blk, t);
        raw.copy(t, t < raw_tiles, r.src, r.stride, r.r0, r.nrows);
    };
    int slot = 0;
    // Raw tile t into registers, its exponent, and the ring's next copy into its buffer (the
    // thread's reads of it have returned: the max used them).
    auto take = [&](int t, HalfTile<BLOCK_N>& x) {
        const RawSource r = raw_source(p, blk, t);
        raw.take(t, x, r.src, r.stride, r.r0, r.nrows);
        const int e = tile_exponent(x.max_bits(), smem.exp(EXP_XCHG), slot);
        copy(t + Raw::depth);
        return e;
    };
#pragma unroll 1
    for (int t = 0; t < Raw::depth; ++t) copy(t);
#pragma unroll 1
    for (int t = 0; t < Q_TILES; ++t) {
        HalfTile<BLOCK_N> x;
        const int e = take(t, x);
        x.store<BLOCK_M>(smem.q(), BLOCK_N * t, e);
        if (threadIdx.x == 0) st_shared_u32(smem.exp(EXP_Q + t), (u32)e);
    }
    publish(smem.q_full());
    // K_j and V_j, each in its own code (their rings' stages and barriers as constants).
#pragma unroll 1
    for (int j = 0, t = Q_TILES; t < raw_tiles; ++j, t += 2) {
        HalfTile<BLOCK_N> x;
        int e = take(t, x);
        u32 s = KRing::stage(j);
        if (j >= K_STAGES) mbar_wait(smem.k_empty(s), KRing::phase(j) ^ 1);
        x.store<BLOCK_N>(smem.k(s), 0, e);
        if (threadIdx.x == 0) st_shared_u32(smem.exp(EXP_K + s), (u32)e);
        publish(smem.k_full(s));

        e = take(t + 1, x);
        s = VRing::stage(j);
        if (j >= STAGES) mbar_wait(smem.v_empty(s), VRing::phase(j) ^ 1);
        x.store<BLOCK_N>(smem.v(s), 0, e);
        if (threadIdx.x == 0) st_shared_u32(smem.exp(EXP_V + s), (u32)e);
        publish(smem.v_full(s));
    }
}

// ---- the consumers ----------------------------------------------------------------------------------
// A consumer warpgroup (c = 0, 1) on rows m0 + 64 c .. of the block.
__device__ __forceinline__ void consume(const FlashParams& p, const QueryBlock& blk, const SmemAt smem, int c) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int row0 = blk.m0 + 64 * c + 16 * warp;  // this warp's 16 rows
    const Visibility vis = blk.vis();

    float o[HEAD_DIM / 8][4];
    float s[BLOCK_N / 8][4];
    float ot[8][4];  // a 64-column slice of P V
    HFrag<BLOCK_N / 16> pp;  // P's parts, scaled by 2^P_EXP
    OnlineSoftmax sm;
    zero(o);
    sm.init(NEG_INF);
    mbar_wait(smem.q_full(), 0);
    // The scores' scale with Q's 2^-e of this warpgroup's rows (K's per tile below).
    const float q_scale = p.scale_log2 * exp2i(-ld_shared_s32(smem.exp(EXP_Q + 64 * c / BLOCK_N)));

    // O += P V for V at stage vs, one 64-column slice at a time; then V's stage is free.
    auto pv = [&](u32 vs) {
        const u32 v = opaque(smem.v(vs));
        const int ev = ld_shared_s32(smem.exp(EXP_V + vs));
#pragma unroll
        for (int cb = 0; cb < COL_BLOCKS; ++cb) {
            h_ab_slice<BLOCK_N / 16>(ot, pp, v, H_PART_BYTES(BLOCK_N), cb);
            wgmma_wait<0>();
            fence_regs(ot);
            add_slice(o, ot, 8 * cb, P_EXP, P_EXP, ev);
        }
        if (lane == 0) mbar_arrive(smem.v_empty(vs));
    };

    // Per key tile j: P_{j-1} V_{j-1} slice by slice, then S_j (issued last, so that P's parts and
    // the slice's accumulator are dead while S_j's registers are live: with S_j in flight beside
    // them, or a softmax overlapping P V, the consumers spilled at D = 128). The other consumer
    // warpgroup's products fill the tensor cores meanwhile.
    KeyWalk w = blk.key_walk();
    const u32 q = opaque(smem.q()) + 64 * c * 128;
    for (; w.more(); w.advance()) {
        const u32 st = KRing::stage(w.j), vs = VRing::stage(w.j - 1);
        if (w.j > 0) {
            mbar_wait(smem.v_full(vs), VRing::phase(w.j - 1));
            pv(vs);
        }
        mbar_wait(smem.k_full(st), KRing::phase(w.j));
        wgmma_fence();
        h_abt<BLOCK_N>(s, q, H_PART_BYTES(BLOCK_M), BLOCK_M, opaque(smem.k(st)), H_PART_BYTES(BLOCK_N));  // S = Q K^T
        wgmma_commit();
        wgmma_wait<0>();
        const int ek = ld_shared_s32(smem.exp(EXP_K + st));
        if (lane == 0) mbar_arrive(smem.k_empty(st));
        fence_regs(s);
        float alpha[2];
        if (blk.tile_mask(w)) mask_tile<BLOCK_N / 8>(s, row0, w.n0(), vis);
        sm.step_scaled(s, positive_scale(q_scale * exp2i(-ek)), alpha);
        OnlineSoftmax::rescale_rows(o, alpha);
        pp.set(s, exp2i(P_EXP), exp2i(P_EXP));
    }
    if (w.j > 0) {
        const u32 vs = VRing::stage(w.j - 1);
        mbar_wait(smem.v_full(vs), VRing::phase(w.j - 1));
        pv(vs);
    }

    store_rows<HEAD_DIM / 8>(p, blk, o, sm, row0);
}

#include "fwd_sm90_f32_entry.h"
