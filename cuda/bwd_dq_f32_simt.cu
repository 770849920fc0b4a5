// bwd_dq_f32_simt.cu — dQ in exact fp32 (SIMT) for HEAD_DIM 64 and 128. Deterministic: no atomics.
//
// Grid (ceil(Sq / BLOCK_M), H, B), 256 threads (16 x 16). Per key tile (simt_f32.h products):
//   S = Q K^T, dP = dO V^T      thread (ty, tx): queries ty + 16 i, keys tx + 16 j
//   P = exp2(S * scale_log2 - lse_log2), dS = P * (dP - delta) -> shared memory
//   dQ += dS K                  thread: queries ty + 16 i, float4 column groups tx + 16 jj
// finally dQ *= scale. K is double-buffered (cp.async), V loads while dQ += dS K runs.
#ifndef SIMT_UNROLL_D
#define SIMT_UNROLL_D 8  // H100 sweep (bench/RESULTS.md): +1-3 % over 4
#endif
#ifndef SIMT_UNROLL_R
#define SIMT_UNROLL_R 4
#endif
#include "simt_f32.h"
#include "block.h"
#include "softmax.h"

#define MR (BLOCK_M / 16)
#define MC (BLOCK_N / 16)
#define PS (BLOCK_N + 16)

// Shared memory: Q and dO [BLOCK_M][RSTRIDE], two buffers of K [2][BLOCK_N][RSTRIDE], V
// [BLOCK_N][RSTRIDE], dS [BLOCK_M][PS].
struct Smem {
    float q[BLOCK_M * RSTRIDE], dout[BLOCK_M * RSTRIDE], k[2 * BLOCK_N * RSTRIDE], v[BLOCK_N * RSTRIDE];
    float ds[BLOCK_M * PS];
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
    KeyTile tile = blk.first_tile();
    cp_rows_f32<BLOCK_M, RSTRIDE>(smem.q, p.q + blk.q_at(p.q_st), blk.m0, blk.Sq, p.q_st.seq);
    cp_rows_f32<BLOCK_M, RSTRIDE>(smem.dout, p.dout + blk.q_at(p.do_st), blk.m0, blk.Sq, p.do_st.seq);
    if (tile.n0 < n_end) {
        cp_rows_f32<BLOCK_N, RSTRIDE>(smem.k, k, tile.n0, blk.Sk, p.k_st.seq);
        cp_rows_f32<BLOCK_N, RSTRIDE>(smem.v, v, tile.n0, blk.Sk, p.v_st.seq);
    }
    cp_async_commit();

    float lse2[MR], dlt[MR];
    float4 acc[MR][DV4];
#pragma unroll
    for (int i = 0; i < MR; ++i) {
        blk.row_stats(p, blk.m0 + ty + 16 * i, lse2[i], dlt[i]);
        zero(acc[i]);
    }

    int buf = 0;
    for (; tile.n0 < n_end; buf ^= 1) {
        const KeyTile next = blk.next_tile(tile);
        const int n0 = tile.n0;
        float* sK = smem.k + buf * BLOCK_N * RSTRIDE;
        cp_async_wait<0>();
        __syncthreads();  // (A) K_j, V_j in place; every thread is done with dS and K_{j-1}
        if (next.n0 < n_end) cp_rows_f32<BLOCK_N, RSTRIDE>(smem.k + (buf ^ 1) * BLOCK_N * RSTRIDE, k, next.n0, blk.Sk, p.k_st.seq);
        cp_async_commit();

        float s[MR][MC], dp[MR][MC];
        zero(s);
        zero(dp);
        mm_rows_f32<MR, MC, RSTRIDE>(s, smem.q, sK);
        mm_rows_f32<MR, MC, RSTRIDE>(dp, smem.dout, smem.v);
        store_ds_rows<PS>(smem.ds, s, dp, lse2, dlt, blk.m0, n0, blk.tile_mask(tile), p.scale_log2, blk.vis(), ty, tx);
        __syncthreads();  // (B) dS visible; every thread is done with V_j
        if (next.n0 < n_end) cp_rows_f32<BLOCK_N, RSTRIDE>(smem.v, v, next.n0, blk.Sk, p.v_st.seq);
        cp_async_commit();
        mm_pv_f32<MR, BLOCK_N, PS, RSTRIDE>(acc, smem.ds, sK);
        tile = next;
    }
    cp_async_wait<0>();
    float mul[MR];
#pragma unroll
    for (int i = 0; i < MR; ++i) mul[i] = p.scale;
    store_rows4_f32<MR>(p.dq + blk.q_at(p.dq_st), acc, mul, blk.m0, blk.Sq, p.dq_st.seq);
}
