"""``state_dict()`` / ``load_state_dict()`` of a module whose parameters ZeRO-3 has freed.

Why this exists: ZeRO-3 (and ``partita.zero.Init`` before ``initialize``) frees a parameter by
resizing its storage to 0 bytes while the parameter keeps its whole shape (see [Note: freeing
storage in place] in param_gatherer.py). ``Module.state_dict()`` returns ``param.detach()``,
which shares that empty storage, so *reading* an entry (``sd["w"].sum()``, ``torch.save(sd)``)
read unallocated memory: a segfault on CPU, an illegal memory access on CUDA. Loading
(``load_state_dict``) wrote into it the same way.

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
  Under ZeRO-3 read those only inside ``GatheredParameters``, as any ``parameters()`` result.
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
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["NotGatheredPlaceholder", "ParameterNotGatheredError", "guard_module", "guard_state_dict", "is_freed"]

# Modules already guarded (weakly: nothing outlives the model), so zero.Init and initialize
# registering the same module install one pair of hooks.
_GUARDED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()

_HOW_TO_READ = (
    "To read whole weights, gather them on every rank: `with partita.zero.GatheredParameters("
    "list(engine.module.parameters())): sd = {k: v.clone() for k, v in engine.module.state_dict().items()}`; "
    "or export them: engine.save_16bit_model(dir, 'model.safetensors'), "
    "engine._zero3_consolidated_16bit_state_dict() (rank 0, the model's dtype), "
    "engine.get_fp32_state_dict() (fp32); engine.save_checkpoint(dir) saves the training state"
)
_HOW_TO_LOAD = (
    "Load inside `with partita.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):` "
    "on every rank (the block writes rank 0's values into every rank's fp32 master shards on exit), "
    "or restore a partita checkpoint with engine.load_checkpoint(dir)"
)
_INIT_NOTE = (
    "It was built under partita.zero.Init and holds only this rank's shard until partita.initialize "
    "(inside the zero.Init context every op sees whole values). "
)


class ParameterNotGatheredError(RuntimeError):
    """A ZeRO-3 parameter's values were needed where this rank holds only its shard."""


class NotGatheredPlaceholder(torch.Tensor):
    """What ``state_dict()`` holds for a parameter that is freed right now (see the module doc).

    A tensor with the parameter's shape, dtype and device but no storage: metadata works, any
    use of values raises :class:`ParameterNotGatheredError`.
    """

    _key: str
    _built_under_init: bool

    @staticmethod
    def __new__(cls, like: torch.Tensor, key: str, *, built_under_init: bool = False) -> NotGatheredPlaceholder:
        # A wrapper subclass: torch allocates nothing for it, and every aten op on it reaches
        # __torch_dispatch__ below (no kernel ever sees a data pointer).
        out = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device, requires_grad=False
        )
        out._key = key
        out._built_under_init = built_under_init
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"NotGatheredPlaceholder({self._key!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}: a ZeRO-3 parameter, not gathered on this rank)")

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)

    def _error(self, what: str) -> ParameterNotGatheredError:
        return ParameterNotGatheredError(
            f"{what} needs the values of state_dict entry {self._key!r} (shape {list(self.shape)}, {self.dtype}), "
            "a ZeRO-3 parameter that this rank holds only as a shard: the state dict has its key, shape and dtype "
            f"but no values (partita/zero/state_dict_guard.py). {_INIT_NOTE if self._built_under_init else ''}"
            f"{_HOW_TO_READ}"
        )

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise _first_placeholder(args, kwargs)._error(_describe(func))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Reached only where torch functions are bypassed (C++ callers, DisableTorchFunction):
        # still no kernel may run on a tensor without data.
        raise _first_placeholder(args, kwargs or {})._error(f"torch op {func}")


# What a placeholder answers: metadata only, never values (nor .data, an alias for writing values).
# Names this torch lacks are skipped (named tensors' ``names`` is gone from newer releases).
_METADATA_PROPERTIES = ("shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_leaf", "grad", "grad_fn",
                        "is_meta", "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_nested", "names", "itemsize",
                        "nbytes")
_METADATA_METHODS = ("size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
                     "is_signed", "is_contiguous", "stride", "get_device", "__len__", "__hash__", "__dir__")
_METADATA = frozenset(
    [getattr(torch.Tensor, n).__get__ for n in _METADATA_PROPERTIES if hasattr(torch.Tensor, n)]
    + [getattr(torch.Tensor, n) for n in _METADATA_METHODS if hasattr(torch.Tensor, n)]
)


def _describe(func: Any) -> str:
    name = getattr(func, "__name__", str(func))
    if name == "__reduce_ex__":
        return "pickling (torch.save, multiprocessing, all_gather_object)"
    if name == "__deepcopy__":
        return "copy.deepcopy"
    owner = getattr(func, "__self__", None)
    if name == "__get__" and owner is not None:
        return f"Tensor.{getattr(owner, '__name__', owner)}"
    return f"{name}()" if not name.startswith("__") else name


def _first_placeholder(args: tuple, kwargs: dict) -> NotGatheredPlaceholder:
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, NotGatheredPlaceholder):
            return leaf
    raise AssertionError("a NotGatheredPlaceholder override ran without one")  # torch passes the overriding arg


def is_freed(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` has elements its storage cannot hold: a ZeRO-3 (or zero.Init) freed
    parameter, or an alias of one. Reading it would read unallocated memory."""
    if tensor.numel() == 0 or isinstance(tensor, NotGatheredPlaceholder):
        return False
    try:
        nbytes = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # no plain storage (sparse, nested, subclasses)
        return False
    last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()) if n > 0)
    return nbytes < (last + 1) * tensor.element_size()


def _init_context_active() -> bool:
    from partita.zero.init_context import sharded_access_active

    return sharded_access_active()


def _built_under_init(param: nn.Parameter) -> bool:
    from partita.zero.gathered import owner_of
    from partita.zero.init_context import init_shard_of

    return owner_of(param) is None and init_shard_of(param) is not None


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
        if is_freed(entry):
            state_dict[key] = NotGatheredPlaceholder(entry, key, built_under_init=_built_under_init(param))
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
