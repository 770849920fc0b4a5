// tf32.h — tile.h's warp-level GEMMs for f32 tiles, on tensor cores as TF32 products
// (mma.sync m16n8k8, sm_80 and newer), with the same names and shapes as the fp16 / bf16 ones, so
// that fwd.cu, bwd_dq.cu and bwd_dkdv.cu run either. Included by tile.h when FLASH_DTYPE == 2.
//
// TF32_TERMS = 3 (split TF32, "3xTF32"): each operand x = big + small, big = tf32(x) and
//   small = tf32(x - big) (x - big is exact in f32), so big + small holds x to about 2^-22, and
//   a * b ~ big_a * small_b + small_a * big_b + big_a * big_b to about f32's accuracy.
//   The tensor cores add into their accumulator truncating (round toward zero): over a long chain
//   of products that is a bias, not noise. So no chain is long: S = Q K^T sums each k step's three
//   products in a zero accumulator, added to S by an f32 add (round to nearest); O += P V sums one
//   key tile (3 * BLOCK_N / 8 products) per 8 output columns the same way. (Summing O's products
//   per k step as well cost 70-90 more registers: ptxas interleaves every column's temporaries.)
//   The backward's products take the same two shapes (S^T, dP^T as S; dV, dK, dQ as O, over a
//   query or key tile), and the atomic-dQ kernel's dQ += dS K (gemm_atb) sums 32 keys at a time.
// TF32_TERMS = 1: one TF32 product per pair (big_a * big_b) chained in the tensor cores: operands
//   rounded to 11 significant bits (relative 2^-11); asked for by name only (precision="tf32").
#pragma once

#ifndef TF32_TERMS
#error "the fp32 tensor-core kernels need TF32_TERMS (1 or 3)"
#endif
#if TF32_TERMS != 1 && TF32_TERMS != 3
#error "TF32_TERMS must be 1 or 3"
#endif

// One operand fragment of N elements: the big parts and (TF32_TERMS = 3) the small ones.
template <int N>
struct Tf32Frag {
    u32 big[N];
#if TF32_TERMS == 3
    u32 small[N];
#endif
    // Element i from f32 x.
    __device__ __forceinline__ void set(int i, float x) {
        big[i] = to_tf32(x);
#if TF32_TERMS == 3
        small[i] = to_tf32(x - __uint_as_float(big[i]));
#endif
    }
    // Every element from f32 bits, as ldmatrix delivers them.
    __device__ __forceinline__ void set_bits(const u32 (&x)[N]) {
#pragma unroll
        for (int i = 0; i < N; ++i) set(i, __uint_as_float(x[i]));
    }
};

// c += a * b for one k step, as TF32_TERMS products chained in the tensor cores; b's two elements
// are b.big[j0], b.big[j0 + 1] (and the small ones at the same places).
template <int NB>
__device__ __forceinline__ void mma_chain(float (&c)[4], const Tf32Frag<4>& a, const Tf32Frag<NB>& b, int j0) {
#if TF32_TERMS == 3
    mma1688_tf32(c, a.big, b.small[j0], b.small[j0 + 1]);
    mma1688_tf32(c, a.small, b.big[j0], b.big[j0 + 1]);
#endif
    mma1688_tf32(c, a.big, b.big[j0], b.big[j0 + 1]);
}

// c += a * b for one k step, rounded to nearest into c (TF32_TERMS = 3: summed in a zero
// accumulator first; TF32_TERMS = 1: chained, as TF32's own error dwarfs the truncation).
template <int NB>
__device__ __forceinline__ void mma_step(float (&c)[4], const Tf32Frag<4>& a, const Tf32Frag<NB>& b, int j0) {
#if TF32_TERMS == 3
    float t[4] = {0.f, 0.f, 0.f, 0.f};
    mma_chain(t, a, b, j0);
#pragma unroll
    for (int e = 0; e < 4; ++e) c[e] += t[e];
#else
    mma_chain(c, a, b, j0);
#endif
}

