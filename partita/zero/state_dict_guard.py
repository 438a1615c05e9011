"""``state_dict()`` / ``load_state_dict()`` of a module whose parameters ZeRO-3 has freed.

Why this exists: ZeRO-3 (and ``partita.zero.Init`` before ``initialize``) frees a parameter by
resizing its storage to 0 bytes while the parameter keeps its whole shape (see [Note: freed
parameters] in partita/zero/freed.py). ``Module.state_dict()`` stores ``param.detach()``; for a
freed parameter that is a :class:`NotGatheredPlaceholder` (freed.py), which this module's hook
replaces by one naming the state_dict key. Before freed parameters guarded their reads, the entry
shared the empty storage, and reading it (``sd["w"].sum()``, ``torch.save(sd)``) read unallocated
memory: a segfault on CPU, an illegal memory access on CUDA.

What partita does instead, and why (:func:`guard_state_dict` puts it on every module that
directly owns such a parameter, so ``engine.module.blocks[0].state_dict()`` is covered too):

- **Keys keep working.** Raising from ``state_dict()`` would break the many key-only uses:
  ``model.state_dict().keys()`` (transformers and PEFT list keys this way, accelerate counts
  them), partita's own checkpoint code (snapshot.py, load.py and pipe/checkpoint.py list keys and
  skip the sharded entries, which they save through the fp32 master shards). So ``state_dict()``
  never raises.
- **Freed entries become placeholders, not DeepSpeed's 0-element tensors.** DeepSpeed 0.19.8
  returns ``numel() == 0`` tensors here: no crash, but the shapes are wrong and
  ``torch.save(model.state_dict())`` silently writes an empty model. A
  :class:`NotGatheredPlaceholder` answers every metadata question with the parameter's own
  answer (``shape``, ``size()``, ``dtype``, ``device``, ``numel()``, ``dim()``, ``stride()``,
  ``is_floating_point()``, ``element_size()``, ``len()``, ``hash``, ``repr``), so shape checks
  and parameter counts stay right, and raises :class:`ParameterNotGatheredError` (a
  RuntimeError naming the key and the fixes) for anything that needs values: arithmetic,
  ``.cpu()``/``.to()``/``.clone()``/``.detach()``, ``.numpy()``, ``.item()``, comparisons,
  ``copy.deepcopy``, ``torch.save``/pickling, ``copy_`` to or from it. It holds no memory.
- **Whole parameters keep their real values.** Inside ``GatheredParameters`` (or while a unit is
  gathered, between a training forward and its backward) an entry is the usual alias of the
  parameter. Freeing it later would empty that alias too (same storage), so the entry is
  reported to the gatherer (:meth:`ParameterGatherer.hand_out_storage`), whose next free moves
  the parameter to a new empty storage instead and leaves the old one, values intact, to the
  dict: reading it after the block is safe, as in DeepSpeed (whose freeing replaces ``.data``).
  Like DeepSpeed's, such an entry then keeps the values it had when the gather ended.
- **``keep_vars=True`` returns the live parameters**, as it promises (the same objects as
  ``named_parameters()``; partita's ``consolidated_16bit_state_dict`` gathers through them).
  Outside ``GatheredParameters`` a freed one answers metadata and raises
  :class:`ParameterNotGatheredError` on any value read, as any ``parameters()`` result (freed.py).
- **Loading into a freed parameter raises** :class:`ParameterNotGatheredError` before torch's
  ``copy_`` writes into the empty storage. Silently loading nothing is no option, and a load that
  does not go through ``GatheredParameters(..., modifier_rank=0)`` would be undone by the next
  gather anyway (the fp32 master shards are the truth). ``load_state_dict(..., assign=True)``
  raises too: it would swap out parameter objects that ZeRO-3 manages.
- **Inside the ``zero.Init`` context** the guard stands aside: its dispatch mode makes every op
  on a freed parameter (or an alias of it) see whole values, which model code relies on.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from partita.zero.freed import (_INIT_NOTE, INIT, NotGatheredPlaceholder, ParameterNotGatheredError, is_freed,
                                reason_of, sharded_access_active)

__all__ = ["NotGatheredPlaceholder", "ParameterNotGatheredError", "guard_module", "guard_state_dict", "is_freed"]

# Modules already guarded (weakly: nothing outlives the model), so zero.Init and initialize
# registering the same module install one pair of hooks.
_GUARDED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()

_HOW_TO_LOAD = (
    "Load inside `with partita.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):` "
    "on every rank (the block writes rank 0's values into every rank's fp32 master shards on exit), "
    "or restore a partita checkpoint with engine.load_checkpoint(dir)"
)


def _init_context_active() -> bool:
    return sharded_access_active()


def _built_under_init(param: nn.Parameter) -> bool:
    return reason_of(param) == INIT


def _replace_freed_entries(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook (see the module doc): freed entries become placeholders; entries
    of whole ZeRO-3 parameters keep their storage past the next free."""
    if _init_context_active():
        return
    for name, param in module._parameters.items():
        key = prefix + name
        entry = state_dict.get(key)
        if param is None or entry is None or entry is param or not isinstance(entry, torch.Tensor):
            continue  # keep_vars=True: the live parameter, as named_parameters() gives it
        if isinstance(entry, NotGatheredPlaceholder) or is_freed(param):
            # param.detach() of a freed parameter is a placeholder already: this one names the key.
            state_dict[key] = NotGatheredPlaceholder(param, key, why=reason_of(param))
        elif _shares_storage(entry, param):
            gatherer = _gatherer_of(param)
            if gatherer is not None and gatherer.is_sharded_param(param):
                gatherer.hand_out_storage(param)


