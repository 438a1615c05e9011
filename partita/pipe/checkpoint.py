"""Checkpoints of a pipeline engine, keyed by layer: saved with p stages, loaded with any q.

[Note: layer-keyed pipeline checkpoints]
The keys are the PipelineModule's own state_dict names: ``"<i>.<name>"`` for layer ``i`` of the
layer list (its *global* index, which no stage count changes) and ``"tied_modules.<key>.<name>"``
for a TiedLayerSpec key's shared module. That is DeepSpeed's ``layer_XX-model_states`` keying
(layer index plus the layer's own keys) written into partita's one checkpoint format (format v2,
:mod:`partita.checkpoint.format`) instead of a second one: the fp32 master weights and optimizer
moments are stored per parameter under the same names (``master/3.linear.weight``,
``state/exp_avg/3.linear.weight``) as element ranges of the rank that owned them, and a loading
rank reads the ranges it owns now (:mod:`partita.checkpoint.reshard`). So the stage count, the
data-parallel size and the ZeRO stage may all change between save and load, and the loaded
masters and moments are the saved ones, bit for bit.

Save (every rank): its rank file (generator states and its shards) as for any engine; the first
rank of each stage builds its stage's model file (``model-stage<s>.safetensors``) and its
sections of meta.json (model keys, parameter table, optimizer groups) from its own layers, and
rank 0 merges the stages' sections into one meta.json (:func:`capture`). A tied module lives on
every stage that uses its key, with the same weights and moments (its gradient is summed over
them and each steps identically): only its first owner stage writes it, so it is stored once.

Load (every rank): the union over the stages of this run's layer keys must be the checkpoint's
(:func:`check_layout`: an error names the missing and extra layers), then each stage reads its
own layers' weights, masters and moments by name; a tied module's owners all read the one copy.

``partita checkpoint consolidate`` writes the keys of ``nn.Sequential(*layers)``
(:mod:`partita.checkpoint.pipeline_layout` has the mapping).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from partita.checkpoint import format as fmt
from partita.checkpoint.errors import CheckpointError, CheckpointMismatchError
from partita.checkpoint.pipeline_layout import layer_position
from partita.checkpoint.safetensors_io import TensorEntry
from partita.checkpoint.snapshot import (
    FilePlan,
    Snapshot,
    _trainable_tensor_shards,
    param_names,
    rank_file_plan,
    shared_plan,
    split_of,
)
from partita.checkpoint.tensor_layout import full_shape_of
from partita.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

if TYPE_CHECKING:
    from partita.pipe.engine import PipelineEngine

__all__ = ["capture", "check_layout", "layout_of", "load_checkpoint", "save_checkpoint"]


# ---------------------------------------------------------------------------- entry points


def save_checkpoint(engine: PipelineEngine, save_dir: Any, *, tag: str | None, client_state: dict | None,
                    save_latest: bool, async_save: bool | None) -> bool:
    """:meth:`PipelineEngine.save_checkpoint`: the plain save (handshake, files, manifest,
    ``latest``) with the pipeline's capture."""
    from partita.checkpoint.save import save_checkpoint as save

    engine.finish_pending_step()
    return save(engine, save_dir, tag=tag, client_state=client_state, save_latest=save_latest, async_save=async_save,
                capture_fn=capture)


def load_checkpoint(engine: PipelineEngine, load_dir: Any, *, tag: str | None, load_module_strict: bool,
                    load_optimizer_states: bool, load_lr_scheduler_states: bool,
                    load_module_only: bool) -> tuple[str | None, dict | None]:
    """:meth:`PipelineEngine.load_checkpoint`: the plain load (tag choice, verification, per-range
    reads) with the layer check over every stage; then what ``Engine.load_checkpoint`` does after it."""
    from partita.checkpoint.load import load_checkpoint as load
    from partita.config.batch import check_resumed_batch

    engine.finish_pending_step()
    path, client_state = load(
        engine, load_dir, tag=tag, load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only, check_layout=check_layout,
    )
    if path is not None:
        engine.loaded_checkpoint = (path, client_state)
        if not load_module_only:
            check_resumed_batch(engine, path)  # another data size: realign accumulation, warn if the batch changed
    return path, client_state


