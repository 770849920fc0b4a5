// bwd_dkdv_sm90_f32.cu — dK and dV for Hopper (sm_90a) in f32, the products as split TF32 on
// warpgroup MMA (sm90_f32.h: TF32_TERMS = 3 "exact", 1 "tf32"). D = 64 and 128, plain problems
// (causal or not, GQA); dQ is bwd_dq_sm90_f32.cu's (no atomics: both deterministic).
// Both precisions run the fp16 form (*_sm90_f32_f16.cu: the same bits on fp16 tensor cores, 1.6-2.6x
// faster on an H200) unless FLASH_NIF_TF32_PARTS=1 (config.rs's f16_parts).
//
// Grid (ceil(Sk / BLOCK_N), Hkv, B); NUM_WARPS = 12:
// - warpgroup 0, the producer: K and V once (RowTiles: the A operands of S^T and dP^T), then per
//   (query head, query tile) of the block's walk (block.h's KeyBlock) Q and dO twice each, as
//   RowTiles (the B operands of S^T = K Q^T and dP^T = V dO^T) and as TransposedTiles (Q^T and
//   dO^T: the B operands of dK += dS^T Q and dV += P^T dO, whose A operands are registers), and the
//   rows' lse_log2 and delta (+inf and 0 past Sq), into a stage (STAGES). The next tile is loaded
//   into registers before waiting for the stage.
// - warpgroups 1 and 2, the consumers (warp w: keys 16 w.. of the warpgroup's 64), both taking
//   every tile of the walk. Per tile the products
//     S^T = K Q^T, dP^T = V dO^T            (ss, from zero)
//     P^T, dS^T                             (bwd_grads.h, the mma accumulator layout per warp)
//     dV += P^T dO, dK += dS^T Q            (rs: P^T and dS^T as AFrags)
//   shared in one of two ways:
//   - D = 64 (BLOCK_N = 128, BLOCK_M = 32): each consumer owns 64 keys and runs all four.
//   - D = 128 (ROLES; BLOCK_N = 64, BLOCK_M = 16): K and V's parts for 128 keys would take 256 KiB,
//     and dK, dV and a fresh accumulator of 128 columns 192 registers a thread. Both consumers take
//     the same 64 keys: consumer 0 S^T, P^T and dV, consumer 1 dP^T, dS^T and dK, P^T passed
//     through shared memory (XCHG; the two warpgroups' accumulator layouts are the same, so each
//     thread reads what its twin wrote). Each holds one gradient.
//   With split products each tile's dV and dK sums run in a fresh accumulator added in f32 (the
//   tensor cores' truncating accumulation over a chain of every query tile would bias them, as it
//   did the forward's O: fwd_sm90_f32.cu's Accumulation).
//
// Shared memory (TERMS = 2 at TF32_TERMS = 3): K and V 2 x TERMS x BLOCK_N x D x 4 = 128 KiB; STAGES
//   stages of Q, dO, Q^T and dO^T, 4 x TERMS x BLOCK_M x D x 4 = 64 KiB each, and of lse / delta;
//   (ROLES) P^T, 4 KiB; the barriers: 192 KiB (D = 128: 196) with one stage. "tf32" (TERMS = 1)
//   takes two stages in 128 KiB (D = 128: three in 208, Q^T and dO^T padded to 128-byte rows; 32
//   query rows a step in 200 KiB measured 2 % slower on an H200).
// Work per tile at D = 64: 2 consumers x 4 products of 64 x 32 x 64, 3 TF32 products each: 6.3
//   MFLOP, ~3000 cycles at the SM's 2048 TF32 FLOP / cycle; the producer ~8 float4 + 32 scalar
//   loads, ~200 conversions and 32 16-byte stores per thread, ~1200 cycles with the loads' latency.
//   (A first version, 64 keys with the consumers taking the tiles in turn, each in its own stage,
//   did half the products per produced tile: its consumers waited for their stages ~60 % of the
//   time, ncu.) At D = 128: 2 x 2 products of 64 x 16 x 128, ~770 cycles; the shared-memory reads
//   (K's and V's parts once per 16 query rows) ~1800 at 128 bytes a cycle.
#include "sm90_f32.h"
#include "tile.h"
#include "block.h"
#include "bwd_grads.h"

#define CONSUMERS 2
#define ROLES (HEAD_DIM == 128)  // both consumers on the same 64 keys, one gradient each (see above)
#ifndef STAGES
#define STAGES 1
#endif
#if FLASH_DTYPE != 2 || NUM_WARPS != 4 * (1 + CONSUMERS) || MASKED || MODS ||                        \
    (HEAD_DIM == 64 && (BLOCK_N != 64 * CONSUMERS || BLOCK_M != 32)) || (ROLES && (BLOCK_N != 64 || BLOCK_M != 16))
