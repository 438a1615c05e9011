"""``engine.offload_states`` / ``engine.reload_states``: move a training engine's device tensors to
host memory between uses and back, bit for bit (DeepSpeed's API, for colocated RL rollouts: the
generator takes the accelerator while the trainer's states wait in host memory).

[Note: what moves]
DeepSpeed's ``OffloadStateTypeEnum`` names five kinds; here each is a set of tensors found in the
ZeRO pieces (partita/zero/api.py ``ZeroState``):

- ``optim_states``: the inner torch optimizer's state tensors of every master partition (Adam's
  moments, 8-bit optimizers' quantised states and scales);
- ``hp_params``: the fp32 master partitions (shard_group.py ``ShardedParamGroup.master``);
- ``lp_params``: the model's parameters that are whole on this rank (stages 0-2: all; ZeRO-3: the
  persistent ones) and ZeRO-3's low-precision shards (param_offload.py ``DeviceShards`` and the
  frozen parameters' ``FrozenShards``). DeepSpeed before 0.16.5 left the 16-bit weights behind;
- ``lp_grads``: ``param.grad`` of the model's parameters (stages 0/1 accumulate there);
- ``contiguous_grad_buffer``: the fp32 gradient partitions and fp32 accumulation sums the reducer
  (reducer.py) fills during backward. Between steps they do not exist (freed after each step), so
  this kind usually moves nothing.

What already lives in host memory by design stays where it is and is not copied again: the masters,
optimizer states and gradient buffers of ``offload_optimizer`` groups (cpu or nvme), and
``offload_param`` shards (cpu or nvme). On a machine whose accelerator *is* the CPU (the tests),
everything else is still copied into fresh host storage, so the move and its exactness are testable.

[Note: how a tensor moves]
Tensors are grouped by storage. Each storage is copied byte for byte into one host buffer (page-locked
when ``pin_memory`` and the storage is on CUDA), and every known tensor on it is re-pointed by
``tensor.data = <the same view of the host buffer>``: the Python objects stay the same (the inner
optimizer's state is keyed by the master object, the shard storage and the reducer hold the same
objects), views that shared a storage still share one (stage 0 in fp32: the parameters are views of
the master), and the device storage loses its last reference and is freed. Reload is the same in
the other direction, into a fresh device storage. Nothing is cast or recomputed, so training after a
reload is bit-identical to training without the round trip. Resizing the device storage to 0 bytes
in place (as ZeRO-3 frees parameters) would keep even unknown aliases consistent, but then any read
of an offloaded tensor (a user's ``p.sum()``) would read unallocated memory: a segfault on CPU.

A storage still referenced by a tensor found nowhere above (an autograd graph kept alive, a
``state_dict()`` entry) keeps its device memory and would not see later updates: such storages are
counted and logged with their kind (``OffloadedStates.still_shared_bytes``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import nn

from partita.zero.api import ZeroState
from partita.zero.freed import is_freed

logger = logging.getLogger("partita")

__all__ = ["KINDS", "OffloadDeviceEnum", "OffloadStateTypeEnum", "OffloadedStates", "parse_include", "parse_device"]


class OffloadStateTypeEnum(str, Enum):
    """DeepSpeed's ``deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum``: the kinds ``include`` names."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class OffloadDeviceEnum(str, Enum):
    """DeepSpeed's ``OffloadDeviceEnum``; ``offload_states`` takes ``cpu`` only, as DeepSpeed's does."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


# The kinds, in DeepSpeed's order.
KINDS = tuple(kind.value for kind in OffloadStateTypeEnum)


def parse_include(include) -> tuple[str, ...]:
    """The kinds ``include`` names (None: all), in :data:`KINDS` order. Accepts DeepSpeed's enum
    members (``OffloadStateTypeEnum.optim_states``: a ``str`` enum), plain strings, or one string."""
    if include is None:
        return KINDS
    if isinstance(include, str) or hasattr(include, "value"):
        include = [include]
    try:
        names = [getattr(item, "value", item) for item in include]
    except TypeError:
        raise ValueError(f"offload_states(include=...): expected a list of state kinds, got {include!r}; valid "
                         f"kinds: {', '.join(KINDS)} (None: all)") from None
    unknown = [n for n in names if n not in KINDS]
    if unknown:
        raise ValueError(f"offload_states(include=...): unknown state kind(s) {', '.join(map(repr, unknown))}; valid "
                         f"kinds (DeepSpeed's OffloadStateTypeEnum): {', '.join(KINDS)} (None: all)")
    return tuple(k for k in KINDS if k in names)


def parse_device(device) -> torch.device:
    """Only host memory is a destination (as in DeepSpeed, whose ``OffloadDeviceEnum.cpu`` is the one
    ``offload_states`` accepts)."""
    name = getattr(device, "value", device)  # DeepSpeed's OffloadDeviceEnum.cpu
    try:
        target = torch.device(name)
    except (RuntimeError, TypeError):
        target = None
    if target is None or target.type != "cpu":
        raise ValueError(f"offload_states(device={device!r}): states can be offloaded to host memory only; use "
                         "device=\"cpu\" (for NVMe, configure zero_optimization.offload_optimizer / offload_param "
                         "with device \"nvme\")")
    return target


# ---------------------------------------------------------------------------------- finding tensors
def _optim_states(zero: ZeroState) -> Iterator[torch.Tensor]:
    optimizer = zero.optimizer
    if optimizer is None:  # ZeRO-Inference: no optimizer
        return
    for group in optimizer.groups:
        if group.offloaded:  # offload_optimizer: its states live in host memory (or swap files) already
            continue
        for value in optimizer.inner.state.get(group.master, {}).values():
            if isinstance(value, torch.Tensor):
                yield value


def _hp_params(zero: ZeroState) -> Iterator[torch.Tensor]:
    optimizer = zero.optimizer
    if optimizer is None:  # an inference group's "master" is its low-precision shard: lp_params
        return
    for group in optimizer.groups:
        if not group.offloaded:
            yield group.master
            if group.master.grad is not None:
                yield group.master.grad


def _lp_params(module: nn.Module, zero: ZeroState) -> Iterator[torch.Tensor]:
    for param in module.parameters():
        if not is_freed(param):  # ZeRO-3's sharded parameters (and freed one-rank blocks) hold no bytes
            yield param
    gatherer = zero.gatherer
    if gatherer is None:
        return
    if gatherer.shard_location == "accelerator":  # offload_param cpu/nvme: on the host already
        yield from gatherer.shards  # an fp32 device master doubles as the shard (hp_params too)
    if gatherer.frozen is not None:  # frozen zero.Init shards stay on the device (frozen_params.py)
        yield from (gatherer.frozen.shard(p) for p in gatherer.frozen.params)


def _lp_grads(module: nn.Module) -> Iterator[torch.Tensor]:
    for param in module.parameters():
        if param.grad is not None:
            yield param.grad


def _grad_buffers(zero: ZeroState) -> Iterator[torch.Tensor]:
    if zero.optimizer is not None:
        for group in zero.optimizer.groups:
            if group.grad_partition is not None and not group.offloaded:
                yield group.grad_partition
    if zero.reducer is not None:
        # Stages 0/1 with accumulate_in_fp32: the fp32 sums of a window's earlier micro-batches.
        yield from getattr(zero.reducer, "_fp32_sums", {}).values()


def find_tensors(kind: str, module: nn.Module, zero: ZeroState) -> Iterator[torch.Tensor]:
    if kind == "optim_states":
        return _optim_states(zero)
    if kind == "hp_params":
        return _hp_params(zero)
    if kind == "lp_params":
        return _lp_params(module, zero)
    if kind == "lp_grads":
        return _lp_grads(module)
    return _grad_buffers(zero)


# ---------------------------------------------------------------------------------- moving storages
def _key(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return storage.device, storage.data_ptr()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _view(storage: torch.UntypedStorage, like: tuple) -> torch.Tensor:
    dtype, offset, shape, stride = like
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)


def _use_count(storage: torch.UntypedStorage) -> int | None:
    counter = getattr(torch._C, "_storage_Use_Count", None)  # private; without it nothing is checked
    return counter(storage._cdata) if counter is not None else None


@dataclass
class _Moved:
    """One storage in host memory: the tensors re-pointed at it and where it came from."""

    kind: str
    home: torch.device
    host: torch.Tensor  # uint8, the storage's bytes
    tensors: list[torch.Tensor] = field(default_factory=list)
    layouts: list[tuple] = field(default_factory=list)  # (dtype, storage offset, shape, stride) per tensor


@torch.no_grad()
def _repoint(tensors: list[torch.Tensor], layouts: list[tuple], storage: torch.UntypedStorage) -> None:
    for tensor, layout in zip(tensors, layouts):
        tensor.data = _view(storage, layout)


class OffloadedStates:
    """What one engine has in host memory now (built by ``engine.offload_states``)."""

    def __init__(self) -> None:
        self._moved: list[_Moved] = []  # a list: a freed storage's address may be reused
        self.kinds: list[str] = []  # what offload_states was asked for, in KINDS order
        self.moved_bytes: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.still_shared_bytes: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.blocks_forward = False  # lp_params (or a storage they share) moved: a forward would fail
        self._hook = None

    @property
    def active(self) -> bool:
        return bool(self.kinds)

    @torch.no_grad()
    def offload(self, module: nn.Module, zero: ZeroState, include: tuple[str, ...], *, compute_device: torch.device,
                pin_memory: bool, non_blocking: bool) -> dict[str, int]:
        """Move the ``include`` kinds' device tensors into host memory; returns the bytes moved per kind
        by this call (a storage two kinds share is counted under the first one named)."""
        if zero.gatherer is not None:
            zero.gatherer.finish_prefetches()
            if zero.gatherer.num_gathered():
                raise RuntimeError(
                    "engine.offload_states(): ZeRO-3 parameters are gathered right now (inside GatheredParameters, "
                    "a generation session, or between a forward and its backward); call it between training steps, "
                    "outside those blocks")
        # A second call moves only what the first left (its tensors point into our host buffers now).
        done = {id(t) for m in self._moved for t in m.tensors}
        done_storages = {_key(m.host) for m in self._moved}
        lp_keys = {_key(t) for t in _lp_params(module, zero)}  # before anything moves
        by_storage: dict[tuple, _Moved] = {}
        for kind in include:
            for tensor in find_tensors(kind, module, zero):
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0 or id(tensor) in done or _key(tensor) in done_storages:
                    continue
                if compute_device.type != "cpu" and storage.device.type == "cpu":
                    continue  # in host memory already (a CPU 'step' counter, an offloaded group's tensor)
                moved = by_storage.get(_key(tensor))
                if moved is None:
                    moved = by_storage[_key(tensor)] = _Moved(kind, storage.device, host=None)
                if not any(t is tensor for t in moved.tensors):
                    moved.tensors.append(tensor)
                    moved.layouts.append((tensor.dtype, tensor.storage_offset(), tensor.shape, tensor.stride()))
        this_call = dict.fromkeys(KINDS, 0)
        for moved in by_storage.values():
            storage = moved.tensors[0].untyped_storage()
            pin = pin_memory and storage.device.type == "cuda"
            moved.host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            moved.host.copy_(_bytes_of(storage), non_blocking=non_blocking and pin)
            _repoint(moved.tensors, moved.layouts, moved.host.untyped_storage())
            count = _use_count(storage)
            if count is not None and count > 1:  # someone beside this wrapper still holds the device bytes
                self.still_shared_bytes[moved.kind] += storage.nbytes()
            del storage
            this_call[moved.kind] += moved.host.numel()
            self.moved_bytes[moved.kind] += moved.host.numel()
            self._moved.append(moved)
        self.kinds = [k for k in KINDS if k in set(self.kinds) | set(include)]
        self.blocks_forward = self.blocks_forward or bool(lp_keys & by_storage.keys())
        if self.blocks_forward and self._hook is None:
            self._hook = module.register_forward_pre_hook(self._refuse_forward, prepend=True)
        shared = {k: v for k, v in self.still_shared_bytes.items() if v}
        if shared:
            logger.warning("offload_states: %s bytes stay on the device: another tensor (an autograd graph, a "
                           "state_dict() entry) still shares their storage; drop it before offloading", shared)
        _finish_copies(non_blocking, cuda=any(m.home.type == "cuda" for m in by_storage.values()))
        return this_call

    @torch.no_grad()
    def reload(self, *, non_blocking: bool) -> None:
        """Every offloaded storage back on its device, the same tensors pointing at it."""
        cuda = False
        for moved in self._moved:
            device = torch.empty(moved.host.numel(), dtype=torch.uint8, device=moved.home)
            device.copy_(moved.host, non_blocking=non_blocking and moved.host.is_pinned())
            _repoint(moved.tensors, moved.layouts, device.untyped_storage())
            cuda = cuda or moved.home.type == "cuda"
        self._moved.clear()
        self.kinds = []
        self.blocks_forward = False
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if cuda and not non_blocking:
            torch.cuda.synchronize()

    def refuse(self, what: str) -> None:
        """Raise for a call that needs the offloaded states on the device."""
        if self.active:
            raise RuntimeError(
                f"{what}: the engine's states are offloaded to host memory (offload_states(include="
                f"{self.kinds})); call engine.reload_states() first")

    def refuse_weights(self, what: str) -> None:
        """Raise for a call that reads the weights, if they (lp_params) are in host memory."""
        if self.blocks_forward:
            self.refuse(what)

    def _refuse_forward(self, module: nn.Module, args) -> None:
        self.refuse_weights("the model's forward")

    def tensors(self) -> Iterable[torch.Tensor]:
        """Every tensor now pointing into host memory (tests and diagnostics)."""
        return [t for m in self._moved for t in m.tensors]


def _finish_copies(non_blocking: bool, *, cuda: bool) -> None:
    if not cuda:
        return
    if not non_blocking:
        torch.cuda.synchronize()
    # The freed device blocks go back to the driver, so a colocated generator (vLLM) can take them.
    torch.cuda.empty_cache()
