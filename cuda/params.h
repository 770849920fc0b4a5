// params.h — the one parameter struct shared by every kernel, and the compile-time configuration.
// The tiled kernels' blocks (their rows, keys, offsets and tile walks) are block.h's.
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
//   MASKED        (tiled kernels) 1: windows, padding, segment ids, block masks and varlen batches,
//                 and the score modifiers (softcap, ALiBi, sinks), all read at run time from the params
//                 (seq.h, mask.h); IS_CAUSAL and EVEN_N are then 0 (causal is the window's right side
//                 0). 0: exactly the plain kernels
//   MODS          (MASKED kernels) 1: the score modifiers are compiled in (mask.h's Visibility::modify,
//                 the sinks); 0: the MASKED kernels as they were without them
#pragma once
#include "types.h"

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
#ifndef MASKED
#define MASKED 0
#endif
#ifndef MODS
#define MODS 0
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1  // __launch_bounds__ minimum resident blocks per SM (caps registers)
#endif

#if HEAD_DIM % 8 != 0 || HEAD_DIM > 256 || HEAD_DIM <= 0
#error "HEAD_DIM must be a multiple of 8 in [8, 256]"
#endif
#if MODS && !MASKED
#error "MODS kernels are MASKED kernels (the modifiers live in the MASKED params)"
#endif
#if MASKED && (IS_CAUSAL || EVEN_N)
#error "MASKED kernels take causal as a window and mask ragged tiles themselves: IS_CAUSAL = EVEN_N = 0"
#endif

#define NUM_THREADS (NUM_WARPS * 32)

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

// Shapes:
//   q, o, do, dq  [B, Sq, H, D]      k, v, dk, dv  [B, Sk, Hkv, D]      lse, delta  [B, H, Sq]
// A varlen call packs its sequences instead: q, o, do, dq [total_q, H, D], k, v, dk, dv
// [total_k, Hkv, D], lse, delta [H, total_q], with B the number of sequences and Sq, Sk the longest
// (only the MASKED kernels, which find each batch row's rows in `seqs`, take those).
// The eight [.., H, D] tensors lie where their Strides say (views of the caller's tensors: a
// `qkv.unbind`, a [B, H, S, D] transpose; the library's own outputs are packed); lse, delta and the
// workspaces are packed.
// The struct is passed by value; the host mirrors it field for field (#[repr(C)]).

// Where a tensor's rows lie, in elements (its last axis contiguous): row r of the call's rows
// (b * S + i in a padded call; the packed row in a varlen one), head h, of batch row b is at
// r * seq + h * head + b * batch_gap, batch_gap being the batch stride less S * seq (0 when the
// batch rows follow each other, and in varlen calls).
struct Strides {
    i64 seq, head, batch_gap;
};
__device__ __forceinline__ i64 row_at(const Strides& st, int b, i64 r, int h) {
    return r * st.seq + (i64)h * st.head + (i64)b * st.batch_gap;
}

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
                           //                 zeroed by the host before bwd_dkdv (dq_tiled: tiles, below)
    const float* dlse;     // [B, H, Sq]      backward: gradient of lse, or null; delta - dlse per row
    int batch;             // B
    int seqlen_q;          // Sq
    int seqlen_k;          // Sk
    int heads;             // H
    int heads_kv;          // Hkv
    float scale;           // softmax scale applied to q.k
    float scale_log2;      // scale * log2(e): scores go to the exp2 domain with one multiply
    int dq_tiled;          // dq_accum's layout: 0 [B, Sq, H, D]; 1 dq_tile_offset's tiles (bwd_sm90.cu)
    Strides q_st, k_st, v_st, o_st, do_st, dq_st, dk_st, dv_st;
