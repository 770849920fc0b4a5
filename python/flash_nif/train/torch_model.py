"""The demo's transformer as torch modules (`--framework torch`): flash_nif.torch's op for
attention, torch autograd for everything else.

The same model as model.py, layer for layer (RMSNorm, Q/K/V projections with grouped-query heads,
half-split rotary positions from the same float32 tables, causal attention, output projection,
RMSNorm, tanh-GELU MLP, final RMSNorm and head over the answer positions only, mean
cross-entropy). Its parameters carry the NumPy model's names and [in, out] layouts (`x @ w`, not
nn.Linear's transposed weight), so one initialisation, one AdamW (optim.py) and one checkpoint
format serve both frameworks, and a run of each from the same seed starts from the same bits.

The trainer keeps parameters as a dict of plain tensors (as it keeps NumPy arrays); `TorchTransformer`
runs the modules on them with `torch.func.functional_call` and returns their gradients by
`torch.autograd.grad`, the interface of model.Transformer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from .. import rotary
from .backend import TorchAttention
from .model import RMS_EPS, ModelConfig, param_shapes


def _param(shape) -> nn.Parameter:
    # Placeholders on the meta device: every call supplies the real tensors (functional_call).
    return nn.Parameter(torch.empty(shape, device="meta"))


def rope(x, cos, sin):
    """Half-split ("rotate half") RoPE of x [B, S, H, Dh] with cos/sin [S, Dh / 2], as
    flash_nif.rotary.apply computes it."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [S, 1, Dh / 2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Block(nn.Module):
    """x + Wo·attn(rope(Wq·n1(x)), rope(Wk·n1(x)), Wv·n1(x)), then x + W2·gelu(W1·n2(x))."""

    def __init__(self, cfg: ModelConfig, attention: TorchAttention, shapes: dict):
        super().__init__()
        self.cfg, self.attend = cfg, attention.apply
        for leaf in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w1", "w2"):  # model.param_shapes order
            setattr(self, leaf, _param(shapes[leaf]))

    def forward(self, x, cos, sin):  # x [B, S, dim]
        cfg = self.cfg
        b, s, d = x.shape
        xn = F.rms_norm(x, (d,), self.attn_norm, RMS_EPS)
        q = rope((xn @ self.wq).view(b, s, cfg.heads, cfg.head_dim), cos, sin)  # [B, S, H, Dh]
        k = rope((xn @ self.wk).view(b, s, cfg.kv_heads, cfg.head_dim), cos, sin)  # [B, S, Hkv, Dh]
        v = (xn @ self.wv).view(b, s, cfg.kv_heads, cfg.head_dim)
        x = x + self.attend(q, k, v).reshape(b, s, d) @ self.wo
        hn = F.rms_norm(x, (d,), self.mlp_norm, RMS_EPS)
        return x + F.gelu(hn @ self.w1, approximate="tanh") @ self.w2


class Model(nn.Module):
    """tokens [B, S] -> (mean cross-entropy over targets >= 0, correct argmaxes, their count)."""

    def __init__(self, cfg: ModelConfig, attention: TorchAttention):
        super().__init__()
        self.cfg = cfg
        shapes = param_shapes(cfg)
        self.embed = _param(shapes["embed"])
        self.layers = nn.ModuleList(
            Block(cfg, attention, {k.rsplit(".", 1)[1]: v for k, v in shapes.items() if k.startswith(f"layers.{i}.")})
            for i in range(cfg.layers))
        self.final_norm = _param(shapes["final_norm"])
        self.head = _param(shapes["head"])
        self._rope = {}

    def rope_tables(self, device):
        """float32 cos/sin [seq, head_dim / 2] on `device`: the NumPy model's tables."""
        if device not in self._rope:
            cos, sin = rotary.tables(self.cfg.seq, self.cfg.head_dim, base=self.cfg.rope_base)
            self._rope[device] = (torch.asarray(cos, device=device), torch.asarray(sin, device=device))
        return self._rope[device]

    def forward(self, tokens, targets):
        cos, sin = self.rope_tables(tokens.device)
        x = F.embedding(tokens, self.embed)  # [B, S, dim]
        for block in self.layers:
            x = block(x, cos, sin)
        flat, labels = x.reshape(-1, self.cfg.dim), targets.reshape(-1)
        keep = labels >= 0  # only the answer positions reach the head
        xs = F.rms_norm(flat[keep], (self.cfg.dim,), self.final_norm, RMS_EPS)
        logits = xs @ self.head
        labels = labels[keep]
        loss = F.cross_entropy(logits, labels)
        return loss, (logits.argmax(dim=-1) == labels).sum(), labels.shape[0]


class TorchTransformer:
    """model.Transformer's interface over `Model`: parameters are a dict of tensors by name."""

    def __init__(self, cfg: ModelConfig, attention: TorchAttention):
        self.cfg = cfg
        self.attention = attention
        self.module = Model(cfg, attention)

    def forward(self, params, tokens, targets):
        """(loss, correct, count, None); no autograd graph."""
        with torch.no_grad():
            loss, correct, count = functional_call(self.module, params, (tokens, targets), strict=True)
        return loss, correct, int(count), None

    def loss_and_grads(self, params, tokens, targets):
        leaves = {k: p.detach().requires_grad_() for k, p in params.items()}  # same storage
        loss, correct, count = functional_call(self.module, leaves, (tokens, targets), strict=True)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        return loss.detach(), correct, int(count), dict(zip(leaves, grads))
