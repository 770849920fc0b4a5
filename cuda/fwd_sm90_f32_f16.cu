// fwd_sm90_f32_f16.cu — the "exact" f32 attention forward for Hopper (sm_90a) with its products on
// fp16 warpgroup MMA (m64nNk16, f32 accumulators): each f32 operand x is held as two fp16 parts of
// a power-of-two-scaled copy, x 2^e = big + small, big = f16(x 2^e), small = f16(x 2^e - big)
// (x 2^e - big is exact in f32), and a b ~ big_a small_b + small_a big_b + big_a big_b, unscaled
// by 2^-(e_a + e_b). 11 + 11 significant bits, as split TF32 (fwd_sm90_f32.cu), at twice TF32's
// tensor rate and half its shared-memory bytes.
//
// The scaling keeps both parts normal fp16: e brings a tile's largest |x| into [2^14, 2^15), so
// big <= 2^15 < 65504, and every element down to 2^-17 of that largest one keeps a normal small
// part (fp16's normals start at 2^-14; below, the error stays under 2^-39 of the tile's largest
// element: absolute, which is what the scores' softmax and o's sums feel). One exponent per 32
// query rows (Q), per key tile (K, V); P = exp2(...) <= 1 takes a fixed 2^15.
//
// D = 64 and 128, plain problems (causal or not, GQA); TF32_TERMS = 3 only (the "tf32" precision
// runs fwd_sm90_f32.cu). Grid (ceil(Sq / BLOCK_M), H, B), causal heaviest first; NUM_WARPS = 12:
// - warpgroup 0, the producer: loads Q (32 rows at a time), then K_0, K_1, V_0, K_2, V_1, ... from
//   global memory into registers, finds the tile's exponent (a max over the warpgroup), and stores
//   the parts into 128-byte-swizzled [D / 64][rows][64] column blocks (fwd_sm90.cu's layout: Q and
//   K read K-major, V MN-major), the exponent beside them; then arrives on the stage's mbarrier.
// - warpgroups 1, 2 own 64 query rows each (warp w: 16 rows, the mma.sync accumulator layout).
//   Per key tile j: S_j = Q K_j^T (ss, 3 D / 16 wgmmas chained from zero) is issued with the first
//   O_PART columns of P_{j-1} V_{j-1} (rs: P's parts in registers), the softmax of S_j (its scale
//   times the tile's 2^-(e_q + e_k)) runs while that product is on the tensor cores; each O_PART
//   slice of P V is summed in a fresh accumulator and added to O in f32 times 2^-(15 + e_v)
//   (one chain over every key tile would bias o with the tensor cores' truncating adds, see
//   fwd_sm90_f32.cu).
//
// Shared memory (two fp16 parts each): Q 2 BLOCK_M D 2 bytes, K and V 2 BLOCK_N D 2 bytes a stage.
//   D = 128: BLOCK_M 128, BLOCK_N 64, two K and two V stages: 64 + 64 + 64 KiB = 192 KiB.
//   D = 64: the same tiles, 96 KiB.
#include "sm90_f32.h"
#include "tile.h"
#include "block.h"
#include "softmax.h"
#include "fwd_store.h"

#define CONSUMERS (NUM_WARPS / 4 - 1)
#ifndef STAGES
#define STAGES 2
#endif
#ifndef K_STAGES
#define K_STAGES STAGES
#endif
#if !F16_PARTS || FLASH_DTYPE != 2 || CONSUMERS != 2 || BLOCK_M != 64 * CONSUMERS || (BLOCK_N != 64 && BLOCK_N != 32) || MASKED
#error "fwd_sm90_f32_f16: f32, two consumer warpgroups of 64 rows, BLOCK_N 64, plain"
#endif

#define COL_BLOCKS (HEAD_DIM / 64)                     // 64-element (128-byte) column blocks of a row
#define H_PART_BYTES(rows) ((rows) * HEAD_DIM * 2)      // one fp16 part of a [rows][D] tile
#define O_PART 64                                      // P V's columns per fresh accumulator
#define P_EXP 15                                       // P's scale: P 2^15 <= 2^15
#define SCALE_BARRIER 1                                // the producer's named barrier (exponents)
// Registers after setmaxnreg (run_roles checks the split): the producer holds one K or V tile (D = 128:
// 64 floats) and its addresses; a consumer O (64), S (32), P's parts (32) and a P V slice (32).
#define PRODUCER_REGS 120
#define CONSUMER_REGS 192

