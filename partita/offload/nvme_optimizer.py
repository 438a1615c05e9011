"""ZeRO-Infinity optimizer offload to NVMe: optimizer states in swap files, stepped sub-group by sub-group.

With ``zero_optimization.offload_optimizer.device: "nvme"`` everything of the ``"cpu"`` offload
holds (the fp32 master partition and its fp32 gradient partition live in host memory, gradients
and weights cross through :class:`~partita.offload.transfer.HostTransfer`), and in addition the
optimizer *state* tensors shaped like the master (Adam's ``exp_avg``/``exp_avg_sq``, SGD's
``momentum_buffer``, Lion's ``exp_avg``) live in swap files (:class:`NvmeSwapStore`), not in
memory. Host memory for states is bounded by ``buffer_count`` buffers of at most
``sub_group_size`` elements (:class:`PinnedBufferPool`), whatever the model size.

Partita's simplification, honestly stated: DeepSpeed also swaps the fp32 master weights; partita
keeps them in host memory, so 4 of the 12 bytes per parameter of Adam's optimizer memory stay in
RAM (8 go to disk). The master is read for every parameter write-back and gradient norm anyway.

How a step works (:meth:`SwappedOptimizerStates.step`): each offloaded group's master partition
is cut into ranges of at most ``sub_group_size`` elements. For each range, its state tensors are
read from disk into pool buffers, a persistent torch optimizer of the inner optimizer's class
("proxy") steps the range — its parameter is a view ``master[lo:hi]`` (a leaf: the master does
not require grad) whose ``.grad`` is ``master.grad[lo:hi]``, its state is the buffers, its
options are copied from ``inner.param_groups[g]`` every step (so LR schedulers, which drive the
inner optimizer, keep working) — and the buffers are written back. ``pipeline_read`` reads the
next range while this one steps; ``pipeline_write`` writes a stepped range while the next one
steps, and lets the last ranges' writes finish after ``step`` returns (on a helper thread, while
the caller uploads the weights and runs the next forward and backward). With ``pipeline_read``,
the end of a step (after those writes) also starts reading the next step's first ranges into the
buffers just freed (as many as the pool holds), so those reads overlap the next forward and
backward too; they are kept across steps in ``buffer_count`` buffers that exist anyway. Order is
kept where it matters: the next step, a checkpoint save and a load first wait for the deferred
writes (:meth:`SwappedOptimizerStates.drain`), and a load drops the prefetched buffers before it
rewrites the files. Each step records its traffic and timing in ``last_step``
(:mod:`partita.offload.swap_stats`).

Why stepping ranges separately is exact: the supported optimizers (:data:`SWAPPABLE_OPTIMIZERS`)
are element-wise — each element's update depends only on that element's weight, gradient and
state and on per-parameter scalars (the step count), which every range keeps identically. The
step count lives in each proxy's state (every range of a group is stepped at every applied step,
so the counts agree). The first step lets torch create the states exactly as it would for the
whole partition (zeros for Adam/Lion, a copy of the gradient for SGD's momentum), then they are
copied into the buffers and written: no optimizer-specific initialisation code.

Checkpoints: :meth:`materialize` reads every state into full tensors in ``inner.state[master]``
for the duration of a save's capture; :meth:`release` drops them again, or — after a load —
writes the loaded values to the swap files first. Saving therefore needs host memory for the
whole partition's optimizer states while the save runs (what ``"cpu"`` offload holds always).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from partita.config.base import ConfigError
from partita.offload.buffer_pool import PinnedBufferPool
from partita.offload.config import AioConfig, OffloadOptimizerConfig
from partita.offload.errors import BufferPoolError, NvmeSwapError
from partita.offload.finalizers import Closer
from partita.offload.nvme import NvmeSwapStore
from partita.offload.nvme_ranges import Range as _Range
from partita.offload.nvme_ranges import Slot as _Slot
from partita.offload.nvme_ranges import cut as _cut
from partita.offload.nvme_ranges import probe_state as _probe_state
from partita.offload.nvme_pass import SwapPass
from partita.offload.swap_stats import SwapStepStats
from partita.optim.lion import Lion

if TYPE_CHECKING:
    from partita.zero.shard_group import ShardedParamGroup

# Optimizers whose update is element-wise (see the module docstring), so a range steps exactly
# as it would inside the whole partition. Exact classes: a subclass may override step().
SWAPPABLE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    Lion,
)

_STORE_IDS = itertools.count()  # one swap directory per engine in a process (tags must differ)


def _close(tail: cf.ThreadPoolExecutor, store: NvmeSwapStore, pool: PinnedBufferPool) -> None:
    tail.shutdown(wait=True)  # its writes land and its prefetch is submitted before the store closes
    store.close()
    pool.close()


class SwappedOptimizerStates:
    """Optimizer states of the offloaded groups in NVMe swap files, stepped sub-group by sub-group.

    Args:
        groups: the ZeRO groups (``ShardedOptimizer.groups``); only offloaded ones are swapped.
        inner: the inner optimizer; its class and per-group options are used, never its ``step``
            for the swapped groups.
        offload: the ``offload_optimizer`` section (``nvme_path``, ``buffer_count``, ``pipeline_read``,
            ``pipeline_write``; ``pin_memory`` does not apply to the state buffers: they never cross PCIe).
        sub_group_size: ``zero_optimization.sub_group_size``, elements per range.
        aio: the root ``aio`` section (block I/O knobs of the swap store).
        swapped: indices of the groups to swap (the NVMe tier); None: every offloaded group.
    """

    def __init__(
        self,
        groups: list[ShardedParamGroup],
        inner: torch.optim.Optimizer,
        *,
        offload: OffloadOptimizerConfig,
        sub_group_size: int,
        aio: AioConfig,
        swapped: Sequence[int] | None = None,
    ) -> None:
        cls = type(inner)
        if cls not in SWAPPABLE_OPTIMIZERS:
            raise NotImplementedError(
                f"zero_optimization.offload_optimizer.device \"nvme\" steps the optimizer one sub-group at a time, "
                f"which is exact only for element-wise optimizers partita knows: "
                f"{', '.join(c.__module__ + '.' + c.__qualname__ for c in SWAPPABLE_OPTIMIZERS)} (from the config's "
                f"Adam/AdamW/SGD/Lion, or an instance of exactly one of these). This run's optimizer is "
                f"{cls.__module__}.{cls.__qualname__} (8-bit optimizers keep block-quantised state, and an optimizer "
                "partita did not build may not be element-wise). Set offload_optimizer.device to \"cpu\" (states in "
                "host memory), or use one of those optimizers"
            )
        self.groups = groups
        # Tiered placement (device "auto") offloads some groups to host memory only: ``swapped``
        # names the NVMe tier's groups; by default every offloaded group is swapped.
        self.swapped_groups = (
            [g for g, group in enumerate(groups) if group.offloaded] if swapped is None else sorted(swapped)
        )
        self.pipeline_read = bool(offload.pipeline_read)
        self.pipeline_write = bool(offload.pipeline_write)
        # overlap_step_with_forward: ranges in the forward's order (last first), so the first
        # modules' weights are stepped first; also for the unoverlapped first step, so the
        # read-ahead it leaves is the next (overlapped) step's first ranges.
        self.forward_order = bool(offload.overlap_step_with_forward)
        # The overlapped step's order across groups (partita/offload/overlapped_update.py sets it).
        self.unit_order: Callable[[_Range], Any] | None = None
        self.sub_group_size = int(sub_group_size)
        self._specs = {g: _probe_state(cls, self._options(inner, g)) for g in self.swapped_groups}
        # A group's files hold valid state only after its first applied step (or a load).
        self._initialised = {g: False for g in self.swapped_groups}
        self._prefetched: deque[_Slot] = deque()  # the next step's first ranges, reads started (_prefetch)
        # One helper thread finishes a step's last writes after the step returns (_finish_tail).
        self._tail = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="partita-swap-tail")
        self._tail_future: cf.Future | None = None
        self.last_step: SwapStepStats | None = None  # traffic and timing of the latest step
        self.totals = SwapStepStats(steps=0)  # summed over every step so far
        self._logged = SwapStepStats(steps=0)  # totals at the last window_metrics()
        wide = {k: d for spec in self._specs.values() for k, d in spec.swapped.items() if d.itemsize > 4}
        if wide:
            raise NotImplementedError(
                f"optimizer states {wide} are wider than 4 bytes per element; the NVMe swap buffers are fp32-sized. "
                "Keep fp32 (or narrower) optimizer states, or use offload_optimizer.device \"cpu\""
            )
        self._check_buffer_count(cls, offload.buffer_count)

        self.store = NvmeSwapStore(
            offload.nvme_path, aio=aio, buffer_count=offload.buffer_count, tag=f"optimizer{next(_STORE_IDS)}",
            config_key="zero_optimization.offload_optimizer.nvme_path",
        )
        try:
            self._ranges: dict[int, list[_Range]] = {g: self._build_ranges(cls, inner, g) for g in self.swapped_groups}
            self.store.allocate(
                {
                    key: (unit.numel, self._specs[g].swapped[state_key])
                    for g, units in self._ranges.items()
                    for unit in units
                    for state_key, key in unit.swap_keys.items()
                }
            )
            widest = max((unit.numel for units in self._ranges.values() for unit in units), default=1)
            # Never page-locked, whatever pin_memory says: states only move between disk and host
            # memory (the step runs on the host), and O_DIRECT needs alignment, not pinning. Pinning
            # would lock memory no copy engine reads, rounded up to a power of two by torch's
            # pinned allocator (a 200 MB buffer takes 256 MB), beyond what `partita estimate` counts.
            self.pool = PinnedBufferPool(
                count=offload.buffer_count, numel=widest, dtype=torch.float32, pin=False,
                name="nvme optimizer states",
            )
        except BaseException:
            self.store.close()
            raise
        # Remove the swap files when the optimizer goes away (the store also does at exit); when the
        # garbage collector finds it on another thread, the close runs on a thread of its own
        # (partita/offload/finalizers.py: that thread may be one of the store's own).
        self._finalizer = Closer(self, _close, self._tail, self.store, self.pool)

    # ---- setup -----------------------------------------------------------------------------
    @staticmethod
    def _options(inner: torch.optim.Optimizer, g: int) -> dict[str, Any]:
        return {k: v for k, v in inner.param_groups[g].items() if k != "params"}

    def _check_buffer_count(self, cls: type, buffer_count: int) -> None:
        most = max((len(spec.swapped) for spec in self._specs.values()), default=0)
        keys = next((list(s.swapped) for s in self._specs.values() if len(s.swapped) == most), [])
        pipelined = [name for name, on in (("pipeline_read", self.pipeline_read), ("pipeline_write", self.pipeline_write)) if on]
        need = most * (2 if pipelined else 1)
        if buffer_count >= need:
            return
        why = (
            f"{' and '.join(pipelined)} keeps a second sub-group's states in buffers while one steps, so it needs "
            f"2 x {most} = {need}; set buffer_count to at least {need}, or set {' and '.join(pipelined)} to false"
            if pipelined
            else f"set buffer_count to at least {need}"
        )
        raise ConfigError(
            f"zero_optimization.offload_optimizer.buffer_count={buffer_count}: with device \"nvme\" every state "
            f"tensor of a sub-group needs one buffer, and {cls.__qualname__} keeps {most} per parameter "
            f"({', '.join(keys)}); {why}"
        )

    def _build_ranges(self, cls: type[torch.optim.Optimizer], inner: torch.optim.Optimizer, g: int) -> list[_Range]:
        master = self.groups[g].master
        options = self._options(inner, g)
        units = []
        for index, (lo, hi) in enumerate(_cut(master.numel(), self.sub_group_size)):
            view = master[lo:hi]  # a leaf (the master does not require grad) sharing the master's memory
            units.append(
                _Range(
                    group=g, index=index, lo=lo, hi=hi, view=view,
                    # Built once: no per-step construction. Its state holds only scalars between steps.
                    proxy=cls([{**options, "params": [view]}]),
                    swap_keys={key: f"g{g}.r{index}.{key}" for key in self._specs[g].swapped},
                )
            )
        return units

    # ---- the step --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, inner: torch.optim.Optimizer, used: list[list[bool]]) -> None:
        """Step every swapped group that has a gradient (``master.grad``), then the inner optimizer
        for the other (on-device) groups. Leaves the swapped groups' ``master.grad`` None.

        ``used[g][i]``: whether parameter ``i`` of group ``g`` got a gradient on any rank; the
        states of those that did not are kept (their master weights are restored by the caller,
        partita.zero.unused_params.restore_unused), as the in-memory path does.
        """
        walk = self.begin_step(inner, used)
        while walk.advance() is not None:
            pass
        walk.end()
        # The swapped groups have no .grad now, so torch skips them; any other group (the
        # on-device part under offload_optimizer.ratio < 1) steps as usual. Called even when
        # nothing is left: LR schedulers and step hooks expect the inner optimizer to step.
        inner.step()

    def begin_step(self, inner: torch.optim.Optimizer, used: list[list[bool]],
                   options: list[dict[str, Any]] | None = None) -> SwapPass:
        """Start stepping the swapped groups that have a gradient, one range per
        :meth:`SwapPass.advance`, then :meth:`SwapPass.end`. ``options``: every group's options as
        taken when the step was decided (``pipelined_step.snapshot_options``, for a step that runs
        on after ``step()`` returned); None: the inner optimizer's current ones."""
        units = [u for g in self.swapped_groups if self.groups[g].master.grad is not None for u in self._ranges[g]]
        if self.unit_order is not None:
            units.sort(key=self.unit_order)  # ranges are independent (element-wise): exact in any order
        elif self.forward_order:
            units.reverse()
        try:
            self._join_tail()  # the previous step's last writes: done before any file is read again
            return SwapPass(self, inner, units, used, options)
        except BaseException:
            self._clear_grads()
            raise

    def has_state(self, g: int) -> bool:
        """Whether swapped group ``g``'s files hold its optimizer state (after its first applied step or a load)."""
        return self._initialised[g]

    def _clear_grads(self) -> None:
        for g in self.swapped_groups:
            self.groups[g].master.grad = None

    def drain(self) -> None:
        """Wait for the writes a step left in flight (``pipeline_write``) and for the prefetch
        submission after them; raises what failed there. Steps and checkpoints call it first."""
        self._join_tail()

    def _join_tail(self) -> None:
        future, self._tail_future = self._tail_future, None
        if future is not None:
            future.result()  # an NvmeSwapError of a deferred write names its file

    def _finish_tail(self, behind: deque[_Slot], units: list[_Range]) -> None:
        try:
            while behind:
                self._retire(behind.popleft(), None)
        except BaseException:
            for slot in behind:
                cf.wait(slot.writes)
                self._release(slot)
            raise
        self._prefetch(units)

    def _open_slot(self, unit: _Range, behind: deque[_Slot], stats: SwapStepStats | None) -> _Slot:
        """Take buffers for ``unit``'s states (waiting for earlier writes to free some) and start
        reading them; a group not stepped yet has nothing on disk to read."""
        need = len(unit.swap_keys)
        while self.pool.capacity - self.pool.in_use < need and behind:
            self._retire(behind.popleft(), stats)
        buffers = [self.pool.acquire() for _ in range(need)]
        tensors = {}
        for buffer, (state_key, dtype) in zip(buffers, self._specs[unit.group].swapped.items()):
            if dtype == torch.float32:
                tensors[state_key] = buffer[: unit.numel]
            else:  # narrower states (bf16) use the front of an fp32 buffer
                tensors[state_key] = buffer.view(torch.uint8)[: unit.numel * dtype.itemsize].view(dtype)
        slot = _Slot(unit, buffers, tensors)
        if self._initialised[unit.group]:
            try:
                for state_key, key in unit.swap_keys.items():
                    slot.reads.append(self.store.read(key, tensors[state_key]))
                    slot.read_bytes += tensors[state_key].nbytes
            except BaseException:
                cf.wait(slot.reads)
                self._release(slot)
                raise
        return slot

    def window_metrics(self) -> dict[str, float]:
        """Per-step means since the previous call (the step log's ``nvme_*`` values)."""
        window = self.totals.minus(self._logged)
        self._logged = dataclasses.replace(self.totals)
        return window.log_metrics()

    # ---- prefetch: the next step's first ranges, read while forward and backward run ---------
    def _prefetch(self, units: list[_Range]) -> None:
        """With ``pipeline_read``, start reading the first ranges of the next step now, into the
        buffers this step has just freed: their reads then overlap the next forward and backward
        instead of delaying the next step. Exact: a state file changes only in a step or a load,
        and a load drops the prefetched buffers first (:meth:`_drop_prefetched`)."""
        if not self.pipeline_read:
            return
        for unit in units:
            need = len(unit.swap_keys)
            if not need or not self._initialised[unit.group] or self.pool.capacity - self.pool.in_use < need:
                break
            try:
                self._prefetched.append(self._open_slot(unit, deque(), None))
            except (NvmeSwapError, BufferPoolError):
                break  # the next step reads this range itself, and reports the error there

    def _take_prefetched(self, units: list[_Range]) -> deque[_Slot]:
        """The prefetched slots that are this step's first units, in order; the others are dropped
        (a group without a gradient this step)."""
        ready: deque[_Slot] = deque()
        prefetched, self._prefetched = self._prefetched, deque()
        for k, slot in enumerate(prefetched):
            if len(ready) == k and k < len(units) and slot.unit is units[k]:
                ready.append(slot)
            else:
                cf.wait(slot.reads)
                self._release(slot)
        return ready

    def _drop_prefetched(self) -> None:
        """Wait for the prefetched reads and give their buffers back (before the files change)."""
        prefetched, self._prefetched = self._prefetched, deque()
        for slot in prefetched:
            cf.wait(slot.reads)
            self._release(slot)

    def _step_range(self, inner: torch.optim.Optimizer, slot: _Slot, used: list[list[bool]],
                    options: list[dict[str, Any]] | None = None) -> None:
        unit = slot.unit
        group = self.groups[unit.group]
        initialised = self._initialised[unit.group]
        proxy_group = unit.proxy.param_groups[0]
        # lr, betas, weight_decay ... as the scheduler set them (or as snapshotted for this step).
        source = inner.param_groups[unit.group] if options is None else options[unit.group]
        for key, value in source.items():
            if key != "params" and not key.startswith("_"):
                proxy_group[key] = value
        state = unit.proxy.state[unit.view]
        if initialised:
            state.update(slot.tensors)
        # Parameters without a gradient on any rank keep their states (see ShardedOptimizer.step).
        kept = []
        if initialised:
            for spec, was_used in zip(group.layout.specs, used[unit.group]):
                lo = max(spec.partition_offset, unit.lo)
                hi = min(spec.partition_offset + spec.shard_numel, unit.hi)
                if not was_used and lo < hi:
                    kept += [(t[lo - unit.lo : hi - unit.lo], t[lo - unit.lo : hi - unit.lo].clone()) for t in slot.tensors.values()]
        unit.view.grad = group.master.grad[unit.lo : unit.hi]
        # The step's unscale + clip when the fused kernel applies it (ShardedOptimizer._apply_update).
        unit.proxy.grad_scale = getattr(inner, "grad_scale", None) if options is None else options[unit.group]["_grad_scale"]
        try:
            unit.proxy.step()
        finally:
            unit.view.grad = None
            del unit.proxy.grad_scale
        for view, saved in kept:
            view.copy_(saved)
        created = {k for k, v in state.items() if torch.is_tensor(v) and v.shape == unit.view.shape}
        if created != set(slot.tensors):
            raise RuntimeError(
                f"{type(unit.proxy).__qualname__} keeps per-parameter state {sorted(created)} in param group "
                f"{unit.group}, but the probe at start found {sorted(slot.tensors)}; the swap files cannot hold it. "
                "Use offload_optimizer.device \"cpu\""
            )
        for key, target in slot.tensors.items():
            value = state.pop(key)  # between steps the proxy holds only scalars (the step count)
            if value.data_ptr() != target.data_ptr():
                target.copy_(value)  # first step: torch created the state; keep it in the buffer

    def _finish(self, futures: list[cf.Future]) -> None:
        for future in futures:
            future.result()  # raises NvmeSwapError naming the file

    def _retire(self, slot: _Slot, stats: SwapStepStats | None) -> None:
        started = time.perf_counter()
        try:
            cf.wait(slot.writes)
            self._finish(slot.writes)
        finally:
            self._release(slot)
            if stats is not None:
                stats.write_wait_s += time.perf_counter() - started

    def _release(self, slot: _Slot) -> None:
        buffers, slot.buffers = slot.buffers, []
        for buffer in buffers:
            self.pool.release(buffer)

    # ---- checkpoints -----------------------------------------------------------------------
    @torch.no_grad()
    def materialize(self, inner: torch.optim.Optimizer) -> None:
        """Read every swapped group's states into full tensors in ``inner.state[master]``.

        Groups not stepped yet get no state, as in memory. Undo with :meth:`release`.
        """
        self._join_tail()
        for g in self.swapped_groups:
            if not self._initialised[g]:
                continue
            master = self.groups[g].master
            spec = self._specs[g]
            full = {key: torch.empty(master.numel(), dtype=dtype) for key, dtype in spec.swapped.items()}
            reads = [
                self.store.read(swap_key, full[key][unit.lo : unit.hi])
                for unit in self._ranges[g]
                for key, swap_key in unit.swap_keys.items()
            ]
            cf.wait(reads)
            self._finish(reads)
            first = self._ranges[g][0] if self._ranges[g] else None
            scalars = dict(first.proxy.state[first.view]) if first is not None else {}
            inner.state[master] = {
                key: full[key] if key in full else _copy(scalars[key]) for key in spec.order if key in full or key in scalars
            }

    @torch.no_grad()
    def release(self, inner: torch.optim.Optimizer, *, write_back: bool) -> None:
        """Drop the swapped groups' states from ``inner.state``; with ``write_back`` (after a load)
        first write them to the swap files and hand their scalars to the proxies."""
        self._join_tail()
        if write_back:
            self._drop_prefetched()  # the loaded states replace what the prefetch read
        for g in self.swapped_groups:
            state = inner.state.pop(self.groups[g].master, None)
            if write_back:
                self._absorb(g, state or {})

    def _absorb(self, g: int, state: dict[str, Any]) -> None:
        spec = self._specs[g]
        master = self.groups[g].master
        shaped = {k for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape}
        if not state:
            # No state saved for this group (saved before its first step): start fresh, as in memory.
            for unit in self._ranges[g]:
                unit.proxy.state.pop(unit.view, None)
            self._initialised[g] = False
            return
        if shaped != set(spec.swapped):
            raise NotImplementedError(
                f"the loaded optimizer state of param group {g} has per-element tensors {sorted(shaped)}, but this "
                f"run's optimizer (with its current options) keeps {sorted(spec.swapped)} in the NVMe swap files; "
                "resume with the optimizer options that saved it (e.g. amsgrad), or offload_optimizer.device \"cpu\""
            )
        writes = []
        try:
            for unit in self._ranges[g]:
                for key, swap_key in unit.swap_keys.items():
                    writes.append(self.store.write(swap_key, state[key][unit.lo : unit.hi].to(spec.swapped[key]).contiguous()))
                unit.proxy.state[unit.view] = {k: _copy(v) for k, v in state.items() if k not in shaped}
        finally:
            cf.wait(writes)
        self._finish(writes)
        self._initialised[g] = True

    # ---- lifetime --------------------------------------------------------------------------
    @property
    def swap_dir(self) -> str:
        return self.store.swap_dir

    def close(self) -> None:
        """Remove the swap files now (also done when this object is collected, and at exit).

        Raises what failed in the last step's deferred writes, after removing the files."""
        try:
            self._join_tail()
        finally:
            self._finalizer()


def _copy(value: Any) -> Any:
    """A private copy of a scalar state entry: each range's proxy counts its own steps."""
    return value.clone() if torch.is_tensor(value) else value
