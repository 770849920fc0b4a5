// bwd_dq_sm90_f32.cu — dQ for Hopper (sm_90a) in f32, the products as split TF32 on warpgroup MMA
// (sm90_f32.h: TF32_TERMS = 3 "exact", 1 "tf32"). D = 64 and 128, plain problems (causal or not,
// GQA); dK and dV are bwd_dkdv_sm90_f32.cu's. Deterministic: each block owns its rows.
// Both precisions run the fp16 form (*_sm90_f32_f16.cu: the same bits on fp16 tensor cores, 1.6-2.6x
// faster on an H200) unless FLASH_NIF_TF32_PARTS=1 (config.rs's f16_parts).
//
// Grid (ceil(Sq / BLOCK_M), H, B), causal heaviest first; BLOCK_M = 64 query rows per consumer
// warpgroup, CONSUMERS = 2 with BLOCK_N = 32 keys a tile, but at D = 128 under "exact" 1 with 16
// (two TF32 parts of Q and dO for 128 rows would fill 256 KiB); NUM_WARPS = 4 (1 + CONSUMERS):
// - warpgroup 0, the producer: Q and dO once (RowTiles: the A operands of S and dP), then per key
//   tile K and V as RowTiles (the B operands of S = Q K^T and dP = dO V^T) and K again as a
//   TransposedTile (K^T: the B operand of dQ += dS K, whose A is registers), STAGES deep. The next
//   tile is loaded into registers before waiting for its stage.
// - the consumers own 64 query rows each (warp w: 16 rows, the mma.sync accumulator layout). Per
//   key tile:
//     S = Q K^T, dP = dO V^T                 (ss, from zero)
//     P = exp2(S scale_log2 - lse_log2), dS = P (dP - delta)    (masked where the tile needs it)
//     dQ += dS K                             (rs: dS as an AFrag)
//   With split products each tile's dS K runs in a fresh accumulator added to dQ in f32 (see
//   bwd_dkdv_sm90_f32.cu). dQ *= scale at the end.
//
// Shared memory (TERMS = 2 at TF32_TERMS = 3): Q and dO 2 x TERMS x BLOCK_M x D x 4 = 128 KiB; per
//   stage K, V and K^T 3 x TERMS x BLOCK_N x D x 4 = 48 KiB: 224 KiB with two stages.
#include "sm90_f32.h"
#include "tile.h"
#include "block.h"
#include "mask.h"

#define CONSUMERS (NUM_WARPS / 4 - 1)
#ifndef STAGES
#define STAGES 2
#endif
#if FLASH_DTYPE != 2 || NUM_WARPS != 4 * (1 + CONSUMERS) || BLOCK_M != 64 * CONSUMERS || BLOCK_N != 16 * CONSUMERS || \
    MASKED || MODS
#error "bwd_dq_sm90_f32: f32, consumer warpgroups of 64 rows (two: 32 keys a tile; one: 16 keys), plain"
#endif

#define FRESH (TERMS == 2)  // each tile's dS K in a fresh accumulator
#define PAIRED_B (TERMS == 2)  // the stage's K and V rows as ss_products_paired's B operands (sm90_f32.h)
// Registers per thread after setmaxnreg (sm90_f32.h's run_roles checks the split). The producer holds a tile of K, V and
// K^T (3 x BLOCK_N x D / 128 floats); a consumer dQ, S, dP, dS's AFrag and a fresh accumulator (one
// consumer at D = 128: 64 columns each; a producer held to 96 spilled 8 bytes, NVRTC 13.5).
// "tf32" (one part, no fresh sums): a consumer needs far fewer, and the producer holds the next
// tile besides (PREFETCH).
#if TERMS == 2 && CONSUMERS == 1
#define PRODUCER_REGS 128
#define CONSUMER_REGS 248
#define PREFETCH 0
#elif TERMS == 2
#define PRODUCER_REGS 120
#define CONSUMER_REGS 192
#define PREFETCH 0
#else
#define PRODUCER_REGS 168
#define CONSUMER_REGS 168
#define PREFETCH (HEAD_DIM == 64)  // at D = 128 a tile is 96 floats a producer thread
#endif

#define TILE_BYTES(rows) (TERMS * PART_BYTES(rows))  // a RowTile's parts
using StageT = TransposedTile<BLOCK_N>;                // K^T
constexpr u32 STAGE_BYTES = 2 * TILE_BYTES(BLOCK_N) + StageT::BYTES;  // K, V, K^T

// Shared memory, from a base aligned to the swizzle's period (1024 bytes): Q, dO [TERMS][D / 32]
// [BLOCK_M][32]; STAGES stages of K, V [D / 32][TERMS][BLOCK_N][32] (ss_products_paired's B) and
// K^T (TransposedTile<BLOCK_N>); the mbarriers qdo_full, full[STAGES], empty[STAGES].
constexpr u32 SMEM_Q = 0;
constexpr u32 SMEM_DO = SMEM_Q + TILE_BYTES(BLOCK_M);
constexpr u32 SMEM_STAGES = SMEM_DO + TILE_BYTES(BLOCK_M);
constexpr u32 SMEM_BARS = SMEM_STAGES + STAGES * STAGE_BYTES;
constexpr u32 SMEM_END = SMEM_BARS + 8 * (1 + 2 * STAGES);
FLASH_EXPORT_SMEM(SWIZZLED_SMEM_BYTES(SMEM_END))

