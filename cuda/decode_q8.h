// decode_q8.h — decode.cu's block step for 8-bit caches: the codes go into fp16 mmas as they are and
// the scales and biases enter per group afterwards (decode_q4.h's plan), so that no element is
// dequantized. fp16 for both query dtypes: 2^10 + c holds every 8-bit code exactly, and one PRMT
// builds two of them (bf16's 8 significant bits hold no 2^k + c for 8-bit c). decode.cu includes
// it after its helpers (transpose8x8, column_max / column_sum, scale_value, group_scores) and runs
// this path at CACHE_BITS 8 with the groups' sizes GK (K) and GV (V) as template arguments.
//
// With x = s c + b per group G of the head dim and M = 2^10:
//   K:  S^T[key, st] = 2^-k(st) sum_G  s[key,G] A_G[key, st] + (b[key,G] - M s[key,G]) qs_G[st],
//       A_G = sum_{d in G} (M + c[key,d]) q'[st,d] (an mma over G's dims, f32 accumulators, fresh
//       per block), q' = q 2^k(st) in fp16, 2^k putting the row's largest |q| in [2^14, 2^15):
//       exact for bf16's 8 bits and fp16's 11 (only elements below 2^-28 of the row's largest may
//       lose bits as subnormals); qs_G = sum_{d in G} q'[st,d] (f32, once per call).
//   V:  O^T[d, st] f(st) = sum_k (M + c[k,d]) P'_G[k,st] - (M + 128) sum_k P'_G[k,st]
//                          + f(st) sum_k (b + 128 s)[k,G] P[k,st],
//       P'_G = P s[.,G] f(st) rounded once to fp16, f keeping it in fp16's range (decode_weights.h).
//       As in decode_q4.h each m-block's mma takes the first term and the second comes off at the
//       end from the groups' sums of P'_G (V_SUMS; else a second mma per m-block whose A is
//       -(M + 128)), so that P'_G's rounding multiplies s (c - 128), centred. The third term is
//       summed in f32 from the unrounded P per lane (without f), and over the lanes at the end.
//
// Layouts (g = lane / 4, t = lane % 4; a 16-key block's K rows at stride Q8::SROW_K, V rows at
// Q8::SROW_V, both an odd number of 16-byte units apart):
//   K: one ldmatrix.x4 gives lane (g, t) word t of 16-byte chunks c, c + 1 of rows g and g + 8.
//      Chunk c (dims 16c .. 16c + 15, in one group) is one k step: word t's codes (c0 .. c3) pair
//      as (c0, c1) -> k (2t, 2t + 1), (c2, c3) -> (2t + 8, 2t + 9); Q's B fragment takes the same
//      dims: 16c + 4t + {0, 1} and {2, 3}.
//   V: one ldmatrix.x4.trans gives lane (g, t) the 16-bit column g (dims 16c + 2g, + 1) of 16-byte
//      chunks c, c + 1 of keys 2t and 2t + 1 (low and high half) and of keys 2t + 8, 2t + 9; one
//      PRMT puts a dim's two keys under M. Chunk c is m-block c (dims 16c + 2g, + 1: rows g, g + 8),
//      in group 16c / GV.
#pragma once

#define Q8_M 1024.f
#define Q8_MAGIC 0x64646464u     // fp16 2^10 = 0x6400: its high byte in every byte
#define Q8_ONES 0x3c003c00u      // fp16 1 in both lanes
#define Q8_NEG_M128 0xe480e480u  // fp16 -(2^10 + 128) = -1152 in both lanes
// What the V weights' sums take off the codes' products: -(M + 128) (the codes enter centred).
#define Q8_MAGIC_SUMS (-(Q8_M + 128.f))

struct Q8 {
    enum : int {
        CHUNKS = HEAD_DIM / 16,  // K: 16-byte chunks of a row, one k step each
        SROW_K = Geom<8>::SROW_K,
        SROW_V = Geom<8>::SROW_V,
    };
};

// The two codes of bytes (lo, hi) of w under M: selector 0x5140 for bytes 0, 1; 0x5342 for 2, 3.
__device__ __forceinline__ u32 q8_magic(u32 w, u32 sel) { return __byte_perm(w, Q8_MAGIC, sel); }

