// sm90_f32.h — what the Hopper f32 kernels share (fwd_sm90_f32.cu, bwd_dq_sm90_f32.cu,
// bwd_dkdv_sm90_f32.cu): f32 operands as TF32 parts in the layouts warpgroup MMA reads, and the
// split products over them.
//
// TF32_TERMS = 3 ("exact"): x = big + small, big = tf32(x), small = tf32(x - big), and a b ~
// big_a small_b + small_a big_b + big_a big_b (TERMS = 2 parts of each operand); TF32_TERMS = 1
// ("tf32"): big only. The parts are made explicitly (cvt.rna: their low 13 bits are zero, so it
// does not matter whether the tensor cores ignore or round them).
//
// A producer warpgroup (PRODUCER_THREADS) loads tiles from global memory into registers and stores
// their parts into shared memory as 128-byte-swizzled [rows][32 f32] column blocks, K-major (TF32
// wgmma takes no transposed operand):
// - RowTile<R>: R rows of D elements as they come (D contiguous): an A or B operand whose
//   contraction runs over D. Its parts are whole [TERMS][D / 32][R][32] tiles, or (PAIRED, a B
//   operand of ss_products_paired) [D / 32][TERMS][R][32]: each column block's big rows followed by
//   its small rows, one B operand of 2R rows.
// - TransposedTile<R>: R rows stored transposed, [R / 32][D][32] (the R rows contiguous), within
//   each group of 8 rows in the order 0, 2, 4, 6, 1, 3, 5, 7: the B operand of a product whose A is
//   an accumulator held in registers (AFrag) and whose contraction runs over the R rows. R = 16
//   (the D = 128 backward's tiles): [D][2][16], each 128-byte transposed row holding the big part's
//   16 rows, then the small part's (one part: the second half unused), so that the small part is
//   the big one's descriptor two k steps on.
// An accumulator's registers are its A fragment as they stand: a wgmma .tf32 A fragment holds
// (row g, k t), (g + 8, t), (g, t + 4), (g + 8, t + 4) (g = lane / 4, t = lane % 4, CUTLASS's
// ALayout_64x8), the accumulator (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) per 8 columns:
// with k index t <-> column 2t and t + 4 <-> column 2t + 1, a = {s0, s2, s1, s3} — the permutation
// TransposedTile stores.
#pragma once
#include "hopper.h"
#include "wgmma.h"

#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "sm90_f32.h: HEAD_DIM 64 or 128"
#endif

#if TF32_TERMS == 3
#define TERMS 2  // big, small
#elif TF32_TERMS == 1
#define TERMS 1
#else
#error "sm90_f32.h: TF32_TERMS 3 or 1"
#endif

#define PRODUCER_THREADS 128

// A kernel's shared memory starts at a base rounded up to the 128-byte swizzle's period (1024
// bytes; the dynamic allocation's own alignment is not promised): a layout ending at `end` bytes
// from that base asks for SWIZZLED_SMEM_BYTES(end), the round-up taking up to 1024 more.
#define SWIZZLED_SMEM_BYTES(end) (((end) + 1023) / 1024 * 1024 + 1024)
#define SM90_SMEM_MAX 232448  // a Hopper block's shared memory (227 KiB, opted in)
__device__ __forceinline__ u32 swizzled_base(const unsigned char* raw) { return (smem_addr(raw) + 1023) & ~1023u; }
#define CB_BYTES(rows) ((rows) * 128)             // one [rows][32] f32 column block
#define PART_BYTES(rows) ((rows) * HEAD_DIM * 4)  // one part of a [rows][D] (or [D][rows]) tile

// Byte offset of 16-byte chunk `chunk` (0..7) of row r in a 128-byte-swizzled column block.
__device__ __forceinline__ u32 sw128(int r, int chunk) { return r * 128 + ((chunk ^ (r & 7)) << 4); }

