"""``apply_tensor_parallel``: split a model's layers across the topology's tensor axis.

A plan maps module names (``fnmatch`` patterns, as torch's ``parallelize_module``) to a
:class:`Style`; each matched module is replaced in its parent by the tensor-parallel layer built
from it (:mod:`partita.tensor_parallel.layers`), so ``state_dict`` keys stay the model's own.
Where the plan comes from, by priority: the plan given here; the config's
``partition_config.layer_specs``; the model's own (the reference GPT, and the architectures in
:mod:`partita.tensor_parallel.autotp`).

Runs first among the strategies (before sequence parallelism, activation checkpointing,
compile and ZeRO), on a model built whole on every rank; every tensor rank starts from tensor
rank 0's weights, so replicated parameters agree and shards are slices of one model.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from partita.distributed import collectives
import partita.tensor_parallel.layers as layers
from partita.tensor_parallel.comm import scatter_sequence
from partita.tensor_parallel.conv1d import Conv1DColumnParallel, Conv1DRowParallel, is_hf_conv1d
from partita.tensor_parallel.loss import VocabParallelCrossEntropy
from partita.tensor_parallel.rng import TensorParallelRNG
# The plan's types live below every plan author; re-exported here, their historical path.
from partita.tensor_parallel.styles import STYLES, Style, TensorParallelPlan

logger = logging.getLogger("partita")

__all__ = ["STYLES", "Style", "TensorParallelPlan", "TensorParallelResult", "apply_tensor_parallel"]


def apply_tensor_parallel(
    model: nn.Module,
    *,
    group: dist.ProcessGroup,
    plan: TensorParallelPlan | dict[str, str | Style],
    sequence_parallel: bool = False,
) -> TensorParallelResult:
    """Split ``model`` in place across ``group`` by ``plan``; returns what was split (module name
    -> style, and the parameters replaced by shards).

    Every rank of ``group`` must call it on the same (whole) model. Raises ValueError for a plan
    entry that matches no module, a module of the wrong type for its style, or a width or head
    count that the tensor size does not divide.
    """
    if not isinstance(plan, TensorParallelPlan):
        plan = TensorParallelPlan({k: v if isinstance(v, Style) else Style(v) for k, v in plan.items()})
    size = dist.get_world_size(group)
    _check_divisible(plan, size)
    _broadcast_from_tensor_rank0(model, group)
    names = [name for name, _ in model.named_modules() if name]
    matched: dict[str, Style] = {}
    for pattern, style in plan.styles.items():
        hits = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise ValueError(
                f"tensor_parallel plan entry {pattern!r} matches no module of {type(model).__name__}; module names "
                f"look like {names[:6]}… — fix the pattern (fnmatch syntax, e.g. 'blocks.*.attn.qkv')"
            )
        for name in hits:
            matched.setdefault(name, style)  # first pattern wins
    shards: dict[int, nn.Parameter] = {}  # id(full weight) -> its shard, so tied weights stay tied
    replaced: dict[int, nn.Parameter] = {}  # id(whole parameter) -> the shard that replaced it
    for name, style in matched.items():
        if style.kind in ("sequence_norm", "sequence_scatter") and not sequence_parallel:
            continue
        parent, attr = _parent_of(model, name)
        old = getattr(parent, attr)
        built = _build(old, style, group, sequence_parallel, name, shards, plan)
        setattr(parent, attr, built)
        for pname in ("weight", "bias"):
            before, after = getattr(old, pname, None), getattr(built, pname, None)
            if isinstance(before, nn.Parameter) and after is not before:
                replaced[id(before)] = after
    layers.mark_replicated(p for p in model.parameters())  # whatever was not split is replicated
    return TensorParallelResult({name: style.kind for name, style in matched.items()}, replaced)


@dataclass
class TensorParallelResult:
    """What :func:`apply_tensor_parallel` did: module name -> style, and id(whole parameter) ->
    the shard Parameter that replaced it (param groups built before the split are remapped with it)."""

    styles: dict[str, str]
    replaced: dict[int, nn.Parameter]

    def remap(self, param_groups: list[dict]) -> list[dict]:
        return [{**g, "params": [self.replaced.get(id(p), p) for p in g["params"]]} for g in param_groups]


def _build(module: nn.Module, style: Style, group, sequence_parallel: bool, name: str, shards: dict, plan) -> nn.Module:
    rank = dist.get_rank(group)
    kind = style.kind
    if kind in ("column", "row") and is_hf_conv1d(module):
        if kind == "column":
            return Conv1DColumnParallel(module, group, chunks=style.chunks, name=name)
        return Conv1DRowParallel(module, group, name=name)
    if kind in ("column", "row"):
        _expect(module, nn.Linear, name, kind)
        full = module.weight
        if kind == "column":
            built = layers.ColumnParallelLinear(module, group, sequence_parallel=sequence_parallel, chunks=style.chunks, name=name)
        else:
            built = layers.RowParallelLinear(module, group, sequence_parallel=sequence_parallel, name=name)
        tied = shards.get(id(full))
        if tied is not None:  # the weight is tied to an already split one (an LM head to its embedding)
            if layers.tensor_shard_of(tied) != layers.tensor_shard_of(built.weight):
                raise ValueError(f"tensor parallelism: {name}.weight is tied to a weight split another way")
            built.weight = tied
        shards[id(full)] = built.weight
        return built
    if kind == "embedding":
        _expect(module, nn.Embedding, name, kind)
        # Output whole (all-reduced) even under sequence parallelism: models add position
        # embeddings of the whole sequence next; the plan's sequence_scatter entry then enters the
        # sequence-sharded region (one all-reduce where Megatron reduce-scatters: 2x the bytes, once
        # per forward, for a model-agnostic plan).
        built = layers.VocabParallelEmbedding(module, group, sequence_parallel=False,
                                              weight=shards.get(id(module.weight)), name=name)
        shards[id(module.weight)] = built.weight
        return built
    if kind == "sequence_norm":
        _expect(module, nn.LayerNorm, name, kind)
        return layers.SequenceParallelLayerNorm(module, group)
    if kind == "sequence_scatter":
        return _ThenScatter(module, group, rank)
    if kind == "sharded_dropout":
        return TensorParallelRNG(module, rank)
    if kind == "vocab_loss":
        if plan.vocab_size is None:
            raise ValueError(f"tensor parallelism: {name} is a vocab_loss but the plan gives no vocab_size")
        return VocabParallelCrossEntropy(group, plan.vocab_size)
    return module  # replicate


class _ThenScatter(nn.Module):
    """Run ``inner`` on this rank's sequence shard: enter the sequence-parallel region."""

    def __init__(self, inner: nn.Module, group, rank: int) -> None:
        super().__init__()
        self.inner = TensorParallelRNG(inner, rank) if isinstance(inner, nn.Dropout) else inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(scatter_sequence(x, self.group))


