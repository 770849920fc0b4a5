// kv_quant.h — the KV cache's 4- / 8-bit affine format on the GPU, bit for bit flash-core's
// quant.rs (and reference.py's quantize_kv): the params of its two kernels, quantize_kv.cu and
// dequantize_kv.cu.
//
//   x               [rows, D]             elem_t (rows = B * S * Hkv)
//   values          [rows, D * bits / 32] u32: codes from the lowest bits of each word up
//   scales, biases  [rows, D / group_size] elem_t
//
// flash_quantize_kv, one thread per (row, group): scale = store((max - min) / levels), bias =
// store(min), code = rint((x - bias) / scale) clipped to [0, levels] (0 when scale is not > 0),
// from the stored scale and bias read back. float32 with no fused multiply-add and IEEE division
// (__fsub_rn, __fdiv_rn): every implementation of the format gives the same bits.
// flash_dequantize_kv, one thread per 8 elements: x = store(scale * code + bias), the product and
// the sum each rounded (__fmul_rn, __fadd_rn), as quant.rs.
#pragma once
#include "types.h"

#ifndef NUM_WARPS
#error "NUM_WARPS must be defined"
#endif
#define NUM_THREADS (NUM_WARPS * 32)

// Mirrored field for field by native/flash-core/src/cuda/kv.rs (#[repr(C)]).
struct QuantParams {
    elem_t* x;         // [rows, D]: quantize's input, dequantize's output
    u32* values;       // [rows, D * bits / 32]
    elem_t* scales;    // [rows, D / group_size]
    elem_t* biases;    // [rows, D / group_size]
    i64 rows;
    int head_dim;      // D, a multiple of group_size
    int group_size;    // 32 or 64
    int bits;          // 4 or 8
    int _pad;          // keeps sizeof a multiple of 8
};
static_assert(sizeof(QuantParams) == 4 * 8 + 8 + 4 * 4, "kv.rs mirrors this layout");

