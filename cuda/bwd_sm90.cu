// bwd_sm90.cu — dK, dV and dQ for Hopper (sm_90a, fp16 / bf16, D = 64 and 128): the tensor copy
// engine, warpgroup MMA, warp specialisation and bulk dQ reductions.
//
// Grid (ceil(Sk / BLOCK_N), Hkv, B), as bwd_dkdv.cu: a block keeps BLOCK_N = 128 keys of K and V in
// shared memory and walks the (query head, query tile) pairs that see them (block.h's KeyBlock and
// QueryWalk, so GQA sums and causal / masked skipping are the portable kernel's). NUM_WARPS = 12:
// - warpgroup 0 gives most of its registers away (setmaxnreg). Its warp 0, the producer, loads K
//   and V once, then per iteration Q and dO (the copy engine, STAGES stages deep) and the rows'
//   lse_log2 and delta (plain loads: +inf and 0 past Sq); its warp 1, the dQ writer (warps 1, 2
//   and 3 in turn when deterministic: DQ_WRITERS), adds each iteration's dQ tile from shared memory into
//   dq_accum's tile (params.h's dq_tile_offset: the same bytes) with one bulk reduction
//   (cp.reduce.async.bulk .add.f32), in key-block order when dq_sem is given (deterministic);
// - warpgroups 1 and 2, the consumers, own 64 keys each. Everything is transposed, so that P and
//   dS are A operands in registers:
//     S^T = K Q^T, dP^T = V dO^T               (wgmma, both operands in shared memory)
//     P^T = exp2(S^T scale_log2 - lse_log2),  dS^T = P^T (dP^T - delta)    (bwd_grads.h)
//     dV += P^T dO, dK += dS^T Q               (wgmma, A from registers, B MN-major)
//     dQ  = dS K                               (wgmma, dS^T stored to shared memory by both
//                                               consumers, A and B MN-major)
//   dK and dV stay in registers for the whole walk (dK *= scale at the end); dQ goes to shared
//   memory for the writer. Consumer c computes dQ rows 64 c.. (BLOCK_M = 128) or its half of the
//   columns (BLOCK_M = 64).
// Shared-memory operand tiles are 64-column blocks of 128-byte rows with the 128-byte swizzle, as in
// fwd_sm90.cu.
#include "hopper.h"
#include "wgmma.h"
#include "tile.h"
#include "block.h"
#include "bwd_grads.h"

#define CONSUMERS 2
// dQ writer warps (warps 1.. of warpgroup 0). Deterministic: they take the tiles in turn, so that
// some wait for their tiles to reach dq_accum (and release the next key blocks' turns) while
// another adds the next tile; unordered, the first one does it all (it waits only for the read).
#define DQ_WRITERS 3
#define COL_BLOCKS (HEAD_DIM / 64)  // 64-element (128-byte) column blocks per row of K, V, Q, dO
#ifndef STAGES
#define STAGES 2
#endif
// Registers per thread after setmaxnreg. The block holds 168 x 384 (launch bounds), which the
// roles' shares must not exceed (setmaxnreg.inc waits for them): 128 x PRODUCER_REGS + 256 x
// CONSUMER_REGS <= 64512. The producer's and the writer's walks spilled at 24 (causal) and 48
// (MASKED, whose tile tests take registers).
#if MASKED
#define PRODUCER_REGS 56
#define CONSUMER_REGS 224
#else
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232
#endif
#if FLASH_DTYPE == 2 || HEAD_DIM % 64 != 0 || NUM_WARPS != 12 || BLOCK_N != 64 * CONSUMERS || (BLOCK_M != 64 && BLOCK_M != 128)
#error "bwd_sm90: fp16 / bf16, two consumer warpgroups of 64 keys, 64 or 128 query rows per step"
#endif
// dQ [BLOCK_M x HEAD_DIM] is split between the consumers by rows (64 each) when BLOCK_M = 128,
// else by columns: each computes a 64 x DQ_N part.
#define DQ_SPLIT_ROWS (BLOCK_M == 128)
#define DQ_N (DQ_SPLIT_ROWS ? HEAD_DIM : HEAD_DIM / 2)

