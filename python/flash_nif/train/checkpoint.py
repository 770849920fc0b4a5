"""npz checkpoints that resume exactly.

One file, DIR/checkpoint.npz, written atomically (temporary file + rename):

    param/<name>   float32 parameters            adam_m/<name>, adam_v/<name>   AdamW moments
    hist/<series>  the training/eval curves so far (for summary.json and the plot)
    meta           JSON: step, AdamW step, data-generator state (PCG64), config, timings

Everything is stored on the host; a checkpoint written on the GPU resumes on the CPU and back.
Loading uses allow_pickle=False.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

from .backend import to_host

FILENAME = "checkpoint.npz"


def path_in(out_dir: str) -> str:
    return os.path.join(out_dir, FILENAME)


def save(out_dir: str, *, params: dict, adam_m: dict, adam_v: dict, history: dict, meta: dict) -> str:
    arrays = {}
    for prefix, group in (("param/", params), ("adam_m/", adam_m), ("adam_v/", adam_v)):
        for name, a in group.items():
            arrays[prefix + name] = to_host(a)
    for name, series in history.items():
        arrays["hist/" + name] = np.asarray(series, dtype=np.float64)
    arrays["meta"] = np.array(json.dumps(meta))
    os.makedirs(out_dir, exist_ok=True)
    target = path_in(out_dir)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".npz", dir=out_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def load(out_dir: str) -> dict:
    """{'params', 'adam_m', 'adam_v', 'history', 'meta'} with host arrays."""
    out = {"params": {}, "adam_m": {}, "adam_v": {}, "history": {}}
    groups = {"param": "params", "adam_m": "adam_m", "adam_v": "adam_v", "hist": "history"}
    with np.load(path_in(out_dir), allow_pickle=False) as z:
        for key in z.files:
            if key == "meta":
                out["meta"] = json.loads(str(z[key]))
                continue
            prefix, name = key.split("/", 1)
            value = z[key]
            out[groups[prefix]][name] = value.tolist() if prefix == "hist" else value
    return out
