// sm90_f16_parts.h — f32 operands as scaled fp16 parts for the Hopper f32 kernels on fp16 tensor
// cores (fwd_sm90_f32_f16.cu, bwd_dq_sm90_f32_f16.cu, bwd_dkdv_sm90_f32_f16.cu): a tile's values x
// times the power of two 2^e that brings its largest |x| into [2^14, 2^15), as big = fp16(x 2^e)
// and (TERMS = 2, "exact") small = fp16(x 2^e - big), 11 + 11 significant bits as split TF32 (sm90_f32.h), both parts normal
// fp16 for elements down to 2^-17 of the tile's largest (below, their error stays under 2^-39 of
// it: absolute, which is what the sums feel). Tiles are fwd_sm90.cu's: [D / 64][rows][64] fp16,
// 128-byte rows swizzled (desc_sw128), read K-major or (a B operand contracting over the rows)
// MN-major. Products: wgmma m64nNk16 .f16 (wgmma.h's Wgmma<N>, FLASH_DTYPE = 2 reads f16).
#pragma once
#include "sm90_f32.h"

#define H_PART_BYTES(rows) ((rows) * HEAD_DIM * 2)  // one fp16 part of a [rows][D] tile
#define SCALE_BARRIER 1                             // the producer's named barrier (tile_exponent)

__device__ __forceinline__ int ld_shared_s32(u32 addr) {
    int v;
    asm volatile("ld.shared.s32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void st_shared_v2(u32 addr, u32 a, u32 b) {
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(addr), "r"(a), "r"(b) : "memory");
}

// 16 bytes of global memory (an input no kernel writes): ld.global even where the compiler has lost
// the pointer's state space (a pointer chosen among tensors: a generic LD otherwise).
__device__ __forceinline__ float4 ld_global_v4(const float* at) {
    float4 x;
    asm("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "l"(at));
    return x;
}

// 2^e as f32 (e in [-126, 127]).
__device__ __forceinline__ float exp2i(int e) { return __int_as_float((127 + e) << 23); }

// The exponent e that brings a largest |x| (its f32 bits) into [2^14, 2^15), within [-126, 126]:
// zeros take 2^126 (harmless), inf / NaN 2^-114 (they stay non-finite).
__device__ __forceinline__ int scale_exponent(u32 bits) { return min(max(14 - ((int)(bits >> 23) - 127), -126), 126); }

// A scores' scale times unscaling powers of two, kept > 0: an underflowing product of tiny q and k
// scores 0 instead of NaN on masked -inf (-inf x 0).
__device__ __forceinline__ float positive_scale(float x) { return fmaxf(x, 1.17549435e-38f); }

// Two f32 as fp16 (round to nearest), lo in the low half; and back.
__device__ __forceinline__ u32 f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float2 f16x2_to_f32(u32 x) {
    float lo, hi;
    asm("{ .reg .f16 a, b; mov.b32 {a, b}, %2; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b; }" : "=f"(lo), "=f"(hi) : "r"(x));
    return make_float2(lo, hi);
}
// The parts of two scaled values: big = f16(x), small = f16(x - big).
__device__ __forceinline__ void split_f16x2(float x0, float x1, u32& big, u32& small) {
    big = f16x2(x0, x1);
    const float2 b = f16x2_to_f32(big);
    small = f16x2(x0 - b.x, x1 - b.y);
}

// ---- the producer ---------------------------------------------------------------------------------
// The exponent e that brings the tile's largest |x| (this thread's: `bits`, |x|'s f32 bits, which
// order as the values do) into [2^14, 2^15): a max over the producer warpgroup through shared memory
// (`exchange`: 2 slots of 4 words, slot `slot` this time, alternating so that a fast warp's next
// write cannot meet a slow warp's read; named barrier SCALE_BARRIER): scale_exponent of it.
__device__ __forceinline__ int tile_exponent(u32 bits, u32 exchange, int& slot) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, o));
    const int warp = (threadIdx.x / 32) % 4;
    const u32 xchg = exchange + 16 * slot;
    if (threadIdx.x % 32 == 0) st_shared_u32(xchg + 4 * warp, bits);
    named_sync(SCALE_BARRIER, PRODUCER_THREADS);