#if MASKED
    // Masks (seq.h): the MASKED kernels' params extend the plain ones, which stay as they were.
    const int* seqs;                  // [B, 6] per batch row: q_start, q_len, k_start, k_len, k_lo, k_hi
    const int* seg_q;                 // [B, Sq] segment ids, or null
    const int* seg_k;                 // [B, Sk] segment ids, or null
    const unsigned char* block_mask;  // [Bm, Hm, ceil(Sq/128), ceil(Sk/128)], 0 = hidden; or null
    i64 bm_batch_stride;              // entries between the block mask's batch rows (0: broadcast)
    i64 bm_head_stride;               // entries between its heads (0: broadcast)
    int bm_cols;                      // ceil(Sk / 128)
    int win_left, win_right;          // window sides; the host caps them at Sq + Sk (= unbounded)
    int stat_q_mul, stat_h_stride;    // lse index of (b, h, i): q_start * stat_q_mul + h * stat_h_stride + i
    int _pad2;
    // Score modifiers (modifiers.rs), in the exp2 domain; the host uploads the tables with the call.
    const float* alibi_log2;          // [B, H] ALiBi slopes * log2(e), or null
    const float* sinks_log2;          // [H] attention-sink logits * log2(e), or null
    float* dsinks;                    // [H] backward output (bwd_dsinks.cu), or null
    float softcap_log2;               // softcap * log2(e); 0 = no softcap
    float softcap_inv_log2;           // 1 / softcap_log2
#endif
};

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF (__int_as_float(0xff800000))
#define POS_INF (__int_as_float(0x7f800000))

// Element offset of (b, s, h) in dq_accum's [B, Sq, H, D] layout; 64-bit so that B*S*H*D may exceed 2^31.
__device__ __forceinline__ i64 q_row_offset(const FlashParams& p, int b, int s, int h) {
    return (((i64)b * p.seqlen_q + s) * p.heads + h) * HEAD_DIM;
}
// dq_accum with dq_tiled (the Hopper backward's): [B, H, ceil(Sq / 64), 64, D] f32, tiles of
// DQ_TILE_ROWS query rows, each one contiguous bulk reduction; in a row, the 16-byte chunks are
// XOR-swizzled by 2 (row % 8), so that mma accumulator fragments store to a tile in shared memory
// without bank conflicts (D >= 64). Offset of (b, h, query row i, column d):
#define DQ_TILE_ROWS 64
__device__ __forceinline__ int dq_tile_elem(int row, int col, int d) {
    return row * d + ((((col >> 2) ^ (2 * (row & 7)))) << 2) + (col & 3);  // row < DQ_TILE_ROWS * k
}
__device__ __forceinline__ i64 dq_tile_offset(const FlashParams& p, int b, int h, int i, int col, int d) {
    const int tiles = (p.seqlen_q + DQ_TILE_ROWS - 1) / DQ_TILE_ROWS;
    const i64 tile = ((i64)b * p.heads + h) * tiles + i / DQ_TILE_ROWS;
    return tile * DQ_TILE_ROWS * d + dq_tile_elem(i % DQ_TILE_ROWS, col, d);
}

__device__ __forceinline__ i64 stat_offset(const FlashParams& p, int b, int h) {
    return ((i64)b * p.heads + h) * p.seqlen_q;
}

// ---- shared memory -----------------------------------------------------------------------------
// Each main kernel writes its layout once, as `struct Smem` (its tiles as flat arrays, in order),
// works on `Smem& smem = shared_memory<Smem>()`, and exports sizeof(Smem) with
// FLASH_EXPORT_SMEM(sizeof(Smem)); the elementwise kernels export 0. The launcher reads the symbol
// `flash_smem_bytes` from the cubin (a 4-byte object in .nv.global.init, or in the zero-filled
// .nv.global when it is 0) and asks for that much dynamic shared memory: the kernel is the only
// owner of its size. Every kernel source exports it exactly once.
// FLASH_EXPORT_SMEM(bytes) itself is types.h's (every kernel has it, rotary.cu too).

// The block's dynamic shared memory, laid out as the kernel's struct T.
template <typename T>
__device__ __forceinline__ T& shared_memory() {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    return *reinterpret_cast<T*>(smem_raw);
}
