"""Packed variable-length batches (FlashAttention's ``cu_seqlens`` convention).

B sequences of different lengths are stored back to back, without padding:

=============  =====================  ==============================================
tensor         shape                  notes
=============  =====================  ==============================================
q, dq          [total_q, H, D]        sequence b's queries are rows
                                      ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``
o, do          [total_q, H, Dv]       v's head dim Dv (any, like D, from 1 to 256)
k, dk          [total_k, Hkv, D]      its keys rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``
v, dv          [total_k, Hkv, Dv]
lse            [H, total_q]           float32
cu_seqlens_*   [B + 1]                int32: 0, then cumulative lengths (non-decreasing,
                                      the last equal to total_q / total_k)
=============  =====================  ==============================================

Each sequence attends only to its own keys, exactly as one batch row of
:func:`flash_nif.forward` with q and k of its lengths would: ``causal`` and ``window`` are aligned
bottom-right per sequence (query i of a sequence with q_len queries and k_len keys sees key j <=
i + k_len - q_len). dtypes, ``scale`` and ``device`` as in :func:`flash_nif.forward`; empty
sequences are allowed. cu_seqlens of another integer dtype are converted to int32 when their values
fit; with GPU data they are arrays of the same library on the same device (copied to the host:
the core checks them and sizes the launch from them).
"""

from __future__ import annotations

from . import _args, _cuda, _native


def forward_with_states(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes=None,
    sinks=None,
    device: str | None = None,
    mode: str = "auto",
    precision: str = "exact",
):
    """(o [total_q, H, Dv] in q's dtype, lse [H, total_q] float32) for packed q [total_q, H, D],
    k [total_k, Hkv, D] and v [total_k, Hkv, Dv]. ``window=(left, right)``, ``mode`` (materialized:
    the longest sequence's S x S per head) and the modifiers (``softcap``, ``alibi_slopes`` [H] or
    [B, H] with B the number of sequences, ``sinks`` [H]) and ``precision`` as in
    :func:`flash_nif.forward_with_states`."""
    opts, host_device = _args.options(causal, scale, window, device, mode=mode, precision=precision)
    opts.update(_args.modifiers(softcap, alibi_slopes, sinks))
    cu = (cu_seqlens_q, cu_seqlens_k)
    if _cuda.any_gpu(q, k, v, *cu):
        return _cuda.forward_with_states((q, k, v), opts, device, {}, cu_seqlens=cu)
    q, k, v = (_args.host_view(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    cu = [_args.host_int32(x, n) for x, n in zip(cu, _args.CU_NAMES)]
    return _native.varlen_forward_host_arrays([q, k, v], cu, host_device, **opts)


def forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes=None,
    sinks=None,
    device: str | None = None,
    mode: str = "auto",
    precision: str = "exact",
):
    """o [total_q, H, Dv] of :func:`forward_with_states`."""
    return forward_with_states(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, device=device, mode=mode, precision=precision,
    )[0]


def backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes=None,
    sinks=None,
    device: str | None = None,
    deterministic: bool = False,
    mode: str = "auto",
    precision: str = "exact",
    dlse=None,
):
    """(dq [total_q, H, D], dk [total_k, Hkv, D], dv [total_k, Hkv, Dv]) in q's dtype, from the
    forward's o and lse (same cu_seqlens and options); with ``sinks`` also dsinks [H] float32.
    ``deterministic``, ``mode``, ``precision`` and ``dlse`` ([H, total_q] float32, like lse) as in
    :func:`flash_nif.backward`."""
    opts, host_device = _args.options(causal, scale, window, device, deterministic, mode=mode, precision=precision)
    opts.update(_args.modifiers(softcap, alibi_slopes, sinks))
    cu = (cu_seqlens_q, cu_seqlens_k)
    extra = () if dlse is None else (dlse,)
    if _cuda.any_gpu(do, q, k, v, o, lse, *extra, *cu):
        return _cuda.backward((do, q, k, v, o, lse), opts, device, {}, cu_seqlens=cu, dlse=dlse)
    names = ("do", "q", "k", "v", "o", "lse")
    arrays = [_args.host_view(x, n) for x, n in zip((do, q, k, v, o), names)]
    arrays.append(_args.host_array(lse, "lse"))
    cu = [_args.host_int32(x, n) for x, n in zip(cu, _args.CU_NAMES)]
    return _native.varlen_backward_host_arrays(arrays, cu, host_device, _args.optional_host(dlse, "dlse"), **opts)


__all__ = ["forward", "forward_with_states", "backward"]
