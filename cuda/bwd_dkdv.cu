// bwd_dkdv.cu — dK and dV on tensor cores, and with ATOMIC_DQ also dQ: fp16 / bf16 (mma m16n8k16),
// and f32 as split-TF32 or TF32 products (TF32_TERMS, the GEMMs of tf32.h; mma m16n8k8), P and dS
// kept in f32.
//
// Grid (ceil(Sk / BLOCK_N), Hkv, B). One block owns BLOCK_N key rows of one kv head and loops over
// the GQA_GROUP query heads that share it and over every query tile that can see its keys, so GQA
// sums happen in registers. K and V stay in shared memory; Q/dO tiles (BLOCK_M rows), with their
// lse and delta, stream through two buffers. Warp w owns key rows 16*(w / D_SPLIT).. and columns
// part (w % D_SPLIT) of dK/dV. Everything is computed transposed, so P and dS never leave registers:
//   S^T = K Q^T, P^T = exp2(S^T * scale_log2 - lse_log2), dP^T = V dO^T, dS^T = P^T * (dP^T - delta)
//   dV += P^T dO, dK += dS^T Q;   finally dK *= scale.
// dK and dV are deterministic (one block owns them, no atomics). With ATOMIC_DQ = 1 the block also
// writes dS^T to shared memory and all warps add dS K (BLOCK_M x D, unscaled) into p.dq_accum with
// f32 atomics — 5 tile GEMMs per (query, key) tile pair instead of the 7 of separate dQ and dK/dV
// kernels, at the price of a run-to-run order of the additions (bwd_dq_convert finishes dQ).
#include "tile.h"
#include "block.h"
#include "bwd_grads.h"

#if BLOCK_N * D_SPLIT != 16 * NUM_WARPS
#error "dkdv: BLOCK_N * D_SPLIT must be 16 * NUM_WARPS"
#endif
#define DPART (DPAD / D_SPLIT)  // dK/dV columns per warp, a multiple of MMA_K

#if ATOMIC_DQ
// dQ work split: items of DQ_MT 16-row query tiles x DQ_NT 8-column slices of D, dealt to the
// warps round-robin; with the usual tiles every warp gets exactly one item.
#if FLASH_DTYPE == 2
#define DS_ROW (BLOCK_M + 4)  // sdS row stride: 4 mod 16 floats, conflict-free scalar reads (tf32.h's gemm_atb)
#else
#define DS_ROW (BLOCK_M + 8)  // sdS row stride: an odd number of 16-byte units, conflict-free ldmatrix
#endif
constexpr int DQ_MT = (BLOCK_M / 16) % 3 == 0 ? 3 : (BLOCK_M / 16) % 2 == 0 ? 2 : 1;
constexpr int DQ_MGROUPS = BLOCK_M / 16 / DQ_MT;
constexpr int DQ_NSPLIT = NUM_WARPS / DQ_MGROUPS > 0 ? NUM_WARPS / DQ_MGROUPS : 1;
constexpr int DQ_NT_ALL = DPAD / 8;
#if FLASH_DTYPE == 2
// Any column tiles per item (the TF32 GEMMs take them one by one), a divisor of DQ_NT_ALL, which
// may be odd (D = 40, 72, 136): the largest one up to DQ_NT_ALL / DQ_NSPLIT.
constexpr int dq_nt_f32() {
    for (int n = DQ_NT_ALL / DQ_NSPLIT; n > 1; --n)
        if (DQ_NT_ALL % n == 0) return n;
    return 1;
}
constexpr int DQ_NT = dq_nt_f32();
#else
constexpr int DQ_NT = (DQ_NT_ALL % DQ_NSPLIT == 0 && (DQ_NT_ALL / DQ_NSPLIT) % 2 == 0)
                          ? DQ_NT_ALL / DQ_NSPLIT
                          : (DQ_NT_ALL % 4 == 0 ? 4 : 2);
#endif
constexpr int DQ_ITEMS = DQ_MGROUPS * (DQ_NT_ALL / DQ_NT);

