// fwd_sm90_f32.cu — attention forward for Hopper (sm_90a) in f32, its products as split TF32 on
// warpgroup MMA (wgmma m64nNk8 .tf32): TF32_TERMS = 3 ("exact": x = big + small, big = tf32(x),
// small = tf32(x - big), a b ~ big_a small_b + small_a big_b + big_a big_b) or 1 ("tf32": big only).
// D = 64 and 128, plain problems (causal or not, GQA); sm90.rs sends everything else elsewhere.
// Both precisions run fwd_sm90_f32_f16.cu (the same bits on fp16 tensor cores, 1.5-2x faster)
// unless FLASH_NIF_TF32_PARTS=1 (config.rs's f16_parts).
//
// Grid (ceil(Sq / BLOCK_M), H, B), causal heaviest first; NUM_WARPS = 4 * (1 + CONSUMERS):
// - warpgroup 0, the producer: all 128 threads load Q once and then K_0, K_1, V_0, K_2, V_1, ...
//   from global memory and store their TF32 parts (sm90_f32.h): Q and K as RowTiles, V as a
//   TransposedTile (V^T). Each thread fences its stores into the async proxy and arrives on the
//   stage's mbarrier (128 arrivals); a stage is reused once every consumer warp has released it.
//   The next K and V tiles are loaded into registers before waiting for their stage (the register
//   file is the producer's second buffer).
// - warpgroups 1..CONSUMERS own 64 query rows each (warp w: 16 rows, the mma.sync accumulator layout,
//   so masks and the online softmax are the other kernels'). Per key tile j: S_j = Q K_j^T (ss: both
//   parts of Q and K in shared memory) is issued with O += P_{j-1} V_{j-1} (rs: P's parts in
//   registers, an AFrag), the softmax of S_j runs while the second product is still on the tensor
//   cores.
//
// Accumulation (the tensor cores add into their accumulator truncating, see tf32.h: over a long
//   chain that is a bias). S chains its 3 D / 8 products from zero (one chain per key tile). O,
//   with split products (TERMS = 2), sums each key tile's 3 BLOCK_N / 8 products in a fresh
//   accumulator, added to O in f32: chained over every key tile instead, o's error grew with the
//   keys to 1.5e-5 at 2048 and 6e-5 at 8192 keys (H100), 10-40x the SIMT kernel's. An emulation
//   (acc = RZ_f32(acc + the k-step's 8 exact products)) gave 1.9e-5 chained and 5-7e-7 per tile at
//   2048-4096 keys, D = 64 and 128, and summing S per k-step as well only 3-4e-7. One product
//   (TERMS = 1) chains O: TF32's own error dwarfs the truncation.
//
// Shared memory per block (f32, TERMS = 2 parts for TF32_TERMS = 3):
//   Q  TERMS * BLOCK_M * D * 4, K K_STAGES * TERMS * BLOCK_N * D * 4, V^T STAGES * the same.
//   D = 64:  BLOCK_M 128, BLOCK_N 64, two K and two V^T stages: 64 + 64 + 64 KiB = 192 KiB.
//   D = 128: BLOCK_M 128, BLOCK_N 32, one K and two V^T stages: 128 + 32 + 64 KiB = 224 KiB (V^T's
//   stage is released last in an iteration, after P V; two of each would need 256).
// Work per key tile (D = 128, BLOCK_N = 32, both consumers): tensor cores 2 x 2 x 64 x 32 x 128 x 2
//   x 3 = 6.3 MFLOP of TF32 = 3072 cycles at the SM's 2048 TF32 FLOP / cycle; the producer ~8
//   float4 + 32 scalar loads, 3 x 8192 / 128 = 192 conversions and 32 16-byte stores per thread
//   (~1000 warp instructions over 4 schedulers: ~250 issue cycles); the consumers' softmax and P
//   split ~ 16 scores x ~12 instructions per thread (~200 cycles per warp). So the tensor cores
//   bound it, 3x the 16-bit kernel's work for the same shared-memory operand traffic per product.
#include "sm90_f32.h"
#include "tile.h"
#include "block.h"
#include "softmax.h"
#include "fwd_store.h"

