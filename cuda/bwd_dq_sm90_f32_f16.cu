// bwd_dq_sm90_f32_f16.cu — dQ for Hopper (sm_90a) in f32 with its products on fp16 warpgroup MMA,
// each operand as scaled fp16 parts (sm90_f16_parts.h: TF32_TERMS = 3 "exact", three products of
// two-part operands; 1 "tf32", one). D = 64 and 128, plain problems (causal or not, GQA); dK and dV
// are bwd_dkdv_sm90_f32.cu's. Deterministic: each block owns its rows.
//
// Grid (ceil(Sq / BLOCK_M), H, B), causal heaviest first; two consumer warpgroups of 64 query rows,
// BLOCK_N keys a tile (64 at D = 64, 32 at D = 128); NUM_WARPS = 12:
// - warpgroup 0, the producer: Q and dO once (32 rows at a time, an exponent each), then per key
//   tile K and V (an exponent each), STAGES deep. K serves S = Q K^T (K-major) and dQ += dS K
//   (MN-major, fp16 wgmma transposes it on the fly): no K^T copy, unlike the TF32 kernel.
// - the consumers own 64 query rows each (warp w: 16 rows, the mma.sync accumulator layout). Per
//   key tile:
//     S = Q K^T, dP = dO V^T                    (ss, from zero; unscaled by their tiles' 2^-e)
//     P = exp2(S scale_log2 - lse_log2), dS = P (dP - delta)    (masked where the tile needs it)
//     dQ += dS K                                (rs: dS's parts, each row scaled by its own 2^e,
//                                                which brings the row's largest |dS| into
//                                                [2^14, 2^15); the tile's sum in a fresh
//                                                accumulator, 64 columns at a time, unscaled and
//                                                added to dQ in f32)
//   dQ *= scale at the end.
//
// Shared memory (two fp16 parts each under "exact"): Q and dO 2 x 2 x BLOCK_M x D x 2 bytes, per stage
//   K and V 2 x 2 x BLOCK_N x D x 2: D = 128 64 + 64 + 2 x 32 KiB = 192 KiB; D = 64 (64 keys) 128.
//   The stages' space first holds raw f32 pieces of Q and dO (up to 8 x 32 rows): D = 128 "exact"
//   96 KiB of it (6 pieces), else all 8.
#include "sm90_f16_parts.h"
#include "tile.h"
#include "block.h"
#include "mask.h"

#define CONSUMERS (NUM_WARPS / 4 - 1)
#ifndef STAGES
#define STAGES 2
#endif
#if !F16_PARTS || FLASH_DTYPE != 2 || CONSUMERS != 2 || BLOCK_M != 64 * CONSUMERS || (BLOCK_N != 32 && BLOCK_N != 64) || \
    MASKED || MODS
#error "bwd_dq_sm90_f32_f16: f32, two consumer warpgroups of 64 rows, BLOCK_N 32 or 64, plain"
#endif

#define COL_BLOCKS (HEAD_DIM / 64)  // 64-element column blocks of a row: dS K's slices
// dS K's slices all issued before the first is added (slice cb + 1's product under slice cb's FMAs):
// one part ("tf32") only, since "exact"'s two parts and a second slice spilled at D = 128.
constexpr bool SLICES_TOGETHER = TERMS == 1 && COL_BLOCKS > 1;
// Registers after setmaxnreg (run_roles checks the split): the producer holds a K and a V tile
// (2 x BLOCK_N x D / 128 floats: 64) and their addresses; a consumer dQ, S, dP, dS's parts and a
// 64-column slice of the tile's dS K.
#define PRODUCER_REGS 120
#define CONSUMER_REGS 192

constexpr u32 TILE_BYTES = TERMS * H_PART_BYTES(BLOCK_N);  // K's or V's parts
// Q and dO are loaded as 32-row pieces (Q_0, dO_0, Q_1, ...) through a raw ring (sm90_f16_parts.h)
// QDO_SLOTS pieces deep in the stages' space (free until the first K and V): one after another, their
// loads' latencies made most of a block's start-up (the consumers' waits for Q and dO).
constexpr int QDO_PIECES = 2 * BLOCK_M / 32;
constexpr u32 PIECE_BYTES = RawRing<32, 1>::TILE_BYTES;
constexpr u32 EXP_Q = 0, EXP_DO = BLOCK_M / 32, EXP_K = 2 * BLOCK_M / 32, EXP_V = EXP_K + STAGES, EXP_XCHG = EXP_V + STAGES;
constexpr u32 EXP_BYTES = 4 * ((EXP_XCHG + 8 + 1) / 2 * 2), BAR_BYTES = 8 * (1 + 2 * STAGES);
// Shared memory, from a base aligned to the swizzle's period: Q, dO [TERMS][D / 64][BLOCK_M][64];
// STAGES stages of K, V [TERMS][D / 64][BLOCK_N][64], first as the pieces' slots (as many as fit
// beside the rest, up to all of them); the exponents (int): Q's and dO's per 32 rows, K's and V's
// per stage, the producer's max exchange (2 slots of 4 warps); the mbarriers.
constexpr u32 SMEM_Q = 0;
constexpr u32 SMEM_DO = SMEM_Q + TERMS * H_PART_BYTES(BLOCK_M);
constexpr u32 SMEM_STAGES = SMEM_DO + TERMS * H_PART_BYTES(BLOCK_M);
constexpr u32 STAGES_ROOM = SM90_SMEM_MAX - 1024 - SMEM_STAGES - EXP_BYTES - BAR_BYTES;  // SWIZZLED_SMEM_BYTES
constexpr int QDO_SLOTS = STAGES_ROOM / PIECE_BYTES < QDO_PIECES ? STAGES_ROOM / PIECE_BYTES : QDO_PIECES;
static_assert(QDO_SLOTS >= 1, "bwd_dq_sm90_f32_f16: no room for a piece of Q");
using Pieces = RawRing<32, QDO_SLOTS>;
constexpr u32 STAGES_BYTES = STAGES * 2 * TILE_BYTES > Pieces::BYTES ? STAGES * 2 * TILE_BYTES : Pieces::BYTES;
constexpr u32 SMEM_EXP = SMEM_STAGES + STAGES_BYTES;
constexpr u32 SMEM_BARS = SMEM_EXP + EXP_BYTES;
constexpr u32 SMEM_END = SMEM_BARS + BAR_BYTES;
static_assert(SWIZZLED_SMEM_BYTES(SMEM_END) <= SM90_SMEM_MAX, "bwd_dq_sm90_f32_f16: shared memory");
FLASH_EXPORT_SMEM(SWIZZLED_SMEM_BYTES(SMEM_END))

struct SmemAt {
    u32 base;
    __device__ __forceinline__ u32 q() const { return base + SMEM_Q; }
    __device__ __forceinline__ u32 dout() const { return base + SMEM_DO; }
    __device__ __forceinline__ u32 k(u32 s) const { return base + SMEM_STAGES + s * 2 * TILE_BYTES; }
    __device__ __forceinline__ u32 v(u32 s) const { return k(s) + TILE_BYTES; }
    __device__ __forceinline__ Pieces pieces() const { return {base + SMEM_STAGES}; }
    __device__ __forceinline__ u32 exp(u32 i) const { return base + SMEM_EXP + 4 * i; }
    __device__ __forceinline__ u32 qdo_full() const { return base + SMEM_BARS; }
    __device__ __forceinline__ u32 full(u32 s) const { return base + SMEM_BARS + 8 * (1 + s); }
    __device__ __forceinline__ u32 empty(u32 s) const { return base + SMEM_BARS + 8 * (1 + STAGES + s); }
};

using StageRing = Ring<STAGES>;  // hopper.h

// ---- the producer -------------------------------------------------------------------------------------
__device__ __forceinline__ void produce(const FlashParams& p, const QueryBlock& blk, const SmemAt smem) {
    const float* q = p.q + blk.q_at(p.q_st);
    const float* dout = p.dout + blk.q_at(p.do_st);
    // Piece k: Q's (k even) or dO's rows 32 (k / 2)..
    const Pieces pieces = smem.pieces();
    auto copy_piece = [&](int k) {
        const bool is_q = k % 2 == 0;
        pieces.copy(k, k < QDO_PIECES, is_q ? q : dout, is_q ? p.q_st.seq : p.do_st.seq, blk.m0 + 32 * (k / 2), blk.Sq);
    };
#pragma unroll 1
    for (int k = 0; k < QDO_SLOTS; ++k) copy_piece(k);
    int slot = 0;
#pragma unroll 1
    for (int k = 0; k < QDO_PIECES; ++k) {
        HalfTile<32> t;
        pieces.take(k, t, nullptr, 0, 0, 0);  // a ring of depth >= 1 reads its buffer, never the source
        const int e = tile_exponent(t.max_bits(), smem.exp(EXP_XCHG), slot);
        // Into the buffer just read (the ring's refill rule). The stages' first stores come after
        // another exponent's barrier: every thread's reads are done.
        copy_piece(k + QDO_SLOTS);
        const int r = 32 * (k / 2);
        t.store<BLOCK_M>(k % 2 == 0 ? smem.q() : smem.dout(), r, e);
        if (threadIdx.x == 0) st_shared_u32(smem.exp((k % 2 == 0 ? EXP_Q : EXP_DO) + r / 32), (u32)e);
    }
    publish(smem.qdo_full());

    const float* k = p.k + blk.kv_at(p.k_st);
    const float* v = p.v + blk.kv_at(p.v_st);
#pragma unroll 1
    for (KeyWalk w = blk.key_walk(); w.more(); w.advance()) {
        HalfTile<BLOCK_N> kt, vt;
        kt.load(k, p.k_st.seq, w.n0(), blk.Sk);
        vt.load(v, p.v_st.seq, w.n0(), blk.Sk);
        const int ek = tile_exponent(kt.max_bits(), smem.exp(EXP_XCHG), slot);
        const int ev = tile_exponent(vt.max_bits(), smem.exp(EXP_XCHG), slot);
        const u32 s = StageRing::stage(w.j);
        if (w.j >= STAGES) mbar_wait(smem.empty(s), StageRing::phase(w.j) ^ 1);
        kt.store<BLOCK_N>(smem.k(s), 0, ek);
        vt.store<BLOCK_N>(smem.v(s), 0, ev);
        if (threadIdx.x == 0) {
            st_shared_u32(smem.exp(EXP_K + s), (u32)ek);
            st_shared_u32(smem.exp(EXP_V + s), (u32)ev);
        }
        publish(smem.full(s));
    }
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
    // Q's and dO's 2^-e of this warp's 32-row group (K's and V's per tile below).
    const int piece = (64 * c + 16 * warp) / 32;
    const float q_unscale = exp2i(-ld_shared_s32(smem.exp(EXP_Q + piece)));
    const float do_unscale = exp2i(-ld_shared_s32(smem.exp(EXP_DO + piece)));
#pragma unroll 1
    for (KeyWalk w = blk.key_walk(); w.more(); w.advance()) {
        const u32 st = StageRing::stage(w.j);
        mbar_wait(smem.full(st), StageRing::phase(w.j));
        const u32 k = opaque(smem.k(st));
        float s[BLOCK_N / 8][4], dp[BLOCK_N / 8][4];
        wgmma_fence();
        h_abt<BLOCK_N>(s, q, H_PART_BYTES(BLOCK_M), BLOCK_M, k, H_PART_BYTES(BLOCK_N));
        h_abt<BLOCK_N>(dp, dout, H_PART_BYTES(BLOCK_M), BLOCK_M, opaque(smem.v(st)), H_PART_BYTES(BLOCK_N));
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(s);
        fence_regs(dp);
        const int ek = ld_shared_s32(smem.exp(EXP_K + st));
        const float s_scale = positive_scale(p.scale_log2 * q_unscale * exp2i(-ek));
        const float dp_unscale = do_unscale * exp2i(-ld_shared_s32(smem.exp(EXP_V + st)));
        if (blk.tile_mask(w)) mask_tile<BLOCK_N / 8>(s, row0, w.n0(), vis);
        float mx[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < BLOCK_N / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e / 2;
                const float pr = fast_exp2(s[i][e] * s_scale - lse2[r]);
                s[i][e] = pr * (dp[i][e] * dp_unscale - dlt[r]);  // dS
                mx[r] = fmaxf(mx[r], fabsf(s[i][e]));
            }
        const int e0 = row_exponent(mx[0]), e1 = row_exponent(mx[1]);
        HFrag<BLOCK_N / 16> ds;
        ds.set(s, exp2i(e0), exp2i(e1));
        add_sliced_product<BLOCK_N / 16, SLICES_TOGETHER>(dq, ds, k, e0, e1, ek);
        if (lane == 0) mbar_arrive(smem.empty(st));  // the stage is read
    }
    store_tile<HEAD_DIM / 8>(p.dq + blk.q_at(p.dq_st), dq, p.scale, p.scale, row0, blk.Sq, 0, p.dq_st.seq);
}

#include "bwd_dq_sm90_f32_entry.h"
