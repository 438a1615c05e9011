"""``partita.zero.Init``: build a model already sharded, so no rank ever holds it whole.

Inside the context, every module's parameters are cut into this rank's 1/N shard as soon as
the module's ``__init__`` returns (the outermost ``__init__`` of that instance, so subclass
initialisers still see whole tensors). Each parameter is created whole once, on this rank's
device, initialised by the module's own code with the same random stream as an unsharded
build, then reduced to its shard: peak memory is one module's parameters, not the model's.

[Note: initialisation after sharding]
Models initialise again after their children are built: a parent's ``_init_weights``
(Hugging Face's ``post_init`` walks every module with its own ``smart_apply``), ``tie_weights``,
``nn.init.*`` on a child's parameter, ``param.data.normal_()``, ``weight[pad].zero_()``. Inside
the context every such op works and gives an unsharded build's values: a torch dispatch mode
(``_ShardedParamAccess``) sees each aten op whose tensors live in a sharded parameter's storage
(the parameter itself, ``.data``, or any view: they share one storage, recognised by identity),
makes those parameters whole for the op (an all-gather; an op that overwrites the whole
parameter, ``normal_``/``uniform_``/``fill_``/``zero_``/``copy_``, only allocates), runs it,
and keeps this rank's slice of the result. So every rank runs the same ops on the same whole
values with the same random stream, exactly as an unsharded build does (construction is
deterministic, so every rank issues the same gathers in the same order). View ops need no
data: the storage only gets its size back while the view is made. Inside ``module.apply(fn)``
a module's parameter made whole by an op stays whole until ``fn`` returns (at most one gather per
parameter, none when ``fn`` overwrites it first, as initialisers do). After the context, a parameter has no
storage until ``initialize`` gathers it: its shape and dtype answer, and any read of its values
raises ``ParameterNotGatheredError`` ([Note: freed parameters] in partita/zero/freed.py).

``initialize`` then builds the fp32 master shards from these shards; at ZeRO-3 the
parameters stay sharded, at stages 0-2 they are gathered whole once.
"""

from __future__ import annotations

import functools
import math
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from partita.distributed import collectives
from partita.utils.host_memory import release_free_host_memory
from partita.zero.bounded_gather import piece_numel
from partita.zero.freed import (INIT, allocate_param, free_param, init_contexts_opened, is_freed, name_params,
                                storage_sized)
from partita.zero.freed import sharded_access_active  # noqa: F401 - re-exported (it lived here)

# Parameter -> this rank's shard (1-D, the layout of partita.zero.partition with alignment 1).
_SHARDS = WeakIdKeyDictionary()
# The parameter's storage (its StorageImpl address, shared by .data and every view) -> the
# parameter (weakly), so the dispatch mode recognises any tensor that reads or writes it.
_BY_STORAGE: dict[int, weakref.ref] = {}


def init_shard_of(param: nn.Parameter) -> torch.Tensor | None:
    return _SHARDS.get(param)


def _register(param: nn.Parameter, shard: torch.Tensor) -> None:
    _SHARDS[param] = shard
    _BY_STORAGE[param.untyped_storage()._cdata] = weakref.ref(param)


def _unregister(param: nn.Parameter) -> None:
    _SHARDS.pop(param, None)
    key = param.untyped_storage()._cdata
    ref = _BY_STORAGE.get(key)
    if ref is not None and ref() is param:
        del _BY_STORAGE[key]


def _param_of_storage(tensor: torch.Tensor) -> nn.Parameter | None:
    """The construction-sharded parameter whose storage ``tensor`` uses, if any."""
    try:
        key = tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # tensors without a storage (sparse, nested, ...)
        return None
    ref = _BY_STORAGE.get(key)
    if ref is None:
        return None
    param = ref()
    if param is None:  # the parameter died (a tied-away weight): its address may be reused
        del _BY_STORAGE[key]
        return None
    if param not in _SHARDS or param.untyped_storage()._cdata != key:  # gathered for good, or new data
        return None
    return param


def _shard_numel(numel: int, world: int) -> int:
    return math.ceil(numel / world)


@torch.no_grad()
def gather_init_param(param: nn.Parameter) -> None:
    """Give a construction-sharded parameter its full storage and values back (collective).

    On CPU in pieces of at most ``bounded_gather.PIECE_BYTES`` of output, each written straight
    into the parameter's own storage (no whole-size staging): [Note: bounded gathers on CPU] in
    partita/zero/bounded_gather.py says why (a whole gather stayed resident on gloo's threads)."""
    shard = _SHARDS[param]
    world = dist.get_world_size()
    allocate_param(param)
    flat = param.data.view(-1)
    per_rank, numel = shard.numel(), flat.numel()
    if shard.device.type != "cpu":
        full = torch.empty(world * per_rank, dtype=shard.dtype, device=shard.device)
        collectives.all_gather_into_tensor(full, shard, group=None, purpose="zero.Init parameter gather")
        flat.copy_(full[:numel])
        return
    step = min(per_rank, piece_numel(world, shard.element_size()))
    staging = torch.empty(world * step, dtype=shard.dtype, device=shard.device)
    for lo in range(0, per_rank, step):
        n = min(step, per_rank - lo)
        rows = staging[: world * n]
        collectives.all_gather_into_tensor(rows, shard[lo : lo + n], group=None, purpose="zero.Init parameter gather")
        rows = rows.view(world, n)
        for rank in range(world):  # rank r's piece lands at r * per_rank + lo (the padding is dropped)
            start = rank * per_rank + lo
            if start >= numel:
                break
            count = min(n, numel - start)
            flat[start : start + count].copy_(rows[rank, :count])