#define CONSUMERS (NUM_WARPS / 4 - 1)
// STAGES: the depth of the V^T ring; K_STAGES: of the K ring (both set by config.rs).
#ifndef STAGES
#define STAGES 1
#endif
#ifndef K_STAGES
#define K_STAGES STAGES
#endif
#if FLASH_DTYPE != 2 || (HEAD_DIM != 64 && HEAD_DIM != 128) || CONSUMERS != 2 || BLOCK_M != 64 * CONSUMERS || \
    (BLOCK_N != 32 && BLOCK_N != 64) || MASKED
#error "fwd_sm90_f32: f32, HEAD_DIM 64 or 128, two consumer warpgroups of 64 rows, BLOCK_N 32 or 64, plain"
#endif

#define FRESH_O (TERMS == 2)  // O per key tile in a fresh accumulator (see Accumulation)
// Registers per thread after setmaxnreg (sm90_f32.h's run_roles checks the split). The producer holds a K and a V tile (2 x BLOCK_N x D / 128 floats)
// and their addresses: it spills below 128 at D = 64, below 120 at D = 128 (NVRTC 13.5). A consumer
// holds O, S and P's parts (no spill at 176, D = 64 and 128) and with FRESH_O an O_PART-column
// slice of one key tile's P V besides: O_PART = 32 needs 184 at D = 64 and 192 at D = 128 (the
// whole tile's, O_PART = D, 200 and over 216).
#if !FRESH_O
#define PRODUCER_REGS 152
#define CONSUMER_REGS 176
#elif HEAD_DIM == 64
#define O_PART 32
#define PRODUCER_REGS 136
#define CONSUMER_REGS 184
#else
#define O_PART 32
#define PRODUCER_REGS 120
#define CONSUMER_REGS 192
#endif

#define KV_ELEMS (BLOCK_N * HEAD_DIM)

// Shared memory, from a base aligned to the swizzle's period (1024 bytes): Q [TERMS][D / 32][BLOCK_M][32];
// K [K_STAGES][TERMS][D / 32][BLOCK_N][32]; V^T [STAGES][TERMS][BLOCK_N / 32][D][32] (keys permuted
// within groups of 8); the mbarriers q_full, k_full[K_STAGES], v_full[STAGES], k_empty[K_STAGES],
// v_empty[STAGES]. Addressed as 32-bit offsets from one base (a generic Smem& kept a 64-bit pointer
// live through both roles, and spilled it).
constexpr u32 SMEM_Q = 0;
constexpr u32 SMEM_K = SMEM_Q + TERMS * BLOCK_M * HEAD_DIM * 4;
constexpr u32 SMEM_V = SMEM_K + K_STAGES * TERMS * KV_ELEMS * 4;
constexpr u32 SMEM_BARS = SMEM_V + STAGES * TERMS * KV_ELEMS * 4;
constexpr u32 SMEM_END = SMEM_BARS + 8 * (1 + 2 * K_STAGES + 2 * STAGES);
FLASH_EXPORT_SMEM(SWIZZLED_SMEM_BYTES(SMEM_END))

struct SmemAt {
    u32 base;
    __device__ __forceinline__ u32 q() const { return base + SMEM_Q; }
    __device__ __forceinline__ u32 k() const { return base + SMEM_K; }
    __device__ __forceinline__ u32 v() const { return base + SMEM_V; }
    __device__ __forceinline__ u32 q_full() const { return base + SMEM_BARS; }
    __device__ __forceinline__ u32 k_full(u32 s) const { return base + SMEM_BARS + 8 * (1 + s); }
    __device__ __forceinline__ u32 k_empty(u32 s) const { return base + SMEM_BARS + 8 * (1 + K_STAGES + s); }
    __device__ __forceinline__ u32 v_full(u32 s) const { return base + SMEM_BARS + 8 * (1 + 2 * K_STAGES + s); }
    __device__ __forceinline__ u32 v_empty(u32 s) const { return base + SMEM_BARS + 8 * (1 + 2 * K_STAGES + STAGES + s); }
};