// acc[16*MT x 8*NT] += A[16*MT x DPAD] * B[8*NT x DPAD]^T, with A rows at a_tile (row stride SROW,
// the warp's rows) and B rows at b_tile: S = Q K^T. In f32 units an ldmatrix 8x8 b16 matrix is
// 8 rows x 4 floats, lane (g, t) receiving element (g, t): the x4 loads below are A's fragment
// (rows 8 ((lane/8) % 2).., columns 4 (lane/16)..) and two 8-key B fragments (keys 8 (lane/16)..,
// columns 4 ((lane/8) % 2)..). The k loop stays rolled: unrolled, ptxas hoists every step's loads
// and splits to the top (255 registers and spills at D = 128).
template <int MT, int NT>
__device__ __forceinline__ void gemm_abt_mt(float (&acc)[MT][NT][4], const float* a_tile, const float* b_tile) {
    const int lane = threadIdx.x % 32;
    const u32 a_base = smem_addr(a_tile + ((lane % 8) + ((lane / 8) % 2) * 8) * SROW + (lane / 16) * 4);
    const u32 b_base = smem_addr(b_tile + ((lane % 8) + (lane / 16) * 8) * SROW + ((lane / 8) % 2) * 4);
#pragma unroll 1
    for (int kk = 0; kk < DPAD / 8; ++kk) {
        Tf32Frag<4> a[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            u32 x[4];
            ldmatrix_x4(x, a_base + (mt * 16 * SROW + kk * 8) * 4);
            a[mt].set_bits(x);
        }
#pragma unroll
        for (int nn = 0; nn < NT / 2; ++nn) {
            u32 x[4];
            ldmatrix_x4(x, b_base + (nn * 16 * SROW + kk * 8) * 4);
            Tf32Frag<4> b;
            b.set_bits(x);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_step(acc[mt][2 * nn], a[mt], b, 0);
                mma_step(acc[mt][2 * nn + 1], a[mt], b, 2);
            }
        }
    }
}

// acc[16*MT x 8*NO] += P[16*MT x 16*KT] * B[16*KT x (cols col0 .. col0 + 8*NO)], P a register tile
// in accumulator layout, B rows at b_tile: O += P V. Each k step (8 keys) takes its keys in the
// order 0, 2, 4, 6, 1, 3, 5, 7: then lane (g, t)'s accumulator values (g, 2t), (g, 2t+1),
// (g+8, 2t), (g+8, 2t+1) are its A fragment as they stand (a0 a2 a1 a3), with no shuffle, and its B
// elements are rows 2t and 2t+1 of column g (scalar loads; SROW = 4 mod 8 puts the four t's rows
// 8 banks apart: no conflict).
template <int MT, int KT, int NO>
__device__ __forceinline__ void gemm_pb_mt(float (&acc)[MT][NO][4], const float (&p)[MT][2 * KT][4],
                                           const float* b_tile, int col0) {
    const int lane = threadIdx.x % 32;
    const float* bp = b_tile + 2 * (lane % 4) * SROW + col0 + lane / 4;
    Tf32Frag<4> a[MT][2 * KT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kt = 0; kt < 2 * KT; ++kt) {
            a[mt][kt].set(0, p[mt][kt][0]);
            a[mt][kt].set(1, p[mt][kt][2]);
            a[mt][kt].set(2, p[mt][kt][1]);
            a[mt][kt].set(3, p[mt][kt][3]);
        }
#pragma unroll
    for (int no = 0; no < NO; ++no) {
        float t[MT][4] = {};  // this tile's products for columns 8 no.. (TF32_TERMS = 3)
#pragma unroll
        for (int kt = 0; kt < 2 * KT; ++kt) {
            Tf32Frag<2> v;
            v.set(0, bp[kt * 8 * SROW + no * 8]);
            v.set(1, bp[kt * 8 * SROW + SROW + no * 8]);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) mma_chain(TF32_TERMS == 3 ? t[mt] : acc[mt][no], a[mt][kt], v, 0);
        }
        if (TF32_TERMS == 3) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mt][no][e] += t[mt][e];
        }
    }
}