// Shared memory, from a base aligned to the swizzle's period: Q [2][D / 64][BLOCK_M][64];
// K [K_STAGES][2][D / 64][BLOCK_N][64]; V [STAGES][the same]; the exponents (int): Q's per 32 rows,
// K's and V's per stage, and the producer's max exchange (2 slots of 4 warps); the mbarriers.
constexpr u32 SMEM_Q = 0;
constexpr u32 SMEM_K = SMEM_Q + TERMS * H_PART_BYTES(BLOCK_M);
constexpr u32 SMEM_V = SMEM_K + K_STAGES * TERMS * H_PART_BYTES(BLOCK_N);
constexpr u32 SMEM_EXP = SMEM_V + STAGES * TERMS * H_PART_BYTES(BLOCK_N);
constexpr u32 EXP_Q = 0, EXP_K = BLOCK_M / 32, EXP_V = EXP_K + K_STAGES, EXP_XCHG = EXP_V + STAGES;
constexpr u32 SMEM_BARS = SMEM_EXP + 4 * ((EXP_XCHG + 8 + 1) / 2 * 2);
constexpr u32 SMEM_END = SMEM_BARS + 8 * (1 + 2 * K_STAGES + 2 * STAGES);
FLASH_EXPORT_SMEM(SWIZZLED_SMEM_BYTES(SMEM_END))

struct SmemAt {
    u32 base;
    __device__ __forceinline__ u32 q() const { return base + SMEM_Q; }
    __device__ __forceinline__ u32 k(u32 s) const { return base + SMEM_K + s * TERMS * H_PART_BYTES(BLOCK_N); }
    __device__ __forceinline__ u32 v(u32 s) const { return base + SMEM_V + s * TERMS * H_PART_BYTES(BLOCK_N); }
    __device__ __forceinline__ u32 exp(u32 i) const { return base + SMEM_EXP + 4 * i; }
    __device__ __forceinline__ u32 q_full() const { return base + SMEM_BARS; }
    __device__ __forceinline__ u32 k_full(u32 s) const { return base + SMEM_BARS + 8 * (1 + s); }
    __device__ __forceinline__ u32 k_empty(u32 s) const { return base + SMEM_BARS + 8 * (1 + K_STAGES + s); }
    __device__ __forceinline__ u32 v_full(u32 s) const { return base + SMEM_BARS + 8 * (1 + 2 * K_STAGES + s); }
    __device__ __forceinline__ u32 v_empty(u32 s) const { return base + SMEM_BARS + 8 * (1 + 2 * K_STAGES + STAGES + s); }
};

using KRing = Ring<K_STAGES>;
using VRing = Ring<STAGES>;

__device__ __forceinline__ int ld_shared_s32(u32 addr) {
    int v;
    asm volatile("ld.shared.s32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void st_shared_v2(u32 addr, u32 a, u32 b) {
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(addr), "r"(a), "r"(b) : "memory");
}

// 2^e as f32 (e in [-126, 127]).
__device__ __forceinline__ float exp2i(int e) { return __int_as_float((127 + e) << 23); }

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
// (slot `slot` of the exchange, alternating, so that a fast warp's next write cannot meet a slow
// warp's read). Zero tiles take 2^126 (harmless); inf / NaN ones 2^-114 (they stay non-finite).
__device__ __forceinline__ int tile_exponent(u32 bits, const SmemAt smem, int& slot) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, o));
    const int warp = (threadIdx.x / 32) % 4;
    const u32 xchg = smem.exp(EXP_XCHG + 4 * slot);
    if (threadIdx.x % 32 == 0) st_shared_u32(xchg + 4 * warp, bits);
    named_sync(SCALE_BARRIER, PRODUCER_THREADS);
#pragma unroll
    for (int w = 0; w < 4; ++w) bits = max(bits, (u32)ld_shared_s32(xchg + 4 * w));
    slot ^= 1;
    const int e = 14 - ((int)(bits >> 23) - 127);
    return min(max(e, -126), 126);
}

// A [R][D] f32 tile held by the producer (RowTile's chunks: thread i the 16-byte chunks i, i + 128,
// ...), stored as its two scaled fp16 parts.
template <int R>
struct HalfTile {
    RowTile<R> t;

