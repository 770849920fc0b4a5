// bwd_dq_sm90_f32_entry.h — the kernel entry of the Hopper f32 dQ kernels (bwd_dq_sm90_f32.cu on
// TF32 parts, bwd_dq_sm90_f32_f16.cu on fp16 parts), included last by each: they define SmemAt
// (qdo_full and the stages' full / empty mbarriers), produce, consume and STAGES.
#pragma once

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) flash_bwd_dq_sm90(const FlashParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const SmemAt smem{swizzled_base(smem_raw)};
    const QueryBlock blk(p);
    if (threadIdx.x == 0) {
        mbar_init(smem.qdo_full(), PRODUCER_THREADS);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem.full(s), PRODUCER_THREADS);
            mbar_init(smem.empty(s), 4 * CONSUMERS);  // every consumer warp's lane 0
        }
        mbar_fence_init();
    }
    __syncthreads();
    run_roles<PRODUCER_REGS, CONSUMER_REGS>([&] { produce(p, blk, smem); }, [&](int c) { consume(p, blk, smem, c); });
}
