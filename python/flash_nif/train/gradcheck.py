"""Whole-model gradient check: stitched gradients against finite differences of the float64 model.

The analytic side is the training code path itself -- the hand-written backward of every layer
stitched to the attention backend that trains (flash_nif's kernels on the training device, float32
by default), or with `--framework torch` torch autograd through the torch modules and
flash_nif.torch's op (so the check also shows that they compute the NumPy model). The numeric side is a central difference of the same model in float64 with the float64
oracle `flash_nif.reference` as its attention:

    fd_i = (L(θ + ε e_i) - L(θ - ε e_i)) / 2ε,    ε = 1e-5.

For each parameter tensor P the check takes every coordinate, or `max_coords` coordinates drawn at
random for a larger tensor, and computes

    rel_err(P) = ||g_P - fd_P||₂ / max(||g_P||₂, ||fd_P||₂)      (0 when both are 0)

over those coordinates. The reported error is the maximum over all tensors. A norm-wise ratio per
tensor does not blow up on single coordinates whose gradient happens to be ~0, yet any wrong layer
backward (a missing term, a transposed weight, a wrong scale) shows up as an error of order 1.
Float32 rounding in the analytic side leaves about 1e-6..1e-4, hence the default tolerance 1e-3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from .backend import Attention, Device, TorchAttention, float64_reference_attention, to_host
from .data import RecallTask
from .model import ModelConfig, Transformer, build_model, init_params

DEFAULT_TOL = 1e-3
FD_EPS = 1e-5


@dataclass
class GradCheckResult:
    max_rel_err: float
    worst: str
    per_param: dict = field(default_factory=dict)
    coords: int = 0
    attention: str = ""
    dtype: str = ""
    config: dict = field(default_factory=dict)

    def passed(self, tol: float) -> bool:
        return math.isfinite(self.max_rel_err) and self.max_rel_err <= tol


def tiny_config(cfg: ModelConfig) -> tuple[ModelConfig, RecallTask]:
    """A model with the training model's head layout (heads, kv heads, head dim) but at most two
    layers, sequence 8 and a 12-token vocabulary, so finite differences stay cheap."""
    task = RecallTask(seq=8, num_keys=6, num_values=6)
    small = replace(cfg, layers=min(cfg.layers, 2), dim=cfg.heads * cfg.head_dim, vocab=task.vocab,
                    seq=task.seq)
    return small, task


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    den = max(float(np.linalg.norm(a)), float(np.linalg.norm(b)))
    return 0.0 if den == 0.0 else float(np.linalg.norm(a - b)) / den


def grad_check(cfg: ModelConfig, task: RecallTask, attention: Attention | TorchAttention, device: Device, *,
               dtype=np.float32, seed: int = 0, batch: int = 2, max_coords: int = 48,
               eps: float = FD_EPS) -> GradCheckResult:
    """Compare the stitched gradients of `attention` on `device` in `dtype` with float64 finite
    differences of the same model and batch (see the module docstring for the error definition)."""
    rng = np.random.Generator(np.random.PCG64([seed, 0x6C4E]))
    params = init_params(cfg, rng, dtype=np.float64)
    for name in params:  # random norm gains, so their gradients are not special
        if name.endswith("norm"):
            params[name] = 1.0 + 0.2 * rng.standard_normal(params[name].shape)
    params = {k: p.astype(dtype) for k, p in params.items()}  # the point both sides evaluate at
    tokens, targets = task.sample(rng, batch)

    model = build_model(cfg, attention)
    dev_params = {k: device.put(p) for k, p in params.items()}
    _, _, _, grads = model.loss_and_grads(dev_params, device.put(tokens), device.put(targets))
    grads = {k: to_host(g).astype(np.float64) for k, g in grads.items()}

    model64 = Transformer(cfg, float64_reference_attention())
    p64 = {k: p.astype(np.float64) for k, p in params.items()}

    def loss64() -> float:
        return float(model64.forward(p64, tokens, targets)[0])

    result = GradCheckResult(0.0, "", attention=attention.name, dtype=np.dtype(dtype).name,
                             config=cfg.to_dict())
    for name, p in p64.items():
        flat = p.reshape(-1)
        idx = np.arange(flat.size) if flat.size <= max_coords else np.sort(
            rng.choice(flat.size, size=max_coords, replace=False))
        fd = np.empty(idx.size)
        for j, i in enumerate(idx):
            old = flat[i]
            flat[i] = old + eps
            up = loss64()
            flat[i] = old - eps
            down = loss64()
            flat[i] = old
            fd[j] = (up - down) / (2 * eps)
        err = rel_err(grads[name].reshape(-1)[idx], fd)
        result.per_param[name] = err
        result.coords += idx.size
        if not (err <= result.max_rel_err):  # also catches NaN
            result.max_rel_err, result.worst = err, name
    return result
