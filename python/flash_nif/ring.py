"""Ring attention (context parallelism): exact attention over a sequence split across the ranks of
a ``torch.distributed`` group. Public through :mod:`flash_nif.torch` (``ring_attention``,
``shard_sequence``, ``unshard_sequence``).

Each rank holds its shard of q, k, v (``[B, S/world, H, D]``; k, v ``[B, S/world, Hkv, D]``). The
forward passes K/V blocks around the ring (rank r sends to r+1, receives from r-1), one block per
step, ``world`` steps in all; each step is one call of our forward op on the block in hand,
returning (o, lse), and the partial results are merged by their logsumexp into f32 accumulators.
The backward passes K/V around again together with f32 dK/dV accumulators, which travel with
their block and reach its home rank after a full loop; each block's gradients come from our
backward op given the *final* o and lse (its delta = rowsum(dO * O) is then the whole row's, so
the per-block gradients are exact and simply add up). dQ accumulates locally in f32.

Overlap: the transfer of the next block is posted before the attention of the block in hand.
On CUDA the transfers are posted from a stream of their own that first waits on the compute
stream (the block to send is ready); compute waits on a transfer's completion (``Work.wait()``,
a stream-side wait, no host sync) only when it needs the received block. dK/dV of step i travel
while step i+1 computes. The summation order is fixed by the ring, so with
``deterministic=True`` (passed to our backward kernels) the gradients are bitwise reproducible.

Layouts of the sequence over ranks (S split into equal chunks):

- ``"zigzag"`` (default): 2·world chunks, rank r holds chunks r and 2·world-1-r. With causal
  masking every rank then does the same work: at step 0 the block is the rank's own (causal);
  a block from an earlier rank is seen fully by all local queries but only in its first chunk;
  a block from a later rank is seen fully (both chunks) by the local second chunk only. Fully
  masked halves are never computed.
- ``"contiguous"``: world chunks, rank r holds chunk r. Causal works (blocks from later ranks are
  skipped, the own block is causal) but is unbalanced: the last rank does world times the work
  of the first. Meant for non-causal attention.

Masks: causal or none. Sliding windows, segment ids / varlen documents and the other masks of
:func:`flash_nif.torch.attention` are not supported across shards yet (a later step).

Memory per rank is O(S/world): the local shard, two K/V blocks in flight, the accumulators.
Nothing gathers the full sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .errors import DTypeError, ShapeError, UnsupportedError

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence"]

LAYOUTS = ("zigzag", "contiguous")


# ---- the sequence layout over ranks --------------------------------------------------------------


def _chunks_of(rank: int, world: int, layout: str) -> tuple[int, tuple[int, ...]]:
    """(number of equal chunks the sequence is cut into, the chunks rank holds, in order)."""
    if layout == "zigzag":
        return 2 * world, (rank, 2 * world - 1 - rank)
    return world, (rank,)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise UnsupportedError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, *, layout: str = "zigzag",
                   dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of the full tensor ``x`` along ``dim`` (the sequence; 1 in ``[B, S, H,
    D]``): chunk ``rank`` of ``world_size`` (``"contiguous"``), or chunks ``rank`` and
    ``2·world_size-1-rank`` of ``2·world_size``, concatenated (``"zigzag"``). A new tensor."""
    _check_layout(layout)
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise UnsupportedError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
    n, mine = _chunks_of(rank, world_size, layout)
    s = x.shape[dim]
    if s % n:
        raise ShapeError(f"the sequence (dim {dim}, length {s}) must split into {n} equal chunks for "
                         f"layout={layout!r} over {world_size} ranks")
    chunks = x.chunk(n, dim)
    return torch.cat([chunks[c] for c in mine], dim)


