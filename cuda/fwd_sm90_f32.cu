// fwd_sm90_f32.cu — attention forward for Hopper (sm_90a) in f32, its products as split TF32 on
// warpgroup MMA (wgmma m64nNk8 .tf32): TF32_TERMS = 3 ("exact": x = big + small, big = tf32(x),
// small = tf32(x - big), a b ~ big_a small_b + small_a big_b + big_a big_b) or 1 ("tf32": big only).
// D = 64 and 128, plain problems (causal or not, GQA); sm90.rs sends everything else elsewhere.
//
// Grid (ceil(Sq / BLOCK_M), H, B), causal heaviest first; NUM_WARPS = 4 * (1 + CONSUMERS):
// - warpgroup 0, the producer: all 128 threads load Q once and then K_0, K_1, V_0, K_2, V_1, ...
//   from global memory (16-byte loads for Q / K, coalesced 4-byte ones for V), split each element
//   into its TF32 parts (cvt.rna, explicitly: the parts' low 13 bits are zero, so it does not matter
//   whether the tensor cores ignore or round them) and store the parts in the layout wgmma reads:
//   128-byte-swizzled [rows][32 f32] column blocks, K-major (TF32 wgmma takes no transposed
//   operand). Q and K are stored as they come (D contiguous); V transposed, V^T [D][keys], keys
//   contiguous, and within each group of 8 keys in the order 0, 2, 4, 6, 1, 3, 5, 7 (see pv_frag).
//   Each thread fences its stores into the async proxy and arrives on the stage's mbarrier
//   (128 arrivals); a stage is reused once every consumer warp has released it. The next K and V
//   tiles are loaded into registers before waiting for their stage (the register file is the
//   producer's second buffer).
// - warpgroups 1..CONSUMERS own 64 query rows each (warp w: 16 rows, the mma.sync accumulator layout,
//   so masks and the online softmax are the other kernels'). Per key tile j: S_j = Q K_j^T (ss: both
//   parts of Q and K in shared memory) is issued with O += P_{j-1} V_{j-1} (rs: P's parts in
//   registers), the softmax of S_j runs while the second product is still on the tensor cores.
//   P's accumulator registers are its A fragment as they stand: a wgmma .tf32 A fragment holds
//   (row g, k t), (g + 8, t), (g, t + 4), (g + 8, t + 4) (g = lane / 4, t = lane % 4, CUTLASS's
//   ALayout_64x8), the accumulator (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) per 8
//   columns: with k index t <-> key 2t and t + 4 <-> key 2t + 1, a = {s0, s2, s1, s3}.
//
// Accumulation (the tensor cores add into their accumulator truncating, see tf32.h: over a long
//   chain that is a bias). S chains its 3 D / 8 products from zero (one chain per key tile). O,
//   with split products (TERMS = 2), sums each key tile's 3 BLOCK_N / 8 products in a fresh
//   accumulator, added to O in f32: chained over every key tile instead, o's error grew with the
//   keys to 1.5e-5 at 2048 and 6e-5 at 8192 keys (H100), 10-40x the SIMT kernel's. An emulation
//   (acc = RZ_f32(acc + the k-step's 8 exact products)) gave 1.9e-5 chained and 5-7e-7 per tile at
//   2048-4096 keys, D = 64 and 128, and summing S per k-step as well only 3-4e-7. One product
//   (TERMS = 1) chains O: TF32's own error dwarfs the truncation.
//
// Shared memory per block (f32, TERMS = 2 parts for TF32_TERMS = 3):
//   Q  TERMS * BLOCK_M * D * 4, K and V^T each STAGES * TERMS * BLOCK_N * D * 4.
//   D = 64:  BLOCK_M 128, BLOCK_N 64, STAGES 2: 64 + 64 + 64 KiB = 192 KiB.
//   D = 128: BLOCK_M 128, BLOCK_N 32, STAGES 1: 128 + 32 + 32 KiB = 192 KiB (two stages: 256).
// Work per key tile (D = 128, BLOCK_N = 32, both consumers): tensor cores 2 x 2 x 64 x 32 x 128 x 2
//   x 3 = 6.3 MFLOP of TF32 = 3072 cycles at the SM's 2048 TF32 FLOP / cycle; the producer ~8
//   float4 + 32 scalar loads, 3 x 8192 / 128 = 192 conversions and 32 16-byte stores per thread
//   (~1000 warp instructions over 4 schedulers: ~250 issue cycles); the consumers' softmax and P
//   split ~ 16 scores x ~12 instructions per thread (~200 cycles per warp). So the tensor cores
//   bound it, 3x the 16-bit kernel's work for the same shared-memory operand traffic per product.
#include "hopper.h"
#include "wgmma.h"
#include "tile.h"
#include "block.h"
#include "softmax.h"
#include "fwd_store.h"

