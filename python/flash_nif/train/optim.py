"""AdamW (decoupled weight decay) with global-norm gradient clipping and a warmup schedule.

One update for NumPy, CuPy and torch arrays (both frameworks of the trainer): the same operations
in the same order with scalars in the parameters' dtype and a correctly rounded sqrt, so equal
gradients give equal bits."""

from __future__ import annotations

import math
from functools import partial

from .backend import scalar, sqrt, to_float64, xp_of


def global_norm(grads: dict) -> float:
    """sqrt of the sum of squares of every gradient entry (accumulated in float64 on the host)."""
    total = 0.0
    for g in grads.values():
        g64 = to_float64(g)
        total = total + (g64 * g64).sum()  # stays on the device until the one float() below
    return math.sqrt(float(total))


def clip_by_global_norm(grads: dict, max_norm: float) -> tuple[dict, float]:
    """Scale all gradients by min(1, max_norm / norm); returns (grads, norm before clipping)."""
    norm = global_norm(grads)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        grads = {k: g * scalar(g, scale) for k, g in grads.items()}
    return grads, norm


def learning_rate(step: int, base_lr: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then constant. Depends on the step only (not on the
    planned total), so a run extended with --resume follows the same schedule as one long run."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    return base_lr


class AdamW:
    """m/v moments per parameter; `step` counts the updates already applied."""

    def __init__(self, params: dict, *, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0, decays=None):
        self.b1, self.b2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.decays = decays or (lambda name: True)
        self.step = 0
        self.m = {k: xp_of(p).zeros_like(p) for k, p in params.items()}
        self.v = {k: xp_of(p).zeros_like(p) for k, p in params.items()}

    def update(self, params: dict, grads: dict, lr: float) -> None:
        """In place: p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)."""
        self.step += 1
        c1 = 1.0 - self.b1 ** self.step
        c2 = 1.0 - self.b2 ** self.step
        for name, p in params.items():
            g = grads[name]
            t = partial(scalar, p)  # scalars in p's dtype
            m, v = self.m[name], self.v[name]
            m *= t(self.b1)
            m += t(1 - self.b1) * g
            v *= t(self.b2)
            v += t(1 - self.b2) * (g * g)
            if self.weight_decay and self.decays(name):
                p *= t(1.0 - lr * self.weight_decay)
            p -= t(lr / c1) * m / (sqrt(v / t(c2)) + t(self.eps))

    def state(self) -> dict:
        return {"step": self.step, "m": self.m, "v": self.v}