#error "bwd_dkdv_sm90_f32: f32, plain; D 64: two consumer warpgroups of 64 keys, 32 query rows a step; D 128: 64 keys, 16 rows"
#endif

#define FRESH (TERMS == 2)  // each tile's dK / dV sums in a fresh accumulator (see above)
#define PAIRED_B (TERMS == 2)  // the stage's Q and dO rows as ss_products_paired's B operands (sm90_f32.h)
// Registers per thread after setmaxnreg (sm90_f32.h's run_roles checks the split). The producer holds a tile of Q, dO,
// Q^T and dO^T (4 x 32 x D / 128 floats) and their addresses; a consumer dK, dV, S^T, dP^T, the
// AFrags of P^T and dS^T and a fresh accumulator.
#define PRODUCER_REGS 120
#define CONSUMER_REGS 192

#define TILE_BYTES(rows) (TERMS * PART_BYTES(rows))  // a RowTile's parts
using StageT = TransposedTile<BLOCK_M>;                // Q^T, dO^T
constexpr u32 STAGE_BYTES = 2 * TILE_BYTES(BLOCK_M) + 2 * StageT::BYTES;  // Q, dO, Q^T, dO^T
// ROLES: consumer 0's P^T for consumer 1, [BLOCK_M / 8][128 threads] float4s.
constexpr u32 XCHG_BYTES = ROLES ? BLOCK_M / 8 * 128 * 16 : 0;
#define XCHG_FULL 1   // named barriers (ROLES): P^T written,
#define XCHG_EMPTY 2  // and read

// Shared memory, from a base aligned to the swizzle's period (1024 bytes): K, V [TERMS][D / 32]
// [BLOCK_N][32]; STAGES stages of Q, dO [D / 32][TERMS][BLOCK_M][32] (ss_products_paired's B),
// Q^T, dO^T (TransposedTile<BLOCK_M>) (each stage 1024-byte aligned); STAGES of lse_log2 and delta
// [BLOCK_M]; (ROLES) P^T; the mbarriers kv_full, full[STAGES], empty[STAGES]. 32-bit offsets from
// one base (as fwd_sm90_f32.cu).
constexpr u32 SMEM_K = 0;
constexpr u32 SMEM_V = SMEM_K + TILE_BYTES(BLOCK_N);
constexpr u32 SMEM_STAGE = SMEM_V + TILE_BYTES(BLOCK_N);
constexpr u32 SMEM_STATS = SMEM_STAGE + STAGES * STAGE_BYTES;
constexpr u32 SMEM_XCHG = SMEM_STATS + STAGES * 2 * BLOCK_M * 4;
constexpr u32 SMEM_BARS = SMEM_XCHG + XCHG_BYTES;
constexpr u32 SMEM_END = SMEM_BARS + 8 * (1 + 2 * STAGES);
FLASH_EXPORT_SMEM(SWIZZLED_SMEM_BYTES(SMEM_END))

struct SmemAt {
    u32 base;
    __device__ __forceinline__ u32 k() const { return base + SMEM_K; }
    __device__ __forceinline__ u32 v() const { return base + SMEM_V; }
    // Stage st's tiles: Q, dO (RowTiles), Q^T, dO^T (TransposedTiles), lse_log2, delta.
    __device__ __forceinline__ u32 q(u32 st) const { return base + SMEM_STAGE + st * STAGE_BYTES; }
    __device__ __forceinline__ u32 dout(u32 st) const { return q(st) + TILE_BYTES(BLOCK_M); }
    __device__ __forceinline__ u32 qt(u32 st) const { return q(st) + 2 * TILE_BYTES(BLOCK_M); }
    __device__ __forceinline__ u32 dot(u32 st) const { return qt(st) + StageT::BYTES; }
    __device__ __forceinline__ u32 xchg() const { return base + SMEM_XCHG; }
    __device__ __forceinline__ u32 lse(u32 st) const { return base + SMEM_STATS + st * 2 * BLOCK_M * 4; }
    __device__ __forceinline__ u32 delta(u32 st) const { return lse(st) + BLOCK_M * 4; }
    __device__ __forceinline__ u32 kv_full() const { return base + SMEM_BARS; }
    __device__ __forceinline__ u32 full(u32 st) const { return base + SMEM_BARS + 8 * (1 + st); }
    __device__ __forceinline__ u32 empty(u32 st) const { return base + SMEM_BARS + 8 * (1 + STAGES + st); }
};

using StageRing = Ring<STAGES>;  // hopper.h

