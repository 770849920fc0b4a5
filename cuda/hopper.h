// hopper.h — the sm_90a kernels' inline-PTX wrappers: mbarriers, the tensor copy engine (TMA),
// warpgroup MMA fences and shared-memory matrix descriptors, register reallocation and named
// barriers. The MMA instructions themselves are wgmma.h's (generated).
#pragma once
#include "ptx.h"

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

// A tensor map built on the host by cuTensorMapEncodeTiled (cuda/tma.rs), passed by value inside a
// __grid_constant__ parameter: the copy engine reads it from the parameter space.
struct __align__(128) TensorMap {
    u64 opaque[16];
};

// ---- mbarriers ----------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the copy engine (the async proxy).
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// Arrives once and adds `bytes` to the transaction count the phase waits for.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Waits until the phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// One lane of the (converged) warp: true there, false in the others.
__device__ __forceinline__ bool elect_one() {
    u32 pred;
    asm volatile("{ .reg .pred p; elect.sync _|p, 0xffffffff; selp.u32 %0, 1, 0, p; }" : "=r"(pred));
    return pred != 0;
}

// ---- the tensor copy engine ---------------------------------------------------------------------
// Box at coordinates (c0 innermost .. c3) of the 4-d tensor `map` -> shared memory at dst, completing
// on mbarrier bar (which must expect the box's bytes). Elements outside the tensor arrive as zeros.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap* map, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
        ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}
// Box at (c0 innermost, c1) of the 2-d tensor `map` -> shared memory at dst (128-byte aligned), as
// tma_load_4d.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
// The same with an L2 cache policy (createpolicy's 64-bit operand).
__device__ __forceinline__ void tma_load_2d_hint(u32 dst, const TensorMap* map, int c0, int c1, u32 bar, unsigned long long policy) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5;"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
                 : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// ---- warpgroup MMA ------------------------------------------------------------------------------
// Orders this warpgroup's earlier register writes before the next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N committed groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pins a register tile in place around asynchronous MMAs: the compiler may not move its reads or
// writes across this point (the asm "defines" every element).
template <int R, int C>
__device__ __forceinline__ void fence_regs(float (&d)[R][C]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < C; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
}

// Descriptor of a wgmma operand in shared memory with the 128-byte swizzle (what the copy engine
// writes with CU_TENSOR_MAP_SWIZZLE_128B): 8-row groups of 128-byte rows, 1024 bytes apart (SBO);
// `lbo` is the distance between 64-element column blocks along M/N, for MN-major operands only
// (K-major ones step through K by moving the start address).
__device__ __forceinline__ u64 desc_sw128(u32 addr, u32 lbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo & 0x3FFFF) >> 4) << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}

// The value x, opaque to the compiler: computed here, so that the descriptors derived from it are
// not hoisted out of a loop into registers the MMAs' accumulators need.
__device__ __forceinline__ u32 opaque(u32 x) {
    asm volatile("" : "+r"(x));
    return x;
}

// ---- rings of stages -----------------------------------------------------------------------------
// Tile j's slot in a ring of DEPTH shared-memory stages, and the parity of its use of that slot (the
// mbarrier phase its full / empty barriers are waited on with).
template <int DEPTH>
struct Ring {
    static __device__ __forceinline__ u32 stage(int j) { return j % DEPTH; }
    static __device__ __forceinline__ u32 phase(int j) { return (j / DEPTH) & 1; }
};

// ---- registers and named barriers ---------------------------------------------------------------
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads.
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- bulk reductions from shared memory, and the async proxy --------------------------------------
// Makes this thread's earlier generic-proxy writes to shared memory visible to the async proxy
// (wgmma operands, bulk copies), which reads them next.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// dst[i] += src[i] over `bytes` (a multiple of 16; both 16-byte aligned) of f32, shared -> global,
// issued by this thread into its bulk group (bulk_commit, then bulk_wait*).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's bulk groups are still reading their shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Waits until at most N of this thread's bulk groups are incomplete (their writes performed).
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// ---- GPU-scope flags ----------------------------------------------------------------------------
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_f32(u32 addr, float x) {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(x) : "memory");
}
__device__ __forceinline__ void st_shared_f32x2(u32 addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}

#endif
