// dequantize_kv.cu — codes, scales, biases -> x (the format and the params: kv_quant.h).
#include "kv_quant.h"

FLASH_EXPORT_SMEM(0)  // no shared memory

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) flash_dequantize_kv(const QuantParams p) {
    const int per_row = p.head_dim / 8, groups = p.head_dim / p.group_size;
    const i64 n = p.rows * per_row;
    for (i64 at = (i64)blockIdx.x * NUM_THREADS + threadIdx.x; at < n; at += (i64)gridDim.x * NUM_THREADS) {
        const i64 row = at / per_row;
        const int d0 = (int)(at % per_row) * 8;
        const i64 grp = row * groups + d0 / p.group_size;
        const float scale = to_float(p.scales[grp]), bias = to_float(p.biases[grp]);
        // Elements d0 .. d0 + 7: one word of 4-bit codes, two of 8-bit.
        const u32* words = p.values + row * (p.head_dim * p.bits / 32) + d0 * p.bits / 32;
        elem_t* out = p.x + row * p.head_dim + d0;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int bit = e * p.bits;
            const u32 code = (words[bit / 32] >> (bit % 32)) & ((1u << p.bits) - 1);
            out[e] = from_float(__fadd_rn(__fmul_rn(scale, (float)code), bias));
        }
    }
}
