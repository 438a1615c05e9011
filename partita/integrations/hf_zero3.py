"""transformers' own ZeRO-3 code paths on a partita ZeRO-3 model: :func:`enable_zero3`.

transformers asks two questions before it touches a ZeRO-3 model, and partita answers neither
by itself:

1. "Is ZeRO-3 on?" -- ``transformers.integrations.is_deepspeed_zero3_enabled()`` reads a
   process-wide config object that the Trainer's DeepSpeed path (``HfDeepSpeedConfig``, which
   needs the ``deepspeed`` package installed) registers. While it says no, ``from_pretrained``
   builds on the meta device, ``resize_token_embeddings`` reads freed parameters and
   ``generate`` runs a different number of forwards per rank (a hang under ZeRO-3).
2. "Which DeepSpeed?" -- inside those paths transformers runs ``import deepspeed`` and calls
   ``deepspeed.zero.Init``, ``deepspeed.zero.GatheredParameters``, ``deepspeed.comm.get_rank``,
   ``deepspeed.accelerator.get_accelerator`` and patches
   ``deepspeed.runtime.zero.partition_parameters``. A function-level ``import deepspeed`` can
   only be answered by ``sys.modules``: no other hook exists in Python's import system.

:func:`enable_zero3` answers both, explicitly and reversibly:

- it registers a config object with transformers (``set_hf_deepspeed_config``) whose
  ``is_zero3()`` is true and whose ``config`` is your partita config;
- it puts a small alias package under the name ``deepspeed`` in ``sys.modules`` (and the
  submodules transformers imports), whose functions are partita's: ``zero.Init`` is
  ``partita.zero.Init``, ``zero.GatheredParameters`` is
  :class:`partita.integrations.hf_gathered.GatheredParameters` (partita's, extended to models
  built under ``zero.Init`` before ``initialize``), ``comm`` is ``partita.comm``,
  ``accelerator`` is ``partita.accelerator``; any other ``deepspeed.X`` is ``partita.X``. No
  package is installed on disk, and :func:`is_deepspeed_available` stays false
  (transformers and accelerate check the package's metadata), so no DeepSpeed-only code path
  of the Trainer turns on. It refuses to run when the real ``deepspeed`` is already imported.

``handle.close()`` (or leaving the ``with`` block) removes both again. Only one can be enabled
at a time. :func:`save_pretrained` writes a ZeRO-3 model in Hugging Face's format.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.integrations.hf_config import read_config
from partita.integrations.hf_gathered import GatheredParameters, is_engine_managed

__all__ = ["HfZero3", "PartitaHfZero3Config", "active_config", "enable_zero3", "save_pretrained"]

# The module names the alias occupies while enabled (what transformers 5.24 imports).
ALIAS_NAMES = ("deepspeed", "deepspeed.zero", "deepspeed.comm", "deepspeed.accelerator", "deepspeed.runtime",
               "deepspeed.runtime.zero", "deepspeed.runtime.zero.partition_parameters")

_ACTIVE: list[HfZero3] = []  # the enabled hook (a strong reference: transformers keeps a weak one)


class PartitaHfZero3Config:
    """The object transformers' ``set_hf_deepspeed_config`` records: ``config`` (the partita
    config as a dict: transformers passes it to ``deepspeed.zero.Init`` and reads
    ``tensor_parallel`` from it) and the queries accelerate's ``HfDeepSpeedConfig`` offers."""

    def __init__(self, config: dict) -> None:
        self.config = config

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        node: Any = self.config
        for key in ds_key_long.split("."):
            if not isinstance(node, dict) or key not in node:
                return default
            node = node[key]
        return node

    def is_true(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return value is not None and bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return value is not None and not bool(value)

    def is_zero3(self) -> bool:
        return True  # enable_zero3 accepts stage-3 configs only

    def is_zero2(self) -> bool:
        return False

    def is_offload(self) -> bool:
        return any(self.get_value(f"zero_optimization.{section}.device") in ("cpu", "nvme")
                   for section in ("offload_param", "offload_optimizer"))


class HfZero3:
    """The enabled hook (returned by :func:`enable_zero3`); a context manager that closes it."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self._hf_config = PartitaHfZero3Config(config)
        self._saved_modules: dict[str, types.ModuleType | None] = {}
        self.closed = False

    def __enter__(self) -> HfZero3:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Tell transformers ZeRO-3 is off again and take the ``deepspeed`` alias out of ``sys.modules``."""
        if self.closed:
            return
        from transformers.integrations import deepspeed as hf_deepspeed

        ref = hf_deepspeed._hf_deepspeed_config_weak_ref
        if ref is not None and ref() is self._hf_config:
            hf_deepspeed.unset_hf_deepspeed_config()
        for name in ALIAS_NAMES:
            previous = self._saved_modules.get(name)
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
        self.closed = True
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def _install(self) -> None:
        from transformers.integrations import deepspeed as hf_deepspeed

        modules = _alias_modules()
        for name in ALIAS_NAMES:
            self._saved_modules[name] = sys.modules.get(name)
            sys.modules[name] = modules[name]
        hf_deepspeed.set_hf_deepspeed_config(self._hf_config)
        _ACTIVE.append(self)


def enable_zero3(config: dict | str | os.PathLike) -> HfZero3:
    """Make transformers' ZeRO-3 paths run on partita (see the module doc).

    Args:
        config: the partita (DeepSpeed-style) config, a dict or a JSON file's path, with
            ``zero_optimization.stage`` 3: the one you will pass to ``partita.initialize``.

    Returns:
        the hook; ``close()`` it (or use ``with enable_zero3(cfg):``) to switch it off.

    Raises:
        ValueError: the stage is not 3, the hook is already enabled, or the real ``deepspeed``
            package is imported in this process.
        partita.config.ConfigError: the config is invalid.
    """
    from partita.config import load_config

    cfg = read_config(config, caller="enable_zero3: the config")
    stage = load_config(cfg).zero_optimization.stage
    if stage != 3:
        raise ValueError(
            f"enable_zero3 needs a ZeRO-3 config, got zero_optimization.stage={stage}: transformers' ZeRO-3 paths "
            "are for sharded parameters; at stages 0-2 the model is whole and transformers needs no hook"
        )
    if _ACTIVE:
        raise ValueError("partita's transformers ZeRO-3 hook is already enabled; close() it before enabling another")
    existing = sys.modules.get("deepspeed")
    if existing is not None and not getattr(existing, "_partita_alias", False):
        raise ValueError(
            "the real deepspeed package is imported in this process; transformers would call it on partita's "
            "model. Use one library per process: drop the `import deepspeed`, or train with DeepSpeed instead"
        )
    handle = HfZero3(cfg)
    handle._install()
    return handle


def active_config() -> dict | None:
    """The enabled hook's config, or None."""
    return _ACTIVE[0].config if _ACTIVE else None




# ---------------------------------------------------------------------------- the alias package
def _module(name: str, doc: str, attrs: dict[str, Any], *, fallback: str | None = None) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    # A spec (importlib.util.find_spec reads it for a module already in sys.modules) and an empty
    # __path__ (submodules other than the aliased ones are "not found", not imported from disk).
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []
    module._partita_alias = True
    module.__dict__.update(attrs)
    if fallback is not None:
        def __getattr__(attr: str) -> Any:  # noqa: N807 - PEP 562
            return getattr(importlib.import_module(fallback), attr)

        module.__getattr__ = __getattr__
    return module


def _wrapper_for_fp_tensor_constructor(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's zero.Init wraps tensor constructors to change their dtype and device, and
    transformers swaps this function out while it builds RoPE buffers. partita's zero.Init
    converts parameters only, never constructors: the constructor is returned as it is."""
    return fn


def _alias_modules() -> dict[str, types.ModuleType]:
    import partita
    import partita.accelerator
    import partita.comm
    import partita.zero
    zero_names = {
        "Init": partita.zero.Init,
        "GatheredParameters": GatheredParameters,
        "register_external_parameter": partita.zero.register_external_parameter,
        "unregister_external_parameter": partita.zero.unregister_external_parameter,
        "set_z3_leaf_modules": partita.zero.set_z3_leaf_modules,
    }
    note = "partita's alias for transformers' `import deepspeed` (partita.integrations.hf_zero3.enable_zero3)"
    zero = _module("deepspeed.zero", f"deepspeed.zero: {note}", zero_names, fallback="partita.zero")
    partition_parameters = _module(
        "deepspeed.runtime.zero.partition_parameters", f"deepspeed.runtime.zero.partition_parameters: {note}",
        {**zero_names, "zero_wrapper_for_fp_tensor_constructor": _wrapper_for_fp_tensor_constructor,
         "_orig_torch_arange": torch.arange, "get_accelerator": partita.accelerator.get_accelerator},
    )
    runtime_zero = _module("deepspeed.runtime.zero", f"deepspeed.runtime.zero: {note}",
                           {**zero_names, "partition_parameters": partition_parameters})
    runtime = _module("deepspeed.runtime", f"deepspeed.runtime: {note}", {"zero": runtime_zero},
                      fallback="partita.runtime")
    top = _module("deepspeed", f"deepspeed: {note}",
                  {"zero": zero, "comm": partita.comm, "accelerator": partita.accelerator, "runtime": runtime},
                  fallback="partita")
    return {"deepspeed": top, "deepspeed.zero": zero, "deepspeed.comm": partita.comm,
            "deepspeed.accelerator": partita.accelerator, "deepspeed.runtime": runtime,
            "deepspeed.runtime.zero": runtime_zero, "deepspeed.runtime.zero.partition_parameters": partition_parameters}


# ---------------------------------------------------------------------------- save_pretrained
def save_pretrained(model_or_engine: Any, save_directory: str | os.PathLike, *, fp32: bool = False,
                    **kwargs: Any) -> None:
    """``save_pretrained`` of a ZeRO-3 model: the whole weights, written by rank 0 in Hugging Face's
    format (``from_pretrained`` loads them; config and generation config included).

    Every rank must call it: parameters are gathered one at a time, and rank 0 holds the whole
    state dict while it writes (as DeepSpeed's ``save_16bit_model`` and the Trainer's
    ``save_model`` do).

    Args:
        model_or_engine: a partita engine (its module is saved), or a model (one built under
            ``partita.zero.Init`` and not yet initialized, or any other).
        save_directory: the folder ``save_pretrained`` writes.
        fp32: write fp32 weights: from an engine, its optimizer's fp32 master weights
            (``engine.get_fp32_state_dict()``); from a model without engine, its weights cast
            to fp32. Default: the model's own dtype (``engine._zero3_consolidated_16bit_state_dict()``).
        **kwargs: passed to ``PreTrainedModel.save_pretrained`` (``max_shard_size``, ...);
            ``state_dict`` and ``is_main_process`` are set here.

    Raises:
        ValueError: ``state_dict`` or ``is_main_process`` given, or ``fp32`` for a model an engine
            trains (pass the engine: its masters are the fp32 weights).
    """
    for key in ("state_dict", "is_main_process"):
        if key in kwargs:
            raise ValueError(f"partita's save_pretrained sets {key}= itself (the gathered weights, rank 0 writes); "
                             f"drop {key}=")
    is_engine = not isinstance(model_or_engine, nn.Module) and hasattr(model_or_engine, "get_fp32_state_dict")
    module = model_or_engine.module if is_engine else model_or_engine
    if is_engine:
        if hasattr(model_or_engine, "finish_pending_step"):
            model_or_engine.finish_pending_step()
        if fp32:
            state = model_or_engine.get_fp32_state_dict()
        else:
            state = model_or_engine._zero3_consolidated_16bit_state_dict()
    else:
        state = _gathered_state_dict(module, fp32=fp32)
    writer = not dist.is_initialized() or dist.get_rank() == 0
    if writer:
        module.save_pretrained(save_directory, state_dict=state, **kwargs)
    if dist.is_initialized():
        dist.barrier()


def _gathered_state_dict(module: nn.Module, *, fp32: bool) -> dict[str, torch.Tensor]:
    """Every ``state_dict`` key of ``module`` as a CPU tensor on rank 0 (``{}`` elsewhere), each
    parameter gathered alone; a tied weight is one tensor under each of its names."""
    entries = module.state_dict(keep_vars=True)
    if fp32 and any(is_engine_managed(t) for t in entries.values()):
        raise ValueError(
            "save_pretrained(model, fp32=True): an engine trains this model, and its fp32 weights are the optimizer's "
            "master copy; pass the engine instead: save_pretrained(engine, dir, fp32=True)"
        )
    writer = not dist.is_initialized() or dist.get_rank() == 0
    saved: dict[int, torch.Tensor] = {}
    for tensor in entries.values():
        if id(tensor) in saved:
            continue
        with GatheredParameters([tensor]):
            if writer:
                value = tensor.detach().to("cpu", copy=True)
                saved[id(tensor)] = value.float() if fp32 and value.is_floating_point() else value
            else:
                saved[id(tensor)] = None  # type: ignore[assignment]
    return {name: saved[id(t)] for name, t in entries.items()} if writer else {}
