// params.h — the one parameter struct shared by every kernel, and the compile-time configuration.
//
// Every kernel is compiled by NVRTC with its configuration baked in as -D defines (no CUDA headers are
// needed, so NVRTC runs with no include path):
//   FLASH_DTYPE   0 = fp16, 1 = bf16, 2 = fp32 (storage type of q, k, v, o, do, dq, dk, dv)
//   HEAD_DIM      D, a multiple of 8, at most 256
//   IS_CAUSAL     1: query i sees keys j <= i + (Sk - Sq) (bottom-right alignment)
//   GQA_GROUP     H / Hkv, query heads per key/value head
//   BLOCK_M       query rows per tile, BLOCK_N key rows per tile
//   NUM_WARPS     warps per block
//   EVEN_N        1 when Sk is a multiple of BLOCK_N: drops the ragged-tile mask. Query rows need no
//                 such flag: rows past Sq are zero-filled on load and never stored, at no branch
//   MIN_BLOCKS    blocks per SM the register allocation must allow (default 1)
//   M_TILES       (forward only) 16-row query tiles per warp, 1 or 2 (default 1)
//   D_SPLIT       (dK/dV kernel only) warps that share one 16-row key slice, each owning HEAD_DIM/D_SPLIT
//                 columns of dK and dV — keeps the accumulators in registers for D > 128
//   ATOMIC_DQ     (dK/dV kernel only) 1: also add dS K into dq_accum with f32 atomics (the default,
//                 non-deterministic backward); 0: dQ comes from the separate bwd_dq kernel
#pragma once

#ifndef FLASH_DTYPE
#error "FLASH_DTYPE must be defined (0 = fp16, 1 = bf16, 2 = fp32)"
#endif
#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#ifndef IS_CAUSAL
#define IS_CAUSAL 0
#endif
#ifndef GQA_GROUP
#define GQA_GROUP 1
#endif
#ifndef EVEN_N
#define EVEN_N 0
#endif
#ifndef D_SPLIT
#define D_SPLIT 1
#endif
#ifndef ATOMIC_DQ
#define ATOMIC_DQ 0
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1  // __launch_bounds__ minimum resident blocks per SM (caps registers)
#endif

#if HEAD_DIM % 8 != 0 || HEAD_DIM > 256 || HEAD_DIM <= 0
#error "HEAD_DIM must be a multiple of 8 in [8, 256]"
#endif

#define NUM_THREADS (NUM_WARPS * 32)

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#if FLASH_DTYPE == 2
typedef float elem_t;
#else
typedef u16 elem_t;  // raw fp16 / bf16 bits
#endif

// Zeroes a register array of any rank, of float or float4.
__device__ __forceinline__ void zero(float& x) { x = 0.f; }
__device__ __forceinline__ void zero(float4& x) { x = make_float4(0.f, 0.f, 0.f, 0.f); }
template <typename T, int N>
__device__ __forceinline__ void zero(T (&a)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) zero(a[i]);
}

// Multiplies a register array of any rank, of float or float4, by f.
__device__ __forceinline__ void rescale(float& x, float f) { x *= f; }
__device__ __forceinline__ void rescale(float4& x, float f) {
    x.x *= f;
    x.y *= f;
    x.z *= f;
    x.w *= f;
}
template <typename T, int N>
__device__ __forceinline__ void rescale(T (&a)[N], float f) {
#pragma unroll
    for (int i = 0; i < N; ++i) rescale(a[i], f);
}

// All tensors are contiguous, row-major:
//   q, o, do, dq  [B, Sq, H, D]      k, v, dk, dv  [B, Sk, Hkv, D]      lse, delta  [B, H, Sq]
// The struct is passed by value; the host mirrors it field for field (#[repr(C)]).
struct FlashParams {
    const elem_t* q;       // [B, Sq, H, D]
    const elem_t* k;       // [B, Sk, Hkv, D]
    const elem_t* v;       // [B, Sk, Hkv, D]
    elem_t* o;             // [B, Sq, H, D]   forward output; backward input
    float* lse;            // [B, H, Sq]      natural-log logsumexp of scale * q.k, -inf for empty rows
    const elem_t* dout;    // [B, Sq, H, D]   backward: gradient of o
    elem_t* dq;            // [B, Sq, H, D]   backward outputs, in the input dtype
    elem_t* dk;            // [B, Sk, Hkv, D]
    elem_t* dv;            // [B, Sk, Hkv, D]
    float* delta;          // [B, H, Sq]      workspace: rowsum(do * o)
    float* lse_log2;       // [B, H, Sq]      workspace: lse * log2(e), +inf for rows that see no key
    float* dq_accum;       // [B, Sq, H, D]   workspace (atomic dQ): sum of dS K without the scale, f32,
                           //                 zeroed by the host before bwd_dkdv
    int batch;             // B
    int seqlen_q;          // Sq
    int seqlen_k;          // Sk
    int heads;             // H
    int heads_kv;          // Hkv
    float scale;           // softmax scale applied to q.k
    float scale_log2;      // scale * log2(e): scores go to the exp2 domain with one multiply
    int _pad;              // keeps sizeof a multiple of 8 on every compiler
};

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF (__int_as_float(0xff800000))
#define POS_INF (__int_as_float(0x7f800000))

