// types.h — what every kernel needs, the attention kernels and the ones outside attention
// (rotary.cu) alike: integer types, the storage type elem_t and its conversions to and from f32,
// and the shared-memory size export. Configured by FLASH_DTYPE alone (0 = fp16, 1 = bf16,
// 2 = fp32); no CUDA headers.
#pragma once

#ifndef FLASH_DTYPE
#error "FLASH_DTYPE must be defined (0 = fp16, 1 = bf16, 2 = fp32)"
#endif

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#if FLASH_DTYPE == 2
typedef float elem_t;
#else
typedef u16 elem_t;  // raw fp16 / bf16 bits
#endif

// Every kernel source exports its dynamic shared memory per block exactly once (see params.h's
// shared-memory section); the elementwise kernels export 0.
#define FLASH_EXPORT_SMEM(bytes) extern "C" __device__ const int flash_smem_bytes = (bytes);

// ---- conversions --------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
#if FLASH_DTYPE == 1
__device__ __forceinline__ float to_float(u16 x) { return __uint_as_float(((u32)x) << 16); }
#elif FLASH_DTYPE == 0
__device__ __forceinline__ float to_float(u16 x) {
    float f;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(x));
    return f;
}
#endif

// f32 -> storage type, round to nearest even.
__device__ __forceinline__ elem_t from_float(float x) {
#if FLASH_DTYPE == 2
    return x;
#elif FLASH_DTYPE == 1
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
#else
    u16 r;
    asm("{ .reg .f16 h; cvt.rn.f16.f32 h, %1; mov.b16 %0, h; }" : "=h"(r) : "f"(x));
    return r;
#endif
}

#if FLASH_DTYPE != 2
// Two f32 -> one register of two fp16 values, lo in the low half (the mma fragment order), whatever
// elem_t is.
__device__ __forceinline__ u32 pack2_f16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// The same in elem_t.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
#if FLASH_DTYPE == 1
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return pack2_f16(lo, hi);
#endif
}
#endif
