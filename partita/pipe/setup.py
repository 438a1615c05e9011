"""What ``partita.initialize`` does for a PipelineModule, kept out of bootstrap.py: the pipe size
of the mesh, the checks of the config against the already-built module, the tied-weight broadcast."""

from __future__ import annotations

from typing import Any

import torch

from partita.config.base import ConfigError
from partita.distributed import collectives
from partita.distributed.topology import Topology
from partita.pipe.module import PipelineModule

__all__ = ["pipe_size_for", "prepare_pipeline"]


def pipe_size_for(cfg: Any, model: Any) -> int:
    """The topology's pipe size: ``pipeline.stages``, else the module's ``num_stages``, else 1."""
    stages = cfg.pipeline.stages
    if not isinstance(model, PipelineModule):
        if stages != "auto" and stages > 1:
            raise ConfigError(
                f"pipeline.stages={stages} needs a partita.pipe.PipelineModule model (got {type(model).__name__}): "
                "build the model as PipelineModule(layers=[...], num_stages=...), or remove pipeline.stages"
            )
        return 1
    if stages != "auto" and stages != model.num_stages:
        raise ConfigError(
            f"pipeline.stages={stages} disagrees with the PipelineModule's num_stages={model.num_stages}: "
            "set them equal (or pipeline.stages to \"auto\")"
        )
    return model.num_stages


def prepare_pipeline(model: Any, cfg: Any, topology: Topology) -> None:
    """Refuse what the pipeline engine does not combine with yet, check the config against the
    module, and give every owner of a tied layer the first owner's weights. Called once the model
    is on its device, before ZeRO copies the weights into its fp32 masters. No-op for other models."""
    if not isinstance(model, PipelineModule):
        return
    pipeline = cfg.pipeline
    stage = cfg.zero_optimization.stage
    if stage >= 3:
        # ZeRO-3 would gather every layer's parameters per micro-batch forward and backward (or hold
        # them whole for the batch, which is ZeRO-2's memory): not built for pipelines.
        raise ConfigError(
            f"zero_optimization.stage={stage} with pipeline parallelism is not supported: use zero_optimization.stage "
            "2 (optimizer states, fp32 masters and gradient partitions sharded inside each stage's data-parallel "
            "group) or 1; the pipeline already splits the parameters across stages"
        )
    if topology.tensor_size > 1 or topology.sequence_size > 1:
        raise NotImplementedError(
            f"pipeline parallelism with tensor ({topology.tensor_size}) or sequence ({topology.sequence_size}) "
            "parallelism is not implemented yet: use pipe x data only (tensor_parallel.autotp_size and "
            "sequence_parallel_size 1)"
        )
    if cfg.zero_optimization.offload_optimizer.enabled:
        raise NotImplementedError("offload_optimizer with pipeline parallelism is not implemented yet; remove it")
    if cfg.precision != "fp32" and cfg.data_types.grad_accum_dtype == "fp32":
        raise NotImplementedError(
            "data_types.grad_accum_dtype=\"fp32\" with bf16/fp16 pipelines is not implemented yet: gradients accumulate "
            "in the model's dtype; remove the key"
        )
    if pipeline.partition != "best" and pipeline.partition.lower() != model.partition_method.lower():
        raise ConfigError(
            f"pipeline.partition={pipeline.partition!r} disagrees with the PipelineModule's partition_method="
            f"{model.partition_method!r} (the module is partitioned when built): set them equal or use \"best\""
        )
    if pipeline.seed_layers and not model.seed_layers:
        raise ConfigError("pipeline.seed_layers=true but the PipelineModule was built with seed_layers=False: "
                          "build it with PipelineModule(..., seed_layers=True)")
    if pipeline.virtual_stages is not None and pipeline.virtual_stages != model.virtual_stages:
        raise ConfigError(
            f"pipeline.virtual_stages={pipeline.virtual_stages} disagrees with the PipelineModule's virtual_stages="
            f"{model.virtual_stages}: build it with PipelineModule(..., virtual_stages={pipeline.virtual_stages})"
        )
    with torch.no_grad():
        for tied in model.tied_groups():
            if tied.group is not None:
                for tensor in list(tied.module.parameters()) + list(tied.module.buffers()):
                    collectives.broadcast(tensor.data, src=tied.src_rank, group=tied.group,
                                          purpose=f"tied-layer {tied.key!r} weight broadcast")
