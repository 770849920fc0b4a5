"""Per-call time of the Python binding on the shapes of elixir/bench/overhead.exs.

    make build && .venv/bin/python elixir/bench/overhead.py
"""

import time

import numpy as np

import flash_nif

SHAPES = [(1, 1, 1, 8), (1, 16, 2, 32), (1, 128, 4, 64), (2, 512, 8, 64), (1, 2048, 8, 64)]


def median(fun, budget=1.0):
    for _ in range(3):
        fun()
    times, start = [], time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < budget and len(times) < 20000):
        t0 = time.perf_counter()
        fun()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main():
    rng = np.random.default_rng(0)
    print("shape [B, S, H, D] (causal, f32)   forward_with_states   backward")
    for shape in SHAPES:
        q = rng.standard_normal(shape).astype(np.float32)
        k = rng.standard_normal(shape).astype(np.float32)
        o, lse = flash_nif.forward_with_states(q, k, k)
        fwd = median(lambda: flash_nif.forward_with_states(q, k, k))
        bwd = median(lambda: flash_nif.backward(o, q, k, k, o, lse))
        print(f"{str(shape):34s}{fwd * 1e6:17.1f} us{bwd * 1e6:9.1f} us")


if __name__ == "__main__":
    main()