# ---------------------------------------------------------------------------- save


def layout_of(module: PipelineModule) -> dict[str, Any]:
    """meta.json's ``pipeline`` section (:mod:`partita.checkpoint.pipeline_layout`)."""
    layers = []
    for spec in module._layer_specs:
        if isinstance(spec, TiedLayerSpec):
            layers.append({"type": spec.typename.__name__, "tie": spec.key, "module": spec.forward_fn is None})
        elif isinstance(spec, LayerSpec):
            layers.append({"type": spec.typename.__name__, "tie": None, "module": True})
        else:
            layers.append({"type": type(spec).__name__ if isinstance(spec, torch.nn.Module) else getattr(spec, "__name__", None),
                           "tie": None, "module": isinstance(spec, torch.nn.Module)})
    return {"num_layers": len(layers), "num_stages": module.num_stages, "virtual_stages": module.virtual_stages,
            "parts": list(module.parts), "layers": layers}


def _stored_elsewhere(module: PipelineModule) -> tuple[str, ...]:
    """Key prefixes of the tied modules this stage holds but another (their first owner) stores."""
    return tuple(f"tied_modules.{t.key}." for t in module.tied_groups() if module.stage_id != t.owner_stages[0])


def _param_of_entry(key: str) -> str | None:
    """The parameter a rank-file entry belongs to (``master/``, ``state/<kind>/``, ``master_padding/``)."""
    if key.startswith(("master/", "master_padding/", "state/")):
        return key.rsplit("/", 1)[1]  # parameter names hold dots, never slashes
    return None


def _is_stage_leader(engine: PipelineEngine) -> bool:
    """The first rank of this stage (data, sequence and tensor coordinates 0) writes its shared part."""
    return engine.topology.zero_rank == 0 and engine.topology.tensor_rank == 0


def capture(engine: PipelineEngine, *, tag: str, client_state: dict[str, Any], copy: bool) -> Snapshot:
    """This rank's files; rank 0's also meta.json over every stage. Collective over the world."""
    engine.optimizer.materialize_states()  # NVMe offload: states into memory for the capture (no-op otherwise)
    try:
        return _capture(engine, tag=tag, client_state=client_state, copy=copy)
    finally:
        engine.optimizer.release_states()


def _capture(engine: PipelineEngine, *, tag: str, client_state: dict[str, Any], copy: bool) -> Snapshot:
    module: PipelineModule = engine.module
    rank = dist.get_rank()
    snapshot, fragment, error = Snapshot(), None, None
    state_plan = meta = None
    try:
        names = param_names(module)
        tensor_sharded = _trainable_tensor_shards(engine, names)
        elsewhere = _stored_elsewhere(module)
        mine = lambda name: not name.startswith(elsewhere)  # noqa: E731
        plan = rank_file_plan(engine, names, copy=copy)
        plan.entries[:] = [e for e in plan.entries if (p := _param_of_entry(e.name)) is None or mine(p)]
        snapshot.files.append(plan)
        if _is_stage_leader(engine):
            model_plan, state_plan, meta = shared_plan(engine, names, tensor_sharded, tag=tag, client_state=client_state,
                                                       copy=copy, model_file=fmt.stage_model_file(module.stage_id))
            model_plan.entries[:] = [e for e in model_plan.entries if mine(e.name)]
            snapshot.files.append(model_plan)
            fragment = _fragment(module.stage_id, meta, state_plan, mine)
    except Exception as exc:  # noqa: BLE001 - every rank learns of it below, instead of waiting in the gather
        error = f"{type(exc).__name__}: {exc}"
    inner = engine.optimizer.inner
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (error, f"{type(inner).__module__}.{type(inner).__qualname__}"))
    failed = [(r, e) for r, (e, _) in enumerate(reports) if e is not None]
    if failed:
        raise CheckpointError("save_checkpoint of the pipeline failed: " + "; ".join(f"rank {r}: {e}" for r, e in failed))
    classes = {c for _, c in reports}
    if len(classes) > 1:  # one optimizer table over all stages: refused on every rank alike
        raise CheckpointError(f"the pipeline's stages use different optimizers ({', '.join(sorted(classes))}); every "
                              "stage must use the same one for a checkpoint")
    fragments: list[Any] = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(fragment if rank != 0 else None, fragments, dst=0)
    if rank != 0:
        return snapshot
    others = [f for f in fragments if f is not None]
    meta["model"], meta["optimizer"], extra_tensors = _merge(fragment, others, layout_of(module))
    state_plan.entries.extend(TensorEntry.of(k, v) for k, v in extra_tensors.items())
    meta["pipeline_parallel_size"] = module.num_stages
    meta["pipeline"] = layout_of(module)
    snapshot.files.append(state_plan)
    snapshot.meta = meta
    return snapshot