// Q^T's B fragments in fp16: qa[2c + h] = dims 16c + 4t + 2h, + 1 of state g times 2^k(g) (zero past
// the last state); qs[G][j]: the sum of group G of scaled state 2t + j; qinv[j]: its 2^-k.
template <int GK>
__device__ __forceinline__ void q8_load_q(u32 (&qa)[HEAD_DIM / 8], float (&qs)[HEAD_DIM / GK][2], float (&qinv)[2],
                                          const DecodeParams& p, const DecodeWork& w) {
    constexpr int CPG = GK / 16;  // chunks per group
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int s = w.state0 + g;
    const bool ok = s < p.states;
    const int i = w.row_of(p, s), h = w.kvh * p.group + (ok ? s % p.group : 0);
    const u16* q = reinterpret_cast<const u16*>(p.q) + (((i64)w.b * p.seq_q + i) * p.heads + h) * HEAD_DIM;
    float x[Q8::CHUNKS][4];
    float mx = 0.f;
#pragma unroll
    for (int c = 0; c < Q8::CHUNKS; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            x[c][e] = ok ? to_float(q[16 * c + 4 * t + e]) : 0.f;
            mx = fmaxf(mx, fabsf(x[c][e]));
        }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));  // state g's largest |q|
    // k = 14 - the exponent of mx, within f32's normal range; 0 for a zero or non-finite row.
    const int ex = (int)(__float_as_uint(mx) >> 23);  // mx >= 0: the biased exponent
    const int k = mx == 0.f || ex == 255 ? 0 : min(max(141 - ex, -126), 126);
    const float scale = __uint_as_float((u32)(127 + k) << 23), inv = __uint_as_float((u32)(127 - k) << 23);
    float part[HEAD_DIM / GK];
#pragma unroll
    for (int G = 0; G < HEAD_DIM / GK; ++G) part[G] = 0.f;
#pragma unroll
    for (int c = 0; c < Q8::CHUNKS; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float lo = x[c][2 * h] * scale, hi = x[c][2 * h + 1] * scale;
            qa[2 * c + h] = pack2_f16(lo, hi);
            part[c / CPG] += lo + hi;
        }
#pragma unroll
    for (int G = 0; G < HEAD_DIM / GK; ++G) {
        float sum = part[G];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);  // state g's sum, in every lane of g
        qs[G][0] = __shfl_sync(0xffffffffu, sum, 8 * t);
        qs[G][1] = __shfl_sync(0xffffffffu, sum, 8 * t + 4);
    }
    qinv[0] = __shfl_sync(0xffffffffu, inv, 8 * t);
    qinv[1] = __shfl_sync(0xffffffffu, inv, 8 * t + 4);
}

// x = S^T of a 16-key block whose K rows start at shared address `rows`: rows g, g + 8 (keys),
// columns states 2t, 2t + 1. sc / bi (sc8 / bi8): the scale rows of key g (g + 8), at ScaleOffset
// half (half8).
template <int GK>
__device__ __forceinline__ void q8_qk(float (&x)[4], const u32 (&qa)[HEAD_DIM / 8], const float (&qs)[HEAD_DIM / GK][2],
                                      const float (&qinv)[2], u32 rows, const unsigned char* sc, const unsigned char* bi,
                                      const unsigned char* sc8, const unsigned char* bi8, int half, int half8) {
    constexpr int NG = HEAD_DIM / GK, CPG = GK / 16;
    // ldmatrix.x4: lanes 8j .. 8j + 7 address matrix j = rows 8 (j % 2) .. + 7 of chunk c + j / 2.
    const u32 row = lane_row(rows, Q8::SROW_K);
    float acc[NG][4];
#pragma unroll
    for (int G = 0; G < NG; ++G) acc[G][0] = acc[G][1] = acc[G][2] = acc[G][3] = 0.f;
#pragma unroll
    for (int c = 0; c < Q8::CHUNKS; c += 2) {
        u32 r[4];  // rows g, g + 8 of chunk c; rows g, g + 8 of chunk c + 1
        ldmatrix_x4(r, lane_unit(row, c));
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int ch = c + e;
            const u32 a[4] = {q8_magic(r[2 * e], 0x5140), q8_magic(r[2 * e + 1], 0x5140), q8_magic(r[2 * e], 0x5342),
                              q8_magic(r[2 * e + 1], 0x5342)};
            mma16816_f16(acc[ch / CPG], a, qa[2 * ch], qa[2 * ch + 1]);
        }
    }
    float y[4];