__device__ __forceinline__ void st_shared_v4(u32 addr, float a, float b, float c, float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// x's TF32 parts: big = tf32(x) and small = tf32(x - big) (x - big is exact in f32).
__device__ __forceinline__ float tf32_big(float x) { return __uint_as_float(to_tf32(x)); }
__device__ __forceinline__ float tf32_small(float x, float big) { return __uint_as_float(to_tf32(x - big)); }

// Stores four elements (one 16-byte chunk) as their parts: the big one at `big`, the small one at
// `small`.
__device__ __forceinline__ void store_parts_at(u32 big, u32 small, float4 x) {
    const float b0 = tf32_big(x.x), b1 = tf32_big(x.y), b2 = tf32_big(x.z), b3 = tf32_big(x.w);
    st_shared_v4(big, b0, b1, b2, b3);
#if TERMS == 2
    st_shared_v4(small, tf32_small(x.x, b0), tf32_small(x.y, b1), tf32_small(x.z, b2), tf32_small(x.w, b3));
#else
    (void)small;
#endif
}
// The same at `off` of each part (parts `part_bytes` apart from `base`).
__device__ __forceinline__ void store_parts(u32 base, u32 part_bytes, u32 off, float4 x) {
    store_parts_at(base + off, base + part_bytes + off, x);
}

// ---- the producer's tiles ---------------------------------------------------------------------------
// A [R][D] tile of rows r0.. of src (row stride `stride`), rows >= nrows as zeros: thread i holds
// the 16-byte chunks i, i + 128, ... (row-major), so a warp reads whole rows.
template <int R>
struct RowTile {
    static constexpr int CHUNKS = R * HEAD_DIM / 4 / PRODUCER_THREADS;
    static_assert(CHUNKS >= 1, "a chunk per producer thread at least");
    float4 x[CHUNKS];

    __device__ __forceinline__ void load(const float* src, i64 stride, int r0, int nrows) {
        const int tid = threadIdx.x % PRODUCER_THREADS;
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const int c = tid + PRODUCER_THREADS * i, r = c / (HEAD_DIM / 4), c4 = c % (HEAD_DIM / 4);
            x[i] = r0 + r < nrows ? *reinterpret_cast<const float4*>(src + (i64)(r0 + r) * stride + 4 * c4)
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    // Into the parts at `base` of a [ROWS][D] tile, as rows row_off..; K-major, swizzled; PAIRED:
    // the parts of each column block side by side (see above).
    template <int ROWS, bool PAIRED = false>
    __device__ __forceinline__ void store(u32 base, int row_off) const {
        const int tid = threadIdx.x % PRODUCER_THREADS;
        constexpr u32 part = PAIRED ? CB_BYTES(ROWS) : PART_BYTES(ROWS);
        constexpr u32 block = PAIRED ? TERMS * CB_BYTES(ROWS) : CB_BYTES(ROWS);
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const int c = tid + PRODUCER_THREADS * i, r = row_off + c / (HEAD_DIM / 4), c4 = c % (HEAD_DIM / 4);
            store_parts(base, part, (c4 / 8) * block + sw128(r, c4 % 8), x[i]);
        }
    }
};

// A [R][D] tile (rows r0.., rows >= nrows as zeros) held for its transposed store: thread i takes
// column d = i % D and the units u = i / D + (128 / D) m: row group u / 2, parity u % 2, the rows
// 8 (u / 2) + u % 2 + {0, 2, 4, 6} (4-byte loads, a warp reading 32 consecutive columns of a row),
// which transposed row d holds at positions 4 (u % 2) + {0, 1, 2, 3} of its group: one 16-byte
// chunk. The 8 threads of a store phase write 8 consecutive rows: no bank conflict.
template <int R>
struct TransposedTile {
    static constexpr int STEP = PRODUCER_THREADS / HEAD_DIM;  // threads per column
    static constexpr int UNITS = R / 4 / STEP;
    static_assert(R % 32 == 0 || R == 16, "whole 32-row column blocks, or both parts of 16 rows in one");
    // From the big part to the small one (rs_products' b_part), and the whole tile's bytes.
    static constexpr u32 PART = R == 16 ? 64 : PART_BYTES(R);
    static constexpr u32 BYTES = R == 16 ? HEAD_DIM * 128 : TERMS * PART_BYTES(R);
    float4 x[UNITS];

    __device__ __forceinline__ void load(const float* src, i64 stride, int r0, int nrows) {
        const int tid = threadIdx.x % PRODUCER_THREADS, d = tid % HEAD_DIM;
#pragma unroll
        for (int m = 0; m < UNITS; ++m) {
            const int u = tid / HEAD_DIM + STEP * m, row = r0 + 8 * (u / 2) + u % 2;
            float e[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) e[i] = row + 2 * i < nrows ? src[(i64)(row + 2 * i) * stride + d] : 0.f;
            x[m] = make_float4(e[0], e[1], e[2], e[3]);
        }
    }
    // Into the parts at `base` of a [R / 32][D][32] tile (R = 16: [D][2][16]).
    __device__ __forceinline__ void store(u32 base) const {
        const int tid = threadIdx.x % PRODUCER_THREADS, d = tid % HEAD_DIM;
#pragma unroll
        for (int m = 0; m < UNITS; ++m) {
            const int u = tid / HEAD_DIM + STEP * m, group = u / 2, chunk = 2 * (group % 4) + u % 2;
            if (R == 16)
                store_parts_at(base + sw128(d, chunk), base + sw128(d, chunk + 4), x[m]);
            else
                store_parts(base, PART_BYTES(R), (group / 4) * CB_BYTES(HEAD_DIM) + sw128(d, chunk), x[m]);
        }
    }
};

// Rows r0.. of src (row stride `stride`, rows >= nrows as zeros) into the parts at `base` of a
// [ROWS][D] tile, 32 rows at a time (a whole tile would hold ROWS * D / 512 float4 per thread).
template <int ROWS>
__device__ __forceinline__ void store_row_tile(u32 base, const float* src, i64 stride, int r0, int nrows) {
#pragma unroll 1
    for (int r = 0; r < ROWS; r += 32) {
        RowTile<32> t;
        t.load(src, stride, r0 + r, nrows);
        t.store<ROWS>(base, r);
    }
}

// This thread's stores are done: make them visible to the tensor cores (the async proxy), then arrive.
__device__ __forceinline__ void publish(u32 full) {
    fence_async_smem();
    mbar_arrive(full);
}

// ---- the products -------------------------------------------------------------------------------------
// Descriptor of k-step kk (8 elements) of a K-major operand of `rows` rows: column block kk / 4, 32
// bytes per step in it.
__device__ __forceinline__ u64 kdesc(u32 base, int rows, int kk) {
    return desc_sw128(base + (kk / 4) * CB_BYTES(rows) + (kk % 4) * 32, 0);
}

// d = the TF32_TERMS products of A (RowTile rows a_rows, parts at a, a + a_part) and B (RowTile
// rows b_rows, parts at b, b + b_part) over the D k-steps, from zero: the correction products
// first (their sums are small), then big x big. Not fenced, committed or waited for.
template <int N>
__device__ __forceinline__ void ss_products(float (&d)[N / 8][4], u32 a, u32 a_part, int a_rows, u32 b, u32 b_part,
                                            int b_rows) {
    constexpr int KS = HEAD_DIM / 8;
#if TERMS == 2
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) WgmmaTf32<N>::ss(d, kdesc(a, a_rows, kk), kdesc(b + b_part, b_rows, kk), kk > 0);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) WgmmaTf32<N>::ss(d, kdesc(a + a_part, a_rows, kk), kdesc(b, b_rows, kk), 1);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) WgmmaTf32<N>::ss(d, kdesc(a, a_rows, kk), kdesc(b, b_rows, kk), 1);
#else
    (void)a_part, (void)b_part;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) WgmmaTf32<N>::ss(d, kdesc(a, a_rows, kk), kdesc(b, b_rows, kk), kk > 0);
