// bwd_dq_f32.cu — dQ in exact fp32 (SIMT). Deterministic: no atomics.
//
// Grid (ceil(Sq / BLOCK_M), H, B), 256 threads. Per key tile:
//   S = Q K^T, P = exp2(S * scale_log2 - lse_log2), dP = dO V^T, dS = P * (dP - delta) (to shared
//   memory), dQ += dS K;   finally dQ *= scale.
#include "tile_f32.h"
#include "mask.h"

#define MR (BLOCK_M / 16)
#define MC (BLOCK_N / 16)
#define PSTRIDE (BLOCK_N + 1)

// Shared memory, byte offsets.
struct SmemLayout {
    enum : int {
        q = 0,                                          // [BLOCK_M][FSTRIDE]
        dout = q + bytes_of<float>(BLOCK_M * FSTRIDE),  // [BLOCK_M][FSTRIDE]
        k = dout + bytes_of<float>(BLOCK_M * FSTRIDE),  // [BLOCK_N][FSTRIDE]
        v = k + bytes_of<float>(BLOCK_N * FSTRIDE),     // [BLOCK_N][FSTRIDE]
        ds = v + bytes_of<float>(BLOCK_N * FSTRIDE),    // [BLOCK_M][PSTRIDE]
        bytes = ds + bytes_of<float>(BLOCK_M * PSTRIDE),
    };
};
FLASH_EXPORT_SMEM(SmemLayout::bytes)

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
flash_bwd_dq(const FlashParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* sQ = smem_at<float>(smem_raw, SmemLayout::q);
    float* sdO = smem_at<float>(smem_raw, SmemLayout::dout);
    float* sK = smem_at<float>(smem_raw, SmemLayout::k);
    float* sV = smem_at<float>(smem_raw, SmemLayout::v);
    float* sdS = smem_at<float>(smem_raw, SmemLayout::ds);

    const QueryBlock blk(p);
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const float* k = p.k + blk.kv_base(p);
    const float* v = p.v + blk.kv_base(p);
    const int n_end = blk.n_end();
    load_tile_f32<BLOCK_M>(sQ, p.q + blk.q_base(p), blk.m0, blk.Sq, blk.q_stride);
    load_tile_f32<BLOCK_M>(sdO, p.dout + blk.q_base(p), blk.m0, blk.Sq, blk.q_stride);

    float lse2[MR], dlt[MR], acc[MR][DCOLS];
#pragma unroll
    for (int i = 0; i < MR; ++i) {
        const int row = blk.m0 + ty + 16 * i;
        const i64 idx = blk.stat_base(p) + row;
        lse2[i] = row < blk.Sq ? p.lse_log2[idx] : POS_INF;
        dlt[i] = row < blk.Sq ? p.delta[idx] : 0.f;
#pragma unroll
        for (int jd = 0; jd < DCOLS; ++jd) acc[i][jd] = 0.f;
    }

    for (int n0 = 0; n0 < n_end; n0 += BLOCK_N) {
        __syncthreads();
        load_tile_f32<BLOCK_N>(sK, k, n0, blk.Sk, blk.kv_stride);
        load_tile_f32<BLOCK_N>(sV, v, n0, blk.Sk, blk.kv_stride);
        __syncthreads();
        float s[MR][MC], dp[MR][MC];
#pragma unroll
        for (int i = 0; i < MR; ++i)
#pragma unroll
            for (int j = 0; j < MC; ++j) s[i][j] = dp[i][j] = 0.f;
        mm_abt_f32<MR, MC>(s, sQ, sK);
        mm_abt_f32<MR, MC>(dp, sdO, sV);
        const bool need_mask = tile_needs_mask(blk.m0, n0, BLOCK_N, blk.Sq, blk.Sk);
#pragma unroll
        for (int i = 0; i < MR; ++i) {
            const int row = blk.m0 + ty + 16 * i;
#pragma unroll
            for (int j = 0; j < MC; ++j) {
                float x = s[i][j] * p.scale_log2;
                if (need_mask && !visible(row, n0 + tx + 16 * j, blk.Sq, blk.Sk)) x = NEG_INF;
                const float pr = fast_exp2(x - lse2[i]);
                sdS[(ty + 16 * i) * PSTRIDE + tx + 16 * j] = pr * (dp[i][j] - dlt[i]);
            }
        }
        __syncthreads();
        mm_pb_f32<MR, BLOCK_N>(acc, sdS, PSTRIDE, sK);
    }
    float mul[MR];
#pragma unroll
    for (int i = 0; i < MR; ++i) mul[i] = p.scale;
    store_rows_f32<MR>(p.dq + blk.q_base(p), acc, mul, blk.m0, blk.Sq, blk.q_stride);
}