#define CONSUMERS (NUM_WARPS / 4 - 1)
#ifndef STAGES
#define STAGES 1
#endif
#if FLASH_DTYPE != 2 || (HEAD_DIM != 64 && HEAD_DIM != 128) || CONSUMERS != 2 || BLOCK_M != 64 * CONSUMERS || \
    (BLOCK_N != 32 && BLOCK_N != 64) || MASKED
#error "fwd_sm90_f32: f32, HEAD_DIM 64 or 128, two consumer warpgroups of 64 rows, BLOCK_N 32 or 64, plain"
#endif

#if TF32_TERMS == 3
#define TERMS 2     // big, small
#define FRESH_O 1   // O per key tile in a fresh accumulator (see Accumulation)
#else
#define TERMS 1
#define FRESH_O 0
#endif
// Registers per thread. The block starts with REG_CAP each (__launch_bounds__(NUM_THREADS, 1)); the
// producer gives some back (setmaxnreg.dec) and the consumers take them (setmaxnreg.inc), which
// waits until the pool holds them: PRODUCER_REGS + CONSUMERS * CONSUMER_REGS > (CONSUMERS + 1) *
// REG_CAP would hang, not fail. The producer holds a K and a V tile (2 x BLOCK_N x D / 128 floats)
// and their addresses: it spills below 128 at D = 64, below 120 at D = 128 (NVRTC 13.5). A consumer
// holds O, S and P's parts (no spill at 176, D = 64 and 128) and with FRESH_O an O_PART-column
// slice of one key tile's P V besides: O_PART = 32 needs 184 at D = 64 and 192 at D = 128 (the
// whole tile's, O_PART = D, 200 and over 216).
#define REG_CAP ((65536 / NUM_THREADS) & ~7)
#if !FRESH_O
#define PRODUCER_REGS 152
#define CONSUMER_REGS 176
#elif HEAD_DIM == 64
#define O_PART 32
#define PRODUCER_REGS 136
#define CONSUMER_REGS 184
#else
#define O_PART 32
#define PRODUCER_REGS 120
#define CONSUMER_REGS 192
#endif
static_assert(PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= (CONSUMERS + 1) * REG_CAP,
              "setmaxnreg: the consumers would wait forever for registers the producer did not give back");

#define PRODUCER_THREADS 128
#define CB_BYTES(rows) ((rows) * 128)          // one [rows][32] f32 column block
#define PART_BYTES(rows) ((rows) * HEAD_DIM * 4)  // one part of a [rows][D] (or [D][rows]) tile
#define KV_ELEMS (BLOCK_N * HEAD_DIM)

// Shared memory, from a base aligned to the swizzle's period (1024 bytes): Q [TERMS][D / 32][BLOCK_M][32];
// K [STAGES][TERMS][D / 32][BLOCK_N][32]; V^T [STAGES][TERMS][BLOCK_N / 32][D][32] (keys permuted
// within groups of 8); the mbarriers q_full, k_full[STAGES], v_full[STAGES], k_empty[STAGES],
// v_empty[STAGES]. Addressed as 32-bit offsets from one base (a generic Smem& kept a 64-bit pointer
// live through both roles, and spilled it).
constexpr u32 SMEM_Q = 0;
constexpr u32 SMEM_K = SMEM_Q + TERMS * BLOCK_M * HEAD_DIM * 4;
constexpr u32 SMEM_V = SMEM_K + STAGES * TERMS * KV_ELEMS * 4;
constexpr u32 SMEM_BARS = SMEM_V + STAGES * TERMS * KV_ELEMS * 4;
constexpr u32 SMEM_END = SMEM_BARS + 8 * (1 + 4 * STAGES);
FLASH_EXPORT_SMEM((SMEM_END + 1023) / 1024 * 1024 + 1024)  // + the round-up of the start to 1024

