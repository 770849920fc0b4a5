// warp_reduce.h — max and sum of a float over the 32 lanes of a warp (every lane gets the result),
// for kernels that need no more of ptx.h (the merge of split states, the CUDA-core decode).
#pragma once

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
