// decode_q4.h — decode.cu's block step for 4-bit caches: the codes go into the mma as they are and
// the scales and biases enter per group afterwards, so that no element is dequantized. decode.cu
// includes it after its helpers (mma16816, transpose8x8, column_sum, scale_value, group_scores)
// and before its kernel, which runs this path at CACHE_BITS 4 with the groups' sizes GK (K) and GV
// (V) as template arguments (32 or 64, picked per call).
//
// Magic codes. A 4-bit code c under the high byte of M (bf16 2^7, fp16 2^10) reads as M + c, exact;
// one PRMT per pair of codes builds them. With x = s c + b per group G of the head dim:
//   K:  S^T[key, st] = sum_G  s'[key,G] * A_G[key, st] + (b[key,G] - M s'[key,G]) * qs_G[st],
//       A_G = sum_{d in G} (M + U c[key,d]) q[st,d] (an mma over G's dims, f32 accumulators),
//       s' = s / U (U = Q4_K_UNIT, below),
//       qs_G = sum_{d in G} q[st,d] (f32, once per call). On Hopper under bf16 queries K's codes
//       enter as subnormals instead, with no M (Q4_SUBNORMAL_K, below).
//   V:  O^T[d, st] = sum_k (M + c[k,d]) P'_G[k,st] - (M + 8) sum_k P'_G[k,st] + sum_k (b + 8 s)[k,G] P[k,st],
//       P'_G = P * s[.,G] rounded once to elem_t (as P alone would be), G the group of d (fp16
//       queries: P s f, f keeping it in fp16's range, decode_weights.h; the output divides by f). Each
//       m-block's mma takes the first term; the second, the same for every m-block of a group, comes
//       from one mma per group and block whose A is all ones (the sums of P'_G, o's m-blocks past
//       HEAD_DIM / 16) and is taken off once at the end (V_SUMS groups; with more groups than the
//       registers allow, each m-block takes it by a second mma whose A is -(M + 8)). Either way
//       what P'_G's rounding multiplies is s (c - 8), centred as the values are (leaving c
//       uncentred, so that it multiplies s c, all positive, failed the GPU tests' bound,
//       bench/RESULTS.md). The third term is summed in f32 from the unrounded P per lane, and over
//       the lanes at the end.
// The mma accumulates the magic terms in f32 and they cancel there: about log2(M) bits of f32's 24
// are lost (a few more where they cancel at the end, over a split's keys), far below elem_t's
// rounding of the dequantized values this replaces.
//
// Layouts (g = lane / 4, t = lane % 4; a 16-key block's K rows at stride Q4::SROW_K, V rows at
// Q4::SROW_V):
//   K: one ldmatrix.x4 gives lane (g, t) word t of 16-byte chunks c, c + 1 of rows g and g + 8.
//      Chunk c (dims 32c .. 32c + 31, one group or half of one) feeds k steps 2c, 2c + 1: word
//      W = 4c + t's codes (c0 .. c7) pair as (c0, c4), (c1, c5) -> step 2c's k (2t, 2t+1) and
//      (2t+8, 2t+9); (c2, c6), (c3, c7) -> step 2c + 1's. Q's B fragment takes the same dims.
//   V: one ldmatrix.x4.trans gives lane (g, t) the 16-bit column g (dims 32u + 4g .. + 3) of 16-byte
//      chunks u, u + 1 of keys 2t and 2t + 1 (low and high half) and of keys 2t + 8, 2t + 9: the
//      two keys' codes of four dims side by side, as the A fragment pairs them. (x >> 4k) & 0xf
//      of both under M is then the pair of dim 4g + k. Unit (chunk) u gives m-blocks 2u (dims 4g,
//      4g + 1: rows g, g + 8) and 2u + 1 (4g + 2, 4g + 3), all of group 32u / GV.
#pragma once