#pragma unroll
    for (int w = 0; w < 4; ++w) bits = max(bits, (u32)ld_shared_s32(xchg + 4 * w));
    slot ^= 1;
    return scale_exponent(bits);
}

// A [R][D] f32 tile held by the producer (RowTile's chunks: thread i the 16-byte chunks i, i + 128,
// ...), stored as its two scaled fp16 parts.
template <int R>
struct HalfTile {
    RowTile<R> t;

    static constexpr int LANES_PER_ROW = HEAD_DIM / 4, ROWS_PER_STEP = PRODUCER_THREADS / LANES_PER_ROW;

    // This thread's walk over its chunks of rows r0.. of src with one running pointer (chunk i: row
    // r_first + ROWS_PER_STEP i of the thread's column; its own addresses per chunk, all hoisted,
    // spilled the producer at D = 128): `at` advances by `step`, chunk i is a row of the tensor
    // while ROWS_PER_STEP i < valid.
    struct Walk {
        const float* at;
        i64 step;
        int valid;  // rows of this thread's column left, from r_first
        __device__ __forceinline__ Walk(const float* src, i64 stride, int r0, int nrows) {
            const int tid = threadIdx.x % PRODUCER_THREADS, r_first = tid / LANES_PER_ROW;
            at = src + (i64)(r0 + r_first) * stride + 4 * (tid % LANES_PER_ROW);
            step = ROWS_PER_STEP * stride;
            valid = nrows - r0 - r_first;
        }
    };

    // RowTile::load's chunks (rows >= nrows as zeros) by a Walk.
    __device__ __forceinline__ void load(const float* src, i64 stride, int r0, int nrows) {
        Walk w(src, stride, r0, nrows);
#pragma unroll
        for (int i = 0; i < RowTile<R>::CHUNKS; ++i) {
            t.x[i] = ROWS_PER_STEP * i < w.valid ? ld_global_v4(w.at) : make_float4(0.f, 0.f, 0.f, 0.f);
            w.at += w.step;
        }
    }