    // RowTile::load with one running pointer (row r_first + ROWS_PER_STEP i of the thread's column):
    // its own addresses per chunk, all hoisted, spilled the producer at D = 128.
    __device__ __forceinline__ void load(const float* src, i64 stride, int r0, int nrows) {
        constexpr int LANES_PER_ROW = HEAD_DIM / 4, ROWS_PER_STEP = PRODUCER_THREADS / LANES_PER_ROW;
        const int tid = threadIdx.x % PRODUCER_THREADS, r_first = tid / LANES_PER_ROW;
        const float* at = src + (i64)(r0 + r_first) * stride + 4 * (tid % LANES_PER_ROW);
        const i64 step = ROWS_PER_STEP * stride;
        const int valid = nrows - r0 - r_first;  // rows of this thread's column left, from r_first
#pragma unroll
        for (int i = 0; i < RowTile<R>::CHUNKS; ++i) {
            t.x[i] = ROWS_PER_STEP * i < valid ? *reinterpret_cast<const float4*>(at) : make_float4(0.f, 0.f, 0.f, 0.f);
            at += step;
        }
    }

    __device__ __forceinline__ u32 max_bits() const {
        u32 m = 0;
#pragma unroll
        for (int i = 0; i < RowTile<R>::CHUNKS; ++i) {
            m = max(m, max(__float_as_uint(t.x[i].x) & 0x7fffffffu, __float_as_uint(t.x[i].y) & 0x7fffffffu));
            m = max(m, max(__float_as_uint(t.x[i].z) & 0x7fffffffu, __float_as_uint(t.x[i].w) & 0x7fffffffu));
        }
        return m;
    }
    // Into the parts at `base` (parts `part` bytes apart) of a [ROWS][D] tile as rows row_off..,
    // scaled by 2^e.
    template <int ROWS>
    __device__ __forceinline__ void store(u32 base, int row_off, int e) const {
        const int tid = threadIdx.x % PRODUCER_THREADS;
        const float f = exp2i(e);
#pragma unroll
        for (int i = 0; i < RowTile<R>::CHUNKS; ++i) {
            const int c = tid + PRODUCER_THREADS * i, r = row_off + c / (HEAD_DIM / 4), col = 4 * (c % (HEAD_DIM / 4));
            const int within = col % 64;  // 8-byte half (within / 4) % 2 of 16-byte chunk within / 8
            const u32 at = base + (col / 64) * CB_BYTES(ROWS) + r * 128 + (((within / 8) ^ (r & 7)) << 4) + ((within / 4) % 2) * 8;
#if TERMS == 2
            u32 b01, s01, b23, s23;
            split_f16x2(t.x[i].x * f, t.x[i].y * f, b01, s01);
            split_f16x2(t.x[i].z * f, t.x[i].w * f, b23, s23);
            st_shared_v2(at, b01, b23);
            st_shared_v2(at + H_PART_BYTES(ROWS), s01, s23);
#else
            st_shared_v2(at, f16x2(t.x[i].x * f, t.x[i].y * f), f16x2(t.x[i].z * f, t.x[i].w * f));
#endif
        }
    }
};

__device__ __forceinline__ void produce(const FlashParams& p, const QueryBlock& blk, const SmemAt smem) {
    const float* q = p.q + blk.q_at(p.q_st);
    const float* k = p.k + blk.kv_at(p.k_st);
    const float* v = p.v + blk.kv_at(p.v_st);
    int slot = 0;
#pragma unroll 1
    for (int r = 0; r < BLOCK_M; r += 32) {
        HalfTile<32> t;
        t.load(q, p.q_st.seq, blk.m0 + r, blk.Sq);
        const int e = tile_exponent(t.max_bits(), smem, slot);
        t.store<BLOCK_M>(smem.q(), r, e);
        if (threadIdx.x == 0) st_shared_u32(smem.exp(EXP_Q + r / 32), (u32)e);
    }
    publish(smem.q_full());

    // The consumers' order: K_0, V_0, K_1, V_1, ... (P_{j-1} V_{j-1} is issued before S_j).
    auto put = [&](const float* src, i64 stride, int j, bool is_k) {
        HalfTile<BLOCK_N> t;
        t.load(src, stride, j * BLOCK_N, blk.Sk);
        const int e = tile_exponent(t.max_bits(), smem, slot);
        const u32 s = is_k ? KRing::stage(j) : VRing::stage(j);
        const int depth = is_k ? K_STAGES : STAGES;
        if (j >= depth) mbar_wait(is_k ? smem.k_empty(s) : smem.v_empty(s), (is_k ? KRing::phase(j) : VRing::phase(j)) ^ 1);
        t.store<BLOCK_N>(is_k ? smem.k(s) : smem.v(s), 0, e);
        if (threadIdx.x == 0) st_shared_u32(smem.exp((is_k ? EXP_K : EXP_V) + s), (u32)e);
        publish(is_k ? smem.k_full(s) : smem.v_full(s));
    };
    const int n = blk.key_walk().n_tiles;
#pragma unroll 1
    for (int j = 0; j < n; ++j) {
        put(k, p.k_st.seq, j, true);
        put(v, p.v_st.seq, j, false);
    }
}

