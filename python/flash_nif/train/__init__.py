"""Manual gradient-stitching trainer: `python -m flash_nif.train --help`.

A decoder-only transformer trained with a hand-written backward pass in which attention is
flash_nif's forward_with_states/backward (see model.py), on an associative-recall task (data.py),
with AdamW and gradient clipping (optim.py), a whole-model gradient check (gradcheck.py), exact
npz checkpoints (checkpoint.py) and a loss plot (plot.py). `--framework torch` trains the same
model written as torch modules (torch_model.py, imported only then) with flash_nif.torch's op.
"""

from .backend import Attention, Device, SetupError, get_attention, get_device
from .data import RecallTask
from .gradcheck import grad_check
from .model import ModelConfig, Transformer
from .trainer import TrainConfig, Trainer

__all__ = ["Attention", "Device", "SetupError", "get_attention", "get_device", "RecallTask",
           "grad_check", "ModelConfig", "Transformer", "TrainConfig", "Trainer"]