// ---- the producer -------------------------------------------------------------------------------------
__device__ __forceinline__ void produce(const FlashParams& p, const KeyBlock& blk, const SmemAt smem) {
    const QueryWalk w0 = blk.query_walk();
    if (!w0.more()) return;
    {
        const float* k = p.k + blk.kv_at(p.k_st);
        const float* v = p.v + blk.kv_at(p.v_st);
        store_row_tile<BLOCK_N>(smem.k(), k, p.k_st.seq, blk.n0, blk.Sk);
        store_row_tile<BLOCK_N>(smem.v(), v, p.v_st.seq, blk.n0, blk.Sk);
        publish(smem.kv_full());
    }
    const int tid = threadIdx.x % PRODUCER_THREADS;
#pragma unroll 1
    for (QueryWalk w = w0; w.more(); w.advance()) {
        const int j = w.it();
        const int h = blk.head(j), m0 = blk.query_row(j);
        const float* q = p.q + blk.q_at(p.q_st, h);
        const float* dout = p.dout + blk.q_at(p.do_st, h);
        RowTile<BLOCK_M> qr, dr;
        StageT qt, dt;
        qr.load(q, p.q_st.seq, m0, blk.Sq);
        dr.load(dout, p.do_st.seq, m0, blk.Sq);
        qt.load(q, p.q_st.seq, m0, blk.Sq);
        dt.load(dout, p.do_st.seq, m0, blk.Sq);
        float lse2 = POS_INF, dlt = 0.f;
        if (tid < BLOCK_M && m0 + tid < blk.Sq) {
            const i64 at = blk.stat_base(p, h) + m0 + tid;
            lse2 = p.lse_log2[at];
            dlt = p.delta[at];
        }
        const u32 st = StageRing::stage(j);
        if (j >= STAGES) mbar_wait(smem.empty(st), StageRing::phase(j) ^ 1);
        qr.store<BLOCK_M, PAIRED_B>(smem.q(st), 0);
        dr.store<BLOCK_M, PAIRED_B>(smem.dout(st), 0);
        qt.store(smem.qt(st));
        dt.store(smem.dot(st));
        if (tid < BLOCK_M) {
            st_shared_f32(smem.lse(st) + 4 * tid, lse2);
            st_shared_f32(smem.delta(st) + 4 * tid, dlt);
        }
        publish(smem.full(st));
    }
}

// ---- the consumers --------------------------------------------------------------------------------------
// d (+)= A B over the tile's query rows (rs: A an AFrag of P^T or dS^T, B the stage's dO^T or Q^T).
// FRESH: summed in a fresh accumulator, waited for and added to d in f32; else chained into d,
// issued and not waited for.
__device__ __forceinline__ void add_product(float (&d)[HEAD_DIM / 8][4], const AFrag<BLOCK_M / 8>& a, u32 bt) {
#if FRESH
    float fresh[HEAD_DIM / 8][4];
    wgmma_fence();
    rs_products<HEAD_DIM>(fresh, a, bt, StageT::PART, 0, false);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(fresh);
    add_into(d, fresh, 0);
#else
    wgmma_fence();
    rs_products<HEAD_DIM>(d, a, bt, StageT::PART, 0, true);
    wgmma_commit();
#endif
}

#if !ROLES
__device__ __forceinline__ void consume(const FlashParams& p, const KeyBlock& blk, const SmemAt smem, int c) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int key0 = blk.n0 + 64 * c + 16 * warp;  // this warp's 16 keys
    const u32 k_rows = smem.k() + 64 * c * 128, v_rows = smem.v() + 64 * c * 128;  // the warpgroup's keys
    float dk[HEAD_DIM / 8][4], dv[HEAD_DIM / 8][4];
    zero(dk);
    zero(dv);
    const QueryWalk w0 = blk.query_walk();
    if (w0.more()) mbar_wait(smem.kv_full(), 0);
