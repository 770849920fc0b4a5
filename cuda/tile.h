// tile.h — shared-memory tile layout, the async tile loader and the two warp-level GEMM shapes
// every tensor-core kernel uses (fp16 / bf16 here; fp32 as TF32 products in tf32.h).
//
// A tile holds R rows of HEAD_DIM elements, padded to DPAD (a multiple of MMA_K, the mma k step; the
// pad columns are zero) and stored with row stride SROW = DPAD + one 16-byte chunk. In 16-byte units
// that stride is odd, so the 8 row addresses of one ldmatrix hit 8 different bank groups.
#pragma once
#include "ptx.h"

#if FLASH_DTYPE == 2
#define MMA_K 8        // m16n8k8 TF32
#define CHUNK_ELEMS 4  // elements per 16-byte copy
#else
#define MMA_K 16  // m16n8k16 fp16 / bf16
#define CHUNK_ELEMS 8
#endif

// With D_SPLIT > 1 (dK/dV for large D) the pad makes DPAD / D_SPLIT a multiple of MMA_K as well.
#define DPAD (((HEAD_DIM) + MMA_K * D_SPLIT - 1) / (MMA_K * D_SPLIT) * (MMA_K * D_SPLIT))
#define SROW (DPAD + CHUNK_ELEMS)
#define CHUNKS_PER_ROW (DPAD / CHUNK_ELEMS)  // 16-byte chunks per padded row

// Issues cp.async for rows [row0, row0 + R) of a [*, stride_rows] tensor into tile `dst`. Rows past
// `nrows` and pad columns are zero-filled. `row_stride` is the element distance between rows.
template <int R>
__device__ __forceinline__ void load_tile_async(elem_t* dst, const elem_t* src, int row0, int nrows,
                                                i64 row_stride) {
    for (int i = threadIdx.x; i < R * CHUNKS_PER_ROW; i += NUM_THREADS) {
        const int r = i / CHUNKS_PER_ROW, c = i % CHUNKS_PER_ROW;
        const bool ok = (row0 + r < nrows) && (c * CHUNK_ELEMS < HEAD_DIM);
        const elem_t* g = ok ? src + (i64)(row0 + r) * row_stride + c * CHUNK_ELEMS : src;
        cp_async16(dst + r * SROW + c * CHUNK_ELEMS, g, ok);
    }
}

// Two adjacent outputs from f32: one 4-byte store of two 16-bit values, or one 8-byte store of two
// floats (dst 8-byte aligned).
__device__ __forceinline__ void store2(elem_t* dst, float lo, float hi) {
#if FLASH_DTYPE == 2
    *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
#else
    *reinterpret_cast<u32*>(dst) = pack2(lo, hi);
#endif
}

// Stores a warp's 16 x 8*NO f32 tile (times `mul`) to rows row0.. of a [*, row_stride] tensor,
// columns col0.., skipping rows >= nrows and columns >= HEAD_DIM.
template <int NO>
__device__ __forceinline__ void store_tile(elem_t* dst, const float (&acc)[NO][4], float mul0,
                                           float mul1, int row0, int nrows, int col0,
                                           i64 row_stride) {
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + g + r * 8;
        if (row >= nrows) continue;
        const float mul = r ? mul1 : mul0;
        elem_t* out = dst + (i64)row * row_stride;
#pragma unroll
        for (int no = 0; no < NO; ++no) {
            const int col = col0 + no * 8 + 2 * t;
            if (col < HEAD_DIM) store2(out + col, acc[no][2 * r] * mul, acc[no][2 * r + 1] * mul);
        }
    }
}

#if FLASH_DTYPE == 2
#include "tf32.h"
#else
// A warp owns MT consecutive 16-row tiles (rows 16*mt..) of each product; every B fragment read
// from shared memory feeds MT mma's (half the ldmatrix traffic at MT = 2). The single-tile forms
// below are MT = 1.

// acc[mt][2 nn] and acc[mt][2 nn + 1] += a[mt] * (the two 16 x 8 halves of fragment b), every mt.
template <int MT, int NT>
__device__ __forceinline__ void mma_b16(float (&acc)[MT][NT][4], const u32 (&a)[MT][4], const u32 (&b)[4],
                                        int nn) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        mma16816(acc[mt][2 * nn], a[mt], b[0], b[1]);
        mma16816(acc[mt][2 * nn + 1], a[mt], b[2], b[3]);
    }
}

