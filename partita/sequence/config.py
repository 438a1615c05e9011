"""The ``sequence_parallel`` and ``sequence_tiling`` config sections (partita only).

``sequence_parallel``: how the sequence axis runs attention. ``sequence_tiling``: the long-context
memory levers of :mod:`partita.sequence.tiling` (see :class:`SequenceTilingConfig`).

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

from typing import Annotated, Literal

from pydantic import Field, model_validator

from partita.config.base import JsonInt, StrictSection

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


class SequenceTilingConfig(StrictSection):
    """The ``sequence_tiling`` section (partita only): token-wise work run a tile of tokens at a time.

    Long-context memory levers (:mod:`partita.sequence.tiling`); each saves memory for compute:

    - ``loss_tile_tokens``: the LM head and the cross-entropy over this many tokens at a time, so the
      ``tokens x vocab`` fp32 logits never exist (49 GiB for 256k tokens and a 50304 vocabulary;
      one tile's instead). Costs one more LM-head matmul in backward. The reference GPT's training
      forward then returns logits None.
    - ``mlp_tile_tokens``: each MLP over this many tokens at a time, its ``tokens x 4d``
      intermediate recomputed tile by tile in backward. Costs one more MLP forward per block.
    - ``mlp_module_types``: for models other than the reference GPT, the class names of the
      token-wise modules to tile (the reference GPT's dense MLPs are found without it).
    """

    loss_tile_tokens: Annotated[JsonInt, Field(ge=1)] | None = Field(
        None,
        description=(
            "Tokens per tile of the LM head + cross-entropy (the reference GPT; other models call "
            "partita.sequence.tiling.tiled_cross_entropy). Default null (all tokens at once)."
        ),
    )
    mlp_tile_tokens: Annotated[JsonInt, Field(ge=1)] | None = Field(
        None,
        description="Tokens per tile of every (dense) MLP, recomputed per tile in backward. Default null (all at once).",
    )
    mlp_module_types: list[str] | None = Field(
        None,
        description=(
            "Class names of the token-wise modules mlp_tile_tokens tiles, for models other than the reference "
            "GPT. Default null (the reference GPT's dense MLPs)."
        ),
    )

    @model_validator(mode="after")
    def _types_need_a_tile(self) -> SequenceTilingConfig:
        if self.mlp_module_types is not None and self.mlp_tile_tokens is None:
            raise ValueError("mlp_module_types only applies with mlp_tile_tokens; set mlp_tile_tokens or remove mlp_module_types")
        if self.mlp_module_types is not None and not self.mlp_module_types:
            raise ValueError("mlp_module_types is an empty list; give class names such as [\"LlamaMLP\"] or null")
        return self
