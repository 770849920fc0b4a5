// bwd_dkdv_f32_simt.cu — dK and dV (and with ATOMIC_DQ also dQ) in exact fp32 (SIMT) for HEAD_DIM 64, 128.
//
// Grid (ceil(Sk / BLOCK_N), Hkv, B), 256 threads (16 x 16). One block owns BLOCK_N keys of one kv
// head and loops over the GQA_GROUP query heads sharing it and every query tile that sees its keys:
//   S^T = K Q^T, dP^T = V dO^T            thread (ty, tx): keys ty + 16 i, queries tx + 16 j
//   P^T = exp2(S^T * scale_log2 - lse_log2), dS^T = P^T * (dP^T - delta)   -> shared memory
//   dV += P^T dO, dK += dS^T Q            thread: keys ty + 16 i, float4 column groups tx + 16 jj
//   ATOMIC_DQ: dq_accum[q] += sum_keys dS^T K (unscaled)   thread: queries 4 ty .. 4 ty + 3
// finally dK *= scale. dK, dV are deterministic (one block owns them); dQ by red.global.add.v4.f32.
// Q, dO (cp.async) and lse, delta of the next query tile load while the dQ product runs.
#ifndef SIMT_UNROLL_D
#define SIMT_UNROLL_D 8  // H100 sweep (bench/RESULTS.md): +1-3 % over 4
#endif
#ifndef SIMT_UNROLL_R
#define SIMT_UNROLL_R 4
#endif
#include "simt_f32.h"
#include "block.h"

#define MR (BLOCK_N / 16)  // key rows per thread
#define MC (BLOCK_M / 16)  // query columns per thread
#define PS (BLOCK_M + 16)  // rows ty, ty + 1 of one warp's scalar stores land 16 banks apart

#if ATOMIC_DQ && BLOCK_M != 64
#error "the dQ product maps 4 queries to each of 16 half-warps: BLOCK_M must be 64"
#endif