def _fragment(stage: int, meta: dict[str, Any], state_plan: FilePlan, mine) -> dict[str, Any]:
    """A stage's model and optimizer sections of meta.json, without the tied modules it does not
    store, and the state-file tensors they refer to (on the CPU, to travel to rank 0)."""
    model = dict(meta["model"])
    model["keys"] = [k for k in model["keys"] if mine(k)]
    model["aliases"] = {a: s for a, s in model["aliases"].items() if mine(a)}
    model["extra_state"] = {k: v for k, v in model["extra_state"].items() if mine(k)}
    model["sharded_keys"] = [k for k in model["sharded_keys"] if mine(k)]
    model["tensors"] = {k: v for k, v in model["tensors"].items() if mine(k)}
    optimizer = dict(meta["optimizer"])
    optimizer["params"] = {k: v for k, v in optimizer["params"].items() if mine(k)}
    optimizer["groups"] = [{**g, "params": [p for p in g["params"] if mine(p)]} for g in optimizer["groups"]]
    wanted = _tensor_refs(model) | _tensor_refs(optimizer)
    tensors = {}
    for entry in state_plan.entries:
        if entry.name in wanted:
            tensors[entry.name] = entry.tensor().detach().to("cpu", copy=True)
    return {"stage": stage, "model": model, "optimizer": optimizer, "tensors": tensors}


