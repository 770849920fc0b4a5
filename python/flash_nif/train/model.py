"""A small decoder-only transformer whose backward pass is written by hand.

    tokens -> embedding -> L x [ x + Wo·attn(rope(Wq·n1(x)), rope(Wk·n1(x)), Wv·n1(x)),
                                 x + W2·gelu(W1·n2(x)) ] -> final RMSNorm -> head -> cross-entropy

Every layer is a pair of functions: `*_fwd` returns its output and what its backward needs,
`*_bwd` turns the output gradient into input and parameter gradients. Attention is the one layer
not written here: its forward/backward are an injected `backend.Attention` (flash_nif's kernels
when training, the float64 oracle in the gradient check). Positions are rotary (RoPE, the
"rotate half" form) applied to q and k by flash_nif.rotary's kernels (the oracle's rotary in the
float64 model); attention is causal with grouped-query heads (GQA).
All arithmetic runs in the dtype of the parameters, on the array module of the parameters
(NumPy or CuPy).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .. import reference, rotary
from .backend import Attention, TorchAttention, xp_of

RMS_EPS = 1e-5
GELU_C = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    seq: int
    mlp_ratio: int = 4
    rope_base: float = 10000.0

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.head_dim % 2:
            raise ValueError(f"head dim (dim/heads = {self.head_dim}) must be even for rotary positions")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def hidden(self) -> int:
        return self.mlp_ratio * self.dim

    def to_dict(self) -> dict:
        return asdict(self)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in a fixed order (the order of checkpoints and checks)."""
    d, kv = cfg.dim, cfg.kv_heads * cfg.head_dim
    shapes = {"embed": (cfg.vocab, d)}
    for i in range(cfg.layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm": (d,), p + "wq": (d, d), p + "wk": (d, kv), p + "wv": (d, kv), p + "wo": (d, d),
            p + "mlp_norm": (d,), p + "w1": (d, cfg.hidden), p + "w2": (cfg.hidden, d),
        })
    shapes.update({"final_norm": (d,), "head": (d, cfg.vocab)})
    return shapes


def decays(name: str) -> bool:
    """Weight decay applies to the projection matrices, not to norms or the embedding."""
    return name.rsplit(".", 1)[-1] in {"wq", "wk", "wv", "wo", "w1", "w2", "head"}


def init_params(cfg: ModelConfig, rng: np.random.Generator, dtype=np.float32) -> dict[str, np.ndarray]:
    """Host (NumPy) parameters: N(0, 1/fan_in) projections, residual outputs scaled by 1/sqrt(2L)."""
    params = {}
    resid_scale = 1.0 / math.sqrt(2 * cfg.layers)
    for name, shape in param_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("norm"):
            w = np.ones(shape)
        elif leaf == "embed":
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / math.sqrt(shape[0])
            if leaf in ("wo", "w2"):
                w *= resid_scale
        params[name] = w.astype(dtype)
    return params


# ----------------------------------------------------------------------------- layers


def rmsnorm_fwd(x, g):
    xp = xp_of(x)
    r = 1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + x.dtype.type(RMS_EPS))
    return x * r * g, (x, r, g)


def rmsnorm_bwd(dy, cache):
    x, r, g = cache
    dyg = dy * g
    dx = r * dyg - x * (r * r * r) * (dyg * x).mean(axis=-1, keepdims=True)
    dg = (dy * x * r).reshape(-1, x.shape[-1]).sum(axis=0)
    return dx, dg


def linear_fwd(x, w):
    return x @ w, x


def linear_bwd(dy, x, w):
    dw = x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])
    return dy @ w.T, dw


def gelu_fwd(x):
    xp = xp_of(x)
    t = xp.tanh(x.dtype.type(GELU_C) * (x + x.dtype.type(0.044715) * (x * x * x)))
    return 0.5 * x * (1 + t), (x, t)


def gelu_bwd(dy, cache):
    x, t = cache
    du = x.dtype.type(GELU_C) * (1 + x.dtype.type(3 * 0.044715) * x * x)
    return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du)


