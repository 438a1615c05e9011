"""Tensor-parallel layers: each holds this rank's shard of a layer's weight as a plain Parameter.

A layer is built *from* the unsharded module (its weights are sliced, so a tensor-parallel model
starts from exactly the weights of the model it came from) and keeps the attribute names
``weight`` / ``bias``, so ``state_dict`` keys never change. Which parameter is sharded how is
kept in a registry keyed by parameter (:func:`tensor_shard_of`), never on the parameter itself:
ZeRO's gradient-norm rule, the exports and the checkpoints read it to rebuild whole tensors.

- :class:`ColumnParallelLinear`: output features split (``weight`` rows, ``bias``); a fused
  projection (``chunks=3`` for q, k, v stacked in one matrix) splits each chunk separately, so
  every rank holds whole heads of q, k and v.
- :class:`RowParallelLinear`: input features split (``weight`` columns); the partial outputs are
  summed across ranks and the replicated ``bias`` added once, after the sum.
- :class:`VocabParallelEmbedding`: vocabulary rows split; a token's row lives on one rank, the
  others contribute zeros to the sum.
- :class:`SequenceParallelLayerNorm`: the replicated norm of Megatron sequence parallelism, run
  on this rank's sequence shard; its parameters' gradients are summed across the tensor ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from partita.tensor_parallel.comm import (
    copy_to_tensor,
    gather_sequence,
    reduce_from_tensor,
    reduce_scatter_sequence,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SequenceParallelLayerNorm",
    "TensorShard",
    "VocabParallelEmbedding",
    "tensor_shard_of",
    "is_tensor_replicated",
]


@dataclass(frozen=True)
class TensorShard:
    """How one parameter is split across the tensor ranks.

    ``dim``: the split dimension; ``full_shape``: the unsharded shape; ``chunks``: how many equal
    blocks of ``dim`` are split separately (3 for a fused q/k/v); this rank holds block-shard
    ``rank`` of each chunk, concatenated.
    """

    dim: int
    rank: int
    size: int
    full_shape: tuple[int, ...]
    chunks: int = 1
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    def full_ranges(self) -> list[tuple[int, int]]:
        """Index ranges ``[start, stop)`` along ``dim`` of the full tensor that this shard holds."""
        chunk = self.full_shape[self.dim] // self.chunks
        piece = chunk // self.size
        return [(c * chunk + self.rank * piece, c * chunk + (self.rank + 1) * piece) for c in range(self.chunks)]


# Parameter -> its TensorShard, by identity (tensors' == is elementwise) and weak: a dropped
# model drops its entries.
_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Parameters replicated across the tensor ranks of a tensor-parallel model (norms, row biases...).
_REPLICATED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def tensor_shard_of(param: torch.Tensor) -> TensorShard | None:
    """The tensor-parallel split of ``param``, or None when it is whole on every tensor rank."""
    return _SHARDS.get(param)


def is_tensor_replicated(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to a tensor-parallel model and every tensor rank holds it whole."""
    return param in _REPLICATED


def replicated_elsewhere(topology) -> list[torch.Tensor]:
    """This rank's copies of tensor-replicated parameters that another tensor rank (rank 0) counts
    in the global gradient norm: every such parameter on tensor ranks > 0, none on rank 0."""
    return [] if topology.tensor_size == 1 or topology.tensor_rank == 0 else list(_REPLICATED.keys())


def mark_replicated(params) -> None:
    for p in params:
        if p not in _SHARDS:
            _REPLICATED[p] = True


def shard_parameter(
    full: torch.Tensor, *, dim: int, rank: int, size: int, group: dist.ProcessGroup, chunks: int = 1, what: str
) -> nn.Parameter:
    """This rank's shard of ``full`` along ``dim`` as a new Parameter, registered in the registry."""
    length = full.shape[dim]
    if length % (chunks * size) != 0:
        fused = f" ({chunks} fused chunks of {length // chunks})" if chunks > 1 else ""
        raise ValueError(
            f"tensor parallelism: {what} has {length} along dimension {dim}{fused}, which does not divide by the "
            f"tensor size {size}; choose tensor_parallel.autotp_size dividing {length // chunks}, or resize the layer"
        )
    pieces = [c.chunk(size, dim=dim)[rank] for c in full.detach().chunk(chunks, dim=dim)]
    param = nn.Parameter(torch.cat(pieces, dim=dim).clone(), requires_grad=full.requires_grad)
    _SHARDS[param] = TensorShard(dim=dim, rank=rank, size=size, full_shape=tuple(full.shape), chunks=chunks, group=group)
    return param