// K's codes: Q4_K_UNIT c under M. fp16 takes them as 16 c (bits 4-7 of the low byte, as cheap to
// build as bits 0-3): the magic then outweighs the codes' sums 16 times less, and the sums lose 4
// bits fewer of f32's 24 where it cancels (it cost fp16 an lse error of 1.3e-5 with scores ~100).
#if FLASH_DTYPE == 1
#define Q4_M 128.f
#define Q4_M2 0x43004300u      // bf16 M in both lanes
#define Q4_ONES 0x3f803f80u    // bf16 1 in both lanes
#define Q4_NEG_M8 0xc308c308u  // -(M + 8 U): bf16 -136
#define Q4_K_UNIT 1.f
#define Q4_V_UNIT 1
#else
#define Q4_M 1024.f
#define Q4_M2 0x64006400u
#define Q4_ONES 0x3c003c00u
#define Q4_NEG_M8 0xe480e480u  // fp16 -1152
#define Q4_K_UNIT 16.f
#define Q4_V_UNIT 16
#endif
// V's codes: Q4_V_UNIT c under M, for the same reason: where the magic comes off at the end, over a
// split's keys, fp16's 1024 + c lost too much (the GPU tests' bound, bench/RESULTS.md); 1024 + 16 c
// outweighs the codes as bf16's 128 + c does. The products then carry U, which the output divides
// out. What the V weights' sums take off the codes' products: -(M + 8 U) (the codes enter centred).
#define Q4_MAGIC_SUMS (-(Q4_M + 8.f * Q4_V_UNIT))

struct Q4 {
    enum : int {
        CHUNKS = HEAD_DIM / 32,  // 16-byte chunks of a row
        UNITS = HEAD_DIM / 32,   // V units per lane (four dims of a word each)
        SROW_K = Geom<4>::SROW_K,
        SROW_V = Geom<4>::SROW_V,
    };
};

// K's codes on Hopper under bf16 queries: as subnormals, not under M. A bf16 lane whose bit pattern
// is below 256 is subnormal or in the first normal binade, where its value is linear in its bits:
// a code in bits 0-3 reads as c 2^-133, in bits 4-7 as 16 c 2^-133, exactly, and sm_90's mma.sync
// takes them so (bench/RESULTS.md session 56). Four LOP3 and one SHF build a word's four pairs where
// the magic form takes seven (its PRMTs), and no magic sum cancels in f32. q goes in as
// q' = q 2^k / U (U = 16 for the pairs from bits 4-7), k chosen per warp so that its largest |q'|
// lies in [2^Q4_SUB_TOP, 2^(Q4_SUB_TOP + 1)) and the products stay normal f32; the scores take
// kf = 2^(Q4_SUB_B - k) with the scale:
//   S^T[key, st] = sum_G kf s[key,G] A_G[key, st] + b[key,G] qs_G[st],  A_G = sum_{d in G} q'_d U_d c_d 2^-133.
// k comes from one REDUX, so kf lives in a uniform register: with a shuffle reduction it took a
// vector register through the loop, and the 128-register kernels spilled more (one warp a block:
// 88 bytes) and ran 64 x 1024 5 % slower. Elsewhere the magic form above: sm_80 (not measured
// there) and fp16 queries (not measured: their 8-state kernel, at the 168-register cap, spilled
// 20 bytes with kf in a vector register).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && FLASH_DTYPE == 1
#define Q4_SUBNORMAL_K 1
#define Q4_SUB_B 133    // bit pattern 1 is 2^-133
#define Q4_SUB_TOP 120  // q' below 2^121; a code's product with a q' 2^-113 of that still a normal f32
#else
#define Q4_SUBNORMAL_K 0
#endif

// The code pairs of a K word: (c0, c4), (c1, c5), (c2, c6), (c3, c7): subnormal, the odd ones in
// units of 16 (Q4_SUBNORMAL_K), or all times Q4_K_UNIT under M.
__device__ __forceinline__ void q4_pairs(u32 w, u32 (&out)[4]) {
#if Q4_SUBNORMAL_K
    const u32 w8 = w >> 8;
    out[0] = w & 0x000f000fu;
    out[1] = w & 0x00f000f0u;
    out[2] = w8 & 0x000f000fu;
    out[3] = w8 & 0x00f000f0u;
#else
#if FLASH_DTYPE == 1
    const u32 lo = w & 0x0f0f0f0fu, hi = (w >> 4) & 0x0f0f0f0fu;
#else
    const u32 lo = (w << 4) & 0xf0f0f0f0u, hi = w & 0xf0f0f0f0u;
#endif
    out[0] = __byte_perm(lo, MAGIC_BYTES, 0x5240);
    out[1] = __byte_perm(hi, MAGIC_BYTES, 0x5240);
    out[2] = __byte_perm(lo, MAGIC_BYTES, 0x5341);
    out[3] = __byte_perm(hi, MAGIC_BYTES, 0x5341);
#endif
}

