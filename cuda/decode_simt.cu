// decode_simt.cu — decode on CUDA cores: every dtype (fp32 in true fp32), any head dim up to 256,
// plain or 4- / 8-bit quantized caches. The fp32 path, and the fallback of decode.cu (fp16 / bf16
// at head dims 64, 128, 256). The params, the block's work, the pipeline and the epilogue are
// decode.h's.
//
// A warp takes STATE_TILE = 4 query states and the blocks of KEYS = 4 keys wk, wk + WK, ... of
// each stage; its lanes split the head dim (lane l owns d = l + 32 i): per key a dot product per
// state, summed across the warp, then per block one online-softmax step and o += p v.
// Arithmetic is f32: quantized elements are dequantize_kv's values (see `dequantized`).

// params.h wants a compile-time head dim: this kernel reads D from its params, at most this bound.
#define HEAD_DIM 256
#include "decode.h"
#include "warp_reduce.h"

#if STATE_TILE != 4
#error "decode_simt.cu's warp tile is 4 query states"
#endif

#define KEYS 4                 // keys per softmax step
#define NI (HEAD_DIM / 32)     // head-dim elements per lane
#define STAGE_BYTES (32 * 1024)

FLASH_EXPORT_SMEM(STAGES * STAGE_BYTES)
static_assert(PARTIALS_BYTES(HEAD_DIM) <= STAGES * STAGE_BYTES, "the epilogue reuses the stages");

// A code's value as dequantize_kv stores it: scale * code + bias, product and sum each rounded,
// then rounded to elem_t (the cache the oracle reads; decode.cu's tensor-core kernel rounds to
// elem_t too).
__device__ __forceinline__ float dequantized(float code, float s, float b) {
    return to_float(from_float(__fadd_rn(__fmul_rn(s, code), b)));
}

// Element d of a row (shared memory) as f32; s, b: its group's scale and bias (quantized).
template <int BITS>
__device__ __forceinline__ float element(const unsigned char* row, int d, float s, float b) {
    if constexpr (BITS == 0) {
        return to_float(reinterpret_cast<const elem_t*>(row)[d]);
    } else if constexpr (BITS == 8) {
        return dequantized((float)row[d], s, b);
    } else {
        return dequantized((float)((row[d >> 1] >> ((d & 1) * 4)) & 15), s, b);
    }
}

// Element `index` of a copied scale row (decode.h's copy_scales) as f32.
__device__ __forceinline__ float scale_at(const unsigned char* row, int index) {
    if constexpr (sizeof(elem_t) == 4) {
        return reinterpret_cast<const float*>(row)[index];
    } else {
        return to_float(reinterpret_cast<const u16*>(row)[index]);
    }
}

template <int BITS>
__device__ __forceinline__ void row_elements_of(float (&x)[NI], const unsigned char* row, const unsigned char* sc,
                                                const unsigned char* bi, int half, int gs_shift, int d) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
        const int col = lane + 32 * i;
        float s = 0.f, b = 0.f;
        if constexpr (BITS != 0) {
            const int at = half + (col >> gs_shift);
            if (col < d) s = scale_at(sc, at), b = scale_at(bi, at);
        }
        x[i] = col < d ? element<BITS>(row, col, s, b) : 0.f;
    }
}