#endif
}

// d = A B^T as ss_products, over fewer reads of A: B's parts PAIRED (RowTile), so that big_a
// [big_b | small_b] is one product of 2N columns and A's big part is read once, not twice (the split
// products read A's parts 2 + 1 times and B's 1 + 2: the 64-row A dominates the shared-memory
// traffic at N = 32). The sums land in two accumulators: d2 = [big_a big_b | big_a small_b] and
// d1 = small_a big_b (apart: wgmma chains into one accumulator register block, not into half of
// another's); `sum_paired` adds them up. TERMS = 2 only. Not fenced, committed or waited for.
#if TERMS == 2
template <int N>
__device__ __forceinline__ void ss_products_paired(float (&d2)[2 * N / 8][4], float (&d1)[N / 8][4], u32 a, u32 a_part,
                                                   int a_rows, u32 b, int b_rows) {
    constexpr int KS = HEAD_DIM / 8;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) WgmmaTf32<N>::ss(d1, kdesc(a + a_part, a_rows, kk), kdesc(b, 2 * b_rows, kk), kk > 0);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) WgmmaTf32<2 * N>::ss(d2, kdesc(a, a_rows, kk), kdesc(b, 2 * b_rows, kk), kk > 0);
}

// x = a paired product's sum in f32: the corrections first, then big x big.
template <int NT>
__device__ __forceinline__ void sum_paired(float (&x)[NT][4], const float (&d2)[2 * NT][4], const float (&d1)[NT][4]) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[i][e] = (d1[i][e] + d2[NT + i][e]) + d2[i][e];
}
#endif

// x = A B^T over D (ss; as abt_pair below, one product), waited for: the D = 128 backward's
// consumers take one score product each.
template <int N>
__device__ __forceinline__ void abt(float (&x)[N / 8][4], u32 a, u32 a_part, int a_rows, u32 b, int b_rows) {
#if TERMS == 2
    float x2[2 * N / 8][4], x1[N / 8][4];
    wgmma_fence();
    ss_products_paired<N>(x2, x1, a, a_part, a_rows, b, b_rows);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(x2);
    fence_regs(x1);
    sum_paired(x, x2, x1);
#else
    wgmma_fence();
    ss_products<N>(x, a, a_part, a_rows, b, PART_BYTES(b_rows), b_rows);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(x);
#endif
}

