"""Multi-query associative recall, generated on the fly.

A sequence of length S = 4·n holds n key/value pairs followed by the same n keys asked again in a
random order, each followed by its answer:

    k1 v1 k2 v2 ... kn vn | q1 a1 q2 a2 ... qn an      (q_j ∈ {k_i}, a_j = value of q_j)

Keys are n distinct tokens out of `num_keys`, values are drawn with replacement from `num_values`
tokens (a disjoint range of the vocabulary), so the mapping changes from sequence to sequence and
cannot be memorised: the only way to predict a_j at the position of q_j is to look back, find q_j
among the keys and copy the token after it -- a job for attention (an induction head needs two
layers). Only the answer positions carry a target; everything else is ignored (-1). Chance
accuracy is 1/num_values.

The generator owns a `numpy.random.Generator`; its state is what a checkpoint saves, so a resumed
run draws exactly the batches the uninterrupted run would have drawn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

IGNORE = -1


@dataclass(frozen=True)
class RecallTask:
    seq: int  # sequence length, a multiple of 4
    num_keys: int = 32
    num_values: int = 32

    def __post_init__(self):
        if self.seq < 4 or self.seq % 4:
            raise ValueError(f"seq must be a positive multiple of 4, got {self.seq}")
        if self.num_pairs > self.num_keys:
            raise ValueError(f"seq {self.seq} needs {self.num_pairs} distinct keys > num_keys {self.num_keys}")

    @property
    def num_pairs(self) -> int:
        return self.seq // 4

    @property
    def vocab(self) -> int:
        return self.num_keys + self.num_values

    @property
    def chance_accuracy(self) -> float:
        return 1.0 / self.num_values

    def sample(self, rng: np.random.Generator, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """tokens [batch, seq] int64 and targets [batch, seq] int64 (IGNORE where no loss)."""
        n = self.num_pairs
        # n distinct keys per row: the first n of a random permutation of the key range.
        keys = np.argsort(rng.random((batch, self.num_keys)), axis=1)[:, :n]
        values = self.num_keys + rng.integers(0, self.num_values, size=(batch, n))
        order = np.argsort(rng.random((batch, n)), axis=1)
        q_keys = np.take_along_axis(keys, order, axis=1)
        q_vals = np.take_along_axis(values, order, axis=1)

        tokens = np.empty((batch, self.seq), dtype=np.int64)
        tokens[:, 0:2 * n:2] = keys
        tokens[:, 1:2 * n:2] = values
        tokens[:, 2 * n::2] = q_keys
        tokens[:, 2 * n + 1::2] = q_vals
        targets = np.full((batch, self.seq), IGNORE, dtype=np.int64)
        targets[:, 2 * n::2] = q_vals  # at each query key, predict its value
        return tokens, targets


class Stream:
    """An endless stream of batches from one seeded generator, with a saveable state."""

    def __init__(self, task: RecallTask, batch: int, seed: int):
        self.task = task
        self.batch = batch
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        return self.task.sample(self.rng, self.batch)

    def get_state(self) -> str:
        return json.dumps(self.rng.bit_generator.state)

    def set_state(self, state: str) -> None:
        self.rng.bit_generator.state = json.loads(state)


def eval_set(task: RecallTask, batch: int, num_batches: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A fixed held-out set from its own generator (a different stream from training)."""
    rng = np.random.Generator(np.random.PCG64([seed, 0xE7A1]))
    return [task.sample(rng, batch) for _ in range(num_batches)]