// U ((x >> 4k) & 0xf) in both 16-bit lanes under M: dim k of two keys' interleaved half-words.
template <int K>
__device__ __forceinline__ u32 q4_dim(u32 x) {
    constexpr int SHIFT = 4 * K - (Q4_V_UNIT == 16 ? 4 : 0);  // right; negative: left
    const u32 y = SHIFT >= 0 ? x >> (SHIFT > 0 ? SHIFT : 0) : x << (SHIFT < 0 ? -SHIFT : 0);
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(y), "r"(0x000f000fu * Q4_V_UNIT), "r"(Q4_M2));  // (a & b) | c
    return d;
}

// Q^T's B fragments for chunk c, k step h: qa[4c + 2h + f] = dims (8W + 2h + f, 8W + 2h + f + 4) of
// state g, W = 4c + t (zero past the last state), scaled by 2^k / U where Q4_SUBNORMAL_K (kf: the
// scores' 2^(Q4_SUB_B - k)); qs[G][j]: the sum of group G of states 2t + j (unscaled).
template <int GK>
__device__ __forceinline__ void q4_load_q(u32 (&qa)[HEAD_DIM / 8], float (&qs)[HEAD_DIM / GK][2], float& kf, const DecodeParams& p,
                                          const DecodeWork& w) {
    constexpr int CPG = GK / 32;  // chunks per group
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int st = w.state0 + (PAIRED ? g % STATE_TILE : g);  // PAIRED: Q^T in both column halves
    const bool ok = st < p.states;
    const int i = w.row_of(p, st), h = w.kvh * p.group + (ok ? st % p.group : 0);
    const u16* q = reinterpret_cast<const u16*>(p.q) + (((i64)w.b * p.seq_q + i) * p.heads + h) * HEAD_DIM;
    float part[HEAD_DIM / GK];
#pragma unroll
    for (int G = 0; G < HEAD_DIM / GK; ++G) part[G] = 0.f;
#if Q4_SUBNORMAL_K
    float x[Q4::CHUNKS][8];  // [c][k]: dim 8 (4c + t) + k
    float mx = 0.f;
#pragma unroll
    for (int c = 0; c < Q4::CHUNKS; ++c)
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            x[c][k] = ok ? to_float(q[8 * (4 * c + t) + k]) : 0.f;
            part[c / CPG] += x[c][k];
            mx = fmaxf(mx, fabsf(x[c][k]));
        }
    // The warp's largest |q| (as bits: ordered as the floats, mx >= 0) by one REDUX, whose result
    // and what follows from it live in uniform registers; mx in [2^e, 2^(e + 1)) (e = -127 for
    // zero, 128 for inf); k keeps 2^k and kf normal floats.
    const int e = (int)(__reduce_max_sync(0xffffffffu, __float_as_uint(mx)) >> 23) - 127;
    const int kq = min(max(Q4_SUB_TOP - e, Q4_SUB_B - 127), 126);  // k: q' = q 2^k / U
    const float up = __uint_as_float((u32)(127 + kq) << 23);
    kf = __uint_as_float((u32)(127 + Q4_SUB_B - kq) << 23);
#pragma unroll
    for (int c = 0; c < Q4::CHUNKS; ++c)
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // k = 2h + f; odd k: q4_pairs' units of 16
            const float u = k % 2 ? up * 0.0625f : up;
            qa[4 * c + k] = pack2(x[c][k] * u, x[c][k + 4] * u);
        }
#else
    kf = 1.f / Q4_K_UNIT;  // the magic codes' unit
#pragma unroll
    for (int c = 0; c < Q4::CHUNKS; ++c) {
        const int base = 8 * (4 * c + t);
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // k = 2h + f
            const u16 lo = ok ? q[base + k] : (u16)0, hi = ok ? q[base + k + 4] : (u16)0;
            qa[4 * c + k] = lo | ((u32)hi << 16);
            part[c / CPG] += to_float(lo) + to_float(hi);
        }
    }
#endif
#pragma unroll
    for (int G = 0; G < HEAD_DIM / GK; ++G) {
        float s = part[G];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);  // state g's sum, in every lane of g
        // (4 col_state() is 8 t at the tile of 8; that text kept there: ptxas allocated the tile-8
        // kernels' registers otherwise, and three spilled, bench/RESULTS.md session 54)
        qs[G][0] = __shfl_sync(0xffffffffu, s, PAIRED ? 4 * col_state() : 8 * t);
        qs[G][1] = __shfl_sync(0xffffffffu, s, PAIRED ? 4 * col_state() + 4 : 8 * t + 4);
    }
}

