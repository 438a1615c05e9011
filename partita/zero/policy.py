"""ZeRO stages as a policy: what is sharded across data-parallel ranks.

One engine serves every stage; the stage only decides these switches.

| stage | optimizer states + fp32 master | gradients | reduced in                     |
|-------|--------------------------------|-----------|--------------------------------|
| 0     | replicated                     | replicated| last micro-batch (all_reduce)  |
| 1     | sharded                        | replicated| last micro-batch (reduce_scatter) |
| 2     | sharded                        | sharded   | every micro-batch (reduce_scatter) |
| 3     | sharded                        | sharded   | every micro-batch; parameters sharded too, gathered per unit |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ZeroPolicy:
    """Switches derived from ``zero_optimization.stage``.

    Attributes:
        stage: the ZeRO stage.
        shard_optimizer: fp32 master weights and optimizer states are split across ranks.
        shard_gradients: gradients are reduce-scattered during every backward and the
            full-size gradient is freed at once, instead of accumulating whole in
            ``param.grad`` until the last micro-batch.
        shard_parameters: each rank keeps only its shard of every parameter; full
            parameters exist only while their unit runs (see param_gatherer.py).
    """

    stage: int
    shard_optimizer: bool
    shard_gradients: bool
    shard_parameters: bool = False

    @classmethod
    def for_stage(cls, stage: int) -> ZeroPolicy:
        if stage == 0:
            return cls(stage=0, shard_optimizer=False, shard_gradients=False)
        if stage == 1:
            return cls(stage=1, shard_optimizer=True, shard_gradients=False)
        if stage == 2:
            return cls(stage=2, shard_optimizer=True, shard_gradients=True)
        if stage == 3:
            return cls(stage=3, shard_optimizer=True, shard_gradients=True, shard_parameters=True)
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")

    def num_shards(self, data_parallel_size: int) -> int:
        """How many pieces the optimizer state is cut into."""
        return data_parallel_size if self.shard_optimizer else 1
