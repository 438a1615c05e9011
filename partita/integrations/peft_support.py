"""LoRA and other PEFT adapters on a partita engine at every ZeRO stage: build, save, merge.

What partita already does for a PEFT model (nothing here is needed for it): ``initialize`` puts
only the parameters that need gradients under ZeRO, so only the adapters (and
``modules_to_save`` copies) get fp32 masters and optimizer state; at ZeRO-3 a base built under
``partita.zero.Init`` stays sharded in the model's dtype (partita/zero/frozen_params.py), one
built whole stays whole on every rank.

What this module adds, and why:

- :func:`get_peft_model`: ``peft.get_peft_model`` for a model built under ``zero.Init``. peft
  gathers ZeRO-3 weights only when transformers says ZeRO-3 is on (DoRA reads each base weight),
  and ``modules_to_save`` copies the wrapped module with ``copy.deepcopy``, for which peft
  gathers DeepSpeed's parameters (it tests ``ds_numel``) but not partita's, whose freed
  parameters refuse to be copied. Both are arranged around peft's call.
- :func:`save_adapters`: PEFT's own files (``adapter_config.json`` and
  ``adapter_model.safetensors``) with whole tensors, written by rank 0 at every stage. Under
  ZeRO-3 ``model.state_dict()`` holds placeholders for the sharded adapters (partita's
  state_dict guard; DeepSpeed gives 0-element tensors there, which peft then saves as empty
  adapters). This gathers only what peft saves, one tensor at a time, and hands it to peft's
  ``save_pretrained(state_dict=...)``. :func:`gathered_adapters` is the same gather as a block,
  for code that calls peft's ``save_pretrained`` itself; with :func:`whole_adapters_threshold` as
  the persistence threshold the adapters are never sharded, and peft's bare ``save_pretrained``
  on rank 0 is whole too.
- :func:`merged_state_dict` / :func:`save_merged_model`: what ``merge_and_unload()`` of the
  unsharded model would give, on rank 0, without changing the engine's model: each adapted layer
  is gathered alone, merged by peft's own ``merge``, read, and put back exactly as it was.
  :func:`iter_merged_parameters` hands the same merged parameters out one at a time on every rank
  (the weight sync to a generator that knows only the base model: vLLM).
- :func:`check_quantized_base`: refuses a bitsandbytes-quantized (QLoRA) base on a device
  bitsandbytes has no 4-bit kernels for (where it has them, QLoRA trains at every stage; at
  ZeRO-3 the 4-bit base stays whole on every rank, see docs/guides/lora-peft.md).

Every function that gathers is collective: every rank calls it, in the same order.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from partita.config.base import ConfigError
from partita.integrations.hf_gathered import GatheredParameters, is_engine_managed
from partita.zero.init_context import init_shard_of

__all__ = ["adapter_state_dict", "check_quantized_base", "gathered_adapters", "get_peft_model",
           "iter_merged_parameters", "merged_state_dict", "save_adapters", "save_merged_model",
           "whole_adapters_threshold"]

# LoRA initialisations that leave the base weights alone (the others rewrite them, assigning .data).
_DEFAULT_INITS = (True, False, "gaussian")


def _writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _peft_model_of(model_or_engine: Any, who: str) -> tuple[Any, Any]:
    """``(peft model, engine or None)``: an engine's module, or the model itself."""
    from peft import PeftModel

    engine = None
    model = model_or_engine
    if not isinstance(model_or_engine, nn.Module) and hasattr(model_or_engine, "module"):
        engine, model = model_or_engine, model_or_engine.module
    if not isinstance(model, PeftModel):
        raise TypeError(
            f"{who} needs a peft.PeftModel (or the partita engine training one), got {type(model).__name__}; build it "
            "with partita.integrations.peft_support.get_peft_model(model, LoraConfig(...)) before partita.initialize"
        )
    return model, engine


def _settle(engine: Any) -> None:
    """An engine whose last step may still be in flight (delayed or overlapped updates) lands it
    first, so the parameters read are the stepped ones."""
    if engine is not None and hasattr(engine, "finish_pending_step"):
        engine.finish_pending_step()


