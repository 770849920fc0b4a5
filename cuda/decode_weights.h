// decode_weights.h — keeping P * scale inside fp16's range, for the quantized decode steps whose V
// products take B = P' = P s f in fp16 (decode_q8.h always; decode_q4.h with fp16 queries). P
// alone is in [0, 1], but s is the cache's: scales below ~1e-4 would make P' subnormal in fp16 (a
// weight of 1 rounded to a few bits), above 65504 infinite. So each state (column of O^T) keeps a
// factor f and R, the running max of P' (decaying with the softmax's rescales): when R leaves
// [1/64, 64], f and the state's accumulators take a power of two (exact) that brings R into
// [1, 2). The largest P' seen is then never below 2^-6 nor above 2^6, the weights that matter keep
// fp16's 11 bits, and what underflows is below 2^-20 of the largest. The output divides by f.
// decode.cu includes it after its helpers (column_max, rescale, rescale_pairs, scale_value).
#pragma once

#define WEIGHT_RANGE_HI 64.f
#define WEIGHT_RANGE_LO (1.f / 64.f)

// States 2t, 2t + 1 of this lane's columns.
struct WeightRange {
    float f[2];  // P' = P s f
    float r[2];  // the running max of P' (0: none yet)
    __device__ __forceinline__ WeightRange() : f{1.f, 1.f}, r{0.f, 0.f} {}
};

// The largest |scale| of a key's v scale row (at ScaleOffset half): P' of the key is at most P f
// times it.
template <int GV>
__device__ __forceinline__ float max_v_scale(const unsigned char* sc, int half) {
    float m = 0.f;
#pragma unroll
    for (int G = 0; G < HEAD_DIM / GV; ++G) m = fmaxf(m, fabsf(scale_value<HEAD_DIM / GV>(sc, half, G)));
    return m;
}

// After a softmax step over NB blocks (x[b]: P of keys g, g + 8 and states 2t, 2t + 1; alpha: the
// step's factors, `moved`: whether any is not 1; smax / smax8[b]: max_v_scale of block b's keys
// g, g + 8): updates f and R, and rescales o by alpha and f's change, cv (the bias sums, taken
// from P without f) by alpha.
template <int NB, int NGV, int NO>
__device__ __forceinline__ void settle_weights(const float (&x)[NB][4], const float (&alpha)[2], bool moved,
                                               const float (&smax)[NB], const float (&smax8)[NB], WeightRange& w,
                                               float (&o)[NO][4], float (&cv)[NGV][2]) {
    float mx[2] = {0.f, 0.f};
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        mx[0] = fmaxf(mx[0], fmaxf(x[b][0] * smax[b], x[b][2] * smax8[b]));
        mx[1] = fmaxf(mx[1], fmaxf(x[b][1] * smax[b], x[b][3] * smax8[b]));
    }
    // MAX_VOTE (decode.cu): where no factor moved and no lane's weights pass R, R stays (the max
    // over the lanes of mx f is the lanes' max of mx times f) and nothing renormalises: one vote
    // instead of the column maxima's shuffles.
    if (MAX_VOTE && !moved && !__any_sync(0xffffffffu, mx[0] * w.f[0] > w.r[0] || mx[1] * w.f[1] > w.r[1])) return;
    float k[2];
    bool renorm = false;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        w.r[c] = fmaxf(w.r[c] * alpha[c], column_max(mx[c]) * w.f[c]);
        k[c] = 1.f;
        if (w.r[c] > WEIGHT_RANGE_HI || (w.r[c] > 0.f && w.r[c] < WEIGHT_RANGE_LO)) {
            // 2^-e for R in [2^e, 2^(e + 1)): R's exponent field from 254 (R is finite and normal
            // here: it is a product of finite P, |scale| and f).
            k[c] = __uint_as_float((254u - (__float_as_uint(w.r[c]) >> 23)) << 23);
            w.f[c] *= k[c];
            w.r[c] *= k[c];
            renorm = true;
        }
    }
    if (__any_sync(0xffffffffu, renorm)) {
        const float ak[2] = {alpha[0] * k[0], alpha[1] * k[1]};
        rescale(o, ak);
        rescale_pairs(cv, alpha);
    } else if (moved) {
        rescale(o, alpha);
        rescale_pairs(cv, alpha);
    }
}

// The warp's o after its last block (divided by f), plus each group's bias sums (over the lanes of
// a column), into shared memory as store_partial_o does, for the quantized steps (decode_q4.h,
// decode_q8.h): at(mb) = (group, dim of row g) of m-block mb in the format's layout (row g + 8:
// the next dim). With V_SUMS, o's m-blocks past HEAD_DIM / 16 hold each group's sums of the V
// weights, which the codes' magic offset multiplies: `magic` times them comes off the group's. The
// products carry the codes' unit (`unit`, decode_q4.h's Q4_V_UNIT), divided out with f.
template <int GV, typename At>
__device__ __forceinline__ void store_quant_partial_o(float* dst, const float (&o)[HEAD_DIM / 16 + V_SUMS(GV)][4],
                                                      const float (&cv)[HEAD_DIM / GV][2], const WeightRange& w, float magic, float unit,
                                                      At&& at) {
    const int cs = col_state();  // this lane's states: cs, cs + 1
    float bias[HEAD_DIM / GV][2];
#pragma unroll
    for (int G = 0; G < HEAD_DIM / GV; ++G) bias[G][0] = column_sum(cv[G][0]), bias[G][1] = column_sum(cv[G][1]);
    const float inv[2] = {1.f / (w.f[0] * unit), 1.f / (w.f[1] * unit)};
#pragma unroll
    for (int mb = 0; mb < HEAD_DIM / 16; ++mb) {
        const int2 gd = at(mb);
        const int G = gd.x, d = gd.y;
        float x[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] = V_SUMS(GV) ? fmaf(magic, o[HEAD_DIM / 16 + (V_SUMS(GV) ? G : 0)][e], o[mb][e]) : o[mb][e];
        dst[cs * HEAD_DIM + d] = fmaf(x[0], inv[0], bias[G][0]);
        dst[(cs + 1) * HEAD_DIM + d] = fmaf(x[1], inv[1], bias[G][1]);
        dst[cs * HEAD_DIM + d + 1] = fmaf(x[2], inv[0], bias[G][0]);
        dst[(cs + 1) * HEAD_DIM + d + 1] = fmaf(x[3], inv[1], bias[G][1]);
    }
}
