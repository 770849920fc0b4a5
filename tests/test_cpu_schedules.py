"""The two CPU backward schedules of the fused path (fused per kv head, or split dQ and dK/dV
passes; chosen by the thread count) visit the same tiles in the same order, so gradients are
bit-identical whatever the number of threads, with v's own head dim (Dv) too; so are the
materialized path's, and ``auto``'s choice between the paths does not depend on the thread count
either."""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import hashlib, sys, numpy as np, flash_nif
d, dv, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(5)
q = rng.standard_normal((1, 200, 6, d), dtype=np.float32)   # B * Hkv = 3 kv heads
k = rng.standard_normal((1, 170, 3, d), dtype=np.float32)
v = rng.standard_normal((1, 170, 3, dv), dtype=np.float32)
o, lse = flash_nif.forward_with_states(q, k, v, mode=mode)
do = rng.standard_normal(o.shape, dtype=np.float32)
h = hashlib.sha256()
for x in (o, lse, *flash_nif.backward(do, q, k, v, o, lse, mode=mode)):
    h.update(x.tobytes())
print(h.hexdigest())
"""


def digest(threads: int, d: int = 40, dv: int = 40, mode: str = "fused") -> str:
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads)}
    env.pop("FLASH_NIF_MODE", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(d), str(dv), mode], env=env, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("d,dv", [(40, 40), (59, 24), (24, 111)], ids=str)
def test_results_do_not_depend_on_thread_count(d, dv):
    # 1 thread: 3 tasks % 1 == 0 -> fused; 2 threads: 3 % 2 != 0 and 3 < 8 -> split.
    assert digest(1, d, dv) == digest(2, d, dv) == digest(3, d, dv)


@pytest.mark.parametrize("mode", ["materialized", "auto"])
def test_other_modes_do_not_depend_on_thread_count(mode):
    assert digest(1, mode=mode) == digest(2, mode=mode) == digest(5, mode=mode)
