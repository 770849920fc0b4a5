"""DIR/loss.png: training and held-out curves (matplotlib, Agg backend, no display needed)."""

from __future__ import annotations

import numpy as np


def smooth(values, window: int) -> np.ndarray:
    """Trailing mean over `window` steps (shorter at the start)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0 or window <= 1:
        return v
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, v.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def plot_curves(history: dict, path: str, *, chance: float, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(history["train_loss"]) + 1)
    window = max(1, len(steps) // 50)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))

    ax_loss.plot(steps, history["train_loss"], color="tab:blue", alpha=0.25, lw=0.8)
    ax_loss.plot(steps, smooth(history["train_loss"], window), color="tab:blue",
                 label=f"train (mean of {window} steps)" if window > 1 else "train")
    ax_loss.plot(history["eval_step"], history["eval_loss"], "o-", color="tab:orange", ms=3,
                 label="held-out eval")
    ax_loss.axhline(np.log(1.0 / chance), color="gray", ls=":", lw=1, label="uniform over values")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy on answer tokens")
    ax_loss.set_ylim(bottom=0)
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)

    ax_acc.plot(steps, smooth(history["train_acc"], window), color="tab:blue", label="train")
    ax_acc.plot(history["eval_step"], history["eval_acc"], "o-", color="tab:orange", ms=3,
                label="held-out eval")
    ax_acc.axhline(chance, color="gray", ls=":", lw=1, label=f"chance ({chance:.3f})")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("accuracy on answer tokens")
    ax_acc.set_ylim(0, 1.02)
    ax_acc.legend(loc="lower right")
    ax_acc.grid(alpha=0.3)

    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