@torch.no_grad()
def reshard_init_param(param: nn.Parameter) -> None:
    """Keep this rank's slice of the (possibly modified) whole parameter and free the rest."""
    shard = _SHARDS[param]
    start = min(dist.get_rank() * shard.numel(), param.numel())
    piece = param.data.view(-1)[start : start + shard.numel()]
    shard.zero_()
    shard[: piece.numel()].copy_(piece)
    free_param(param, INIT)


@torch.no_grad()
def materialize_init_params(params: list[nn.Parameter]) -> None:
    """Stages 0-2 need whole parameters: gather every construction-sharded one, for good."""
    for param in params:
        if param in _SHARDS:
            gather_init_param(param)
            _unregister(param)


def forget_init_shards(params: list[nn.Parameter]) -> None:
    for param in params:
        _unregister(param)


class Init:
    """Context manager: modules built inside hold only this rank's shard of their parameters.

    Args (DeepSpeed's names): ``config_dict_or_path`` / ``config``: the training config (its
    ``distributed`` section starts torch.distributed; ``bf16``/``fp16`` give the parameter
    dtype unless ``dtype`` is given); ``enabled``: False makes the context a no-op;
    ``module``: not supported (build the model inside the context instead).
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        config_dict_or_path: dict | str | os.PathLike | None = None,
        config: dict | str | None = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        remote_device: str | None = None,
        mpu: Any = None,
        **_: Any,
    ) -> None:
        if module is not None:
            raise NotImplementedError("zero.Init(module=...) is not supported; build the model inside the context")
        if remote_device not in (None, "none") or mpu is not None or data_parallel_group is not None:
            raise NotImplementedError(
                "zero.Init supports neither remote_device (offload), mpu nor data_parallel_group yet"
            )
        self._enabled = enabled
        self._config = config_dict_or_path if config_dict_or_path is not None else config
        self._dtype = dtype
        self._depth: dict[int, int] = {}
        self._patched: list[tuple[type, Any, Any]] = []  # (class, its __init__, our wrapper)
        self._open = False

    # ------------------------------------------------------------------ context
    def __enter__(self) -> Init:
        if not self._enabled:
            return self
        from partita.config import load_config
        from partita.distributed.init import current_device, init_distributed

        cfg = load_config(self._config if self._config is not None else {})
        init_distributed(backend=cfg.distributed.backend, timeout_seconds=cfg.distributed.timeout_seconds)
        self._device = current_device()
        precision = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision]
        self._dtype = self._dtype or precision
        self._world, self._rank = dist.get_world_size(), dist.get_rank()
        self._open = True
        for cls in _all_module_classes():
            self._wrap_init(cls)
        self._orig_init_subclass = nn.Module.__dict__.get("__init_subclass__")
        context = self

        def init_subclass(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            context._wrap_init(cls)  # classes defined inside the context too

        nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._orig_apply = nn.Module.apply
        nn.Module.apply = _gathering_apply
        self._access = _ShardedParamAccess()
        self._access.__enter__()
        init_contexts_opened(+1)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._enabled:
            return
        self._access.__exit__(None, None, None)
        init_contexts_opened(-1)
        self._open = False  # every wrapper of this context only forwards from now on
        for cls, original, wrapped in reversed(self._patched):
            # A class defined inside the context is wrapped while its ``class`` statement runs
            # (``__init_subclass__``), before its decorators: one that replaced ``__init__`` in
            # turn (transformers' ``use_kernelized_func``) calls our wrapper. Putting the original
            # back would drop that decorator's ``__init__``; leave it, ours now only forwards.
            if cls.__dict__.get("__init__") is wrapped:
                cls.__init__ = original
        self._patched.clear()
        if self._orig_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._orig_init_subclass
        nn.Module.apply = self._orig_apply
        release_free_host_memory()  # the whole parameters freed after sharding (partita/utils/host_memory.py)

    # ------------------------------------------------------------------ patching
    def _wrap_init(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        # Already wrapped by an open context (this one, or an outer one). The marker names its
        # context: a decorator's ``functools.wraps`` copies it onto its own ``__init__``, and one
        # copied from a closed context's wrapper must not stop this context from wrapping.
        owner = getattr(original, "_partita_init_context", None)
        if original is None or (owner is not None and owner._open):
            return
        context = self

        @functools.wraps(original)
        def wrapped(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            if not context._open:  # a wrapper left inside another's (see __exit__)
                original(module, *args, **kwargs)
                return
            key = id(module)
            context._depth[key] = context._depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                context._depth[key] -= 1
            if context._depth[key] == 0:
                del context._depth[key]
                context._shard_direct_params(module)

        wrapped._partita_init_context = self  # type: ignore[attr-defined]
        cls.__init__ = wrapped
        self._patched.append((cls, original, wrapped))

    @torch.no_grad()
    def _shard_direct_params(self, module: nn.Module) -> None:
        from partita.zero.state_dict_guard import guard_module

        for name, param in list(module._parameters.items()):
            if param is None or param in _SHARDS:
                continue
            # After the context (until initialize) its state_dict entries are freed: placeholders then.
            guard_module(module)
            data = param.data.to(device=self._device, dtype=self._dtype if param.is_floating_point() else None)
            data = data.clone() if data.data_ptr() == param.data.data_ptr() else data  # a storage of its own
            per_rank = _shard_numel(data.numel(), self._world)
            start = min(self._rank * per_rank, data.numel())
            shard = torch.zeros(per_rank, dtype=data.dtype, device=data.device)
            piece = data.view(-1)[start : start + per_rank]
            shard[: piece.numel()].copy_(piece)
            param.data = data
            free_param(param, INIT)  # see [Note: freed parameters] in partita/zero/freed.py
            name_params([(f"{type(module).__name__}.{name}", param)])  # initialize names it in the model
            _register(param, shard)


# What ``Module.apply`` runs its function on now, innermost last: that module's sharded parameters
# and those of them an op has made whole (kept whole until the function returns).
_APPLYING: list[tuple[list[nn.Parameter], list[nn.Parameter]]] = []


def _gathering_apply(module: nn.Module, fn) -> nn.Module:
    """``Module.apply`` inside ``zero.Init``: ``fn`` sees each module's sharded parameters whole,
    and what it writes is kept. A parameter is made whole by ``fn``'s first op on it, a gather,
    or only an allocation when that op overwrites all of it (``normal_``, ``zero_``: GPT's and most
    models' initialisation then gathers nothing), and stays whole until ``fn`` returns, so later
    ops on it (``trunc_normal_``'s five) cost no collective."""
    for child in module.children():
        _gathering_apply(child, fn)
    sharded = [p for p in module._parameters.values() if p is not None and p in _SHARDS]
    made_whole: list[nn.Parameter] = []
    _APPLYING.append((sharded, made_whole))
    try:
        fn(module)
    finally:
        _APPLYING.pop()
        for param in made_whole:
            reshard_init_param(param)
    return module


# Ops that overwrite every element of their first argument without reading it: when that
# argument is a whole sharded parameter, its storage is only allocated, not gathered.
_aten = torch.ops.aten
_OVERWRITES = frozenset(
    {_aten.normal_.default, _aten.uniform_.default, _aten.fill_.Scalar, _aten.zero_.default, _aten.copy_.default}
)


class _ShardedParamAccess(TorchDispatchMode):
    """Runs every op on a construction-sharded parameter on its whole value (see [Note:
    initialisation after sharding]). Ops inside ``__torch_dispatch__`` (the gathers) do not
    re-enter the mode: torch pops it while the handler runs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        freed: list[nn.Parameter] = []
        for tensor in tensors:
            param = _param_of_storage(tensor)
            if param is not None and is_freed(param) and all(p is not param for p in freed):
                freed.append(param)
        if not freed:
            return func(*args, **kwargs)
        if func.is_view:
            # A view reads nothing but is checked against the storage's size: give the storage its
            # size (no gather) while the view is made. Later ops on the view are seen like any other.
            with storage_sized(freed):
                return func(*args, **kwargs)
        applying = _APPLYING[-1] if _APPLYING else None
        kept: list[nn.Parameter] = []  # whole until Module.apply's function returns (_gathering_apply)
        for param in freed:
            if func in _OVERWRITES and _overwrites_whole(args, tensors, param):
                allocate_param(param)  # no gather: the op writes every element
            else:
                gather_init_param(param)
            if applying is not None and any(p is param for p in applying[0]):
                applying[1].append(param)
                kept.append(param)
        try:
            return func(*args, **kwargs)
        finally:
            for param in freed:
                if all(p is not param for p in kept):
                    reshard_init_param(param)


def _overwrites_whole(args: tuple, tensors: list[torch.Tensor], param: nn.Parameter) -> bool:
    """True if the op's first argument is all of ``param`` and no other argument reads it."""
    target = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if target is None or _param_of_storage(target) is not param:
        return False
    if target.numel() != param.numel() or target.storage_offset() != 0 or not target.is_contiguous():
        return False
    return all(t is target or _param_of_storage(t) is not param for t in tensors)


def _all_module_classes() -> list[type]:
    seen, stack = [], [nn.Module]
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.append(cls)
            stack.extend(cls.__subclasses__())
    return seen