// acc[G] = A_G of a 16-key block whose K rows start at shared address `rows`: rows g, g + 8 (keys),
// columns states 2t, 2t + 1 (PAIRED: states 2t % 4, + 1, Q^T being in both column halves); the
// groups of chunks [c0, c1) only (an even span: whole groups).
template <int GK>
__device__ __forceinline__ void q4_qk_products(float (&acc)[HEAD_DIM / GK][4], const u32 (&qa)[HEAD_DIM / 8], u32 rows, int c0 = 0,
                                               int c1 = Q4::CHUNKS) {
    constexpr int CPG = GK / 32;
    // ldmatrix.x4: lanes 8j .. 8j + 7 address matrix j = rows 8 (j % 2) .. + 7 of chunk c + j / 2.
    const u32 row = lane_row(rows, Q4::SROW_K);
#pragma unroll
    for (int G = c0 / CPG; G < c1 / CPG; ++G) acc[G][0] = acc[G][1] = acc[G][2] = acc[G][3] = 0.f;
#pragma unroll
    for (int c = c0; c < c1; c += 2) {
        u32 r[4];  // rows g, g + 8 of chunk c; rows g, g + 8 of chunk c + 1
        ldmatrix_x4(r, lane_unit(row, c));
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int ch = c + e;
            u32 pg[4], pg8[4];
            q4_pairs(r[2 * e], pg);
            q4_pairs(r[2 * e + 1], pg8);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 a[4] = {pg[2 * h], pg8[2 * h], pg[2 * h + 1], pg8[2 * h + 1]};
                mma16816(acc[ch / CPG], a, qa[4 * ch + 2 * h], qa[4 * ch + 2 * h + 1]);
            }
        }
    }
}

// x = S^T from a block's A_G (acc): each group's scale and bias terms. sc / bi (sc8 / bi8): the
// scale rows of this lane's key g (g + 8), at ScaleOffset half (half8).
template <int GK>
__device__ __forceinline__ void q4_qk_terms(float (&x)[4], const float (&acc)[HEAD_DIM / GK][4], const float (&qs)[HEAD_DIM / GK][2],
                                            float kf, const unsigned char* sc, const unsigned char* bi, const unsigned char* sc8,
                                            const unsigned char* bi8, int half, int half8) {
    constexpr int NG = HEAD_DIM / GK;
#pragma unroll
    for (int G = 0; G < NG; ++G) {
        // The codes' scale per unit of acc: s times kf (q4_load_q; exact, a power of two).
        const float s = scale_value<NG>(sc, half, G) * kf;
        const float s8 = scale_value<NG>(sc8, half8, G) * kf;
#if Q4_SUBNORMAL_K
        const float b = scale_value<NG>(bi, half, G), b8 = scale_value<NG>(bi8, half8, G);  // no magic to take off
#else
        const float b = fmaf(-Q4_M, s, scale_value<NG>(bi, half, G));
        const float b8 = fmaf(-Q4_M, s8, scale_value<NG>(bi8, half8, G));
#endif
        group_scores(x, acc[G], s, s8, b, b8, qs[G], G == 0);
    }
}

// x = S^T of a 16-key block whose K rows start at shared address `rows` (q4_qk_products, then
// q4_qk_terms).
template <int GK>
__device__ __forceinline__ void q4_qk(float (&x)[4], const u32 (&qa)[HEAD_DIM / 8], const float (&qs)[HEAD_DIM / GK][2], float kf,
                                      u32 rows, const unsigned char* sc, const unsigned char* bi, const unsigned char* sc8,
                                      const unsigned char* bi8, int half, int half8) {
    float acc[HEAD_DIM / GK][4];
    q4_qk_products<GK>(acc, qa, rows);
    q4_qk_terms<GK>(x, acc, qs, kf, sc, bi, sc8, bi8, half, half8);
}

// The group of m-block mb, and the dim of its row g (row g + 8: the next one).
template <int GV>
__device__ __forceinline__ int q4_group(int mb) { return GV == 64 ? mb / 4 : mb / 2; }
__device__ __forceinline__ int q4_dim_of(int mb, int g) { return 32 * (mb / 2) + 4 * g + 2 * (mb % 2); }