    // The same chunks, copied asynchronously (cp.async, one group per call site's commit) into this
    // thread's own 16-byte slots of a raw [R][D] f32 buffer at `raw` (slot i at raw + 16 (tid +
    // PRODUCER_THREADS i): conflict-free), rows >= nrows as zeros; read back by the same thread
    // (`read`), so no barrier sits between the two.
    static __device__ __forceinline__ void copy_async(u32 raw, const float* src, i64 stride, int r0, int nrows) {
        Walk w(src, stride, r0, nrows);
        const u32 slot = raw + 16 * (threadIdx.x % PRODUCER_THREADS);
#pragma unroll
        for (int i = 0; i < RowTile<R>::CHUNKS; ++i) {
            // A row past the end copies nothing (src-size 0: no read) and zero-fills.
            cp_async16_u32(slot + 16 * PRODUCER_THREADS * i, w.at, ROWS_PER_STEP * i < w.valid);
            w.at += w.step;
        }
    }
    __device__ __forceinline__ void read(u32 raw) {
        const u32 slot = raw + 16 * (threadIdx.x % PRODUCER_THREADS);
#pragma unroll
        for (int i = 0; i < RowTile<R>::CHUNKS; ++i) {
            float4& x = t.x[i];
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "r"(slot + 16 * PRODUCER_THREADS * i) : "memory");
        }
    }

    // The bits of this thread's largest |x| (f32 max with |.| operands: one instruction per element;
    // NaNs drop out of the max, and stay NaN under any scale).
    __device__ __forceinline__ u32 max_bits() const {
        float m = 0.f;
#pragma unroll
        for (int i = 0; i < RowTile<R>::CHUNKS; ++i) {
            m = fmaxf(m, fmaxf(fabsf(t.x[i].x), fabsf(t.x[i].y)));
            m = fmaxf(m, fmaxf(fabsf(t.x[i].z), fabsf(t.x[i].w)));
        }
        return __float_as_uint(m);
    }
    // Into the parts at `base` (parts `part` bytes apart) of a [ROWS][D] tile as rows row_off..,
    // scaled by 2^e.
    template <int ROWS>
    __device__ __forceinline__ void store(u32 base, int row_off, int e) const {
        // Chunk i: row row_off + tid / LANES_PER_ROW + ROWS_PER_STEP i, columns 4 (tid % LANES_PER_ROW)..;
        // the swizzle (row & 7) repeats every PERIOD chunks (8 rows), so chunk i's address is that of
        // chunk i % PERIOD plus an immediate.
        constexpr int PERIOD = ROWS_PER_STEP >= 8 ? 1 : 8 / ROWS_PER_STEP;
        static_assert(ROWS_PER_STEP * PERIOD % 8 == 0, "HalfTile::store: the swizzle's period");
        const int tid = threadIdx.x % PRODUCER_THREADS, col = 4 * (tid % LANES_PER_ROW);
        const int within = col % 64;  // 8-byte half (within / 4) % 2 of 16-byte chunk within / 8
        u32 at[PERIOD];
#pragma unroll
        for (int i = 0; i < PERIOD; ++i) {
            const int r = row_off + tid / LANES_PER_ROW + ROWS_PER_STEP * i;
            at[i] = base + (col / 64) * CB_BYTES(ROWS) + r * 128 + (((within / 8) ^ (r & 7)) << 4) + ((within / 4) % 2) * 8;
        }
        const float f = exp2i(e);
#pragma unroll
        for (int i = 0; i < RowTile<R>::CHUNKS; ++i) {
            const u32 a = at[i % PERIOD] + (i / PERIOD) * ROWS_PER_STEP * PERIOD * 128;
#if TERMS == 2
            u32 b01, s01, b23, s23;
            split_f16x2(t.x[i].x * f, t.x[i].y * f, b01, s01);
            split_f16x2(t.x[i].z * f, t.x[i].w * f, b23, s23);
            st_shared_v2(a, b01, b23);
            st_shared_v2(a + H_PART_BYTES(ROWS), s01, s23);
#else
            st_shared_v2(a, f16x2(t.x[i].x * f, t.x[i].y * f), f16x2(t.x[i].z * f, t.x[i].w * f));
#endif
        }
    }
};

// ---- the producer's raw ring ------------------------------------------------------------------------
// f32 tiles copied raw (cp.async) into a ring of DEPTH [ROWS][D] buffers, tile t into buffer
// t % DEPTH, DEPTH tiles ahead of its conversion (HalfTile: exponent, parts), so that the copies'
// latency hides under the conversions before them. Each thread reads back only its own chunks
// (HalfTile::copy_async / read): no barrier between copy and read, nor before a refill: tile t + DEPTH
// goes into t's buffer after the thread's reads of t have returned (the tile's max used them). DEPTH
// 0: no ring, each tile loaded into registers when it is taken.
template <int ROWS, int DEPTH>
struct RawRing {
    static constexpr int depth = DEPTH;
    static constexpr u32 TILE_BYTES = ROWS * HEAD_DIM * 4;
    static constexpr u32 BYTES = DEPTH * TILE_BYTES;
    u32 base;
    // Tile t's buffer (DEPTH 0 has none: the modulus only stays nonzero).
    __device__ __forceinline__ u32 buffer(int t) const { return base + (t % (DEPTH > 0 ? DEPTH : 1)) * TILE_BYTES; }
    // Tile t's rows r0.. of src (rows >= nrows as zeros; `any` false: past the last tile, nothing).
    // One commit group per call either way, as cp_async_wait counts groups.
    __device__ __forceinline__ void copy(int t, bool any, const float* src, i64 stride, int r0, int nrows) const {
        if (DEPTH == 0) return;
        if (any) HalfTile<ROWS>::copy_async(buffer(t), src, stride, r0, nrows);
        cp_async_commit();
    }
    // Tile t (the same source as its copy) into x, once its copy and every earlier one has landed.
    __device__ __forceinline__ void take(int t, HalfTile<ROWS>& x, const float* src, i64 stride, int r0, int nrows) const {
        if (DEPTH == 0) {
            x.load(src, stride, r0, nrows);
        } else {
            cp_async_wait<(DEPTH > 0 ? DEPTH - 1 : 0)>();
            x.read(buffer(t));
        }
    }
};