// ---- the consumers ----------------------------------------------------------------------------------
// Descriptor of k-step kk (16 elements) of a K-major [rows][D] fp16 part at `part`.
__device__ __forceinline__ u64 hdesc(u32 part, int rows, int kk) {
    return desc_sw128(part + (kk / 4) * CB_BYTES(rows) + (kk % 4) * 32, 0);
}

// S = Q K^T for the warpgroup's 64 rows (q: their first row in Q's big part), K's parts at k;
// the correction products first (their sums are small), then big x big. Issued, not waited for.
__device__ __forceinline__ void issue_qk(float (&s)[BLOCK_N / 8][4], u32 q, u32 k) {
    constexpr int KS = HEAD_DIM / 16;
    constexpr u32 QP = H_PART_BYTES(BLOCK_M), KP = H_PART_BYTES(BLOCK_N);
    wgmma_fence();
#if TERMS == 2
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) Wgmma<BLOCK_N>::ss(s, hdesc(q, BLOCK_M, kk), hdesc(k + KP, BLOCK_N, kk), kk > 0);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) Wgmma<BLOCK_N>::ss(s, hdesc(q + QP, BLOCK_M, kk), hdesc(k, BLOCK_N, kk), 1);
#else
    (void)QP, (void)KP;
#endif
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) Wgmma<BLOCK_N>::ss(s, hdesc(q, BLOCK_M, kk), hdesc(k, BLOCK_N, kk), TERMS == 2 || kk > 0);
    wgmma_commit();
}

// P's parts (scaled by 2^P_EXP) as the A fragments of P V, 16 keys each (the accumulator layout's
// pairs are the fp16 A fragment's).
struct PParts {
    u32 big[BLOCK_N / 16][4];
#if TERMS == 2
    u32 small[BLOCK_N / 16][4];
#endif
    __device__ __forceinline__ void set(const float (&s)[BLOCK_N / 8][4]) {
        const float f = exp2i(P_EXP);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#if TERMS == 2
                split_f16x2(s[2 * kk + h][0] * f, s[2 * kk + h][1] * f, big[kk][2 * h], small[kk][2 * h]);
                split_f16x2(s[2 * kk + h][2] * f, s[2 * kk + h][3] * f, big[kk][2 * h + 1], small[kk][2 * h + 1]);
#else
                big[kk][2 * h] = f16x2(s[2 * kk + h][0] * f, s[2 * kk + h][1] * f);
                big[kk][2 * h + 1] = f16x2(s[2 * kk + h][2] * f, s[2 * kk + h][3] * f);
#endif
            }
    }
};

// ot = P V for the O_PART output columns of column block cb, fresh (V's parts at v, MN-major).
// Issued, not waited for.
__device__ __forceinline__ void issue_pv(float (&ot)[O_PART / 8][4], const PParts& pp, u32 v, int cb) {
    constexpr u32 VP = H_PART_BYTES(BLOCK_N);
    const u32 at = v + cb * CB_BYTES(BLOCK_N);
    wgmma_fence();
#if TERMS == 2
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        Wgmma<O_PART>::rs(ot, pp.big[kk], desc_sw128(at + VP + kk * 16 * 128, CB_BYTES(BLOCK_N)), kk > 0);
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) Wgmma<O_PART>::rs(ot, pp.small[kk], desc_sw128(at + kk * 16 * 128, CB_BYTES(BLOCK_N)), 1);
#else
    (void)VP;
#endif
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        Wgmma<O_PART>::rs(ot, pp.big[kk], desc_sw128(at + kk * 16 * 128, CB_BYTES(BLOCK_N)), TERMS == 2 || kk > 0);
    wgmma_commit();
}

