"""flash_nif for PyTorch: attention as differentiable torch ops.

:func:`attention` returns o; :func:`attention_with_lse` returns (o, lse) with both differentiable
(lse's gradient enters the backward as delta - dlse per row: merged states, z-losses). They are
``torch.library.custom_op``\\ s (``flash_nif::attention_forward`` and
``flash_nif::attention_backward``) with fake (meta) implementations and registered autograd, so
``torch.compile(model, fullgraph=True)`` traces through them with no graph break, ``torch.export``
keeps each as one node, and ``torch.utils.checkpoint`` recomputes them like any op.

Layout: ``[B, S, H, D]`` like the rest of flash_nif (``layout="bshd"``), or ``layout="bhsd"``
for code written against ``F.scaled_dot_product_attention`` (q ``[B, H, Sq, D]``, o
``[B, H, Sq, Dv]``): the tensors are then transposed views, never copies, on the way in and out.
lse is ``[B, H, Sq]`` float32 in both layouts.

Devices follow the data: CPU tensors run on flash_nif's CPU backend, shared with NumPy (no copy;
bfloat16 is viewed as ``ml_dtypes.bfloat16`` through int16); CUDA tensors run flash_nif's kernels
on torch's current stream, outputs allocated by torch's caching allocator.

Strides: on CUDA the kernels take each input's batch, sequence and head strides, so views whose
last axis is contiguous — a ``bhsd`` transpose, ``qkv.unbind(2)``, a batch slice — run with no
copy (a view whose rows do not start on 16-byte boundaries is copied once inside the call, by the
kernels' own padding copy). On the CPU the same views reach the CPU kernels as NumPy views, read
where they lie too.

Under ``torch.autocast``, float32 q, k, v are cast to the autocast dtype first (as
``scaled_dot_product_attention`` is). ``import flash_nif`` never imports torch; importing this
module registers the ops.
"""

from typing import Optional

import ml_dtypes
import numpy as np
import torch

import flash_nif

__all__ = ["attention", "attention_with_lse", "ring_attention", "shard_sequence", "unshard_sequence"]

_LAYOUTS = ("bshd", "bhsd")


# ---- tensors <-> the flash_nif API ----------------------------------------------------------------


def _to_flash(t: Optional[torch.Tensor]):
    """A CPU tensor as a NumPy array sharing its memory (bfloat16 through int16); a CUDA tensor as
    it is (flash_nif's GPU dispatch takes torch tensors on torch's current stream)."""
    if t is None:
        return None
    t = t.detach()
    if t.device.type != "cpu":
        return t
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _from_flash(a) -> torch.Tensor:
    """flash_nif's output as a tensor (NumPy arrays shared, not copied)."""
    if isinstance(a, torch.Tensor):
        return a
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _options(seg_q, seg_k, seqused_k, leftpad_k, block_mask, alibi_slopes, sinks, causal, scale, window_left,
             window_right, softcap, mode, precision) -> dict:
    """The flash_nif keyword arguments of the ops' flat arguments."""
    window = None if window_left is None and window_right is None else (window_left, window_right)
    segment_ids = None if seg_q is None else (_to_flash(seg_q), _to_flash(seg_k))
    return dict(
        causal=causal, scale=scale, window=window, segment_ids=segment_ids, seqused_k=_to_flash(seqused_k),
        leftpad_k=_to_flash(leftpad_k), block_mask=_to_flash(block_mask), softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, mode=mode, precision=precision,
    )


# ---- the custom ops: flat arguments, [B, S, H, D] layout ----------------------------------------


@torch.library.custom_op("flash_nif::attention_forward", mutates_args=())
def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    seg_q: Optional[torch.Tensor], seg_k: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
    leftpad_k: Optional[torch.Tensor], block_mask: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
    causal: bool, scale: Optional[float], window_left: Optional[int], window_right: Optional[int],
    softcap: Optional[float], deterministic: bool, mode: str, precision: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, Sq, H, Dv] in q's dtype, lse [B, H, Sq] float32). ``deterministic`` is the
    backward's, carried here so that the autograd formula sees it."""
    opts = _options(seg_q, seg_k, seqused_k, leftpad_k, block_mask, alibi_slopes, sinks, causal, scale,
                    window_left, window_right, softcap, mode, precision)
    o, lse = flash_nif.forward_with_states(_to_flash(q), _to_flash(k), _to_flash(v), **opts)
    return _from_flash(o), _from_flash(lse)


@_forward.register_fake
def _(q, k, v, seg_q, seg_k, seqused_k, leftpad_k, block_mask, alibi_slopes, sinks, causal, scale, window_left,
      window_right, softcap, deterministic, mode, precision):
    b, sq, h = q.shape[0], q.shape[1], q.shape[2]
    o = q.new_empty((b, sq, h, v.shape[-1]))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return o, lse


