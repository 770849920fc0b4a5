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

    // sink2: the head's attention sink in the exp2 domain (-inf: none). A sink is one more term of
    // every row's sum, exp2(sink2 - m) with no value: it starts the row at max sink2, sum 1 (held
    // by the quad's first lane, since the quad's parts are summed at the end).
    __device__ __forceinline__ void init(float sink2) {
        m[0] = m[1] = sink2;
        l[0] = l[1] = (sink2 != NEG_INF && threadIdx.x % 4 == 0) ? 1.f : 0.f;
    }

    // s: raw scores, already scaled to the log2 domain and masked (-inf). On return s holds the
    // unnormalised probabilities; acc (the 16 x 8*NO output tile) is rescaled.
    template <int NT, int NO>
    __device__ __forceinline__ void update(float (&s)[NT][4], float (&acc)[NO][4]) {
        float alpha[2];
        step(s, alpha);
        rescale_rows(acc, alpha);
    }

    // update's first half, which leaves the output tile alone (the sm90 forward rescales it once its
    // previous P V product has landed): s becomes the unnormalised probabilities, and alpha[r] the
    // factor exp2(m_old - m_new) by which row r's output must be rescaled.
    template <int NT>
    __device__ __forceinline__ void step(float (&s)[NT][4], float (&alpha)[2]) {
        step_scaled(s, 1.f, alpha);
    }

    // step on raw scores s (masked to -inf, not yet scaled): the scale (> 0) goes into the
    // exponent's one FMA, exp2(scale * s - scale * max), instead of a multiply per score first.
    template <int NT>
    __device__ __forceinline__ void step_scaled(float (&s)[NT][4], float scale, float (&alpha)[2]) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = NEG_INF;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
            mx = fmaxf(m[r], quad_max(mx) * scale);
            // A row that has seen no visible key keeps max -inf; use 0 as its base so that
            // exp2(-inf - base) = 0 rather than NaN.
            const float base = (mx == NEG_INF) ? 0.f : mx;
            alpha[r] = fast_exp2(m[r] - base);
            m[r] = mx;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                s[nt][2 * r] = fast_exp2(fmaf(s[nt][2 * r], scale, -base));
                s[nt][2 * r + 1] = fast_exp2(fmaf(s[nt][2 * r + 1], scale, -base));
                sum += s[nt][2 * r] + s[nt][2 * r + 1];
            }
            l[r] = l[r] * alpha[r] + sum;
        }
    }

    // update's second half: row r of acc times alpha[r].
    template <int NO>
    __device__ __forceinline__ static void rescale_rows(float (&acc)[NO][4], const float (&alpha)[2]) {
#pragma unroll
        for (int no = 0; no < NO; ++no) {
            acc[no][0] *= alpha[0];
            acc[no][1] *= alpha[0];
            acc[no][2] *= alpha[1];
            acc[no][3] *= alpha[1];
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

// The fp32 kernels' dS = P * (dP - delta) with P = exp2(S * scale_log2 - lse_log2), for the thread's
// scores s and dp of query rows row0 + ty + 16 i (lse2[i], dlt[i]) and keys n0 + tx + 16 j (masked
// by vis when need_mask, then modified by it, dS taking the softcap's chain rule), to
// ds[(ty + 16 i) * DS_STRIDE + tx + 16 j].
template <int DS_STRIDE, int MR, int MC>
__device__ __forceinline__ void store_ds_rows(float* ds, const float (&s)[MR][MC], const float (&dp)[MR][MC],
                                              const float (&lse2)[MR], const float (&dlt)[MR], int row0, int n0,
                                              bool need_mask, float scale_log2, const Visibility& vis, int ty,
                                              int tx) {
#pragma unroll
    for (int i = 0; i < MR; ++i) {
        const int row = row0 + ty + 16 * i;
#pragma unroll
        for (int j = 0; j < MC; ++j) {
            const int col = n0 + tx + 16 * j;
            float x = s[i][j] * scale_log2, dcap;
            if (need_mask && !vis(row, col)) x = NEG_INF;
            x = vis.modify(x, row, col, dcap);
            const float pr = fast_exp2(x - lse2[i]);
            ds[(ty + 16 * i) * DS_STRIDE + tx + 16 * j] = pr * (dp[i][j] - dlt[i]) * dcap;
        }
    }
}

// The fp32 kernels' online softmax (16 x 16 threads; the half-warp ty shares query rows ty + 16 i,
// lane tx holds their scores tx + 16 j): per row i, the running max m (scale*log2(e) domain) and
// this lane's part l of the running sum.
template <int MR>
struct OnlineSoftmaxRows {
    float l[MR];
    float m[MR];

    // Starts the rows at the head's sink (sink2 in the exp2 domain, -inf: none; see OnlineSoftmax::init,
    // lane tx = 0 holding its 1), and zeroes their output accumulator acc (float or float4 columns).
    template <typename T, int NC>
    __device__ __forceinline__ void init(T (&acc)[MR][NC], float sink2) {
#pragma unroll
        for (int i = 0; i < MR; ++i) {
            m[i] = sink2;
            l[i] = (sink2 != NEG_INF && threadIdx.x % 16 == 0) ? 1.f : 0.f;
            zero(acc[i]);
        }
    }

    // One key tile from n0 for query rows row0 + ty + 16 i: scales (and, with need_mask, masks by vis) the
    // scores s in place, writes their probabilities to p[(ty + 16 i) * PSTRIDE + tx + 16 j], and
    // rescales each row of acc by exp2(m_old - m_new).
    template <int PSTRIDE, int MC, typename T, int NC>
    __device__ __forceinline__ void update(float (&s)[MR][MC], T (&acc)[MR][NC], float* p, int row0, int n0,
                                           bool need_mask, float scale_log2, const Visibility& vis) {
        const int ty = threadIdx.x / 16;
#pragma unroll
        for (int i = 0; i < MR; ++i) {
            const float alpha = row_step(s[i], m[i], l[i], p + (ty + 16 * i) * PSTRIDE, row0 + ty + 16 * i, n0,
                                         need_mask, scale_log2, vis);
            rescale(acc[i], alpha);
        }
    }

    // One row of update: scales and masks the lane's scores s, writes their probabilities to
    // p_row[tx + 16 j], updates the row's m and l, and returns exp2(m_old - m_new).
    template <int MC>
    __device__ __forceinline__ static float row_step(float (&s)[MC], float& m, float& l, float* p_row, int row,
                                                     int n0, bool need_mask, float scale_log2,
                                                     const Visibility& vis) {
        const int tx = threadIdx.x % 16;
        float mx = m;
#pragma unroll
        for (int j = 0; j < MC; ++j) {
            float x = s[j] * scale_log2, dcap;
            if (need_mask && !vis(row, n0 + tx + 16 * j)) x = NEG_INF;
            x = vis.modify(x, row, n0 + tx + 16 * j, dcap);
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

    // Finishes rows row0 + ty + 16 i of the half-warp ty: inv[i] = 1/l (0 for a row with no visible
    // key) and, from lane tx = 0, lse[offset + row] in natural log (-inf for such a row) for rows
    // < seqlen_q.
    __device__ __forceinline__ void finish(float (&inv)[MR], float* lse, i64 offset, int row0, int seqlen_q,
                                           int ty, int tx) {
#pragma unroll
        for (int i = 0; i < MR; ++i) {
            const float sum = half_sum(l[i]);
            const bool empty = !(sum > 0.f);
            inv[i] = empty ? 0.f : 1.f / sum;
            const int row = row0 + ty + 16 * i;
            if (tx == 0 && row < seqlen_q) lse[offset + row] = empty ? NEG_INF : (m[i] + log2f(sum)) * LN2;
        }
    }
};