// A consumer warpgroup (c = 0, 1) on rows m0 + 64 c .. of the block.
__device__ __forceinline__ void consume(const FlashParams& p, const QueryBlock& blk, const SmemAt smem, int c) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int row0 = blk.m0 + 64 * c + 16 * warp;  // this warp's 16 rows
    const Visibility vis = blk.vis();

    float o[HEAD_DIM / 8][4];
    float s[BLOCK_N / 8][4];
    float ot[O_PART / 8][4];
    PParts pp;
    OnlineSoftmax sm;
    zero(o);
    sm.init(NEG_INF);
    mbar_wait(smem.q_full(), 0);
    // The scores' scale with Q's 2^-e of this warp's 32-row group (K's per tile below).
    const float q_scale = p.scale_log2 * exp2i(-ld_shared_s32(smem.exp(EXP_Q + (64 * c + 16 * warp) / 32)));

    // o += ot 2^-(P_EXP + ev): a slice of P V (output column block cb) added in f32.
    auto add_slice = [&](int cb, int ev) {
        const float f = exp2i(-P_EXP) * exp2i(-ev);
        fence_regs(ot);
#pragma unroll
        for (int i = 0; i < O_PART / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[cb * (O_PART / 8) + i][e] = fmaf(ot[i][e], f, o[cb * (O_PART / 8) + i][e]);
    };
    // O += P V for V at stage vs, one O_PART-column slice at a time; then V's stage is free.
    auto pv = [&](u32 vs) {
        const u32 v = opaque(smem.v(vs));
        const int ev = ld_shared_s32(smem.exp(EXP_V + vs));
#pragma unroll
        for (int cb = 0; cb < COL_BLOCKS; ++cb) {
            issue_pv(ot, pp, v, cb);
            wgmma_wait<0>();
            add_slice(cb, ev);
        }
        if (lane == 0) mbar_arrive(smem.v_empty(vs));
    };

    // Per key tile j: P_{j-1} V_{j-1} slice by slice, then S_j (issued last, so that P's parts and
    // the slice's accumulator are dead while S_j's registers are live: with S_j in flight beside
    // them, or a softmax overlapping P V, the consumers spilled at D = 128). The other consumer
    // warpgroup's products fill the tensor cores meanwhile.
    KeyWalk w = blk.key_walk();
    const u32 q = opaque(smem.q()) + 64 * c * 128;
    for (; w.more(); w.advance()) {
        const u32 st = KRing::stage(w.j), vs = VRing::stage(w.j - 1);
        if (w.j > 0) {
            mbar_wait(smem.v_full(vs), VRing::phase(w.j - 1));
            pv(vs);
        }
        mbar_wait(smem.k_full(st), KRing::phase(w.j));
        issue_qk(s, q, opaque(smem.k(st)));
        wgmma_wait<0>();
        const int ek = ld_shared_s32(smem.exp(EXP_K + st));
        if (lane == 0) mbar_arrive(smem.k_empty(st));
        fence_regs(s);
        float alpha[2];
        if (blk.tile_mask(w)) mask_tile<BLOCK_N / 8>(s, row0, w.n0(), vis);
        // (> 0: an underflowing product of tiny q and k scores 0 instead of NaN on masked -inf)
        sm.step_scaled(s, fmaxf(q_scale * exp2i(-ek), 1.17549435e-38f), alpha);
        OnlineSoftmax::rescale_rows(o, alpha);
        pp.set(s);
    }
    if (w.j > 0) {
        const u32 vs = VRing::stage(w.j - 1);
        mbar_wait(smem.v_full(vs), VRing::phase(w.j - 1));
        pv(vs);
    }

    store_rows<HEAD_DIM / 8>(p, blk, o, sm, row0);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) flash_fwd_sm90(const FlashParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const SmemAt smem{swizzled_base(smem_raw)};
    const QueryBlock blk(p);
    if (threadIdx.x == 0) {
        mbar_init(smem.q_full(), PRODUCER_THREADS);
#pragma unroll
        for (int s = 0; s < K_STAGES; ++s) {
            mbar_init(smem.k_full(s), PRODUCER_THREADS);
            mbar_init(smem.k_empty(s), 4 * CONSUMERS);  // every consumer warp's lane 0
        }
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem.v_full(s), PRODUCER_THREADS);
            mbar_init(smem.v_empty(s), 4 * CONSUMERS);
        }
        mbar_fence_init();
    }
    __syncthreads();
    run_roles<PRODUCER_REGS, CONSUMER_REGS>([&] { produce(p, blk, smem); }, [&](int c) { consume(p, blk, smem, c); });
}
