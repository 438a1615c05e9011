"""Export whole weights from a running engine, one parameter at a time.

``save_16bit_model`` writes the model's weights in its compute dtype as one file, in the
format its name says (``.safetensors``, or torch's for ``.bin``/``.pt``/``.pth``; rank 0
writes, every rank takes part in the gathers). ``fp32_state_dict`` rebuilds
full fp32 weights from the optimizer's master shards. Both gather parameter by parameter, so
no rank holds more than one extra whole parameter on the device at a time.

Under tensor parallelism both return *whole* tensors under the model's own keys: a tensor
shard is first rebuilt from the ZeRO shards of its tensor rank, then gathered across the
tensor group (``gather_whole``); every rank takes part in both gathers.

Under expert parallelism (an MoE layer with ``ep_size > 1``) each rank holds only its own
experts; both exports gather every expert rank's copy of each local expert slot over the expert
group (:func:`partita.moe.registry.gather_expert_copies`) and return every expert under its
global name, ``...deepspeed_experts.<global index>.<name>``, in the order of the same model
built at ``ep_size`` 1: the keys and values ``model.state_dict()`` has in one process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from partita.moe.registry import expert_export_order, gather_expert_copies, global_expert_names
from partita.tensor_parallel.layers import gather_whole, tensor_shard_of
from partita.zero.api import ZeroState
from partita.zero.gathered import iter_fp32_master, iter_full_parameters


def _split_of(param: torch.Tensor):
    """How ``param`` is split over ranks holding different parts of it: a tensor-parallel shard, or
    an expert-parallel MoE parameter (this rank's experts, a dim-0 split over the expert group)."""
    from partita.moe.registry import expert_shard_of

    return tensor_shard_of(param) or expert_shard_of(param)


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def fp32_state_dict(module: nn.Module, zero: ZeroState, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Full fp32 weights keyed like ``module.state_dict()`` (tied weights under every name),
    as CPU tensors; empty on ranks other than 0 when ``rank0_only``."""
    keep = _is_writer() or not rank0_only
    first_name = {p: n for n, p in module.named_parameters()}
    # param -> its whole fp32 value: one tensor, or every expert rank's copy (expert parallelism)
    master: dict[nn.Parameter, list[torch.Tensor]] = {}
    trained: set[nn.Parameter] = set()
    for param, full in iter_fp32_master(zero):
        trained.add(param)
        shard = _split_of(param)
        if shard is not None:
            full = gather_whole(full.contiguous(), shard).contiguous()
        copies = gather_expert_copies(first_name[param], param, full)  # every rank of the expert group calls
        if keep:
            master[param] = [t.detach().to("cpu", copy=True) for _, t in copies]
    # Parameters without a master (frozen): their own values, gathered one at a time where ZeRO-3
    # holds them as shards (every rank takes part).
    untrained = [(n, p) for n, p in module.named_parameters() if p not in trained]
    by_name = dict(untrained)
    for name, full in iter_full_parameters(zero, untrained):
        copies = gather_expert_copies(name, by_name[name], full.float())
        if keep:
            master[by_name[name]] = [t.to("cpu", copy=True) for _, t in copies]
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers())
    for name, tensor in named:
        if isinstance(tensor, nn.Parameter) and tensor in master:
            # Every name of the parameter (tied aliases too) with each expert rank's copy.
            out.update(zip(global_expert_names(name, tensor), master[tensor]))
        else:
            out[name] = tensor.detach().cpu()
    return {name: out[name] for name in expert_export_order(named)}


def state_dict_entries(module: nn.Module, *, exclude_frozen_parameters: bool = False
                       ) -> tuple[dict[str, torch.Tensor], list[tuple[str, torch.Tensor]], dict[int, str]]:
    """What a 16-bit export holds: ``module.state_dict(keep_vars=True)`` (every key: tied weights under
    each name, persistent buffers), its unique tensors under their first keys, and tensor identity ->
    that first key (shared with partita/zero/weight_stream.py)."""
    entries = module.state_dict(keep_vars=True)
    if exclude_frozen_parameters:
        entries = {k: v for k, v in entries.items() if not (isinstance(v, nn.Parameter) and not v.requires_grad)}
    first_name: dict[int, str] = {}
    unique = []
    for name, tensor in entries.items():
        if id(tensor) not in first_name:
            first_name[id(tensor)] = name
            unique.append((name, tensor))
    return entries, unique, first_name


def whole_copies(name: str, tensor: torch.Tensor, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``[(export name, whole tensor)]`` of ``tensor`` (model name ``name``) from this rank's ZeRO-whole
    value ``full``: a tensor-parallel shard gathered over its tensor group, an expert-parallel expert as
    every expert rank's copy under its global name (collectives: every rank calls it for the same
    tensor); anything else ``[(name, full)]`` itself."""
    shard = _split_of(tensor)
    if shard is not None:
        full = gather_whole(full.contiguous(), shard).contiguous()
    return gather_expert_copies(name, tensor, full)


def consolidated_16bit_state_dict(
    module: nn.Module, zero: ZeroState, *, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor]:
    """The whole ``module.state_dict()`` in the model's dtype as CPU tensors on rank 0 (every
    key; a tied weight is one tensor under each of its names), ``{}`` on other ranks. Every
    rank must call it: parameters are gathered one at a time (DeepSpeed's
    ``_zero3_consolidated_16bit_state_dict``; the Hugging Face Trainer saves it with
    ``save_pretrained``)."""
    entries, unique, first_name = state_dict_entries(module, exclude_frozen_parameters=exclude_frozen_parameters)
    writer = _is_writer()
    saved: dict[str, list[torch.Tensor]] = {}
    # One parameter gathered at a time (buffers and stage 0-2 parameters need no gather).
    for name, full in iter_full_parameters(zero, unique):
        copies = whole_copies(name, entries[name], full)  # while the ZeRO-3 gather still holds it
        if writer:
            saved[name] = [t.to("cpu", copy=True).contiguous() for _, t in copies]
    if not writer:
        return {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in entries.items():
        out.update(zip(global_expert_names(name, tensor), saved[first_name[id(tensor)]]))
    return {name: out[name] for name in expert_export_order(list(entries.items()))}


def _drop_aliases(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep each tensor under its first name; return the rest as ``{dropped name: kept name}``."""
    kept: dict[int, str] = {}
    stored, aliases = {}, {}
    for name, tensor in state.items():
        if id(tensor) in kept:
            aliases[name] = kept[id(tensor)]
        else:
            kept[id(tensor)] = name
            stored[name] = tensor
    return stored, aliases


# The file name says the format: torch's own (a tensors-only dict, readable with
# torch.load(..., weights_only=True), as DeepSpeed's default pytorch_model.bin) or safetensors.
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
SAFETENSORS_SUFFIX = ".safetensors"


def save_16bit_model(
    module: nn.Module,
    zero: ZeroState,
    save_dir: str | os.PathLike,
    save_filename: str,
    *,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Write the weights in the model's dtype to ``save_dir/save_filename`` (rank 0 writes; every
    rank must call, since every rank takes part in the gathers).

    Keys are ``module.state_dict()``'s (parameters and persistent buffers). A ``.bin``/``.pt``/
    ``.pth`` name gets ``torch.save`` of that dict with *every* key, tied weights included under
    each of their names and sharing one tensor (written once, as DeepSpeed does); a
    ``.safetensors`` name gets safetensors, which refuses two names for one storage, so a tied
    weight is stored once under its first name (Hugging Face's convention: ``from_pretrained``
    and ``tie_weights`` restore the alias) and the header's metadata ``"partita_tied"`` maps
    each dropped name to the stored one. ``exclude_frozen_parameters`` (DeepSpeed's option)
    leaves out parameters with ``requires_grad=False``.
    """
    path = Path(save_dir) / save_filename
    suffix = path.suffix.lower()
    if suffix not in TORCH_SUFFIXES + (SAFETENSORS_SUFFIX,):
        raise ValueError(
            f"save_16bit_model: cannot tell the format from the file name {save_filename!r}; end it in "
            f"{SAFETENSORS_SUFFIX} (safetensors) or one of {', '.join(TORCH_SUFFIXES)} (torch.save, tensors only)"
        )
    state = consolidated_16bit_state_dict(module, zero, exclude_frozen_parameters=exclude_frozen_parameters)
    if _is_writer():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        if suffix == SAFETENSORS_SUFFIX:
            from safetensors.torch import save_file

            stored, aliases = _drop_aliases(state)
            metadata = {"format": "pt", "producer": "partita", "partita_tied": json.dumps(aliases)}
            save_file(stored, str(tmp), metadata=metadata)
        else:
            torch.save(state, tmp)
        os.replace(tmp, path)  # a crash mid-write never leaves a truncated file under the real name
    if dist.is_initialized():
        dist.barrier()
    return path
