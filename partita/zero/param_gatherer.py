"""ZeRO stage 3: parameters live as 1/N shards and are gathered just in time, unit by unit.

[Note: units]
A *unit* is a module whose parameters are gathered together by one all-gather before its
forward (and again before its backward) and freed after. Units are the children of every
``nn.ModuleList`` (a transformer's repeated blocks), modules marked with
:func:`set_z3_leaf_modules` (MoE-style blocks gathered whole), and the root module for every
parameter not inside another unit. A parameter belongs to the innermost unit containing
it; a parameter shared by two units (tied weights) belongs to the root, which stays
gathered across the whole forward, so any use of it anywhere is safe. Gathering whole
subtrees (as FSDP2 does per block) rather than every module separately (as DeepSpeed
does) means fewer, larger collectives, and a forward that reads a child's parameter
directly still finds it gathered.

[Note: freeing storage in place]
Autograd saves parameter tensors for backward by reference. To free a parameter without
invalidating those references, its storage is resized to 0 bytes and resized back before
it is needed again; the ``nn.Parameter`` object, its shape and the model's state_dict keys
never change. Every free and refill goes through partita/zero/freed.py (``free_param`` /
``allocate_param``): while freed, reading the parameter's values in any way raises
``ParameterNotGatheredError`` instead of reading unallocated memory, and its metadata (shape,
numel, dtype) stays whole. Each parameter's state (SHARDED or GATHERED) is kept here, keyed by
the parameter, and every transition is checked. ``state_dict()`` neither crashes on a freed
parameter nor loses an entry taken while it was whole: see partita/zero/state_dict_guard.py.

[Note: reuse]
When a unit's forward ends it is normally freed. With ``stage3_max_reuse_distance`` (as in
DeepSpeed), a unit that the trace of the first step (``unit_trace``) says runs again before
other units gather ``max_reuse_distance`` elements is kept whole instead: a block called twice
in one forward, or the last blocks of the forward, whose backward starts right after. Keeping
never takes the elements held whole past ``stage3_max_live_parameters`` (the kept unit plus
everything gathered before its reuse must fit). 0 frees every unit at its end. At world size 1
with the shards on the accelerator a unit is never kept across the forward's end: gathering it
again is a local cast of the master (~0.1 ms for a 50 M-element block on an H200), while a kept
unit sits beside every activation at the start of backward, the step's memory peak (GPT-1.3B
kept ~0.9 G elements, 1.8 GiB, there). Reuse inside the forward (a block called twice) is kept as
before. A unit's backward always ends with its gradient hooks (frozen parameters: the hook on its
inputs, ReleaseAfterBackward) freeing it: the next use is after the optimizer step, with new values.

[Note: rank divergence]: partita/zero/unit_sync.py. The training forward's unit events: traced_forward.py. [Note: holds] (whole until a hold ends): holds.py.
Units' gathers travel exact, as int8 (ZeRO++ qwZ) or FP8 (Float8Linear weights, fp8.all_gather): gather_wire.py.
With ZeRO++ hpZ a unit's backward re-gather stays inside a group of ranks: [Note: the secondary partition], hpz.py.
With one ZeRO rank (shards on the device) a gather is a local fill, and ``stage3_one_rank_resident``
keeps every parameter whole with no unit hook: [Note: one-rank gathers], one_rank_gather.py.

[Note: where shards live]
The shards gathers read from are owned by a ``ShardStorage`` (partita/offload/param_offload.py):
on the parameters' device, or with ``offload_param`` in host memory or NVMe swap files, copied
to the device as part of the gather (so prefetching also prefetches those copies, at world
size 1 too). Persistent parameters stay whole on the device either way. Frozen parameters
built under zero.Init (no master, no group) keep their shards apart, in ``FrozenShards``, and are
gathered with their units all the same (see partita/zero/frozen_params.py).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable

import torch
from torch import nn

from partita.distributed import collectives
from partita.offload.config import AioConfig, OffloadParamConfig
from partita.offload.param_offload import ShardPiece, ShardStorage, UnitPieces, build_shard_storage
from partita.utils.weak_hooks import register_weak_grad_hook
from partita.zero.eval_prefetch import EvalPrefetch
from partita.zero.freed import ZERO3, allocate_param, free_param, is_freed, name_params, share_values
from partita.zero.frozen_params import FrozenShards, fetch_pieces
from partita.zero.gather_state import InFlight, ParamState
from partita.zero.gather_wire import PURPOSE, Wire, refresh_gatherer_fp8_scales, start_all_gather, wire_of
from partita.zero.holds import Holds
from partita.zero.hpz import SecondaryPartition
from partita.zero.one_rank_gather import LocalGather, local_gathers, resident_ignored
from partita.zero.partition import ShardSpec
from partita.zero.shard_group import ShardedParamGroup, unpack_from_columns
from partita.zero.traced_forward import TracedForward
from partita.zero.unit_sync import UnitSync, ranks_agree
from partita.zero.unit_trace import Phase, TraceState, UnitTrace
from partita.zero.unit_owner import assign_units
from partita.zero.units import GatherBeforeBackward, ReleaseAfterBackward, in_backward_pass, through_function, unit_names

class ParameterGatherer(TracedForward):
    """Owns the sharded parameters of stage 3: their low-precision shards, gathering, freeing."""

    # True while a generation session holds every unit for a compiled decode (zero/generation.py).
    hooks_inert = False

    def __init__(
        self,
        model: nn.Module,
        groups: list[ShardedParamGroup],
        *,
        process_group,
        world_size: int,
        persistence_threshold: int,
        prefetch_numel: int = 50_000_000,
        max_live_numel: int = 1_000_000_000,
        max_reuse_distance: int = 1_000_000_000,
        offload_param: OffloadParamConfig | None = None,
        aio: AioConfig | None = None,
        frozen: FrozenShards | None = None,
        quantize_weights: str = "none",
        hpz: SecondaryPartition | None = None,
        one_rank_resident: bool = False,
    ) -> None:
        self._groups = groups
        # ZeRO++ qwZ: "all", "frozen" (nontrainable only) or "none"; the forward/backward gathers of those
        # parameters go as int8 (partita/zero/quantized_comm.py). Gathers for users (holds, exports) stay exact.
        self._quantize = quantize_weights
        # ZeRO++ hpZ: backward re-gathers of units come from copies inside a group of ranks (partita/zero/hpz.py).
        self.hpz = hpz  # None: off
        self.frozen = frozen  # sharded parameters of no group (see partita/zero/frozen_params.py)
        self.prefetch_numel = prefetch_numel
        self._max_live_numel = max_live_numel
        self._max_reuse_distance = max_reuse_distance
        # Elements of sharded parameters held whole or being gathered (what max_live bounds).
        self._live_numel = 0
        self.peak_live_numel = 0  # its maximum since construction or reset_peak_live_numel()
        self.kept_count = 0  # unit ends that kept the unit whole for reuse (observability and tests)
        self._in_flight: dict[int, InFlight] = {}
        self._in_flight_of: dict[nn.Parameter, int] = {}
        self._tickets = itertools.count()
        self.trace = UnitTrace()
        self.holds = Holds()  # parameters kept whole past their units' hooks (partita/zero/holds.py)
        self.eval_prefetch = EvalPrefetch(self)  # eval forwards' unit order (partita/zero/eval_prefetch.py)
        self.prefetch_count = 0  # all-gathers started ahead of need (observability and tests)
        self._process_group = process_group
        self._world_size = world_size
        self._where: dict[nn.Parameter, tuple[int, ShardSpec]] = {}
        for g, group in enumerate(groups):
            for param, spec in zip(group.params, group.layout.specs):
                self._where[param] = (g, spec)
        # Small parameters stay whole on every rank (DeepSpeed's persistence threshold):
        # gathering them costs more in latency than it saves in memory. (Resident at one rank they
        # stay persistent too: a checkpoint saves persistent parameters in its model file, and the
        # resident engine's checkpoint must be the default's.)
        self.persistent = {p for p in self._where if p.numel() <= persistence_threshold}
        # Element counts, read here once: a freed parameter's metadata costs a __torch_function__
        # round trip (partita/zero/freed.py), and the live-element accounting reads it per transition.
        managed = list(itertools.chain(self._where, frozen.params if frozen is not None else ()))
        self._numel: dict[nn.Parameter, int] = {p: p.numel() for p in managed}
        name_params(model.named_parameters(), replace=True)  # error messages name freed parameters
        self._state: dict[nn.Parameter, ParamState] = {}
        self._handed_out: set[nn.Parameter] = set()  # see hand_out_storage
        self._husks: dict[nn.Parameter, torch.Tensor] = {}  # frozen, one rank: sharing their shards (_start_gathers)
        self._unit_params = self._assign_units(model)
        # Units holding frozen parameters: their inputs carry the hook that frees those after backward.
        self._frozen_units = {u for u, ps in self._unit_params.items() if frozen and any(p in frozen for p in ps)}
        # Collectives run where the parameters live, whatever the shards' or masters' location.
        self._device = groups[0].params[0].device
        # Each rank's low-precision shard of every parameter, what all-gathers read from: on the
        # device, in host memory or on NVMe (``offload_param``, partita/offload/param_offload.py).
        names = unit_names(model, list(self._unit_params))
        self.storage: ShardStorage = build_shard_storage(
            groups, self._device, offload=offload_param, aio=aio,
            units=[UnitPieces(name, tuple(self._piece(p) for p in params if p in self._where))
                   for name, params in zip(names, self._unit_params.values())],
        )
        for param in managed:
            if param in self.persistent:
                if is_freed(param):  # built under zero.Init: make it whole
                    from partita.zero.init_context import gather_init_param

                    gather_init_param(param)
                continue
            if not is_freed(param):  # else zero.Init freed it already
                self._own_storage(param)
            self._free(param)
            self._state[param] = ParamState.SHARDED
        self._root = model
        self._unit_index = {unit: i for i, unit in enumerate(self._unit_params)}
        # The training forward in progress: whether one is, the next trace event expected,
        # and the units whose forward has started and not ended (outermost first).
        self._in_forward = False
        self._event_pos = 0
        self._open: list[nn.Module] = []
        self._sync: UnitSync | None = None
        if world_size > 1 and self._state:  # nothing is ever gathered otherwise: nothing to mismatch
            self._sync = UnitSync(
                process_group=process_group,
                world_size=world_size,
                device=self._device,
                unit_names=names,
            )
        if callable(getattr(model, "zero3_units", None)):  # a pipeline stage: no root forward brackets a
            self.trace.state = TraceState.DISABLED  # step, units are gathered on demand (partita/pipe/module.py)
        # One rank, shards on the device: gathers are local fills (zero/one_rank_gather.py), and with
        # ``one_rank_resident`` every parameter is whole for good and no unit hook exists at all.
        self._local: LocalGather | None = None
        if local_gathers(world_size=world_size, storage=self.storage, groups=groups, hpz=hpz):
            self._local = LocalGather(self._where, self.storage, frozen, share_trainable=one_rank_resident)
        self.resident: frozenset[nn.Parameter] = frozenset()
        self._hooks = []
        if self._local is not None and one_rank_resident:
            self._make_resident()
            return
        if one_rank_resident:
            resident_ignored(world_size, self.storage.location)
        for unit, params in self._unit_params.items():
            if params or unit is model:  # the root's hooks also mark where a forward starts
                self._hooks.append(unit.register_forward_pre_hook(self._pre_forward))
                if unit in self._frozen_units:
                    self._hooks.append(unit.register_forward_pre_hook(self._hook_inputs, with_kwargs=True))
                self._hooks.append(unit.register_forward_hook(self._post_forward))
        for param in (p for p in self._state if p.requires_grad):  # frozen ones: see ReleaseAfterBackward
            # Registered after the reducer's hook on the same parameter, so the gradient is
            # already packed into its bucket when the full parameter is freed.
            self._hooks.append(register_weak_grad_hook(param, self._release_one))

    # ------------------------------------------------------------------ setup
    def _make_resident(self) -> None:
        """[Note: resident parameters] (zero/one_rank_gather.py): whole for good, held by the engine."""
        params = list(self._state)
        for param in params:
            self._transition(param, ParamState.SHARDED, ParamState.GATHERED)
        self._husks.update(self._local.make_resident(params))
        self.holds.add(params)  # nothing releases a held parameter: no hook, release_all, hold's end
        self.resident = frozenset(params)

    def _assign_units(self, model: nn.Module) -> dict[nn.Module, list[nn.Parameter]]:  # rule: zero/unit_owner.py
        frozen = self.frozen if self.frozen is not None else ()
        return assign_units(model, lambda p: (p in self._where or p in frozen) and p not in self.persistent)

    def _spec(self, param: nn.Parameter) -> ShardSpec:
        where = self._where.get(param)
        return self.frozen.spec(param) if where is None else where[1]

    def _piece(self, param: nn.Parameter) -> ShardPiece:
        g, spec = self._where[param]
        return ShardPiece(g, spec.partition_offset, spec.shard_numel)

    @staticmethod
    def _own_storage(param: nn.Parameter) -> None:
        """A resizable storage of its own (not a safetensors memory map): freeing it frees nothing else."""
        data, storage = param.data, param.data.untyped_storage()
        if data.storage_offset() or storage.nbytes() != data.numel() * data.element_size() or not storage.resizable():
            param.data = data.clone()

    def hand_out_storage(self, param: nn.Parameter) -> None:
        """A ``state_dict()`` entry shares the whole parameter's storage (state_dict_guard.py)."""
        self._handed_out.add(param)

    def _free(self, param: nn.Parameter) -> None:
        # A state dict entry shares the storage: resizing would empty it too. The parameter moves
        # to a new empty storage instead (the same TensorImpl, so autograd's saved references
        # follow it) and the old one, values intact, stays with the dict.
        handed_out = param in self._handed_out
        self._handed_out.discard(param)  # one rank, frozen: it moves off its shard onto its husk (shard kept)
        free_param(param, ZERO3, fresh_storage=handed_out, husk=self._husks.pop(param, None))

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, unit: nn.Module, args: Any) -> None:
        if self.hooks_inert:
            return None
        training = self._root.training and torch.is_grad_enabled()
        if unit is self._root and not in_backward_pass():
            if training:
                self._begin_forward()
            else:
                self._in_forward = False  # a forward that raised midway left it set
            self.eval_prefetch.begin(active=not training)
        if self._in_forward:
            self._forward_event(unit, end=False)
        elif training and in_backward_pass():
            self._before_backward(unit)  # recomputation under activation checkpointing
        else:
            self.gather_unit(unit)  # eval, no_grad, or a unit called outside the model's forward
            self.eval_prefetch.unit_started(unit)

    def _hook_inputs(self, unit: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        """A unit with frozen parameters (no gradient hook frees them): freed once its inputs'
        gradients exist, positional or keyword (inputs that need none: at the end of backward)."""
        if self.hooks_inert:
            return None
        return through_function(ReleaseAfterBackward, self, unit, (args, kwargs)) if torch.is_grad_enabled() else None

    def on_post_backward(self, unit: nn.Module) -> None:
        """``unit``'s backward is done: free its frozen parameters (the others free themselves)."""
        self.release([p for p in self._unit_params[unit] if p in self.frozen])

    def on_pre_backward(self, unit: nn.Module) -> None:
        """Gradients reached ``unit``'s outputs: its parameters must be whole again."""
        self._before_backward(unit)

    def _before_backward(self, unit: nn.Module) -> None:
        resume = self.trace.observe_backward(unit)
        self._gather_checked(unit, Phase.BACKWARD)
        if resume is not None:
            self._prefetch(self.trace.upcoming(Phase.BACKWARD, resume))

    def _post_forward(self, unit: nn.Module, args: Any, output: Any) -> Any:
        if self.hooks_inert:
            return None
        if self._in_forward:
            self._forward_event(unit, end=True)
        elif in_backward_pass():
            pass  # recomputation: this unit's backward runs next, its gradient hooks free it
        elif not torch.is_grad_enabled() or unit is not self._root:
            self.release_unit(unit)  # the root stays gathered until its gradients are produced
        if unit is self._root and not in_backward_pass():
            self.eval_prefetch.end()  # an eval forward: unused prefetches land and are freed
        if not torch.is_grad_enabled():
            return output  # no backward will follow (eval, no_grad)
        wrapped = through_function(GatherBeforeBackward, self, unit, output)  # a ModelOutput stays one
        return output if wrapped is None else wrapped

    def _release_one(self, param: nn.Parameter) -> None:
        self.release((param,))

    # ------------------------------------------------------------------ gather / release
    def gather_unit(self, unit: nn.Module) -> None:
        self.gather(self._unit_params[unit], quantize=True)

    def release_unit(self, unit: nn.Module) -> None:
        self.release(self._unit_params[unit])

    @torch.no_grad()
    def gather(self, params: Iterable[nn.Parameter], *, quantize: bool = False) -> None:
        """Make every parameter in ``params`` whole: finish prefetches that cover some of
        them, all-gather the rest with one collective (``quantize``: a unit's gather, int8 with qwZ)."""
        params = list(params)
        if self._in_flight:
            for ticket in sorted({self._in_flight_of[p] for p in params if p in self._in_flight_of}):
                self._finish_gather(ticket)
        if self._local is not None:  # one rank: each parameter filled from its shard, no collective
            for param in params:
                if self._state.get(param) is ParamState.SHARDED:
                    self._transition(param, ParamState.SHARDED, ParamState.GATHERED)
                    husk = self._local.fill(param)
                    if husk is not None:
                        self._husks[param] = husk
            return
        todo = [p for p in params if self._state.get(p) is ParamState.SHARDED]
        for ticket in self._start_gathers(todo, quantize):
            self._finish_gather(ticket)

    def _start_gathers(self, params: list[nn.Parameter], quantize: bool = False) -> list[int]:
        """One all-gather per process group among ``params`` (their ZeRO groups' comms: expert
        parameters gather within their expert-data group), in first-parameter order, which is
        the same on every rank."""
        for param in [p for p in params if p not in self._where and self.frozen.shared_whole]:
            self._transition(param, ParamState.SHARDED, ParamState.GATHERED)  # frozen, one rank: the shard is
            self._husks[param] = share_values(param, self.frozen.whole(param))  # the value, shared (no copy)
        params = [p for p in params if p not in self._husks]
        by_comm: dict[tuple, tuple[Any, list[nn.Parameter]]] = {}
        hpz = self.hpz if quantize else None  # a unit's gather: hpZ's copies fill in forward, serve in backward
        backward = hpz is not None and in_backward_pass()
        for param in params:
            where = self._where.get(param)
            comm = self.frozen.comm if where is None else self._groups[where[0]].comm
            dtype = self.frozen.shard(param).dtype if where is None else self._groups[where[0]].model_dtype
            wire = wire_of(param, unit_gather=quantize, quantize_weights=self._quantize)
            if backward and hpz.holds(param) and comm.process_group is self._process_group:
                wire = "hpz"  # the backward's re-gather: from this rank's copy, inside its hpZ group
            by_comm.setdefault((id(comm), dtype, wire), (comm, []))[1].append(param)
        tickets = [self._start_gather(part, comm, key[2]) for key, (comm, part) in by_comm.items()]
        for ticket, (comm, _) in zip(tickets, by_comm.values() if hpz and self._in_forward and not backward else ()):
            if comm.process_group is self._process_group:
                hpz.fill_from(ticket)  # a training forward's world gather: keep this rank's rows as they land
        return tickets

    def _start_gather(self, params: list[nn.Parameter], comm=None, wire: Wire = False) -> int:
        # Trainable parameters' pieces first (from the storage), then frozen ones' (FrozenShards).
        params = [p for p in params if p in self._where] + [p for p in params if p not in self._where]
        pieces = [self._piece(p) for p in params if p in self._where]
        columns, column = [], 0
        for param in params:
            self._transition(param, ParamState.SHARDED, ParamState.GATHERING)
            columns.append(column)
            column += self._spec(param).shard_numel
        if wire == "hpz":
            return self._register(self.hpz.start_gather(params, self._spec))
        storage = self.storage
        # Offloaded shards: the host-to-device copies and the all-gather go on one side stream,
        # ordered without a host synchronisation (see partita/offload/param_offload.py).
        with storage.issue():
            local = fetch_pieces(storage, self.frozen, pieces, params[len(pieces):], column, self._device)
            size, process_group = (self._world_size, self._process_group) if comm is None else (comm.size, comm.process_group)
            spans = [(col, self._spec(p).shard_numel) for p, col in zip(params, columns)]
            work, gathered, decoder = start_all_gather(local, spans, size=size, group=process_group, wire=wire, params=params)
            ready = storage.issued()
        return self._register(InFlight(work, gathered, params, columns, ready, decoder))

    def _register(self, flight: InFlight) -> int:
        ticket = next(self._tickets)
        self._in_flight[ticket] = flight
        for param in flight.params:
            self._in_flight_of[param] = ticket
        return ticket

    def _finish_gather(self, ticket: int) -> list[nn.Parameter]:
        flight = self._in_flight.pop(ticket)
        collectives.wait(flight.work, purpose=PURPOSE)
        self.storage.arrived(flight.ready, flight.gathered)
        gathered = flight.gathered if flight.quantized is None else flight.quantized.dequantize(flight.gathered)
        if self.hpz is not None:
            self.hpz.landed(ticket, flight, gathered, self._spec)
        for param, col in zip(flight.params, flight.columns):
            del self._in_flight_of[param]
            allocate_param(param)
            unpack_from_columns(gathered, col, self._spec(param), param)
            self._transition(param, ParamState.GATHERING, ParamState.GATHERED)
        return flight.params

    def _transition(self, param: nn.Parameter, expected: ParamState, new: ParamState) -> None:
        state = self._state.get(param)
        if state is not expected:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            raise RuntimeError(
                f"partita rank {rank}: ZeRO-3 parameter of shape {tuple(param.shape)} is {state}, "
                f"expected {expected} before becoming {new} (internal invariant broken)"
            )
        self._state[param] = new
        if expected is ParamState.SHARDED:
            self._live_numel += self._numel[param]
            self.peak_live_numel = max(self.peak_live_numel, self._live_numel)
        elif new is ParamState.SHARDED:
            self._live_numel -= self._numel[param]

    def release(self, params: Iterable[nn.Parameter]) -> None:
        for param in params:
            if self._state.get(param) is ParamState.GATHERED and param not in self.holds:
                self._free(param)
                self._transition(param, ParamState.GATHERED, ParamState.SHARDED)

    def release_all(self) -> None:
        """End of backward: land unused prefetches (every rank issued them), free all, settle the first step's trace."""
        for ticket in sorted(self._in_flight):
            self._finish_gather(ticket)
        self.release(list(self._state))
        if self.hpz is not None:
            self.hpz.drop()  # each forward refreshes the copies its backward reads (partita/zero/hpz.py)
        if self.trace.state is TraceState.RECORDING and self.trace.sequences[Phase.BACKWARD]:
            self.trace.finish_recording(self._ranks_agree, self._unit_index, self._unit_numel, self._root)

    def finish_prefetches(self) -> None:
        """Land every gather still in flight (every rank issued it) and free what it gathered."""
        for ticket in sorted(self._in_flight):
            self.release(self._finish_gather(ticket))

    def unit_params(self) -> dict[nn.Module, list[nn.Parameter]]:  # outermost first, the same on every rank
        return {unit: list(params) for unit, params in self._unit_params.items()}

    def _unit_numel(self, unit: nn.Module) -> int:
        return sum(self._numel[p] for p in self._unit_params[unit])

    def _ranks_agree(self, encoded: list[int]) -> bool:
        return ranks_agree(encoded, world_size=self._world_size, process_group=self._process_group, device=self._device)

    def num_gathered(self) -> int:
        """Elements of non-persistent parameters currently held whole on this rank."""
        resident = self.resident  # whole for good: nothing a caller waits on (offload_states asks)
        return sum(p.numel() for p, s in self._state.items() if s is ParamState.GATHERED and p not in resident)

    @property
    def live_numel(self) -> int:
        """Elements of non-persistent parameters held whole or being gathered on this rank."""
        return self._live_numel

    def reset_peak_live_numel(self) -> None:
        self.peak_live_numel = self._live_numel

    @property
    def unit_checks(self) -> int:
        """Rank-agreement checks this rank has issued (see [Note: rank divergence])."""
        return self._sync.exchanges if self._sync is not None else 0

    def state_of(self, param: nn.Parameter) -> ParamState | None:
        return self._state.get(param)

    def is_gathered(self, param: nn.Parameter) -> bool:  # a sharded parameter whole right now (GATHERED)
        return self._state.get(param) is ParamState.GATHERED

    def is_sharded_param(self, param: nn.Parameter) -> bool:  # lives as shards (not persistent)
        return param in self._state

    def wait_shard_reads(self) -> None:
        """Before an optimizer step rewrites the masters: the gathers' copies reading them are done."""
        self.storage.wait_reads()

    def adopt_frozen(self, params: Iterable[nn.Parameter]) -> None:
        """Whole frozen parameters edited in place (GatheredParameters): their shards follow."""
        for param in params:
            if self.frozen is not None and param in self.frozen and self._state[param] is ParamState.GATHERED:
                self.frozen.adopt_whole(param)

    @torch.no_grad()
    def refresh_shards(self) -> None:
        """After an optimizer step: the low-precision shards follow the fp32 master (on the
        device, in host memory or in the swap files, see :attr:`storage`); hpZ's copies are stale."""
        self.storage.refresh()
        if self.resident:
            self._local.refresh()  # the 16-bit parameters are the shards' whole copies: they follow
        refresh_gatherer_fp8_scales(self._where, self._groups, self.storage, group=self._process_group, world_size=self._world_size)
        if self.hpz is not None:
            self.hpz.drop()

    @property
    def shards(self) -> list[torch.Tensor]:
        """Per group, the in-memory shard tensor gathers read (offload_param "nvme": those kept in CPU memory)."""
        return self.storage.shards

    @property
    def shard_location(self) -> str:
        """Where the shards live between uses: "accelerator", "cpu" or "nvme"."""
        return self.storage.location

    def shard_nbytes(self) -> dict[str, int]:
        """Bytes of shards by location; swap files counted as allocated (whole aio blocks)."""
        return self.storage.nbytes()

    def close(self) -> None:
        """Remove the offload_param swap files, free their buffers (also when collected, at exit); no gather follows."""
        self.storage.close()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
