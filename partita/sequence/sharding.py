"""Which tokens of a sequence each sequence rank holds, and their global positions.

Two layouts:

- ``"contiguous"`` (Ulysses, and ring attention without a causal mask): rank r holds tokens
  ``r*T/n .. (r+1)*T/n - 1``.
- ``"balanced"`` (ring attention with a causal mask): the sequence is cut into ``2n`` chunks and
  rank r holds chunks ``r`` and ``2n-1-r``, concatenated. Under a causal mask a token attends to
  the tokens before it, so with contiguous shards the last rank would do ``2n-1`` times the first
  rank's work; pairing an early chunk with a late one gives every rank the same work (Striped /
  zig-zag ring attention; torch's context parallel calls it head-tail load balancing).

Positions matter for models with position embeddings: a rank's tokens are not at positions
``0 .. T/n - 1``, and a learned or rotary embedding must see their global positions.
"""

from __future__ import annotations

from typing import Literal

import torch

Layout = Literal["contiguous", "balanced"]
LAYOUTS: tuple[str, ...] = ("contiguous", "balanced")

__all__ = ["LAYOUTS", "Layout", "check_sequence_length", "local_positions", "shard_sequence", "unshard_sequence"]


def check_sequence_length(seq_len: int, size: int, layout: Layout) -> None:
    """Raise ValueError (values and fix) unless ``seq_len`` splits evenly in ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; choose one of {list(LAYOUTS)}")
    parts = size if layout == "contiguous" else 2 * size
    if seq_len % parts != 0:
        why = (
            f"each of the {size} sequence ranks holds {seq_len}/{size} tokens"
            if layout == "contiguous"
            else f"causal ring attention cuts it into 2 x {size} = {parts} load-balanced chunks"
        )
        fix = parts * max(1, -(-seq_len // parts))
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {parts} ({why}); pad or cut sequences to a multiple "
            f"of {parts} (e.g. {fix}), or change sequence_parallel_size"
        )


def local_positions(seq_len: int, *, rank: int, size: int, layout: Layout, device=None) -> torch.Tensor:
    """Global positions (int64, in the order the rank holds them) of ``rank``'s tokens."""
    check_sequence_length(seq_len, size, layout)
    if layout == "contiguous":
        local = seq_len // size
        return torch.arange(rank * local, (rank + 1) * local, device=device)
    chunk = seq_len // (2 * size)
    late = 2 * size - 1 - rank
    return torch.cat(
        [
            torch.arange(rank * chunk, (rank + 1) * chunk, device=device),
            torch.arange(late * chunk, (late + 1) * chunk, device=device),
        ]
    )


def shard_sequence(x: torch.Tensor, *, dim: int, rank: int, size: int, layout: Layout) -> torch.Tensor:
    """``rank``'s tokens of ``x`` along ``dim`` (a view for ``"contiguous"``, a copy otherwise)."""
    seq_len = x.size(dim)
    check_sequence_length(seq_len, size, layout)
    if layout == "contiguous":
        local = seq_len // size
        return x.narrow(dim, rank * local, local)
    chunk = seq_len // (2 * size)
    late = 2 * size - 1 - rank
    return torch.cat([x.narrow(dim, rank * chunk, chunk), x.narrow(dim, late * chunk, chunk)], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], *, dim: int, layout: Layout) -> torch.Tensor:
    """The whole sequence from every rank's shard (rank order): the inverse of :func:`shard_sequence`."""
    size = len(shards)
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; choose one of {list(LAYOUTS)}")
    early = [s.chunk(2, dim=dim)[0] for s in shards]
    late = [s.chunk(2, dim=dim)[1] for s in shards]
    return torch.cat(early + late[::-1], dim=dim)
