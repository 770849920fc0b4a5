// softmax.h — online softmax over a warp's 16-row accumulator tile, in the exp2 domain.
//
// Each lane holds two rows (g and g+8). Per row: running max m (already multiplied by
// scale*log2(e)), the lane's partial sum l (summed over the quad once, at the end), and the
// output accumulator, rescaled by exp2(m_old - m_new) whenever the max grows.
#pragma once
#include "ptx.h"

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