#pragma unroll 1
    for (int j = 0; j < w0.n_iter; ++j) {
        const int h = blk.head(j), m0 = blk.query_row(j);
        const u32 st = StageRing::stage(j);
        mbar_wait(smem.full(st), StageRing::phase(j));
        float s[BLOCK_M / 8][4], dp[BLOCK_M / 8][4];
        // S^T = K Q^T, dP^T = V dO^T (descriptors opaque per iteration: hoisted out of the loop they
        // would take the products' registers)
        abt_pair<BLOCK_M>(s, dp, opaque(k_rows), opaque(v_rows), PART_BYTES(BLOCK_N), BLOCK_N, opaque(smem.q(st)),
                          opaque(smem.dout(st)), BLOCK_M);
        const float* lse2 = reinterpret_cast<const float*>(__cvta_shared_to_generic(smem.lse(st)));
        const float* dlt = reinterpret_cast<const float*>(__cvta_shared_to_generic(smem.delta(st)));
        const bool masked = key_slice_needs_mask(key0, m0, blk.Sq, blk.Sk);
        grads_t<BLOCK_M / 8>(s, dp, p.scale_log2, masked, key0, m0, blk.vis(h), lse2, dlt);
        AFrag<BLOCK_M / 8> pa, da;
        pa.set(s);
        da.set(dp);
        add_product(dv, pa, opaque(smem.dot(st)));
        add_product(dk, da, opaque(smem.qt(st)));
#if !FRESH
        wgmma_wait<0>();
        fence_regs(dk);
        fence_regs(dv);
#endif
        if (lane == 0) mbar_arrive(smem.empty(st));  // the stage is read
    }
    store_tile<HEAD_DIM / 8>(p.dk + blk.kv_at(p.dk_st), dk, p.scale, p.scale, key0, blk.Sk, 0, p.dk_st.seq);
    store_tile<HEAD_DIM / 8>(p.dv + blk.kv_at(p.dv_st), dv, 1.f, 1.f, key0, blk.Sk, 0, p.dv_st.seq);
}
#else

// Consumer ROLE (0: S^T, P^T, dV; 1: dP^T, dS^T, dK) over the block's 64 keys (see above).
template <int ROLE>
__device__ __forceinline__ void consume_role(const FlashParams& p, const KeyBlock& blk, const SmemAt smem) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, tid = threadIdx.x % 128;
    const int key0 = blk.n0 + 16 * warp;  // this warp's 16 keys
    float grad[HEAD_DIM / 8][4];          // dV (role 0) or dK (role 1)
    zero(grad);
    const QueryWalk w0 = blk.query_walk();
    if (w0.more()) mbar_wait(smem.kv_full(), 0);
#pragma unroll 1
    for (int j = 0; j < w0.n_iter; ++j) {
        const int h = blk.head(j), m0 = blk.query_row(j);
        const u32 st = StageRing::stage(j);
        mbar_wait(smem.full(st), StageRing::phase(j));
        float s[BLOCK_M / 8][4];  // S^T (role 0) or dP^T (role 1)
        abt<BLOCK_M>(s, opaque(ROLE == 0 ? smem.k() : smem.v()), PART_BYTES(BLOCK_N), BLOCK_N,
                     opaque(ROLE == 0 ? smem.q(st) : smem.dout(st)), BLOCK_M);
        if (ROLE == 0) {
            const float* lse2 = reinterpret_cast<const float*>(__cvta_shared_to_generic(smem.lse(st)));
            probs_t<BLOCK_M / 8>(s, p.scale_log2, key_slice_needs_mask(key0, m0, blk.Sq, blk.Sk), key0, m0, blk.vis(h), lse2);
            if (j > 0) named_sync(XCHG_EMPTY, 256);  // consumer 1 has read the last P^T
#pragma unroll
            for (int i = 0; i < BLOCK_M / 8; ++i)
                st_shared_v4(smem.xchg() + (i * 128 + tid) * 16, s[i][0], s[i][1], s[i][2], s[i][3]);
            named_arrive(XCHG_FULL, 256);
        } else {
            float pt[BLOCK_M / 8][4];
            named_sync(XCHG_FULL, 256);
            const float4* x = reinterpret_cast<const float4*>(__cvta_shared_to_generic(smem.xchg()));
#pragma unroll
            for (int i = 0; i < BLOCK_M / 8; ++i) {
                const float4 v = x[i * 128 + tid];
                pt[i][0] = v.x, pt[i][1] = v.y, pt[i][2] = v.z, pt[i][3] = v.w;
            }
            if (j + 1 < w0.n_iter) named_arrive(XCHG_EMPTY, 256);  // consumer 0 syncs on it from its 2nd tile
            dscores_t<BLOCK_M / 8>(s, pt, reinterpret_cast<const float*>(__cvta_shared_to_generic(smem.delta(st))));
        }
        AFrag<BLOCK_M / 8> a;
        a.set(s);
        add_product(grad, a, opaque(ROLE == 0 ? smem.dot(st) : smem.qt(st)));
#if !FRESH
        wgmma_wait<0>();
        fence_regs(grad);
#endif
        if (lane == 0) mbar_arrive(smem.empty(st));  // the stage is read
    }
    if (ROLE == 0)
        store_tile<HEAD_DIM / 8>(p.dv + blk.kv_at(p.dv_st), grad, 1.f, 1.f, key0, blk.Sk, 0, p.dv_st.seq);
    else
        store_tile<HEAD_DIM / 8>(p.dk + blk.kv_at(p.dk_st), grad, p.scale, p.scale, key0, blk.Sk, 0, p.dk_st.seq);
}
#endif

#include "bwd_dkdv_sm90_f32_entry.h"
