// Probe (development, not built by the library): how fast can decode's warp-owned stages be filled
// from a 4-bit cache [B, S, Hkv, 64 bytes] (D = 128), with no compute? Each block takes one (b, kv
// head, split) as decode.cu does (128 threads, two 128-key stages, a warp's blocks wk and wk + 4
// of each stage), and fills them either by cp.async (16 bytes a lane, rows 80 bytes apart, as
// WarpCopy) or by the tensor copy engine (one 16-row box a block for K and one for V, 64-byte
// swizzle, an mbarrier per warp and stage). SCALES adds the four 4-byte scale rows per key by
// cp.async in both. tools/probe_decode_copy.py compiles and times it.
#include "hopper.h"

#define ROWS 16              // keys of a block
#define STAGE_KEYS 128       // keys of a stage (4 warps x 2 blocks)
#define ROW 64               // bytes of a 4-bit row at D = 128
#define SROW 80              // cp.async rows: an odd number of 16-byte units apart
#define STAGE_BYTES (STAGE_KEYS * 2 * SROW + STAGE_KEYS * 16)

struct Params {
    const unsigned char* k;
    const unsigned char* v;
    const unsigned char* sc[4];  // k scale, k bias, v scale, v bias: [B, S, Hkv, 2] bf16
    int s, hkv, keys, use_tma, scales;
    unsigned* sink;
};

extern "C" __global__ void __launch_bounds__(128, 3)
    probe(const __grid_constant__ Params p, const __grid_constant__ TensorMap tk, const __grid_constant__ TensorMap tv,
          const __grid_constant__ TensorMap tk80, const __grid_constant__ TensorMap tv80) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const int kvh = blockIdx.x % p.hkv, split = blockIdx.x / p.hkv, b = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int key0 = split * p.keys;
    const u32 base = smem_addr(smem);
    __shared__ __align__(8) unsigned long long bars[4][2];
    const u32 bar0 = smem_addr(&bars[warp][0]);
    if (p.use_tma && lane == 0) {
        mbar_init(bar0, 1);
        mbar_init(bar0 + 8, 1);
        mbar_fence_init();
    }
    __syncwarp();
    const int stages = p.keys / STAGE_KEYS;
    unsigned acc = 0;
    auto issue = [&](int t) {
        const int s = t & 1;
        const u32 st = base + s * STAGE_BYTES;
        const int kbase = key0 + t * STAGE_KEYS;
        for (int j = 0; j < 2; ++j) {
            const int r0 = (warp + 4 * j) * ROWS;
            const long long row = ((long long)b * p.s + kbase + r0);  // key row index
            if (p.use_tma) {
                if (lane == 0 && p.use_tma == 2) {
                    // 80-byte boxes (the head's row and the next head's first 16 bytes), rows 80 apart
                    if (j == 0) mbar_expect_tx(bar0 + 8 * s, 4 * ROWS * SROW);
                    tma_load_2d(st + r0 * SROW, &tk80, kvh * ROW, (int)row, bar0 + 8 * s);
                    tma_load_2d(st + STAGE_KEYS * SROW + r0 * SROW, &tv80, kvh * ROW, (int)row, bar0 + 8 * s);
                } else if (lane == 0) {
                    if (j == 0) mbar_expect_tx(bar0 + 8 * s, 4 * ROWS * ROW);
                    // 2-d boxes [64 bytes, 16 keys] at (kvh * 64, row): dense 64-byte rows, 64-byte swizzle.
                    asm volatile(
                        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                        ::"r"(st + r0 * ROW), "l"(&tk), "r"(kvh * ROW), "r"((int)row), "r"(bar0 + 8 * s) : "memory");
                    asm volatile(
                        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                        ::"r"(st + STAGE_KEYS * ROW + r0 * ROW), "l"(&tv), "r"(kvh * ROW), "r"((int)row), "r"(bar0 + 8 * s) : "memory");
                }
            } else {
                const int z = lane % 4, i0 = lane / 4;
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const int r = r0 + i0 + 8 * i;
                    const long long src = ((row + i0 + 8 * i) * p.hkv + kvh) * ROW + 16 * z;
                    const u32 dk = st + r * SROW + 16 * z, dv = st + STAGE_KEYS * SROW + r * SROW + 16 * z;
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dk), "l"(p.k + src) : "memory");
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dv), "l"(p.v + src) : "memory");
                }
            }
            if (p.scales) {
                // 16 keys x 4 arrays of one 4-byte word: two a lane.
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int e = lane + 32 * c, a = e / 16, r = e % 16;
                    const long long src = ((row + r) * p.hkv + kvh) * 4;
                    const u32 d = st + 2 * STAGE_KEYS * SROW + (a * STAGE_KEYS + r0 + r) * 4;
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(p.sc[a] + src) : "memory");
                }
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    issue(0);
    for (int t = 0; t < stages; ++t) {
        if (t + 1 < stages) {
            issue(t + 1);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        if (p.use_tma) mbar_wait(bar0 + 8 * (t & 1), (t >> 1) & 1);
        __syncwarp();
        // Touch the warp's rows (one word a lane) so the stage is read as decode reads it.
        const u32 st = base + (t & 1) * STAGE_BYTES;
        u32 x;
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(x) : "r"(st + (warp * ROWS) * (p.use_tma == 1 ? ROW : SROW) + 4 * lane));
        acc += x;
        __syncwarp();
    }
    if (acc == 0x12345678u) p.sink[0] = acc;
}
