// bwd_dkdv_sm90_f32_entry.h — the kernel entry of the Hopper f32 dK/dV kernels (bwd_dkdv_sm90_f32.cu
// on TF32 parts, bwd_dkdv_sm90_f32_f16.cu on fp16 parts), included last by each: they define SmemAt
// (kv_full and the stages' full / empty mbarriers), produce, STAGES and, with ROLES,
// consume_role<0 | 1>, else consume.
#pragma once

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) flash_bwd_sm90(const FlashParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const SmemAt smem{swizzled_base(smem_raw)};
    const KeyBlock blk(p);
    if (threadIdx.x == 0) {
        mbar_init(smem.kv_full(), PRODUCER_THREADS);
#pragma unroll
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(smem.full(st), PRODUCER_THREADS);
            mbar_init(smem.empty(st), 4 * CONSUMERS);  // every consumer warp's lane 0
        }
        mbar_fence_init();
    }
    __syncthreads();
#if ROLES
    run_roles<PRODUCER_REGS, CONSUMER_REGS>([&] { produce(p, blk, smem); }, [&](int c) {
        if (c == 0)
            consume_role<0>(p, blk, smem);
        else
            consume_role<1>(p, blk, smem);
    });
#else
    run_roles<PRODUCER_REGS, CONSUMER_REGS>([&] { produce(p, blk, smem); }, [&](int c) { consume(p, blk, smem, c); });
#endif
}
