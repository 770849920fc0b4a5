// bwd_preprocess.cu — per-row statistics for the backward pass (every dtype).
//
//   delta[b, h, i]    = sum_d dO[b, i, h, d] * O[b, i, h, d] - dlse[b, h, i]   (f32; dlse optional:
//                       the gradient of lse, taken only on rows that see a key)
//   lse_log2[b, h, i] = lse * log2(e), or +inf for a row that sees no key (lse = -inf), so that
//                       exp2(s * scale_log2 - lse_log2) is 0 there instead of NaN.
// BLOCK_M rows per block, BLOCK_M / NUM_WARPS consecutive (b, i, h) rows per warp, each row's dot
// product over the warp's lanes: the warp's loads of all its rows go out together (one row a warp
// left too few bytes in flight to stream O and dO at the memory's rate). Grid ceil(B * Sq * H / BLOCK_M).
#include "ptx.h"

FLASH_EXPORT_SMEM(0)  // no shared memory

#define ROWS_PER_WARP (BLOCK_M / NUM_WARPS)
#if BLOCK_M % NUM_WARPS != 0 || ROWS_PER_WARP < 1 || ROWS_PER_WARP > 32
#error "bwd_preprocess: BLOCK_M a multiple of NUM_WARPS, 1 to 32 rows a warp (a lane writes each row's stats)"
#endif

extern "C" __global__ void __launch_bounds__(NUM_THREADS)
flash_bwd_preprocess(const FlashParams p) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 first = ((i64)blockIdx.x * NUM_WARPS + warp) * ROWS_PER_WARP;  // index into [B, Sq, H]
    const i64 rows = (i64)p.batch * p.seqlen_q * p.heads;
    if (first >= rows) return;
    // The rows' addresses first, then all loads: the index arithmetic's branches (64-bit division)
    // would otherwise sit between one row's loads and the next's. A row past the end reads the last
    // row again and writes nothing.
    const elem_t* o[ROWS_PER_WARP];
    const elem_t* dout[ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const i64 row = min(first + r, rows - 1);
        const int h = (int)(row % p.heads);
        const i64 bs = row / p.heads;  // the call's row: b * Sq + i
        const int b = (int)(bs / p.seqlen_q);
        o[r] = p.o + row_at(p.o_st, b, bs, h);
        dout[r] = p.dout + row_at(p.do_st, b, bs, h);
    }
    float acc[ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        acc[r] = 0.f;
#pragma unroll
        for (int d = lane; d < HEAD_DIM; d += 32) acc[r] += to_float(o[r][d]) * to_float(dout[r][d]);
    }
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
#pragma unroll
        for (int off = 16; off > 0; off /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
    }
    if (lane < ROWS_PER_WARP && first + lane < rows) {
        float a = acc[0];
#pragma unroll
        for (int r = 1; r < ROWS_PER_WARP; ++r) a = lane == r ? acc[r] : a;
        const i64 row = first + lane;
        const int h = (int)(row % p.heads);
        const i64 bs = row / p.heads;
        const int i = (int)(bs % p.seqlen_q), b = (int)(bs / p.seqlen_q);
        const i64 idx = stat_offset(p, b, h) + i;
        const float l = p.lse[idx];
        p.delta[idx] = (p.dlse != nullptr && l != NEG_INF) ? a - p.dlse[idx] : a;
        p.lse_log2[idx] = (l == NEG_INF) ? POS_INF : l * LOG2E;
    }
}