// Descriptor of k-step kk (16 elements) of a K-major [rows][D] fp16 part at `part`.
__device__ __forceinline__ u64 hdesc(u32 part, int rows, int kk) {
    return desc_sw128(part + (kk / 4) * CB_BYTES(rows) + (kk % 4) * 32, 0);
}

// An accumulator tile [64 x 16 KT] (f32, 8-column blocks) as KT A fragments of 16 columns, its
// values scaled by f0 (row g of the warp's 16) and f1 (row g + 8): the big part and (TERMS = 2) the
// small one. The accumulator's pairs are the fp16 A fragment's: (row g, k 2t..), (g + 8, 2t..),
// (g, 2t + 8..), (g + 8, 2t + 8..).
template <int KT>
struct HFrag {
    u32 big[KT][4];
#if TERMS == 2
    u32 small[KT][4];
#endif
    __device__ __forceinline__ void set(const float (&s)[2 * KT][4], float f0, float f1) {
#pragma unroll
        for (int kk = 0; kk < KT; ++kk)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#if TERMS == 2
                split_f16x2(s[2 * kk + h][0] * f0, s[2 * kk + h][1] * f0, big[kk][2 * h], small[kk][2 * h]);
                split_f16x2(s[2 * kk + h][2] * f1, s[2 * kk + h][3] * f1, big[kk][2 * h + 1], small[kk][2 * h + 1]);
#else
                big[kk][2 * h] = f16x2(s[2 * kk + h][0] * f0, s[2 * kk + h][1] * f0);
                big[kk][2 * h + 1] = f16x2(s[2 * kk + h][2] * f1, s[2 * kk + h][3] * f1);
#endif
            }
    }
};

// The exponent that brings the largest |x| of an accumulator row (this lane's share `m`; a row's
// values lie on the 4 lanes of a quad) into [2^14, 2^15), scale_exponent of it.
__device__ __forceinline__ int row_exponent(float m) {
    u32 bits = __float_as_uint(m) & 0x7fffffffu;
    bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, 1));
    bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, 2));
    return scale_exponent(bits);
}

// d = A B^T over D (ss): A's 64 rows at a (a K-major [a_rows][D] tile's parts a_part apart, from a
// row of it), B's N rows at b (parts b_part apart); the correction products first (their sums are
// small), then big x big, chained from zero. Not fenced, committed or waited for.
template <int N>
__device__ __forceinline__ void h_abt(float (&d)[N / 8][4], u32 a, u32 a_part, int a_rows, u32 b, u32 b_part) {
    constexpr int KS = HEAD_DIM / 16;
#if TERMS == 2
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) Wgmma<N>::ss(d, hdesc(a, a_rows, kk), hdesc(b + b_part, N, kk), kk > 0);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) Wgmma<N>::ss(d, hdesc(a + a_part, a_rows, kk), hdesc(b, N, kk), 1);
#else
    (void)a_part, (void)b_part;
#endif
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) Wgmma<N>::ss(d, hdesc(a, a_rows, kk), hdesc(b, N, kk), TERMS == 2 || kk > 0);
}

