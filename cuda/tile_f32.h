// tile_f32.h — the fp32 (SIMT, exact f32 arithmetic) building blocks.
//
// A block is 16 x 16 threads (ty = threadIdx.x / 16, tx = threadIdx.x % 16). A tile of rows holds
// HEAD_DIM floats per row with row stride FSTRIDE = HEAD_DIM + 1 (odd, so 16 different rows read
// at one column hit 16 different banks). Thread (ty, tx) owns score rows ty + 16 i and score
// columns tx + 16 j; in products with a [*, HEAD_DIM] tile it owns columns tx + 16 jd.
#pragma once
#include "ptx.h"

#if FLASH_DTYPE != 2
#error "tile_f32.h is the fp32 path"
#endif
#if NUM_THREADS != 256
#error "the fp32 kernels run 16 x 16 threads"
#endif

#define FSTRIDE (HEAD_DIM + 1)
#define DCOLS ((HEAD_DIM + 15) / 16)  // columns of D per thread

// Copies rows [row0, row0 + R) of a [*, row_stride] tensor into dst (zeros past nrows).
template <int R>
__device__ __forceinline__ void load_tile_f32(float* dst, const float* src, int row0, int nrows,
                                              i64 row_stride) {
    constexpr int V4 = HEAD_DIM / 4;
    for (int i = threadIdx.x; i < R * V4; i += NUM_THREADS) {
        const int r = i / V4, c = (i % V4) * 4;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (row0 + r < nrows) x = *reinterpret_cast<const float4*>(src + (i64)(row0 + r) * row_stride + c);
        float* d = dst + r * FSTRIDE + c;
        d[0] = x.x; d[1] = x.y; d[2] = x.z; d[3] = x.w;
    }
}

// acc[i][j] += sum_d A[ty + 16 i][d] * B[tx + 16 j][d]
template <int MR, int MC>
__device__ __forceinline__ void mm_abt_f32(float (&acc)[MR][MC], const float* a, const float* b) {
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll 4
    for (int d = 0; d < HEAD_DIM; ++d) {
        float av[MR], bv[MC];
#pragma unroll
        for (int i = 0; i < MR; ++i) av[i] = a[(ty + 16 * i) * FSTRIDE + d];
#pragma unroll
        for (int j = 0; j < MC; ++j) bv[j] = b[(tx + 16 * j) * FSTRIDE + d];
#pragma unroll
        for (int i = 0; i < MR; ++i)
#pragma unroll
            for (int j = 0; j < MC; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
}

// acc[i][jd] += sum_c P[ty + 16 i][c] * B[c][tx + 16 jd], c < K; P has row stride pstride.
template <int MR, int K>
__device__ __forceinline__ void mm_pb_f32(float (&acc)[MR][DCOLS], const float* pm, int pstride,
                                          const float* b) {
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll 4
    for (int c = 0; c < K; ++c) {
        float pv[MR];
#pragma unroll
        for (int i = 0; i < MR; ++i) pv[i] = pm[(ty + 16 * i) * pstride + c];
#pragma unroll
        for (int jd = 0; jd < DCOLS; ++jd) {
            const int col = tx + 16 * jd;
            if (HEAD_DIM % 16 == 0 || col < HEAD_DIM) {
                const float bv = b[c * FSTRIDE + col];
#pragma unroll
                for (int i = 0; i < MR; ++i) acc[i][jd] = fmaf(pv[i], bv, acc[i][jd]);
            }
        }
    }
}

// Writes rows row0 + ty + 16 i (< nrows) of acc * mul[i] to a [*, row_stride] tensor.
template <int MR>
__device__ __forceinline__ void store_rows_f32(float* dst, const float (&acc)[MR][DCOLS],
                                               const float (&mul)[MR], int row0, int nrows,
                                               i64 row_stride) {
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll
    for (int i = 0; i < MR; ++i) {
        const int row = row0 + ty + 16 * i;
        if (row >= nrows) continue;
#pragma unroll
        for (int jd = 0; jd < DCOLS; ++jd) {
            const int col = tx + 16 * jd;
            if (col < HEAD_DIM) dst[(i64)row * row_stride + col] = acc[i][jd] * mul[i];
        }
    }
}

