"""``engine.load_checkpoint``: pick a complete, verified tag, then restore each piece of state.

Choosing the tag is a joint decision: rank 0 lists the candidates (the requested tag, or
``latest`` followed by every other complete tag, newest first); for each, the ranks split the
checksum work, post what they found, and all take the first candidate without problems.
With ``tag=None`` a damaged ``latest`` is skipped with a warning naming the damaged file;
with an explicit tag the damage is an error.

Restoring reads only what this rank needs: module weights (every rank holds them at stages
0-2), then for each parameter range this rank owns *now* the overlapping parts of the saved
fp32 master and optimizer-state shards (:mod:`partita.checkpoint.reshard`); for a
tensor-parallel shard, the parts of the saved tensor-rank pieces that make up this rank's
shard now, at any tensor size (:mod:`partita.checkpoint.tensor_layout`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from partita.checkpoint import format as fmt
from partita.checkpoint import frozen
from partita.checkpoint.frozen import load_frozen
from partita.checkpoint.import_deepspeed_read import deepspeed_hint
from partita.checkpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from partita.checkpoint.jsoncodec import decode
from partita.checkpoint.manifest import check_files, read_latest_checked, read_manifest, scan_tags
from partita.checkpoint.reshard import ShardReader
from partita.checkpoint.rng import restore_rng
from partita.checkpoint.save import checkpoint_config, long_timeout_s, wait_for_pending_save
from partita.checkpoint.snapshot import (
    IMPLEMENTATION_OPTIONS,
    LOCAL_MASTER,
    checkpoint_state_dict,
    param_names,
    shard_file_of,
    split_of,
    sharded_param_keys,
    tensor_rank_files,
)
from partita.checkpoint.stacked_experts import open_upgraded
from partita.checkpoint.state_layout import block_range, element_shards, element_stop
from partita.checkpoint.tensor_layout import check_block_wise, full_shape_of, last_shard_file, read_blocks, read_elements
from partita.checkpoint.sync import Coordinator
from partita.data.sampler import ResumableDistributedSampler
from partita.moe.registry import checkpoint_name, expert_names_elsewhere
from partita.optim.eight_bit import BLOCK_SIZE
from partita.tensor_parallel.shard_ranges import local_slice

if TYPE_CHECKING:
    from partita.engine import Engine
    from partita.zero.shard_group import ShardedParamGroup

logger = logging.getLogger("partita")


def load_checkpoint(
    engine: Engine,
    load_dir: str | os.PathLike[str] | None,
    *,
    tag: str | None = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    check_layout: Callable[[Engine, dict[str, Any], bool], None] | None = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """Restore a checkpoint; see :meth:`partita.engine.Engine.load_checkpoint`.

    ``check_layout(engine, meta, strict, parameters=)``: replaces the per-rank comparison of the
    module's keys (``strict``) and trainable parameters (``parameters``: False for a weights-only
    load) with the checkpoint's (a pipeline stage holds only some layers, so partita/pipe/checkpoint.py
    compares the union over its stages); every rank calls it."""
    wait_for_pending_save()
    cfg = checkpoint_config(engine)
    if load_dir is None:
        load_dir = cfg.save_dir
    coordinator = Coordinator("load_checkpoint", handshake_timeout_s=cfg.handshake_timeout_seconds, long_timeout_s=long_timeout_s(engine))
    problem, candidates = None, []
    if load_dir is None:
        problem = "no directory: pass load_checkpoint(load_dir, ...) or set checkpoint.save_dir in the config"
    elif tag is not None and fmt.check_tag(tag) is not None:
        problem = fmt.check_tag(tag)
    elif coordinator.rank == 0:
        try:
            candidates = _candidates(Path(load_dir), tag)
        except Exception as error:  # noqa: BLE001 - reported to every rank by the handshake, not a lone crash
            problem = f"rank 0 could not list the checkpoints in {load_dir}: {type(error).__name__}: {error}"
    payloads = coordinator.handshake({"tag": tag, "error": problem, "candidates": candidates})
    failures = [(r, p["error"]) for r, p in enumerate(payloads) if p["error"]]
    if failures:
        raise CheckpointError("load_checkpoint did not start: " + "; ".join(f"rank {r}: {m}" for r, m in failures))
    candidates = payloads[0]["candidates"]
    load_dir = Path(load_dir)
    if not candidates:
        if coordinator.rank == 0:
            logger.warning("no checkpoint found in %s (no 'latest' file and no complete tag); nothing was loaded", load_dir)
        return None, None

    chosen, skipped = None, []
    for index, candidate in enumerate(candidates):
        problems = _verify_jointly(coordinator, load_dir / candidate, index=index, checksums=cfg.verify_checksums)
        if not problems:
            chosen = candidate
            break
        if tag is not None:
            raise CheckpointCorruptError(
                f"checkpoint {load_dir / candidate} cannot be loaded: " + "; ".join(problems)
                + f". Load another tag (partita checkpoint inspect {load_dir} lists them)"
            )
        skipped.append((candidate, problems))
    if chosen is None:
        detail = " | ".join(f"{t}: {'; '.join(p)}" for t, p in skipped)
        raise CheckpointCorruptError(f"no complete checkpoint in {load_dir} passes verification: {detail}")
    if skipped and coordinator.rank == 0:
        for bad, problems in skipped:
            logger.warning("checkpoint %s is damaged (%s); falling back to the next newest complete one", load_dir / bad, "; ".join(problems))
        logger.warning("loading checkpoint %s instead of %s", load_dir / chosen, load_dir / skipped[0][0])

    path = load_dir / chosen
    client_state = _restore(
        engine,
        path,
        load_module_strict=load_module_strict,
        load_optimizer_states=load_optimizer_states and not load_module_only,
        load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
        load_module_only=load_module_only,
        check_layout=check_layout,
    )
    if coordinator.rank == 0:
        logger.info("loaded checkpoint %s (global step %d)", path, engine.global_steps)
    return str(path), client_state


# ---------------------------------------------------------------------------- choosing the tag


def _candidates(load_dir: Path, tag: str | None) -> list[str]:
    hint = deepspeed_hint(load_dir, tag)
    if hint is not None:
        raise CheckpointError(hint)
    if tag is not None:
        return [tag]
    latest = _read_latest_or_warn(load_dir)
    complete = [info.tag for info in scan_tags(load_dir) if info.complete]
    ordered = [latest] if latest is not None else []
    return ordered + [t for t in complete if t != latest]


def _read_latest_or_warn(load_dir: Path) -> str | None:
    """The tag ``latest`` names, or None (with a warning) when the file is damaged."""
    latest, problem = read_latest_checked(load_dir)
    if problem is not None:
        logger.warning("%s is damaged (%s); falling back to the newest complete checkpoint", load_dir / fmt.LATEST_FILE, problem)
    return latest


def _verify_jointly(coordinator: Coordinator, tag_dir: Path, *, index: int, checksums: bool) -> list[str]:
    """Every rank checks sizes and hashes its share of the files; all get the union of problems."""
    try:
        manifest = read_manifest(tag_dir)
        names = sorted(manifest["files"])
        mine = {n for i, n in enumerate(names) if i % coordinator.world_size == coordinator.rank} if checksums else set()
        problems = check_files(tag_dir, manifest, hash_names=mine)
    except CheckpointCorruptError as error:
        problems = [str(error)]
    coordinator.publish(f"verify{index}", {"problems": problems})
    reports = coordinator.gather(f"verify{index}", what="verifying the checkpoint files")
    return sorted({p for report in reports for p in report["problems"]})


# ---------------------------------------------------------------------------- restoring


def _restore(
    engine: Engine,
    path: Path,
    *,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    check_layout: Callable[[Engine, dict[str, Any], bool], None] | None = None,
) -> dict[str, Any]:
    meta = json.loads((path / fmt.META_FILE).read_text(encoding="utf-8"))
    # MoE experts saved stacked by earlier partita: read under today's per-expert names.
    meta, reader = open_upgraded(path, meta, engine.module)
    strict = load_module_strict
    if check_layout is not None:
        check_layout(engine, meta, load_module_strict, parameters=not load_module_only)
        strict = False  # checked over every stage just now; this rank's keys are a part of them
    with reader:
        tensor_of = lambda key: reader.tensor(meta["state_file"], key)  # noqa: E731
        sharded_now = sharded_param_keys(engine)
        # Keys restored through the fp32 master weights instead of the model file: those held
        # as shards in this run (ZeRO-3) and those the checkpoint holds only as shards.
        via_master = _load_module(
            engine.module, reader, meta["model"], strict=strict, skip=sharded_now, tensor_of=tensor_of
        )
        load_frozen(engine, reader, meta, strict=strict)  # ZeRO-3's sharded frozen parameters
        engine.zero_grad()
        if load_module_only:
            # As DeepSpeed: weights only (no optimizer, scheduler, counters or generators), but
            # the client_state still comes back, e.g. for a fine-tuning run that reads it.
            _masters_for_module_only(engine, reader, meta, via_master)
            engine.optimizer.write_back_params()
            return decode(meta["client_state"], tensor=tensor_of)
        if check_layout is None:
            _check_parameters(engine, meta)
        _load_masters(engine, reader, meta)
        if load_optimizer_states:
            _load_optimizer_state(engine, reader, meta, tensor_of)
            if engine.loss_scaler is not None and meta["loss_scaler"] is not None:
                engine.loss_scaler.load_state_dict(decode(meta["loss_scaler"], tensor=tensor_of))
        # The model's trainable weights are the master weights cast to the compute dtype.
        engine.optimizer.write_back_params()
        if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(decode(meta["lr_scheduler"], tensor=tensor_of))
        counters = meta["counters"]
        engine.global_steps = counters["global_steps"]
        engine.global_samples = counters["global_samples"]
        engine.skipped_steps = counters["skipped_steps"]
        engine.micro_steps = counters["micro_steps"]
        if getattr(engine, "_forward_schedules", None) is not None:  # PLD theta, curriculum difficulty (partita/schedules)
            engine._forward_schedules.load_state_dict(meta.get("forward_schedules"), global_steps=engine.global_steps)
        _load_rng(reader, meta)
        _load_sampler(engine, meta)
        return decode(meta["client_state"], tensor=tensor_of)


@torch.no_grad()
def _load_module(module: torch.nn.Module, reader: ShardReader, model_meta: dict[str, Any], *, strict: bool,
                 skip: set[str], tensor_of) -> set[str]:
    """Copy saved weights and buffers into the module's own tensors, one tensor at a time.

    Keys in ``skip`` (parameters this run holds as shards) are not touched. Returns the keys
    to restore through the fp32 master weights: ``skip`` and the keys the model file lacks
    because the checkpoint holds them only as shards (a ZeRO-3 save).
    """
    current = checkpoint_state_dict(module)  # MoE experts under their global index
    elsewhere = expert_names_elsewhere(module)  # experts other expert ranks hold: saved, not here
    aliases = model_meta["aliases"]
    extra = model_meta.get("extra_state", {})
    files = {model_meta["file"], *model_meta.get("files", {}).values()}
    stored = {key for name in files for key in reader.handle(name).keys()}
    sharded_saved = set(model_meta.get("sharded_keys", []))
    saved_keys = set(model_meta["keys"])
    missing = [k for k in current if k not in saved_keys]
    unexpected = [k for k in model_meta["keys"] if k not in current and k not in elsewhere]
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(
            "the checkpoint's model does not match this model: "
            + (f"missing in the checkpoint: {_few(missing)}; " if missing else "")
            + (f"not in this model: {_few(unexpected)}; " if unexpected else "")
            + "pass load_module_strict=False to load the keys both have"
        )
    extra_values: dict[str, Any] = {}
    via_master = set(skip)
    tensor_shards = {checkpoint_name(k, p): split_of(p) for k, p in module.named_parameters(remove_duplicate=False)
                     if split_of(p)}
    for key, target in current.items():
        if key not in saved_keys or key in skip:
            continue
        if key in extra:
            extra_values[key] = decode(extra[key], tensor=tensor_of)
            continue
        source = aliases.get(key, key)
        # Saved as ZeRO-3 frozen shards (partita/checkpoint/frozen.py), whole here: read whole.
        value = frozen.read_whole(reader, model_meta, source, target.dtype) if source not in stored else None
        if value is None and source not in stored:
            if source in sharded_saved:
                via_master.add(key)
                continue
            raise CheckpointCorruptError(f"{reader.tag_dir / fmt.model_file_of(model_meta, source)} has no tensor {source!r}")
        if value is None:
            value = reader.tensor(fmt.model_file_of(model_meta, source), source)
        shard = tensor_shards.get(key)
        if shard is not None and tuple(value.shape) == tuple(shard.full_shape):
            # A whole tensor (saved without tensor parallelism): this rank's shard of it.
            value = local_slice(value, dim=shard.dim, size=shard.size, rank=shard.rank, chunks=shard.chunks)
        if tuple(value.shape) != tuple(target.shape):
            raise CheckpointMismatchError(
                f"'{key}' has shape {list(value.shape)} in the checkpoint and {list(target.shape)} in this model"
            )
        target.copy_(value)
    if extra_values:
        module.load_state_dict(extra_values, strict=False)
    return via_master


@torch.no_grad()
def _masters_for_module_only(engine: Engine, reader: ShardReader, meta: dict[str, Any], via_master: set[str]) -> None:
    """Weights-only load: each master slice comes from the loaded whole parameter, or, for a
    parameter not loaded whole, from the saved fp32 master shards (or the model file)."""
    saved = meta["optimizer"]["params"]
    model_meta = meta["model"]
    names = param_names(engine.module)
    for group in engine.optimizer.groups:
        for param, spec, (start, end) in group.owned_slices():
            name = names[param]
            target = group.master[spec.partition_offset : spec.partition_offset + (end - start)]
            source = model_meta["aliases"].get(name, name)
            if name not in via_master:
                target.copy_(param.detach().reshape(-1)[start:end])
            elif name in saved or source in saved:
                record = saved.get(name) or saved[source]
                key = fmt.master_key(source if name not in saved else name)
                read_elements(reader, key, record, split_of(param), start, end, target)
            elif frozen.read_range(reader, model_meta, source, start, end, target):
                pass  # frozen (sharded) when saved, trained now
            elif source in model_meta["tensors"]:
                value = reader.tensor(fmt.model_file_of(model_meta, source), source)
                shard = split_of(param)
                if shard is not None:
                    value = local_slice(value, dim=shard.dim, size=shard.size, rank=shard.rank, chunks=shard.chunks)
                target.copy_(value.reshape(-1)[start:end])
            else:
                raise CheckpointMismatchError(f"the checkpoint has no weights for parameter '{name}'")


def _few(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_parameters(engine: Engine, meta: dict[str, Any]) -> None:
    saved = meta["optimizer"]["params"]
    names = param_names(engine.module)
    # Whole shapes: a tensor-parallel shard is compared as the tensor it is part of.
    current = {names[p]: (g, full_shape_of(p, split_of(p))) for g, group in enumerate(engine.optimizer.groups)
               for p in group.params}
    missing = [n for n in current if n not in saved]
    elsewhere = expert_names_elsewhere(engine.module)  # experts other expert ranks train
    extra = [n for n in saved if n not in current and n not in elsewhere]
    if missing or extra:
        raise CheckpointMismatchError(
            "the trainable parameters differ from the checkpoint's: "
            + (f"not in the checkpoint: {_few(missing)}; " if missing else "")
            + (f"trainable in the checkpoint but not here: {_few(extra)}; " if extra else "")
            + "train the same parameters, or load with load_module_only=True (weights only)"
        )
    for name, (group, shape) in current.items():
        if tuple(saved[name]["shape"]) != shape:
            raise CheckpointMismatchError(f"parameter '{name}' has shape {saved[name]['shape']} in the checkpoint and {list(shape)} here")


@torch.no_grad()
def _load_masters(engine: Engine, reader: ShardReader, meta: dict[str, Any]) -> None:
    saved = meta["optimizer"]["params"]
    names = param_names(engine.module)
    for group in engine.optimizer.groups:
        group.master.zero_()
        for param, spec, (start, end) in group.owned_slices():
            name = names[param]
            target = group.master[spec.partition_offset : spec.partition_offset + (end - start)]
            read_elements(reader, fmt.master_key(name), saved[name], split_of(param), start, end, target)


@torch.no_grad()
def _load_optimizer_state(engine: Engine, reader: ShardReader, meta: dict[str, Any], tensor_of) -> None:
    optimizer_meta = meta["optimizer"]
    inner = engine.optimizer.inner
    current_class = f"{type(inner).__module__}.{type(inner).__qualname__}"
    if optimizer_meta["class"] != current_class:
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer is {optimizer_meta['class']}, this run's is {current_class}; use the same "
            "optimizer or pass load_optimizer_states=False (weights and fp32 master weights are still loaded)"
        )
    names = param_names(engine.module)
    saved_of = _saved_groups(engine, optimizer_meta, names, tensor_of)
    groups_meta = optimizer_meta["groups"]
    current = inner.state_dict()
    new_state: dict[int, dict[str, Any]] = {}
    new_groups = []
    for g, group in enumerate(engine.optimizer.groups):
        (index,) = current["param_groups"][g]["params"]
        saved = saved_of[g]
        group_meta = groups_meta[saved]
        state = _sharded_state(engine, reader, optimizer_meta, g, group_meta, names)
        # A private copy per group: parts of one saved group (ratio < 1) must not share a step
        # tensor, which torch increments in place once per parameter.
        scalars = decode(group_meta["scalar_state"], tensor=tensor_of)
        state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})
        if group_meta["local_state"]:
            state.update(_local_state(engine, reader, meta, g, group_meta, saved=saved))
        if state:
            new_state[index] = state
        hyper = decode(group_meta["hyperparameters"], tensor=tensor_of)
        for key in IMPLEMENTATION_OPTIONS & current["param_groups"][g].keys():
            hyper[key] = current["param_groups"][g][key]
        new_groups.append({**hyper, "params": [index]})
    inner.load_state_dict({"state": new_state, "param_groups": new_groups})
    own_entries = getattr(inner, "load_checkpoint_entries", None)
    if own_entries is not None:  # the 1-bit optimizers' worker errors (partita/optim/onebit_checkpoint.py)
        own_entries(reader, meta, names, fmt.rank_file)
    engine.optimizer.release_states(loaded=True)  # NVMe optimizer offload: into the swap files


def _saved_groups(
    engine: Engine, optimizer_meta: dict[str, Any], names: dict[torch.nn.Parameter, str], tensor_of
) -> list[int]:
    """For each ZeRO group of this run, the saved group whose hyperparameters and scalar state
    it takes.

    Groups match by the user's param group they come from (``source``), not by position:
    ``offload_optimizer.ratio`` < 1 cuts a user group into a host and a device part, and a
    checkpoint must resume under another ratio. Parts of one user group hold the same kind of
    state; a saved pair whose step counts or state keys differ is refused.
    """
    groups_meta = optimizer_meta["groups"]
    sources = [group_meta.get("source", i) for i, group_meta in enumerate(groups_meta)]  # older checkpoints: by position
    chosen = []
    for g, group in enumerate(engine.optimizer.groups):
        saved = [optimizer_meta["params"][names[p]]["group"] for p in group.params]
        moved = [names[p] for p, s in zip(group.params, saved) if sources[s] != group.source_index]
        if moved:
            raise CheckpointMismatchError(
                f"parameters {_few(moved)} are in param group {group.source_index} now but were in another group "
                "when saved; build the same groups or pass load_optimizer_states=False"
            )
        twins = sorted(set(saved))
        kinds = {(tuple(groups_meta[s]["partition_state"]), tuple(groups_meta[s]["block_state"]),
                  tuple(groups_meta[s]["local_state"])) for s in twins}
        scalars = [decode(groups_meta[s]["scalar_state"], tensor=tensor_of) for s in twins]
        if len(kinds) > 1 or any(not _same_value(scalars[0], other) for other in scalars[1:]):
            raise CheckpointMismatchError(
                f"param group {group.source_index} was saved as parts {twins} (offload_optimizer.ratio < 1) whose "
                "optimizer states differ (step counts or state kinds); resume with the saved offload ratio, or pass "
                "load_optimizer_states=False"
            )
        if groups_meta[twins[0]]["local_state"] and twins != [g]:
            raise NotImplementedError(
                f"param group {group.source_index} keeps per-rank optimizer state that cannot be regrouped; resume "
                "with the saved offload_optimizer.ratio, or pass load_optimizer_states=False"
            )
        chosen.append(twins[0])
    return chosen


def _same_value(a: Any, b: Any) -> bool:
    """Equality of decoded state values (tensors compared by value)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return a == b


