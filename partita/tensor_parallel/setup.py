"""From the ``tensor_parallel`` config section to a split model: what ``initialize`` calls."""

from __future__ import annotations

import logging
import re

import torch
import torch.distributed as dist
from torch import nn

from partita.distributed.topology import Topology
from partita.tensor_parallel.apply import Style, TensorParallelPlan, apply_tensor_parallel
from partita.tensor_parallel.config import TensorParallelConfig
from partita.tensor_parallel.autotp import fix_attention_widths, log_replicated_linears
from partita.tensor_parallel.plans import fork_attention_rng, plan_for

logger = logging.getLogger("partita")

__all__ = ["apply_config"]


def apply_config(
    model: nn.Module, config: TensorParallelConfig, topology: Topology, param_groups: list[dict]
) -> list[dict]:
    """Split ``model`` across the tensor axis as the config says; returns ``param_groups`` with the
    split parameters replaced by their shards (unchanged when the tensor size is 1)."""
    if topology.tensor_size == 1:
        if config.sequence_parallel:
            logger.warning("tensor_parallel.sequence_parallel has no effect with tensor size 1 (as in Megatron)")
        return param_groups
    from partita.zero.init_context import init_shard_of

    if any(init_shard_of(p) is not None for p in model.parameters()):
        raise NotImplementedError(
            "tensor parallelism on a model built under partita.zero.Init is not supported yet: build the model "
            "normally (tensor parallelism splits it before ZeRO shards it)"
        )
    plan = _plan(model, config)
    result = apply_tensor_parallel(model, group=topology.tensor_group, plan=plan, sequence_parallel=config.sequence_parallel)
    fork_attention_rng(model, topology.tensor_rank)
    fix_attention_widths(model, topology.tensor_size)
    log_replicated_linears(model, {n for n, style in result.styles.items() if style in ("column", "row")})
    _check_same_batch_once(model, topology)
    split = sorted({style for style in result.styles.values() if style != "replicate"})
    logger.info("tensor parallel: %s; %d modules split (%s)", topology.describe(), len(result.styles), ", ".join(split))
    return result.remap(param_groups)


def _plan(model: nn.Module, config: TensorParallelConfig) -> TensorParallelPlan:
    from partita.pipe.module import PipelineModule

    # A pipeline stage holds some layers only: a rule may match nothing here (another stage's
    # layers), and a stage without splittable layers keeps them replicated.
    staged = isinstance(model, PipelineModule)
    custom = {}
    names = [name for name, _ in model.named_modules() if name]
    for spec in config.partition_config.layer_specs:
        for pattern in spec.patterns:
            regex = re.compile(pattern)
            hits = [n for n in names if regex.search(n) and _is_matmul(model.get_submodule(n))]
            if not hits and not staged:
                raise ValueError(
                    f"tensor_parallel.partition_config.layer_specs pattern {pattern!r} matches no nn.Linear of "
                    f"{type(model).__name__}; module names look like {names[:6]}…"
                )
            for name in hits:
                custom.setdefault(name, Style("column" if spec.partition_type == "column" else "row"))
    builtin = plan_for(model, sequence_parallel=config.sequence_parallel) if config.partition_config.use_default_specs else None
    if builtin is None and not custom and staged and config.partition_config.layer_specs:
        return TensorParallelPlan({})
    if builtin is None and not custom:
        raise ValueError(
            f"tensor parallelism: partita has no built-in plan for {type(model).__name__}; give "
            "tensor_parallel.partition_config.layer_specs (e.g. [{\"patterns\": [\"attn\\\\.q\"], \"partition_type\": "
            "\"column\"}, ...]) or call partita.tensor_parallel.apply_tensor_parallel(model, plan=...) yourself"
        )
    if builtin is None:
        return TensorParallelPlan(custom)
    # Custom rules first: exact names win over the built-in patterns for the same modules.
    return TensorParallelPlan({**custom, **builtin.styles}, head_counts=builtin.head_counts, vocab_size=builtin.vocab_size)


def _check_same_batch_once(model: nn.Module, topology: Topology) -> None:
    """Every tensor rank must compute on the same batch (they hold parts of one model). Check the
    first forward's integer/float inputs once, like DeepSpeed's AutoTP, and name the fix."""
    group = topology.tensor_group

    def check(module, args, kwargs):
        handle.remove()
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if not tensors:
            return
        digest = torch.stack([t.detach().double().sum().cpu() for t in tensors] + [torch.tensor(float(sum(t.numel() for t in tensors)), dtype=torch.float64)])
        gathered = [torch.empty_like(digest) for _ in range(topology.tensor_size)]
        dist.all_gather(gathered, digest, group=group)
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            raise ValueError(
                f"tensor parallelism: the tensor ranks of one group got different batches at the first forward "
                f"(rank {topology.rank}, tensor group of {topology.tensor_size}); every tensor rank must see the same "
                "samples — use the loader initialize(training_data=...) returns, or shard your data by "
                "engine.topology.data_rank / data_size rather than by the global rank"
            )

    handle = model.register_forward_pre_hook(check, with_kwargs=True)


def _is_matmul(module: nn.Module) -> bool:
    from partita.tensor_parallel.autotp import is_hf_conv1d

    return isinstance(module, nn.Linear) or is_hf_conv1d(module)