// x = A1 B1^T and y = A2 B2^T over D (ss; A's of a_rows rows with parts a_part apart, B's of b_rows
// rows, PAIRED under split products (ss_products_paired), else parts PART_BYTES(b_rows) apart),
// waited for: a kernel's two score products (S and dP, or S^T and dP^T).
template <int N>
__device__ __forceinline__ void abt_pair(float (&x)[N / 8][4], float (&y)[N / 8][4], u32 a1, u32 a2, u32 a_part, int a_rows,
                                         u32 b1, u32 b2, int b_rows) {
#if TERMS == 2
    float x2[2 * N / 8][4], x1[N / 8][4], y2[2 * N / 8][4], y1[N / 8][4];
    wgmma_fence();
    ss_products_paired<N>(x2, x1, a1, a_part, a_rows, b1, b_rows);
    ss_products_paired<N>(y2, y1, a2, a_part, a_rows, b2, b_rows);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(x2);
    fence_regs(x1);
    fence_regs(y2);
    fence_regs(y1);
    sum_paired(x, x2, x1);
    sum_paired(y, y2, y1);
#else
    wgmma_fence();
    ss_products<N>(x, a1, a_part, a_rows, b1, PART_BYTES(b_rows), b_rows);
    ss_products<N>(y, a2, a_part, a_rows, b2, PART_BYTES(b_rows), b_rows);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(x);
    fence_regs(y);
#endif
}

// An accumulator tile [64 x 8 KT] as KT A fragments (8 columns each): big and (TERMS = 2) small parts.
template <int KT>
struct AFrag {
    u32 big[KT][4];
#if TERMS == 2
    u32 small[KT][4];
#endif
    // From f32 values in accumulator layout: a = {s0, s2, s1, s3} (TransposedTile's order).
    __device__ __forceinline__ void set(const float (&s)[KT][4]) {
#pragma unroll
        for (int nt = 0; nt < KT; ++nt) {
            const float x[4] = {s[nt][0], s[nt][2], s[nt][1], s[nt][3]};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                big[nt][e] = to_tf32(x[e]);
#if TERMS == 2
                small[nt][e] = to_tf32(x[e] - __uint_as_float(big[nt][e]));
#endif
            }
        }
    }
};

// d (+)= A B for N output columns: A's parts in registers, B a TransposedTile<8 KT> (parts at b,
// b + b_part) from its transposed row d0 on (d0 a multiple of the swizzle's 8 rows); `acc` = false
// starts d from zero. Not fenced, committed or waited for.
template <int N, int KT>
__device__ __forceinline__ void rs_products(float (&d)[N / 8][4], const AFrag<KT>& a, u32 b, u32 b_part, int d0, bool acc) {
    b += d0 * 128;  // 128 bytes a transposed row
#if TERMS == 2
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) WgmmaTf32<N>::rs(d, a.big[kk], kdesc(b + b_part, HEAD_DIM, kk), acc || kk > 0);
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) WgmmaTf32<N>::rs(d, a.small[kk], kdesc(b, HEAD_DIM, kk), 1);
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) WgmmaTf32<N>::rs(d, a.big[kk], kdesc(b, HEAD_DIM, kk), 1);
#else
    (void)b_part;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) WgmmaTf32<N>::rs(d, a.big[kk], kdesc(b, HEAD_DIM, kk), acc || kk > 0);
#endif
}

// d[i0 + i] += x[i] for x's rows (a fresh accumulator's sum, added in f32).
template <int R, int C, int RX>
__device__ __forceinline__ void add_into(float (&d)[R][C], const float (&x)[RX][C], int i0) {
#pragma unroll
    for (int i = 0; i < RX; ++i)
#pragma unroll
        for (int j = 0; j < C; ++j) d[i0 + i][j] += x[i][j];
}

// The block's roles: warpgroup 0 runs produce(), warpgroups 1.. consume(c) (c = 0, 1, ...), once
// setmaxnreg has moved registers from the producer to the consumers. Every thread starts with
// REG_CAP (__launch_bounds__(NUM_THREADS, 1)), and the consumers' setmaxnreg.inc waits until the
// producer's .dec has given back enough: a split above the pool would hang, not fail.
#define REG_CAP ((65536 / NUM_THREADS) & ~7)
template <int PRODUCER_REGS_, int CONSUMER_REGS_, typename Produce, typename Consume>
__device__ __forceinline__ void run_roles(Produce&& produce, Consume&& consume) {
    constexpr int consumers = NUM_THREADS / 128 - 1;
    static_assert(PRODUCER_REGS_ + consumers * CONSUMER_REGS_ <= (consumers + 1) * REG_CAP,
                  "setmaxnreg: the consumers would wait forever for registers the producer did not give back");
    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        setmaxnreg_dec<PRODUCER_REGS_>();
        produce();
    } else {
        setmaxnreg_inc<CONSUMER_REGS_>();
        consume(wg - 1);
    }
}
