// fwd_sm90.cu — attention forward for Hopper (sm_90a, fp16 / bf16, D = 64, 128, 256): the tensor
// copy engine, warpgroup MMA and warp specialisation.
//
// Block i takes the tiles (query block, head, batch row) i, i + gridDim.x, ... in the order of the
// portable kernels' grid (query blocks fastest, heaviest first when causal): the host launches a
// persistent grid (at most a block per SM, so that one tile's epilogue overlaps the next one's
// first loads) or, causal or masked, a block per tile (sm90.rs says why).
// NUM_WARPS = 4 * (1 + CONSUMERS) warps in warpgroups of 4:
// - warpgroup 0, the producer, gives most of its registers away (setmaxnreg); its first warp walks
//   the tiles and one thread issues the copies: each tile's Q (once the consumers are done with the
//   last one), then the K and V tiles of every key tile the block visits into rings of STAGES
//   shared-memory stages, each tile completing on its own mbarrier (full), each stage reused once
//   every consumer warp has released it (empty);
// - warpgroups 1..CONSUMERS each own 64 query rows (warp w of one: 16 rows, the mma.sync
//   accumulator layout, so the masks and the online softmax are the other kernels'). Per key
//   tile j: S_j = Q K_j^T (wgmma, both operands in shared memory) is issued together with
//   O += P_{j-1} V_{j-1} (wgmma, P from registers), and the softmax of S_j runs while the second
//   product is still on the tensor cores; O is rescaled once it has landed.
//   With PINGPONG, the consumers take turns issuing their products (named barriers, round robin),
//   so that one warpgroup's softmax overlaps the others' products; a consumer hands the turn over
//   once its S_j has landed (a barrier between a wgmma and its wait makes ptxas serialize them all).
// Shared memory tiles are 64-column blocks of 128-byte rows with the 128-byte swizzle, the layout
// the copy engine writes (CU_TENSOR_MAP_SWIZZLE_128B) and wgmma reads (desc_sw128). O and the LSE
// are written as fwd.cu writes them. MASKED blocks visit only the key tiles some row sees (block.h),
// the producer and the consumers walking the same tiles; the K/V rings' positions run on across
// tiles. MASKED kernels take every mask but varlen batches (their rows are batch-local: q_start =
// b Sq, k_start = b Sk, which the 4-d tensor maps address), and with MODS the score modifiers.
#include "hopper.h"
#include "wgmma.h"
#include "tile.h"
#include "block.h"
#include "softmax.h"
#include "fwd_store.h"

#define CONSUMERS (NUM_WARPS / 4 - 1)
#define COL_BLOCKS (HEAD_DIM / 64)  // 64-element (128-byte) column blocks per row
#ifndef STAGES
#define STAGES 2
#endif
#ifndef PINGPONG
#define PINGPONG 0
#endif
#if CONSUMERS == 2
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
#elif CONSUMERS == 3
#define PRODUCER_REGS 24
#define CONSUMER_REGS 160
#else
#error "fwd_sm90: two or three consumer warpgroups"
#endif
#if FLASH_DTYPE == 2 || HEAD_DIM % 64 != 0 || NUM_WARPS % 4 != 0 || BLOCK_M != 64 * CONSUMERS || BLOCK_N % 16 != 0
#error "fwd_sm90: fp16 / bf16, HEAD_DIM a multiple of 64, 64 query rows per consumer warpgroup, BLOCK_N % 16 == 0"
#endif

// Bytes of one [rows][64] column block.
#define CB_BYTES(rows) ((rows) * 128)

// Shared memory: Q [COL_BLOCKS][BLOCK_M][64]; K and V [STAGES][COL_BLOCKS][BLOCK_N][64]; the
// mbarriers. Every column block starts on a 1024-byte boundary (the swizzle's period).
struct __align__(1024) Smem {
    elem_t q[COL_BLOCKS * BLOCK_M * 64];
    elem_t k[STAGES * COL_BLOCKS * BLOCK_N * 64];
    elem_t v[STAGES * COL_BLOCKS * BLOCK_N * 64];
    u64 q_full, q_empty, k_full[STAGES], v_full[STAGES], k_empty[STAGES], v_empty[STAGES];
};
// + 1024: the dynamic shared memory's start is rounded up to the swizzle's period.
FLASH_EXPORT_SMEM(sizeof(Smem) + 1024)