struct SmemAt {
    u32 base;
    __device__ __forceinline__ u32 q() const { return base + SMEM_Q; }
    __device__ __forceinline__ u32 k() const { return base + SMEM_K; }
    __device__ __forceinline__ u32 v() const { return base + SMEM_V; }
    __device__ __forceinline__ u32 q_full() const { return base + SMEM_BARS; }
    __device__ __forceinline__ u32 k_full(u32 s) const { return base + SMEM_BARS + 8 * (1 + s); }
    __device__ __forceinline__ u32 v_full(u32 s) const { return base + SMEM_BARS + 8 * (1 + STAGES + s); }
    __device__ __forceinline__ u32 k_empty(u32 s) const { return base + SMEM_BARS + 8 * (1 + 2 * STAGES + s); }
    __device__ __forceinline__ u32 v_empty(u32 s) const { return base + SMEM_BARS + 8 * (1 + 3 * STAGES + s); }
};

__device__ __forceinline__ u32 stage_of(int j) { return j % STAGES; }
__device__ __forceinline__ u32 phase_of(int j) { return (j / STAGES) & 1; }

// Byte offset of 16-byte chunk `chunk` (0..7) of row r in a 128-byte-swizzled column block.
__device__ __forceinline__ u32 sw128(int r, int chunk) { return r * 128 + ((chunk ^ (r & 7)) << 4); }

