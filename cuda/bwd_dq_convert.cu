// bwd_dq_convert.cu — the last step of the atomic-dQ backward (every dtype):
//
//   dq[b, i, h, d] = dq_accum[b, i, h, d] * scale, rounded to the storage dtype
//
// dq_accum [B, Sq, H, D] f32 holds sum_j dS_ij K_j, added by bwd_dkdv with atomics (or by
// bwd_sm90 in params.h's tiles, p.dq_tiled). Each thread converts pairs of elements (HEAD_DIM is
// even; a pair never straddles a swizzled 16-byte chunk); grid-stride over the B * Sq * H * D / 2
// pairs, in dq's order.
#include "ptx.h"

FLASH_EXPORT_SMEM(0)  // no shared memory

extern "C" __global__ void __launch_bounds__(NUM_THREADS)
flash_bwd_dq_convert(const FlashParams p) {
    const i64 pairs = (i64)p.batch * p.seqlen_q * p.heads * (HEAD_DIM / 2);
    const float2* acc = reinterpret_cast<const float2*>(p.dq_accum);
    for (i64 i = (i64)blockIdx.x * NUM_THREADS + threadIdx.x; i < pairs; i += (i64)gridDim.x * NUM_THREADS) {
        float2 x;
        if (p.dq_tiled) {
            const int row = (int)(i / (HEAD_DIM / 2)), col = 2 * (int)(i % (HEAD_DIM / 2));  // row of [B, Sq, H]
            const int h = row % p.heads, bi = row / p.heads;
            x = *reinterpret_cast<const float2*>(p.dq_accum + dq_tile_offset(p, bi / p.seqlen_q, h, bi % p.seqlen_q, col, HEAD_DIM));
        } else {
            x = acc[i];
        }
#if FLASH_DTYPE == 2
        reinterpret_cast<float2*>(p.dq)[i] = make_float2(x.x * p.scale, x.y * p.scale);
#else
        reinterpret_cast<u32*>(p.dq)[i] = pack2(x.x * p.scale, x.y * p.scale);
#endif
    }
}
