"""Run a function on ``world_size`` local ranks of a fresh ``torch.distributed`` group, and stop by
itself: the launcher of ``tests/test_ring.py`` and ``bench/ring.py``. (On a cluster, use
``torchrun``; :func:`flash_nif.torch.ring_attention` only needs an initialised process group.)

    results = spawn(fn, 2, args=(...,), backend="gloo", timeout=120)

``fn(rank, world_size, *args)`` runs in each of ``world_size`` spawned processes after
``init_process_group`` (with ``nccl``, on GPU ``rank``); its return value (tensors, numbers,
dicts…) comes back through ``torch.save`` files, as ``results[rank]``. ``fn`` must be importable
(a module-level function). A rank that raises fails the call with its traceback; past ``timeout``
seconds the ranks still running are killed and ``TimeoutError`` is raised.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, fn, world_size, backend, init_method, timeout, outdir, args):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        out = fn(rank, world_size, *args)
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, args: tuple = (), *, backend: str = "gloo", timeout: float = 120.0) -> list:
    """``[fn(0, world_size, *args), …, fn(world_size - 1, world_size, *args)]``, one process per rank."""
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"nccl with {world_size} ranks needs {world_size} GPUs; "
                           f"torch sees {torch.cuda.device_count()}")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="flash_nif_spawn_") as outdir:
        ctx = mp.start_processes(_rank_main, args=(fn, world_size, backend, init_method, timeout, outdir, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=0.5):  # raises ProcessRaisedException when a rank fails
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks of {fn.__name__} still running after {timeout} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