#define CB_BYTES(rows) ((rows) * 128)                    // one [rows][64] column block
#define TILE_BYTES(rows) (CB_BYTES(rows) * COL_BLOCKS)   // a [rows][HEAD_DIM] tile
#define DS_BYTES (CB_BYTES(BLOCK_N) * (BLOCK_M / 64))    // dS^T [BLOCK_N][BLOCK_M]
static_assert(DQ_WRITERS <= 3, "warpgroup 0 has the producer and three more warps");
static_assert(BLOCK_M % DQ_TILE_ROWS == 0, "a dQ tile is whole tiles of dq_accum");
#define DQ_TILE_BYTES (DQ_TILE_ROWS * HEAD_DIM * 4)  // one tile of dq_accum

// Shared memory: K, V [COL_BLOCKS][BLOCK_N][64]; Q, dO [STAGES][COL_BLOCKS][BLOCK_M][64]; dS^T, two
// buffers of [BLOCK_M / 64][BLOCK_N][64] (query column blocks); the dQ tile [BLOCK_M][HEAD_DIM] f32 (dq_accum's tiles);
// lse_log2 and delta [STAGES][BLOCK_M]; the mbarriers. Operand tiles start on 1024-byte boundaries.
struct __align__(1024) Smem {
    elem_t k[COL_BLOCKS * BLOCK_N * 64];
    elem_t v[COL_BLOCKS * BLOCK_N * 64];
    elem_t q[STAGES * COL_BLOCKS * BLOCK_M * 64];
    elem_t dout[STAGES * COL_BLOCKS * BLOCK_M * 64];
    elem_t ds[2 * DS_BYTES / sizeof(elem_t)];
    float dq[BLOCK_M * HEAD_DIM];
    float lse[STAGES * BLOCK_M], delta[STAGES * BLOCK_M];
    u64 kv_full, q_full[STAGES], do_full[STAGES], qdo_empty[STAGES], ds_full[2], dq_full[DQ_WRITERS], dq_empty;
};
// + 1024: the dynamic shared memory's start is rounded up to the swizzle's period.
FLASH_EXPORT_SMEM(sizeof(Smem) + 1024)

// The kernel's parameter: the tensor maps of q, k, v, do (4-d: D, heads, rows, batch), the
// deterministic mode's semaphores, then the params.
struct Sm90BwdParams {
    TensorMap tq, tk, tv, tdo;
    int* dq_sem;   // [B, H, ceil(Sq / BLOCK_M)] zeroed: key blocks done with each dQ tile; null: unordered
    int m_blocks;  // ceil(Sq / BLOCK_M)
    int _pad;
    FlashParams p;
};

using StageRing = Ring<STAGES>;  // hopper.h

