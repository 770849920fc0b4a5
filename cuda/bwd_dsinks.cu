// bwd_dsinks.cu — the attention sinks' gradient (every dtype; MASKED params, which carry the sinks):
//
//   dsinks[h] = -sum over batch rows b and query rows i of exp2(sinks_log2[h] - lse_log2[b, h, i]) * delta[b, h, i]
//
// (d lse / d sink = exp(sink - lse), and o's rows shrink by it: modifiers.rs). One block per head,
// each thread a fixed stride of rows, then a fixed-order reduction: bit-identical run to run. Walks
// lse_log2 and delta as [B, H, Sq] (a varlen call's [H, total_q] is B = 1, Sq = total_q).
#include "ptx.h"

#if !MASKED
#error "bwd_dsinks reads the MASKED params' sinks"
#endif

FLASH_EXPORT_SMEM(0)  // its reduction buffer is static

extern "C" __global__ void __launch_bounds__(NUM_THREADS)
flash_bwd_dsinks(const FlashParams p) {
    __shared__ float warp_sums[NUM_WARPS];
    const int h = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float sink2 = p.sinks_log2[h];
    const i64 rows = (i64)p.batch * p.seqlen_q;
    float acc = 0.f;
    for (i64 r = threadIdx.x; r < rows; r += NUM_THREADS) {
        const i64 idx = stat_offset(p, (int)(r / p.seqlen_q), h) + r % p.seqlen_q;
        const float l2 = p.lse_log2[idx];  // +inf: a row of a forward without sinks; it adds nothing
        if (l2 != POS_INF) acc -= exp2f(sink2 - l2) * p.delta[idx];
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < NUM_WARPS; ++w) total += warp_sums[w];
        p.dsinks[h] = total;
    }
}