def rope_tables(seq: int, head_dim: int, base: float, xp, dtype):
    """cos/sin [seq, head_dim / 2] for the half-split ("rotate half", GPT-NeoX) form: float64 for
    the float64 model (the oracle's rotary), float32 for the kernels whatever the model's dtype."""
    table_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    cos, sin = rotary.tables(seq, head_dim, base=base, dtype=table_dtype)
    return xp.asarray(cos), xp.asarray(sin)


def rope_fwd(x, cos, sin):
    """RoPE of x [B, S, H, Dh] at positions 0..S-1: flash_nif's kernel (float32 / float16 /
    bfloat16, NumPy or CuPy), or the float64 oracle for the float64 model."""
    if x.dtype == np.float64:
        return reference.rotary_apply(x, cos, sin)
    return rotary.apply(x, cos, sin)


def rope_bwd(dy, cos, sin):
    """The rotation's transpose (a rotation by -theta), as rope_fwd chooses its implementation."""
    if dy.dtype == np.float64:
        return reference.rotary_backward(dy, cos, sin)
    return rotary.backward(dy, cos, sin)


def cross_entropy_fwd(logits, labels):
    """Mean cross-entropy and the number of correct argmaxes over rows of logits [N, V]."""
    xp = xp_of(logits)
    z = logits - logits.max(axis=-1, keepdims=True)
    ez = xp.exp(z)
    sez = ez.sum(axis=-1, keepdims=True)
    rows = xp.arange(labels.shape[0])
    nll = xp.log(sez[:, 0]) - z[rows, labels]
    correct = (logits.argmax(axis=-1) == labels).sum()
    return nll.mean(), correct, (ez / sez, labels)


def cross_entropy_bwd(cache):
    probs, labels = cache
    xp = xp_of(probs)
    d = probs.copy()
    d[xp.arange(labels.shape[0]), labels] -= 1
    return d / probs.dtype.type(labels.shape[0])


# ----------------------------------------------------------------------------- the model


