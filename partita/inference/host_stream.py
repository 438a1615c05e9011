"""ZeRO-Inference for one process: a model's block weights live in (pinned) host memory and stream
to the device one block at a time, the next blocks' copies overlapping the current block's compute.

    streamed = HostStreamedWeights(model, "cuda", prefetch=1)   # blocks -> pinned host memory
    model.generate(ids, max_new_tokens=32)                      # each block copied in just before it runs
    streamed.remove()                                           # everything resident on the device again

What streams: the parameters of each *unit* (default: the children of every outermost
``nn.ModuleList``, i.e. the transformer blocks). Everything else (embeddings, final norm, LM head,
every buffer) is moved to the device and stays there. A parameter shared by two units, or by a unit
and the rest of the model, stays resident too (streaming it would drop it under the other user).

How (CUDA): every unit's parameters are kept as host tensors, pinned so that host-to-device copies
run asynchronously on the copy engine. A forward pre-hook on unit ``i`` makes sure unit ``i``'s
copy has been issued, issues the copies of the next ``prefetch`` units (in module order, wrapping
from the last unit to the first: under a KV cache HF ``generate`` runs every block once per token,
so after the last block the next token's first block comes), makes the compute stream wait for unit
``i``'s copy with a CUDA event (never a host sync), and installs the device copies as the unit's
parameters. Copies run on a side stream; each device tensor is ``record_stream``-ed on the compute
stream so the caching allocator reuses its memory only after the compute that read it. A forward
post-hook puts the host tensors back, which drops the device copies. Kernels run asynchronously,
so the host may reach later units' hooks long before the device has finished earlier ones; before
each copy the host therefore waits (on the oldest released unit's event) whenever ``prefetch + 2``
units' copies are alive: the one running, those prefetched, and released ones the device is still
computing. That bounds the device memory of the streamed weights to ``prefetch + 2`` units, plus the
resident rest, and the wait costs the device nothing (it has the queued units to run meanwhile).

torchao-quantized weights (``quantize_weights``) stream as stored: the int8/int4 data and scales
are copied, not a dequantized copy (:mod:`partita.inference.tensor_parts`), so a model whose bf16
weights exceed the GPU can generate from int8 weights in host memory.

On a machine without CUDA the device is the CPU: the same hooks and schedule, with plain
synchronous copies (so tests can check exactness and the schedule there).

Per tensor rank: under tensor parallelism each rank wraps its own (sharded) model; nothing is
shared between ranks. Not compatible with CUDA graphs / ``torch.compile`` of the blocks (the hooks
swap parameters between calls) or with ZeRO-3-partitioned parameters (those are gathered by ZeRO).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from partita.inference.tensor_parts import leaves, map_leaves, stored_nbytes

__all__ = ["HostStreamedWeights", "StreamCounters"]

# torchao formats packed for one device's kernels: their bytes mean nothing to another device's.
_PACKED_FOR = {
    "Int4OpaqueTensor": "cpu",
    "IntxOpaqueTensor": "cpu",
    "Int4TilePackedTo4dTensor": "cuda",
    "Int4Tensor": "cuda",
    "Int4PreshuffledTensor": "cuda",
}


@dataclass
class StreamCounters:
    """What the streaming did, for tests and logs.

    ``fetches``: host-to-device copies issued, per unit (a unit's copy = all its parameters);
    ``prefetch_hits``: pre-hooks that found their unit's copy already issued ahead;
    ``prefetches_issued``: copies issued ahead of their unit's turn; ``prefetches_dropped``: copies
    issued ahead that were dropped unused (the model ran its units in another order);
    ``bytes_copied``: bytes of all copies; ``host_waits``: times the host waited for the device to
    finish a unit before copying the next (it ran ``prefetch + 2`` units ahead; see ``_throttle``).
    """

    fetches: list[int] = field(default_factory=list)
    prefetch_hits: int = 0
    prefetches_issued: int = 0
    prefetches_dropped: int = 0
    bytes_copied: int = 0
    host_waits: int = 0

    @property
    def copies_issued(self) -> int:
        return sum(self.fetches)


class _Done:
    """The CPU's stand-in for a CUDA event: CPU work is finished when the call returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclass
class _Slot:
    """One streamed parameter: where it lives in the model and its host copy."""

    module: nn.Module
    name: str
    host: nn.Parameter


class HostStreamedWeights:
    """Keep the weights of ``model``'s units in host memory and stream them to ``device`` per unit.

    ``units``: the modules whose parameters stream (default: the children of every outermost
    ``nn.ModuleList``, in module order, which is the order they run in); ``prefetch``: how many
    units ahead to copy (0: each copy is issued when its unit starts); ``pin_memory``: pin the host
    copies (CUDA only: the copies are then asynchronous; without pinning they are staged by the
    driver). ``model`` may start anywhere (on the host, for a model larger than the device): the
    units' parameters go to host memory, the rest to ``device``.

    ``remove()`` takes the hooks out and leaves the whole model resident on ``device``;
    ``nbytes_on_host()`` is the bytes of the host copies; ``counters`` is a :class:`StreamCounters`.
    """

    def __init__(self, model: nn.Module, device: torch.device | str, *, units=None, prefetch: int = 1,
                 pin_memory: bool = True) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(
                f"HostStreamedWeights: prefetch must be an int >= 0 (units copied ahead), got {prefetch!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"HostStreamedWeights: device {str(device)!r} is not available "
                                 "(torch.cuda.is_available() is False); stream to device='cpu' instead")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        elif self.device.type != "cpu":
            raise ValueError(f"HostStreamedWeights: device {str(device)!r} is not supported; use 'cuda' or 'cpu'")
        self.model = model
        self._units = _resolve_units(model, units)
        for name, p in model.named_parameters():  # checked before anything moves
            self._check_packing(name, p)
        self.prefetch = min(prefetch, len(self._units) - 1)
        self._cuda = self.device.type == "cuda"
        self._pin = pin_memory and self._cuda
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self.counters = StreamCounters(fetches=[0] * len(self._units))
        self._inflight: dict[int, tuple[list[torch.Tensor], object]] = {}  # unit -> (device copies, event)
        self._running: set[int] = set()
        self._released: deque = deque()  # events marking the end of released units' compute
        self._handles: list = []
        self._slots = self._place(model)
        for index, unit in enumerate(self._units):
            self._handles.append(unit.register_forward_pre_hook(self._make_pre(index)))
            self._handles.append(unit.register_forward_hook(self._make_post(index), always_call=True))

    # -- placement ------------------------------------------------------------------------------

    def _place(self, model: nn.Module) -> list[list[_Slot]]:
        """Host copies for the units' own parameters, everything else onto the device."""
        owner = _owners(model, self._units)
        slots: list[list[_Slot]] = [[] for _ in self._units]
        moved: dict[int, torch.Tensor] = {}  # id(old) -> replacement, so tied parameters stay tied
        for name, module in model.named_modules():
            for pname, p in list(module._parameters.items()):
                if p is None:
                    continue
                index = owner.get(id(p), -1)
                if id(p) not in moved:
                    moved[id(p)] = self._to_host(p) if index >= 0 else self._to_device_param(p)
                new = moved[id(p)]
                if new is not p:
                    module._parameters[pname] = new
                if index >= 0:
                    slots[index].append(_Slot(module, pname, new))
            for bname, b in list(module._buffers.items()):
                if b is not None and b.device != self.device:
                    module._buffers[bname] = map_leaves(b, lambda leaf: leaf.to(self.device))
        return slots

    def _check_packing(self, name: str, p: torch.Tensor) -> None:
        packed = _PACKED_FOR.get(type(p).__name__) if is_traceable_wrapper_subclass(p) else None
        if packed is not None and packed != self.device.type:
            raise ValueError(
                f"HostStreamedWeights: {name} is a {type(p).__name__}, packed for {packed} kernels, and cannot run on "
                f"{self.device.type}; quantize for the device it runs on: "
                f"quantize_weights(model, bits=4, device={self.device.type!r}) before streaming"
            )

    def _to_host(self, p: nn.Parameter) -> nn.Parameter:
        def host(leaf: torch.Tensor) -> torch.Tensor:
            leaf = leaf.detach()
            if leaf.device.type != "cpu":
                leaf = leaf.to("cpu")
            return leaf.pin_memory() if self._pin and not leaf.is_pinned() else leaf

        if p.device.type == "cpu" and not self._pin:
            return p  # already where it should be: no copy of a (possibly huge) host model
        return nn.Parameter(map_leaves(p, host), requires_grad=p.requires_grad)

    def _to_device_param(self, p: nn.Parameter) -> nn.Parameter:
        if p.device == self.device:
            return p
        return nn.Parameter(map_leaves(p, lambda leaf: leaf.detach().to(self.device)), requires_grad=p.requires_grad)

    # -- the schedule ---------------------------------------------------------------------------

    def _new_event(self, stream=None):
        if not self._cuda:
            return _Done()
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _throttle(self) -> None:
        """Keep at most ``prefetch + 2`` units' copies alive on the device (running, prefetched, and
        released units whose compute the device has not finished yet).

        Kernels are queued asynchronously, so the hooks of later units run while the device is still
        computing earlier ones. A released unit's memory is reusable only once its compute is done
        (``record_stream``); without a bound, every new copy would allocate fresh memory and a model
        larger than the device would fill it. So when the host is that far ahead, it waits for the
        oldest released unit's event: the device still has the queued units to run meanwhile, so the
        wait takes no time from the device.
        """
        while self._released and self._released[0].query():
            self._released.popleft()
        while self._released and len(self._inflight) + len(self._released) >= self.prefetch + 2:
            self._released.popleft().synchronize()
            self.counters.host_waits += 1

    def _fetch(self, index: int) -> None:
        """Issue unit ``index``'s host-to-device copies (on the side stream, under CUDA)."""
        self._throttle()
        copies: list[torch.Tensor] = []
        nbytes = 0

        def copy(leaf: torch.Tensor) -> torch.Tensor:
            nonlocal nbytes
            nbytes += leaf.untyped_storage().nbytes()
            return leaf.to(self.device, non_blocking=self._pin, copy=True)

        if self._cuda:
            with torch.cuda.stream(self._copy_stream):
                copies = [map_leaves(slot.host, copy) for slot in self._slots[index]]
        else:
            copies = [map_leaves(slot.host, copy) for slot in self._slots[index]]
        self._inflight[index] = (copies, self._new_event(self._copy_stream))
        self.counters.fetches[index] += 1
        self.counters.bytes_copied += nbytes

    def _make_pre(self, index: int):
        def pre(_module, _args):
            n = len(self._units)
            wanted = [(index + k) % n for k in range(self.prefetch + 1)]
            for stale in [u for u in self._inflight if u not in wanted and u not in self._running]:
                del self._inflight[stale]
                self.counters.prefetches_dropped += 1
            if index in self._inflight:
                self.counters.prefetch_hits += 1
            else:
                self._fetch(index)
            for ahead in wanted[1:]:
                if ahead not in self._inflight and ahead not in self._running:
                    self._fetch(ahead)
                    self.counters.prefetches_issued += 1
            self._install(index)

        return pre

    def _install(self, index: int) -> None:
        copies, event = self._inflight[index]
        if self._cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            for t in copies:
                for leaf in leaves(t):
                    leaf.record_stream(compute)
        for slot, t in zip(self._slots[index], copies):
            slot.module._parameters[slot.name] = nn.Parameter(t, requires_grad=False)
        self._running.add(index)

    def _make_post(self, index: int):
        def post(_module, _args, _output):
            for slot in self._slots[index]:
                slot.module._parameters[slot.name] = slot.host
            if self._inflight.pop(index, None) is not None:
                self._released.append(self._new_event(torch.cuda.current_stream(self.device) if self._cuda else None))
            self._running.discard(index)

        return post

    # -- the rest ---------------------------------------------------------------------------------

    def nbytes_on_host(self) -> int:
        """Bytes of the streamed parameters' host copies, as stored (quantized data stays quantized)."""
        return stored_nbytes(slot.host for unit in self._slots for slot in unit)

    def remove(self) -> nn.Module:
        """Take the hooks out and put every streamed parameter on ``device`` for good; returns the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._inflight.clear()
        self._running.clear()
        self._released.clear()
        for unit in self._slots:
            for slot in unit:
                host = slot.host
                resident = map_leaves(host, lambda leaf: leaf.to(self.device, copy=True))
                slot.module._parameters[slot.name] = nn.Parameter(resident, requires_grad=host.requires_grad)
        self._slots = [[] for _ in self._units]
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()  # the host copies may be freed after this
        return self.model

    def __enter__(self) -> HostStreamedWeights:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _owners(model: nn.Module, units: list[nn.Module]) -> dict[int, int]:
    """id(parameter) -> the index of the one unit it belongs to, or -1: used outside the units, or
    by two of them (every path to it counts, shared modules included)."""
    paths = dict(model.named_modules(remove_duplicate=False))
    unit_paths = [(path, i) for i, u in enumerate(units) for path, m in paths.items() if m is u]
    owner: dict[int, int] = {}
    for path, module in paths.items():
        index = next((i for up, i in unit_paths if path == up or path.startswith(up + ".")), -1)
        for p in module._parameters.values():
            if p is not None:
                owner[id(p)] = index if owner.get(id(p), index) == index else -1
    return owner


def _is_inside(module: nn.Module, unit: nn.Module) -> bool:
    return any(module is m for m in unit.modules())


def _resolve_units(model: nn.Module, units) -> list[nn.Module]:
    if units is None:
        found: list[nn.Module] = []
        for name, module in model.named_modules():
            if isinstance(module, nn.ModuleList) and not any(_is_inside(module, u) for u in found):
                found.extend(module.children())
        if not found:
            raise ValueError(
                f"HostStreamedWeights: {type(model).__name__} has no nn.ModuleList whose children (the blocks) "
                "could stream; pass units=[...] (the modules to stream, in the order they run)"
            )
        return found
    names = dict((id(m), n) for n, m in model.named_modules())
    resolved = []
    for unit in units:
        if isinstance(unit, str):
            try:
                unit = model.get_submodule(unit)
            except AttributeError as e:
                raise ValueError(f"HostStreamedWeights: units names {unit!r}, which is not a submodule of "
                                 f"{type(model).__name__}") from e
        if not isinstance(unit, nn.Module) or id(unit) not in names:
            raise ValueError(f"HostStreamedWeights: every unit must be a submodule of the model (or its name); "
                             f"got {type(unit).__name__}")
        if unit is model:
            raise ValueError("HostStreamedWeights: the model itself cannot be a unit; pass its blocks")
        # A ModuleList has no forward of its own (its hooks would never run): stream its children.
        resolved.extend(unit.children() if isinstance(unit, nn.ModuleList) else [unit])
    if not resolved:
        raise ValueError("HostStreamedWeights: units is empty; pass the modules to stream, or units=None for the "
                         "children of the model's nn.ModuleLists")
    for a in resolved:
        for b in resolved:
            if a is not b and _is_inside(a, b):
                raise ValueError(f"HostStreamedWeights: unit {names[id(a)]!r} lies inside unit {names[id(b)]!r}; "
                                 "units must not overlap")
    if len({id(u) for u in resolved}) != len(resolved):
        raise ValueError("HostStreamedWeights: a unit is listed twice; list each once, in the order they run")
    return resolved
