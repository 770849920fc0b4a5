// bwd_dkdv_sm90_f32_f16.cu — dK and dV for Hopper (sm_90a) in f32 with their products on fp16
// warpgroup MMA, each operand as scaled fp16 parts (sm90_f16_parts.h: TF32_TERMS = 3 "exact", three
// products of two-part operands; 1 "tf32", one). D = 64 and 128, plain problems (causal or not,
// GQA); dQ is bwd_dq_sm90_f32_f16.cu's (no atomics: both deterministic).
//
// Grid (ceil(Sk / BLOCK_N), Hkv, B); NUM_WARPS = 12:
// - warpgroup 0, the producer: K and V once (an exponent each), then per (query head, query tile)
//   of the block's walk (block.h's KeyBlock) Q and dO (BLOCK_M = 32 rows, an exponent each) and the
//   rows' lse_log2 and delta (+inf and 0 past Sq), into a stage (STAGES). Q and dO serve both the
//   score products (K-major B operands) and dK += dS^T Q, dV += P^T dO (MN-major: fp16 wgmma
//   transposes them on the fly; the TF32 kernel stores transposed copies).
// - warpgroups 1 and 2, the consumers (warp w: keys 16 w.. of the warpgroup's 64). Per tile
//     S^T = K Q^T, dP^T = V dO^T       (ss, from zero; unscaled by their tiles' 2^-e)
//     P^T, dS^T                        (bwd_grads.h, the mma accumulator layout per warp)
//     dV += P^T dO, dK += dS^T Q       (rs: P^T's parts scaled by 2^15, dS^T's per key row by the
//                                      2^e that brings the row's largest |dS| into [2^14, 2^15);
//                                      each tile's sum in a fresh accumulator, 64 columns at a
//                                      time, unscaled and added in f32)
//   shared in one of two ways (as bwd_dkdv_sm90_f32.cu):
//   - D = 64 (BLOCK_N = 128): each consumer owns 64 keys and runs all four.
//   - D = 128 (ROLES; BLOCK_N = 64): both consumers take the same 64 keys: consumer 0 S^T, P^T and
//     dV, consumer 1 dP^T, dS^T and dK, P^T passed through shared memory (XCHG). Each holds one
//     gradient (dK, dV and a fresh slice together would not fit the registers).
//
// Shared memory (two fp16 parts each under "exact"): K and V 2 x 2 x BLOCK_N x D x 2 bytes (64
//   KiB), STAGES stages of Q and dO 2 x 2 x 32 x D x 2 (D = 128: 32 KiB) and lse / delta.
#include "sm90_f16_parts.h"
#include "tile.h"
#include "block.h"
#include "bwd_grads.h"

#define CONSUMERS 2
#define ROLES (HEAD_DIM == 128)  // both consumers on the same 64 keys, one gradient each (see above)
#ifndef STAGES
#define STAGES 2
#endif
#if !F16_PARTS || FLASH_DTYPE != 2 || NUM_WARPS != 4 * (1 + CONSUMERS) || MASKED || MODS || BLOCK_M != 32 || \
    BLOCK_N != (ROLES ? 64 : 64 * CONSUMERS)
#error "bwd_dkdv_sm90_f32_f16: f32, plain, 32 query rows a step; D 64: two consumer warpgroups of 64 keys; D 128: 64 keys"
#endif

#define COL_BLOCKS (HEAD_DIM / 64)  // 64-element column blocks of a row: the gradients' slices
// A product's slices all issued before the first is added (slice cb + 1's product under slice cb's
// FMAs; both precisions fit here, unlike bwd_dq_sm90_f32_f16.cu's "exact").
constexpr bool SLICES_TOGETHER = COL_BLOCKS > 1;
#define P_EXP 15                    // P^T's scale: P 2^15 <= 2^15
// Registers after setmaxnreg (run_roles checks the split): the producer holds K or V (BLOCK_N x D /
// 128 floats: 64) once, then a Q and a dO tile (2 x 32 x D / 128); a consumer its gradients, S^T,
// dP^T, the parts of P^T and dS^T and a 64-column fresh slice.
#define PRODUCER_REGS 120
#define CONSUMER_REGS 192