def _tensor_refs(value: Any) -> set[str]:
    if isinstance(value, dict):
        if len(value) == 1 and "__tensor__" in value:
            return {value["__tensor__"]}
        return set().union(*(_tensor_refs(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(_tensor_refs(v) for v in value)) if value else set()
    return set()


def _renamed_refs(value: Any, prefix: str) -> Any:
    """``value`` with every state-file reference prefixed (stages' keys would collide: each has
    an ``optimizer/group0/...``)."""
    if isinstance(value, dict):
        if len(value) == 1 and "__tensor__" in value:
            return {"__tensor__": prefix + value["__tensor__"]}
        return {k: _renamed_refs(v, prefix) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed_refs(v, prefix) for v in value]
    return value


def _merge(own: dict[str, Any], others: list[dict[str, Any]], layout: dict[str, Any]):
    """One model and one optimizer section over every stage (rank 0's stage first): groups
    numbered stage after stage, every stored model key mapped to its stage's model file."""
    fragments = sorted([own, *(f for f in others if f["stage"] != own["stage"])], key=lambda f: f["stage"])
    model = {"file": own["model"]["file"], "files": {}, "keys": [], "aliases": {}, "extra_state": {},
             "sharded_keys": [], "tensors": {}}
    optimizer = {"class": own["optimizer"]["class"], "master_dtype": own["optimizer"]["master_dtype"],
                 "groups": [], "params": {}}
    tensors: dict[str, torch.Tensor] = {}
    seen: set[str] = set()  # keys every stage holds alike (a loss_fn module's buffers) are listed once
    for fragment in fragments:
        prefix = "" if fragment is own else f"pipe{fragment['stage']}/"
        part_model = _renamed_refs(fragment["model"], prefix)
        part_optimizer = _renamed_refs(fragment["optimizer"], prefix)
        if fragment is not own:
            tensors.update({prefix + k: v for k, v in fragment["tensors"].items()})
        offset = len(optimizer["groups"])
        optimizer["groups"] += part_optimizer["groups"]
        for name, record in part_optimizer["params"].items():
            optimizer["params"][name] = {**record, "group": record["group"] + offset}
        for key in part_model["keys"]:
            if key not in seen:
                seen.add(key)
                model["keys"].append(key)
        model["aliases"].update(part_model["aliases"])
        model["extra_state"].update(part_model["extra_state"])
        model["sharded_keys"] += part_model["sharded_keys"]
        model["tensors"].update(part_model["tensors"])
        model["files"].update({k: part_model["file"] for k in part_model["tensors"]})
    model["keys"].sort(key=lambda k: layer_position(k, layout))  # as the layers run (sort is stable)
    model["sharded_keys"] = sorted(set(model["sharded_keys"]))
    return model, optimizer, tensors


# ---------------------------------------------------------------------------- load


def _by_layer(keys: list[str], layout: dict[str, Any] | None) -> str:
    """Keys grouped by layer for an error message: ``layer 7 (7.linear.weight, 7.linear.bias)``."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        head, _, rest = key.partition(".")
        if head.isdigit():
            label = f"layer {head}"
        elif head == "tied_modules":
            label = f"tied layer {rest.partition('.')[0]!r}"
        else:
            label = head
        groups.setdefault(label, []).append(key)
    shown = [f"{label} ({', '.join(ks[:4])}{', ...' if len(ks) > 4 else ''})" for label, ks in list(groups.items())[:8]]
    more = f" and {len(groups) - 8} more" if len(groups) > 8 else ""
    return "; ".join(shown) + more


def check_layout(engine: PipelineEngine, meta: dict[str, Any], strict: bool, *, parameters: bool = True) -> None:
    """Compare the union of every stage's keys (``strict``) and trainable parameters
    (``parameters``; a weights-only load may train others) with the checkpoint's.

    Collective over the world; every rank raises the same error, naming the layers that differ.
    """
    module: PipelineModule = engine.module
    names = param_names(module)
    mine = {
        "keys": list(module.state_dict().keys()),
        "params": {names[p]: list(full_shape_of(p, split_of(p))) for group in engine.optimizer.groups for p in group.params},
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    keys = {k for g in gathered for k in g["keys"]}
    params = {n: s for g in gathered for n, s in g["params"].items()}
    saved_keys = set(meta["model"]["keys"])
    saved_params = meta["optimizer"]["params"]
    layout = meta.get("pipeline")
    what = (f"the checkpoint ({layout['num_layers']} layers, saved with {layout['num_stages']} stages)" if layout
            else "the checkpoint (not saved by a pipeline engine: its keys are not layer keys)")
    order = lambda ks: sorted(ks, key=lambda k: (layer_position(k, layout) if layout else 0, k))  # noqa: E731
    # Trainable parameters must match in any case (their masters and moments are per parameter);
    # the other keys (buffers, frozen weights) only under load_module_strict, as for any engine.
    missing_params = {n for n in params if n not in saved_params} if parameters else set()
    extra_params = {n for n in saved_params if n not in params} if parameters else set()
    missing = order(missing_params | (keys - saved_keys if strict else set()))
    extra = order(extra_params | (saved_keys - keys if strict else set()))
    problems = []
    if missing:
        problems.append("in this model but not in the checkpoint: " + _by_layer(missing, layout))
    if extra:
        problems.append("in the checkpoint but not in this model: " + _by_layer(extra, layout))
    if problems:
        raise CheckpointMismatchError(
            f"the layers of {what} do not match this PipelineModule ({len(module._layer_specs)} layers): "
            + "; ".join(problems) + ". Build the PipelineModule from the layer list it was saved with"
            + ("" if missing_params or extra_params else
               " (or pass load_module_strict=False to skip keys that are not trainable parameters)")
        )
    for name, shape in params.items() if parameters else ():
        if list(saved_params[name]["shape"]) != shape:
            raise CheckpointMismatchError(
                f"parameter '{name}' has shape {saved_params[name]['shape']} in the checkpoint and {shape} in this "
                "PipelineModule"
            )
