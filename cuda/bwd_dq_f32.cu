// bwd_dq_f32.cu — dQ in exact fp32 (SIMT). Deterministic: no atomics.
//
// Grid (ceil(Sq / BLOCK_M), H, B), 256 threads. Per key tile:
//   S = Q K^T, P = exp2(S * scale_log2 - lse_log2), dP = dO V^T, dS = P * (dP - delta) (to shared
//   memory), dQ += dS K;   finally dQ *= scale.
#include "tile_f32.h"
#include "block.h"
#include "softmax.h"

#define MR (BLOCK_M / 16)
#define MC (BLOCK_N / 16)
#define PSTRIDE (BLOCK_N + 1)

// Shared memory: Q and dO [BLOCK_M][FSTRIDE], K and V [BLOCK_N][FSTRIDE], dS [BLOCK_M][PSTRIDE].
struct Smem {
    float q[BLOCK_M * FSTRIDE], dout[BLOCK_M * FSTRIDE], k[BLOCK_N * FSTRIDE], v[BLOCK_N * FSTRIDE];
    float ds[BLOCK_M * PSTRIDE];
};
FLASH_EXPORT_SMEM(sizeof(Smem))

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
flash_bwd_dq(const FlashParams p) {
    Smem& smem = shared_memory<Smem>();
    const QueryBlock blk(p);
    if (blk.empty()) return;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const float* k = p.k + blk.kv_at(p.k_st);
    const float* v = p.v + blk.kv_at(p.v_st);
    const int n_end = blk.n_end();
    load_tile_f32<BLOCK_M>(smem.q, p.q + blk.q_at(p.q_st), blk.m0, blk.Sq, p.q_st.seq);
    load_tile_f32<BLOCK_M>(smem.dout, p.dout + blk.q_at(p.do_st), blk.m0, blk.Sq, p.do_st.seq);

    float lse2[MR], dlt[MR], acc[MR][DCOLS];
#pragma unroll
    for (int i = 0; i < MR; ++i) {
        blk.row_stats(p, blk.m0 + ty + 16 * i, lse2[i], dlt[i]);
        zero(acc[i]);
    }

    for (KeyTile tile = blk.first_tile(); tile.n0 < n_end; tile = blk.next_tile(tile)) {
        const int n0 = tile.n0;
        __syncthreads();
        load_tile_f32<BLOCK_N>(smem.k, k, n0, blk.Sk, p.k_st.seq);
        load_tile_f32<BLOCK_N>(smem.v, v, n0, blk.Sk, p.v_st.seq);
        __syncthreads();
        float s[MR][MC], dp[MR][MC];
        zero(s);
        zero(dp);
        mm_abt_f32<MR, MC>(s, smem.q, smem.k);
        mm_abt_f32<MR, MC>(dp, smem.dout, smem.v);
        store_ds_rows<PSTRIDE>(smem.ds, s, dp, lse2, dlt, blk.m0, n0, blk.tile_mask(tile), p.scale_log2, blk.vis(), ty, tx);
        __syncthreads();
        mm_pb_f32<MR, BLOCK_N>(acc, smem.ds, PSTRIDE, smem.k);
    }
    float mul[MR];
#pragma unroll
    for (int i = 0; i < MR; ++i) mul[i] = p.scale;
    store_rows_f32<MR>(p.dq + blk.q_at(p.dq_st), acc, mul, blk.m0, blk.Sq, p.dq_st.seq);
}
