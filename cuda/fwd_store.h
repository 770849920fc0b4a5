// fwd_store.h — the forward's epilogue for one warp's 16 query rows held in the mma accumulator
// layout (lane (g, t): rows g and g + 8), shared by fwd.cu, fwd_sm90.cu and fwd_sm90_f32.cu:
// o = acc / l into p.o, and the rows' logsumexp (natural log; -inf for a row that saw no key) from
// the lanes t = 0.
#pragma once
#include "tile.h"
#include "block.h"
#include "softmax.h"

// acc: the rows' unnormalised o, NO 8-column blocks; sm: their softmax state; row0: the first row.
template <int NO>
__device__ __forceinline__ void store_rows(const FlashParams& p, const QueryBlock& blk, const float (&acc)[NO][4],
                                           OnlineSoftmax& sm, int row0) {
    float inv[2], lse[2];
    sm.finish(inv, lse);
    store_tile<NO>(p.o + blk.q_at(p.o_st), acc, inv[0], inv[1], row0, blk.Sq, 0, p.o_st.seq);
    const int lane = threadIdx.x % 32;
    if (lane % 4 == 0) {
        float* out_lse = p.lse + blk.stat_base(p);
        const int g = lane / 4;
        if (row0 + g < blk.Sq) out_lse[row0 + g] = lse[0];
        if (row0 + g + 8 < blk.Sq) out_lse[row0 + g + 8] = lse[1];
    }
}
