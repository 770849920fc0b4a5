"""flash_nif: exact FlashAttention forward (saving logsumexp) and backward.

Layout (identical in Python and Elixir):

=============  ===================  =========================================
tensor         shape                dtype
=============  ===================  =========================================
q, dq          [B, Sq, H, D]        float32, float16 or ml_dtypes.bfloat16
k, dk          [B, Sk, Hkv, D]      same as q; H % Hkv == 0 (GQA / MQA)
v, dv          [B, Sk, Hkv, Dv]     same as q
o, do          [B, Sq, H, Dv]       same as q
lse            [B, H, Sq]           float32, natural log of each row's sum
=============  ===================  =========================================

D and Dv are any head dims from 1 to 256, on every device; v's Dv may differ from q and k's D
(DeepSeek-style attention: D = 192, Dv = 128). ``causal`` defaults to True and is aligned
bottom-right (query i sees keys j <= i + Sk - Sq); ``scale`` defaults to 1/sqrt(D). A row that sees no key gives
o = 0, lse = -inf and zero gradients. Arithmetic is f32 whatever the storage dtype.
On the CPU, q, k, v (and the backward's o, do) are read where they lie when their strides allow
it — non-negative, last axis contiguous, native byte order: ``np.swapaxes`` of a [B, H, S, D]
array, ``qkv[:, :, 0]`` of a packed [B, S, 3, H, D] one, a batch slice — with no copy. Any other
view or byte order (and every input of a GPU call) is copied to C order first, never misread.

Masks (sliding windows, segment ids, key padding, block masks) and score modifiers (``softcap``,
``alibi_slopes``, attention ``sinks``) are keyword options of :func:`forward_with_states`,
:func:`forward` and :func:`backward`; packed variable-length batches (``cu_seqlens``) are
:mod:`flash_nif.varlen`; rotary position embeddings :mod:`flash_nif.rotary`.
"""

from __future__ import annotations

from . import _args, _native
from . import _cuda  # GPU arrays (CuPy, torch, DLPack) dispatch
from . import varlen  # packed variable-length batches (cu_seqlens)
from . import rotary  # rotary position embeddings (RoPE)
from .kv import QuantizedKV, decode, dequantize_kv, merge_states, quantize_kv  # KV caches for decoding
from . import errors, reference  # reference: the float64 oracle, flash_nif.reference.forward(...)
from .errors import (
    CompileError,
    DeviceError,
    DTypeError,
    FlashAttentionError,
    InternalError,
    OutOfMemoryError,
    ShapeError,
    UnsupportedError,
)

__version__ = _native.info()["version"]