def unshard_sequence(shards: Sequence[torch.Tensor], *, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard (``shards[r]`` from rank r, as
    :func:`shard_sequence` cut them). Needs all shards in one process (tests, debugging): the
    ring itself never does this."""
    _check_layout(layout)
    shards = list(shards)
    if not shards:
        raise ShapeError("unshard_sequence needs at least one shard")
    first = shards[0]
    for r, t in enumerate(shards):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ShapeError(f"shard {r} is {tuple(t.shape)} {t.dtype} on {t.device}; shard 0 is "
                             f"{tuple(first.shape)} {first.dtype} on {first.device}: shards must match")
    world = len(shards)
    n, _ = _chunks_of(0, world, layout)
    per = n // world
    if first.shape[dim] % per:
        raise ShapeError(f"a zigzag shard holds 2 equal chunks: its length {first.shape[dim]} (dim {dim}) must be even")
    pieces: list[Optional[torch.Tensor]] = [None] * n
    for r, t in enumerate(shards):
        for c, piece in zip(_chunks_of(r, world, layout)[1], t.chunk(per, dim)):
            pieces[c] = piece
    return torch.cat(pieces, dim)


# ---- which part of a held block each step computes ---------------------------------------------


@dataclass(frozen=True)
class _Block:
    q: slice  # local query rows that see the held K/V block
    kv: slice  # rows of the held K/V block they see
    causal: bool  # the diagonal block (own K/V): causal within it


def _block(rank: int, src: int, n: int, causal: bool, layout: str) -> Optional[_Block]:
    """The work of rank ``rank`` on the K/V block that rank ``src`` holds (local length ``n``), or
    None when causal masking hides it entirely."""
    every = slice(0, n)
    if not causal:
        return _Block(every, every, False)
    if src == rank:
        return _Block(every, every, True)
    if layout == "contiguous":
        return _Block(every, every, False) if src < rank else None
    half = n // 2
    if src < rank:  # src's first chunk precedes both of ours; its second follows both
        return _Block(every, slice(0, half), False)
    return _Block(slice(half, n), every, False)  # src's chunks both lie between our two


# ---- the ring's transport -----------------------------------------------------------------------


_STREAMS: dict[int, torch.cuda.Stream] = {}


class _Ring:
    """Shifts a tensor one rank along the ring (send to rank+1, receive from rank-1)."""

    def __init__(self, group, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        g = group if group is not None else dist.group.WORLD
        self.next = dist.get_global_rank(g, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(g, (self.rank - 1) % self.world)
        self.stream = None
        if device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            if idx not in _STREAMS:
                _STREAMS[idx] = torch.cuda.Stream(idx)
            self.stream = _STREAMS[idx]

    def shift(self, send: torch.Tensor, tag: int):
        """Posts the transfer; returns a handle for :meth:`wait`. ``send`` must not change until then."""
        if self.world == 1:
            return send, ()
        recv = torch.empty_like(send)  # allocated on the compute stream, which will use it
        if self.stream is None:
            works = dist.batch_isend_irecv(self._ops(send, recv, tag))
        else:
            self.stream.wait_stream(torch.cuda.current_stream(send.device))  # send is ready
            with torch.cuda.stream(self.stream):
                works = dist.batch_isend_irecv(self._ops(send, recv, tag))
        return recv, (works, send)  # keeps send alive until the wait

    def _ops(self, send, recv, tag):
        return [dist.P2POp(dist.isend, send, self.next, self.group, tag),
                dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]

    @staticmethod
    def wait(handle) -> torch.Tensor:
        """The received tensor; on CUDA the current stream waits for it (no host sync)."""
        recv, pending = handle
        if pending:
            for w in pending[0]:
                w.wait()
        return recv


def _pack(*ts: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """One flat buffer holding ``ts`` (one message per step instead of one per tensor)."""
    return torch.cat([t.reshape(-1) if dtype is None else t.reshape(-1).to(dtype) for t in ts])


def _unpack(buf: torch.Tensor, *shapes) -> list[torch.Tensor]:
    out, at = [], 0
    for shape in shapes:
        size = torch.Size(shape).numel()
        out.append(buf[at:at + size].view(shape))
        at += size
    return out


# ---- one block through our ops --------------------------------------------------------------------


def _block_forward(q, k, v, causal, scale, deterministic):
    """(o [B, Sq, H, Dv] in q's dtype, lse [B, H, Sq] f32) of one block: flash_nif::attention_forward."""
    none7 = (None,) * 7
    return _ops._forward(q, k, v, *none7, causal, scale, None, None, None, deterministic, "auto", "exact")


def _block_backward(do, q, k, v, o, lse, causal, scale, deterministic):
    """(dq, dk, dv) of one block given the final o and lse: flash_nif::attention_backward."""
    none7 = (None,) * 7
    dq, dk, dv, _ = _ops._backward(do, q, k, v, o, lse, None, *none7, causal, scale, None, None, None,
                                   deterministic, "auto", "exact")
    return dq, dk, dv


def _merge_(o_acc, lse_acc, o, lse):
    """In place: (o_acc [B, Sq, H, Dv] f32, lse_acc [B, H, Sq] f32) <- their merge with a block's
    (o, lse) by logsumexp (as flash_nif.merge_states: rows no part saw stay o = 0, lse = -inf)."""
    new = torch.logaddexp(lse_acc, lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)  # both -inf: weights exp(-inf) = 0, not NaN
    w_acc = torch.exp(lse_acc - safe).transpose(1, 2).unsqueeze(-1)  # [B, Sq, H, 1]
    w_blk = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    o_acc.mul_(w_acc).add_(o.float() * w_blk)
    lse_acc.copy_(new)


# ---- forward and backward around the ring --------------------------------------------------------


def _ring_forward(ring: _Ring, q, k, v, causal, scale, layout, deterministic):
    b, n, h, _ = q.shape
    o_acc = q.new_zeros((b, n, h, v.shape[-1]), dtype=torch.float32)  # [B, S/w, H, Dv]
    lse_acc = q.new_full((b, h, n), float("-inf"), dtype=torch.float32)  # [B, H, S/w]
    kv = _pack(k, v)
    for step in range(ring.world):
        nxt = ring.shift(kv, tag=0) if step + 1 < ring.world else None
        blk = _block(ring.rank, (ring.rank - step) % ring.world, n, causal, layout)
        if blk is not None:
            kb, vb = _unpack(kv, k.shape, v.shape)
            o, lse = _block_forward(q[:, blk.q], kb[:, blk.kv], vb[:, blk.kv], blk.causal, scale, deterministic)
            _merge_(o_acc[:, blk.q], lse_acc[:, :, blk.q], o, lse)
        if nxt is not None:
            kv = ring.wait(nxt)
    return o_acc.to(q.dtype), lse_acc


def _ring_backward(ring: _Ring, do, q, k, v, o, lse, causal, scale, layout, deterministic):
    n = q.shape[1]
    dq_acc = torch.zeros_like(q, dtype=torch.float32)
    kv = _pack(k, v)
    dkv_next = None
    for step in range(ring.world):
        kv_next = ring.shift(kv, tag=0) if step + 1 < ring.world else None
        blk = _block(ring.rank, (ring.rank - step) % ring.world, n, causal, layout)
        if blk is not None:
            kb, vb = _unpack(kv, k.shape, v.shape)
            dq, dk, dv = _block_backward(do[:, blk.q], q[:, blk.q], kb[:, blk.kv], vb[:, blk.kv], o[:, blk.q],
                                         lse[:, :, blk.q], blk.causal, scale, deterministic)
            dq_acc[:, blk.q] += dq
        # the dK/dV accumulator of the held block: fresh at step 0, else the one that came with it
        dkv = kv.new_zeros(kv.shape, dtype=torch.float32) if dkv_next is None else ring.wait(dkv_next)
        if blk is not None:
            dk_acc, dv_acc = _unpack(dkv, k.shape, v.shape)
            dk_acc[:, blk.kv] += dk
            dv_acc[:, blk.kv] += dv
        dkv_next = ring.shift(dkv, tag=1)  # after the last step this brings each block's home
        if kv_next is not None:
            kv = ring.wait(kv_next)
    dk, dv = _unpack(ring.wait(dkv_next), k.shape, v.shape)
    return dq_acc.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, layout, deterministic):
        ring = _Ring(group, q.device)
        o, lse = _ring_forward(ring, q, k, v, causal, scale, layout, deterministic)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.ring, ctx.args = ring, (causal, scale, layout, deterministic)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.ring, do, q, k, v, o, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def _check(q, k, v, layout):
    _check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ShapeError(f"{name} must be a 4-d tensor [B, S/world, heads, D]; got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if not (q.shape[0] == k.shape[0] == v.shape[0] and q.shape[1] == k.shape[1] == v.shape[1]):
        raise ShapeError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: ring attention needs one "
                         "batch and one local sequence length (shards of one sequence) in q, k, v")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ShapeError(f"a zigzag shard holds 2 equal chunks: its length {q.shape[1]} must be even")
    if not (q.dtype == k.dtype == v.dtype):
        raise DTypeError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise UnsupportedError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, causal: bool = True,
                   scale: Optional[float] = None, layout: str = "zigzag", deterministic: bool = False) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group`` (None: the default
    group): o ``[B, S/world, H, Dv]``, this rank's shard, differentiable with respect to q, k, v.

    Every rank calls it with its shard (:func:`shard_sequence` with the same ``layout``): q ``[B,
    S/world, H, D]``, k ``[B, S/world, Hkv, D]``, v ``[B, S/world, Hkv, Dv]`` (GQA: H a multiple of
    Hkv), float32 / float16 / bfloat16, on the device that the group's backend serves (CUDA with
    NCCL, CPU with gloo). ``causal`` (default True) is over the full sequence; ``scale`` defaults to
    1/sqrt(D); ``deterministic`` as :func:`flash_nif.backward`. Every rank must pass the same shapes
    and options. Only causal masking (or none) is supported across shards."""
    _check(q, k, v, layout)
    if not (dist.is_available() and dist.is_initialized()):
        raise UnsupportedError("ring_attention needs torch.distributed initialised "
                               "(torch.distributed.init_process_group): each rank passes its own shard")
    return _RingAttention.apply(q, k, v, group, causal, scale, layout, deterministic)


# Last, so that importing either module first works: flash_nif.torch re-exports this module's names.
from . import torch as _ops  # noqa: E402
