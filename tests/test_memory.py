"""Memory: O(S) extra memory at long sequence lengths, and a clean
OutOfMemoryError (not an abort) for sizes too large to allocate.

Both run in a child interpreter: peak RSS (``ru_maxrss``) is a high-water mark
for the whole process, and a failed allocation must not be able to take the
test runner down with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

S = 8192
D = 64
SXS_F32_BYTES = S * S * 4  # 256 MiB: one materialised score matrix

PEAK_SCRIPT = textwrap.dedent(
    f"""
    import json, resource
    import numpy as np
    import flash_nif as fa

    S, D = {S}, {D}
    rng = np.random.default_rng(50)
    q, k, v, do = (rng.standard_normal((1, S, 1, D), dtype=np.float32) for _ in range(4))

    # warm up: thread pool, first-call allocations
    small = [t[:, :256].copy() for t in (q, k, v, do)]
    o_s, lse_s = fa.forward_with_states(*small[:3], causal=False)
    fa.backward(small[3], *small[:3], o_s, lse_s, causal=False)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    o, lse = fa.forward_with_states(q, k, v, causal=False)
    dq, dk, dv = fa.backward(do, q, k, v, o, lse, causal=False)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    # spot-check a few rows against float64 (only rows x S scores)
    rows = np.array([0, 1, 4097, S - 1])
    q64, k64, v64 = (t[0, :, 0].astype(np.float64) for t in (q, k, v))
    s = (q64[rows] @ k64.T) / np.sqrt(D)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    o_ref = (p @ v64) / p.sum(axis=1, keepdims=True)
    lse_ref = m[:, 0] + np.log(p.sum(axis=1))
    err_o = np.linalg.norm(o[0, rows, 0] - o_ref) / np.linalg.norm(o_ref)
    err_lse = np.linalg.norm(lse[0, 0, rows] - lse_ref) / np.linalg.norm(lse_ref)
    finite = bool(np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all())
    print(json.dumps(dict(growth_bytes=(after - before) * 1024, err_o=float(err_o),
                          err_lse=float(err_lse), finite=finite)))
    """
)


def _run_child(script: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)


def test_s8192_forward_backward_peak_rss_is_far_below_one_sxs_matrix(fa):
    proc = _run_child(PEAK_SCRIPT, timeout=300)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = res["growth_bytes"]
    # inputs 4 x 2 MiB exist before; outputs o, dq, dk, dv are 2 MiB each
    # a quarter of one S x S f32 matrix: any materialised score block would show
    assert growth < SXS_F32_BYTES / 4, f"peak RSS grew {growth / 2**20:.1f} MiB (S x S f32 = 256 MiB)"
    assert res["finite"]
    assert res["err_o"] <= 1e-5 and res["err_lse"] <= 1e-5, res


OOM_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import flash_nif as fa

    small = np.random.default_rng(51).standard_normal((1, 16, 1, 64), dtype=np.float32)
    # a zero-stride view: 2**46 elements (256 TiB, beyond the address space) that only the kernel's
    # contiguous copy / buffers would have to hold
    huge_q = np.broadcast_to(np.float32(0.5), (1, 2**40, 1, 64))
    huge_kv = np.broadcast_to(np.float32(0.5), (1, 2**40, 1, 64))
    for name, args in (("q", (huge_q, small, small)), ("kv", (small, huge_kv, huge_kv))):
        try:
            fa.forward(*args, causal=False)
        except fa.OutOfMemoryError as exc:
            print(name, "OutOfMemoryError", isinstance(exc, MemoryError), flush=True)
        except BaseException as exc:
            print(name, "other", type(exc).__module__ + "." + type(exc).__qualname__, str(exc)[:200], flush=True)
        else:
            print(name, "no-error", flush=True)
    # still alive and working
    o = fa.forward(small, small, small)
    print("alive", bool(np.isfinite(o).all()), flush=True)
    """
)


def test_too_large_to_allocate_raises_out_of_memory_error(fa):
    try:
        proc = _run_child(OOM_SCRIPT, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("allocating a 256 TiB input hung instead of failing")
    out = proc.stdout
    assert proc.returncode == 0, f"interpreter died ({proc.returncode}):\n{out}\n{proc.stderr}"
    assert "q OutOfMemoryError True" in out, out
    assert "kv OutOfMemoryError True" in out, out
    assert "alive True" in out, out