def _expect(module: nn.Module, cls: type, name: str, kind: str) -> None:
    if not isinstance(module, cls):
        raise ValueError(
            f"tensor parallelism: style {kind!r} needs an {cls.__module__}.{cls.__name__} but {name} is a "
            f"{type(module).__name__}; change the plan entry for {name}"
        )


def _check_divisible(plan: TensorParallelPlan, size: int) -> None:
    for what, count in plan.head_counts.items():
        if count % size != 0:
            raise ValueError(
                f"tensor parallelism: {what} = {count} does not divide by the tensor size {size} (each rank holds whole "
                f"heads); set tensor_parallel.autotp_size to a divisor of {count}"
            )
    if plan.vocab_size is not None and plan.vocab_size % size != 0:
        raise ValueError(
            f"tensor parallelism: the vocabulary ({plan.vocab_size}) does not divide by the tensor size {size}; pad "
            f"vocab_size to a multiple of {size} (e.g. {-(-plan.vocab_size // size) * size})"
        )


@torch.no_grad()
def _broadcast_from_tensor_rank0(model: nn.Module, group) -> None:
    """Tensor ranks may have built the model from different seeds: tensor rank 0's weights win."""
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    for tensor in list(model.parameters()) + list(model.buffers()):
        collectives.broadcast(tensor.data, src=src, group=group, purpose="tensor parallel: initial weight broadcast")


def _parent_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr
