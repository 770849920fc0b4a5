// merge.cu — attention over the union of disjoint key sets from each set's state: the public
// merge_states, and decode's splits (flash-core's quant.rs is the CPU's, with the same rule).
//
//   o_parts    [P, B, Sq, H, Dv]  elem_t, or f32 (parts_f32: decode's partial states)
//   lse_parts  [P, B, H, Sq]      f32, natural log
//   o          [B, Sq, H, Dv]     elem_t:  o = sum_p exp(lse_p - lse) o_p
//   lse        [B, H, Sq]         f32:     lse = log(sum_p exp(lse_p))
//
// Parts whose lse is -inf weigh nothing (their o is not read); a state no part saw gives o = 0,
// lse = -inf. One warp per state (b, i, h), grid-stride: its lanes find the max and the sum over
// the parts, then the columns (merge_columns: COLS per lane at a time; decode's f32 parts:
// merge_columns_f32x4, 16-byte loads, more in flight), the parts' weights broadcast from the lanes
// that computed them (for_weighted_parts). Decode's f32 parts past one warp's trip: a block per
// state (MERGE_BY_BLOCK, merge_state_block).
// Arithmetic is f32 (expf / logf, not the approximations).
#include "types.h"
#include "warp_reduce.h"
#include "grid_dep.h"

#ifndef NUM_WARPS
#error "NUM_WARPS must be defined"
#endif
#define NUM_THREADS (NUM_WARPS * 32)

FLASH_EXPORT_SMEM(0)  // no shared memory

// Mirrored field for field by native/flash-core/src/cuda/kv.rs (#[repr(C)]).
struct MergeParams {
    const void* o_parts;      // [P, B, Sq, H, Dv] elem_t, or f32 with parts_f32
    const float* lse_parts;   // [P, B, H, Sq]
    elem_t* o;                // [B, Sq, H, Dv]
    float* lse;               // [B, H, Sq]
    int parts, batch, seq_q, heads, dv, parts_f32;
};
static_assert(sizeof(MergeParams) == 4 * 8 + 6 * 4, "kv.rs mirrors this layout");

// MERGE_BY_BLOCK 1: the kernel takes a block per state (merge_state_block), which kv.rs launches for
// decode's f32 parts past one warp's trip; 0: a warp per state (every other merge). Two variants,
// so that neither path's registers bound the other's.
#ifndef MERGE_BY_BLOCK
#define MERGE_BY_BLOCK 0
#endif

// Columns a lane accumulates at once (per chunk of 32 * COLS columns): independent loads in flight.
#define COLS 8

// Part q's value at column c of state s.
__device__ __forceinline__ float part_value(const MergeParams& p, int q, i64 part_stride, i64 s, int c) {
    const i64 at = q * part_stride + s * p.dv + c;
    return p.parts_f32 ? reinterpret_cast<const float*>(p.o_parts)[at] : to_float(reinterpret_cast<const elem_t*>(p.o_parts)[at]);
}

// Calls add(q, w_q) for each part q of nonzero weight w_q = exp(lse_q - mx) (of state index stat):
// the weights of 32 parts at a time computed by the lanes and broadcast. Only for a state some part
// saw (mx finite). A part of weight 0 adds nothing, whatever its o holds (not even NaN).
template <int UNROLL, typename Add>
__device__ __forceinline__ void for_weighted_parts(const MergeParams& p, i64 stat, i64 stat_stride, float mx, Add&& add) {
    const int lane = threadIdx.x % 32;
    for (int q0 = 0; q0 < p.parts; q0 += 32) {
        const float mine = q0 + lane < p.parts ? expf(p.lse_parts[(q0 + lane) * stat_stride + stat] - mx) : 0.f;
        const int n = min(32, p.parts - q0);
#pragma unroll UNROLL
        for (int q = 0; q < n; ++q) {
            const float wq = __shfl_sync(0xffffffffu, mine, q);
            if (wq != 0.f) add(q0 + q, wq);
        }
    }
}

// o's columns c .. c + 3 of state s: acc / total, or 0 for a state no part saw (total 0).
__device__ __forceinline__ void store_columns4(const MergeParams& p, i64 s, int c, float4 acc, float total) {
    const bool seen = total > 0.f;
    elem_t* out = p.o + s * p.dv + c;
    out[0] = from_float(seen ? acc.x / total : 0.f);
    out[1] = from_float(seen ? acc.y / total : 0.f);
    out[2] = from_float(seen ? acc.z / total : 0.f);
    out[3] = from_float(seen ? acc.w / total : 0.f);
}

// The columns of state s for decode's splits (f32 parts, Dv a multiple of 4; mx, total: the parts'
// max lse and sum of weights): each lane takes four columns of every part (16-byte loads, 8 parts
// in flight).
__device__ __forceinline__ void merge_columns_f32x4(const MergeParams& p, i64 s, i64 stat, i64 part_stride, i64 stat_stride,
                                                    float mx, float total) {
    const int lane = threadIdx.x % 32;
    const bool seen = total > 0.f;
    const float* parts = reinterpret_cast<const float*>(p.o_parts) + s * p.dv;
    for (int c = 4 * lane; c < p.dv; c += 128) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (seen) {
            for_weighted_parts<8>(p, stat, stat_stride, mx, [&](int q, float wq) {
                const float4 x = *reinterpret_cast<const float4*>(parts + q * part_stride + c);
                acc.x += wq * x.x, acc.y += wq * x.y, acc.z += wq * x.z, acc.w += wq * x.w;
            });
        }
        store_columns4(p, s, c, acc, total);
    }
}

// Decode's f32 parts, at most 32 of them and Dv a multiple of 4: state s whole, in about one memory
// round trip. Lane j loads part j's lse while every lane loads its four columns of the first
// MERGE_CHUNK parts (none of those loads waits for a weight); the max, the weights and their sum
// come from registers (shuffles), and a part of weight 0 adds nothing by a select (its o is read,
// never used: decode's parts are finite, and a select keeps even NaN out). Returns the state's lse.
// (kv.rs's MERGE_CHUNK is this, which a unit test checks; decode's splits stay within one trip of
// merge_state_block, MERGE_BLOCK_PARTS, where the 4-bit kernel would take more.)
#define MERGE_CHUNK 16

// This lane's four columns at c of parts q0 .. q0 + MERGE_CHUNK - 1 (zeros past the parts or past Dv).
__device__ __forceinline__ void load_part_columns(float4 (&x)[MERGE_CHUNK], const MergeParams& p, const float* parts, i64 part_stride,
                                                  int q0, int c) {
#pragma unroll
    for (int j = 0; j < MERGE_CHUNK; ++j)
        x[j] = c < p.dv && q0 + j < p.parts ? *reinterpret_cast<const float4*>(parts + (q0 + j) * part_stride + c)
                                            : make_float4(0.f, 0.f, 0.f, 0.f);
}

__device__ __forceinline__ float merge_state_f32x4(const MergeParams& p, i64 s, i64 stat, i64 part_stride, i64 stat_stride) {
    const int lane = threadIdx.x % 32;
    const float neg_inf = __int_as_float(0xff800000);
    const float* parts = reinterpret_cast<const float*>(p.o_parts) + s * p.dv;
    const float mine = lane < p.parts ? p.lse_parts[lane * stat_stride + stat] : neg_inf;
    float4 x[MERGE_CHUNK];
    load_part_columns(x, p, parts, part_stride, 0, 4 * lane);
    const float mx = warp_max(mine);
    const float w = mx == neg_inf ? 0.f : expf(mine - mx);  // lanes past the parts: exp(-inf) = 0
    const float total = warp_sum(w);
    const bool seen = total > 0.f;
    for (int c = 4 * lane; c - 4 * lane < p.dv; c += 128) {  // passes of 128 columns, every lane in each
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int q0 = 0; q0 < p.parts; q0 += MERGE_CHUNK) {
            if (q0 > 0 || c >= 128) load_part_columns(x, p, parts, part_stride, q0, c);
#pragma unroll
            for (int j = 0; j < MERGE_CHUNK; ++j) {
                const float wq = __shfl_sync(0xffffffffu, w, (q0 + j) & 31);
                const bool used = wq != 0.f;  // 0 past the parts
                acc.x += used ? wq * x[j].x : 0.f, acc.y += used ? wq * x[j].y : 0.f;
                acc.z += used ? wq * x[j].z : 0.f, acc.w += used ? wq * x[j].w : 0.f;
            }
        }
        if (c < p.dv) store_columns4(p, s, c, acc, total);
    }
    return seen ? mx + logf(total) : neg_inf;
}

// Decode's f32 parts, MERGE_CHUNK < P <= MERGE_BLOCK_PARTS and Dv a multiple of 4: state s by a whole
// block, in about one memory round trip where merge_state_f32x4 takes one per MERGE_CHUNK parts (and
// past 32 parts the general path three). Warp k takes parts MERGE_CHUNK k .. + MERGE_CHUNK - 1: its
// lanes load their four columns of them while each lane also loads the lse of parts lane, lane +
// 32, ... (every warp finds the max and the total itself); the warps' weighted sums meet in shared
// memory, where warp 0 adds them in order. For few states with many parts (a long row split for a
// small batch: 32 warps merged 32 parts each at B = 1), so that more of the GPU takes the merge.
// Returns the state's lse.
#define MERGE_BLOCK_PARTS (NUM_WARPS * MERGE_CHUNK)

__device__ __forceinline__ float merge_state_block(const MergeParams& p, i64 s, i64 stat, i64 part_stride, i64 stat_stride) {
    __shared__ float4 partial[NUM_WARPS][32];  // each warp's sums of its lanes' four columns
    constexpr int LSE_PER_LANE = MERGE_BLOCK_PARTS / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, q0 = warp * MERGE_CHUNK;
    const float neg_inf = __int_as_float(0xff800000);
    const float* parts = reinterpret_cast<const float*>(p.o_parts) + s * p.dv;
    float l[LSE_PER_LANE];
    float mx = neg_inf;
#pragma unroll
    for (int k = 0; k < LSE_PER_LANE; ++k) {
        const int q = lane + 32 * k;
        l[k] = q < p.parts ? p.lse_parts[q * stat_stride + stat] : neg_inf;
        mx = fmaxf(mx, l[k]);
    }
    float4 x[MERGE_CHUNK];
    load_part_columns(x, p, parts, part_stride, q0, 4 * lane);
    mx = warp_max(mx);
    float total = 0.f, mine = 0.f;  // mine: the weight of part 32 (q0 / 32) + lane (the warp's parts lie in that row of 32)
#pragma unroll
    for (int k = 0; k < LSE_PER_LANE; ++k) {
        const float w = mx == neg_inf ? 0.f : expf(l[k] - mx);  // lanes past the parts: exp(-inf) = 0
        total += w;
        mine = k == q0 / 32 ? w : mine;
    }
    total = warp_sum(total);
    for (int c = 4 * lane; c - 4 * lane < p.dv; c += 128) {  // passes of 128 columns, every lane in each
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c >= 128) load_part_columns(x, p, parts, part_stride, q0, c);
#pragma unroll
        for (int j = 0; j < MERGE_CHUNK; ++j) {
            const float wq = __shfl_sync(0xffffffffu, mine, (q0 + j) & 31);
            const bool used = q0 + j < p.parts && wq != 0.f;
            acc.x += used ? wq * x[j].x : 0.f, acc.y += used ? wq * x[j].y : 0.f;
            acc.z += used ? wq * x[j].z : 0.f, acc.w += used ? wq * x[j].w : 0.f;
        }
        partial[warp][lane] = acc;
        __syncthreads();
        if (warp == 0) {
            float4 sum = partial[0][lane];
            for (int k = 1; k < NUM_WARPS && k * MERGE_CHUNK < p.parts; ++k) {
                const float4 y = partial[k][lane];
                sum.x += y.x, sum.y += y.y, sum.z += y.z, sum.w += y.w;
            }
            if (c < p.dv) store_columns4(p, s, c, sum, total);
        }
        __syncthreads();  // partial is rewritten by the next pass (or state)
    }
    return total > 0.f ? mx + logf(total) : neg_inf;
}

// The columns of state s in general (any Dv, elem_t or f32 parts): COLS per lane at a time, 32 apart.
__device__ __forceinline__ void merge_columns(const MergeParams& p, i64 s, i64 stat, i64 part_stride, i64 stat_stride,
                                              float mx, float total) {
    const int lane = threadIdx.x % 32;
    const bool seen = total > 0.f;
    for (int c0 = 0; c0 < p.dv; c0 += 32 * COLS) {
        float acc[COLS];
#pragma unroll
        for (int j = 0; j < COLS; ++j) acc[j] = 0.f;
        if (seen) {
            for_weighted_parts<2>(p, stat, stat_stride, mx, [&](int q, float wq) {
#pragma unroll
                for (int j = 0; j < COLS; ++j) {
                    const int c = c0 + lane + 32 * j;
                    if (c < p.dv) acc[j] += wq * part_value(p, q, part_stride, s, c);
                }
            });
        }
#pragma unroll
        for (int j = 0; j < COLS; ++j) {
            const int c = c0 + lane + 32 * j;
            if (c < p.dv) p.o[s * p.dv + c] = from_float(seen ? acc[j] / total : 0.f);
        }
    }
}

// The [B, H, Sq] index (lse's) of state s, which counts (b, i, h) in o's order.
__device__ __forceinline__ i64 stat_of(const MergeParams& p, i64 s) {
    const int h = (int)(s % p.heads);
    const i64 bi = s / p.heads;  // b * Sq + i
    const int i = (int)(bi % p.seq_q);
    const i64 b = bi / p.seq_q;
    return (b * p.heads + h) * p.seq_q + i;
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) flash_merge_states(const MergeParams p) {
    wait_for_prior_grid();  // launched dependent on the kernel that wrote the parts (kv.rs)
    const i64 states = (i64)p.batch * p.seq_q * p.heads;  // (b, i, h) in o's order
    const i64 part_stride = states * p.dv;                  // elements between parts of o_parts
    const i64 stat_stride = states;                         // between parts of lse_parts
#if MERGE_BY_BLOCK
    for (i64 s = blockIdx.x; s < states; s += gridDim.x) {
        const i64 stat = stat_of(p, s);
        const float lse = merge_state_block(p, s, stat, part_stride, stat_stride);
        if (threadIdx.x == 0) p.lse[stat] = lse;
    }
#else
    const int lane = threadIdx.x % 32;
    const float neg_inf = __int_as_float(0xff800000);
    const i64 warps = (i64)gridDim.x * NUM_WARPS;
    for (i64 s = (i64)blockIdx.x * NUM_WARPS + threadIdx.x / 32; s < states; s += warps) {
        const i64 stat = stat_of(p, s);
        if (p.parts_f32 && p.dv % 4 == 0 && p.parts <= 32) {
            const float lse = merge_state_f32x4(p, s, stat, part_stride, stat_stride);
            if (lane == 0) p.lse[stat] = lse;
            continue;
        }
        float mx = neg_inf;
        for (int q = lane; q < p.parts; q += 32) mx = fmaxf(mx, p.lse_parts[q * stat_stride + stat]);
        mx = warp_max(mx);
        float total = 0.f;
        if (mx != neg_inf) {
            for (int q = lane; q < p.parts; q += 32) total += expf(p.lse_parts[q * stat_stride + stat] - mx);
            total = warp_sum(total);
        }
        if (p.parts_f32 && p.dv % 4 == 0) {
            merge_columns_f32x4(p, s, stat, part_stride, stat_stride, mx, total);
        } else {
            merge_columns(p, s, stat, part_stride, stat_stride, mx, total);
        }
        const bool seen = total > 0.f;
        if (lane == 0) p.lse[stat] = seen ? mx + logf(total) : neg_inf;
    }
#endif
}
