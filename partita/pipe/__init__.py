"""Pipeline parallelism with DeepSpeed's API (``deepspeed.pipe``): ``PipelineModule``, ``LayerSpec``,
``TiedLayerSpec``, and the engine ``partita.initialize`` returns for them (``train_batch``).

    from partita.pipe import PipelineModule, LayerSpec
    model = PipelineModule(layers=[LayerSpec(Block, d) for _ in range(8)], num_stages=2, loss_fn=loss)
    engine, *_ = partita.initialize(model=model, config=cfg)
    loss = engine.train_batch(data_iter)
"""

from __future__ import annotations

from typing import Any

from partita.pipe.failure import StageFailure
from partita.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from partita.pipe.partition import partition_balanced, partition_uniform

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "PipelineEngine", "PipelineError", "StageFailure",
           "partition_balanced", "partition_uniform"]


def __getattr__(name: str) -> Any:
    # The engine imports partita.engine (and through it the monitors); only initialize() needs it.
    if name in ("PipelineEngine", "PipelineError"):
        from partita.pipe import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'partita.pipe' has no attribute {name!r}")