// The kernel's parameter: the tensor maps of q, k, v (4-d: D, heads, rows, batch) and the params.
struct Sm90Params {
    TensorMap tq, tk, tv;
    FlashParams p;
};

#define TILE_BYTES(rows) (CB_BYTES(rows) * COL_BLOCKS)
#define PINGPONG_BARRIER 1  // named barriers 1 .. CONSUMERS: consumer c waits on 1 + c for its turn

using StageRing = Ring<STAGES>;  // hopper.h

// The producer: Q, then the K and V tiles in the order the consumers use them
// (K_0, K_1, V_0, K_2, V_1, ...: P_{j-1} V_{j-1} is issued after S_j = Q K_j^T). A stage's K and V
// are released separately (K once S_j has landed, V once P_j V_j has), so each load waits only for
// the tile it replaces.
// The producer is one warp (the MASKED tile walk's skip probes are warp-wide); its lane 0 issues.
__device__ __forceinline__ bool producer_leader() { return threadIdx.x % 32 == 0; }

__device__ __forceinline__ void load_kv(const TensorMap* map, u32 tiles, u32 full, u32 empty, int j, int n0, const QueryBlock& blk) {
    const u32 s = StageRing::stage(j);
    if (j >= STAGES) mbar_wait(empty + 8 * s, StageRing::phase(j) ^ 1);
    if (!producer_leader()) return;
    mbar_expect_tx(full + 8 * s, TILE_BYTES(BLOCK_N));
#pragma unroll
    for (int cb = 0; cb < COL_BLOCKS; ++cb)
        tma_load_4d(tiles + s * TILE_BYTES(BLOCK_N) + cb * CB_BYTES(BLOCK_N), map, cb * 64, blk.hkv, n0, blk.b, full + 8 * s);
}

// The tiles of the persistent grid: (query block, head, batch row), query blocks fastest.
struct TileSchedule {
    int m_blocks, total;
    __device__ __forceinline__ explicit TileSchedule(const FlashParams& p) {
        m_blocks = (p.seqlen_q + BLOCK_M - 1) / BLOCK_M;
        total = m_blocks * p.heads * p.batch;
    }
    __device__ __forceinline__ QueryBlock block(const FlashParams& p, int t) const {
        const int m = t % m_blocks, hb = t / m_blocks;
        return QueryBlock(p, IS_CAUSAL ? m_blocks - 1 - m : m, hb % p.heads, hb / p.heads);
    }
};

// One tile's loads; `done`: the key tiles loaded for earlier tiles (the rings' position), `i`:
// the tiles before this one. Returns this tile's key tiles.
__device__ __forceinline__ int produce_tile(const Sm90Params& P, const QueryBlock& blk, Smem& smem, int done, int i) {
    const u32 q_full = smem_addr(&smem.q_full);
    if (i > 0) mbar_wait(smem_addr(&smem.q_empty), (i - 1) & 1);
    if (producer_leader()) {
        mbar_expect_tx(q_full, TILE_BYTES(BLOCK_M));
#pragma unroll
        for (int cb = 0; cb < COL_BLOCKS; ++cb)
            tma_load_4d(smem_addr(smem.q) + cb * CB_BYTES(BLOCK_M), &P.tq, cb * 64, blk.h, blk.m0, blk.b, q_full);
    }
    const u32 k_tiles = smem_addr(smem.k), k_full = smem_addr(smem.k_full), k_empty = smem_addr(smem.k_empty);
    const u32 v_tiles = smem_addr(smem.v), v_full = smem_addr(smem.v_full), v_empty = smem_addr(smem.v_empty);
    KeyWalk w = blk.key_walk();
    if (w.more()) load_kv(&P.tk, k_tiles, k_full, k_empty, done, w.n0(), blk);
    for (; w.more(); w.advance()) {
        blk.look_ahead(w);
        if (w.has_next()) load_kv(&P.tk, k_tiles, k_full, k_empty, done + w.j + 1, w.next_n0(), blk);
        load_kv(&P.tv, v_tiles, v_full, v_empty, done + w.j, w.n0(), blk);
    }
    return w.j;
}

