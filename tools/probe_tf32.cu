// Probe (development, not built): do the TF32 wgmma wrappers compile to HGMMA .TF32? Compile with
// NVRTC for sm_90a with cuda/ on the include path and FLASH_DTYPE=2; cuobjdump -sass shows
// HGMMA.64x64x8.F32.TF32 for both the smem-smem and the register-A form (checked 2026-11-23).
#include "wgmma.h"
extern "C" __global__ void probe(float* out, u64 da, u64 db) {
    float d[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) d[i][0] = d[i][1] = d[i][2] = d[i][3] = 0.f;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    WgmmaTf32<64>::ss(d, da, db, 0);
    const u32 a[4] = {__float_as_uint(out[0]), __float_as_uint(out[1]), __float_as_uint(out[2]), __float_as_uint(out[3])};
    WgmmaTf32<64>::rs(d, a, db, 1);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < 8; ++i) out[threadIdx.x * 32 + i * 4] = d[i][0] + d[i][1] + d[i][2] + d[i][3];
}
