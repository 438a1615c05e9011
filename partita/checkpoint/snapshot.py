"""What one rank writes for a checkpoint: a snapshot of the engine's state as file plans.

The snapshot is taken on the training thread at a step boundary. For a synchronous save it
only *references* the live tensors (they are written before training continues); for an
asynchronous save every tensor is copied to CPU memory first, so training can go on while a
thread writes the copy (one copy of this rank's share: the bound on extra memory).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import partita.checkpoint.format as fmt
from partita.checkpoint.frozen import frozen_entries, frozen_meta
from partita.checkpoint.jsoncodec import encode
# Names and rank files live a layer below, where frozen.py reads them too; re-exported here,
# where load.py and partita/pipe/checkpoint.py have always imported them from.
from partita.checkpoint.locations import (checkpoint_state_dict, param_names, piece_files, shard_file_of,
                                          tensor_rank_files)
from partita.checkpoint.rng import capture_rng, rng_metadata
from partita.checkpoint.safetensors_io import TensorEntry
from partita.checkpoint.state_layout import StateLayout, block_range, classify_state, element_stop
from partita.checkpoint.tensor_layout import tensor_param_record
from partita.data.sampler import ResumableDistributedSampler
from partita.moe.registry import (checkpoint_name, expert_names_elsewhere, expert_parallel_keys, expert_shard_of,
                                  global_expert_names)
from partita.tensor_parallel.layers import tensor_shard_of
from partita.zero.partition import ShardSpec

if TYPE_CHECKING:
    from partita.engine import Engine

logger = logging.getLogger("partita")

# Optimizer options that describe the machine/implementation rather than the math; a load
# keeps the current run's values for them (a checkpoint from a GPU run loads on a CPU).
IMPLEMENTATION_OPTIONS = frozenset({"foreach", "fused", "capturable", "differentiable"})
LOCAL_MASTER = "__master__"  # local_state_key name of a whole master partition


@dataclass
class FilePlan:
    """One safetensors file to write."""

    name: str
    entries: list[TensorEntry]
    metadata: dict[str, str] | None = None


@dataclass
class Snapshot:
    """Everything this rank writes: safetensors files and, on rank 0, meta.json."""

    files: list[FilePlan] = field(default_factory=list)
    meta: dict[str, Any] | None = None


def sharded_param_keys(engine: Engine) -> set[str]:
    """state_dict keys of parameters that exist only as shards right now (ZeRO-3, non-persistent).

    Their full tensors have no storage between forward passes; the fp32 master shards are
    their checkpointed form.
    """
    gatherer = getattr(engine.zero, "gatherer", None)
    if gatherer is None:
        return set()
    return {checkpoint_name(name, p) for name, p in engine.module.named_parameters(remove_duplicate=False)
            if gatherer.is_sharded_param(p)}


def dedupe_state_dict(
    module: torch.nn.Module, state: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split a state_dict into tensors stored once and ``{alias: stored name}`` for the rest.

    Tied parameters appear under several keys; safetensors stores each tensor's bytes once
    and refuses aliases, and writing them twice would double the file. Parameters and
    buffers are matched by object (their storage may be freed under ZeRO-3); other entries
    by storage, offset, shape and strides.
    """
    owners: dict[str, int] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owners[checkpoint_name(name, param)] = id(param)
    for name, buffer in module.named_buffers(remove_duplicate=False):
        if buffer is not None:
            owners[name] = id(buffer)
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state.items():
        if name in owners:
            identity: tuple = ("object", owners[name])
        elif tensor.numel() > 0:
            identity = ("storage", tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                        tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        else:
            identity = ("empty", name)
        if identity in seen:
            aliases[name] = seen[identity]
            continue
        seen[identity] = name
        stored[name] = tensor
    return stored, aliases


def _own(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    tensor = tensor.detach()
    if not copy:
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    out.copy_(tensor)
    return out


def split_of(param: torch.Tensor):
    """How ``param`` is split across ranks that hold different parts of it: its tensor-parallel
    shard, or, for an expert-parallel MoE parameter, its dim-0 split by global expert index
    (partita/moe/registry.py). None when every rank of its ZeRO group holds it whole."""
    tensor, expert = tensor_shard_of(param), expert_shard_of(param)
    if tensor is not None and expert is not None:
        raise NotImplementedError("checkpoints of MoE experts that are also tensor-parallel shards are not implemented yet")
    return tensor if tensor is not None else expert


def tensor_sharded_keys(module: torch.nn.Module) -> set[str]:
    """Checkpoint keys of tensor-parallel shards, row-sharded embeddings and expert-parallel MoE
    experts: checkpointed as fp32 master pieces (with their whole shape,
    :mod:`partita.checkpoint.tensor_layout`), not in the model file. Experts: this rank's only."""
    experts = expert_parallel_keys(module)
    return {checkpoint_name(name, p) for name, p in module.named_parameters(remove_duplicate=False)
            if split_of(p) is not None or name in experts}


def writes_shards(engine: Engine, group=None) -> bool:
    """Whether this rank writes a ZeRO group's shards (default: the first group): all ranks when
    sharded, else the first rank of the group's comm (the ZeRO group, or an expert-data group)."""
    group = engine.optimizer.groups[0] if group is None else group
    rank = engine.topology.zero_rank if group.comm is None else group.comm.rank
    return group.layout.num_shards > 1 or rank == 0


def _span(spec: ShardSpec, start: int, stop: int) -> slice:
    """Partition slice of parameter elements ``[start, stop)`` (``start`` owned by this rank)."""
    return slice(spec.partition_offset, spec.partition_offset + (stop - start))


def _shard_state_entries(kinds: StateLayout, state: dict[str, Any], master: torch.Tensor, spec: ShardSpec, start: int,
                         end: int, name: str, copy: bool) -> list[TensorEntry]:
    """This rank's per-parameter optimizer state of parameter elements ``[start, end)``."""
    stop = element_stop(end, kinds.block_size)  # block-wise: up to the end of the last block
    entries = [TensorEntry.of(fmt.state_key(key, name), _own(state[key][_span(spec, start, stop)], copy)) for key in kinds.element]
    if kinds.block_size is not None:
        first, last = block_range(spec.partition_offset, spec.partition_offset + (stop - start), kinds.block_size)
        entries += [TensorEntry.of(fmt.state_key(key, name), _own(state[key][first:last], copy)) for key in kinds.block]
        if end == spec.numel and stop > end:
            # The padding in the parameter's last block (see partita.checkpoint.state_layout).
            padding = master[_span(spec, start, stop)][end - start :]
            entries.append(TensorEntry.of(fmt.master_padding_key(name), _own(padding, copy)))
    return entries


def capture(engine: Engine, *, tag: str, client_state: dict[str, Any], copy: bool) -> Snapshot:
    """Snapshot this rank's part of the checkpoint (and, on rank 0, the shared part)."""
    # NVMe optimizer offload: the states are read from the swap files into inner.state for the
    # capture; the snapshot keeps references (or copies) after they are dropped from there again.
    engine.optimizer.materialize_states()
    try:
        return _capture(engine, tag=tag, client_state=client_state, copy=copy)
    finally:
        engine.optimizer.release_states()


def _capture(engine: Engine, *, tag: str, client_state: dict[str, Any], copy: bool) -> Snapshot:
    names = param_names(engine.module)
    tensor_sharded = _trainable_tensor_shards(engine, names)  # every rank: a refusal must not be rank 0's alone
    snapshot = Snapshot(files=[rank_file_plan(engine, names, copy=copy)])
    if dist.get_rank() != 0:
        return snapshot
    model_plan, state_plan, meta = shared_plan(engine, names, tensor_sharded, tag=tag, client_state=client_state, copy=copy)
    snapshot.files += [model_plan, state_plan]
    snapshot.meta = meta
    return snapshot


def rank_file_plan(engine: Engine, names: dict[torch.nn.Parameter, str], *, copy: bool) -> FilePlan:
    """This rank's file: its generator states and its shards of the fp32 masters and optimizer state."""
    rank = dist.get_rank()
    optimizer = engine.optimizer
    inner = optimizer.inner
    rng_json, rng_tensors = capture_rng()
    entries = [TensorEntry.of(k, _own(v, copy)) for k, v in rng_tensors.items()]
    # Tensor parallelism: parameters the tensor ranks replicate are written once, by tensor rank 0.
    replicas_only = engine.topology.tensor_size > 1 and engine.topology.tensor_rank > 0
    for g, group in enumerate(optimizer.groups):
        if writes_shards(engine, group):
            state = inner.state.get(group.master, {})
            kinds = classify_state(state, group.master)
            for param, spec, (start, end) in group.owned_slices():
                if end <= start or (replicas_only and tensor_shard_of(param) is None):
                    continue
                name = names[param]
                entries.append(TensorEntry.of(fmt.master_key(name), _own(group.master[_span(spec, start, end)], copy)))
                entries += _shard_state_entries(kinds, state, group.master, spec, start, end, name, copy)
            for key in kinds.local:
                entries.append(TensorEntry.of(fmt.local_state_key(g, key), _own(state[key], copy)))
            if kinds.local:
                # Unknown state may involve the padding elements; keep the whole partition.
                entries.append(TensorEntry.of(fmt.local_state_key(g, LOCAL_MASTER), _own(group.master, copy)))
    # Per-rank state an optimizer saves itself: the 1-bit optimizers' worker errors (partita/optim/onebit_checkpoint.py).
    own_entries = getattr(inner, "checkpoint_entries", None)
    if own_entries is not None:
        entries += [TensorEntry.of(key, _own(value, copy)) for key, value in own_entries(names)]
    entries += frozen_entries(engine, names, copy=copy)  # ZeRO-3's sharded frozen parameters
    return FilePlan(fmt.rank_file(rank), entries, {fmt.RNG_METADATA_KEY: rng_metadata(rng_json)})


def shared_plan(engine: Engine, names: dict[torch.nn.Parameter, str], tensor_sharded: set[str], *, tag: str,
                client_state: dict[str, Any], copy: bool,
                model_file: str = fmt.MODEL_FILE) -> tuple[FilePlan, FilePlan, dict[str, Any]]:
    """Rank 0's part (the model file, the state file and meta.json) from this rank's module and
    optimizer. A pipeline save (partita/pipe/checkpoint.py) calls it on every stage's first rank,
    with a model file per stage, and merges the stages' model and optimizer sections."""
    sink: dict[str, torch.Tensor] = {}
    full_state = checkpoint_state_dict(engine.module)
    # Expert-parallel MoE experts held by other expert ranks: recorded (keys, masters) by global index too.
    elsewhere = sorted(expert_names_elsewhere(engine.module))
    # Non-tensor entries come from modules' get_extra_state(); they go to meta.json as JSON.
    extra = {k: v for k, v in full_state.items() if not torch.is_tensor(v)}
    unique, aliases = dedupe_state_dict(engine.module, {k: v for k, v in full_state.items() if torch.is_tensor(v)})
    # ZeRO-3: parameters held as shards are saved only as fp32 master shards (below); so are
    # tensor-parallel shards, whose whole tensors no rank holds.
    sharded = sharded_param_keys(engine) | tensor_sharded
    model_state = {k: v for k, v in unique.items() if k not in sharded}
    model_plan = FilePlan(model_file, [TensorEntry.of(k, _own(v, copy)) for k, v in model_state.items()])
    meta = {
        **fmt.meta_header(tag),
        "world_size": dist.get_world_size(),
        # Ranks that read different samples (the batch arithmetic's), not ZeRO's data x sequence:
        # sequence ranks read the same samples, so resuming an SP run must not see a changed batch.
        "data_parallel_size": engine.topology.data_size,
        "sequence_parallel_size": engine.topology.sequence_size,
        "tensor_parallel_size": engine.topology.tensor_size,
        "zero_stage": engine.zero.policy.stage,
        "precision": str(engine.compute_dtype).replace("torch.", ""),
        "counters": {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
            "micro_steps": engine.micro_steps,
        },
        "config": encode(engine.config.to_dict() if engine.config is not None else {}, path="config", sink=sink),
        "model": {
            "file": model_file,
            "keys": list(full_state.keys()) + elsewhere,
            "aliases": aliases,
            "extra_state": {k: encode(v, path=f"model[{k!r}]", sink=sink) for k, v in extra.items()},
            "sharded_keys": sorted(k for k in unique if k in sharded) + elsewhere,
            "frozen_shards": frozen_meta(engine, names),
            "tensors": {k: {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)} for k, v in model_state.items()},
        },
        "optimizer": _optimizer_meta(engine, names, sink),
        "loss_scaler": None if engine.loss_scaler is None else encode(engine.loss_scaler.state_dict(), path="loss_scaler", sink=sink),
        "lr_scheduler": None
        if engine.lr_scheduler is None
        else encode(engine.lr_scheduler.state_dict(), path="lr_scheduler", sink=sink),
        "sampler": _sampler_state(engine),
        # progressive_layer_drop / legacy curriculum_learning (partita/schedules); DeepSpeed saves neither.
        "forward_schedules": None if getattr(engine, "_forward_schedules", None) is None
        else engine._forward_schedules.state_dict(),
        "client_state": encode(client_state, path="client_state", sink=sink),
        "rank_files": [fmt.rank_file(r) for r in range(dist.get_world_size())],
        "state_file": fmt.STATE_FILE,
    }
    return model_plan, FilePlan(fmt.STATE_FILE, [TensorEntry.of(k, _own(v, True)) for k, v in sink.items()]), meta


def _optimizer_meta(engine: Engine, names: dict[torch.nn.Parameter, str], sink: dict[str, torch.Tensor]) -> dict[str, Any]:
    optimizer = engine.optimizer
    inner = optimizer.inner
    groups, params = [], {}
    local_names = {p: n for n, p in engine.module.named_parameters()}
    for g, group in enumerate(optimizer.groups):
        state = inner.state.get(group.master, {})
        kinds = classify_state(state, group.master)
        hyper = {k: v for k, v in inner.param_groups[g].items() if k != "params"}
        groups.append(
            {
                "params": [n for p in group.params for n in global_expert_names(local_names[p], p)],
                "source": group.source_index,  # the user's param group (ratio < 1 splits one in two)
                "hyperparameters": encode(hyper, path=f"optimizer/group{g}/hyperparameters", sink=sink),
                "partition_state": list(kinds.element),
                "block_state": list(kinds.block),
                "block_size": kinds.block_size,
                "state_dtypes": kinds.dtypes,
                "scalar_state": encode(kinds.replicated, path=f"optimizer/group{g}/state", sink=sink),
                "local_state": list(kinds.local),
                "num_shards": group.layout.num_shards,
            }
        )
        for param, spec in zip(group.params, group.layout.specs):
            experts = global_expert_names(local_names[param], param)
            if len(experts) > 1:
                # An expert-parallel MoE expert: the same local slot on every expert rank is one
                # global expert each, with the same ZeRO layout, in that expert rank's files.
                for expert_rank, name in enumerate(experts):
                    params[name] = {"group": g, "shape": list(spec.shape), "numel": spec.numel,
                                    "dtype": str(param.dtype).replace("torch.", ""),
                                    "shards": _ranges(spec, group.layout.num_shards, piece_files(engine, param, expert_rank))}
                continue
            tensor_shard = split_of(param)
            if tensor_shard is not None:
                params[names[param]] = {
                    "group": g,
                    "dtype": str(param.dtype).replace("torch.", ""),
                    **tensor_param_record(tensor_shard, spec.numel, lambda t: _ranges(spec, group.layout.num_shards,
                                                                                      piece_files(engine, param, t))),
                }
                continue
            shards = []
            for shard_rank in range(group.layout.num_shards):
                start, end = spec.owned_range(shard_rank)
                if end > start:
                    shards.append({"file": shard_file_of(engine, shard_rank), "start": start, "end": end})
            params[names[param]] = {
                "group": g,
                "shape": list(spec.shape),
                "numel": spec.numel,
                "dtype": str(param.dtype).replace("torch.", ""),
                "shards": shards,
            }
    return {
        "class": f"{type(inner).__module__}.{type(inner).__qualname__}",
        "master_dtype": "float32",
        "groups": groups,
        "params": params,
    }


def _ranges(spec: ShardSpec, num_shards: int, files: list[str]) -> list[dict[str, Any]]:
    """The ``{file, start, end}`` ZeRO shards of one local tensor, ZeRO rank ``z`` in ``files[z]``."""
    out = []
    for shard_rank in range(num_shards):
        start, end = spec.owned_range(shard_rank)
        if end > start:
            out.append({"file": files[shard_rank], "start": start, "end": end})
    return out


def _trainable_tensor_shards(engine: Engine, names: dict[torch.nn.Parameter, str]) -> set[str]:
    keys = tensor_sharded_keys(engine.module)
    trained = {names[p] for group in engine.optimizer.groups for p in group.params}
    frozen = sorted(k for k in keys if k not in trained and k in names.values())
    if frozen:
        raise NotImplementedError(
            f"save_checkpoint: the tensor-parallel shards {frozen[:4]} are frozen (requires_grad=False), and partita "
            "checkpoints tensor-parallel weights through the optimizer's fp32 master pieces; make them trainable "
            "(lr 0), or save the whole weights with engine.save_16bit_model"
        )
    return keys


def _sampler_state(engine: Engine) -> dict[str, Any] | None:
    loader = engine.training_dataloader
    sampler = getattr(loader, "sampler", None) if loader is not None else None
    if isinstance(sampler, ResumableDistributedSampler):
        return sampler.state_dict()
    return None


def check_accumulation_boundary(engine: Engine) -> None:
    """Warn when saving mid-window: the gradients accumulated so far are not part of a checkpoint."""
    if engine.micro_steps % engine.gradient_accumulation_steps() != 0 or engine._backward_pending:
        logger.warning(
            "save_checkpoint was called in the middle of a gradient-accumulation window (micro step %d of %d); "
            "the gradients accumulated so far are not saved, so a run resumed from it differs. Save right "
            "after the engine.step() that updates the weights",
            engine.micro_steps % engine.gradient_accumulation_steps(),
            engine.gradient_accumulation_steps(),
        )
