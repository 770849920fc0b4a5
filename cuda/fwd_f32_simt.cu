// fwd_f32_simt.cu — attention forward in exact fp32 (SIMT FMAs, no TF32) for HEAD_DIM 64 and 128.
//
// Grid (ceil(Sq / BLOCK_M), H, B), 256 threads (16 x 16). Thread (ty, tx) owns query rows ty + 16 i
// (i < BLOCK_M / 16), keys tx + 16 j of each key tile and the float4 column groups tx + 16 jj of O.
// Per key tile: S = Q K^T from LDS.128 reads along D (simt_f32.h), mask, online softmax in the exp2
// domain (rows reduced over the half-warp), P to shared memory, O += P V. K and V are loaded with
// cp.async, each while the other product runs:
//   wait K_j | load V_j | S = Q K_j^T, softmax, P | wait V_j | load K_{j+1} | O += P V_j
#ifndef SIMT_UNROLL_D
#define SIMT_UNROLL_D 8  // H100 sweep (bench/RESULTS.md): +1-3 % over 4
#endif
#ifndef SIMT_UNROLL_R
#define SIMT_UNROLL_R 2
#endif
#include "simt_f32.h"
#include "block.h"
#include "softmax.h"

#define MR (BLOCK_M / 16)
#define MC (BLOCK_N / 16)
#define QS RSTRIDE
#define VS HEAD_DIM
#define PS (BLOCK_N + 16)  // rows ty and ty + 1 of one warp's scalar P stores land 16 banks apart

// Shared memory: Q [BLOCK_M][QS], K [BLOCK_N][RSTRIDE], V [BLOCK_N][VS], P [BLOCK_M][PS].
struct Smem {
    float q[BLOCK_M * QS], k[BLOCK_N * RSTRIDE], v[BLOCK_N * VS], p[BLOCK_M * PS];
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
    KeyTile tile = blk.first_tile();
    cp_rows_f32<BLOCK_M, QS>(smem.q, p.q + blk.q_at(p.q_st), blk.m0, blk.Sq, p.q_st.seq);
    if (tile.n0 < n_end) cp_rows_f32<BLOCK_N, RSTRIDE>(smem.k, k, tile.n0, blk.Sk, p.k_st.seq);
    cp_async_commit();

    float4 acc[MR][DV4];
    OnlineSoftmaxRows<MR> sm;
    sm.init(acc, blk.sink2(p));

    while (tile.n0 < n_end) {
        const KeyTile next = blk.next_tile(tile);
        const int n0 = tile.n0;
        cp_async_wait<0>();
        __syncthreads();  // K_j landed; every thread is done with V_{j-1} and P
        cp_rows_f32<BLOCK_N, VS>(smem.v, v, n0, blk.Sk, p.v_st.seq);
        cp_async_commit();

        float s[MR][MC];
        zero(s);
        mm_rows_f32<MR, MC, QS>(s, smem.q, smem.k);

        sm.update<PS>(s, acc, smem.p, blk.m0, n0, blk.tile_mask(tile), p.scale_log2, blk.vis());
        cp_async_wait<0>();
        __syncthreads();  // V_j landed, P visible, every thread is done with K_j
        if (next.n0 < n_end) cp_rows_f32<BLOCK_N, RSTRIDE>(smem.k, k, next.n0, blk.Sk, p.k_st.seq);
        cp_async_commit();
        mm_pv_f32<MR, BLOCK_N, PS, VS>(acc, smem.p, smem.v);
        tile = next;
    }
    cp_async_wait<0>();

    float inv[MR];
    sm.finish(inv, p.lse, blk.stat_base(p), blk.m0, blk.Sq, ty, tx);
    store_rows4_f32<MR>(p.o + blk.q_at(p.o_st), acc, inv, blk.m0, blk.Sq, p.o_st.seq);
}