// Element offsets of (b, s, h) rows; 64-bit so that B*S*H*D may exceed 2^31.
__device__ __forceinline__ i64 q_row_offset(const FlashParams& p, int b, int s, int h) {
    return (((i64)b * p.seqlen_q + s) * p.heads + h) * HEAD_DIM;
}
__device__ __forceinline__ i64 kv_row_offset(const FlashParams& p, int b, int s, int hkv) {
    return (((i64)b * p.seqlen_k + s) * p.heads_kv + hkv) * HEAD_DIM;
}
__device__ __forceinline__ i64 stat_offset(const FlashParams& p, int b, int h) {
    return ((i64)b * p.heads + h) * p.seqlen_q;
}

// ---- the block's rows, lengths and offsets -------------------------------------------------------
// Every tiled kernel opens with one of the two structs below, built from the params and blockIdx:
// they are the one place where a block's query and key ranges, sequence lengths, strides and base
// offsets are computed.

// First key after which no key is visible to any row of the query block [m0, m0 + block_m).
__device__ __forceinline__ int key_end(int m0, int block_m, int seqlen_q, int seqlen_k) {
#if IS_CAUSAL
    int e = m0 + block_m + seqlen_k - seqlen_q;
    return e < 0 ? 0 : (e < seqlen_k ? e : seqlen_k);
#else
    return seqlen_k;
#endif
}

// First query row (a multiple of block_m) whose tile can see a key of the block starting at n0:
// causal skips the query tiles above the diagonal. The dK/dV kernels' twin of key_end.
__device__ __forceinline__ int first_query_tile(int n0, int block_m, int seqlen_q, int seqlen_k) {
#if IS_CAUSAL
    const int first_query = n0 - (seqlen_k - seqlen_q);
    return first_query > 0 ? first_query / block_m * block_m : 0;
#else
    return 0;
#endif
}

#if defined(BLOCK_M) && defined(BLOCK_N)  // the tiled kernels
// A block of a kernel gridded over query tiles (fwd, bwd_dq): grid (ceil(Sq / BLOCK_M), H, B).
// It owns query rows [m0, m0 + BLOCK_M) of head h of batch b and reads keys [0, n_end()) of kv
// head hkv. Causal grids run the heaviest blocks (the last rows) first. Offsets are computed where
// they are asked for, as the kernels did before this struct (same code, same registers).
struct QueryBlock {
    int b, h, hkv;       // batch, query head, its key/value head
    int m0;              // first query row
    int Sq, Sk;          // query and key sequence lengths
    i64 q_stride;        // element distance between rows of q, o, do, dq
    i64 kv_stride;       // element distance between rows of k, v

    __device__ __forceinline__ explicit QueryBlock(const FlashParams& p) {
        const int m_block = IS_CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
        h = blockIdx.y;
        b = blockIdx.z;
        hkv = h / GQA_GROUP;
        m0 = m_block * BLOCK_M;
        Sq = p.seqlen_q;
        Sk = p.seqlen_k;
        q_stride = (i64)p.heads * HEAD_DIM;
        kv_stride = (i64)p.heads_kv * HEAD_DIM;
    }
    // Keys [0, n_end()) are visible to some row of the block: n_tiles() tiles of BLOCK_N.
    __device__ __forceinline__ int n_end() const { return key_end(m0, BLOCK_M, Sq, Sk); }
    __device__ __forceinline__ int n_tiles() const { return (n_end() + BLOCK_N - 1) / BLOCK_N; }
    // Element offsets of (b, row 0, h) in q, o, do, dq; of (b, key 0, hkv) in k, v; and of
    // (b, h, row 0) in lse, lse_log2, delta.
    __device__ __forceinline__ i64 q_base(const FlashParams& p) const { return q_row_offset(p, b, 0, h); }
    __device__ __forceinline__ i64 kv_base(const FlashParams& p) const { return kv_row_offset(p, b, 0, hkv); }
    __device__ __forceinline__ i64 stat_base(const FlashParams& p) const { return stat_offset(p, b, h); }
    // lse_log2 and delta of query row `row` (backward): +inf and 0 past Sq, so that P = 0 there.
    __device__ __forceinline__ void row_stats(const FlashParams& p, int row, float& lse2, float& dlt) const {
        const i64 idx = stat_base(p) + row;
        lse2 = row < Sq ? p.lse_log2[idx] : POS_INF;
        dlt = row < Sq ? p.delta[idx] : 0.f;
    }
};

