"""The ``sequence_parallel`` config section (partita only): how the sequence axis runs attention.

DeepSpeed's top-level ``sequence_parallel_size`` sets how many ranks split each sequence (the
topology's sequence axis, :mod:`partita.config.root`); this section picks the algorithm:

- ``"ulysses"`` (default, DeepSpeed-Ulysses): all-to-all from sequence shards to head shards,
  full-sequence attention on ``heads / sp`` heads, all-to-all back. Communication per rank does
  not grow with the number of ranks; the head count must divide by ``sequence_parallel_size``.
- ``"ring"`` (ring attention / context parallelism): queries stay, key/value blocks go around the
  ring, overlapped with attention. No head limit (use it when heads < sequence size), and no
  rank ever holds more than two key/value blocks of the sequence, at ``sp - 1`` block transfers
  per layer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from partita.config.base import StrictSection

SequenceParallelMode = Literal["ulysses", "ring"]


class SequenceParallelConfig(StrictSection):
    """How attention runs across the ``sequence_parallel_size`` ranks of one sequence."""

    mode: SequenceParallelMode = Field(
        "ulysses",
        description=(
            "\"ulysses\": all-to-all to head shards (heads must divide by sequence_parallel_size); \"ring\": "
            "key/value blocks passed around the ranks, causal work load-balanced (chunks i and 2n-1-i on "
            "rank i). No effect when sequence_parallel_size is 1. Default \"ulysses\"."
        ),
    )