def _check_block_size(group: ShardedParamGroup, g: int, block_size: int) -> None:
    """Block-wise state moves block by block only between layouts with the same block size."""
    if block_size != BLOCK_SIZE:
        raise CheckpointMismatchError(
            f"the checkpoint's 8-bit optimizer state of param group {g} is quantised in blocks of {block_size} "
            f"elements, this run's optimizer uses blocks of {BLOCK_SIZE}; the per-block scales cannot be re-cut "
            "between block sizes. Resume with the bitsandbytes version (block size) that saved it, or pass "
            "load_optimizer_states=False (weights and fp32 master weights are still loaded)"
        )
    misaligned = [s.index for s in group.layout.specs if s.shard_numel % block_size or s.partition_offset % block_size]
    if misaligned:
        raise CheckpointMismatchError(
            f"param group {g} has a ZeRO layout whose shards are not multiples of the 8-bit block size {block_size} "
            f"(parameters {_few([str(i) for i in misaligned])}); build it with alignment={block_size} "
            "(partita.optim.factory.required_alignment), as partita.initialize does"
        )


@torch.no_grad()
def _sharded_state(engine: Engine, reader: ShardReader, optimizer_meta: dict[str, Any], g: int,
                   group_meta: dict[str, Any], names: dict[torch.nn.Parameter, str]) -> dict[str, Any]:
    """This rank's partition of the per-element and per-block state of group ``g``, read per
    parameter from the saved shards (block-wise state: see partita.checkpoint.state_layout)."""
    group = engine.optimizer.groups[g]
    master = group.master
    block_size = group_meta.get("block_size")
    block_keys = group_meta.get("block_state", [])
    dtypes = group_meta.get("state_dtypes", {})
    if block_size is not None:
        _check_block_size(group, g, block_size)
        # Every parameter, owned here or not, so that every rank refuses together.
        for param in group.params:
            check_block_wise(names[param], optimizer_meta["params"][names[param]], split_of(param), block_size)
    state: dict[str, Any] = {}
    for key in group_meta["partition_state"]:
        dtype = getattr(torch, dtypes.get(key, "float32"))
        state[key] = torch.zeros(master.shape, dtype=dtype, device=master.device)
    for key in block_keys:
        blocks = math.ceil(master.numel() / block_size)
        state[key] = torch.zeros(blocks, dtype=getattr(torch, dtypes.get(key, "float32")), device=master.device)
    for param, spec, (start, end) in group.owned_slices():
        if end <= start:
            continue
        name = names[param]
        record = optimizer_meta["params"][name]
        tensor_shard = split_of(param)
        stop = element_stop(end, block_size)
        lo = spec.partition_offset
        rounded = lambda shards: element_shards(shards, block_size)  # noqa: E731
        for key in group_meta["partition_state"]:
            target = state[key][lo : lo + (stop - start)]
            read_elements(reader, fmt.state_key(key, name), record, tensor_shard, start, stop, target, shards_of=rounded)
        if block_size is None:
            continue
        first, last = block_range(start, stop, block_size)
        offset = lo // block_size
        for key in block_keys:
            target = state[key][offset : offset + (last - first)]
            read_blocks(reader, fmt.state_key(key, name), record, tensor_shard, first, last, target, block_size)
        if end == spec.numel and stop > end:
            # The padding that shares the last block; the rank owning the parameter's last
            # element owned (and saved) the whole block in the saving layout too (a tensor
            # layout change is accepted only where no local shard has padding).
            padding = reader.tensor(last_shard_file(record, tensor_shard), fmt.master_padding_key(name))
            master[lo + (end - start) : lo + (stop - start)].copy_(padding)
    return state