// dq_accum[b, m0 + i, h, :] += sum_j dS[i][j] K[j][:] for one work item (DQ_MT query tiles x DQ_NT
// column tiles) of the block's BLOCK_M x BLOCK_N tile of dS (stored transposed in sdS) and its keys.
__device__ __forceinline__ void add_dq_item(const FlashParams& p, const KeyBlock& blk, const elem_t* sdS,
                                            const elem_t* sK, int h, int m0, int item) {
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int mg = item % DQ_MGROUPS, ng = item / DQ_MGROUPS;
    float acc[DQ_MT][DQ_NT][4];
    zero(acc);
    gemm_atb<DQ_MT, DQ_NT, BLOCK_N / 16>(acc, sdS, DS_ROW, mg * DQ_MT * 16, sK, ng * DQ_NT * 8);
    float* dq = p.dq_accum + blk.accum_base(p, h);
#pragma unroll
    for (int mt = 0; mt < DQ_MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = m0 + (mg * DQ_MT + mt) * 16 + g + 8 * r;
            if (row >= blk.Sq) continue;
#pragma unroll
            for (int nt = 0; nt < DQ_NT; ++nt) {
                const int col = (ng * DQ_NT + nt) * 8 + 2 * t;
                if (col < HEAD_DIM) red_add_f32x2(dq + row * blk.accum_stride + col, acc[mt][nt][2 * r], acc[mt][nt][2 * r + 1]);
            }
        }
}

__device__ __forceinline__ void add_dq_tile(const FlashParams& p, const KeyBlock& blk, const elem_t* sdS,
                                            const elem_t* sK, int h, int m0) {
    const int warp = threadIdx.x / 32;
    if constexpr (DQ_ITEMS == NUM_WARPS) {  // the usual tiles: one item per warp, no loop
        add_dq_item(p, blk, sdS, sK, h, m0, warp);
    } else {
#pragma unroll 1
        for (int item = warp; item < DQ_ITEMS; item += NUM_WARPS) add_dq_item(p, blk, sdS, sK, h, m0, item);
    }
}
#endif

