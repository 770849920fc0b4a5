// rotary.cu — rotary position embeddings (RoPE), forward and backward, every dtype: one pass over
// x, bandwidth-bound, no shared memory. Math, layouts and validation: native/flash-core/src/rotary.rs.
//
//   x, y       [B, S, H, D] elem_t   (row r = (b·S + s)·H + h holds one head's D elements)
//   cos, sin   [max_pos, R/2] f32
//   positions  [B, S] int32, or null: row (b, s) takes table row s + offset
//
//   y[a] = x[a]·cos − x[b]·sin·sign,  y[b] = x[b]·cos + x[a]·sin·sign  for each rotated pair (a, b),
//   sign = +1 (forward) or −1 (backward: the transpose, a rotation by −θ); dims R..D are copied.
//
// Defines: FLASH_DTYPE; NUM_WARPS; INTERLEAVED (0: pairs (i, i + R/2), GPT-NeoX; 1: pairs
// (2i, 2i + 1), GPT-J); VEC (elements per vector access: 1, 2, 4 or 8, at most 16 bytes of x — the
// host picks the widest that D, R/2 and the pointers' alignment allow).
//
// A row's work is `units` pieces: rot_units = R/2 / VEC rotation units (VEC pairs: 2·VEC elements
// in and out, VEC angles of each table) then (D − R) / VEC copy units. 2^tpr_shift consecutive
// threads share a row (the smallest power of two >= units, at most a block), so a block covers
// NUM_THREADS >> tpr_shift rows; grid ceil(rows / that).
#include "types.h"

#ifndef NUM_WARPS
#error "NUM_WARPS must be defined"
#endif
#ifndef INTERLEAVED
#define INTERLEAVED 0
#endif
#ifndef VEC
#define VEC 1
#endif
#if VEC != 1 && VEC != 2 && VEC != 4 && VEC != 8
#error "VEC must be 1, 2, 4 or 8"
#endif
#define NUM_THREADS (NUM_WARPS * 32)

FLASH_EXPORT_SMEM(0)  // no shared memory

// Mirrored field for field by native/flash-core/src/cuda/rotary.rs (#[repr(C)]).
struct RotaryParams {
    const elem_t* x;       // [B, S, H, D]   input (dy for the backward)
    elem_t* y;             // [B, S, H, D]   output (dx for the backward)
    const float* cos;      // [max_pos, R/2]
    const float* sin;      // [max_pos, R/2]
    const int* positions;  // [B, S], or null
    int rows;              // B·S·H (the host checks it fits an int)
    int heads;             // H
    int seq;               // S
    int head_dim;          // D
    int half;              // R/2
    int max_pos;           // rows of the tables
    int offset;            // without positions, row (b, s) takes s + offset
    int rot_units;         // R/2 / VEC
    int units;             // rot_units + (D − R) / VEC
    int tpr_shift;         // log2(threads per row)
    float sign;            // +1 forward, −1 backward
    int _pad;              // keeps sizeof a multiple of 8
};

// N elements of T as one aligned access (16 bytes at most per instruction; 32-byte vectors of
// the f32 tables are two).
template <typename T, int N>
struct alignas(sizeof(T) * N >= 16 ? 16 : sizeof(T) * N) Vec {
    T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load(const T* p) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
}
template <typename T, int N>
__device__ __forceinline__ void store(T* p, const Vec<T, N>& v) {
    *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// Turns the pair (a, b) by the angle whose cosine and (signed) sine are c, s.
__device__ __forceinline__ void turn(float& a, float& b, float c, float s) {
    const float a0 = a, b0 = b;
    a = a0 * c - b0 * s;
    b = b0 * c + a0 * s;
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS)
flash_rotary(const RotaryParams p) {
    const int row = blockIdx.x * (NUM_THREADS >> p.tpr_shift) + (threadIdx.x >> p.tpr_shift);
    if (row >= p.rows) return;
    const int tpr = 1 << p.tpr_shift;
    const int bs = row / p.heads;  // the (b, s) row: its position
    const int pos = p.positions ? p.positions[bs] : bs % p.seq + p.offset;
    // The host checks every position; one outside the tables would still read nothing outside
    // them (its rotated dims become NaN).
    const bool valid = (unsigned)pos < (unsigned)p.max_pos;
    const elem_t* __restrict__ x = p.x + (i64)row * p.head_dim;
    elem_t* __restrict__ y = p.y + (i64)row * p.head_dim;
    const i64 table_row = (i64)(valid ? pos : 0) * p.half;
    const float* __restrict__ cos_row = p.cos + table_row;
    const float* __restrict__ sin_row = p.sin + table_row;

    for (int u = threadIdx.x & (tpr - 1); u < p.units; u += tpr) {
        if (u >= p.rot_units) {  // pass-through dims
            const int k = 2 * p.half + (u - p.rot_units) * VEC;
            store(y + k, load<elem_t, VEC>(x + k));
            continue;
        }
        const int i = u * VEC;  // first angle of this unit
        float c[VEC], s[VEC];
        if (valid) {
            const Vec<float, VEC> cv = load<float, VEC>(cos_row + i), sv = load<float, VEC>(sin_row + i);
#pragma unroll
            for (int j = 0; j < VEC; ++j) c[j] = cv.v[j], s[j] = sv.v[j] * p.sign;
        } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) c[j] = s[j] = __int_as_float(0x7fc00000);
        }
#if INTERLEAVED
        // Elements 2i .. 2i + 2·VEC: pair j is (2j, 2j + 1) of the run.
        Vec<elem_t, VEC> h[2] = {load<elem_t, VEC>(x + 2 * i), load<elem_t, VEC>(x + 2 * i + VEC)};
        float e[2 * VEC];
#pragma unroll
        for (int k = 0; k < 2 * VEC; ++k) e[k] = to_float(h[k / VEC].v[k % VEC]);
#pragma unroll
        for (int j = 0; j < VEC; ++j) turn(e[2 * j], e[2 * j + 1], c[j], s[j]);
#pragma unroll
        for (int k = 0; k < 2 * VEC; ++k) h[k / VEC].v[k % VEC] = from_float(e[k]);
        store(y + 2 * i, h[0]);
        store(y + 2 * i + VEC, h[1]);
#else
        // Pair j is (i + j, i + j + R/2).
        Vec<elem_t, VEC> lo = load<elem_t, VEC>(x + i), hi = load<elem_t, VEC>(x + p.half + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            float a = to_float(lo.v[j]), b = to_float(hi.v[j]);
            turn(a, b, c[j], s[j]);
            lo.v[j] = from_float(a);
            hi.v[j] = from_float(b);
        }
        store(y + i, lo);
        store(y + p.half + i, hi);
#endif
    }
}