// ot = A B for the 64 output columns of column block cb, fresh (rs): A's parts in registers (16 KT
// contraction rows), B a [16 KT][D] tile at b (parts b_part apart) read MN-major. Fenced and
// committed, not waited for.
template <int KT>
__device__ __forceinline__ void h_ab_slice(float (&ot)[8][4], const HFrag<KT>& a, u32 b, u32 b_part, int cb) {
    const u32 at = b + cb * CB_BYTES(16 * KT);
    wgmma_fence();
#if TERMS == 2
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) Wgmma<64>::rs(ot, a.big[kk], desc_sw128(at + b_part + kk * 16 * 128, CB_BYTES(16 * KT)), kk > 0);
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) Wgmma<64>::rs(ot, a.small[kk], desc_sw128(at + kk * 16 * 128, CB_BYTES(16 * KT)), 1);
#else
    (void)b_part;
#endif
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) Wgmma<64>::rs(ot, a.big[kk], desc_sw128(at + kk * 16 * 128, CB_BYTES(16 * KT)), TERMS == 2 || kk > 0);
    wgmma_commit();
}

// d[i][e] += ot[i][e] 2^-(e_row(e) + e) for the 8 column blocks of a slice from d's block i0 (rows g
// and g + 8 of the warp's 16: e0, e1). One FMA an element with the combined power of two when every
// lane's is a normal f32 (2^-k, -127 <= k <= 126); else (the ends of the range, e.g. an all-zero row,
// whose exponent is clamped to 126) the two factors in turn, so that neither alone under- or
// overflows. The same bits either way wherever ot 2^-e_row is a normal f32.
__device__ __forceinline__ void add_slice(float (&d)[HEAD_DIM / 8][4], const float (&ot)[8][4], int i0, int e0, int e1, int e) {
    const int k0 = e0 + e, k1 = e1 + e;
    if (__all_sync(0xffffffffu, k0 >= -127 && k0 <= 126 && k1 >= -127 && k1 <= 126)) {
        const float g0 = exp2i(-k0), g1 = exp2i(-k1);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float* x = d[i0 + i];
            x[0] = fmaf(ot[i][0], g0, x[0]), x[1] = fmaf(ot[i][1], g0, x[1]);
            x[2] = fmaf(ot[i][2], g1, x[2]), x[3] = fmaf(ot[i][3], g1, x[3]);
        }
    } else {
        const float f0 = exp2i(-e0), f1 = exp2i(-e1), f = exp2i(-e);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float* x = d[i0 + i];
            x[0] = fmaf(ot[i][0] * f0, f, x[0]), x[1] = fmaf(ot[i][1] * f0, f, x[1]);
            x[2] = fmaf(ot[i][2] * f1, f, x[2]), x[3] = fmaf(ot[i][3] * f1, f, x[3]);
        }
    }
}

// d += A B (A's parts in registers, KT 16-row contraction tiles; B the [16 KT][D] tile at b), one
// 64-column slice at a time in a fresh accumulator, each added by add_slice with the row exponents
// e0, e1 and e. TOGETHER: every slice's product issued before the first is added (slice 1's under
// slice 0's FMAs), where the kernel's registers allow the second accumulator.
template <int KT, bool TOGETHER>
__device__ __forceinline__ void add_sliced_product(float (&d)[HEAD_DIM / 8][4], const HFrag<KT>& a, u32 b, int e0, int e1,
                                                   int e) {
    constexpr int SLICES = HEAD_DIM / 64;
    if (TOGETHER) {
        float ot[SLICES][8][4];
#pragma unroll
        for (int cb = 0; cb < SLICES; ++cb) h_ab_slice<KT>(ot[cb], a, b, H_PART_BYTES(16 * KT), cb);
#pragma unroll
        for (int cb = 0; cb < SLICES; ++cb) {
            if (cb == 0) wgmma_wait<SLICES - 1>();
            else wgmma_wait<0>();
            fence_regs(ot[cb]);
            add_slice(d, ot[cb], 8 * cb, e0, e1, e);
        }
    } else {
#pragma unroll
        for (int cb = 0; cb < SLICES; ++cb) {
            float ot[8][4];
            h_ab_slice<KT>(ot, a, b, H_PART_BYTES(16 * KT), cb);
            wgmma_wait<0>();
            fence_regs(ot);
            add_slice(d, ot, 8 * cb, e0, e1, e);
        }
    }
}
