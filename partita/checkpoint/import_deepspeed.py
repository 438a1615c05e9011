"""``partita checkpoint import-deepspeed DIR OUT``: a DeepSpeed checkpoint as a partita checkpoint.

DeepSpeed 0.19.8's files are read without running code (:mod:`.import_deepspeed_read`), the
whole fp32 master weights and optimizer states are rebuilt from its partitions with
``zero_to_fp32``'s layout rules (:mod:`.import_deepspeed_state`), and the result is written in
partita's own format (:mod:`partita.checkpoint.format`) by partita's writers: the files as a
one-rank, stage-0 save (every parameter one shard), then the manifest, the atomic rename and
``latest`` as any save. Since partita checkpoints reshard on load, the imported checkpoint
resumes at any world size and ZeRO stage (``engine.load_checkpoint(OUT)``).

Carried over: the module's weights and buffers, the fp32 masters, per-element optimizer state
(Adam's ``exp_avg``/``exp_avg_sq``) and its scalars (``step``), each group's hyperparameters,
the LR scheduler's position, ``global_steps``/``global_samples``/``skipped_steps``, the fp16
loss scale, and client_state. Not carried over: random generator states (DeepSpeed saves
none; a resumed run keeps its own), data sampler state, and DeepSpeed-only sections
(curriculum ``data_sampler``, ``random_ltd``), which are reported in ``imported_from``.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from partita.checkpoint import format as fmt
from partita.checkpoint.errors import CheckpointError
from partita.checkpoint.import_deepspeed_read import (DeepSpeedFiles, DeepSpeedImportError, find_files, resolve_tag_dir,
                                                      safe_load)
from partita.checkpoint.import_deepspeed_state import (ImportedGroup, groups_from_stage0, groups_from_stage3,
                                                       groups_from_stage12, stage0_names)
from partita.checkpoint.jsoncodec import encode
from partita.checkpoint.manifest import commit_tag, write_latest
from partita.checkpoint.safetensors_io import TensorEntry, write_json, write_safetensors

__all__ = ["DeepSpeedImportError", "import_deepspeed"]

# Keys of DeepSpeed's model file that are its own bookkeeping; every other key is client_state.
_ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info", "ds_autotp_universal_checkpoint_info",
})


def import_deepspeed(
    ds_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    out_tag: str | None = None,
    optimizer_class: str | None = None,
    stage0_param_names: list[list[str]] | None = None,
    rename: dict[str, str] | None = None,
) -> Path:
    """Convert DeepSpeed's checkpoint in ``ds_dir`` (its save_dir, or one tag directory) into a
    partita checkpoint ``out_dir/<tag>`` (``latest`` updated); returns the tag directory.

    Args:
        tag: the DeepSpeed tag to import (default: the one ``latest`` names).
        out_tag: the partita tag (default: the DeepSpeed tag).
        optimizer_class: the torch optimizer class the resumed run uses
            (``"torch.optim.adamw.AdamW"``); default: inferred from DeepSpeed's config or the saved
            param groups. partita loads optimizer state only into the class it was saved from.
        stage0_param_names: ZeRO 0 only, where DeepSpeed does not record which parameter each
            optimizer entry is: the names per param group, in the order given to the optimizer
            (DeepSpeed's names, before ``rename``).
        rename: name prefixes to replace in every key, ``{old: new}`` (``{"module.": ""}`` drops
            a wrapper's prefix; ``{"": "model."}`` adds one): for a partita model whose
            state_dict names differ from the DeepSpeed model's.
    """
    tag_dir = resolve_tag_dir(Path(ds_dir), tag)
    files = find_files(tag_dir)
    model_states = safe_load(files.model_states[0])
    config = model_states.get("ds_config")
    # DeepSpeed saves the config as given to initialize: a dict, or a file path (then the files tell the stage).
    config = config if isinstance(config, dict) else {}
    stage = _zero_stage(config, files)
    _check_layout(model_states, stage, files)
    world, optim = _read_optimizer_files(model_states, stage, files)
    if stage in (1, 2):
        groups = groups_from_stage12(model_states, optim)
    elif stage == 3:
        groups = groups_from_stage3(model_states, optim)
    else:
        groups = _stage0_groups(model_states, stage0_param_names)
    module = _module_state(model_states, groups, [safe_load(p) for p in files.model_states[1:]] if stage == 3 else [])
    model_states["module"] = None  # DeepSpeed's copies of the weights: the rebuilt ones replace them
    if rename:
        model_states = _renamed(model_states, groups, module, rename)
        module = {_new_name(k, rename): v for k, v in module.items()}
    cls = optimizer_class or _optimizer_class(config, groups)
    name = out_tag or tag_dir.name
    problem = fmt.check_tag(name)
    if problem is not None:
        raise DeepSpeedImportError(f"{problem}; pass another partita tag with --out-tag")
    meta, model_entries, state_entries, rank_entries = _plan(
        model_states, config, groups, module, cls, tag=name, stage=stage, world=world, source=tag_dir,
        optim0=optim[0] if optim else model_states.get("optimizer"))
    return _write(Path(out_dir), name, meta, model_entries, state_entries, rank_entries)


# ---------------------------------------------------------------------------- checks


def _zero_stage(config: dict[str, Any], files: DeepSpeedFiles) -> int:
    """The stage DeepSpeed's config names (the layout of 1 and 2 is the same; 3 has per-rank model files)."""
    section = config.get("zero_optimization")
    if isinstance(section, dict) and "stage" in section:
        stage = int(section["stage"])
    else:  # no config saved: the files tell
        stage = 0 if not files.optim_states else (3 if len(files.model_states) > 1 else 2)
    if stage > 0 and not files.optim_states:
        raise DeepSpeedImportError(
            f"{files.tag_dir} is a ZeRO-{stage} checkpoint without its optimizer files "
            "(zero_pp_rank_<r>_mp_rank_00_optim_states.pt); copy every rank's files into the tag directory"
        )
    return stage


def _check_layout(model_states: dict[str, Any], stage: int, files: DeepSpeedFiles) -> None:
    """Refuse the layouts the importer does not read (named, with the way out)."""
    if stage == 0 and files.optim_states:
        raise NotImplementedError(
            f"{files.tag_dir} holds per-rank optimizer files at ZeRO 0 ({files.optim_states[0].name}, ...): DeepSpeed's "
            "BF16_Optimizer, whose flat fp32 layout the importer does not read. Import a ZeRO 1-3 checkpoint of the "
            "run, or take the weights alone (DeepSpeed's zero_to_fp32.py, then load_module_only)"
        )
    if model_states.get("mp_world_size", 1) != 1:
        raise NotImplementedError(
            f"{files.tag_dir} was saved with model-parallel size {model_states['mp_world_size']}; the importer reads "
            "checkpoints with one model-parallel rank only"
        )


def _read_optimizer_files(model_states: dict[str, Any], stage: int, files: DeepSpeedFiles) -> tuple[int, list[dict[str, Any]]]:
    """(data-parallel size, every rank's ``optimizer_state_dict``) of a ZeRO 1-3 checkpoint."""
    world = int(model_states.get("dp_world_size") or len(files.optim_states) or 1)
    if stage == 0:
        return world, []
    if len(files.optim_states) != world:
        have = sorted(int(re.search(r"zero_pp_rank_(\d+)_", p.name).group(1)) for p in files.optim_states)
        raise DeepSpeedImportError(
            f"{files.tag_dir} was saved by {world} data-parallel ranks but holds the optimizer files of ranks {have}; "
            "copy every rank's zero_pp_rank_<r>_mp_rank_00_optim_states.pt into the tag directory"
        )
    optim = [safe_load(p)["optimizer_state_dict"] for p in files.optim_states]
    if stage in (1, 2) and not isinstance(optim[0].get("base_optimizer_state"), dict):
        raise NotImplementedError(
            f"{files.tag_dir} was saved with zero_optimization.elastic_checkpoint, which keeps no param-group "
            "hyperparameters (lr, betas, weight decay of each group), so the optimizer state cannot be resumed "
            "exactly (DeepSpeed 0.19.8 itself cannot load it for torch optimizers); save with elastic_checkpoint "
            "false, or take the weights alone (DeepSpeed's zero_to_fp32.py, then load_module_only)"
        )
    return world, optim


# ---------------------------------------------------------------------------- reconstruction


def _stage0_groups(model_states: dict[str, Any], names: list[list[str]] | None) -> list[ImportedGroup]:
    optimizer = model_states.get("optimizer")
    if not isinstance(optimizer, dict) or "param_groups" not in optimizer.get("optimizer_state_dict", optimizer):
        raise DeepSpeedImportError(
            "the DeepSpeed model file holds no optimizer state (saved without an optimizer, or with "
            "load_optimizer_states disabled); only weights can be taken from it: load it with DeepSpeed's "
            "zero_to_fp32.py output and load_module_only"
        )
    module = model_states["module"]
    inner = optimizer.get("optimizer_state_dict", optimizer)
    if names is None:
        names = stage0_names(module, model_states.get("buffer_names") or [], inner["param_groups"], inner["state"])
    if [len(n) for n in names] != [len(g["params"]) for g in inner["param_groups"]]:
        raise DeepSpeedImportError(
            f"stage0_param_names has {[len(n) for n in names]} names per group; the optimizer's groups hold "
            f"{[len(g['params']) for g in inner['param_groups']]} parameters"
        )
    # fp16/bf16 at ZeRO 0: DeepSpeed's FP16 optimizers wrap the torch optimizer and keep the fp32
    # masters in the param groups' order: whole tensors (``fp32_groups``, FP16_UnfusedOptimizer) or
    # one flat tensor per group (``fp32_groups_flat``, FP16_Optimizer).
    wrapped = "optimizer_state_dict" in optimizer
    groups = groups_from_stage0(inner, names)
    for g, group in enumerate(groups):
        offset = 0
        for i, name in enumerate(group.names):
            if name not in module:
                raise DeepSpeedImportError(f"stage0_param_names names {name!r}, which is not in the module's state_dict")
            shape = tuple(module[name].shape)
            group.shapes.append(shape)
            if not wrapped:
                master = module[name]
            elif "fp32_groups" in optimizer:
                master = optimizer["fp32_groups"][g][i]
            elif "fp32_groups_flat" in optimizer:
                numel = module[name].numel()
                master = optimizer["fp32_groups_flat"][g].reshape(-1)[offset : offset + numel]
                offset += numel
            else:
                raise DeepSpeedImportError(
                    f"DeepSpeed's ZeRO-0 optimizer state has keys {sorted(optimizer)} but no fp32 master weights "
                    "(fp32_groups or fp32_groups_flat); the importer does not know this layout"
                )
            group.masters[name] = master.detach().float().clone().view(shape)
    return groups


def _new_name(name: str, rename: dict[str, str]) -> str:
    """``name`` with its longest matching prefix in ``rename`` replaced."""
    for old in sorted(rename, key=len, reverse=True):
        if name.startswith(old):
            return rename[old] + name[len(old):]
    return name


def _renamed(model_states: dict[str, Any], groups: list[ImportedGroup], module: dict[str, torch.Tensor],
             rename: dict[str, str]) -> dict[str, Any]:
    """Rename the groups in place; return the model file's dict with renamed shared_params."""
    new = [_new_name(k, rename) for k in module]
    if len(set(new)) != len(new):
        clash = sorted({n for n in new if new.count(n) > 1})
        raise DeepSpeedImportError(f"rename {rename} maps several keys to {clash[:4]}; give prefixes that keep names distinct")
    for group in groups:
        group.names = [_new_name(n, rename) for n in group.names]
        group.masters = {_new_name(n, rename): t for n, t in group.masters.items()}
        group.state = {k: {_new_name(n, rename): t for n, t in v.items()} for k, v in group.state.items()}
    shared = model_states.get("shared_params") or {}
    return {**model_states, "shared_params": {_new_name(a, rename): _new_name(b, rename) for a, b in shared.items()}}


def _gather_frozen(model_states: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """ZeRO 3's frozen parameters: each rank's file holds its piece (``frozen_param_fragments``)."""
    shapes = model_states.get("frozen_param_shapes") or {}
    ranks = [model_states] + others
    out = {}
    for name, shape in shapes.items():
        numel = 1
        for d in shape:
            numel *= int(d)
        pieces = [r["frozen_param_fragments"][name].reshape(-1) for r in ranks]
        out[name] = torch.cat(pieces)[:numel].view(tuple(int(d) for d in shape))
    return out


def _module_state(model_states: dict[str, Any], groups: list[ImportedGroup], others: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The module's state_dict, whole: trained parameters from the fp32 masters (in the module's
    dtype), the rest (buffers, frozen parameters) as DeepSpeed saved them."""
    module = dict(model_states["module"])
    masters = {n: t for g in groups for n, t in g.masters.items()}
    frozen = _gather_frozen(model_states, others) if others or model_states.get("frozen_param_shapes") else {}
    shared = model_states.get("shared_params") or {}
    for key, value in list(module.items()):
        source = shared.get(key, key)
        if source in masters:
            dtype = value.dtype if value.is_floating_point() else torch.float32
            module[key] = masters[source].to(dtype)
        elif source in frozen:
            module[key] = frozen[source].to(value.dtype)
        elif torch.is_tensor(value) and value.numel() == 0 and key not in (model_states.get("buffer_names") or []):
            raise DeepSpeedImportError(
                f"parameter {key!r} is empty in the DeepSpeed model file (a ZeRO-3 placeholder) and is neither in the "
                "optimizer's param_shapes nor a saved frozen parameter; the files do not belong together"
            )
    missing = sorted(set(masters) - set(module))
    if missing:
        raise DeepSpeedImportError(
            f"the optimizer holds parameters {missing[:6]} that the module's state_dict lacks; the model file and the "
            "optimizer files come from different models"
        )
    return module


def _optimizer_class(config: dict[str, Any], groups: list[ImportedGroup]) -> str:
    """The torch class partita builds for this run, as partita.optim.factory does from the same config."""
    section = config.get("optimizer") or {}
    kind = str(section.get("type", "")).lower()
    params = section.get("params") or {}
    if kind in ("adam", "adamw", "fusedadam", "cpuadam"):
        decoupled = kind == "adamw" or params.get("adam_w_mode", True)
        return "torch.optim.adamw.AdamW" if decoupled else "torch.optim.adam.Adam"
    if kind == "sgd":
        return "torch.optim.sgd.SGD"
    if kind:
        raise DeepSpeedImportError(
            f"DeepSpeed's optimizer type {section.get('type')!r} has no partita counterpart the importer knows; pass "
            "the torch class your partita run uses with --optimizer-class (e.g. torch.optim.adamw.AdamW)"
        )
    hyper = groups[0].hyperparameters if groups else {}
    if "decoupled_weight_decay" in hyper:  # torch's Adam/AdamW (a client optimizer)
        return "torch.optim.adamw.AdamW" if hyper["decoupled_weight_decay"] else "torch.optim.adam.Adam"
    if "nesterov" in hyper and "dampening" in hyper:
        return "torch.optim.sgd.SGD"
    raise DeepSpeedImportError(
        f"cannot tell which optimizer class saved this state (param group keys {sorted(hyper)}); pass the torch class "
        "your partita run uses with --optimizer-class (e.g. torch.optim.adamw.AdamW)"
    )


def _scheduler_state(state: Any, config: dict[str, Any]) -> Any:
    """DeepSpeed's schedulers save ``{"last_batch_iteration": i}``; partita's are torch schedulers
    counting completed steps in ``last_epoch`` on DeepSpeed's step convention
    (partita.optim.schedulers), so DeepSpeed's ``i`` is partita's ``last_epoch = i + 1`` for
    WarmupLR, WarmupDecayLR, WarmupCosineLR and OneCycle alike. Only the counter is written:
    torch's load_state_dict updates the attributes it is given, so the schedule's settings stay
    those of the resumed run's config."""
    if not (isinstance(state, dict) and set(state) == {"last_batch_iteration"}):
        return state  # a torch scheduler passed to deepspeed.initialize: its own state_dict
    step = int(state["last_batch_iteration"]) + 1
    return {"last_epoch": step, "_step_count": step + 1}


def _loss_scaler(optim0: dict[str, Any] | None, config: dict[str, Any]) -> dict[str, Any] | None:
    """fp16's loss scale as partita's scaler state (partita.precision.loss_scaler: DeepSpeed's names).

    ``optim0``: rank 0's ZeRO 1-3 optimizer state (the scaler is an object under ``loss_scaler``)
    or, at ZeRO 0, DeepSpeed's FP16 optimizer state (its attributes at the top level)."""
    if not (config.get("fp16") or {}).get("enabled") or optim0 is None:
        return None  # fp32/bf16: partita keeps no loss scaler
    scaler = vars(optim0["loss_scaler"]) if "loss_scaler" in optim0 else optim0
    if optim0.get("dynamic_loss_scale"):
        return {"type": "dynamic", "scale": float(scaler["cur_scale"]), "cur_hysteresis": int(scaler.get("cur_hysteresis", 1)),
                "cur_iter": int(scaler.get("cur_iter", 0)), "last_overflow_iter": int(scaler.get("last_overflow_iter", -1))}
    return {"type": "static", "scale": float(scaler["cur_scale"])}


# ---------------------------------------------------------------------------- writing


def _optimizer_section(groups: list[ImportedGroup], module: dict[str, torch.Tensor], cls: str,
                       sink: dict[str, torch.Tensor]) -> tuple[dict[str, Any], list[TensorEntry]]:
    """meta.json's ``optimizer`` and the rank file's tensors: every parameter one shard, whole
    (what partita's snapshot writes for a one-rank, stage-0 save)."""
    rank_file = fmt.rank_file(0)
    rank_entries: list[TensorEntry] = []
    groups_meta, params_meta = [], {}
    for g, group in enumerate(groups):
        for name, shape in zip(group.names, group.shapes):
            rank_entries.append(TensorEntry.of(fmt.master_key(name), group.masters[name].reshape(-1).contiguous()))
            for key in group.state:
                rank_entries.append(TensorEntry.of(fmt.state_key(key, name), group.state[key][name].contiguous()))
            numel = group.masters[name].numel()
            params_meta[name] = {"group": g, "shape": list(shape), "numel": numel,
                                 "dtype": str(module[name].dtype).replace("torch.", ""),
                                 "shards": [{"file": rank_file, "start": 0, "end": numel}]}
        groups_meta.append({
            "params": list(group.names),
            "source": g,
            "hyperparameters": encode(group.hyperparameters, path=f"optimizer/group{g}/hyperparameters", sink=sink),
            "partition_state": sorted(group.state),
            "block_state": [],
            "block_size": None,
            "state_dtypes": {k: "float32" for k in group.state},
            "scalar_state": encode(group.scalars, path=f"optimizer/group{g}/state", sink=sink),
            "local_state": [],
            "num_shards": 1,
        })
    section = {"class": cls, "master_dtype": "float32", "groups": groups_meta, "params": params_meta}
    return section, rank_entries


def _plan(model_states: dict[str, Any], config: dict[str, Any], groups: list[ImportedGroup], module: dict[str, torch.Tensor],
          cls: str, *, tag: str, stage: int, world: int, source: Path, optim0: dict[str, Any] | None):
    """meta.json and the tensors of each file, as partita's snapshot lays them out for a one-rank save."""
    sink: dict[str, torch.Tensor] = {}
    shared = model_states.get("shared_params") or {}
    aliases = {alias: src for alias, src in shared.items() if alias in module and src in module}
    stored = {k: v for k, v in module.items() if k not in aliases and torch.is_tensor(v)}
    optimizer, rank_entries = _optimizer_section(groups, module, cls, sink)
    client_state = {k: v for k, v in model_states.items() if k not in _ENGINE_KEYS}
    counters = {"global_steps": int(model_states.get("global_steps", 0)),
                "global_samples": int(model_states.get("global_samples", 0)),
                "skipped_steps": int(model_states.get("skipped_steps", 0))}
    # 0, as DeepSpeed's own resume (it never restores its micro-step counter): the engine finds
    # accumulation boundaries by micro_steps % accumulation, so steps x DeepSpeed's accumulation
    # would misplace them in a run resumed with another accumulation (same global batch, other
    # world size).
    counters["micro_steps"] = 0
    trained = next(iter(optimizer["params"]), None)
    precision = str(module[trained].dtype if trained else torch.float32).replace("torch.", "")
    scheduler = model_states.get("lr_scheduler")
    meta = {
        **fmt.meta_header(tag),
        "world_size": 1,
        "data_parallel_size": 1,
        "tensor_parallel_size": 1,
        "zero_stage": 0,
        "precision": precision,
        "counters": counters,
        "config": {},
        "model": {
            "file": fmt.MODEL_FILE,
            "keys": list(module.keys()),
            "aliases": aliases,
            "extra_state": {},
            "sharded_keys": [],
            "frozen_shards": {},
            "tensors": {k: {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)} for k, v in stored.items()},
        },
        "optimizer": optimizer,
        "loss_scaler": _loss_scaler(optim0, config),
        "lr_scheduler": None if scheduler is None else encode(_scheduler_state(scheduler, config), path="lr_scheduler", sink=sink),
        "sampler": None,
        "client_state": _encode_client_state(client_state, sink),
        "rank_files": [fmt.rank_file(0)],
        "state_file": fmt.STATE_FILE,
        "imported_from": {
            "deepspeed_version": model_states.get("ds_version"),
            "path": str(source),
            "zero_stage": stage,
            "data_parallel_size": world,
            "config": _plain(config),
            "not_imported": sorted(k for k in ("data_sampler", "random_ltd") if model_states.get(k) is not None),
        },
    }
    return meta, [TensorEntry.of(k, v.contiguous()) for k, v in stored.items()], sink, rank_entries


def _encode_client_state(client_state: dict[str, Any], sink: dict[str, torch.Tensor]) -> Any:
    try:
        return encode(client_state, path="client_state", sink=sink)
    except CheckpointError as error:
        raise DeepSpeedImportError(
            f"the DeepSpeed checkpoint's client_state cannot be stored in a partita checkpoint: {error}. Keep "
            "client_state to plain data (numbers, strings, lists, dicts, tensors)"
        ) from None


def _plain(value: Any) -> Any:
    """DeepSpeed's config as JSON, for the record (anything else as its repr)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _write(out_dir: Path, tag: str, meta: dict[str, Any], model_entries: list[TensorEntry], sink: dict[str, torch.Tensor],
           rank_entries: list[TensorEntry]) -> Path:
    """Write the files into ``<tag>.partial``, then commit (manifest, rename, ``latest``) as a save does."""
    partial = out_dir / (tag + fmt.PARTIAL_SUFFIX)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        written = {
            fmt.MODEL_FILE: write_safetensors(partial / fmt.MODEL_FILE, model_entries),
            fmt.STATE_FILE: write_safetensors(partial / fmt.STATE_FILE, [TensorEntry.of(k, v.contiguous()) for k, v in sink.items()]),
            fmt.rank_file(0): write_safetensors(partial / fmt.rank_file(0), rank_entries),
            fmt.META_FILE: write_json(partial / fmt.META_FILE, meta),
        }
        summary = {"global_steps": meta["counters"]["global_steps"], "global_samples": meta["counters"]["global_samples"],
                   "world_size": 1, "pipeline_parallel_size": 1, "zero_stage": 0, "precision": meta["precision"]}
        final = commit_tag(out_dir, tag, written, summary)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    write_latest(out_dir, tag)
    return final