// S = Q K^T for the warpgroup's 64 rows (q_rows: their first row in each Q column block) against the
// K tile at k_tile; issued, not waited for.
__device__ __forceinline__ void issue_qk(float (&s)[BLOCK_N / 8][4], u32 q_rows, u32 k_tile) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const u32 off = (kk % 4) * 32;  // 16 elements = 32 bytes along a 128-byte row
        const u64 da = desc_sw128(q_rows + (kk / 4) * CB_BYTES(BLOCK_M) + off, 0);
        const u64 db = desc_sw128(k_tile + (kk / 4) * CB_BYTES(BLOCK_N) + off, 0);
        Wgmma<BLOCK_N>::ss(s, da, db, kk > 0);
    }
    wgmma_commit();
}

// O += P V for the warpgroup's rows, P in registers (the A fragments of 16 keys each), V MN-major
// at v_tile; issued, not waited for.
__device__ __forceinline__ void issue_pv(float (&o)[HEAD_DIM / 8][4], const u32 (&pa)[BLOCK_N / 16][4], u32 v_tile) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        Wgmma<HEAD_DIM>::rs(o, pa[kk], desc_sw128(v_tile + kk * 16 * 128, CB_BYTES(BLOCK_N)), 1);
    wgmma_commit();
}

// Probabilities (accumulator layout, f32) -> the A fragments of P V (16-bit pairs).
__device__ __forceinline__ void pack_p(u32 (&pa)[BLOCK_N / 16][4], const float (&s)[BLOCK_N / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        pa[kk][0] = pack2(s[2 * kk][0], s[2 * kk][1]);
        pa[kk][1] = pack2(s[2 * kk][2], s[2 * kk][3]);
        pa[kk][2] = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[kk][3] = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// PINGPONG: consumer c waits for its turn to issue products, and hands the turn to the next one
// (round robin) after.
__device__ __forceinline__ void take_turn(int c) {
#if PINGPONG
    named_sync(PINGPONG_BARRIER + c, 2 * 128);
#endif
}
__device__ __forceinline__ void pass_turn(int c) {
#if PINGPONG
    named_arrive(PINGPONG_BARRIER + (c + 1) % CONSUMERS, 2 * 128);
#endif
}

// A consumer warpgroup (c = 0 .. CONSUMERS-1) on one tile: rows m0 + 64 c .. of the block; `done`
// and `i` as in produce_tile. Returns the tile's key tiles.
__device__ __forceinline__ int consume_tile(const FlashParams& p, const QueryBlock& blk, Smem& smem, int c, int done, int i) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int row0 = blk.m0 + 64 * c + 16 * warp;  // this warp's 16 rows
    const u32 q_rows = smem_addr(smem.q) + 64 * c * 128;
    const u32 k_base = smem_addr(smem.k), v_base = smem_addr(smem.v);
    const Visibility vis = blk.vis();

    float o[HEAD_DIM / 8][4];
    float s[BLOCK_N / 8][4];
    u32 pa[BLOCK_N / 16][4];
    OnlineSoftmax sm;
    zero(o);
    sm.init(blk.sink2(p));
    mbar_wait(smem_addr(&smem.q_full), i & 1);

    // Masks S_j and takes its softmax step (alpha: the rescale of O): the scale folded into the
    // exponent, or with score modifiers (which take scaled scores) applied first.
    auto softmax_step = [&](const KeyWalk& w, float (&alpha)[2]) {
#if MODS
#pragma unroll
        for (int nt = 0; nt < BLOCK_N / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] *= p.scale_log2;
        if (blk.tile_mask(w)) mask_tile<BLOCK_N / 8>(s, row0, w.n0(), vis);
        modify_tile<BLOCK_N / 8>(s, row0, w.n0(), vis);
        sm.step(s, alpha);
#else
        if (blk.tile_mask(w)) mask_tile<BLOCK_N / 8>(s, row0, w.n0(), vis);
        sm.step_scaled(s, p.scale_log2, alpha);
#endif
    };

    KeyWalk w = blk.key_walk();
    u32 prev = 0;  // the stage of the tile whose P V is pending
    bool pending = false;
    for (; w.more(); w.advance()) {
        blk.look_ahead(w);
        const u32 st = StageRing::stage(done + w.j);
        mbar_wait(smem_addr(&smem.k_full[st]), StageRing::phase(done + w.j));
        take_turn(c);
        issue_qk(s, q_rows, k_base + st * TILE_BYTES(BLOCK_N));
        if (pending) {
            mbar_wait(smem_addr(&smem.v_full[prev]), StageRing::phase(done + w.j - 1));
            issue_pv(o, pa, v_base + prev * TILE_BYTES(BLOCK_N));
        }
        float alpha[2];
        if (pending) {
            wgmma_wait<1>();  // S_j has landed; P_{j-1} V_{j-1} may still run
            pass_turn(c);     // (not before the wait: ptxas would serialize every wgmma)
            if (lane == 0) mbar_arrive(smem_addr(&smem.k_empty[st]));
            fence_regs(s);
            softmax_step(w, alpha);
            wgmma_wait<0>();
            fence_regs(o);
            if (lane == 0) mbar_arrive(smem_addr(&smem.v_empty[prev]));
            OnlineSoftmax::rescale_rows(o, alpha);
        } else {
            wgmma_wait<0>();
            pass_turn(c);
            if (lane == 0) mbar_arrive(smem_addr(&smem.k_empty[st]));
            fence_regs(s);
            softmax_step(w, alpha);
            OnlineSoftmax::rescale_rows(o, alpha);
        }
        pack_p(pa, s);
        prev = st;
        pending = true;
    }
    if (lane == 0) mbar_arrive(smem_addr(&smem.q_empty));  // every S of the tile has landed
    if (pending) {
        take_turn(c);
        mbar_wait(smem_addr(&smem.v_full[prev]), StageRing::phase(done + w.j - 1));
        issue_pv(o, pa, v_base + prev * TILE_BYTES(BLOCK_N));
        wgmma_wait<0>();
        fence_regs(o);
        pass_turn(c);
        if (lane == 0) mbar_arrive(smem_addr(&smem.v_empty[prev]));
    }

    store_rows<HEAD_DIM / 8>(p, blk, o, sm, row0);
    return w.j;
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) flash_fwd_sm90(const __grid_constant__ Sm90Params P) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    Smem& smem = *reinterpret_cast<Smem*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
    const FlashParams& p = P.p;
    const TileSchedule tiles(p);
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        tma_prefetch_map(&P.tq);
        tma_prefetch_map(&P.tk);
        tma_prefetch_map(&P.tv);
        mbar_init(smem_addr(&smem.q_full), 1);
        mbar_init(smem_addr(&smem.q_empty), 4 * CONSUMERS);  // every consumer warp's lane 0
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_addr(&smem.k_full[s]), 1);
            mbar_init(smem_addr(&smem.v_full[s]), 1);
            mbar_init(smem_addr(&smem.k_empty[s]), 4 * CONSUMERS);
            mbar_init(smem_addr(&smem.v_empty[s]), 4 * CONSUMERS);
        }
        mbar_fence_init();
    }
    __syncthreads();
    int done = 0, i = 0;  // key tiles and tiles this block has walked
    if (wg == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x < 32) {
            for (int t = blockIdx.x; t < tiles.total; t += gridDim.x) {
                const QueryBlock blk = tiles.block(p, t);
                if (blk.empty()) continue;
                done += produce_tile(P, blk, smem, done, i++);
            }
        }
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const int c = wg - 1;
#if PINGPONG
        if (c == CONSUMERS - 1) pass_turn(c);  // consumer 0 goes first
#endif
        for (int t = blockIdx.x; t < tiles.total; t += gridDim.x) {
            const QueryBlock blk = tiles.block(p, t);
            if (blk.empty()) continue;
            done += consume_tile(p, blk, smem, c, done, i++);
        }
#if PINGPONG
        if (c == 0) take_turn(c);  // the last consumer's last pass: every turn taken
#endif
    }
}