constexpr u32 KV_BYTES = TERMS * H_PART_BYTES(BLOCK_N);     // K's or V's parts
constexpr u32 ROWS_BYTES = TERMS * H_PART_BYTES(BLOCK_M);   // Q's or dO's parts
constexpr u32 STAGE_BYTES = 2 * ROWS_BYTES;                 // Q, dO
// ROLES: consumer 0's P^T for consumer 1, [BLOCK_M / 8][128 threads] float4s.
constexpr u32 XCHG_BYTES = ROLES ? BLOCK_M / 8 * 128 * 16 : 0;
#define XCHG_FULL 2   // named barriers (ROLES): P^T written (1 is SCALE_BARRIER),
#define XCHG_EMPTY 3  // and read

// Shared memory, from a base aligned to the swizzle's period: K, V [TERMS][D / 64][BLOCK_N][64];
// STAGES stages of Q, dO [TERMS][D / 64][BLOCK_M][64]; STAGES of lse_log2 and delta [BLOCK_M]; the
// exponents (int): K's, V's, Q's and dO's per stage, the producer's max exchange (2 slots of 4
// warps); (ROLES) P^T; the mbarriers kv_full, full[STAGES], empty[STAGES].
constexpr u32 SMEM_K = 0;
constexpr u32 SMEM_V = SMEM_K + KV_BYTES;
constexpr u32 SMEM_STAGE = SMEM_V + KV_BYTES;
constexpr u32 SMEM_STATS = SMEM_STAGE + STAGES * STAGE_BYTES;
constexpr u32 SMEM_EXP = SMEM_STATS + STAGES * 2 * BLOCK_M * 4;
constexpr u32 EXP_K = 0, EXP_V = 1, EXP_Q = 2, EXP_DO = EXP_Q + STAGES, EXP_XCHG = EXP_DO + STAGES;
constexpr u32 SMEM_XCHG = SMEM_EXP + 16 * ((EXP_XCHG + 8 + 3) / 4);
constexpr u32 SMEM_BARS = SMEM_XCHG + XCHG_BYTES;
constexpr u32 SMEM_END = SMEM_BARS + 8 * (1 + 2 * STAGES);
FLASH_EXPORT_SMEM(SWIZZLED_SMEM_BYTES(SMEM_END))

struct SmemAt {
    u32 base;
    __device__ __forceinline__ u32 k() const { return base + SMEM_K; }
    __device__ __forceinline__ u32 v() const { return base + SMEM_V; }
    __device__ __forceinline__ u32 q(u32 st) const { return base + SMEM_STAGE + st * STAGE_BYTES; }
    __device__ __forceinline__ u32 dout(u32 st) const { return q(st) + ROWS_BYTES; }
    __device__ __forceinline__ u32 lse(u32 st) const { return base + SMEM_STATS + st * 2 * BLOCK_M * 4; }
    __device__ __forceinline__ u32 delta(u32 st) const { return lse(st) + BLOCK_M * 4; }
    __device__ __forceinline__ u32 exp(u32 i) const { return base + SMEM_EXP + 4 * i; }
    __device__ __forceinline__ u32 xchg() const { return base + SMEM_XCHG; }
    __device__ __forceinline__ u32 kv_full() const { return base + SMEM_BARS; }
    __device__ __forceinline__ u32 full(u32 st) const { return base + SMEM_BARS + 8 * (1 + st); }
    __device__ __forceinline__ u32 empty(u32 st) const { return base + SMEM_BARS + 8 * (1 + STAGES + st); }
};

using StageRing = Ring<STAGES>;  // hopper.h

__device__ __forceinline__ const float* generic(u32 addr) { return reinterpret_cast<const float*>(__cvta_shared_to_generic(addr)); }