__device__ __forceinline__ void st_shared_v4(u32 addr, float a, float b, float c, float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// x's TF32 parts: big = tf32(x) and small = tf32(x - big) (x - big is exact in f32).
__device__ __forceinline__ float tf32_big(float x) { return __uint_as_float(to_tf32(x)); }
__device__ __forceinline__ float tf32_small(float x, float big) { return __uint_as_float(to_tf32(x - big)); }

// Stores four consecutive elements of one row (one 16-byte chunk) as their parts at `off` of each
// part (parts `part_bytes` apart from `base`).
__device__ __forceinline__ void store_parts(u32 base, u32 part_bytes, u32 off, float4 x) {
    const float b0 = tf32_big(x.x), b1 = tf32_big(x.y), b2 = tf32_big(x.z), b3 = tf32_big(x.w);
    st_shared_v4(base + off, b0, b1, b2, b3);
#if TERMS == 2
    st_shared_v4(base + part_bytes + off, tf32_small(x.x, b0), tf32_small(x.y, b1), tf32_small(x.z, b2),
                 tf32_small(x.w, b3));
#endif
}

// ---- the producer: row tiles (Q, K) --------------------------------------------------------------
// A [R][D] tile of rows r0.. of src (row stride `stride`), rows >= nrows as zeros: thread i holds
// the 16-byte chunks i, i + 128, ... (row-major), so a warp reads whole rows.
template <int R>
struct RowTile {
    static constexpr int CHUNKS = R * HEAD_DIM / 4 / PRODUCER_THREADS;
    float4 x[CHUNKS];

    __device__ __forceinline__ void load(const float* src, i64 stride, int r0, int nrows) {
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const int c = threadIdx.x + PRODUCER_THREADS * i, r = c / (HEAD_DIM / 4), c4 = c % (HEAD_DIM / 4);
            x[i] = r0 + r < nrows ? *reinterpret_cast<const float4*>(src + (i64)(r0 + r) * stride + 4 * c4)
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    // Into the parts at `base` of a [rows][D] tile, as rows row_off..; K-major, swizzled.
    template <int ROWS>
    __device__ __forceinline__ void store(u32 base, int row_off) const {
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const int c = threadIdx.x + PRODUCER_THREADS * i, r = row_off + c / (HEAD_DIM / 4), c4 = c % (HEAD_DIM / 4);
            store_parts(base, PART_BYTES(ROWS), (c4 / 8) * CB_BYTES(ROWS) + sw128(r, c4 % 8), x[i]);
        }
    }
};

// ---- the producer: V^T ----------------------------------------------------------------------------
// A [BLOCK_N][D] tile of V (keys n0.., keys >= nkeys as zeros) held for its transposed store: thread
// i takes column d = i % D and the units u = i / D + (128 / D) m: key group u / 2, parity u % 2,
// the keys 8 (u / 2) + u % 2 + {0, 2, 4, 6} (4-byte loads, a warp reading 32 consecutive columns of
// a key row), which V^T row d holds at positions 4 (u % 2) + {0, 1, 2, 3} of its group: one 16-byte
// chunk. The 8 threads of a store phase write 8 consecutive rows: no bank conflict.
struct VTile {
    static constexpr int STEP = PRODUCER_THREADS / HEAD_DIM;  // threads per column
    static constexpr int UNITS = BLOCK_N / 4 / STEP;
    float4 x[UNITS];

    __device__ __forceinline__ void load(const float* src, i64 stride, int n0, int nkeys) {
        const int d = threadIdx.x % HEAD_DIM;
#pragma unroll
        for (int m = 0; m < UNITS; ++m) {
            const int u = threadIdx.x / HEAD_DIM + STEP * m, key = n0 + 8 * (u / 2) + u % 2;
            float e[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) e[i] = key + 2 * i < nkeys ? src[(i64)(key + 2 * i) * stride + d] : 0.f;
            x[m] = make_float4(e[0], e[1], e[2], e[3]);
        }
    }
    __device__ __forceinline__ void store(u32 base) const {
        const int d = threadIdx.x % HEAD_DIM;
#pragma unroll
        for (int m = 0; m < UNITS; ++m) {
            const int u = threadIdx.x / HEAD_DIM + STEP * m, group = u / 2;
            store_parts(base, PART_BYTES(BLOCK_N), (group / 4) * CB_BYTES(HEAD_DIM) + sw128(d, 2 * (group % 4) + u % 2), x[m]);
        }
    }
};

// This thread's stores are done: make them visible to the tensor cores (the async proxy), then arrive.
__device__ __forceinline__ void publish(u32 full) {
    fence_async_smem();
    mbar_arrive(full);
}

__device__ __forceinline__ void produce(const FlashParams& p, const QueryBlock& blk, const SmemAt smem) {
    const float* q = p.q + blk.q_at(p.q_st);
    const float* k = p.k + blk.kv_at(p.k_st);
    const float* v = p.v + blk.kv_at(p.v_st);
    // Q, 32 rows at a time (a whole tile would hold D / 4 float4 per thread).
#pragma unroll 1
    for (int r = 0; r < BLOCK_M; r += 32) {
        RowTile<32> t;
        t.load(q, p.q_st.seq, blk.m0 + r, blk.Sq);
        t.store<BLOCK_M>(smem.q(), r);
    }
    publish(smem.q_full());

    const u32 k_base = smem.k(), v_base = smem.v();
    auto store_k = [&](const RowTile<BLOCK_N>& t, int j) {
        const u32 s = stage_of(j);
        if (j >= STAGES) mbar_wait(smem.k_empty(s), phase_of(j) ^ 1);
        t.store<BLOCK_N>(k_base + s * TERMS * PART_BYTES(BLOCK_N), 0);
        publish(smem.k_full(s));
    };
    auto store_v = [&](const VTile& t, int j) {
        const u32 s = stage_of(j);
        if (j >= STAGES) mbar_wait(smem.v_empty(s), phase_of(j) ^ 1);
        t.store(v_base + s * TERMS * PART_BYTES(BLOCK_N));
        publish(smem.v_full(s));
    };
    // The consumers' order: K_0, K_1, V_0, K_2, V_1, ... (P_{j-1} V_{j-1} is issued after S_j).
    const int n = blk.key_walk().n_tiles;
    if (n == 0) return;
    RowTile<BLOCK_N> kt;
    kt.load(k, p.k_st.seq, 0, blk.Sk);
    store_k(kt, 0);
#pragma unroll 1
    for (int j = 0; j < n; ++j) {
        VTile vt;
        if (j + 1 < n) kt.load(k, p.k_st.seq, (j + 1) * BLOCK_N, blk.Sk);
        vt.load(v, p.v_st.seq, j * BLOCK_N, blk.Sk);
        if (j + 1 < n) store_k(kt, j + 1);
        store_v(vt, j);
    }
}

// ---- the consumers ----------------------------------------------------------------------------------
// Descriptor of k-step kk (8 elements) of a K-major operand: column block kk / 4, 32 bytes per step in it.
__device__ __forceinline__ u64 kdesc(u32 base, int rows, int kk) {
    return desc_sw128(base + (kk / 4) * CB_BYTES(rows) + (kk % 4) * 32, 0);
}

// d = the TF32_TERMS products of A (ss: rows a_rows, parts at a, a + a_part) and B (rows b_rows,
// parts at b, b + b_part) over every k-step, from zero: the correction products first (their sums
// are small), then big x big.
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
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) WgmmaTf32<N>::ss(d, kdesc(a, a_rows, kk), kdesc(b, b_rows, kk), kk > 0);
#endif
}