@torch.library.custom_op("flash_nif::attention_backward", mutates_args=())
def _backward(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    dlse: Optional[torch.Tensor],
    seg_q: Optional[torch.Tensor], seg_k: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
    leftpad_k: Optional[torch.Tensor], block_mask: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
    causal: bool, scale: Optional[float], window_left: Optional[int], window_right: Optional[int],
    softcap: Optional[float], deterministic: bool, mode: str, precision: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks): dsinks [H] float32 with sinks, else an empty [0] tensor."""
    opts = _options(seg_q, seg_k, seqused_k, leftpad_k, block_mask, alibi_slopes, sinks, causal, scale,
                    window_left, window_right, softcap, mode, precision)
    arrays = [_to_flash(x) for x in (do, q, k, v, o, lse)]
    grads = flash_nif.backward(*arrays, dlse=_to_flash(dlse), deterministic=deterministic, **opts)
    dq, dk, dv = (_from_flash(g) for g in grads[:3])
    dsinks = _from_flash(grads[3]) if len(grads) == 4 else q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dsinks


@_backward.register_fake
def _(do, q, k, v, o, lse, dlse, seg_q, seg_k, seqused_k, leftpad_k, block_mask, alibi_slopes, sinks, causal,
      scale, window_left, window_right, softcap, deterministic, mode, precision):
    dsinks = q.new_empty((0 if sinks is None else q.shape[2],), dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


# Forward op inputs after q, k, v: the mask and modifier tensors, then the options.
_TENSOR_OPTIONS = ("seg_q", "seg_k", "seqused_k", "leftpad_k", "block_mask", "alibi_slopes", "sinks")
_SCALAR_OPTIONS = ("causal", "scale", "window_left", "window_right", "softcap", "deterministic", "mode", "precision")


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    tensors, scalars = rest[: len(_TENSOR_OPTIONS)], rest[len(_TENSOR_OPTIONS):]
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, *tensors)
    ctx.scalars = scalars
    ctx.sinks_dtype = None if tensors[-1] is None else tensors[-1].dtype
    ctx.set_materialize_grads(False)  # an unused lse (attention()) gives dlse None, not zeros


def _autograd_backward(ctx, do, dlse):
    q, k, v, o, lse, *tensors = ctx.saved_tensors
    none = (None,) * (len(_TENSOR_OPTIONS) + len(_SCALAR_OPTIONS))
    if do is None and dlse is None:
        return (None, None, None, *none)
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv, dsinks = _backward(do, q, k, v, o, lse, dlse, *tensors, *ctx.scalars)
    grads = [dq, dk, dv, *none]
    if ctx.sinks_dtype is not None:
        grads[3 + _TENSOR_OPTIONS.index("sinks")] = dsinks.to(ctx.sinks_dtype)
    return tuple(grads)


torch.library.register_autograd("flash_nif::attention_forward", _autograd_backward, setup_context=_setup_context)


# ---- the public functions -----------------------------------------------------------------------


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    window: Optional[tuple] = None,
    segment_ids: Optional[tuple] = None,
    seqused_k: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    block_mask: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    mode: str = "auto",
    precision: str = "exact",
    layout: str = "bshd",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse), both differentiable: o ``[B, Sq, H, Dv]`` in q's dtype (``[B, H, Sq, Dv]`` with
    ``layout="bhsd"``) and lse ``[B, H, Sq]`` float32.

    q ``[B, Sq, H, D]``, k ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]`` (GQA: H a multiple of Hkv),
    float32, float16 or bfloat16, all on one device. Gradients flow to q, k, v and ``sinks``
    (when given); masks, modifiers, ``mode`` and ``precision`` as :func:`flash_nif.forward_with_states`,
    ``deterministic`` as :func:`flash_nif.backward`. Mask tensors live on q's device.
    """
    if layout not in _LAYOUTS:
        raise flash_nif.UnsupportedError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
    if window is None:
        window = (None, None)
    if not (isinstance(window, tuple) and len(window) == 2):
        raise flash_nif.UnsupportedError(f"window must be a (left, right) tuple of non-negative ints or None; got {window!r}")
    seg_q, seg_k = (None, None) if segment_ids is None else _pair(segment_ids)
    if layout == "bhsd":  # [B, H, S, D] -> [B, S, H, D] views
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if torch.is_autocast_enabled(q.device.type) and q.dtype == torch.float32:
        low = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(low), k.to(low), v.to(low)
    o, lse = _forward(q, k, v, seg_q, seg_k, seqused_k, leftpad_k, block_mask, alibi_slopes, sinks, causal, scale,
                      window[0], window[1], softcap, deterministic, mode, precision)
    return (o.transpose(1, 2) if layout == "bhsd" else o), lse


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    window: Optional[tuple] = None,
    segment_ids: Optional[tuple] = None,
    seqused_k: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    block_mask: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    mode: str = "auto",
    precision: str = "exact",
    layout: str = "bshd",
) -> torch.Tensor:
    """Attention output o ``[B, Sq, H, Dv]`` (``[B, H, Sq, Dv]`` with ``layout="bhsd"``),
    differentiable with respect to q, k, v (and ``sinks``); arguments as :func:`attention_with_lse`."""
    return attention_with_lse(
        q, k, v, causal=causal, scale=scale, window=window, segment_ids=segment_ids, seqused_k=seqused_k,
        leftpad_k=leftpad_k, block_mask=block_mask, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        deterministic=deterministic, mode=mode, precision=precision, layout=layout,
    )[0]


def _pair(segment_ids):
    if not (isinstance(segment_ids, tuple) and len(segment_ids) == 2):
        raise flash_nif.UnsupportedError("segment_ids must be a (seg_q, seg_k) tuple of tensors")
    return segment_ids


from .ring import ring_attention, shard_sequence, unshard_sequence  # noqa: E402 (ring.py calls the ops above)