def _refuse_loading_into_freed(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                               missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """load_state_dict pre-hook (see the module doc): raise before torch's copy_ would write into
    a parameter with no storage, or swap out a ZeRO-3 parameter (``assign=True``)."""
    if _init_context_active():
        return  # the dispatch mode makes the copy land in this rank's shard
    assign = bool(local_metadata.get("assign_to_params_buffers", False))
    for name, param in module._parameters.items():
        key = prefix + name
        if param is None or key not in state_dict:
            continue
        if is_freed(param):
            hint = _INIT_NOTE if _built_under_init(param) else ""
            raise ParameterNotGatheredError(
                f"load_state_dict would write {key!r} (shape {list(param.shape)}) into a ZeRO-3 parameter that this "
                f"rank holds only as a shard (it has no storage now; partita/zero/state_dict_guard.py). {hint}"
                f"{_HOW_TO_LOAD}"
            )
        gatherer = _gatherer_of(param) if assign else None
        if gatherer is not None and (param.requires_grad or gatherer.is_sharded_param(param)):  # not whole frozen ones
            raise ParameterNotGatheredError(
                f"load_state_dict(..., assign=True) would replace the ZeRO-3 parameter {key!r} with the state dict's "
                f"tensor, which ZeRO does not manage. {_HOW_TO_LOAD}"
            )


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _gatherer_of(param: nn.Parameter):
    from partita.zero.gathered import owner_of

    zero = owner_of(param)
    return getattr(zero, "gatherer", None)


def guard_state_dict(model: nn.Module, needs_guard: Callable[[nn.Parameter], bool]) -> None:
    """Guard every module of ``model`` that directly owns a parameter for which ``needs_guard``
    is true (ZeRO-3: the parameters the gatherer frees between uses)."""
    for module in model.modules():
        if any(p is not None and needs_guard(p) for p in module._parameters.values()):
            guard_module(module)


def guard_module(module: nn.Module) -> None:
    """Install the state_dict post-hook and load_state_dict pre-hook on ``module`` (once): they
    look at its own parameters, so a state dict taken from any ancestor or the module itself
    is covered."""
    if module in _GUARDED:
        return
    module.register_state_dict_post_hook(_replace_freed_entries)
    module.register_load_state_dict_pre_hook(_refuse_loading_into_freed)
    _GUARDED.add(module)