class Transformer:
    """Forward keeps a tape of what each layer's backward needs; backward replays it in reverse."""

    def __init__(self, cfg: ModelConfig, attention: Attention):
        self.cfg = cfg
        self.attention = attention
        self._rope = {}

    def rope(self, xp, dtype):
        key = (xp.__name__, np.dtype(dtype).str)
        if key not in self._rope:
            self._rope[key] = rope_tables(self.cfg.seq, self.cfg.head_dim, self.cfg.rope_base, xp, dtype)
        return self._rope[key]

    def forward(self, params, tokens, targets):
        """(loss, correct, count, tape) for tokens/targets [B, S] on the parameters' device.

        Only the positions with a target (>= 0) go through the final norm and the head.
        """
        cfg = self.cfg
        xp = xp_of(params["embed"])
        dtype = params["embed"].dtype
        B, S = tokens.shape
        H, Hkv, Dh = cfg.heads, cfg.kv_heads, cfg.head_dim
        cos, sin = self.rope(xp, dtype)
        tape = {"tokens": tokens, "layers": []}

        x = params["embed"][tokens]  # [B, S, D]
        for i in range(cfg.layers):
            p = f"layers.{i}."
            t = {}
            # attention block
            xn, t["n1"] = rmsnorm_fwd(x, params[p + "attn_norm"])
            q = (xn @ params[p + "wq"]).reshape(B, S, H, Dh)
            k = (xn @ params[p + "wk"]).reshape(B, S, Hkv, Dh)
            v = (xn @ params[p + "wv"]).reshape(B, S, Hkv, Dh)
            qr = rope_fwd(q, cos, sin)  # new contiguous arrays
            kr = rope_fwd(k, cos, sin)
            v = xp.ascontiguousarray(v)
            o, lse = self.attention.forward(qr, kr, v)
            o2 = o.reshape(B, S, H * Dh)
            x = x + o2 @ params[p + "wo"]
            t.update(xn=xn, qr=qr, kr=kr, v=v, o=o, lse=lse)
            # MLP block
            hn, t["n2"] = rmsnorm_fwd(x, params[p + "mlp_norm"])
            u = hn @ params[p + "w1"]
            a, t["gelu"] = gelu_fwd(u)
            x = x + a @ params[p + "w2"]
            t.update(hn=hn, a=a)
            tape["layers"].append(t)

        flat = x.reshape(B * S, cfg.dim)
        sel = xp.nonzero(targets.reshape(-1) >= 0)[0]
        labels = targets.reshape(-1)[sel]
        xs, tape["nf"] = rmsnorm_fwd(flat[sel], params["final_norm"])
        logits = xs @ params["head"]
        loss, correct, tape["ce"] = cross_entropy_fwd(logits, labels)
        tape.update(sel=sel, xs=xs, shape=(B, S))
        return loss, correct, int(labels.shape[0]), tape

    def backward(self, params, tape):
        """Gradients of the mean loss for every parameter (same names, shapes, dtype, device)."""
        cfg = self.cfg
        xp = xp_of(params["embed"])
        dtype = params["embed"].dtype
        B, S = tape["shape"]
        H, Hkv, Dh = cfg.heads, cfg.kv_heads, cfg.head_dim
        cos, sin = self.rope(xp, dtype)
        grads = {}

        dlogits = cross_entropy_bwd(tape["ce"])
        dxs, grads["head"] = linear_bwd(dlogits, tape["xs"], params["head"])
        dsel, grads["final_norm"] = rmsnorm_bwd(dxs, tape["nf"])
        dflat = xp.zeros((B * S, cfg.dim), dtype=dtype)
        dflat[tape["sel"]] = dsel  # each selected row appears once: a plain scatter
        dx = dflat.reshape(B, S, cfg.dim)

        for i in reversed(range(cfg.layers)):
            p = f"layers.{i}."
            t = tape["layers"][i]
            # MLP block: x_out = x_mid + gelu(n2(x_mid) W1) W2
            da, grads[p + "w2"] = linear_bwd(dx, t["a"], params[p + "w2"])
            du = gelu_bwd(da, t["gelu"])
            dhn, grads[p + "w1"] = linear_bwd(du, t["hn"], params[p + "w1"])
            dmid, grads[p + "mlp_norm"] = rmsnorm_bwd(dhn, t["n2"])
            dx = dx + dmid
            # attention block: x_mid = x_in + attn(...) Wo
            do2, grads[p + "wo"] = linear_bwd(dx, t["o"].reshape(B, S, H * Dh), params[p + "wo"])
            do = xp.ascontiguousarray(do2.reshape(B, S, H, Dh))
            dqr, dkr, dv = self.attention.backward(do, t["qr"], t["kr"], t["v"], t["o"], t["lse"])
            dq = rope_bwd(dqr, cos, sin).reshape(B, S, H * Dh)
            dk = rope_bwd(dkr, cos, sin).reshape(B, S, Hkv * Dh)
            dv = dv.reshape(B, S, Hkv * Dh)
            xn = t["xn"]
            dxn, grads[p + "wq"] = linear_bwd(dq, xn, params[p + "wq"])
            dxn_k, grads[p + "wk"] = linear_bwd(dk, xn, params[p + "wk"])
            dxn_v, grads[p + "wv"] = linear_bwd(dv, xn, params[p + "wv"])
            din, grads[p + "attn_norm"] = rmsnorm_bwd(dxn + dxn_k + dxn_v, t["n1"])
            dx = dx + din

        # embedding: rows gathered by token id -> one-hot^T @ dx (deterministic, no scatter-add)
        tokens = tape["tokens"].reshape(-1)
        onehot = (tokens[:, None] == xp.arange(cfg.vocab)[None, :]).astype(dtype)
        grads["embed"] = onehot.T @ dx.reshape(B * S, cfg.dim)
        return {name: grads[name] for name in params}

    def loss_and_grads(self, params, tokens, targets):
        loss, correct, count, tape = self.forward(params, tokens, targets)
        return loss, correct, count, self.backward(params, tape)


def build_model(cfg: ModelConfig, attention):
    """The model that trains with `attention`: this module's hand-stitched Transformer for a
    NumPy/CuPy `Attention`, torch_model's modules for a `TorchAttention` (torch imported only then)."""
    if isinstance(attention, TorchAttention):
        from .torch_model import TorchTransformer

        return TorchTransformer(cfg, attention)
    return Transformer(cfg, attention)
