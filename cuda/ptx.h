// ptx.h — the attention kernels' inline-PTX wrappers in one place: shared-memory addresses,
// cp.async, ldmatrix, mma.sync m16n8k16, exp2 (the dtype conversions are types.h's, which every
// kernel includes). Needs sm_80 or newer; no CUDA headers.
#pragma once
#include "params.h"

// ---- shared memory, async copies ----------------------------------------------------------------
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// 16-byte global -> shared copy (bypassing L1) to a shared address; when !valid the 16 bytes are
// zero-filled and src is not read.
__device__ __forceinline__ void cp_async16_u32(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) { cp_async16_u32(smem_addr(dst), src, valid); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// ---- tensor cores -------------------------------------------------------------------------------
// Four 8x8 b16 matrices; lane l gives the row address for matrix l/8, row l%8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(u32 (&r)[2], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// c[16x8] += a[16x16] * b[16x8], f32 accumulators.
// Fragment layout (g = lane/4, t = lane%4): a = {(g,2t..), (g+8,2t..), (g,2t+8..), (g+8,2t+8..)},
// b = {(k=2t.., n=g), (k=2t+8.., n=g)}, c = {(g,2t), (g,2t+1), (g+8,2t), (g+8,2t+1)}.
// mma16816_f16 takes fp16 operands whatever elem_t is (decode_q8.h's codes are fp16 2^10 + code),
// mma16816 elem_t's.
__device__ __forceinline__ void mma16816_f16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if FLASH_DTYPE == 1
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif FLASH_DTYPE == 0
    mma16816_f16(c, a, b0, b1);
#endif
}

// f32 -> TF32 (10 explicit mantissa bits), rounded to nearest, ties away from zero; the low 13
// bits of the result are zero.
__device__ __forceinline__ u32 to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// c[16x8] += a[16x8] * b[8x8], TF32 operands (to_tf32), f32 accumulators.
// Fragment layout (g = lane/4, t = lane%4): a = {(g,t), (g+8,t), (g,t+4), (g+8,t+4)},
// b = {(k=t, n=g), (k=t+4, n=g)}, c as mma16816's.
__device__ __forceinline__ void mma1688_tf32(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- global reductions ---------------------------------------------------------------------------
// dst[0] += a, dst[1] += b (relaxed f32 atomics; dst 8-byte aligned). One vector reduction on
// sm_90, two scalar ones before.
__device__ __forceinline__ void red_add_f32x2(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst + 1), "f"(b) : "memory");
#endif
}

// ---- math ---------------------------------------------------------------------------------------
__device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float fast_log2(float x) {
    float r;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
// Reductions over the 4 lanes of a quad (the lanes that share a row of an mma accumulator).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
// Reductions over the 16 lanes of a half-warp (the lanes that share a row in the fp32 kernels).
__device__ __forceinline__ float half_max(float x) {
#pragma unroll
    for (int o = 8; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float half_sum(float x) {
#pragma unroll
    for (int o = 8; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