struct SmemAt {
    u32 base;
    __device__ __forceinline__ u32 q() const { return base + SMEM_Q; }
    __device__ __forceinline__ u32 dout() const { return base + SMEM_DO; }
    __device__ __forceinline__ u32 k(u32 s) const { return base + SMEM_STAGES + s * STAGE_BYTES; }
    __device__ __forceinline__ u32 v(u32 s) const { return k(s) + TILE_BYTES(BLOCK_N); }
    __device__ __forceinline__ u32 kt(u32 s) const { return k(s) + 2 * TILE_BYTES(BLOCK_N); }
    __device__ __forceinline__ u32 qdo_full() const { return base + SMEM_BARS; }
    __device__ __forceinline__ u32 full(u32 s) const { return base + SMEM_BARS + 8 * (1 + s); }
    __device__ __forceinline__ u32 empty(u32 s) const { return base + SMEM_BARS + 8 * (1 + STAGES + s); }
};

using StageRing = Ring<STAGES>;  // hopper.h

// ---- the producer -------------------------------------------------------------------------------------
__device__ __forceinline__ void produce(const FlashParams& p, const QueryBlock& blk, const SmemAt smem) {
    const float* q = p.q + blk.q_at(p.q_st);
    const float* dout = p.dout + blk.q_at(p.do_st);
    store_row_tile<BLOCK_M>(smem.q(), q, p.q_st.seq, blk.m0, blk.Sq);
    store_row_tile<BLOCK_M>(smem.dout(), dout, p.do_st.seq, blk.m0, blk.Sq);
    publish(smem.qdo_full());

    const float* k = p.k + blk.kv_at(p.k_st);
    const float* v = p.v + blk.kv_at(p.v_st);
    // Key tile j in registers: K and V as RowTiles, K as a TransposedTile.
    struct KeyTileRegs {
        RowTile<BLOCK_N> kr, vr;
        StageT kt;
    };
    auto load = [&](KeyTileRegs& t, int n0) {
        t.kr.load(k, p.k_st.seq, n0, blk.Sk);
        t.vr.load(v, p.v_st.seq, n0, blk.Sk);
        t.kt.load(k, p.k_st.seq, n0, blk.Sk);
    };
    auto store = [&](const KeyTileRegs& t, int j) {
        const u32 s = StageRing::stage(j);
        if (j >= STAGES) mbar_wait(smem.empty(s), StageRing::phase(j) ^ 1);
        t.kr.store<BLOCK_N, PAIRED_B>(smem.k(s), 0);
        t.vr.store<BLOCK_N, PAIRED_B>(smem.v(s), 0);
        t.kt.store(smem.kt(s));
        publish(smem.full(s));
    };
#if PREFETCH
    // Tile j + 1's loads are in flight while tile j is stored.
    KeyWalk w = blk.key_walk();
    if (!w.more()) return;
    KeyTileRegs cur;
    load(cur, w.n0());
#pragma unroll 1
    for (; w.more(); w.advance()) {
        KeyTileRegs nxt;
        if (w.has_next()) load(nxt, w.next_n0());
        store(cur, w.j);
        cur = nxt;
    }
#else
#pragma unroll 1
    for (KeyWalk w = blk.key_walk(); w.more(); w.advance()) {
        KeyTileRegs t;
        load(t, w.n0());
        store(t, w.j);
    }
#endif
}

// ---- the consumers --------------------------------------------------------------------------------------
__device__ __forceinline__ void consume(const FlashParams& p, const QueryBlock& blk, const SmemAt smem, int c) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4;
    const int row0 = blk.m0 + 64 * c + 16 * warp;  // this warp's 16 rows
    const Visibility vis = blk.vis();
    float lse2[2], dlt[2];
    blk.row_stats(p, row0 + g, lse2[0], dlt[0]);
    blk.row_stats(p, row0 + g + 8, lse2[1], dlt[1]);

    float dq[HEAD_DIM / 8][4];
    zero(dq);
    const u32 q = opaque(smem.q()) + 64 * c * 128, dout = opaque(smem.dout()) + 64 * c * 128;
    mbar_wait(smem.qdo_full(), 0);
#pragma unroll 1
    for (KeyWalk w = blk.key_walk(); w.more(); w.advance()) {
        const u32 st = StageRing::stage(w.j);
        mbar_wait(smem.full(st), StageRing::phase(w.j));
        float s[BLOCK_N / 8][4], dp[BLOCK_N / 8][4];
        abt_pair<BLOCK_N>(s, dp, q, dout, PART_BYTES(BLOCK_M), BLOCK_M, opaque(smem.k(st)), opaque(smem.v(st)), BLOCK_N);  // S, dP
        if (blk.tile_mask(w)) mask_tile<BLOCK_N / 8>(s, row0, w.n0(), vis);
#pragma unroll
        for (int i = 0; i < BLOCK_N / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e / 2;
                const float pr = fast_exp2(s[i][e] * p.scale_log2 - lse2[r]);
                s[i][e] = pr * (dp[i][e] - dlt[r]);  // dS
            }
        AFrag<BLOCK_N / 8> da;
        da.set(s);
        const u32 kt = opaque(smem.kt(st));
#if FRESH
        float fresh[HEAD_DIM / 8][4];
        wgmma_fence();
        rs_products<HEAD_DIM>(fresh, da, kt, StageT::PART, 0, false);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(fresh);
        add_into(dq, fresh, 0);
#else
        wgmma_fence();
        rs_products<HEAD_DIM>(dq, da, kt, StageT::PART, 0, true);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(dq);
#endif
        if (lane == 0) mbar_arrive(smem.empty(st));  // the stage is read
    }
    store_tile<HEAD_DIM / 8>(p.dq + blk.q_at(p.dq_st), dq, p.scale, p.scale, row0, blk.Sq, 0, p.dq_st.seq);
}

#include "bwd_dq_sm90_f32_entry.h"