def forward_with_states(
    q,
    k,
    v,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    segment_ids=None,
    seqused_k=None,
    leftpad_k=None,
    block_mask=None,
    softcap: float | None = None,
    alibi_slopes=None,
    sinks=None,
    device: str | None = None,
    mode: str = "auto",
    precision: str = "exact",
):
    """Attention output and log-sum-exp.

    q: [B, Sq, H, D]; k: [B, Sk, Hkv, D]; v: [B, Sk, Hkv, Dv]. Returns (o [B, Sq, H, Dv] in q's
    dtype, lse [B, H, Sq] float32). Keep both for :func:`backward`, with the same options and masks.

    Masks (all optional, all intersect; ``causal`` too):

    * ``window=(left, right)``: query i sees relative keys in ``[i + off - left, i + off + right]``,
      ``off`` aligning the diagonal bottom-right as ``causal`` does; each side an int >= 0, or None
      for unbounded. ``causal`` caps ``right`` at 0.
    * ``segment_ids=(seg_q [B, Sq], seg_k [B, Sk])``: query i sees key j only where
      ``seg_q[b, i] == seg_k[b, j]`` (documents packed into one row).
    * ``seqused_k [B]``, ``leftpad_k [B]``: batch row b's valid keys are
      ``[leftpad_k[b], seqused_k[b])`` (defaults 0 and Sk); the diagonal and window are counted from
      ``leftpad_k[b]``, with ``off = seqused_k[b] - leftpad_k[b] - Sq``.
    * ``block_mask [B or 1, H or 1, ceil(Sq/128), ceil(Sk/128)]`` bool or uint8: 0 hides the
      128 x 128 tile of queries and keys (FlexAttention's block size).

    Score modifiers (all optional), applied in this order to ``s = scale * q.k``:

    * ``softcap=c`` (c > 0): ``s = c * tanh(s / c)`` (Gemma 2);
    * ``alibi_slopes`` float32 ``[H]`` or ``[B, H]``: ``s -= slope * |i + off - j_rel|``, with the
      masks' ``off`` and relative key index ``j_rel = j - leftpad_k[b]`` (FlashAttention's ALiBi);
    * then the masks, then the softmax;
    * ``sinks`` float32 ``[H]`` (learnable, as in gpt-oss): one more logit per head in every row's
      denominator, with no value: ``lse = log(sum_j exp(s_j) + exp(sink_h))``. :func:`backward`
      then also returns ``dsinks``. A row that sees no key gets o = 0 and lse = sink_h.

    Index arrays are int32; an array of another integer dtype is converted when its values fit.
    NumPy arrays with NumPy data; with GPU data, arrays of the same library on the same device
    (seqused_k and leftpad_k are copied to the host: the core checks their values; so are the small
    alibi_slopes and sinks, from any library, converted to float32).
    A row that sees no key gives o = 0, lse = -inf and zero gradients.

    ``mode``: ``"fused"`` (tiled online softmax, O(S) memory), ``"materialized"`` (each head's
    whole S x S score matrix; fastest for short sequences) or ``"auto"`` (default: materialized
    where it fits ``FLASH_NIF_MATERIALIZE_MAX_BYTES`` and the crossover table in ``info()["dispatch"]``
    says it is faster). Both give the same results to the same bounds. The environment variable
    ``FLASH_NIF_MODE`` overrides it; an explicit ``"materialized"`` over the ceiling (or on a backend
    without that path) raises :class:`UnsupportedError`.

    ``precision`` (float32 inputs on a GPU): ``"exact"`` (default) keeps float32 accuracy, whichever
    kernel runs, the fastest exact one: the forward computes its products on tensor cores as split
    products (each float32 operand the sum of two 11-bit parts, three products per pair, summed in
    float32) from 16 keys on (on Hopper at head dims 64 and 128 without masks or modifiers the wgmma
    kernel on fp16 parts of power-of-two-scaled tiles, ``"3xf16"``; elsewhere TF32 parts, but at
    head dims 64 and 128, and below 16 keys, float32 FMAs, which are faster there); the backward
    likewise on fp16 parts on Hopper at head dims 64 and 128 without masks or modifiers (its wgmma
    kernels), elsewhere with float32 FMAs. ``"tf32"`` (asked for by name only) takes one TF32
    product per pair (Hopper's kernels: one product of scaled fp16 operands, the same 11 bits), forward and
    backward: faster, with relative
    errors of order 1e-3 (the operands rounded to 11 significant bits; bound ``5e-3`` of
    ||x - exact|| / ||exact|| for o, lse, dq, dk, dv, checked by tests/test_tf32.py). The CPU always computes in float32 and accepts
    either; float16 / bfloat16 inputs are unaffected.
    ``info()["cuda"]["last_kernels"]`` names the kernel that ran and its ``math``
    (``"3xf16"``, ``"3xtf32"``, ``"1xf16"``, ``"tf32"``, ``"f32-simt"``, ``"f16"``, ``"bf16"``).
    """
    opts, host_device = _args.options(causal, scale, window, device, mode=mode, precision=precision)
    opts.update(_args.modifiers(softcap, alibi_slopes, sinks))
    masks = _args.masks(segment_ids, seqused_k, leftpad_k, block_mask)
    if _cuda.any_gpu(q, k, v, *masks.values()):
        return _cuda.forward_with_states((q, k, v), opts, device, masks)
    q, k, v = (_args.host_view(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    return _native.forward_host_arrays([q, k, v], host_device, **opts, **_args.host_masks(masks))


def forward(
    q,
    k,
    v,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    segment_ids=None,
    seqused_k=None,
    leftpad_k=None,
    block_mask=None,
    softcap: float | None = None,
    alibi_slopes=None,
    sinks=None,
    device: str | None = None,
    mode: str = "auto",
    precision: str = "exact",
):
    """Attention output o [B, Sq, H, Dv] (q's dtype) for q [B, Sq, H, D], k [B, Sk, Hkv, D] and
    v [B, Sk, Hkv, Dv]; options, masks and modifiers as :func:`forward_with_states`."""
    return forward_with_states(
        q, k, v, causal=causal, scale=scale, window=window, segment_ids=segment_ids, seqused_k=seqused_k,
        leftpad_k=leftpad_k, block_mask=block_mask, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        device=device, mode=mode, precision=precision,
    )[0]


def backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    segment_ids=None,
    seqused_k=None,
    leftpad_k=None,
    block_mask=None,
    softcap: float | None = None,
    alibi_slopes=None,
    sinks=None,
    device: str | None = None,
    deterministic: bool = False,
    mode: str = "auto",
    precision: str = "exact",
    dlse=None,
):
    """Gradients (dq [B, Sq, H, D], dk [B, Sk, Hkv, D], dv [B, Sk, Hkv, Dv]) in q's dtype; with
    ``sinks``, (dq, dk, dv, dsinks [H] float32), dsinks summed over batch rows and query rows.

    do ([B, Sq, H, Dv], like o) is the gradient of the loss with respect to o; o and lse are what
    :func:`forward_with_states` returned for the same q, k, v, options and masks.
    dk and dv sum over the query heads that share each kv head. Masks and modifiers as
    :func:`forward_with_states` (the forward's own).

    The CPU backward is always bit-identical run to run (and across thread counts). On a GPU the
    default sums dQ with float32 atomics (faster; dq may differ in its last bits from run to run,
    dk and dv never do); ``deterministic=True`` takes the atomic-free path instead.

    ``mode`` as in :func:`forward_with_states` (the backward decides on its own: either path's
    backward takes either path's o and lse). The materialized backward holds S and dS per head.

    ``dlse`` (optional, [B, H, Sq] float32, like lse): the loss's gradient with respect to lse, for
    losses that use lse too (merged states, z-loss). It enters each row as ``delta - dlse``
    (``d lse / d s_j = P_j``); rows that see no key ignore it. FlashAttention has no such input.

    ``precision`` as in :func:`forward_with_states`: ``"exact"`` runs the float32 FMA backward (the
    split-TF32 one measured slower), ``"tf32"`` one TF32 product per pair.
    """
    opts, host_device = _args.options(causal, scale, window, device, deterministic, mode=mode, precision=precision)
    opts.update(_args.modifiers(softcap, alibi_slopes, sinks))
    masks = _args.masks(segment_ids, seqused_k, leftpad_k, block_mask)
    extra = () if dlse is None else (dlse,)
    if _cuda.any_gpu(do, q, k, v, o, lse, *extra, *masks.values()):
        return _cuda.backward((do, q, k, v, o, lse), opts, device, masks, dlse=dlse)
    names = ("do", "q", "k", "v", "o", "lse")
    arrays = [_args.host_view(x, n) for x, n in zip((do, q, k, v, o), names)]
    arrays.append(_args.host_array(lse, "lse"))
    return _native.backward_host_arrays(arrays, host_device, _args.optional_host(dlse, "dlse"), **opts,
                                        **_args.host_masks(masks))


def info() -> dict:
    """Version, available backends, CPU thread count and instruction set, the GPU (if any), and
    ``dispatch``: the fused / materialized choice (the environment's mode and ceiling, and each
    backend's crossover table, measured by bench/dispatch.py)."""
    return {**dict(_native.info()), "cuda": _cuda.info()}


def cuda_available() -> bool:
    """Whether the GPU backend can run here (``info()["backends"]`` lists ``"cuda"``): the build
    has it, the driver sees a GPU and NVRTC is found; ``device="auto"`` then picks the GPU."""
    return "cuda" in _native.info()["backends"]


__all__ = [
    "varlen",
    "rotary",
    "QuantizedKV",
    "quantize_kv",
    "dequantize_kv",
    "merge_states",
    "decode",
    "forward",
    "forward_with_states",
    "backward",
    "info",
    "cuda_available",
    "reference",
    *errors.__all__,
]
