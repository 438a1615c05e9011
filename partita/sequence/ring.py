"""Ring attention (context parallelism) over the sequence group.

Each rank keeps its queries; the key/value blocks travel around the ring (rank r sends to r+1 and
receives from r-1), so after ``n`` steps every query block has met every key/value block. The
exchange for the next step is posted with ``dist.batch_isend_irecv`` before the current block's
attention and waited for after it, so communication overlaps compute. Partial results merge
through their log-sum-exp (:mod:`partita.sequence.block_kernels`), in fp32.

Causal masks use the ``"balanced"`` layout (:mod:`partita.sequence.sharding`: rank r holds chunks r
and 2n-1-r). Then every step does half a block of work on every rank: at step i the keys come
from rank s = r - i, and

- s == r: the local block with the causal mask;
- s <  r: all queries against the *early* half of the keys (the late half is in their future);
- s >  r: only the *late* half of the queries, against all keys (the early half sees nothing).

``"contiguous"`` with a causal mask is also supported (steps with s > r are skipped, so rank n-1
does n times the work of rank 0); without a mask every step is a full block.

Backward is written out rather than left to autograd through the ring steps: autograd would
need every received block and its score matrix kept alive until backward (memory the ring
exists to avoid) and a differentiable send/receive whose backward order must match on every
rank. Here forward saves only the local q, k, v, the merged output and lse; backward sends the
key/value blocks around again, and with them an fp32 accumulator of their gradients: rank r adds
its share for the block it holds and passes the sum on, so after ``n`` steps plus one final
exchange each rank holds the complete gradient of its own keys and values.

Why not ``torch.distributed.tensor.experimental.context_parallel``: it is a prototype that
reroutes SDPA through DTensor dispatch and shards buffers in place; it intercepts only the CUDA
flash / efficient / cuDNN ops (so it cannot run, or be tested, on CPU gloo), supports no attention
mask but causal, and needs the model's SDPA call to happen inside its context manager. A function
over a process group composes with Ulysses, with ZeRO and with partita's CPU tests.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.distributed.collective_errors import explain_collective_failure
from partita.monitor.comms_logger import COMMS_LOGGER
from partita.sequence.block_kernels import BlockKernel, pick_kernel
from partita.sequence.sharding import LAYOUTS, Layout

__all__ = ["RingAttention", "ring_attention"]

_KV_TAG, _GRAD_TAG = 17, 18  # kv blocks and their gradient accumulators travel the same links


class _Ring:
    """Send to the next rank, receive from the previous one, in this group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensor: torch.Tensor, *, tag: int, purpose: str) -> tuple[list[Any], torch.Tensor]:
        """Post the exchange; returns the requests and the buffer that will hold the received block."""
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ]
        token = COMMS_LOGGER.start("batch_isend_irecv", tensor.numel() * tensor.element_size(), tensor, self.group, purpose)
        with explain_collective_failure(purpose):
            requests = dist.batch_isend_irecv(ops)
        COMMS_LOGGER.finish(token, None)
        return requests, received

    @staticmethod
    def wait(requests: list[Any], purpose: str) -> None:
        with explain_collective_failure(purpose):
            for request in requests:
                request.wait()


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buffer: torch.Tensor, k_shape: torch.Size, v_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    n = k_shape.numel()
    return buffer[:n].view(k_shape), buffer[n:].view(v_shape)


