// fwd_sm90_f32_entry.h — the kernel entry of the Hopper f32 forwards (fwd_sm90_f32.cu on TF32
// parts, fwd_sm90_f32_f16.cu on fp16 parts), included last by each: they define SmemAt (q_full and
// the K and V rings' full / empty mbarriers), produce, consume and the rings' depths.
#pragma once

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