// ---- the block's key block and its turn at each dQ tile --------------------------------------------
// Deterministic (dq_sem) dQ tiles take their key blocks' reductions in a fixed order in which a block
// only ever waits for blocks dispatched before it (CTAs start in index order, so those are resident
// or done: no deadlock, however many key blocks there are and whatever else shares the GPU):
// - plain walks: ascending key blocks (every block starts at tile 0);
// - causal walks start at their diagonal tile, and ascending order would make each block wait for
//   the blocks below it to walk down to its diagonal (a staircase). Descending order keeps every
//   block two tiles (BLOCK_N / BLOCK_M) behind the one above it, and the CTAs take the key blocks
//   from the last down.
// (Staggered plain walks — block n starting at tile n — measured no faster, and would need every
// key block of a head resident at once.)
// Dispatch order (the CTAs start in index order). Two walks take the key blocks of groups of heads
// in turn, block 0 first (GROUP_L2_BYTES of Q, dO and dq_accum a group, so that they stay in L2:
// all heads at once measured 35 % slower):
// - unordered causal walks differ in length (key block 0 visits every query tile, the last one or
//   two): the longest start first and the short ones fill the end (not a last head's long walks);
// - deterministic plain walks all start at query tile 0, where key block n waits for the n blocks
//   before it: here block n starts a group's worth of CTAs after block n - 1, not with it.
#define GROUP_L2_BYTES (16 << 20)
__device__ __forceinline__ KeyBlock key_block(const Sm90BwdParams& P) {
    if (!MASKED && IS_CAUSAL != (P.dq_sem != nullptr)) {  // (MASKED: spills at D = 64)
        const int blocks = gridDim.x, heads = gridDim.y * gridDim.z;
        const i64 per_head = (i64)P.p.seqlen_q * HEAD_DIM * (2 * sizeof(elem_t) + 4);  // Q, dO, dq_accum
        const int group = (int)max((i64)1, GROUP_L2_BYTES / max(per_head, (i64)1));    // heads per group
        const int id = blockIdx.x + blocks * (blockIdx.y + gridDim.y * blockIdx.z);     // dispatch order
        const int first = id / (group * blocks) * group;                                // the group's first head
        const int size = min(group, heads - first), r = id - first * blocks;
        const int head = first + r % size;
        return KeyBlock(P.p, r / size, head % gridDim.y, head / gridDim.y);
    }
    const bool descending = IS_CAUSAL && P.dq_sem;
    return KeyBlock(P.p, descending ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
}

// The block's turn at query tile m0: the reductions into that dQ tile that go before its own.
__device__ __forceinline__ int dq_turn(const KeyBlock& blk, int m0) {
    const int n = blk.n0 / BLOCK_N;
#if IS_CAUSAL
    // Key blocks n' visit the tile when n' BLOCK_N - (Sk - Sq) < m0 + BLOCK_M (block.h's
    // first_query_tile): the first `visitors` blocks, the last of them first.
    const int reach = m0 + BLOCK_M + (blk.Sk - blk.Sq);
    const int visitors = reach <= 0 ? 0 : min((reach + BLOCK_N - 1) / BLOCK_N, (int)gridDim.x);
    return visitors - 1 - n;
#else
    (void)m0;
    return n;
#endif
}

// ---- the producer warp ---------------------------------------------------------------------------
__device__ __forceinline__ void produce(const Sm90BwdParams& P, Smem& smem) {
    const FlashParams& p = P.p;
    const KeyBlock blk = key_block(P);
    const int lane = threadIdx.x % 32;
    QueryWalk w = blk.query_walk();
    if (!w.more()) return;
    if (lane == 0) {
        const u32 full = smem_addr(&smem.kv_full);
        mbar_expect_tx(full, 2 * TILE_BYTES(BLOCK_N));
#pragma unroll
        for (int cb = 0; cb < COL_BLOCKS; ++cb) {
            tma_load_4d(smem_addr(smem.k) + cb * CB_BYTES(BLOCK_N), &P.tk, cb * 64, blk.hkv, blk.n0, blk.b, full);
            tma_load_4d(smem_addr(smem.v) + cb * CB_BYTES(BLOCK_N), &P.tv, cb * 64, blk.hkv, blk.n0, blk.b, full);
        }
    }
    for (int j = 0; w.more(); w.advance(), ++j) {
        blk.look_ahead(w);
        const u32 st = StageRing::stage(j);
        if (j >= STAGES) mbar_wait(smem_addr(&smem.qdo_empty[st]), StageRing::phase(j) ^ 1);
        const int h = blk.head(w.it()), m0 = blk.query_row(w.it());
        const i64 so = blk.stat_base(p, h);
        for (int i = lane; i < BLOCK_M; i += 32) {
            const bool ok = m0 + i < blk.Sq;
            smem.lse[st * BLOCK_M + i] = ok ? p.lse_log2[so + m0 + i] : POS_INF;
            smem.delta[st * BLOCK_M + i] = ok ? p.delta[so + m0 + i] : 0.f;
        }
        const u32 q_full = smem_addr(&smem.q_full[st]), do_full = smem_addr(&smem.do_full[st]);
        if (lane == 0) {  // every lane arrives on q_full after its lse / delta stores
            mbar_expect_tx(q_full, TILE_BYTES(BLOCK_M));
            mbar_expect_tx(do_full, TILE_BYTES(BLOCK_M));
#pragma unroll
            for (int cb = 0; cb < COL_BLOCKS; ++cb) {
                const u32 off = st * TILE_BYTES(BLOCK_M) + cb * CB_BYTES(BLOCK_M);
                tma_load_4d(smem_addr(smem.q) + off, &P.tq, cb * 64, h, m0, blk.b, q_full);
                tma_load_4d(smem_addr(smem.dout) + off, &P.tdo, cb * 64, h, m0, blk.b, do_full);
            }
        } else {
            mbar_arrive(q_full);
        }
    }
}

// ---- the dQ writer warps -------------------------------------------------------------------------
// Adds iteration j's dQ tile into dq_accum's tile, one bulk reduction. Deterministic (dq_sem): after
// the key blocks before this one, in order.
__device__ __forceinline__ void write_dq(const Sm90BwdParams& P, Smem& smem, int writer) {
    const FlashParams& p = P.p;
    const KeyBlock blk = key_block(P);
    const int lane = threadIdx.x % 32;
    const int writers = P.dq_sem ? DQ_WRITERS : 1;
    if (writer >= writers) return;
    QueryWalk w = blk.query_walk();
    for (int j = 0; w.more(); w.advance(), ++j) {
        blk.look_ahead(w);
        if (j % writers != writer) continue;
        const int h = blk.head(w.it()), m0 = blk.query_row(w.it());
        int* sem = P.dq_sem ? P.dq_sem + ((i64)blk.b * p.heads + h) * P.m_blocks + m0 / BLOCK_M : nullptr;
        // Tile j is announced on dq_full[j % DQ_WRITERS] (one barrier per writer: a parity wait on
        // a barrier shared by two writers could pass on the other's phase).
        mbar_wait(smem_addr(&smem.dq_full[j % DQ_WRITERS]), (j / DQ_WRITERS) & 1);
        if (lane == 0) {
            if (sem)
                while (ld_acquire_gpu(sem) != dq_turn(blk, m0)) {
                }
            // One reduction per dq_accum tile that has rows below Sq (rows past Sq land in the last
            // one's padding; a next tile would be the next head's).
#pragma unroll
            for (int i = 0; i < BLOCK_M / DQ_TILE_ROWS; ++i)
                if (i == 0 || m0 + i * DQ_TILE_ROWS < blk.Sq)
                    bulk_reduce_add_f32(p.dq_accum + dq_tile_offset(p, blk.b, h, m0 + i * DQ_TILE_ROWS, 0, HEAD_DIM),
                                        smem_addr(smem.dq) + i * DQ_TILE_BYTES, DQ_TILE_BYTES);
            bulk_commit();
            bulk_wait_read<0>();
            mbar_arrive(smem_addr(&smem.dq_empty));  // the consumers may write the next tile
            if (sem) {
                bulk_wait<0>();  // the tile is in dq_accum: the next key block's turn
                __threadfence();
                st_release_gpu(sem, dq_turn(blk, m0) + 1);
            }
        }
        __syncwarp();
    }
    bulk_wait<0>();
}

// ---- the consumers -------------------------------------------------------------------------------
// acc[64 x N] = A B^T: A the warpgroup's 64 rows at a_rows of a K-major [*][HEAD_DIM] tile whose
// column blocks are a_cb bytes apart, B the [N][HEAD_DIM] tile at b_tile; issued, not waited for.
template <int N>
__device__ __forceinline__ void issue_abt(float (&acc)[N / 8][4], u32 a_rows, u32 a_cb, u32 b_tile) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const u32 off = (kk % 4) * 32;  // 16 elements = 32 bytes along a 128-byte row
        const u64 da = desc_sw128(a_rows + (kk / 4) * a_cb + off, 0);
        const u64 db = desc_sw128(b_tile + (kk / 4) * CB_BYTES(N) + off, 0);
        Wgmma<N>::ss(acc, da, db, kk > 0);
    }
    wgmma_commit();
}