// acc[16*MT x 8*NT] += A[16*MT x DPAD] * B[8*NT x DPAD]^T, with A rows at a_tile (row stride SROW,
// the warp's rows) and B rows at b_tile. This is S = Q K^T, dP = dO V^T, S^T = K Q^T, dP^T = V dO^T.
template <int MT, int NT>
__device__ __forceinline__ void gemm_abt_mt(float (&acc)[MT][NT][4], const elem_t* a_tile,
                                            const elem_t* b_tile) {
    const int lane = threadIdx.x % 32;
    const u32 a_base = smem_addr(a_tile + (lane % 16) * SROW + (lane / 16) * 8);
    const u32 b_base = smem_addr(b_tile + ((lane % 8) + (lane / 16) * 8) * SROW + ((lane / 8) % 2) * 8);
#pragma unroll
    for (int kk = 0; kk < DPAD / 16; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], a_base + (mt * 16 * SROW) * 2 + kk * 32);
#pragma unroll
        for (int nn = 0; nn < NT / 2; ++nn) {
            u32 b[4];
            ldmatrix_x4(b, b_base + (nn * 16 * SROW) * 2 + kk * 32);
            mma_b16(acc, a, b, nn);
        }
    }
}

// acc[16*MT x 8*NO] += P[16*MT x 16*KT] * B[16*KT x (cols col0 .. col0 + 8*NO)], where P is a register
// tile in accumulator layout (converted to 16-bit here) and B rows live at b_tile. This is O += P V,
// dQ += dS K, dV += P^T dO, dK += dS^T Q.
template <int MT, int KT, int NO>
__device__ __forceinline__ void gemm_pb_mt(float (&acc)[MT][NO][4], const float (&p)[MT][2 * KT][4],
                                           const elem_t* b_tile, int col0) {
    const int lane = threadIdx.x % 32;
    const u32 b_base =
        smem_addr(b_tile + ((lane % 8) + ((lane / 8) % 2) * 8) * SROW + col0 + (lane / 16) * 8);
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            a[mt][0] = pack2(p[mt][2 * kk][0], p[mt][2 * kk][1]);
            a[mt][1] = pack2(p[mt][2 * kk][2], p[mt][2 * kk][3]);
            a[mt][2] = pack2(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
            a[mt][3] = pack2(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dd = 0; dd < NO / 2; ++dd) {
            u32 b[4];
            ldmatrix_x4_trans(b, b_base + (kk * 16 * SROW + dd * 16) * 2);
            mma_b16(acc, a, b, dd);
        }
    }
}

// The single-tile forms (MT = 1) on a warp's 16 rows.
template <int NT>
__device__ __forceinline__ void gemm_abt(float (&acc)[NT][4], const elem_t* a_tile, const elem_t* b_tile) {
    gemm_abt_mt<1, NT>(reinterpret_cast<float (&)[1][NT][4]>(acc), a_tile, b_tile);
}
template <int KT, int NO>
__device__ __forceinline__ void gemm_pb(float (&acc)[NO][4], const float (&p)[2 * KT][4], const elem_t* b_tile,
                                        int col0) {
    gemm_pb_mt<1, KT, NO>(reinterpret_cast<float (&)[1][NO][4]>(acc),
                          reinterpret_cast<const float (&)[1][2 * KT][4]>(p), b_tile, col0);
}

// acc[MT][NT] += A[16*MT x K] * B[K x 8*NT] for K = 16*KT, with A stored TRANSPOSED in shared
// memory (at[k][m], row stride at_stride, first column m_off) and B row-major (b[k][n], row stride
// SROW, first column n_off). This is dQ += dS K with dS^T written by the dK/dV warps.
template <int MT, int NT, int KT>
__device__ __forceinline__ void gemm_atb(float (&acc)[MT][NT][4], const elem_t* at, int at_stride,
                                         int m_off, const elem_t* b_tile, int n_off) {
    const int lane = threadIdx.x % 32, mi = lane / 8;
    // Matrix mi of an A fragment: k rows 8*(mi/2).., m columns 8*(mi%2).. (loaded transposed).
    const u32 a_base = smem_addr(at + ((lane % 8) + (mi / 2) * 8) * at_stride + m_off + (mi % 2) * 8);
    const u32 b_base =
        smem_addr(b_tile + ((lane % 8) + ((lane / 8) % 2) * 8) * SROW + n_off + (lane / 16) * 8);
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4_trans(a[mt], a_base + (kk * 16 * at_stride + mt * 16) * 2);
#pragma unroll
        for (int nn = 0; nn < NT / 2; ++nn) {
            u32 b[4];
            ldmatrix_x4_trans(b, b_base + (kk * 16 * SROW + nn * 16) * 2);
            mma_b16(acc, a, b, nn);
        }
    }
}

#endif
