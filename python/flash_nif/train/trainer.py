"""The training state and one step of it: batch -> forward/backward (hand-stitched, or torch
autograd with --framework torch) -> clip -> AdamW.

`Trainer` owns everything a checkpoint must hold to resume exactly: parameters, AdamW moments and
step, the data generator's state, and the curves so far. Nothing else influences a step (no
dropout, a step-only learning-rate schedule, deterministic kernels), so N straight steps and
N/2 + resume + N/2 give bit-identical parameters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from . import checkpoint
from .backend import Attention, Device, TorchAttention, host_dtype
from .data import RecallTask, Stream, eval_set
from .model import ModelConfig, build_model, decays, init_params, param_shapes
from .optim import AdamW, clip_by_global_norm, learning_rate

HISTORY_KEYS = ("train_loss", "train_acc", "eval_step", "eval_loss", "eval_acc")


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    layers: int
    heads: int
    kv_heads: int
    dim: int
    seq: int
    batch: int
    lr: float
    seed: int
    weight_decay: float
    clip: float
    warmup: int
    num_keys: int
    num_values: int
    eval_every: int
    eval_batches: int
    ckpt_every: int

    # The fields a resumed run must share with its checkpoint (steps and the schedules of
    # evaluation/checkpointing may change).
    FIXED = ("layers", "heads", "kv_heads", "dim", "seq", "batch", "lr", "seed", "weight_decay",
             "clip", "warmup", "num_keys", "num_values", "eval_batches")

    def task(self) -> RecallTask:
        return RecallTask(seq=self.seq, num_keys=self.num_keys, num_values=self.num_values)

    def model(self) -> ModelConfig:
        return ModelConfig(vocab=self.num_keys + self.num_values, dim=self.dim, layers=self.layers,
                           heads=self.heads, kv_heads=self.kv_heads, seq=self.seq)


class Trainer:
    def __init__(self, cfg: TrainConfig, device: Device, attention: Attention | TorchAttention):
        self.cfg = cfg
        self.device = device
        self.task = cfg.task()
        self.model_cfg = cfg.model()
        self.model = build_model(self.model_cfg, attention)
        init_rng = np.random.Generator(np.random.PCG64([cfg.seed, 0x1417]))
        host = init_params(self.model_cfg, init_rng)
        self.params = {k: device.put(v) for k, v in host.items()}
        self.opt = AdamW(self.params, weight_decay=cfg.weight_decay, decays=decays)
        self.stream = Stream(self.task, cfg.batch, seed=cfg.seed)
        self.eval_data = [(device.put(t), device.put(y)) for t, y in
                          eval_set(self.task, cfg.batch, cfg.eval_batches, seed=cfg.seed)]
        self.step = 0
        self.history = {k: [] for k in HISTORY_KEYS}
        self.train_time = 0.0  # seconds spent in training steps, over all runs of this checkpoint
        self.tokens = 0  # tokens trained on, over all runs

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch * self.cfg.seq

    def num_params(self) -> int:
        return sum(int(np.prod(s)) for s in param_shapes(self.model_cfg).values())

    def train_step(self) -> tuple[float, float, float]:
        """One optimiser step; returns (loss, accuracy on the answer tokens, grad norm)."""
        t0 = time.perf_counter()
        tokens, targets = self.stream.next()
        loss, correct, count, grads = self.model.loss_and_grads(
            self.params, self.device.put(tokens), self.device.put(targets))
        grads, gnorm = clip_by_global_norm(grads, self.cfg.clip)
        self.opt.update(self.params, grads, learning_rate(self.step, self.cfg.lr, self.cfg.warmup))
        loss, acc = float(loss), int(correct) / count  # (synchronises the device)
        self.step += 1
        self.train_time += time.perf_counter() - t0
        self.tokens += self.tokens_per_step
        self.history["train_loss"].append(loss)
        self.history["train_acc"].append(acc)
        return loss, acc, gnorm

    def evaluate(self) -> tuple[float, float]:
        """Loss and answer accuracy on the fixed held-out set; recorded at the current step."""
        total, correct, count = 0.0, 0, 0
        for tokens, targets in self.eval_data:
            loss, c, n, _ = self.model.forward(self.params, tokens, targets)
            total += float(loss) * n
            correct += int(c)
            count += n
        loss, acc = total / count, correct / count
        self.history["eval_step"].append(self.step)
        self.history["eval_loss"].append(loss)
        self.history["eval_acc"].append(acc)
        return loss, acc

    # ------------------------------------------------------------------ checkpoints

    def save(self, out_dir: str) -> str:
        meta = {
            "format": 1,
            "step": self.step,
            "adam_step": self.opt.step,
            "data_rng": self.stream.get_state(),
            "config": self.config_dict(),
            "train_time": self.train_time,
            "tokens": self.tokens,
        }
        return checkpoint.save(out_dir, params=self.params, adam_m=self.opt.m, adam_v=self.opt.v,
                               history=self.history, meta=meta)

    def load(self, ckpt: dict) -> None:
        meta = ckpt["meta"]
        names = list(self.params)
        for group, target in (("params", self.params), ("adam_m", self.opt.m), ("adam_v", self.opt.v)):
            missing = set(names) ^ set(ckpt[group])
            if missing:
                raise ValueError(f"checkpoint {group} do not match the model: {sorted(missing)}")
            for name in names:
                src = ckpt[group][name]
                shape, dtype = tuple(target[name].shape), host_dtype(target[name])
                if src.shape != shape or src.dtype != dtype:
                    raise ValueError(f"checkpoint {group}/{name} has shape {src.shape} {src.dtype}, "
                                     f"the model wants {shape} {dtype}")
                target[name] = self.device.put(src.copy())
        self.opt.step = int(meta["adam_step"])
        self.stream.set_state(meta["data_rng"])
        self.step = int(meta["step"])
        self.train_time = float(meta["train_time"])
        self.tokens = int(meta["tokens"])
        self.history = {k: list(ckpt["history"].get(k, [])) for k in HISTORY_KEYS}
        self.history["eval_step"] = [int(s) for s in self.history["eval_step"]]

    def config_dict(self) -> dict:
        d = {k: getattr(self.cfg, k) for k in self.cfg.__dataclass_fields__}
        d["vocab"] = self.model_cfg.vocab
        d["head_dim"] = self.model_cfg.head_dim
        d["params"] = self.num_params()
        return d
