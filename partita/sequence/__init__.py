"""Long sequences across ranks: DeepSpeed-Ulysses and ring attention over the sequence axis.

- :class:`partita.sequence.layer.DistributedAttention`: DeepSpeed-Ulysses at DeepSpeed's path;
- :func:`ring_attention` / :class:`RingAttention`: ring attention (context parallelism);
- :func:`shard_sequence`, :func:`local_positions`: which tokens a sequence rank holds;
- :func:`token_weighted_cross_entropy`, :func:`sequence_token_mean`: the loss averaged exactly over
  all tokens of the sequence group;
- :func:`apply_sequence_parallel`: what ``initialize`` does with ``sequence_parallel_size > 1``;
- :func:`tiled_cross_entropy`, :func:`tiled_mlp`, :class:`TiledMLP`, :func:`apply_tiled_mlp`
  (:mod:`partita.sequence.tiling`): the loss and the MLP over token tiles, for long context on
  one device (the ``sequence_tiling`` section).

The config: top-level ``sequence_parallel_size`` (DeepSpeed's), the ``sequence_parallel`` and
``sequence_tiling`` sections (:mod:`partita.sequence.config`).
"""

from __future__ import annotations

from partita.sequence.comm import all_reduce_sum, all_to_all, sequence_token_mean, token_weighted_cross_entropy
from partita.sequence.layer import DistributedAttention
from partita.sequence.ring import RingAttention, ring_attention
from partita.sequence.sharding import local_positions, shard_sequence, unshard_sequence

__all__ = [
    "DistributedAttention",
    "RingAttention",
    "TiledMLP",
    "all_reduce_sum",
    "all_to_all",
    "apply_tiled_mlp",
    "apply_sequence_parallel",
    "local_positions",
    "ring_attention",
    "sequence_token_mean",
    "shard_sequence",
    "tiled_cross_entropy",
    "tiled_mlp",
    "token_weighted_cross_entropy",
    "unshard_sequence",
]


_TILING = ("TiledMLP", "apply_tiled_mlp", "tiled_cross_entropy", "tiled_mlp")


def __getattr__(name: str):
    # apply_sequence_parallel imports the topology and the reference model; the config loader
    # imports partita.sequence.config early, so this package must not import them eagerly.
    if name == "apply_sequence_parallel":
        from partita.sequence.apply import apply_sequence_parallel

        return apply_sequence_parallel
    # The tiling module's torch.compiler.disable decorators import torch._dynamo (~2 s of CPU
    # per process), which every launch paid through the config loader before it was lazy.
    if name in _TILING:
        from partita.sequence import tiling

        return getattr(tiling, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
