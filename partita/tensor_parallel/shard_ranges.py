"""Pure index arithmetic of tensor shards: which slices of the whole tensor a tensor rank holds.

Used where no process group exists (a checkpoint read offline, a load onto another tensor
size) and where the whole tensor is at hand and one rank's shard is wanted (writing a whole
value back into a shard). The layout is :class:`partita.tensor_parallel.layers.TensorShard`'s:
``dim`` is split into ``chunks`` equal blocks (3 for a fused q/k/v), each block into ``size``
equal pieces, and rank ``r`` holds piece ``r`` of every block, concatenated in block order.
"""

from __future__ import annotations

import torch

__all__ = ["dim_ranges", "local_shape", "local_slice"]


def dim_ranges(length: int, *, size: int, rank: int, chunks: int = 1) -> list[tuple[int, int]]:
    """Ranges ``[start, stop)`` along the split dimension (of ``length`` elements) that tensor
    rank ``rank`` of ``size`` holds, in the order its local tensor stores them."""
    if size < 1 or not 0 <= rank < size or chunks < 1:
        raise ValueError(f"tensor shard rank {rank} of size {size} with {chunks} chunks is not a valid shard")
    if length % (chunks * size):
        raise ValueError(f"a dimension of {length} does not split into {chunks} chunks x {size} tensor ranks")
    chunk = length // chunks
    piece = chunk // size
    return [(c * chunk + rank * piece, c * chunk + (rank + 1) * piece) for c in range(chunks)]


def local_shape(full_shape: tuple[int, ...] | list[int], *, dim: int, size: int) -> tuple[int, ...]:
    """The shape of one tensor rank's shard of a tensor of ``full_shape`` split along ``dim``."""
    shape = list(full_shape)
    shape[dim] //= size
    return tuple(shape)


def local_slice(full: torch.Tensor, *, dim: int, size: int, rank: int, chunks: int = 1) -> torch.Tensor:
    """Tensor rank ``rank``'s shard of the whole tensor ``full`` (a new tensor when ``chunks`` > 1
    or the pieces are not contiguous; otherwise a view)."""
    pieces = [full.narrow(dim, a, b - a) for a, b in dim_ranges(full.shape[dim], size=size, rank=rank, chunks=chunks)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
