// fwd_f32.cu — attention forward in exact fp32 (SIMT FMAs, no TF32).
//
// Grid (ceil(Sq / BLOCK_M), H, B), 256 threads. Per key tile: S = Q K^T (register micro-tiles),
// mask, online softmax in the exp2 domain (rows reduced over half-warps), P to shared memory,
// O += P V. O and LSE are written once.
#include "tile_f32.h"
#include "block.h"
#include "softmax.h"

#define MR (BLOCK_M / 16)
#define MC (BLOCK_N / 16)
#define PSTRIDE (BLOCK_N + 1)

// Shared memory: Q [BLOCK_M][FSTRIDE], K and V [BLOCK_N][FSTRIDE], P [BLOCK_M][PSTRIDE].
struct Smem {
    float q[BLOCK_M * FSTRIDE], k[BLOCK_N * FSTRIDE], v[BLOCK_N * FSTRIDE], p[BLOCK_M * PSTRIDE];
};
FLASH_EXPORT_SMEM(sizeof(Smem))

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
flash_fwd(const FlashParams p) {
    Smem& smem = shared_memory<Smem>();
    const QueryBlock blk(p);
    if (blk.empty()) return;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const float* k = p.k + blk.kv_at(p.k_st);
    const float* v = p.v + blk.kv_at(p.v_st);
    const int n_end = blk.n_end();
    load_tile_f32<BLOCK_M>(smem.q, p.q + blk.q_at(p.q_st), blk.m0, blk.Sq, p.q_st.seq);

    float acc[MR][DCOLS];
    OnlineSoftmaxRows<MR> sm;
    sm.init(acc, blk.sink2(p));

    for (KeyTile tile = blk.first_tile(); tile.n0 < n_end; tile = blk.next_tile(tile)) {
        const int n0 = tile.n0;
        __syncthreads();  // previous tile's K, V, P no longer read
        load_tile_f32<BLOCK_N>(smem.k, k, n0, blk.Sk, p.k_st.seq);
        load_tile_f32<BLOCK_N>(smem.v, v, n0, blk.Sk, p.v_st.seq);
        __syncthreads();
        float s[MR][MC];
        zero(s);
        mm_abt_f32<MR, MC>(s, smem.q, smem.k);
        sm.update<PSTRIDE>(s, acc, smem.p, blk.m0, n0, blk.tile_mask(tile), p.scale_log2, blk.vis());
        __syncthreads();
        mm_pb_f32<MR, BLOCK_N>(acc, smem.p, PSTRIDE, smem.v);
    }

    float inv[MR];
    sm.finish(inv, p.lse, blk.stat_base(p), blk.m0, blk.Sq, ty, tx);
    store_rows_f32<MR>(p.o + blk.q_at(p.o_st), acc, inv, blk.m0, blk.Sq, p.o_st.seq);
}