def _plan(step: int, rank: int, size: int, *, causal: bool, layout: Layout) -> str:
    """What the held block contributes at ``step``: "diagonal", "full", "early_keys", "late_queries" or "skip"."""
    if not causal:
        return "full"
    source = (rank - step) % size
    if source == rank:
        return "diagonal"
    if layout == "contiguous":
        return "full" if source < rank else "skip"
    return "early_keys" if source < rank else "late_queries"


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (output, lse) into the running fp32 (out, lse), in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse)[..., None]).add_(block_out.float() * torch.exp(block_lse - new_lse)[..., None])
    lse.copy_(new_lse)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, group, causal: bool, layout: Layout, scale: float, prefer_math: bool):
        ring = _Ring(group)
        kernel = pick_kernel(q, prefer_math=prefer_math)
        half = q.size(2) // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = _pack(k, v)
        for step in range(ring.size):
            pending = ring.start(kv, tag=_KV_TAG, purpose="ring attention kv") if step + 1 < ring.size else None
            k_blk, v_blk = _unpack(kv, k.shape, v.shape)
            plan = _plan(step, ring.rank, ring.size, causal=causal, layout=layout)
            if plan in ("diagonal", "full"):
                block_out, block_lse = kernel.forward(q, k_blk, v_blk, causal=plan == "diagonal", scale=scale)
                _merge(out, lse, block_out, block_lse)
            elif plan == "early_keys":
                block_out, block_lse = kernel.forward(
                    q, k_blk[:, :, :half].contiguous(), v_blk[:, :, :half].contiguous(), causal=False, scale=scale
                )
                _merge(out, lse, block_out, block_lse)
            elif plan == "late_queries":
                block_out, block_lse = kernel.forward(q[:, :, half:].contiguous(), k_blk, v_blk, causal=False, scale=scale)
                _merge(out[:, :, half:], lse[:, :, half:], block_out, block_lse)
            if pending is not None:
                _Ring.wait(pending[0], "ring attention kv")
                kv = pending[1]
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.ring, ctx.kernel, ctx.causal, ctx.layout, ctx.scale = ring, kernel, causal, layout, scale
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, kernel, scale = ctx.ring, ctx.kernel, ctx.scale
        dout = dout.contiguous()
        half = q.size(2) // 2
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = _pack(k, v)
        grad_pending = None
        for step in range(ring.size):
            pending = ring.start(kv, tag=_KV_TAG, purpose="ring attention kv (backward)") if step + 1 < ring.size else None
            k_blk, v_blk = _unpack(kv, k.shape, v.shape)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            dk_blk, dv_blk = _unpack(dkv, k.shape, v.shape)
            plan = _plan(step, ring.rank, ring.size, causal=ctx.causal, layout=ctx.layout)
            if plan in ("diagonal", "full"):
                g = kernel.backward(dout, q, k_blk, v_blk, out, lse, causal=plan == "diagonal", scale=scale)
                dq += g[0]
                dk_blk += g[1]
                dv_blk += g[2]
            elif plan == "early_keys":
                g = kernel.backward(
                    dout, q, k_blk[:, :, :half].contiguous(), v_blk[:, :, :half].contiguous(), out, lse,
                    causal=False, scale=scale,
                )
                dq += g[0]
                dk_blk[:, :, :half] += g[1]
                dv_blk[:, :, :half] += g[2]
            elif plan == "late_queries":
                rows = slice(half, None)
                late = (t[:, :, rows].contiguous() for t in (dout, q, out, lse))
                dout_l, q_l, out_l, lse_l = late
                g = kernel.backward(dout_l, q_l, k_blk, v_blk, out_l, lse_l, causal=False, scale=scale)
                dq[:, :, rows] += g[0]
                dk_blk += g[1]
                dv_blk += g[2]
            if grad_pending is not None:
                # The sum so far for the block this rank holds, from the ranks that held it before.
                _Ring.wait(grad_pending[0], "ring attention kv gradients")
                dkv += grad_pending[1]
            if ring.size > 1:
                grad_pending = ring.start(dkv, tag=_GRAD_TAG, purpose="ring attention kv gradients")
            else:
                grad_pending = ([], dkv)
            if pending is not None:
                _Ring.wait(pending[0], "ring attention kv (backward)")
                kv = pending[1]
        # The last exchange hands each block's complete gradient to its owner.
        _Ring.wait(grad_pending[0], "ring attention kv gradients")
        dk, dv = _unpack(grad_pending[1], k.shape, v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    causal: bool = True,
    layout: Layout = "balanced",
    scale: float | None = None,
    prefer_math: bool = False,
) -> torch.Tensor:
    """Attention of this rank's queries against the keys and values of every rank of ``group``.

    ``query``, ``key``, ``value``: ``(batch, heads, local_len, head_dim)``, this rank's tokens in
    ``layout`` (:func:`partita.sequence.sharding.shard_sequence`); every rank of the group holds
    the same number. Returns this rank's output rows, same shape as ``query``. ``prefer_math``
    forces the plain-torch block kernel (the fused aten kernels are used otherwise).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"ring_attention(layout={layout!r}): choose one of {list(LAYOUTS)}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"ring_attention: {name} has shape {tuple(t.shape)}; expected (batch, heads, local_len, head_dim)")
    if key.shape[:3] != query.shape[:3] or value.shape[:3] != query.shape[:3]:
        raise ValueError(
            f"ring_attention: query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} must "
            "agree in batch, heads and local length (self-attention over one sharded sequence; repeat grouped "
            "key/value heads before the call)"
        )
    if causal and layout == "balanced" and query.size(2) % 2 != 0:
        raise ValueError(
            f"ring_attention: local length {query.size(2)} is odd, but the balanced causal layout holds two equal "
            "chunks per rank; make sequences a multiple of 2 x sequence_parallel_size"
        )
    scale = query.size(-1) ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(
        query.contiguous(), key.contiguous(), value.contiguous(), group, causal, layout, scale, prefer_math
    )


class RingAttention(nn.Module):
    """:func:`ring_attention` as a module, for models built before ``partita.initialize``:
    with ``sequence_process_group=None``, ``initialize`` (``sequence_parallel_size > 1``) binds
    it to the job's sequence group, as it does for ``DistributedAttention``.

    ``forward(query, key, value)`` on ``(batch, heads, local_len, head_dim)`` shards in ``layout``.
    """

    def __init__(
        self,
        sequence_process_group: dist.ProcessGroup | None = None,
        *,
        causal: bool = True,
        layout: Layout = "balanced",
        scale: float | None = None,
    ) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"RingAttention(layout={layout!r}): choose one of {list(LAYOUTS)}")
        self.group = sequence_process_group
        self.causal, self.layout, self.scale = causal, layout, scale

    def bind_group(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            raise RuntimeError(
                "RingAttention has no sequence group: build it with sequence_process_group="
                "engine.topology.sequence_group, or set sequence_parallel_size > 1 so partita.initialize binds it"
            )
        return ring_attention(
            query, key, value, group=self.group, causal=self.causal, layout=self.layout, scale=self.scale
        )
