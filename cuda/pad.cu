// pad.cu — the head-dim padding layer's copies (every dtype; host side: flash-core's cuda/pad.rs).
//
// The tiled kernels take one head dim for q, k and v, a multiple of 8. A call with another D, or
// with v's own Dv, runs them on zero-filled copies of head dim HEAD_DIM = roundup8(max(D, Dv)):
//
//   to_wide = 1:  dst [rows, HEAD_DIM] = src [rows, cols], then HEAD_DIM - cols zero columns
//   to_wide = 0:  dst [rows, cols]     = the first cols columns of src [rows, HEAD_DIM]
//
// rows = B * S * heads of the tensor, cols its own head dim (D or Dv, 1..HEAD_DIM). One warp per
// row, its lanes over the columns (no division per element); grid-stride over the rows.
#include "params.h"

FLASH_EXPORT_SMEM(0)  // no shared memory

// The params of this kernel alone (the host mirrors them in pad.rs).
struct PadParams {
    const elem_t* src;  // [rows, cols] (to_wide: rows r = (call row, head) laid out as src_st) or [rows, HEAD_DIM]
    elem_t* dst;        // [rows, HEAD_DIM] (to_wide) or [rows, cols]
    i64 rows;
    int cols;
    int to_wide;
    Strides src_st;     // to_wide: where the source's rows lie (params.h)
    i64 heads;          // rows per call row
    i64 batch_rows;     // call rows per batch row (for src_st's batch_gap)
};

// floor(x / y) for 0 <= x < 2^50, 0 < y: x times the double reciprocal of y, then corrected (that
// estimate is off by at most one). 64-bit integer and double divisions are subroutines whose call
// frames ptxas counts as spills.
__device__ __forceinline__ i64 div_i64(i64 x, i64 y) {
    i64 q = (i64)((double)x * __drcp_rn((double)y));
    while (q > 0 && q * y > x) --q;
    while ((q + 1) * y <= x) ++q;
    return q;
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS)
flash_pad(const PadParams p) {
    const int lane = threadIdx.x % 32;
    const i64 warps = (i64)gridDim.x * NUM_WARPS;
    for (i64 r = (i64)blockIdx.x * NUM_WARPS + threadIdx.x / 32; r < p.rows; r += warps) {
        if (p.to_wide) {
            const i64 row = div_i64(r, p.heads);
            const elem_t* src = p.src + row_at(p.src_st, (int)div_i64(row, p.batch_rows), row, (int)(r - row * p.heads));
            elem_t* dst = p.dst + r * HEAD_DIM;
            for (int c = lane; c < HEAD_DIM; c += 32) dst[c] = c < p.cols ? src[c] : (elem_t)0;
        } else {
            const elem_t* src = p.src + r * HEAD_DIM;
            elem_t* dst = p.dst + r * p.cols;
            for (int c = lane; c < p.cols; c += 32) dst[c] = src[c];
        }
    }
}
