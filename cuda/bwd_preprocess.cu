// bwd_preprocess.cu — per-row statistics for the backward pass (every dtype).
//
//   delta[b, h, i]    = sum_d dO[b, i, h, d] * O[b, i, h, d] - dlse[b, h, i]   (f32; dlse optional:
//                       the gradient of lse, taken only on rows that see a key)
//   lse_log2[b, h, i] = lse * log2(e), or +inf for a row that sees no key (lse = -inf), so that
//                       exp2(s * scale_log2 - lse_log2) is 0 there instead of NaN.
// One warp per (b, i, h) row; NUM_WARPS rows per block, grid ceil(B * Sq * H / NUM_WARPS).
#include "ptx.h"

FLASH_EXPORT_SMEM(0)  // no shared memory

extern "C" __global__ void __launch_bounds__(NUM_THREADS)
flash_bwd_preprocess(const FlashParams p) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 row = (i64)blockIdx.x * NUM_WARPS + warp;  // index into [B, Sq, H]
    const i64 rows = (i64)p.batch * p.seqlen_q * p.heads;
    if (row >= rows) return;
    const int h = (int)(row % p.heads);
    const i64 bs = row / p.heads;  // the call's row: b * Sq + i
    const int i = (int)(bs % p.seqlen_q), b = (int)(bs / p.seqlen_q);
    const elem_t* o = p.o + row_at(p.o_st, b, bs, h);
    const elem_t* dout = p.dout + row_at(p.do_st, b, bs, h);
    float acc = 0.f;
    for (int d = lane; d < HEAD_DIM; d += 32) acc += to_float(o[d]) * to_float(dout[d]);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) {
        const i64 idx = stat_offset(p, b, h) + i;
        const float l = p.lse[idx];
        p.delta[idx] = (p.dlse != nullptr && l != NEG_INF) ? acc - p.dlse[idx] : acc;
        p.lse_log2[idx] = (l == NEG_INF) ? POS_INF : l * LOG2E;
    }
}
