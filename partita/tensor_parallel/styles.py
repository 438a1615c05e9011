"""What a tensor-parallel plan is: :class:`Style` (how one module is split) and
:class:`TensorParallelPlan` (module-name pattern -> style).

The plans' authors (:mod:`partita.tensor_parallel.plans`, :mod:`partita.tensor_parallel.autotp`,
the config's ``layer_specs``) and their applier (:mod:`partita.tensor_parallel.apply`) all build
on these, so they sit below all of them and import nothing of partita.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["STYLES", "Style", "TensorParallelPlan"]

STYLES = ("column", "row", "embedding", "replicate", "sequence_norm", "sequence_scatter", "sharded_dropout", "vocab_loss")


@dataclass(frozen=True)
class Style:
    """How one module is split. ``kind`` is one of :data:`STYLES`:

    - ``column`` / ``row``: an ``nn.Linear`` split by output / input features (``chunks``: fused
      projections split chunk by chunk, 3 for q/k/v in one matrix);
    - ``embedding``: an ``nn.Embedding`` split by vocabulary;
    - ``replicate``: left whole (listed to silence the "not sharded" log);
    - ``sequence_norm``: an ``nn.LayerNorm`` run on sequence shards (sequence parallelism);
    - ``sequence_scatter``: a module after which activations become sequence shards (sequence
      parallelism's entry, e.g. the embedding dropout);
    - ``sharded_dropout``: a dropout inside a sharded region: its own random stream per tensor rank;
    - ``vocab_loss``: a ``(logits, targets) -> loss`` module replaced by the vocabulary-parallel one.
    """

    kind: str
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.kind not in STYLES:
            raise ValueError(f"unknown tensor-parallel style {self.kind!r}; choose one of {list(STYLES)}")


@dataclass
class TensorParallelPlan:
    """Module-name pattern -> style; ``heads``: (module pattern, attribute or count) checks that
    every attention's head count divides the tensor size before anything is split."""

    styles: dict[str, Style]
    head_counts: dict[str, int] = field(default_factory=dict)
    vocab_size: int | None = None