// The single-tile forms (MT = 1) on a warp's 16 rows, as tile.h's: S^T = K Q^T, dP^T = V dO^T
// (gemm_abt), dV += P^T dO, dK += dS^T Q, dQ += dS K (gemm_pb) in the backward kernels.
template <int NT>
__device__ __forceinline__ void gemm_abt(float (&acc)[NT][4], const float* a_tile, const float* b_tile) {
    gemm_abt_mt<1, NT>(reinterpret_cast<float (&)[1][NT][4]>(acc), a_tile, b_tile);
}
template <int KT, int NO>
__device__ __forceinline__ void gemm_pb(float (&acc)[NO][4], const float (&p)[2 * KT][4], const float* b_tile,
                                        int col0) {
    gemm_pb_mt<1, KT, NO>(reinterpret_cast<float (&)[1][NO][4]>(acc),
                          reinterpret_cast<const float (&)[1][2 * KT][4]>(p), b_tile, col0);
}

// acc[MT][NT] += A[16*MT x K] * B[K x 8*NT] for K = 16*KT, with A stored TRANSPOSED in shared
// memory (at[k][m], row stride at_stride = 4 mod 16, first column m_off) and B row-major (b[k][n],
// row stride SROW, first column n_off): dQ += dS K from the dS^T the dK/dV warps wrote (bwd_dkdv.cu,
// ATOMIC_DQ). Scalar loads (ldmatrix cannot transpose 32-bit elements), each k step's keys in
// gemm_pb_mt's order 0, 2, 4, 6, 1, 3, 5, 7: lane (g, t) reads A's keys 2t, 2t+1 of rows g, g + 8
// and B's keys 2t, 2t+1 of column g; both strides are 4 mod 16, so rows 2t sit 8 banks apart (no
// conflict). TF32_TERMS = 3: the products of each 32 keys (12 per output tile, half gemm_pb_mt's
// chain at 64 keys) are summed in a zero accumulator and added to acc in f32.
template <int MT, int NT, int KT>
__device__ __forceinline__ void gemm_atb(float (&acc)[MT][NT][4], const float* at, int at_stride, int m_off,
                                         const float* b_tile, int n_off) {
    constexpr int GROUP = 2 * KT < 4 ? 2 * KT : 4;  // k steps (8 keys) per chain
    static_assert((2 * KT) % GROUP == 0, "gemm_atb: K must be 16 keys or a multiple of 32");
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float* ap = at + 2 * t * at_stride + m_off + g;
    const float* bp = b_tile + 2 * t * SROW + n_off + g;
#pragma unroll 1
    for (int k0 = 0; k0 < 2 * KT; k0 += GROUP) {
        float c[MT][NT][4] = {};  // this group's products (TF32_TERMS = 3)
#pragma unroll
        for (int kk = k0; kk < k0 + GROUP; ++kk) {
            Tf32Frag<4> a[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const float* r = ap + kk * 8 * at_stride + mt * 16;
                a[mt].set(0, r[0]);
                a[mt].set(1, r[8]);
                a[mt].set(2, r[at_stride]);
                a[mt].set(3, r[at_stride + 8]);
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                Tf32Frag<2> b;
                b.set(0, bp[kk * 8 * SROW + nt * 8]);
                b.set(1, bp[kk * 8 * SROW + SROW + nt * 8]);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_chain(TF32_TERMS == 3 ? c[mt][nt] : acc[mt][nt], a[mt], b, 0);
            }
        }
        if (TF32_TERMS == 3) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[mt][nt][e] += c[mt][nt][e];
        }
    }
}