// S = Q K^T for the warpgroup's 64 rows (q: their first row's address in Q's big part), K at k;
// issued, not waited for.
__device__ __forceinline__ void issue_qk(float (&s)[BLOCK_N / 8][4], u32 q, u32 k) {
    wgmma_fence();
    ss_products<BLOCK_N>(s, q, PART_BYTES(BLOCK_M), BLOCK_M, k, PART_BYTES(BLOCK_N), BLOCK_N);
    wgmma_commit();
}

// P's A fragments (8 keys each): big and (TERMS = 2) small parts.
struct PFrag {
    u32 big[BLOCK_N / 8][4];
#if TERMS == 2
    u32 small[BLOCK_N / 8][4];
#endif
    // From probabilities in accumulator layout: a = {s0, s2, s1, s3} (the keys' order in V^T).
    __device__ __forceinline__ void set(const float (&s)[BLOCK_N / 8][4]) {
#pragma unroll
        for (int nt = 0; nt < BLOCK_N / 8; ++nt) {
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

// o (+)= P V for the N output columns d0.. (rs: P's parts in registers, V^T's at v); `acc` = 0
// starts o from zero. Issued, not waited for.
template <int N>
__device__ __forceinline__ void issue_pv(float (&o)[N / 8][4], const PFrag& pf, u32 v, int d0, bool acc) {
    wgmma_fence();
    constexpr int KS = BLOCK_N / 8;
    v += d0 * 128;  // V^T row d0 of each column block (128 bytes a row; d0 a multiple of the swizzle's 8 rows)
#if TERMS == 2
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) WgmmaTf32<N>::rs(o, pf.big[kk], kdesc(v + PART_BYTES(BLOCK_N), HEAD_DIM, kk), acc || kk > 0);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) WgmmaTf32<N>::rs(o, pf.small[kk], kdesc(v, HEAD_DIM, kk), 1);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) WgmmaTf32<N>::rs(o, pf.big[kk], kdesc(v, HEAD_DIM, kk), 1);
#else
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) WgmmaTf32<N>::rs(o, pf.big[kk], kdesc(v, HEAD_DIM, kk), acc || kk > 0);
#endif
    wgmma_commit();
}

// d[i0 + i] += x[i] for x's rows.
template <int R, int C, int RX>
__device__ __forceinline__ void add_into(float (&d)[R][C], const float (&x)[RX][C], int i0) {
#pragma unroll
    for (int i = 0; i < RX; ++i)
#pragma unroll
        for (int j = 0; j < C; ++j) d[i0 + i][j] += x[i][j];
}

// A consumer warpgroup (c = 0, 1) on rows m0 + 64 c .. of the block.
__device__ __forceinline__ void consume(const FlashParams& p, const QueryBlock& blk, const SmemAt smem, int c) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int row0 = blk.m0 + 64 * c + 16 * warp;  // this warp's 16 rows
    const Visibility vis = blk.vis();

    float o[HEAD_DIM / 8][4];
    float s[BLOCK_N / 8][4];