def _local_state(
    engine: Engine, reader: ShardReader, meta: dict[str, Any], g: int, group_meta: dict[str, Any], *, saved: int
) -> dict[str, Any]:
    """Optimizer state partita cannot cut per parameter (saved per rank): same layout only.

    8-bit state is saved per parameter now; a checkpoint holding it under ``local_state`` was
    written by an earlier partita and loads onto its own layout only.
    """
    group = engine.optimizer.groups[g]
    tensor_size = engine.topology.tensor_size
    if (group_meta["num_shards"] != group.layout.num_shards or meta["world_size"] != dist.get_world_size()
            or meta.get("tensor_parallel_size", 1) != tensor_size):
        raise NotImplementedError(
            f"optimizer state {group_meta['local_state']} of group {g} is stored per rank and cannot be resharded "
            f"from {group_meta['num_shards']} to {group.layout.num_shards} shards (the optimizer keeps state partita "
            "cannot split per parameter, or the checkpoint predates per-parameter 8-bit state); resume on the saved "
            f"world size ({meta['world_size']}), tensor-parallel size ({meta.get('tensor_parallel_size', 1)}) and ZeRO "
            f"stage ({meta['zero_stage']}), or pass load_optimizer_states=False"
        )
    source = tensor_rank_files(engine, engine.topology.tensor_rank)[group.shard_rank] if tensor_size > 1 else shard_file_of(engine, group.shard_rank)
    group.master.copy_(reader.tensor(source, fmt.local_state_key(saved, LOCAL_MASTER)))  # padding included
    return {key: reader.tensor(source, fmt.local_state_key(saved, key)).to(group.master.device) for key in group_meta["local_state"]}


def _load_rng(reader: ShardReader, meta: dict[str, Any]) -> None:
    rank = dist.get_rank()
    if rank >= meta["world_size"]:
        if rank == meta["world_size"]:
            logger.warning(
                "the checkpoint was saved by %d ranks; ranks %d and above keep their current random state",
                meta["world_size"], meta["world_size"],
            )
        return
    name = fmt.rank_file(rank)
    metadata = reader.metadata(name)
    if fmt.RNG_METADATA_KEY not in metadata:
        return  # no generator states saved (a checkpoint imported from DeepSpeed, which saves none)
    handle = reader.handle(name)
    tensors = {k: handle.get_tensor(k) for k in handle.keys() if k.startswith("rng/")}
    restore_rng(json.loads(metadata[fmt.RNG_METADATA_KEY]), tensors)


def _load_sampler(engine: Engine, meta: dict[str, Any]) -> None:
    loader = engine.training_dataloader
    sampler = getattr(loader, "sampler", None) if loader is not None else None
    if isinstance(sampler, ResumableDistributedSampler) and meta.get("sampler") is not None:
        sampler.load_state_dict(meta["sampler"])