// ---- the producer -------------------------------------------------------------------------------------
__device__ __forceinline__ void produce(const FlashParams& p, const KeyBlock& blk, const SmemAt smem) {
    const QueryWalk w0 = blk.query_walk();
    if (!w0.more()) return;
    int slot = 0;
    {
        HalfTile<BLOCK_N> t;
        t.load(p.k + blk.kv_at(p.k_st), p.k_st.seq, blk.n0, blk.Sk);
        int e = tile_exponent(t.max_bits(), smem.exp(EXP_XCHG), slot);
        t.store<BLOCK_N>(smem.k(), 0, e);
        if (threadIdx.x == 0) st_shared_u32(smem.exp(EXP_K), (u32)e);
        t.load(p.v + blk.kv_at(p.v_st), p.v_st.seq, blk.n0, blk.Sk);
        e = tile_exponent(t.max_bits(), smem.exp(EXP_XCHG), slot);
        t.store<BLOCK_N>(smem.v(), 0, e);
        if (threadIdx.x == 0) st_shared_u32(smem.exp(EXP_V), (u32)e);
        publish(smem.kv_full());
    }
    const int tid = threadIdx.x % PRODUCER_THREADS;
#pragma unroll 1
    for (QueryWalk w = w0; w.more(); w.advance()) {
        const int j = w.it();
        const int h = blk.head(j), m0 = blk.query_row(j);
        HalfTile<BLOCK_M> qt, dt;
        qt.load(p.q + blk.q_at(p.q_st, h), p.q_st.seq, m0, blk.Sq);
        dt.load(p.dout + blk.q_at(p.do_st, h), p.do_st.seq, m0, blk.Sq);
        float lse2 = POS_INF, dlt = 0.f;
        if (tid < BLOCK_M && m0 + tid < blk.Sq) {
            const i64 at = blk.stat_base(p, h) + m0 + tid;
            lse2 = p.lse_log2[at];
            dlt = p.delta[at];
        }
        const int eq = tile_exponent(qt.max_bits(), smem.exp(EXP_XCHG), slot);
        const int edo = tile_exponent(dt.max_bits(), smem.exp(EXP_XCHG), slot);
        const u32 st = StageRing::stage(j);
        if (j >= STAGES) mbar_wait(smem.empty(st), StageRing::phase(j) ^ 1);
        qt.store<BLOCK_M>(smem.q(st), 0, eq);
        dt.store<BLOCK_M>(smem.dout(st), 0, edo);
        if (tid < BLOCK_M) {
            st_shared_f32(smem.lse(st) + 4 * tid, lse2);
            st_shared_f32(smem.delta(st) + 4 * tid, dlt);
        }
        if (tid == 0) {
            st_shared_u32(smem.exp(EXP_Q + st), (u32)eq);
            st_shared_u32(smem.exp(EXP_DO + st), (u32)edo);
        }
        publish(smem.full(st));
    }
}

// ---- the consumers --------------------------------------------------------------------------------------
// d += A B over the tile's query rows (rs: A the parts of P^T or dS^T, B the stage's dO or Q, MN-major),
// slice by slice in a fresh accumulator, each row's sum times 2^-e0 (row g) or 2^-e1 (g + 8) and 2^-e.
__device__ __forceinline__ void add_product(float (&d)[HEAD_DIM / 8][4], const HFrag<BLOCK_M / 16>& a, u32 b, int e0,
                                            int e1, int e) {
    add_sliced_product<BLOCK_M / 16, SLICES_TOGETHER>(d, a, b, e0, e1, e);
}

// dS^T's parts, each key row scaled by its own exponent; returns the rows' exponents.
__device__ __forceinline__ int2 dscores_parts(HFrag<BLOCK_M / 16>& a, const float (&ds)[BLOCK_M / 8][4]) {
    float mx[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < BLOCK_M / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], fabsf(ds[i][e]));
    const int e0 = row_exponent(mx[0]), e1 = row_exponent(mx[1]);
    a.set(ds, exp2i(e0), exp2i(e1));
    return make_int2(e0, e1);
}