// acc[64 x HEAD_DIM] += A B: A [64 x BLOCK_M] in registers (16-bit A fragments), B the [BLOCK_M]
// [HEAD_DIM] tile at b_tile (MN-major); issued, not waited for.
__device__ __forceinline__ void issue_ab(float (&acc)[HEAD_DIM / 8][4], const u32 (&a)[BLOCK_M / 16][4], u32 b_tile) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk)
        Wgmma<HEAD_DIM>::rs(acc, a[kk], desc_sw128(b_tile + kk * 16 * 128, CB_BYTES(BLOCK_M)), 1);
    wgmma_commit();
}

// dq[64 x DQ_N] = dS K over the block's BLOCK_N keys: dS^T's 64 query columns at ds_cols and K's
// DQ_N columns at k_cols, both in [BLOCK_N][64] column blocks (MN-major operands); issued, not
// waited for.
__device__ __forceinline__ void issue_dq(float (&acc)[DQ_N / 8][4], u32 ds_cols, u32 k_cols) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        const u32 off = kk * 16 * 128;
        Wgmma<DQ_N>::tt(acc, desc_sw128(ds_cols + off, CB_BYTES(BLOCK_N)), desc_sw128(k_cols + off, CB_BYTES(BLOCK_N)), kk > 0);
    }
    wgmma_commit();
}

