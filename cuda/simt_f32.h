// simt_f32.h — building blocks of the fast fp32 (SIMT, exact f32 FMA) kernels for HEAD_DIM in {64, 128}.
//
// A block is 16 x 16 threads: ty = threadIdx.x / 16 (a half-warp), tx = threadIdx.x % 16. Operand
// tiles live in shared memory row-major with D contiguous, so that every read is a 16-byte LDS.128
// along the reduction dimension or along D:
//   * products reducing over D (S = Q K^T): thread (ty, tx) owns rows ty + 16 i of the first operand
//     (one address per half-warp: a broadcast) and rows tx + 16 j of the second; that one is stored
//     with row stride HEAD_DIM + 4 (an odd number of float4s), so 8 consecutive rows of one quarter-
//     warp hit 8 different 16-byte bank groups;
//   * products reducing over rows (O += P V): thread (ty, tx) owns rows ty + 16 i of the result and
//     the float4 column groups tx + 16 jj of D; P is read as float4 along its row (broadcast), V as
//     float4 along D (consecutive for consecutive tx: conflict-free).
// Tiles are filled with cp.async (16 bytes per copy; rows past the end are zero-filled).
#pragma once
#include "ptx.h"

#if FLASH_DTYPE != 2
#error "simt_f32.h is the fp32 path"
#endif
#if NUM_THREADS != 256
#error "the fp32 kernels run 16 x 16 threads"
#endif
#if HEAD_DIM % 64 != 0 || HEAD_DIM > 128
#error "the SIMT fp32 kernels take HEAD_DIM 64 or 128"
#endif

#ifndef SIMT_UNROLL_D
#define SIMT_UNROLL_D 4  // unroll of the D loop (4 columns each) of mm_rows_f32
#endif
#ifndef SIMT_UNROLL_R
#define SIMT_UNROLL_R 2  // unroll of the row loop (4 rows each) of mm_pv_f32
#endif

#define DV4 (HEAD_DIM / 64)      // float4 column groups of D per thread
#define RSTRIDE (HEAD_DIM + 4)   // row stride of a tile read by rows tx + 16 j

__device__ __forceinline__ float4 lds4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float f4get(const float4& v, int u) {
    return u == 0 ? v.x : u == 1 ? v.y : u == 2 ? v.z : v.w;
}
__device__ __forceinline__ void fma4(float4& acc, float a, const float4& b) {
    acc.x = fmaf(a, b.x, acc.x);
    acc.y = fmaf(a, b.y, acc.y);
    acc.z = fmaf(a, b.z, acc.z);
    acc.w = fmaf(a, b.w, acc.w);
}
__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    return fmaf(a.w, b.w, acc);
}

// Async copy of rows [row0, row0 + R) of a [*, row_stride] tensor into dst (row stride DS floats);
// rows at or past nrows are zero-filled. Commit separately.
template <int R, int DS>
__device__ __forceinline__ void cp_rows_f32(float* dst, const float* src, int row0, int nrows, i64 row_stride) {
    constexpr int V4 = HEAD_DIM / 4;
    constexpr int TOTAL = R * V4;
#pragma unroll
    for (int it = 0; it < (TOTAL + NUM_THREADS - 1) / NUM_THREADS; ++it) {
        const int i = threadIdx.x + it * NUM_THREADS;
        if (TOTAL % NUM_THREADS == 0 || i < TOTAL) {
            const int r = i / V4, c = (i % V4) * 4;
            const bool ok = row0 + r < nrows;
            cp_async16(dst + r * DS + c, src + (i64)(ok ? row0 + r : 0) * row_stride + c, ok);
        }
    }
}

// acc[i][j] += sum_d A[ty + 16 i][d] * B[tx + 16 j][d]   (A row stride AS, B row stride RSTRIDE)
template <int MR, int MC, int AS>
__device__ __forceinline__ void mm_rows_f32(float (&acc)[MR][MC], const float* a, const float* b) {
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    a += ty * AS;
    b += tx * RSTRIDE;
#pragma unroll SIMT_UNROLL_D
    for (int d = 0; d < HEAD_DIM; d += 4) {
        float4 av[MR], bv[MC];
#pragma unroll
        for (int i = 0; i < MR; ++i) av[i] = lds4(a + 16 * i * AS + d);
#pragma unroll
        for (int j = 0; j < MC; ++j) bv[j] = lds4(b + 16 * j * RSTRIDE + d);
#pragma unroll
        for (int i = 0; i < MR; ++i)
#pragma unroll
            for (int j = 0; j < MC; ++j) acc[i][j] = dot4(av[i], bv[j], acc[i][j]);
    }
}

// acc[i][jj] += sum_{c < K} P[ty + 16 i][c] * B[c][4 (tx + 16 jj) .. +3]   (P row stride PSt, B row stride BS)
template <int MR, int K, int PSt, int BS>
__device__ __forceinline__ void mm_pv_f32(float4 (&acc)[MR][DV4], const float* pm, const float* b) {
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    pm += ty * PSt;
    b += tx * 4;
#pragma unroll SIMT_UNROLL_R
    for (int c = 0; c < K; c += 4) {
        float4 pv[MR];
#pragma unroll
        for (int i = 0; i < MR; ++i) pv[i] = lds4(pm + 16 * i * PSt + c);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            float4 bv[DV4];
#pragma unroll
            for (int jj = 0; jj < DV4; ++jj) bv[jj] = lds4(b + (c + u) * BS + 64 * jj);
#pragma unroll
            for (int i = 0; i < MR; ++i)
#pragma unroll
                for (int jj = 0; jj < DV4; ++jj) fma4(acc[i][jj], f4get(pv[i], u), bv[jj]);
        }
    }
}

// Writes rows row0 + ty + 16 i (< nrows) of acc * mul[i] to a [*, row_stride] tensor, float4 stores.
template <int MR>
__device__ __forceinline__ void store_rows4_f32(float* dst, const float4 (&acc)[MR][DV4], const float (&mul)[MR],
                                                int row0, int nrows, i64 row_stride) {
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll
    for (int i = 0; i < MR; ++i) {
        const int row = row0 + ty + 16 * i;
        if (row >= nrows) continue;
#pragma unroll
        for (int jj = 0; jj < DV4; ++jj) {
            float4 x = acc[i][jj];
            x.x *= mul[i]; x.y *= mul[i]; x.z *= mul[i]; x.w *= mul[i];
            *reinterpret_cast<float4*>(dst + (i64)row * row_stride + 4 * (tx + 16 * jj)) = x;
        }
    }
}


// dst[0..3] += v with one fire-and-forget reduction (.v4 on sm_90, four scalar ones before).
__device__ __forceinline__ void red_add4(float* dst, const float4& v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1,%2,%3,%4};" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst), "f"(v.x) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst + 1), "f"(v.y) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst + 2), "f"(v.z) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst + 3), "f"(v.w) : "memory");
#endif
}
