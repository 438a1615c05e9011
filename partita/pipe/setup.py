"""What ``partita.initialize`` does for a PipelineModule, kept out of bootstrap.py: the pipe size
of the mesh, the checks of the config against the already-built module, the tied-weight broadcast."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from partita.config.base import ConfigError
from partita.distributed import collectives
from partita.distributed.topology import Topology
from partita.pipe.module import PipelineModule
from partita.sequence.apply import has_sequence_attention
from partita.sequence.layer import DistributedAttention
from partita.sequence.ring import RingAttention

__all__ = ["norm_group", "pipe_size_for", "prepare_pipeline"]


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
    model.check_topology(topology)  # a DeepSpeed topology given to the module must match the config's mesh
    pipeline = cfg.pipeline
    stage = cfg.zero_optimization.stage
    if stage >= 3 and pipeline.schedule == "zero_bubble":
        # The zero-bubble schedule computes weight gradients apart from autograd's backward order
        # (pt#144530), after the hooks that gather and free a ZeRO-3 unit have run.
        raise ConfigError(
            f"zero_optimization.stage={stage} with pipeline.schedule=\"zero_bubble\" is not supported: use "
            "pipeline.schedule \"interleaved_1f1b\" (or \"1f1b\", \"gpipe\") with ZeRO-3, or zero_optimization.stage 2"
        )
    if topology.sequence_size > 1:
        _check_sequence_attention(model, cfg, topology)
    if cfg.tensor_parallel.sequence_parallel and topology.tensor_size > 1:
        raise NotImplementedError(
            "tensor_parallel.sequence_parallel with pipeline parallelism is not implemented yet (stages would pass "
            "sequence shards): set it to false"
        )
    if cfg.flops_profiler.enabled:
        raise NotImplementedError("flops_profiler with pipeline parallelism is not implemented yet (it profiles "
                                  "one forward and backward, a pipeline runs many per batch): disable it")
    if cfg.zero_optimization.offload_optimizer.enabled:
        raise NotImplementedError("offload_optimizer with pipeline parallelism is not implemented yet; remove it")
    if cfg.zero_optimization.offload_param.enabled:
        raise NotImplementedError("offload_param with pipeline parallelism is not implemented yet; remove it (ZeRO-3 "
                                  "keeps each stage's parameter shards on its device)")
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
    model.rebind_layers()  # tensor parallelism ran first and may have replaced top-level layers
    with torch.no_grad():
        for tied in model.tied_groups():
            if tied.group is not None:
                for tensor in list(tied.module.parameters()) + list(tied.module.buffers()):
                    collectives.broadcast(tensor.data, src=tied.src_rank, group=tied.group,
                                          purpose=f"tied-layer {tied.key!r} weight broadcast")


def _check_sequence_attention(model: PipelineModule, cfg: Any, topology: Topology) -> None:
    """Sequence parallelism needs attention that sees whole sequences, in the layout the engine cuts
    the inputs in (partita/pipe/sequence.py: contiguous slices for ``sequence_parallel.mode``
    "ulysses", the two-chunk balanced layout for "ring"). Some stage must hold a DistributedAttention
    or RingAttention layer (a stage holding only an embedding or a head is fine), and every such
    layer must expect that layout. Each stage checks its own layers; the verdicts are summed over the
    pipe group, so every stage raises together instead of one stage leaving the others waiting."""
    mode = cfg.sequence_parallel.mode
    layout = "balanced" if mode == "ring" else "contiguous"
    problems = []
    for name, module in model.named_modules():
        if isinstance(module, RingAttention) and module.layout != layout:
            problems.append(f"{name} is RingAttention(layout={module.layout!r})")
        if isinstance(module, DistributedAttention) and layout != "contiguous":
            problems.append(f"{name} is DistributedAttention (Ulysses needs contiguous slices)")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(topology.pipe_group) == "nccl" else "cpu"
    verdict = torch.tensor([1.0 if has_sequence_attention(model) else 0.0, float(len(problems))], device=device)
    collectives.all_reduce(verdict, group=topology.pipe_group, purpose="pipeline: the stages' sequence-parallel attention")
    if verdict[1].item() > 0:
        mine = "; ".join(problems) if problems else "another stage's layers do"
        raise ValueError(
            f"sequence_parallel.mode={mode!r} makes the pipeline cut every sequence into {layout} slices, but {mine}: "
            "use RingAttention(layout=\"balanced\") with mode \"ring\", or DistributedAttention / "
            "RingAttention(layout=\"contiguous\") with mode \"ulysses\""
        )
    if verdict[0].item() == 0:
        raise NotImplementedError(
            f"sequence_parallel_size={topology.sequence_size} with a PipelineModule that holds no "
            "partita.sequence.layer.DistributedAttention or partita.sequence.RingAttention layer on any stage: its "
            "attention would see only this rank's slice of each sequence. Build the attention with "
            "DistributedAttention(local_attention, sequence_process_group=None) or RingAttention(None) (bound at "
            "initialize), or set sequence_parallel_size to 1"
        )


def norm_group(topology: Topology) -> Any:
    """The group the global gradient norm is summed over beyond ZeRO's: the pipe axis, or with
    tensor parallelism the ranks of one (data, sequence) position across pipe x tensor, so every
    stage's and every tensor shard's gradients enter clipping and the fp16 overflow check.
    Collective over the world when it creates a group (every rank calls it, in the same order).
    None when the model is not split (pipe 1)."""
    if topology.pipe_size == 1:
        return None
    if topology.tensor_size == 1:
        return topology.pipe_group
    # The mesh's rank grid, (pipe, data, sequence, tensor): one list per (data, sequence) position.
    grid = topology.mesh.mesh.permute(1, 2, 0, 3)
    lists = [[int(r) for r in row] for row in grid.reshape(-1, topology.pipe_size * topology.tensor_size).tolist()]
    group, _ = dist.new_subgroups_by_enumeration(lists)
    return group