using KRing = Ring<K_STAGES>;
using VRing = Ring<STAGES>;

__device__ __forceinline__ void produce(const FlashParams& p, const QueryBlock& blk, const SmemAt smem) {
    const float* q = p.q + blk.q_at(p.q_st);
    const float* k = p.k + blk.kv_at(p.k_st);
    const float* v = p.v + blk.kv_at(p.v_st);
    store_row_tile<BLOCK_M>(smem.q(), q, p.q_st.seq, blk.m0, blk.Sq);
    publish(smem.q_full());

    const u32 k_base = smem.k(), v_base = smem.v();
    auto store_k = [&](const RowTile<BLOCK_N>& t, int j) {
        const u32 s = KRing::stage(j);
        if (j >= K_STAGES) mbar_wait(smem.k_empty(s), KRing::phase(j) ^ 1);
        t.store<BLOCK_N>(k_base + s * TERMS * PART_BYTES(BLOCK_N), 0);
        publish(smem.k_full(s));
    };
    auto store_v = [&](const TransposedTile<BLOCK_N>& t, int j) {
        const u32 s = VRing::stage(j);
        if (j >= STAGES) mbar_wait(smem.v_empty(s), VRing::phase(j) ^ 1);
        t.store(v_base + s * TERMS * PART_BYTES(BLOCK_N));
        publish(smem.v_full(s));
    };
    // The consumers' order: K_0, K_1, V_0, K_2, V_1, ... (P_{j-1} V_{j-1} is issued after S_j).
    const int n = blk.key_walk().n_tiles;
    if (n == 0) return;
    RowTile<BLOCK_N> kt;
    kt.load(k, p.k_st.seq, 0, blk.Sk);
    store_k(kt, 0);
#pragma unroll 1
    for (int j = 0; j < n; ++j) {
        TransposedTile<BLOCK_N> vt;
        if (j + 1 < n) kt.load(k, p.k_st.seq, (j + 1) * BLOCK_N, blk.Sk);
        vt.load(v, p.v_st.seq, j * BLOCK_N, blk.Sk);
        if (j + 1 < n) store_k(kt, j + 1);
        store_v(vt, j);
    }
}

// ---- the consumers ----------------------------------------------------------------------------------
// S = Q K^T for the warpgroup's 64 rows (q: their first row's address in Q's big part), K at k;
// issued, not waited for.
__device__ __forceinline__ void issue_qk(float (&s)[BLOCK_N / 8][4], u32 q, u32 k) {
    wgmma_fence();
    ss_products<BLOCK_N>(s, q, PART_BYTES(BLOCK_M), BLOCK_M, k, PART_BYTES(BLOCK_N), BLOCK_N);
    wgmma_commit();
}

// o (+)= P V for the N output columns d0.. (P's parts in registers, V^T's at v); `acc` = false
// starts o from zero. Issued, not waited for.
template <int N>
__device__ __forceinline__ void issue_pv(float (&o)[N / 8][4], const AFrag<BLOCK_N / 8>& pf, u32 v, int d0, bool acc) {
    wgmma_fence();
    rs_products<N>(o, pf, v, PART_BYTES(BLOCK_N), d0, acc);
    wgmma_commit();
}

// A consumer warpgroup (c = 0, 1) on rows m0 + 64 c .. of the block.
__device__ __forceinline__ void consume(const FlashParams& p, const QueryBlock& blk, const SmemAt smem, int c) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int row0 = blk.m0 + 64 * c + 16 * warp;  // this warp's 16 rows
    const Visibility vis = blk.vis();

    float o[HEAD_DIM / 8][4];
    float s[BLOCK_N / 8][4];
