// fwd.cu — attention forward on tensor cores, FlashAttention-2 layout: fp16 / bf16 (mma m16n8k16), and
// f32 as split-TF32 or TF32 products (TF32_TERMS, the GEMMs of tf32.h; mma m16n8k8).
//
// Grid (ceil(Sq / BLOCK_M), H, B); NUM_WARPS warps, each owning M_TILES tiles of 16 query rows
// (BLOCK_M = 16 * M_TILES * NUM_WARPS; with M_TILES = 2 each K/V fragment feeds two mma's). The Q tile is loaded once; K/V tiles of BLOCK_N rows stream through two shared-memory
// buffers (cp.async, K and V in separate groups, the next tile in flight while the current one is used). Per tile:
//   S = Q K^T (mma), mask the diagonal / ragged tile, online softmax in the exp2 domain, O += P V.
// O and LSE are written once at the end. Causal blocks skip every key tile past their last row;
// MASKED blocks visit only the key tiles some row sees (block.h).
#include "tile.h"
#include "block.h"
#include "softmax.h"
#include "fwd_store.h"

#ifndef M_TILES
#define M_TILES 1
#endif
#if BLOCK_M != 16 * M_TILES * NUM_WARPS
#error "fwd: BLOCK_M must be 16 * M_TILES * NUM_WARPS"
#endif

// Shared memory: Q [BLOCK_M][SROW]; K and V, two buffers [2][BLOCK_N][SROW] each.
struct Smem {
    elem_t q[BLOCK_M * SROW], k[2 * BLOCK_N * SROW], v[2 * BLOCK_N * SROW];
};
FLASH_EXPORT_SMEM(sizeof(Smem))

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
flash_fwd(const FlashParams p) {
    Smem& smem = shared_memory<Smem>();
    const QueryBlock blk(p);
    if (blk.empty()) return;
    const int warp = threadIdx.x / 32;
    const elem_t* q = p.q + blk.q_at(p.q_st);
    const elem_t* k = p.k + blk.kv_at(p.k_st);
    const elem_t* v = p.v + blk.kv_at(p.v_st);
    KeyWalk w = blk.key_walk();

    // Two commit groups per tile, K then V, so that S = Q K^T starts while V is still in flight.
    // In flight at the top of iteration j: K_j, V_j (in that order).
    load_tile_async<BLOCK_M>(smem.q, q, blk.m0, blk.Sq, p.q_st.seq);
    if (w.more()) load_tile_async<BLOCK_N>(smem.k, k, w.n0(), blk.Sk, p.k_st.seq);
    cp_async_commit();
    if (w.more()) load_tile_async<BLOCK_N>(smem.v, v, w.n0(), blk.Sk, p.v_st.seq);
    cp_async_commit();

    float acc[M_TILES][DPAD / 8][4];
    OnlineSoftmax sm[M_TILES];
    zero(acc);
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) sm[mt].init(blk.sink2(p));
    const elem_t* sQw = smem.q + warp * 16 * M_TILES * SROW;
    const int row0 = blk.m0 + warp * 16 * M_TILES;

    for (; w.more(); w.advance()) {
        blk.look_ahead(w);
        const int nb = w.next_buf();
        cp_async_wait<1>();
        __syncthreads();  // K_j landed; every warp is done with K_{j-1}'s buffer
        if (w.has_next()) load_tile_async<BLOCK_N>(smem.k + nb * BLOCK_N * SROW, k, w.next_n0(), blk.Sk, p.k_st.seq);
        cp_async_commit();
        const elem_t* sKj = smem.k + w.buf() * BLOCK_N * SROW;
        const elem_t* sVj = smem.v + w.buf() * BLOCK_N * SROW;
        const int n0 = w.n0();

        float s[M_TILES][BLOCK_N / 8][4];
        zero(s);
        gemm_abt_mt<M_TILES, BLOCK_N / 8>(s, sQw, sKj);
        const bool need_mask = blk.tile_mask(w);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int i = 0; i < BLOCK_N / 8; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][i][e] *= p.scale_log2;
            if (need_mask) mask_tile<BLOCK_N / 8>(s[mt], row0 + 16 * mt, n0, blk.vis());
            modify_tile<BLOCK_N / 8>(s[mt], row0 + 16 * mt, n0, blk.vis());
            sm[mt].update(s[mt], acc[mt]);
        }

        cp_async_wait<1>();
        __syncthreads();  // V_j landed; every warp is done with V_{j-1}'s buffer
        if (w.has_next()) load_tile_async<BLOCK_N>(smem.v + nb * BLOCK_N * SROW, v, w.next_n0(), blk.Sk, p.v_st.seq);
        cp_async_commit();
        gemm_pb_mt<M_TILES, BLOCK_N / 16, DPAD / 8>(acc, s, sVj, 0);
    }

#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) store_rows<DPAD / 8>(p, blk, acc[mt], sm[mt], row0 + 16 * mt);
}