#pragma unroll
    for (int G = 0; G < NG; ++G) {
        const float s = scale_value<NG>(sc, half, G), s8 = scale_value<NG>(sc8, half8, G);
        const float b = fmaf(-Q8_M, s, scale_value<NG>(bi, half, G));
        const float b8 = fmaf(-Q8_M, s8, scale_value<NG>(bi8, half8, G));
        group_scores(y, acc[G], s, s8, b, b8, qs[G], G == 0);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = y[e] * qinv[e & 1];
}

// o += V^T P'^T for a 16-key block whose V rows start at shared address `rows` (stride Q8::SROW_V),
// and cv[G] += the block's bias sums of group G (b + 128 s: the codes' share is centred). x: P of keys
// g, g + 8 (rows) and states 2t, 2t + 1 in S^T's layout, f32; sc / bi (sc8 / bi8): the v scale and
// bias rows of key g (g + 8) at ScaleOffset half (half8). P'_G = P s f goes into B fragments as
// p_fragment transposes P.
template <int GV>
__device__ __forceinline__ void q8_pv(float (&o)[HEAD_DIM / 16 + V_SUMS(GV)][4], float (&cv)[HEAD_DIM / GV][2], const float (&x)[4],
                                      const WeightRange& w, u32 rows, const unsigned char* sc, const unsigned char* bi,
                                      const unsigned char* sc8, const unsigned char* bi8, int half, int half8) {
    constexpr int NG = HEAD_DIM / GV, CPG = GV / 16;  // chunks (m-blocks) per group
    const u32 row = lane_row(rows, Q8::SROW_V);  // v_columns' row
    const u32 ones[4] = {Q8_ONES, Q8_ONES, Q8_ONES, Q8_ONES};
    const u32 neg_m128[4] = {Q8_NEG_M128, Q8_NEG_M128, Q8_NEG_M128, Q8_NEG_M128};
    const float xf[4] = {x[0] * w.f[0], x[1] * w.f[1], x[2] * w.f[0], x[3] * w.f[1]};
#pragma unroll
    for (int G = 0; G < NG; ++G) {
        const float s = scale_value<NG>(sc, half, G), s8 = scale_value<NG>(sc8, half8, G);
        const float b = fmaf(128.f, s, scale_value<NG>(bi, half, G));
        const float b8 = fmaf(128.f, s8, scale_value<NG>(bi8, half8, G));
        cv[G][0] = fmaf(b, x[0], fmaf(b8, x[2], cv[G][0]));
        cv[G][1] = fmaf(b, x[1], fmaf(b8, x[3], cv[G][1]));
        const u32 bq0 = transpose8x8(pack2_f16(xf[0] * s, xf[1] * s)), bq1 = transpose8x8(pack2_f16(xf[2] * s8, xf[3] * s8));
        if constexpr (V_SUMS(GV) > 0) mma16816_f16(o[HEAD_DIM / 16 + (V_SUMS(GV) ? G : 0)], ones, bq0, bq1);  // P' sums, every row alike
        u32 xv[CPG][2];  // the group's chunks only
        v_columns<CPG>(xv, row, G * CPG);
#pragma unroll
        for (int j = 0; j < CPG; ++j) {
            // Bytes 0, 2 of a column pair: dim 16c + 2g of both keys; bytes 1, 3: dim + 1.
            const u32 a[4] = {q8_magic(xv[j][0], 0x4240), q8_magic(xv[j][0], 0x4341), q8_magic(xv[j][1], 0x4240),
                              q8_magic(xv[j][1], 0x4341)};
            mma16816_f16(o[G * CPG + j], a, bq0, bq1);
            if constexpr (V_SUMS(GV) == 0) mma16816_f16(o[G * CPG + j], neg_m128, bq0, bq1);
        }
    }
}

// The group of m-block mb, and the dim of its row g (row g + 8: the next one).
template <int GV>
__device__ __forceinline__ int q8_group(int mb) { return 16 * mb / GV; }
__device__ __forceinline__ int q8_dim_of(int mb, int g) { return 16 * mb + 2 * g; }
