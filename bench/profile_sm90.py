"""The Hopper forward or backward at D = 128 (or `d64`), S = 8192, bf16 (B*S = 16384, H*D = 2048),
run a few times for a profiler (development tool):

    ncu --kernel-name flash_fwd_sm90 --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        --section WarpStateStats python bench/profile_sm90.py [causal] [backward] [d64]

(the backward's kernel: flash_bwd_sm90).
"""

import sys

import torch

import flash_nif

causal = "causal" in sys.argv[1:]
backward = "backward" in sys.argv[1:]
s, d = 8192, 64 if "d64" in sys.argv[1:] else 128
q, k, v = (torch.randn(16384 // s, s, 2048 // d, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
o, lse = flash_nif.forward_with_states(q, k, v, causal=causal)
do = torch.randn_like(o)
for _ in range(4):
    if backward:
        flash_nif.backward(do, q, k, v, o, lse, causal=causal)
    else:
        flash_nif.forward_with_states(q, k, v, causal=causal)
torch.cuda.synchronize()
print(flash_nif.info()["cuda"]["last_kernels"]["backward" if backward else "forward"])