// Accumulator tile (f32) -> the 16-bit A fragments of its 16-column steps.
template <int KT>
__device__ __forceinline__ void pack_a(u32 (&a)[KT][4], const float (&x)[2 * KT][4]) {
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
        a[kk][0] = pack2(x[2 * kk][0], x[2 * kk][1]);
        a[kk][1] = pack2(x[2 * kk][2], x[2 * kk][3]);
        a[kk][2] = pack2(x[2 * kk + 1][0], x[2 * kk + 1][1]);
        a[kk][3] = pack2(x[2 * kk + 1][2], x[2 * kk + 1][3]);
    }
}

// S^T, dP^T -> P^T, dS^T (bwd_grads.h) as 16-bit A fragments, 16 query columns at a time: each
// step's lse / delta loads stay in it (a memory clobber), so that S^T, dP^T, dK, dV and the 2 x 32
// columns' statistics are never all live at once (BLOCK_M = 128 spilled).
__device__ __forceinline__ void grads_packed(u32 (&pa)[BLOCK_M / 16][4], u32 (&da)[BLOCK_M / 16][4],
                                             float (&s)[BLOCK_M / 8][4], float (&dp)[BLOCK_M / 8][4], float scale_log2,
                                             bool masked, int key0, int m0, const Visibility& vis, const float* lse2,
                                             const float* dlt) {
    typedef float Step[2][4];  // one 16-column step of S^T / dP^T
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
        Step& s2 = *reinterpret_cast<Step*>(&s[2 * kk]);
        Step& dp2 = *reinterpret_cast<Step*>(&dp[2 * kk]);
        grads_t<2>(s2, dp2, scale_log2, masked, key0, m0 + 16 * kk, vis, lse2 + 16 * kk, dlt + 16 * kk);
        pack_a(*reinterpret_cast<u32(*)[1][4]>(&pa[kk]), s2);
        pack_a(*reinterpret_cast<u32(*)[1][4]>(&da[kk]), dp2);
        asm volatile("" ::: "memory");
    }
}

// The warp's dS^T rows (A fragments) -> the swizzled dS^T tile at ds: key row `row` (and row + 8),
// query columns 16 kk + 8 half + 2 t.
__device__ __forceinline__ void store_ds(u32 ds, const u32 (&a)[BLOCK_M / 16][4], int row) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int col = 16 * kk + 8 * half, key = row + 8 * r;
                const u32 chunk = ((col % 64) / 8) ^ (key % 8);  // the 128-byte swizzle
                st_shared_u32(ds + (col / 64) * CB_BYTES(BLOCK_N) + key * 128 + chunk * 16 + 4 * t, a[kk][2 * half + r]);
            }
}