// This lane's elements of key row r of a stage (0 past D): rows at `rows` (stride srow), scale
// rows at sc / bi (stride sw words), the row's ScaleOffset `half`.
__device__ __forceinline__ void row_elements(float (&x)[NI], int bits, const unsigned char* rows, int srow,
                                             const unsigned char* sc, const unsigned char* bi, int sw, int r, int half,
                                             int gs_shift, int d) {
    const unsigned char* row = rows + r * srow;
    sc += r * 4 * sw;
    bi += r * 4 * sw;
    if (bits == 4) {
        row_elements_of<4>(x, row, sc, bi, half, gs_shift, d);
    } else if (bits == 8) {
        row_elements_of<8>(x, row, sc, bi, half, gs_shift, d);
    } else {
        row_elements_of<0>(x, row, sc, bi, half, gs_shift, d);
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS) flash_decode_simt(const DecodeParams p) {
    wait_for_prior_grid();  // launched dependent (decode.rs): the stream's previous kernel may write q or the caches
    unsigned char* smem = &shared_memory<unsigned char>();
    const DecodeWork w(p);
    const int d = p.head_dim, lane = threadIdx.x % 32;
    const int srow = round16(p.row_bytes);
    const StageLayout L = stage_layout(p, srow, srow, STAGE_BYTES, KEYS * NUM_WARPS);
    const bool active = w.state0 < p.states;
    const int wk_n = NUM_WARPS / p.warp_states;
    const int gk_shift = p.k_group_size == 64 ? 6 : 5, gv_shift = p.v_group_size == 64 ? 6 : 5;
    const ScaleOffset k_off(p, w, groups_k(p)), v_off(p, w, groups_v(p));

    float q[STATE_TILE][NI], o[STATE_TILE][NI], m[STATE_TILE], l[STATE_TILE];
    int2 vis[STATE_TILE];
#pragma unroll
    for (int s = 0; s < STATE_TILE; ++s) {
        const int st = w.state0 + s, i = w.row_of(p, st);
        const int h = w.kvh * p.group + (st < p.states ? st % p.group : 0);
        const elem_t* qrow = p.q + (((i64)w.b * p.seq_q + i) * p.heads + h) * d;
#pragma unroll
        for (int k = 0; k < NI; ++k) {
            const int col = lane + 32 * k;
            q[s][k] = st < p.states && col < d ? to_float(qrow[col]) : 0.f;
            o[s][k] = 0.f;
        }
        m[s] = NEG_INF;
        l[s] = 0.f;
        vis[s] = visible_keys(p, w, i);
    }

    pipeline<0>(smem, L, p, w, [&](const unsigned char* stage, int key0, int nkeys) {
        if (!active) return;
        for (int blk = w.wk; blk * KEYS < nkeys; blk += wk_n) {
            float sc[KEYS][STATE_TILE];
#pragma unroll
            for (int x = 0; x < KEYS; ++x) {
                const int r = blk * KEYS + x;
                float kx[NI];
                row_elements(kx, p.bits, stage, L.srow_k, stage + L.off_ks, stage + L.off_kb, L.sw_k, r,
                             k_off(key0 + r), gk_shift, d);
#pragma unroll
                for (int s = 0; s < STATE_TILE; ++s) {
                    float dot = 0.f;
#pragma unroll
                    for (int k = 0; k < NI; ++k) dot = fmaf(q[s][k], kx[k], dot);
                    dot = warp_sum(dot);
                    const int key = key0 + r;
                    const bool ok = r < nkeys && key >= vis[s].x && key <= vis[s].y;
                    sc[x][s] = ok ? score_log2(p, dot) : NEG_INF;
                }
            }
#pragma unroll
            for (int s = 0; s < STATE_TILE; ++s) {
                float mx = m[s];
#pragma unroll
                for (int x = 0; x < KEYS; ++x) mx = fmaxf(mx, sc[x][s]);
                const float m_use = mx == NEG_INF ? 0.f : mx;  // no -inf - -inf
                const float alpha = fast_exp2(m[s] - m_use);
                float sum = 0.f;
#pragma unroll
                for (int x = 0; x < KEYS; ++x) {
                    sc[x][s] = fast_exp2(sc[x][s] - m_use);
                    sum += sc[x][s];
                }
                l[s] = l[s] * alpha + sum;
                m[s] = mx;
#pragma unroll
                for (int k = 0; k < NI; ++k) o[s][k] *= alpha;
            }
#pragma unroll
            for (int x = 0; x < KEYS; ++x) {
                const int r = blk * KEYS + x;
                float vx[NI];
                row_elements(vx, p.bits, stage + L.off_v, L.srow_v, stage + L.off_vs, stage + L.off_vb, L.sw_v, r,
                             v_off(key0 + r), gv_shift, d);
#pragma unroll
                for (int s = 0; s < STATE_TILE; ++s) {
#pragma unroll
                    for (int k = 0; k < NI; ++k) o[s][k] = fmaf(sc[x][s], vx[k], o[s][k]);
                }
            }
        }
    });

    const Partials part(smem, d);
    const int row = (threadIdx.x / 32) * STATE_TILE;
#pragma unroll
    for (int s = 0; s < STATE_TILE; ++s) {
        if (lane == 0) part.m[row + s] = m[s], part.l[row + s] = l[s];
#pragma unroll
        for (int k = 0; k < NI; ++k) {
            const int col = lane + 32 * k;
            if (col < d) part.o[(row + s) * d + col] = o[s][k];
        }
    }
    __syncthreads();
    store_states(p, w, part);
}

