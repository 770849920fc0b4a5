// quantize_kv.cu — x -> codes, scales, biases (the format and the params: kv_quant.h).
#include "kv_quant.h"

FLASH_EXPORT_SMEM(0)  // no shared memory

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) flash_quantize_kv(const QuantParams p) {
    const int groups = p.head_dim / p.group_size, per_word = 32 / p.bits;
    const float levels = (float)((1 << p.bits) - 1);
    const i64 n = p.rows * groups;
    for (i64 at = (i64)blockIdx.x * NUM_THREADS + threadIdx.x; at < n; at += (i64)gridDim.x * NUM_THREADS) {
        const i64 row = at / groups;
        const int g = (int)(at % groups);
        const elem_t* x = p.x + row * p.head_dim + g * p.group_size;
        float lo = __int_as_float(0x7f800000), hi = __int_as_float(0xff800000);
        for (int e = 0; e < p.group_size; ++e) {
            const float v = to_float(x[e]);
            lo = fminf(lo, v);
            hi = fmaxf(hi, v);
        }
        const elem_t scale_s = from_float(__fdiv_rn(__fsub_rn(hi, lo), levels)), bias_s = from_float(lo);
        p.scales[at] = scale_s;
        p.biases[at] = bias_s;
        const float scale = to_float(scale_s), bias = to_float(bias_s);
        u32* words = p.values + row * (p.head_dim / per_word) + g * (p.group_size / per_word);
        for (int w = 0; w < p.group_size / per_word; ++w) {
            u32 word = 0;
            for (int k = 0; k < per_word; ++k) {
                const float v = to_float(x[w * per_word + k]);
                // fmaxf first: a NaN quotient becomes 0, as Rust's saturating cast makes it.
                const float c = scale > 0.f ? fminf(fmaxf(rintf(__fdiv_rn(__fsub_rn(v, bias), scale)), 0.f), levels) : 0.f;
                word |= (u32)c << (k * p.bits);
            }
            words[w] = word;
        }
    }
}