# ------------------------------------------------------------------------------ building
def get_peft_model(model: nn.Module, peft_config: Any, adapter_name: str = "default", **kwargs: Any) -> Any:
    """``peft.get_peft_model(model, peft_config, adapter_name, **kwargs)``, also for a model built
    under ``partita.zero.Init`` (call it on every rank, before ``partita.initialize``).

    For such a base two things are added around peft's call. peft's own ZeRO-3 gathers
    (``gather_params_ctx``: DoRA reads each base weight's norm) run on partita: transformers'
    ZeRO-3 hook (:func:`partita.integrations.hf_zero3.enable_zero3`) is on for the call unless one
    is on already, so each base layer is gathered alone while peft reads it. And the modules named
    in ``peft_config.modules_to_save`` are gathered whole while peft copies them (one extra whole
    copy of each, as peft keeps anyway). The adapters peft creates are ordinary whole parameters
    that ``initialize`` then shards. A model an engine already trains is refused: its optimizer and
    ZeRO-3 units were built without the adapters.

    Raises:
        ConfigError: the model is already under an engine, or an ``init_lora_weights`` that rewrites
            the base weights (PiSSA, OLoRA, EVA, LoftQ, CorDA) meets a base sharded by zero.Init,
            or a quantized base on a device bitsandbytes cannot run (:func:`check_quantized_base`).
    """
    import peft

    from partita.integrations.hf_zero3 import active_config, enable_zero3

    if any(is_engine_managed(p) for p in model.parameters()):
        raise ConfigError(
            "get_peft_model: a partita engine already trains this model, and its optimizer state and ZeRO-3 units "
            "were built without the adapters; apply PEFT first, then call partita.initialize on the PeftModel"
        )
    check_quantized_base(model)  # QLoRA on a device bitsandbytes cannot run: refused before any work
    sharded = any(init_shard_of(p) is not None for p in model.parameters())
    init = getattr(peft_config, "init_lora_weights", True)
    if sharded and init not in _DEFAULT_INITS:
        raise ConfigError(
            f"get_peft_model: init_lora_weights={init!r} rewrites the base weights while it builds the adapters, and "
            "this base was built under partita.zero.Init (each rank holds a shard); build the base without zero.Init "
            "for this initialisation, or use init_lora_weights=True (the default) or 'gaussian'"
        )
    targets = _modules_to_save_params(model, getattr(peft_config, "modules_to_save", None)) if sharded else []
    hook = enable_zero3(_HOOK_CONFIG) if sharded and active_config() is None else contextlib.nullcontext()
    # Read-only gather: the originals are not changed, the copies are new parameters.
    with hook, GatheredParameters(targets):
        return peft.get_peft_model(model, peft_config, adapter_name=adapter_name, **kwargs)


# What transformers' ZeRO-3 hook needs to say "ZeRO-3 is on" while peft builds the adapters.
_HOOK_CONFIG = {"zero_optimization": {"stage": 3}}


def _modules_to_save_params(model: nn.Module, names: Any) -> list[nn.Parameter]:
    """The parameters of the modules ``modules_to_save`` names (peft's match: the module's name is
    the entry or ends with ``.<entry>``)."""
    if not names:
        return []
    names = [names] if isinstance(names, str) else list(names)
    out: dict[int, nn.Parameter] = {}
    for key, module in model.named_modules():
        if any(key == n or key.endswith("." + n) for n in names):
            for p in module.parameters():
                out.setdefault(id(p), p)
    return list(out.values())


# ------------------------------------------------------------------------------ saving adapters
def _adapter_entries(model: Any, adapter_names: list[str], save_embedding_layers: Any) -> dict[str, torch.Tensor]:
    """``{model.state_dict() key: live tensor}`` of everything peft saves for ``adapter_names``
    (peft's own selection, run on the live tensors, so nothing is read or copied)."""
    from peft import get_peft_model_state_dict

    live = model.state_dict(keep_vars=True)  # the parameters themselves: no placeholders, no values read
    chosen: set[int] = set()
    for name in adapter_names:
        selected = get_peft_model_state_dict(model, state_dict=live, adapter_name=name,
                                             save_embedding_layers=save_embedding_layers)
        chosen.update(id(t) for t in selected.values())
    return {key: t for key, t in live.items() if id(t) in chosen}