// The scores' scale with K's and this stage's Q exponents, and dP^T's 2^-(e_v + e_dO).
__device__ __forceinline__ float scores_scale(const FlashParams& p, const SmemAt smem, u32 st) {
    return positive_scale(p.scale_log2 * exp2i(-ld_shared_s32(smem.exp(EXP_K))) * exp2i(-ld_shared_s32(smem.exp(EXP_Q + st))));
}
__device__ __forceinline__ float dp_unscale(const SmemAt smem, u32 st) {
    return exp2i(-ld_shared_s32(smem.exp(EXP_V))) * exp2i(-ld_shared_s32(smem.exp(EXP_DO + st)));
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
        wgmma_fence();
        h_abt<BLOCK_M>(s, opaque(k_rows), H_PART_BYTES(BLOCK_N), BLOCK_N, opaque(smem.q(st)), H_PART_BYTES(BLOCK_M));
        h_abt<BLOCK_M>(dp, opaque(v_rows), H_PART_BYTES(BLOCK_N), BLOCK_N, opaque(smem.dout(st)), H_PART_BYTES(BLOCK_M));
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(s);
        fence_regs(dp);
        const bool masked = key_slice_needs_mask(key0, m0, blk.Sq, blk.Sk);
        probs_t<BLOCK_M / 8>(s, scores_scale(p, smem, st), masked, key0, m0, blk.vis(h), generic(smem.lse(st)));
        dscores_t<BLOCK_M / 8>(dp, s, generic(smem.delta(st)), dp_unscale(smem, st));
        HFrag<BLOCK_M / 16> a;
        a.set(s, exp2i(P_EXP), exp2i(P_EXP));
        const int eq = ld_shared_s32(smem.exp(EXP_Q + st)), edo = ld_shared_s32(smem.exp(EXP_DO + st));
        add_product(dv, a, opaque(smem.dout(st)), P_EXP, P_EXP, edo);
        const int2 e = dscores_parts(a, dp);
        add_product(dk, a, opaque(smem.q(st)), e.x, e.y, eq);
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
        wgmma_fence();
        h_abt<BLOCK_M>(s, opaque(ROLE == 0 ? smem.k() : smem.v()), H_PART_BYTES(BLOCK_N), BLOCK_N,
                       opaque(ROLE == 0 ? smem.q(st) : smem.dout(st)), H_PART_BYTES(BLOCK_M));
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(s);
        HFrag<BLOCK_M / 16> a;
        if (ROLE == 0) {
            probs_t<BLOCK_M / 8>(s, scores_scale(p, smem, st), key_slice_needs_mask(key0, m0, blk.Sq, blk.Sk), key0, m0,
                                 blk.vis(h), generic(smem.lse(st)));
            if (j > 0) named_sync(XCHG_EMPTY, 256);  // consumer 1 has read the last P^T
#pragma unroll
            for (int i = 0; i < BLOCK_M / 8; ++i)
                st_shared_v4(smem.xchg() + (i * 128 + tid) * 16, s[i][0], s[i][1], s[i][2], s[i][3]);
            named_arrive(XCHG_FULL, 256);
            a.set(s, exp2i(P_EXP), exp2i(P_EXP));
            const int edo = ld_shared_s32(smem.exp(EXP_DO + st));
            add_product(grad, a, opaque(smem.dout(st)), P_EXP, P_EXP, edo);
        } else {
            float pt[BLOCK_M / 8][4];
            named_sync(XCHG_FULL, 256);
            const float4* x = reinterpret_cast<const float4*>(generic(smem.xchg()));
#pragma unroll
            for (int i = 0; i < BLOCK_M / 8; ++i) {
                const float4 v = x[i * 128 + tid];
                pt[i][0] = v.x, pt[i][1] = v.y, pt[i][2] = v.z, pt[i][3] = v.w;
            }
            if (j + 1 < w0.n_iter) named_arrive(XCHG_EMPTY, 256);  // consumer 0 syncs on it from its 2nd tile
            dscores_t<BLOCK_M / 8>(s, pt, generic(smem.delta(st)), dp_unscale(smem, st));
            const int2 e = dscores_parts(a, s);
            const int eq = ld_shared_s32(smem.exp(EXP_Q + st));
            add_product(grad, a, opaque(smem.q(st)), e.x, e.y, eq);
        }
        if (lane == 0) mbar_arrive(smem.empty(st));  // the stage is read
    }
    if (ROLE == 0)
        store_tile<HEAD_DIM / 8>(p.dv + blk.kv_at(p.dv_st), grad, 1.f, 1.f, key0, blk.Sk, 0, p.dv_st.seq);
    else
        store_tile<HEAD_DIM / 8>(p.dk + blk.kv_at(p.dk_st), grad, p.scale, p.scale, key0, blk.Sk, 0, p.dk_st.seq);
}
#endif

#include "bwd_dkdv_sm90_f32_entry.h"