// o's m-blocks of V group G += the group's codes (V rows at this lane's `row`, v_columns') times
// P'^T's B fragment bq0 / bq1.
template <int GV>
__device__ __forceinline__ void q4_pv_units(float (&o)[HEAD_DIM / 16 + V_SUMS(GV)][4], u32 row, int G, u32 bq0, u32 bq1) {
    constexpr int UPG = Q4::UNITS / (HEAD_DIM / GV);  // units per group
    const u32 neg_m8[4] = {Q4_NEG_M8, Q4_NEG_M8, Q4_NEG_M8, Q4_NEG_M8};
    u32 xv[UPG][2];  // the group's units only (all of them at once spill at D = 256)
    v_columns<UPG>(xv, row, G * UPG);
#pragma unroll
    for (int j = 0; j < UPG; ++j) {
        const int u = G * UPG + j;
        const u32 x01 = xv[j][0], x89 = xv[j][1];
        const u32 a0[4] = {q4_dim<0>(x01), q4_dim<1>(x01), q4_dim<0>(x89), q4_dim<1>(x89)};
        mma16816(o[2 * u], a0, bq0, bq1);
        if constexpr (V_SUMS(GV) == 0) mma16816(o[2 * u], neg_m8, bq0, bq1);
        const u32 a1[4] = {q4_dim<2>(x01), q4_dim<3>(x01), q4_dim<2>(x89), q4_dim<3>(x89)};
        mma16816(o[2 * u + 1], a1, bq0, bq1);
        if constexpr (V_SUMS(GV) == 0) mma16816(o[2 * u + 1], neg_m8, bq0, bq1);
    }
}

// o += V^T P'^T for a 16-key block whose V rows start at shared address `rows` (stride Q4::SROW_V),
// and cv[G] += the block's bias sums of group G (b + 8 s: the codes' share is centred). x: P of keys
// g, g + 8 (rows) and states 2t, 2t + 1 in S^T's layout, f32; sc / bi (sc8 / bi8): the v scale and
// bias rows of key g (g + 8) at ScaleOffset half (half8). cv[G][j]: sum over this lane's keys of b P
// for state 2t + j (summed over the lanes at the end). P'_G = P s f goes into B fragments as
// p_fragment transposes P (w.f: 1 but with fp16 queries). NBV 2 (a PAIRED step): x holds the
// weights of two blocks, whose V rows start at `rows` and `rows1`; each takes its columns of P'^T
// (block_columns).
template <int GV, int NBV = 1>
__device__ __forceinline__ void q4_pv(float (&o)[HEAD_DIM / 16 + V_SUMS(GV)][4], float (&cv)[HEAD_DIM / GV][2], const float (&x)[4],
                                      const WeightRange& w, u32 rows, const unsigned char* sc, const unsigned char* bi,
                                      const unsigned char* sc8, const unsigned char* bi8, int half, int half8, u32 rows1 = 0) {
    constexpr int NG = HEAD_DIM / GV;
    const u32 row = lane_row(rows, Q4::SROW_V);  // v_columns' row
    const u32 ones[4] = {Q4_ONES, Q4_ONES, Q4_ONES, Q4_ONES};
    const float xf[4] = {x[0] * w.f[0], x[1] * w.f[1], x[2] * w.f[0], x[3] * w.f[1]};
#pragma unroll
    for (int G = 0; G < NG; ++G) {
        const float s = scale_value<NG>(sc, half, G), s8 = scale_value<NG>(sc8, half8, G);
        const float b = fmaf(8.f, s, scale_value<NG>(bi, half, G));
        const float b8 = fmaf(8.f, s8, scale_value<NG>(bi8, half8, G));
        cv[G][0] = fmaf(b, x[0], fmaf(b8, x[2], cv[G][0]));
        cv[G][1] = fmaf(b, x[1], fmaf(b8, x[3], cv[G][1]));
        const u32 bq0 = transpose8x8(pack2(xf[0] * s, xf[1] * s)), bq1 = transpose8x8(pack2(xf[2] * s8, xf[3] * s8));
        if constexpr (V_SUMS(GV) > 0) mma16816(o[HEAD_DIM / 16 + (V_SUMS(GV) ? G : 0)], ones, bq0, bq1);  // P' sums, every row alike
        if constexpr (NBV == 1) {
            q4_pv_units<GV>(o, row, G, bq0, bq1);
        } else {
            q4_pv_units<GV>(o, row, G, block_columns(bq0, 0), block_columns(bq1, 0));
            q4_pv_units<GV>(o, lane_row(rows1, Q4::SROW_V), G, block_columns(bq0, 1), block_columns(bq1, 1));
        }
    }
}