__device__ __forceinline__ void consume(const Sm90BwdParams& P, Smem& smem, int c) {
    const FlashParams& p = P.p;
    const KeyBlock blk = key_block(P);
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int key0 = blk.n0 + 64 * c + 16 * warp;  // this warp's 16 keys
    // dQ: this consumer's 64 x DQ_N part (rows or columns), from its dS^T and K columns.
    const int dq_row0 = DQ_SPLIT_ROWS ? 64 * c : 0, dq_col0 = DQ_SPLIT_ROWS ? 0 : DQ_N * c;

    float dk[HEAD_DIM / 8][4], dv[HEAD_DIM / 8][4];
    zero(dk);
    zero(dv);
    QueryWalk w = blk.query_walk();
    if (w.more()) mbar_wait(smem_addr(&smem.kv_full), 0);
    for (int j = 0; w.more(); w.advance(), ++j) {
        blk.look_ahead(w);
        const u32 st = StageRing::stage(j), ph = StageRing::phase(j);
        const int h = blk.head(w.it()), m0 = blk.query_row(w.it());
        const u32 q_tile = smem_addr(smem.q) + st * TILE_BYTES(BLOCK_M);
        const u32 do_tile = smem_addr(smem.dout) + st * TILE_BYTES(BLOCK_M);
        const float* lse2 = smem.lse + st * BLOCK_M;
        const float* dlt = smem.delta + st * BLOCK_M;
        const bool masked = blk.slice_mask(w, key0);
        // This warpgroup's 64 keys of K and V, and K's column block for dQ (opaque: see hopper.h).
        const u32 k_rows = opaque(smem_addr(smem.k) + 64 * c * 128), v_rows = opaque(smem_addr(smem.v) + 64 * c * 128);
        const u32 k_cols = opaque(smem_addr(smem.k) + (dq_col0 / 64) * CB_BYTES(BLOCK_N) + (dq_col0 % 64) * 2);

        float s[BLOCK_M / 8][4], dp[BLOCK_M / 8][4];
        mbar_wait(smem_addr(&smem.q_full[st]), ph);
        issue_abt<BLOCK_M>(s, k_rows, CB_BYTES(BLOCK_N), q_tile);
        mbar_wait(smem_addr(&smem.do_full[st]), ph);
        issue_abt<BLOCK_M>(dp, v_rows, CB_BYTES(BLOCK_N), do_tile);
        u32 pa[BLOCK_M / 16][4], da[BLOCK_M / 16][4];
        wgmma_wait<0>();  // S^T and dP^T (P^T V issued before dS^T is computed spilled at 232 registers)
        fence_regs(s);
        fence_regs(dp);
        grads_packed(pa, da, s, dp, p.scale_log2, masked, key0, m0, blk.vis(h), lse2, dlt);
        issue_ab(dv, pa, do_tile);
        issue_ab(dk, da, q_tile);

        // dS^T to shared memory (buffer j % 2: both consumers finished reading it at iteration j - 2,
        // before arriving on ds_full at j - 1), then dQ once both halves are there.
        const u32 ds = smem_addr(smem.ds) + (j % 2) * DS_BYTES;
        store_ds(ds, da, 64 * c + 16 * warp + g);
        fence_async_smem();
        mbar_arrive(smem_addr(&smem.ds_full[j % 2]));
        mbar_wait(smem_addr(&smem.ds_full[j % 2]), (j / 2) & 1);
        float dq[DQ_N / 8][4];
        issue_dq(dq, ds + (dq_row0 / 64) * CB_BYTES(BLOCK_N), k_cols);
        wgmma_wait<0>();
        fence_regs(dk);
        fence_regs(dv);
        fence_regs(dq);
        if (lane == 0) mbar_arrive(smem_addr(&smem.qdo_empty[st]));  // Q and dO read for the last time

        // The dQ tile to shared memory for the writer, once it has read the last one.
        if (j > 0) mbar_wait(smem_addr(&smem.dq_empty), (j - 1) & 1);
        const u32 dq_tile = smem_addr(smem.dq);
#pragma unroll
        for (int nt = 0; nt < DQ_N / 8; ++nt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = dq_row0 + 16 * warp + g + 8 * r, col = dq_col0 + 8 * nt + 2 * t;
                st_shared_f32x2(dq_tile + dq_tile_elem(row, col, HEAD_DIM) * 4, dq[nt][2 * r], dq[nt][2 * r + 1]);
            }
        fence_async_smem();
        mbar_arrive(smem_addr(&smem.dq_full[j % DQ_WRITERS]));
    }
    store_tile<HEAD_DIM / 8>(p.dk + blk.kv_at(p.dk_st), dk, p.scale, p.scale, key0, blk.Sk, 0, p.dk_st.seq);
    store_tile<HEAD_DIM / 8>(p.dv + blk.kv_at(p.dv_st), dv, 1.f, 1.f, key0, blk.Sk, 0, p.dv_st.seq);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) flash_bwd_sm90(const __grid_constant__ Sm90BwdParams P) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    Smem& smem = *reinterpret_cast<Smem*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
    if (key_block(P).empty()) return;  // each role builds its own (none live across setmaxnreg)
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        tma_prefetch_map(&P.tq);
        tma_prefetch_map(&P.tk);
        tma_prefetch_map(&P.tv);
        tma_prefetch_map(&P.tdo);
        mbar_init(smem_addr(&smem.kv_full), 1);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_addr(&smem.q_full[s]), 32);  // the producer's lanes (lse, delta) and the copy
            mbar_init(smem_addr(&smem.do_full[s]), 1);
            mbar_init(smem_addr(&smem.qdo_empty[s]), 4 * CONSUMERS);  // every consumer warp's lane 0
        }
        mbar_init(smem_addr(&smem.ds_full[0]), 128 * CONSUMERS);  // every consumer thread
        mbar_init(smem_addr(&smem.ds_full[1]), 128 * CONSUMERS);
        for (int i = 0; i < DQ_WRITERS; ++i) mbar_init(smem_addr(&smem.dq_full[i]), 128 * CONSUMERS);
        mbar_init(smem_addr(&smem.dq_empty), 1);  // a writer's lane 0
        mbar_fence_init();
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        const int warp = threadIdx.x / 32;
        if (warp == 0) produce(P, smem);
        else if (warp <= DQ_WRITERS) write_dq(P, smem, warp - 1);
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        consume(P, smem, wg - 1);
    }
}