#if FRESH_O
    float ot[O_PART / 8][4];  // one key tile's P V, O_PART columns of it
#endif
    PFrag pf;
    OnlineSoftmax sm;
    zero(o);
    sm.init(NEG_INF);
    mbar_wait(smem.q_full(), 0);

    auto softmax_step = [&](const KeyWalk& w, float (&alpha)[2]) {
        if (blk.tile_mask(w)) mask_tile<BLOCK_N / 8>(s, row0, w.n0(), vis);
        sm.step_scaled(s, p.scale_log2, alpha);
    };
    // O (+)= P_{j-1} V_{j-1} (V^T at v): FRESH_O issues its first O_PART columns into ot and returns;
    // pv_rest waits for them, adds them to O in f32 and does the other parts one by one. Else the
    // products chain into O: issued here, pv_rest waits.
    auto pv_issue = [&](u32 v) {
#if FRESH_O
        issue_pv<O_PART>(ot, pf, v, 0, false);
#else
        issue_pv<HEAD_DIM>(o, pf, v, 0, true);
#endif
    };
    auto pv_rest = [&](u32 v) {
        wgmma_wait<0>();
#if FRESH_O
        fence_regs(ot);
        add_into(o, ot, 0);
#pragma unroll
        for (int part = 1; part < HEAD_DIM / O_PART; ++part) {
            issue_pv<O_PART>(ot, pf, v, part * O_PART, false);
            wgmma_wait<0>();
            fence_regs(ot);
            add_into(o, ot, part * O_PART / 8);
        }
#else
        fence_regs(o);
#endif
    };

    KeyWalk w = blk.key_walk();
    const u32 q = opaque(smem.q()) + 64 * c * 128;
    u32 prev = 0;  // the stage of the tile whose P V is pending
    bool pending = false;
    for (; w.more(); w.advance()) {
        const u32 st = stage_of(w.j);
        mbar_wait(smem.k_full(st), phase_of(w.j));
        issue_qk(s, q, opaque(smem.k()) + st * TERMS * PART_BYTES(BLOCK_N));
        const u32 v = opaque(smem.v()) + prev * TERMS * PART_BYTES(BLOCK_N);
        if (pending) {
            mbar_wait(smem.v_full(prev), phase_of(w.j - 1));
            pv_issue(v);
        }
        float alpha[2];
        if (pending) {
            wgmma_wait<1>();  // S_j has landed; P_{j-1} V_{j-1} may still run
            if (lane == 0) mbar_arrive(smem.k_empty(st));
            fence_regs(s);
            softmax_step(w, alpha);
            pv_rest(v);
            if (lane == 0) mbar_arrive(smem.v_empty(prev));
        } else {
            wgmma_wait<0>();
            if (lane == 0) mbar_arrive(smem.k_empty(st));
            fence_regs(s);
            softmax_step(w, alpha);
        }
        OnlineSoftmax::rescale_rows(o, alpha);
        pf.set(s);
        prev = st;
        pending = true;
    }
    if (pending) {
        const u32 v = opaque(smem.v()) + prev * TERMS * PART_BYTES(BLOCK_N);
        mbar_wait(smem.v_full(prev), phase_of(w.j - 1));
        pv_issue(v);
        pv_rest(v);
        if (lane == 0) mbar_arrive(smem.v_empty(prev));
    }

    store_rows<HEAD_DIM / 8>(p, blk, o, sm, row0);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) flash_fwd_sm90(const FlashParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const SmemAt smem{(smem_addr(smem_raw) + 1023) & ~1023u};
    const QueryBlock blk(p);
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        mbar_init(smem.q_full(), PRODUCER_THREADS);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem.k_full(s), PRODUCER_THREADS);
            mbar_init(smem.v_full(s), PRODUCER_THREADS);
            mbar_init(smem.k_empty(s), 4 * CONSUMERS);  // every consumer warp's lane 0
            mbar_init(smem.v_empty(s), 4 * CONSUMERS);
        }
        mbar_fence_init();
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        produce(p, blk, smem);
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        consume(p, blk, smem, wg - 1);
    }
}