// Shared memory: K and V [BLOCK_N][RSTRIDE], Q and dO [BLOCK_M][RSTRIDE], P^T and dS^T
// [BLOCK_N][PS], the query tile's lse_log2 and delta [BLOCK_M].
struct Smem {
    float k[BLOCK_N * RSTRIDE], v[BLOCK_N * RSTRIDE], q[BLOCK_M * RSTRIDE], dout[BLOCK_M * RSTRIDE];
    float p[BLOCK_N * PS], ds[BLOCK_N * PS], lse[BLOCK_M], delta[BLOCK_M];
};
FLASH_EXPORT_SMEM(sizeof(Smem))

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
flash_bwd_dkdv(const FlashParams p) {
    Smem& smem = shared_memory<Smem>();
    const KeyBlock blk(p);
    if (blk.empty()) return;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const int n0 = blk.n0, Sq = blk.Sq, Sk = blk.Sk;
    QueryWalk w = blk.query_walk();

    cp_rows_f32<BLOCK_N, RSTRIDE>(smem.k, p.k + blk.kv_at(p.k_st), n0, Sk, p.k_st.seq);
    cp_rows_f32<BLOCK_N, RSTRIDE>(smem.v, p.v + blk.kv_at(p.v_st), n0, Sk, p.v_st.seq);
    if (w.more()) {
        const int h = blk.head(w.it()), m0 = blk.query_row(w.it());
        cp_rows_f32<BLOCK_M, RSTRIDE>(smem.q, p.q + blk.q_at(p.q_st, h), m0, Sq, p.q_st.seq);
        cp_rows_f32<BLOCK_M, RSTRIDE>(smem.dout, p.dout + blk.q_at(p.do_st, h), m0, Sq, p.do_st.seq);
        if (threadIdx.x < BLOCK_M) {
            const int q = m0 + threadIdx.x;
            const i64 so = blk.stat_base(p, h);
            smem.lse[threadIdx.x] = q < Sq ? p.lse_log2[so + q] : POS_INF;
            smem.delta[threadIdx.x] = q < Sq ? p.delta[so + q] : 0.f;
        }
    }
    cp_async_commit();

    float4 dk[MR][DV4], dv[MR][DV4];
#pragma unroll
    for (int i = 0; i < MR; ++i)
#pragma unroll
        for (int jj = 0; jj < DV4; ++jj) dk[i][jj] = dv[i][jj] = make_float4(0.f, 0.f, 0.f, 0.f);

    for (; w.more(); w.advance()) {
        blk.look_ahead(w);
        const int h = blk.head(w.it()), m0 = blk.query_row(w.it());
        cp_async_wait<0>();
        __syncthreads();  // (A) Q, dO, lse, delta of this tile in place; last tile's dS^T reads done

        float s[MR][MC], dp[MR][MC];
#pragma unroll
        for (int i = 0; i < MR; ++i)
#pragma unroll
            for (int j = 0; j < MC; ++j) s[i][j] = dp[i][j] = 0.f;
        mm_rows_f32<MR, MC, RSTRIDE>(s, smem.k, smem.q);
        mm_rows_f32<MR, MC, RSTRIDE>(dp, smem.v, smem.dout);

        float lse2[MC], dlt[MC];
#pragma unroll
        for (int j = 0; j < MC; ++j) {
            lse2[j] = smem.lse[tx + 16 * j];
            dlt[j] = smem.delta[tx + 16 * j];
        }
#if MASKED
        const bool need_mask = blk.tile_mask(w);
        const Visibility vis = blk.vis(h);
#elif IS_CAUSAL || (ATOMIC_DQ && !EVEN_N)
        bool need_mask = false;
#if IS_CAUSAL
        need_mask = n0 + BLOCK_N - 1 > m0 + Sk - Sq;
#endif
#if ATOMIC_DQ && !EVEN_N
        need_mask = need_mask || n0 + BLOCK_N > Sk;  // zero-filled keys must add nothing to dQ
#endif
#else
        const bool need_mask = false;
#endif
#pragma unroll
        for (int i = 0; i < MR; ++i) {
            const int key = n0 + ty + 16 * i;
#pragma unroll
            for (int j = 0; j < MC; ++j) {
                float x = s[i][j] * p.scale_log2;
#if MASKED
                if (need_mask && !vis(m0 + tx + 16 * j, key)) x = NEG_INF;
#else
                if (need_mask && !visible(m0 + tx + 16 * j, key, Sq, Sk)) x = NEG_INF;
#endif
#if MODS
                float dcap;  // the softcap's chain rule (1 without one)
                x = vis.modify(x, m0 + tx + 16 * j, key, dcap);
#else
                const float dcap = 1.f;
#endif
                const float pr = fast_exp2(x - lse2[j]);
                smem.p[(ty + 16 * i) * PS + tx + 16 * j] = pr;
                smem.ds[(ty + 16 * i) * PS + tx + 16 * j] = pr * (dp[i][j] - dlt[j]) * dcap;
            }
        }
        __syncthreads();  // (B) P^T, dS^T visible
        mm_pv_f32<MR, BLOCK_M, PS, RSTRIDE>(dv, smem.p, smem.dout);
        mm_pv_f32<MR, BLOCK_M, PS, RSTRIDE>(dk, smem.ds, smem.q);

#if ATOMIC_DQ
        __syncthreads();  // (C) every thread is done with Q, dO, lse, delta: load the next tile's
        float nl = POS_INF, nd = 0.f;
        if (w.has_next()) {
            const int h1 = blk.head(w.next_it()), m1 = blk.query_row(w.next_it());
            cp_rows_f32<BLOCK_M, RSTRIDE>(smem.q, p.q + blk.q_at(p.q_st, h1), m1, Sq, p.q_st.seq);
            cp_rows_f32<BLOCK_M, RSTRIDE>(smem.dout, p.dout + blk.q_at(p.do_st, h1), m1, Sq, p.do_st.seq);
            if (threadIdx.x < BLOCK_M && m1 + (int)threadIdx.x < Sq) {
                const i64 idx = blk.stat_base(p, h1) + m1 + threadIdx.x;
                nl = p.lse_log2[idx];
                nd = p.delta[idx];
            }
        }
        cp_async_commit();
        {
            // dQ rows m0 + 4 ty + r, float4 column groups tx + 16 jj: sum over keys of dS^T[key][q] K[key][:]
            float4 dq[4][DV4];
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int jj = 0; jj < DV4; ++jj) dq[r][jj] = make_float4(0.f, 0.f, 0.f, 0.f);
            const float* a = smem.ds + 4 * ty;
            const float* kb = smem.k + 4 * tx;
#pragma unroll 4
            for (int c = 0; c < BLOCK_N; ++c) {
                const float4 av = lds4(a + c * PS);
                float4 bv[DV4];
#pragma unroll
                for (int jj = 0; jj < DV4; ++jj) bv[jj] = lds4(kb + c * RSTRIDE + 64 * jj);
#pragma unroll
                for (int jj = 0; jj < DV4; ++jj) {
                    fma4(dq[0][jj], av.x, bv[jj]);
                    fma4(dq[1][jj], av.y, bv[jj]);
                    fma4(dq[2][jj], av.z, bv[jj]);
                    fma4(dq[3][jj], av.w, bv[jj]);
                }
            }
            float* dqa = p.dq_accum + blk.accum_base(p, h);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int q = m0 + 4 * ty + r;
                if (q < Sq) {
#pragma unroll
                    for (int jj = 0; jj < DV4; ++jj) red_add4(dqa + (i64)q * blk.accum_stride + 4 * (tx + 16 * jj), dq[r][jj]);
                }
            }
        }
        if (threadIdx.x < BLOCK_M) {
            smem.lse[threadIdx.x] = nl;
            smem.delta[threadIdx.x] = nd;
        }
#else
        if (w.has_next()) {
            __syncthreads();  // (C) every thread is done with Q, dO, lse, delta
            const int h1 = blk.head(w.next_it()), m1 = blk.query_row(w.next_it());
            cp_rows_f32<BLOCK_M, RSTRIDE>(smem.q, p.q + blk.q_at(p.q_st, h1), m1, Sq, p.q_st.seq);
            cp_rows_f32<BLOCK_M, RSTRIDE>(smem.dout, p.dout + blk.q_at(p.do_st, h1), m1, Sq, p.do_st.seq);
            if (threadIdx.x < BLOCK_M) {
                const bool ok = m1 + (int)threadIdx.x < Sq;
                const i64 idx = blk.stat_base(p, h1) + m1 + threadIdx.x;
                smem.lse[threadIdx.x] = ok ? p.lse_log2[idx] : POS_INF;
                smem.delta[threadIdx.x] = ok ? p.delta[idx] : 0.f;
            }
            cp_async_commit();
        }
#endif
    }
    cp_async_wait<0>();

    float one[MR], sc[MR];
#pragma unroll
    for (int i = 0; i < MR; ++i) { one[i] = 1.f; sc[i] = p.scale; }
    store_rows4_f32<MR>(p.dk + blk.kv_at(p.dk_st), dk, sc, n0, Sk, p.dk_st.seq);
    store_rows4_f32<MR>(p.dv + blk.kv_at(p.dv_st), dv, one, n0, Sk, p.dv_st.seq);
}
