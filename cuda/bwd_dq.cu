// bwd_dq.cu — dQ on tensor cores: fp16 / bf16, and f32 as split-TF32 or TF32 products (TF32_TERMS,
// tf32.h), dS kept in f32. Deterministic: no atomics, one block owns its rows.
//
// Grid (ceil(Sq / BLOCK_M), H, B); each warp owns 16 query rows. K/V tiles stream through two
// shared-memory buffers. Per tile, with P recomputed from the saved logsumexp:
//   S = Q K^T, P = exp2(S * scale_log2 - lse_log2), dP = dO V^T, dS = P * (dP - delta), dQ += dS K
// and finally dQ *= scale.
#include "tile.h"
#include "block.h"

#if BLOCK_M != 16 * NUM_WARPS
#error "dq: BLOCK_M must be 16 * NUM_WARPS"
#endif

// Shared memory: Q and dO [BLOCK_M][SROW]; K and V, two buffers [2][BLOCK_N][SROW] each.
struct Smem {
    elem_t q[BLOCK_M * SROW], dout[BLOCK_M * SROW], k[2 * BLOCK_N * SROW], v[2 * BLOCK_N * SROW];
};
FLASH_EXPORT_SMEM(sizeof(Smem))

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
flash_bwd_dq(const FlashParams p) {
    Smem& smem = shared_memory<Smem>();
    const QueryBlock blk(p);
    if (blk.empty()) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4;
    const elem_t* k = p.k + blk.kv_at(p.k_st);
    const elem_t* v = p.v + blk.kv_at(p.v_st);
    KeyWalk w = blk.key_walk();

    // Commit groups: (Q, dO, K_0), V_0, then K_{j+1} and V_{j+1} per tile, so that S = Q K^T
    // starts while V is in flight. In flight at the top of iteration j: K_j, V_j.
    load_tile_async<BLOCK_M>(smem.q, p.q + blk.q_at(p.q_st), blk.m0, blk.Sq, p.q_st.seq);
    load_tile_async<BLOCK_M>(smem.dout, p.dout + blk.q_at(p.do_st), blk.m0, blk.Sq, p.do_st.seq);
    if (w.more()) load_tile_async<BLOCK_N>(smem.k, k, w.n0(), blk.Sk, p.k_st.seq);
    cp_async_commit();
    if (w.more()) load_tile_async<BLOCK_N>(smem.v, v, w.n0(), blk.Sk, p.v_st.seq);
    cp_async_commit();

    // Row statistics of this lane's two rows (rows past Sq: lse +inf gives P = 0).
    const int row0 = blk.m0 + warp * 16;
    float lse2[2], dlt[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) blk.row_stats(p, row0 + g + 8 * r, lse2[r], dlt[r]);

    float dq[DPAD / 8][4];
    zero(dq);
    const elem_t* sQw = smem.q + warp * 16 * SROW;
    const elem_t* sdOw = smem.dout + warp * 16 * SROW;

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

        float s[BLOCK_N / 8][4], dp[BLOCK_N / 8][4];
        zero(s);
        zero(dp);
        gemm_abt<BLOCK_N / 8>(s, sQw, sKj);

        cp_async_wait<1>();
        __syncthreads();  // V_j landed; every warp is done with V_{j-1}'s buffer
        if (w.has_next()) load_tile_async<BLOCK_N>(smem.v + nb * BLOCK_N * SROW, v, w.next_n0(), blk.Sk, p.v_st.seq);
        cp_async_commit();
        gemm_abt<BLOCK_N / 8>(dp, sdOw, sVj);
#pragma unroll
        for (int i = 0; i < BLOCK_N / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[i][e] *= p.scale_log2;
#if MODS
        const Visibility vis = blk.vis();
        if (blk.tile_mask(w)) mask_tile<BLOCK_N / 8>(s, row0, n0, vis);
        const float d0 = vis.dist(row0 + g, n0 + 2 * (lane % 4));  // mask.h's modify_tile
#pragma unroll
        for (int i = 0; i < BLOCK_N / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float dcap;  // the softcap's chain rule (1 without one)
                const float x = vis.modify_at(s[i][e], d0 + (float)(8 * (e / 2) - 8 * i - e % 2), dcap);
                const float pr = fast_exp2(x - lse2[e / 2]);
                s[i][e] = pr * (dp[i][e] - dlt[e / 2]) * dcap;  // dS
            }
#else
        if (blk.tile_mask(w)) mask_tile<BLOCK_N / 8>(s, row0, n0, blk.vis());
#pragma unroll
        for (int i = 0; i < BLOCK_N / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float pr = fast_exp2(s[i][e] - lse2[e / 2]);
                s[i][e] = pr * (dp[i][e] - dlt[e / 2]);  // dS
            }
#endif
        gemm_pb<BLOCK_N / 16, DPAD / 8>(dq, s, sKj, 0);
    }
    store_tile<DPAD / 8>(p.dq + blk.q_at(p.dq_st), dq, p.scale, p.scale, row0, blk.Sq, 0, p.dq_st.seq);
}
