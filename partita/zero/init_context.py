"""``partita.zero.Init``: build a model already sharded, so no rank ever holds it whole.

Inside the context, every module's parameters are cut into this rank's 1/N shard as soon as
the module's ``__init__`` returns (the outermost ``__init__`` of that instance, so subclass
initialisers still see whole tensors). Each parameter is created whole once, on this rank's
device, initialised by the module's own code with the same random stream as an unsharded
build, then reduced to its shard: peak memory is one module's parameters, not the model's.

Initialisation that runs after children are built (a parent's ``_init_weights``) must go
through ``module.apply(fn)``, which the context makes gather each module's parameters around
``fn`` and keep what ``fn`` wrote, or through :class:`partita.zero.GatheredParameters`. Direct
access to a child's parameter outside those fails loudly (it has no storage), never silently.
As in DeepSpeed, this is the contract of construction-time sharding.

``initialize`` then builds the fp32 master shards from these shards; at ZeRO-3 the
parameters stay sharded, at stages 0-2 they are gathered whole once.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from partita.distributed import collectives

# Parameter -> this rank's shard (1-D, the layout of partita.zero.partition with alignment 1).
_SHARDS = WeakIdKeyDictionary()


def init_shard_of(param: nn.Parameter) -> torch.Tensor | None:
    return _SHARDS.get(param)


def _shard_numel(numel: int, world: int) -> int:
    return math.ceil(numel / world)


@torch.no_grad()
def gather_init_param(param: nn.Parameter) -> None:
    """Give a construction-sharded parameter its full storage and values back (collective)."""
    shard = _SHARDS[param]
    world = dist.get_world_size()
    full = torch.empty(world * shard.numel(), dtype=shard.dtype, device=shard.device)
    collectives.all_gather_into_tensor(full, shard, group=None, purpose="zero.Init parameter gather")
    param.data.untyped_storage().resize_(param.numel() * param.element_size())
    param.data.view(-1).copy_(full[: param.numel()])


@torch.no_grad()
def reshard_init_param(param: nn.Parameter) -> None:
    """Keep this rank's slice of the (possibly modified) whole parameter and free the rest."""
    shard = _SHARDS[param]
    start = min(dist.get_rank() * shard.numel(), param.numel())
    piece = param.data.view(-1)[start : start + shard.numel()]
    shard.zero_()
    shard[: piece.numel()].copy_(piece)
    param.data.untyped_storage().resize_(0)


@torch.no_grad()
def materialize_init_params(params: list[nn.Parameter]) -> None:
    """Stages 0-2 need whole parameters: gather every construction-sharded one, for good."""
    for param in params:
        if param in _SHARDS:
            gather_init_param(param)
            del _SHARDS[param]


def forget_init_shards(params: list[nn.Parameter]) -> None:
    for param in params:
        _SHARDS.pop(param, None)


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
        self._patched: list[tuple[type, Any]] = []

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
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._enabled:
            return
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched.clear()
        if self._orig_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._orig_init_subclass
        nn.Module.apply = self._orig_apply

    # ------------------------------------------------------------------ patching
    def _wrap_init(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_partita_wrapped", False):
            return
        context = self

        @functools.wraps(original)
        def wrapped(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            key = id(module)
            context._depth[key] = context._depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                context._depth[key] -= 1
            if context._depth[key] == 0:
                del context._depth[key]
                context._shard_direct_params(module)

        wrapped._partita_wrapped = True  # type: ignore[attr-defined]
        cls.__init__ = wrapped
        self._patched.append((cls, original))

    @torch.no_grad()
    def _shard_direct_params(self, module: nn.Module) -> None:
        for name, param in list(module._parameters.items()):
            if param is None or param in _SHARDS:
                continue
            data = param.data.to(device=self._device, dtype=self._dtype if param.is_floating_point() else None)
            data = data.clone() if data.data_ptr() == param.data.data_ptr() else data  # a storage of its own
            per_rank = _shard_numel(data.numel(), self._world)
            start = min(self._rank * per_rank, data.numel())
            shard = torch.zeros(per_rank, dtype=data.dtype, device=data.device)
            piece = data.view(-1)[start : start + per_rank]
            shard[: piece.numel()].copy_(piece)
            param.data = data
            param.data.untyped_storage().resize_(0)
            _SHARDS[param] = shard


def _gathering_apply(module: nn.Module, fn) -> nn.Module:
    """``Module.apply`` inside ``zero.Init``: each module's sharded parameters are whole while
    ``fn`` runs on it, and what ``fn`` writes is kept."""
    for child in module.children():
        _gathering_apply(child, fn)
    sharded = [p for p in module._parameters.values() if p is not None and p in _SHARDS]
    for param in sharded:
        gather_init_param(param)
    try:
        fn(module)
    finally:
        for param in sharded:
            reshard_init_param(param)
    return module


def _all_module_classes() -> list[type]:
    seen, stack = [], [nn.Module]
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.append(cls)
            stack.extend(cls.__subclasses__())
    return seen
