// bwd_dkdv_f32.cu — dK and dV (and with ATOMIC_DQ also dQ) in exact fp32 (SIMT), any head dim.
// dK, dV are deterministic; with ATOMIC_DQ the unscaled dS K is added into p.dq_accum by f32 atomics.
//
// Grid (ceil(Sk / BLOCK_N), Hkv, B), 256 threads. One block owns BLOCK_N keys of one kv head and
// loops over the GQA_GROUP query heads sharing it and every query tile that sees its keys:
//   S^T = K Q^T, P^T = exp2(S^T * scale_log2 - lse_log2), dP^T = V dO^T, dS^T = P^T * (dP^T - delta)
//   dV += P^T dO, dK += dS^T Q;   finally dK *= scale.
#include "tile_f32.h"
#include "block.h"

#define MR (BLOCK_N / 16)  // key rows per thread
#define MC (BLOCK_M / 16)  // query columns per thread
#define PSTRIDE (BLOCK_M + 1)

// Shared memory: K and V [BLOCK_N][FSTRIDE], Q and dO [BLOCK_M][FSTRIDE], P^T and dS^T
// [BLOCK_N][PSTRIDE], the query tile's lse_log2 and delta [BLOCK_M].
struct Smem {
    float k[BLOCK_N * FSTRIDE], v[BLOCK_N * FSTRIDE], q[BLOCK_M * FSTRIDE], dout[BLOCK_M * FSTRIDE];
    float p[BLOCK_N * PSTRIDE], ds[BLOCK_N * PSTRIDE], lse[BLOCK_M], delta[BLOCK_M];
};
FLASH_EXPORT_SMEM(sizeof(Smem))

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
flash_bwd_dkdv(const FlashParams p) {
    Smem& smem = shared_memory<Smem>();
    const KeyBlock blk(p);
    if (blk.empty()) return;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const int n0 = blk.n0, Sq = blk.Sq, Sk = blk.Sk;
    load_tile_f32<BLOCK_N>(smem.k, p.k + blk.kv_at(p.k_st), n0, Sk, p.k_st.seq);
    load_tile_f32<BLOCK_N>(smem.v, p.v + blk.kv_at(p.v_st), n0, Sk, p.v_st.seq);

    float dk[MR][DCOLS], dv[MR][DCOLS];
#pragma unroll
    for (int i = 0; i < MR; ++i)
#pragma unroll
        for (int jd = 0; jd < DCOLS; ++jd) dk[i][jd] = dv[i][jd] = 0.f;

    for (int g = 0; g < GQA_GROUP; ++g) {
        const int h = blk.hkv * GQA_GROUP + g;
        const i64 so = blk.stat_base(p, h);
#if MASKED
        const Visibility vis = blk.vis(h);
#endif
        for (int m0 = blk.m_start; m0 < blk.m_stop(); m0 += BLOCK_M) {
            const TileTest tile = blk.query_tile(h, m0);
            if (!tile.visit) {
#if MASKED
                m0 = blk.next_row(h, m0 + BLOCK_M) - BLOCK_M;  // past the hidden tiles that follow
#endif
                continue;
            }
            __syncthreads();
            load_tile_f32<BLOCK_M>(smem.q, p.q + blk.q_at(p.q_st, h), m0, Sq, p.q_st.seq);
            load_tile_f32<BLOCK_M>(smem.dout, p.dout + blk.q_at(p.do_st, h), m0, Sq, p.do_st.seq);
            for (int i = threadIdx.x; i < BLOCK_M; i += NUM_THREADS) {
                const bool ok = m0 + i < Sq;
                smem.lse[i] = ok ? p.lse_log2[so + m0 + i] : POS_INF;
                smem.delta[i] = ok ? p.delta[so + m0 + i] : 0.f;
            }
            __syncthreads();
            float s[MR][MC], dp[MR][MC];
#pragma unroll
            for (int i = 0; i < MR; ++i)
#pragma unroll
                for (int j = 0; j < MC; ++j) s[i][j] = dp[i][j] = 0.f;
            mm_abt_f32<MR, MC>(s, smem.k, smem.q);
            mm_abt_f32<MR, MC>(dp, smem.v, smem.dout);
#pragma unroll
            for (int i = 0; i < MR; ++i) {
                const int key = n0 + ty + 16 * i;
#pragma unroll
                for (int j = 0; j < MC; ++j) {
                    const int qc = tx + 16 * j;
                    float x = s[i][j] * p.scale_log2;
#if IS_CAUSAL
                    if (key > m0 + qc + Sk - Sq) x = NEG_INF;
#endif
#if ATOMIC_DQ && !EVEN_N && !MASKED
                    if (key >= Sk) x = NEG_INF;  // zero-filled keys must add nothing to dQ
#endif
#if MASKED
                    if (tile.mask && !vis(m0 + qc, key)) x = NEG_INF;
#endif
#if MODS
                    float dcap;  // the softcap's chain rule (1 without one)
                    x = vis.modify(x, m0 + qc, key, dcap);
#else
                    const float dcap = 1.f;
#endif
                    const float pr = fast_exp2(x - smem.lse[qc]);
                    smem.p[(ty + 16 * i) * PSTRIDE + qc] = pr;
                    smem.ds[(ty + 16 * i) * PSTRIDE + qc] = pr * (dp[i][j] - smem.delta[qc]) * dcap;
                }
            }
            __syncthreads();
            mm_pb_f32<MR, BLOCK_M>(dv, smem.p, PSTRIDE, smem.dout);
            mm_pb_f32<MR, BLOCK_M>(dk, smem.ds, PSTRIDE, smem.q);
#if ATOMIC_DQ
            {
                // dQ rows m0 + ty + 16 i, columns tx + 16 jd: sum over keys c of dS^T[c][q] K[c][:]
                float dq[MC][DCOLS];
#pragma unroll
                for (int i = 0; i < MC; ++i)
#pragma unroll
                    for (int jd = 0; jd < DCOLS; ++jd) dq[i][jd] = 0.f;
#pragma unroll 4
                for (int c = 0; c < BLOCK_N; ++c) {
                    float av[MC];
#pragma unroll
                    for (int i = 0; i < MC; ++i) av[i] = smem.ds[c * PSTRIDE + ty + 16 * i];
#pragma unroll
                    for (int jd = 0; jd < DCOLS; ++jd) {
                        const int col = tx + 16 * jd;
                        if (HEAD_DIM % 16 == 0 || col < HEAD_DIM) {
                            const float bv = smem.k[c * FSTRIDE + col];
#pragma unroll
                            for (int i = 0; i < MC; ++i) dq[i][jd] = fmaf(av[i], bv, dq[i][jd]);
                        }
                    }
                }
                float* dqa = p.dq_accum + blk.accum_base(p, h);
#pragma unroll
                for (int i = 0; i < MC; ++i) {
                    const int q = m0 + ty + 16 * i;
                    if (q >= Sq) continue;
#pragma unroll
                    for (int jd = 0; jd < DCOLS; ++jd) {
                        const int col = tx + 16 * jd;
                        if (col < HEAD_DIM) atomicAdd(dqa + (i64)q * blk.accum_stride + col, dq[i][jd]);
                    }
                }
            }
#endif
        }
    }
    float one[MR], sc[MR];
#pragma unroll
    for (int i = 0; i < MR; ++i) { one[i] = 1.f; sc[i] = p.scale; }
    store_rows_f32<MR>(p.dk + blk.kv_at(p.dk_st), dk, sc, n0, Sk, p.dk_st.seq);
    store_rows_f32<MR>(p.dv + blk.kv_at(p.dv_st), dv, one, n0, Sk, p.dv_st.seq);
}