class _Parallel(nn.Module):
    """Common state: the tensor group, and whether activations are sequence-sharded around this layer."""

    def __init__(self, group: dist.ProcessGroup, sequence_parallel: bool) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.tensor_rank = dist.get_rank(group)
        self.tensor_size = dist.get_world_size(group)

    def extra_repr(self) -> str:
        return f"tensor_size={self.tensor_size}, sequence_parallel={self.sequence_parallel}"


class ColumnParallelLinear(_Parallel):
    """``y_local = x W_local^T + b_local``: output features split; the output stays sharded
    (the next row-parallel layer or the vocabulary-parallel loss consumes it)."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, *, sequence_parallel: bool = False,
                 chunks: int = 1, name: str = "linear") -> None:
        super().__init__(group, sequence_parallel)
        shard = dict(dim=0, rank=self.tensor_rank, size=self.tensor_size, group=group, chunks=chunks)
        self.weight = shard_parameter(linear.weight, what=f"{name}.weight (output features)", **shard)
        self.bias = None if linear.bias is None else shard_parameter(linear.bias, what=f"{name}.bias", **shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_sequence(x, self.group) if self.sequence_parallel else copy_to_tensor(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(_Parallel):
    """``y = sum_ranks(x_local W_local^T) + b``: input features split, the bias replicated and
    added once after the sum (or the reduce-scatter, under sequence parallelism)."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, *, sequence_parallel: bool = False,
                 name: str = "linear") -> None:
        super().__init__(group, sequence_parallel)
        self.weight = shard_parameter(
            linear.weight, dim=1, rank=self.tensor_rank, size=self.tensor_size, group=group,
            what=f"{name}.weight (input features)",
        )
        self.bias = linear.bias
        if self.bias is not None:
            mark_replicated([self.bias])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_sequence(partial, self.group)
            # Each rank adds the bias to its own tokens: its gradient is partial, so sum it.
            return out if self.bias is None else out + copy_to_tensor(self.bias, self.group)
        out = reduce_from_tensor(partial, self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(_Parallel):
    """An embedding whose vocabulary rows are split; the lookup is summed across ranks (each
    token's row is on exactly one rank), or reduce-scattered along the sequence."""

    def __init__(self, embedding: nn.Embedding, group: dist.ProcessGroup, *, sequence_parallel: bool = False,
                 weight: nn.Parameter | None = None, name: str = "embedding") -> None:
        super().__init__(group, sequence_parallel)
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise NotImplementedError(
                f"tensor parallelism: {name} uses padding_idx/max_norm/sparse, which a vocabulary-parallel "
                "embedding does not support; keep it replicated with a plan entry \"replicate\""
            )
        self.num_embeddings = embedding.num_embeddings
        self.weight = weight if weight is not None else shard_parameter(
            embedding.weight, dim=0, rank=self.tensor_rank, size=self.tensor_size, group=group,
            what=f"{name}.weight (vocabulary)",
        )
        per_rank = self.num_embeddings // self.tensor_size
        self.vocab_start, self.vocab_end = self.tensor_rank * per_rank, (self.tensor_rank + 1) * per_rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(rows, self.group)
        return reduce_from_tensor(rows, self.group)


class SequenceParallelLayerNorm(_Parallel):
    """A LayerNorm run on this rank's sequence shard (Megatron sequence parallelism). Its
    parameters stay whole on every rank; their gradients, each from a different shard of the
    tokens, are summed across the tensor ranks by :func:`copy_to_tensor`."""

    def __init__(self, norm: nn.LayerNorm, group: dist.ProcessGroup) -> None:
        super().__init__(group, sequence_parallel=True)
        self.normalized_shape, self.eps = norm.normalized_shape, norm.eps
        self.weight, self.bias = norm.weight, norm.bias
        mark_replicated([p for p in (self.weight, self.bias) if p is not None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else copy_to_tensor(self.weight, self.group)
        bias = None if self.bias is None else copy_to_tensor(self.bias, self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def gather_whole(local: torch.Tensor, shard: TensorShard) -> torch.Tensor:
    """The whole tensor from every tensor rank's ``local`` shard (a collective over the tensor
    group): what exports, ``GatheredParameters`` and tests read."""
    from partita.tensor_parallel.comm import all_gather_along

    stacked = all_gather_along(local, shard.dim, shard.group, "tensor parallel: gather whole parameter")
    if shard.chunks == 1:
        return stacked
    # Rank r holds [chunk0_r, chunk1_r, ...]: reorder to [chunk0_0, chunk0_1, ..., chunk1_0, ...].
    per_rank = [piece.chunk(shard.chunks, dim=shard.dim) for piece in stacked.chunk(shard.size, dim=shard.dim)]
    return torch.cat([per_rank[r][c] for c in range(shard.chunks) for r in range(shard.size)], dim=shard.dim)