// Shared memory: the block's K and V [BLOCK_N][SROW]; two buffers of the query tile's Q and dO
// [2][BLOCK_M][SROW] and of its lse_log2 and delta [2][BLOCK_M]; with ATOMIC_DQ, dS^T [BLOCK_N][DS_ROW].
struct Smem {
    elem_t k[BLOCK_N * SROW], v[BLOCK_N * SROW], q[2 * BLOCK_M * SROW], dout[2 * BLOCK_M * SROW];
    float lse[2 * BLOCK_M], delta[2 * BLOCK_M];
#if ATOMIC_DQ
    elem_t ds[BLOCK_N * DS_ROW];
#endif
};
FLASH_EXPORT_SMEM(sizeof(Smem))

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS)
flash_bwd_dkdv(const FlashParams p) {
    Smem& smem = shared_memory<Smem>();
    const KeyBlock blk(p);
    if (blk.empty()) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int slice = warp / D_SPLIT, part = warp % D_SPLIT;
    QueryWalk w = blk.query_walk();

    load_tile_async<BLOCK_N>(smem.k, p.k + blk.kv_at(p.k_st), blk.n0, blk.Sk, p.k_st.seq);
    load_tile_async<BLOCK_N>(smem.v, p.v + blk.kv_at(p.v_st), blk.n0, blk.Sk, p.v_st.seq);

    // Iteration it = (query head, query tile). Its Q tile (with lse, delta) and its dO tile go in
    // separate commit groups, so that S^T = K Q^T starts while dO is in flight. In flight at the
    // top of iteration it: Q_it, dO_it. lse/delta are plain stores, visible after the next barrier.
    auto load_q = [&](int it, int buf) {
        const int h = blk.head(it), m0 = blk.query_row(it);
        load_tile_async<BLOCK_M>(smem.q + buf * BLOCK_M * SROW, p.q + blk.q_at(p.q_st, h), m0, blk.Sq, p.q_st.seq);
        const i64 so = blk.stat_base(p, h);
        for (int i = threadIdx.x; i < BLOCK_M; i += NUM_THREADS) {
            const bool ok = m0 + i < blk.Sq;
            smem.lse[buf * BLOCK_M + i] = ok ? p.lse_log2[so + m0 + i] : POS_INF;
            smem.delta[buf * BLOCK_M + i] = ok ? p.delta[so + m0 + i] : 0.f;
        }
    };
    auto load_do = [&](int it, int buf) {
        const int h = blk.head(it), m0 = blk.query_row(it);
        load_tile_async<BLOCK_M>(smem.dout + buf * BLOCK_M * SROW, p.dout + blk.q_at(p.do_st, h), m0, blk.Sq, p.do_st.seq);
    };
    if (w.more()) load_q(w.it(), 0);
    cp_async_commit();  // with K and V
    if (w.more()) load_do(w.it(), 0);
    cp_async_commit();

    float dk[DPART / 8][4], dv[DPART / 8][4];
    zero(dk);
    zero(dv);
    const elem_t* sKw = smem.k + slice * 16 * SROW;
    const elem_t* sVw = smem.v + slice * 16 * SROW;
    const int key0 = blk.n0 + slice * 16;
    const int col0 = part * DPART;
    const int g = lane / 4, t = lane % 4;

    for (; w.more(); w.advance()) {
        blk.look_ahead(w);
        const int it = w.it(), buf = w.buf();
        cp_async_wait<1>();
        __syncthreads();  // Q_it landed; every warp is done with the previous iteration's buffers
        if (w.has_next()) load_q(w.next_it(), buf ^ 1);
        cp_async_commit();
        const elem_t* sQi = smem.q + buf * BLOCK_M * SROW;
        const elem_t* sdOi = smem.dout + buf * BLOCK_M * SROW;
        const float* lse2 = smem.lse + buf * BLOCK_M;
        const float* dlt = smem.delta + buf * BLOCK_M;
        const int m0 = blk.query_row(it);

        float s[BLOCK_M / 8][4], dp[BLOCK_M / 8][4];
        zero(s);
        zero(dp);
        gemm_abt<BLOCK_M / 8>(s, sKw, sQi);

        cp_async_wait<1>();
        __syncthreads();  // dO_it landed
        if (w.has_next()) load_do(w.next_it(), buf ^ 1);
        cp_async_commit();
        gemm_abt<BLOCK_M / 8>(dp, sVw, sdOi);
#if MODS
        grads_t<BLOCK_M / 8>(s, dp, p.scale_log2, blk.slice_mask(w, key0), key0, m0, blk.vis(blk.head(it)), lse2, dlt);
#else
        // As grads_t, but the visibility built only for the slices that need the mask: passing it
        // made the MASKED atomic-dQ kernels spill 52-436 bytes (sm_90a).
#pragma unroll
        for (int i = 0; i < BLOCK_M / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[i][e] *= p.scale_log2;
        if (blk.slice_mask(w, key0)) mask_tile<BLOCK_M / 8, true>(s, key0, m0, blk.vis(blk.head(it)));
#pragma unroll
        for (int i = 0; i < BLOCK_M / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = i * 8 + 2 * t + (e % 2);
                const float pr = fast_exp2(s[i][e] - lse2[col]);
                s[i][e] = pr;                                // P^T
                dp[i][e] = pr * (dp[i][e] - dlt[col]);       // dS^T
            }
#endif
        gemm_pb<BLOCK_M / 16, DPART / 8>(dv, s, sdOi, col0);
        gemm_pb<BLOCK_M / 16, DPART / 8>(dk, dp, sQi, col0);
#if ATOMIC_DQ
        if (part == 0) {  // the D_SPLIT warps of a slice hold the same dS^T
#pragma unroll
            for (int i = 0; i < BLOCK_M / 8; ++i)
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    store2(smem.ds + (slice * 16 + g + 8 * r) * DS_ROW + i * 8 + 2 * t, dp[i][2 * r], dp[i][2 * r + 1]);
        }
        __syncthreads();  // dS^T complete (the next write follows the next iteration's first barrier)
        add_dq_tile(p, blk, smem.ds, smem.k, blk.head(it), m0);
#endif
    }
    store_tile<DPART / 8>(p.dk + blk.kv_at(p.dk_st), dk, p.scale, p.scale, key0, blk.Sk, col0, p.dk_st.seq);
    store_tile<DPART / 8>(p.dv + blk.kv_at(p.dv_st), dv, 1.f, 1.f, key0, blk.Sk, col0, p.dv_st.seq);
}