// A block of a kernel gridded over key tiles (bwd_dkdv): grid (ceil(Sk / BLOCK_N), Hkv, B). It owns
// keys [n0, n0 + BLOCK_N) of kv head hkv of batch b and visits n_iter (query head, query tile)
// pairs: the GQA_GROUP query heads of hkv, and in each the m_tiles query tiles from m_start on.
struct KeyBlock {
    int b, hkv;          // batch, key/value head
    int n0;              // first key row
    int Sq, Sk;          // query and key sequence lengths
    i64 q_stride;        // element distance between rows of q, do, dq_accum
    i64 kv_stride;       // element distance between rows of k, v, dk, dv
    int m_first;         // first query tile (index) with a row that sees a key of the block
    int m_start;         // its first row, m_first * BLOCK_M
    int m_tiles;         // query tiles per head from m_first on
    int n_iter;          // m_tiles * GQA_GROUP

    __device__ __forceinline__ explicit KeyBlock(const FlashParams& p) {
        n0 = blockIdx.x * BLOCK_N;
        hkv = blockIdx.y;
        b = blockIdx.z;
        Sq = p.seqlen_q;
        Sk = p.seqlen_k;
        q_stride = (i64)p.heads * HEAD_DIM;
        kv_stride = (i64)p.heads_kv * HEAD_DIM;
        m_first = first_query_tile(n0, BLOCK_M, Sq, Sk) / BLOCK_M;
        const int all_tiles = (Sq + BLOCK_M - 1) / BLOCK_M;
        m_tiles = all_tiles > m_first ? all_tiles - m_first : 0;
        n_iter = m_tiles * GQA_GROUP;
        m_start = m_first * BLOCK_M;
    }
    // Iteration it < n_iter: its query head, and the first row of its query tile.
    __device__ __forceinline__ int head(int it) const { return hkv * GQA_GROUP + it / m_tiles; }
    __device__ __forceinline__ int query_row(int it) const { return (m_first + it % m_tiles) * BLOCK_M; }
    // Element offsets of (b, key 0, hkv) in k, v, dk, dv; of (b, row 0, h) in q, do, dq_accum; and
    // of (b, h, row 0) in lse_log2, delta.
    __device__ __forceinline__ i64 kv_base(const FlashParams& p) const { return kv_row_offset(p, b, 0, hkv); }
    __device__ __forceinline__ i64 q_base(const FlashParams& p, int h) const { return q_row_offset(p, b, 0, h); }
    __device__ __forceinline__ i64 stat_base(const FlashParams& p, int h) const { return stat_offset(p, b, h); }
};
#endif

// ---- shared memory -----------------------------------------------------------------------------
// Each main kernel writes its layout once, as `struct Smem` (its tiles as flat arrays, in order),
// works on `Smem& smem = shared_memory<Smem>()`, and exports sizeof(Smem) with
// FLASH_EXPORT_SMEM(sizeof(Smem)); the elementwise kernels export 0. The launcher reads the symbol
// `flash_smem_bytes` from the cubin (a 4-byte object in .nv.global.init, or in the zero-filled
// .nv.global when it is 0) and asks for that much dynamic shared memory: the kernel is the only
// owner of its size. Every kernel source exports it exactly once.
#define FLASH_EXPORT_SMEM(bytes) extern "C" __device__ const int flash_smem_bytes = (bytes);

// The block's dynamic shared memory, laid out as the kernel's struct T.
template <typename T>
__device__ __forceinline__ T& shared_memory() {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    return *reinterpret_cast<T*>(smem_raw);
}