def _gather_to_cpu(entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor whole, copied to the CPU on rank 0 (``{}`` elsewhere): one gathered at a time, so
    no rank holds more than one extra whole tensor on the device."""
    out: dict[str, torch.Tensor] = {}
    copied: dict[int, torch.Tensor] = {}
    writer = _writer()
    for key, tensor in entries.items():
        if id(tensor) not in copied:
            with GatheredParameters([tensor]):
                copied[id(tensor)] = tensor.detach().to("cpu", copy=True).contiguous() if writer else None
        if writer:
            out[key] = copied[id(tensor)]
    return out


def adapter_state_dict(model_or_engine: Any, adapter_name: str = "default", *,
                       save_embedding_layers: Any = "auto") -> dict[str, torch.Tensor]:
    """What ``peft.get_peft_model_state_dict(model, adapter_name=...)`` gives for the unsharded
    model (keys without the adapter name, as peft writes them), as whole CPU tensors in the
    model's dtype on rank 0; ``{}`` on the other ranks. Every rank must call it."""
    from peft import get_peft_model_state_dict

    model, engine = _peft_model_of(model_or_engine, "adapter_state_dict")
    _settle(engine)
    whole = _gather_to_cpu(_adapter_entries(model, [adapter_name], save_embedding_layers))
    if not _writer():
        return {}
    return get_peft_model_state_dict(model, state_dict=whole, adapter_name=adapter_name,
                                     save_embedding_layers=save_embedding_layers)


def save_adapters(model: Any, save_directory: str | os.PathLike, *, engine: Any = None,
                  safe_serialization: bool = True, **kwargs: Any) -> None:
    """Write the adapters in PEFT's format, whole, at every ZeRO stage (rank 0 writes).

    The files are peft's own ``save_pretrained`` output (``adapter_config.json`` and
    ``adapter_model.safetensors``, or ``adapter_model.bin`` with ``safe_serialization=False``),
    with whole tensors in the model's dtype; ``PeftModel.from_pretrained(base, save_directory)``
    loads them. Only the adapters are gathered (one tensor at a time), never the base. Every rank
    must call it; it returns after rank 0 has written.

    Args:
        model: the ``PeftModel`` (or the engine training it).
        save_directory: the folder peft writes.
        engine: the engine training ``model``, if any (its last step is landed first); found from
            ``model`` when that is the engine.
        safe_serialization: safetensors (default) or torch's format, as in peft.
        **kwargs: peft's ``save_pretrained`` arguments (``selected_adapters``,
            ``save_embedding_layers``, ...); ``state_dict`` and ``is_main_process`` are set here.

    Raises:
        ValueError: ``state_dict`` or ``is_main_process`` given.
        TypeError: not a PEFT model.
    """
    for key in ("state_dict", "is_main_process"):
        if key in kwargs:
            raise ValueError(f"save_adapters sets {key}= itself (the gathered adapters, rank 0 writes); drop {key}=")
    peft_model, found = _peft_model_of(model, "save_adapters")
    _settle(engine if engine is not None else found)
    adapters = kwargs.get("selected_adapters") or list(peft_model.peft_config)
    entries = _adapter_entries(peft_model, list(adapters), kwargs.get("save_embedding_layers", "auto"))
    whole = _gather_to_cpu(entries)
    if _writer():
        peft_model.save_pretrained(save_directory, safe_serialization=safe_serialization, state_dict=whole,
                                   is_main_process=True, **kwargs)
    if dist.is_initialized():
        dist.barrier()  # every rank returns once the files exist


def whole_adapters_threshold(model_or_engine: Any, *, save_embedding_layers: Any = "auto") -> int:
    """The smallest ``zero_optimization.stage3_param_persistence_threshold`` that keeps every tensor
    peft saves whole on every rank at ZeRO-3 (the largest one's element count). With it in the
    config, the adapters are never freed, so peft's own ``model.save_pretrained(dir)`` called on
    rank 0 alone writes them whole (no gather, no collective). The cost: each rank holds them
    whole in the model's dtype, and base parameters up to that size (norms) stay whole too."""
    model, _ = _peft_model_of(model_or_engine, "whole_adapters_threshold")
    entries = _adapter_entries(model, list(model.peft_config), save_embedding_layers)
    return max((t.numel() for t in entries.values()), default=0)


@contextlib.contextmanager
def gathered_adapters(model_or_engine: Any, *, save_embedding_layers: Any = "auto") -> Iterator[Any]:
    """A block in which every tensor peft saves is whole on every rank (every rank enters), so
    peft's own ``model.save_pretrained(dir)`` (called on rank 0, or on every rank with
    ``is_main_process=rank == 0``) writes whole adapters under ZeRO-3. Yields the PeftModel."""
    model, engine = _peft_model_of(model_or_engine, "gathered_adapters")
    _settle(engine)
    entries = _adapter_entries(model, list(model.peft_config), save_embedding_layers)
    with GatheredParameters(list(entries.values())):
        yield model


# ------------------------------------------------------------------------------ merging
def merged_state_dict(model_or_engine: Any, *, adapter_names: list[str] | None = None,
                      fp32: bool = False) -> dict[str, torch.Tensor]:
    """The state dict of ``model.merge_and_unload(adapter_names=...)`` of the unsharded model,
    as whole CPU tensors on rank 0 (``{}`` on the others); the engine's model is left as it was.
    Keys are the base model's own (``from_pretrained`` of the base class loads them). Every rank
    must call it.

    Each adapted layer is gathered alone, merged with peft's own ``merge`` (so every LoRA variant
    peft merges is covered, with peft's arithmetic: equal to the unsharded merge), read, and
    restored bit for bit; ``modules_to_save`` contribute their trained copy, as
    ``merge_and_unload`` keeps it. Rank 0 holds the merged model in host memory at the end.

    Args:
        fp32: merge in fp32: the trained parameters (adapters, modules_to_save) take the engine's
            fp32 master values, every other tensor its model-dtype value cast to fp32; the result
            is the fp32 unsharded merge (peft's ``merge_and_unload`` of an fp32 copy holding the
            masters). Default: the model's dtype and its own values, as peft merges them.

    Raises:
        ConfigError: a quantized (bitsandbytes) base: merge into an unquantized copy of the base.
        NotImplementedError: a peft wrapper other than ``modules_to_save`` (trainable tokens).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    model, engine = _peft_model_of(model_or_engine, "merged_state_dict")
    _settle(engine)
    if _quantized(model):
        raise ConfigError(
            "merged_state_dict: the base is quantized (bitsandbytes), and merging into 4/8-bit weights loses the "
            "adapters' precision; save the adapters (save_adapters) and merge them into the unquantized base: "
            "PeftModel.from_pretrained(base_in_bf16, dir).merge_and_unload()"
        )
    masters = _fp32_masters(engine) if fp32 else None
    out: dict[str, torch.Tensor] = {}
    _merge_walk(model.get_base_model(), "", out, _Merge(adapter_names, masters, BaseTunerLayer))
    return out if _writer() else {}


class _Merge:
    """What one merge walk needs: the adapters to merge, the fp32 values (None: model dtype; else
    ``id(param) -> fp32 master`` of the trained parameters, on rank 0), peft's tuner layer class."""

    def __init__(self, adapter_names: list[str] | None, masters: dict[int, torch.Tensor] | None,
                 tuner_layer: type) -> None:
        self.adapter_names = adapter_names
        self.masters = masters
        self.tuner_layer = tuner_layer

    def fp32_value(self, tensor: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of a whole tensor (its master for a trained parameter), on its device."""
        master = self.masters.get(id(tensor))
        if master is not None:
            return master.to(tensor.device, copy=True)
        return tensor.detach().to(torch.float32, copy=True) if tensor.is_floating_point() else tensor.detach()


def _fp32_masters(engine: Any) -> dict[int, torch.Tensor]:
    """``id(param) -> whole fp32 master`` (CPU, rank 0 only) of every parameter the engine trains:
    the adapters and modules_to_save copies, never the base. One all-gather per parameter."""
    if engine is None or getattr(engine, "zero", None) is None:
        return {}  # no engine: the model's own values are the truth
    from partita.zero.gathered import iter_fp32_master

    writer = _writer()
    return {id(param): full.to("cpu", copy=True) for param, full in iter_fp32_master(engine.zero) if writer}


def _merge_walk(module: nn.Module, prefix: str, out: dict, merge: _Merge) -> None:
    """The merged model's state dict, module by module, in ``state_dict`` order: an adapted layer
    becomes its merged base layer, a modules_to_save wrapper its active copy (merge_and_unload's
    replacements), everything else itself."""
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    if isinstance(module, merge.tuner_layer):
        _merge_layer(module, prefix, out, merge)
        return
    if isinstance(module, ModulesToSaveWrapper):
        active = module.active_adapters[0] if module.active_adapters else None
        target = module.modules_to_save[active] if active in module.modules_to_save else module.original_module
        _merge_walk(target, prefix, out, merge)
        return
    if isinstance(module, AuxiliaryTrainingWrapper):
        raise NotImplementedError(
            f"merged_state_dict: {prefix.rstrip('.') or 'the model'} is a peft {type(module).__name__}, which this "
            "merge does not unwrap; save the adapters (save_adapters) and merge them into the unsharded base with "
            "PeftModel.from_pretrained(base, dir).merge_and_unload()"
        )
    own = {name: t for name, t in module._parameters.items() if t is not None}
    own.update({name: t for name, t in module._buffers.items()
                if t is not None and name not in module._non_persistent_buffers_set})
    if merge.masters is None:
        out.update({prefix + k: v for k, v in _gather_to_cpu(own).items()})
    else:
        for name, tensor in own.items():
            with GatheredParameters([tensor]):
                if _writer():
                    out[prefix + name] = merge.fp32_value(tensor).cpu().contiguous()
    for name, child in module._modules.items():
        if child is not None:
            _merge_walk(child, f"{prefix}{name}.", out, merge)


def _merge_layer(layer: Any, prefix: str, out: dict, merge: _Merge) -> None:
    """One adapted layer's merged base-layer state, read on rank 0 (see :func:`_merged_layer`)."""
    with _merged_layer(layer, merge) as entries:
        if entries is not None and _writer():
            out.update({prefix + k: t.detach().to("cpu", copy=True).contiguous() for k, t in entries.items()})


@contextlib.contextmanager
def _merged_layer(layer: Any, merge: _Merge) -> Iterator[dict[str, torch.Tensor] | None]:
    """One adapted layer, gathered and merged in place by peft for the block: yields its base layer's
    ``state_dict(keep_vars=True)`` (the live, merged tensors, whole on every rank; None on the ranks
    other than 0 in an fp32 merge, which only take part in the gathers); on exit every tensor gets
    back its own storage and values, and peft's merge record is restored.

    In fp32 every tensor of the layer computes on an fp32 copy (``.data`` swapped for the merge):
    the live tensors are only read."""
    base = layer.get_base_layer()
    entries = base.state_dict(keep_vars=True)  # the live tensors of the merged layer's keys
    tensors = list(layer.parameters()) + list(layer.buffers())
    # no_grad around the edits only, not across the yield: the caller's block keeps its own grad mode.
    with GatheredParameters(tensors):
        if merge.masters is not None and not _writer():
            yield None  # the fp32 merge is rank 0's alone; the others only took part in the gathers
            return
        swapped = tensors if merge.masters is not None else list(entries.values())
        with torch.no_grad():  # (tensor, its own .data, what to put back into it: None when it computed on a copy)
            kept = [(t, t.data, None if merge.masters is not None else t.detach().clone()) for t in swapped]
        merged_before = list(layer.merged_adapters)
        try:
            with torch.no_grad():
                if merge.masters is not None:
                    for tensor in swapped:
                        tensor.data = merge.fp32_value(tensor)
                # safe_merge=False: peft's in-place path (merge_and_unload's default arithmetic).
                layer.merge(safe_merge=False, adapter_names=merge.adapter_names)
            yield entries
        finally:
            with torch.no_grad():
                for tensor, data, values in kept:
                    if tensor.data is not data:  # a copy, or a variant that assigned .data: its own storage back
                        tensor.data = data
                    if values is not None:
                        tensor.data.copy_(values)
            layer.merged_adapters = merged_before


def iter_merged_parameters(model_or_engine: Any, *,
                           adapter_names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters of ``merge_and_unload(adapter_names=...)`` of the unsharded model, one whole
    tensor at a time on every rank, in ``named_parameters()`` order and under the base model's names
    (a tied weight once, under its first name; no buffers): the weight sync to a generator that
    knows the base model only (vLLM). The values equal :func:`merged_state_dict`'s; the engine's
    model is left as it was.

    Memory: besides its own shards a rank holds one adapted layer gathered and merged (plus a copy
    of its base weight to restore it), or one other parameter gathered. Each tensor is valid until
    the next one is asked for (it may be the model's own storage, merged for the moment): read or
    copy it first. Every rank must iterate to the end (the gathers are collectives).

    Raises:
        ConfigError: a quantized (bitsandbytes) base.
        NotImplementedError: a peft wrapper other than ``modules_to_save`` (trainable tokens).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    model, engine = _peft_model_of(model_or_engine, "iter_merged_parameters")
    _settle(engine)
    if _quantized(model):
        raise ConfigError(
            "iter_merged_parameters: the base is quantized (bitsandbytes), and merging into 4/8-bit weights loses "
            "the adapters' precision; stream the weights of an unquantized base instead"
        )
    yield from _stream_walk(model.get_base_model(), "", _Merge(adapter_names, None, BaseTunerLayer), set())


def _stream_walk(module: nn.Module, prefix: str, merge: _Merge, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`_merge_walk`'s replacements (adapted layers merged, the active modules_to_save copy),
    parameters only, each made whole on every rank while it is handed out."""
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    if isinstance(module, merge.tuner_layer):
        with _merged_layer(module, merge) as entries:
            for key, tensor in entries.items():
                if isinstance(tensor, nn.Parameter) and id(tensor) not in seen:
                    seen.add(id(tensor))
                    yield prefix + key, tensor.detach()
        return
    if isinstance(module, ModulesToSaveWrapper):
        active = module.active_adapters[0] if module.active_adapters else None
        target = module.modules_to_save[active] if active in module.modules_to_save else module.original_module
        yield from _stream_walk(target, prefix, merge, seen)
        return
    if isinstance(module, AuxiliaryTrainingWrapper):
        raise NotImplementedError(
            f"iter_merged_parameters: {prefix.rstrip('.') or 'the model'} is a peft {type(module).__name__}, which "
            "this merge does not unwrap; merge the adapters into the unsharded base and stream that model instead"
        )
    for name, param in module._parameters.items():
        if param is None or id(param) in seen:
            continue
        seen.add(id(param))
        with GatheredParameters([param]):
            yield prefix + name, param.detach()
    for name, child in module._modules.items():
        if child is not None:
            yield from _stream_walk(child, f"{prefix}{name}.", merge, seen)


def save_merged_model(model_or_engine: Any, save_directory: str | os.PathLike, *,
                      adapter_names: list[str] | None = None, fp32: bool = False, **kwargs: Any) -> None:
    """``merge_and_unload().save_pretrained(save_directory)`` of the unsharded model: rank 0 writes
    the base model's format (config included) with :func:`merged_state_dict`'s weights (``fp32``:
    its fp32 merge), which
    ``from_pretrained`` of the base class loads. Every rank must call it; ``**kwargs`` go to the
    base model's ``save_pretrained`` (``state_dict`` and ``is_main_process`` are set here)."""
    for key in ("state_dict", "is_main_process"):
        if key in kwargs:
            raise ValueError(f"save_merged_model sets {key}= itself (the merged weights, rank 0 writes); drop {key}=")
    model, _ = _peft_model_of(model_or_engine, "save_merged_model")
    state = merged_state_dict(model_or_engine, adapter_names=adapter_names, fp32=fp32)
    if _writer():
        model.get_base_model().save_pretrained(save_directory, state_dict=state, **kwargs)
    if dist.is_initialized():
        dist.barrier()


# ------------------------------------------------------------------------------ QLoRA
def _quantized(model: nn.Module) -> list[str]:
    """Names of the parameters bitsandbytes quantized (4-bit ``Params4bit``, 8-bit ``Int8Params``)."""
    names = []
    for name, param in model.named_parameters():
        cls = type(param)
        if cls.__module__.startswith("bitsandbytes") or any(c.__name__ in ("Params4bit", "Int8Params")
                                                            for c in cls.__mro__):
            names.append(name)
    return names


def check_quantized_base(model: nn.Module, device: torch.device | str | None = None) -> None:
    """Refuse a bitsandbytes-quantized (QLoRA) base on a device bitsandbytes cannot run 4-bit on.

    bitsandbytes 0.50 quantizes and multiplies 4-bit weights on CUDA and on the CPU (where a QLoRA
    model trains under partita at every ZeRO stage); on a device it has no kernels for, the first
    forward would fail deep inside bitsandbytes. This probes the device once (a 64x64 quantize
    and dequantize) and raises before training starts. ``device``: where the engine runs (default
    partita's current device). A model without quantized parameters passes without a probe.

    Raises:
        ConfigError: what is quantized, why it cannot run there, and the fix.
    """
    quantized = _quantized(model)
    if not quantized:
        return
    if device is None:
        from partita.distributed.init import current_device

        device = current_device()
    device = torch.device(device)
    try:
        import bitsandbytes.functional as bnb_functional

        packed, state = bnb_functional.quantize_4bit(torch.zeros(64, 64, device=device), quant_type="nf4")
        bnb_functional.dequantize_4bit(packed, state)
    except Exception as err:  # bitsandbytes raises many types for an unsupported backend
        raise ConfigError(
            f"QLoRA: the base has {len(quantized)} bitsandbytes-quantized parameters (e.g. {quantized[0]!r}), and "
            f"bitsandbytes cannot run 4-bit weights on {device} ({type(err).__name__}: {err}); train on a device "
            "bitsandbytes supports (CUDA or the CPU), or load the base unquantized (torch_dtype=torch.bfloat16, no "
            "quantization_config) and shard it with ZeRO-3 under partita.zero.Init instead"
        ) from err
