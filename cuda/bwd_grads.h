// bwd_grads.h — the elementwise middle of the dK/dV kernels (bwd_dkdv.cu, bwd_sm90.cu): from a
// warp's transposed scores S^T and dP^T (16 keys x 8*NT queries, the mma accumulator layout: key
// rows g, g + 8; query columns 8 nt + 2 t, + 1) to P^T and dS^T, with the query rows' lse_log2
// and delta at lse2[col] and dlt[col] (shared memory, +inf and 0 past Sq so that P = 0 there).
#pragma once
#include "mask.h"

#if MODS
// Both at once with the score modifiers (which take scaled scores): S^T -> P^T and dP^T -> dS^T,
// the softcap's chain rule folded into dS^T.
template <int NT>
__device__ __forceinline__ void grads_t(float (&s)[NT][4], float (&dp)[NT][4], float scale_log2, bool masked,
                                             int key0, int m0, const Visibility& vis, const float* lse2,
                                             const float* dlt) {
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[i][e] *= scale_log2;
    if (masked) mask_tile<NT, true>(s, key0, m0, vis);
    const float d0 = vis.dist(m0 + 2 * t, key0 + g);  // mask.h's modify_tile
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = i * 8 + 2 * t + (e % 2);
            float dcap;  // the softcap's chain rule (1 without one)
            const float x = vis.modify_at(s[i][e], d0 + (float)(8 * i + e % 2 - 8 * (e / 2)), dcap);
            const float pr = fast_exp2(x - lse2[col]);
            s[i][e] = pr;                                   // P^T
            dp[i][e] = pr * (dp[i][e] - dlt[col]) * dcap;   // dS^T
        }
}
#else
// S^T (raw scores) -> P^T = exp2(S^T scale_log2 - lse2), masked when `masked` (KEY_ROWS mask).
template <int NT>
__device__ __forceinline__ void probs_t(float (&s)[NT][4], float scale_log2, bool masked, int key0, int m0,
                                        const Visibility& vis, const float* lse2) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[i][e] *= scale_log2;
    if (masked) mask_tile<NT, true>(s, key0, m0, vis);
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[i][e] = fast_exp2(s[i][e] - lse2[i * 8 + 2 * t + (e % 2)]);
}

// dP^T -> dS^T = P^T (dP^T dp_scale - delta) (dp_scale: a power of two that unscales dP^T, one FMA
// with the subtraction).
template <int NT>
__device__ __forceinline__ void dscores_t(float (&dp)[NT][4], const float (&pt)[NT][4], const float* dlt, float dp_scale = 1.f) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[i][e] = pt[i][e] * fmaf(dp[i][e], dp_scale, -dlt[i * 8 + 2 * t + (e % 2)]);
}

// Both: S^T -> P^T and dP^T -> dS^T.
template <int NT>
__device__ __forceinline__ void grads_t(float (&s)[NT][4], float (&dp)[NT][4], float scale_log2, bool masked, int key0,
                                        int m0, const Visibility& vis, const float* lse2, const float* dlt) {
    probs_t<NT>(s, scale_log2, masked, key0, m0, vis, lse2);
    dscores_t<NT>(dp, s, dlt);
}
#endif
