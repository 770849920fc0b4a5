// softmax.h — online softmax over a warp's 16-row accumulator tile, in the exp2 domain.
//
// Each lane holds two rows (g and g+8). Per row: running max m (already multiplied by
// scale*log2(e)), the lane's partial sum l (summed over the quad once, at the end), and the
// output accumulator, rescaled by exp2(m_old - m_new) whenever the max grows.
#pragma once
#include "ptx.h"
#include "mask.h"

struct OnlineSoftmax {
    float m[2];  // running max of scale_log2 * s, -inf until a visible key is seen
    float l[2];  // this lane's part of the running sum of exp2(scale_log2 * s - m)

    __device__ __forceinline__ void init() {
        m[0] = m[1] = NEG_INF;
        l[0] = l[1] = 0.f;
    }

    // s: raw scores, already scaled to the log2 domain and masked (-inf). On return s holds the
    // unnormalised probabilities; acc (the 16 x 8*NO output tile) is rescaled.
    template <int NT, int NO>
    __device__ __forceinline__ void update(float (&s)[NT][4], float (&acc)[NO][4]) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = m[r];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
            mx = quad_max(mx);
            // A row that has seen no visible key keeps max -inf; use 0 as its base so that
            // exp2(-inf - base) = 0 rather than NaN.
            const float base = (mx == NEG_INF) ? 0.f : mx;
            const float alpha = fast_exp2(m[r] - base);
            m[r] = mx;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                s[nt][2 * r] = fast_exp2(s[nt][2 * r] - base);
                s[nt][2 * r + 1] = fast_exp2(s[nt][2 * r + 1] - base);
                sum += s[nt][2 * r] + s[nt][2 * r + 1];
            }
            l[r] = l[r] * alpha + sum;
#pragma unroll
            for (int no = 0; no < NO; ++no) {
                acc[no][2 * r] *= alpha;
                acc[no][2 * r + 1] *= alpha;
            }
        }
    }

    // Finishes the rows: inv[r] = 1/l (0 for rows with no visible key), lse[r] in natural log
    // (-inf for rows with no visible key).
    __device__ __forceinline__ void finish(float (&inv)[2], float (&lse)[2]) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float sum = quad_sum(l[r]);
            const bool empty = !(sum > 0.f);
            inv[r] = empty ? 0.f : 1.f / sum;
            lse[r] = empty ? NEG_INF : (m[r] + fast_log2(sum)) * LN2;
        }
    }
};

// The fp32 kernels' layout (a half-warp shares a row; lane tx holds columns tx + 16 j): one online-
// softmax step of one query row over a key tile starting at n0. Scales (and, with need_mask, masks)
// the lane's scores s in place, writes their probabilities to p_row[tx + 16 j], updates the row's
// running max m and this lane's part l of the sum, and returns exp2(m_old - m_new), the factor
// the row's output accumulator must be rescaled by.
template <int MC>
__device__ __forceinline__ float softmax_row_step(float (&s)[MC], float& m, float& l, float* p_row, int row,
                                                  int n0, bool need_mask, float scale_log2, int seqlen_q,
                                                  int seqlen_k) {
    const int tx = threadIdx.x % 16;
    float mx = m;
#pragma unroll
    for (int j = 0; j < MC; ++j) {
        float x = s[j] * scale_log2;
        if (need_mask && !visible(row, n0 + tx + 16 * j, seqlen_q, seqlen_k)) x = NEG_INF;
        s[j] = x;
        mx = fmaxf(mx, x);
    }
    mx = half_max(mx);
    const float base = (mx == NEG_INF) ? 0.f : mx;  // a row with no visible key yet: P = 0, no NaN
    const float alpha = fast_exp2(m - base);
    m = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < MC; ++j) {
        const float e = fast_exp2(s[j] - base);
        sum += e;
        p_row[tx + 16 * j] = e;
    }
    l = l * alpha + sum;
    return alpha;
}