#if FRESH_O
    float ot[O_PART / 8][4];  // one key tile's P V, O_PART columns of it
#endif
    AFrag<BLOCK_N / 8> pf;
    OnlineSoftmax sm;
    zero(o);
    sm.init(NEG_INF);
    mbar_wait(smem.q_full(), 0);

    auto softmax_step = [&](const KeyWalk& w, float (&alpha)[2]) {
        if (blk.tile_mask(w)) mask_tile<BLOCK_N / 8>(s, row0, w.n0(), vis);
        sm.step_scaled(s, p.scale_log2, alpha);
    };
    // O (+)= P_{j-1} V_{j-1} (V^T at v): FRESH_O issues its first O_PART columns into ot and returns;
    // pv_rest waits for them, adds them to O in f32 and does the other parts one by one. Else the
    // products chain into O: issued here, pv_rest waits.
    auto pv_issue = [&](u32 v) {
#if FRESH_O
        issue_pv<O_PART>(ot, pf, v, 0, false);
#else
        issue_pv<HEAD_DIM>(o, pf, v, 0, true);
#endif
    };
    auto pv_rest = [&](u32 v) {
        wgmma_wait<0>();
#if FRESH_O
        fence_regs(ot);
        add_into(o, ot, 0);
#pragma unroll
        for (int part = 1; part < HEAD_DIM / O_PART; ++part) {
            issue_pv<O_PART>(ot, pf, v, part * O_PART, false);
            wgmma_wait<0>();
            fence_regs(ot);
            add_into(o, ot, part * O_PART / 8);
        }
#else
        fence_regs(o);
#endif
    };

    KeyWalk w = blk.key_walk();
    const u32 q = opaque(smem.q()) + 64 * c * 128;
    // P_{j-1} V_{j-1} is pending from tile 1 on; V^T_{j-1} at v_at(j - 1).
    auto v_at = [&](int j) { return opaque(smem.v()) + VRing::stage(j) * TERMS * PART_BYTES(BLOCK_N); };
    for (; w.more(); w.advance()) {
        const u32 st = KRing::stage(w.j);
        const bool pending = w.j > 0;
        mbar_wait(smem.k_full(st), KRing::phase(w.j));
        issue_qk(s, q, opaque(smem.k()) + st * TERMS * PART_BYTES(BLOCK_N));
        const u32 v = v_at(w.j - 1);
        if (pending) {
            mbar_wait(smem.v_full(VRing::stage(w.j - 1)), VRing::phase(w.j - 1));
            pv_issue(v);
        }
        float alpha[2];
        if (pending) {
            wgmma_wait<1>();  // S_j has landed; P_{j-1} V_{j-1} may still run
            if (lane == 0) mbar_arrive(smem.k_empty(st));
            fence_regs(s);
            softmax_step(w, alpha);
            pv_rest(v);
            if (lane == 0) mbar_arrive(smem.v_empty(VRing::stage(w.j - 1)));
        } else {
            wgmma_wait<0>();
            if (lane == 0) mbar_arrive(smem.k_empty(st));
            fence_regs(s);
            softmax_step(w, alpha);
        }
        OnlineSoftmax::rescale_rows(o, alpha);
        pf.set(s);
    }
    if (w.j > 0) {
        const u32 v = v_at(w.j - 1);
        mbar_wait(smem.v_full(VRing::stage(w.j - 1)), VRing::phase(w.j - 1));
        pv_issue(v);
        pv_rest(v);
        if (lane == 0) mbar_arrive(smem.v_empty(VRing::stage(w.j - 1)));
    }

    store_rows<HEAD_DIM / 8>(p, blk, o, sm, row0);
}

#include "fwd_sm90_f32_entry.h"
