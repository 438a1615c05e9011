"""Gradient reduction for ZeRO stages 0-2: hooks, buckets, and one collective per bucket.

[Note: bucket order]
Parameters are ordered by *descending* registration index across all optimizer groups,
which is roughly the order backward produces their gradients. Buckets are runs of that
order of at most ``reduce_bucket_size`` elements. Bucket ``k`` is launched only after
bucket ``k - 1``, so every rank issues the same collectives in the same order even when
gradients arrive in a different order on different ranks, or some parameters get no
gradient at all (those are reduced as zeros by :meth:`GradientReducer.finish_backward`).
A rank can never deadlock the others by skipping a bucket.

[Note: what each stage reduces]
- stage 0 (``num_shards == 1``): ``all_reduce`` of the bucket; every rank keeps it all.
- stages 1 and 2 (``num_shards == world``): ``reduce_scatter_tensor`` of the packed bucket;
  each rank keeps its row (see :mod:`partita.zero.partition`). ZeRO++ qgZ (zero_quantized_gradients)
  sends the rows quantized through one all-to-all instead (partita/zero/quantized_comm.py), or
  across nodes through two, inside each node then between nodes (partita/zero/hierarchical_reduce.py).

[Note: one process group per ZeRO group]
Each ZeRO group carries its own :class:`~partita.zero.shard_group.ShardComm` (default: the
whole ZeRO group). A bucket holds parameters of one comm only, and its collective runs over
that comm; buckets of every comm are launched in one order (by their first parameter's
position), identical on every rank, so no two ranks wait on different groups. The average
is always over the ZeRO world (``world_size``), whatever group the sum ran over: expert
parameters (partita/moe) are summed over their expert-data group only, because the MoE
all-to-all already summed, in each expert's own backward, the contributions of every token
routed to it from its expert group; (sum over expert-data ranks) / world is then exactly the
data-parallel mean gradient of the whole model.
Stages 0 and 1 reduce only in the backward of the last micro-batch of an accumulation
window (gradients accumulate in ``param.grad`` before that); stage 2 reduces in every
micro-batch's backward and frees ``param.grad`` as soon as it is packed, so full-size
gradients never outlive their bucket.
On GPU the collectives run asynchronously on the process group's own stream while
backward continues; their results are folded into the fp32 partitions at the end of
backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from partita.distributed import collectives
from partita.utils.weak_hooks import register_weak_grad_hook
from partita.zero.shard_group import ShardComm, ShardedParamGroup, pack_into_columns
from partita.zero.partition import ShardSpec
from partita.zero.hierarchical_reduce import TwoHopReduceScatter, build_node_groups, start_two_hop_reduce_scatter
from partita.zero.quantized_comm import QuantizedReduceScatter, start_quantized_reduce_scatter


# Launched buckets whose collective may still run while backward continues.
_IN_FLIGHT = 2


@dataclass(frozen=True, slots=True)
class _Entry:
    group: int
    spec: ShardSpec
    column: int


@dataclass(frozen=True, slots=True)
class _Run:
    """Consecutive entries of one group whose shards are contiguous in the partition."""

    group: int
    partition_start: int
    column: int
    numel: int


@dataclass(slots=True)
class _ReduceBucket:
    entries: tuple[_Entry, ...]
    runs: tuple[_Run, ...]
    shard_numel: int
    comm: ShardComm
    num_shards: int
    shard_rank: int
    in_place: bool  # see [Note: in-place reduction]
    # Per-backward state.
    packed: torch.Tensor | None = None
    pending: set[int] = field(default_factory=set)
    work: dist.Work | None = None
    output: torch.Tensor | None = None
    in_place_works: list = field(default_factory=list)  # in-place mode: one all-reduce per run
    # ZeRO++ qgZ in flight: gives ``output`` once waited for.
    quantized: QuantizedReduceScatter | TwoHopReduceScatter | None = None


def num_shards_of(groups: list[ShardedParamGroup]) -> int:
    return groups[0].layout.num_shards


def _runs(entries: list[_Entry]) -> tuple[_Run, ...]:
    runs: list[_Run] = []
    for e in entries:
        last = runs[-1] if runs else None
        if last and last.group == e.group and last.partition_start + last.numel == e.spec.partition_offset:
            runs[-1] = _Run(last.group, last.partition_start, last.column, last.numel + e.spec.shard_numel)
        else:
            runs.append(_Run(e.group, e.spec.partition_offset, e.column, e.spec.shard_numel))
    return tuple(runs)


class GradientReducer:
    """Turns the model's gradients into each rank's averaged fp32 gradient partition."""

    def __init__(
        self,
        groups: list[ShardedParamGroup],
        registration_index: dict[nn.Parameter, int],
        *,
        process_group: dist.ProcessGroup | None,
        world_size: int,
        bucket_numel: int,
        reduce_every_micro_batch: bool,
        use_reduce_scatter: bool = True,
        overlap_comm: bool = True,
        comm_dtype: torch.dtype | None = None,
        predivide_factor: float = 1.0,
        accumulate_in_fp32: bool = False,
        download_during_backward: bool = False,
        fold_at_end: bool = False,
        streamed: bool = False,
        quantized_gradient_bits: int | None = None,
    ) -> None:
        self._groups = groups
        # ZeRO++ qgZ: reduce-scatters go as an all-to-all of 4- or 8-bit blocks, summed in fp32 (quantized_comm.py).
        self._quantized_bits = quantized_gradient_bits
        # Across nodes, qgZ reduces inside each node first (hierarchical_reduce.py); its process
        # groups are made here, once, by every rank in one order. None: one hop.
        self._node_groups = (build_node_groups(process_group, world_size)
                             if quantized_gradient_bits is not None else None)
        # One rank, offloaded groups: send each gradient to the host as backward makes it
        # instead of after backward (on one H200 with GPT-1.3B: backward 278 -> ~207 ms). It
        # once made the exact (non-delayed) step slower: its uploads then waited for staging
        # buffers behind the downloads; they now go up from the page-locked master directly.
        self._download_during_backward = download_during_backward
        # One rank, on-device groups: hold each param.grad until finish_backward instead of
        # folding it in as it arrives (zero_optimization.one_rank_gradient_fold "end").
        self._fold_at_end = fold_at_end or streamed
        # zero_optimization.one_rank_gradient_fold "stream": never fold; the optimizer step reads
        # param.grad itself (streamed_step.py [Note: the streamed step]).
        self._streamed = streamed
        self._process_group = process_group
        self._world_size = world_size  # what every gradient is averaged over (the ZeRO world)
        default = ShardComm(process_group, world_size, dist.get_rank(process_group) if world_size > 1 else 0)
        self._comms = [g.comm if g.comm is not None else default for g in groups]
        self._reduce_every_micro_batch = reduce_every_micro_batch
        self._use_reduce_scatter = use_reduce_scatter
        self._overlap_comm = overlap_comm
        self._comm_dtype = comm_dtype  # None: the gradients' own dtype
        self._predivide = predivide_factor
        # data_types.grad_accum_dtype=fp32 at stages 0/1: micro-batch gradients are summed in
        # fp32 here instead of in param.grad's bf16/fp16 (see [Note: what each stage reduces]).
        self._accumulate_in_fp32 = accumulate_in_fp32 and not reduce_every_micro_batch
        self._fp32_sums: dict[nn.Parameter, torch.Tensor] = {}
        # [Note: in-place reduction] With unsharded fp32 gradients (stage 0 in fp32, or fp32
        # communication) the fp32 partition can be the bucket itself: each gradient is added
        # into it pre-divided by the world size and its runs are all-reduced in place, one
        # pass over the gradients instead of a pack copy plus an add. Decided per bucket.
        self._buckets = self._build_buckets(registration_index, bucket_numel)
        self._bucket_of: dict[nn.Parameter, tuple[int, int]] = {}
        for b, bucket in enumerate(self._buckets):
            for i, entry in enumerate(bucket.entries):
                self._bucket_of[groups[entry.group].params[entry.spec.index]] = (b, i)
        self._armed = False
        # 1-bit optimizers (partita/optim/onebit.py) in their compressed phase: no reduction at all,
        # each rank keeps its local gradients in param.grad for the compressed momentum exchange.
        self.local_only: Callable[[], bool] | None = None
        self._next_launch = 0
        self._next_retire = 0
        # Which parameters got a gradient on this rank since the last optimizer step.
        self._received = [[False] * len(g.params) for g in groups]
        self._hooks = [register_weak_grad_hook(p, self._on_grad_ready) for p in self._bucket_of]  # utils/weak_hooks.py

    def _build_buckets(self, registration_index: dict[nn.Parameter, int], bucket_numel: int) -> list[_ReduceBucket]:
        position = lambda gs: -registration_index[self._groups[gs[0]].params[gs[1].index]]  # noqa: E731
        ordered = sorted(((g, spec) for g, group in enumerate(self._groups) for spec in group.layout.specs), key=position)
        by_comm: dict[int, list[tuple[int, ShardSpec]]] = {}
        for g, spec in ordered:
            by_comm.setdefault(id(self._comms[g]), []).append((g, spec))
        buckets: list[tuple[int, _ReduceBucket]] = []
        for run in by_comm.values():  # each comm's parameters in backward order, cut into buckets
            current: list[_Entry] = []
            current_numel = column = 0
            for g, spec in run:
                if current and current_numel + spec.numel > bucket_numel:
                    buckets.append(self._bucket(current, column, position))
                    current, current_numel, column = [], 0, 0
                current.append(_Entry(g, spec, column))
                current_numel += spec.numel
                column += spec.shard_numel
            if current:
                buckets.append(self._bucket(current, column, position))
        # One launch order over every comm: by each bucket's first parameter (same on every rank).
        return [bucket for _, bucket in sorted(buckets, key=lambda pb: pb[0])]

    def _bucket(self, entries: list[_Entry], shard_numel: int, position) -> tuple[int, _ReduceBucket]:
        group = self._groups[entries[0].group]
        comm = self._comms[entries[0].group]
        num_shards = group.layout.num_shards
        in_place = (num_shards == 1 and comm.size > 1
                    and (self._comm_dtype or group.params[0].dtype) == torch.float32)
        first = position((entries[0].group, entries[0].spec))
        return first, _ReduceBucket(tuple(entries), _runs(entries), shard_numel, comm, num_shards,
                                    group.shard_rank, in_place)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def begin_backward(self, *, reduce: bool) -> None:
        """Arm the hooks for one backward pass; ``reduce`` says whether this pass reduces."""
        self._armed = reduce and not (self.local_only is not None and self.local_only())
        self._next_launch = 0
        self._next_retire = 0
        for bucket in self._buckets:
            bucket.pending = set(range(len(bucket.entries)))
            bucket.packed = None
            bucket.work = None
            bucket.output = None

    def wants_reduction_every_micro_batch(self) -> bool:
        return self._reduce_every_micro_batch

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._armed:
            if self._accumulate_in_fp32:
                self._add_to_fp32_sum(param)
            return  # accumulate (in param.grad or the fp32 sum) until the window's last micro-batch
        b, i = self._bucket_of[param]
        bucket = self._buckets[b]
        offloaded = self._groups[bucket.entries[i].group].offloaded
        if bucket.comm.size == 1 and (self._fold_at_end if not offloaded else not self._download_during_backward):
            # One rank: leave the gradient in param.grad; finish_backward folds it in (an on-device
            # partition with fold_at_end) or sends it down (an offloaded one without
            # download_during_backward).
            return
        if bucket.comm.size == 1 and i not in bucket.pending:
            # One rank, a second gradient of the same parameter in one backward (reentrant
            # checkpointing of a region that uses it twice): nothing was sent, so it simply adds.
            self._pack(bucket, i, self._take_grad(param))
            return
        # [Note: folding on one rank] With nothing to communicate (comm size 1) the gradient is
        # folded into the fp32 partition as soon as it is ready and param.grad is freed, as with
        # buckets: holding every param.grad until the end of backward put the full-size gradients
        # (2 bytes/parameter) beside the fresh fp32 partition (4) there: GPT-6.7B at ZeRO-3 with
        # checkpointing peaked at 18 bytes/parameter (111.7 GiB; FSDP2 100.8). The partition is
        # allocated at the first gradient, after the loss's backward freed its fp32 logits
        # gradients, which for GPT-1.3B at micro-batch 8 are larger than it. The trade-off: when
        # the activations still alive then exceed the full-size gradients and the loss transient
        # is smaller than the partition (small micro-batches without checkpointing), the
        # partition now coexists with more activations than before (partita estimate, GPT-1.3B,
        # ZeRO-2, micro-batch 2: 25.9 -> 28.6 GiB). zero_optimization.one_rank_gradient_fold "end"
        # keeps the old rule (fold_at_end, above); "auto" picks by the estimate (fold_choice.py).
        if i not in bucket.pending:
            # The gradient was already packed (and maybe sent) in this backward: reentrant
            # activation checkpointing runs a nested backward per checkpointed region.
            raise RuntimeError(
                "partita: a parameter's gradient became ready twice in one backward pass; this happens "
                "with reentrant activation checkpointing (torch.utils.checkpoint(..., use_reentrant=True)). "
                "Use use_reentrant=False."
            )
        self._pack(bucket, i, self._take_grad(param))  # the bucket holds it now: full-size grad freed
        bucket.pending.discard(i)
        self._launch_ready_buckets()

    def _add_to_fp32_sum(self, param: nn.Parameter) -> None:
        if param.grad is None:
            return
        total = self._fp32_sums.get(param)
        if total is None:
            self._fp32_sums[param] = param.grad.to(torch.float32)
        else:
            total.add_(param.grad)
        param.grad = None

    def _take_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """This window's whole gradient of ``param`` (param.grad plus any fp32 sum); frees both."""
        grad, param.grad = param.grad, None
        total = self._fp32_sums.pop(param, None)
        if total is None:
            return grad
        if grad is not None:
            total.add_(grad)
        return total

    def _pack(self, bucket: _ReduceBucket, i: int, grad: torch.Tensor | None) -> None:
        entry = bucket.entries[i]
        if grad is not None:
            self._received[entry.group][entry.spec.index] = True
        if bucket.comm.size == 1 or bucket.in_place:
            # The partition is the whole group: add the gradient straight into it, no bucket
            # buffer (one rank: nothing to communicate; else see [Note: in-place reduction]).
            if grad is not None:
                scale = 1.0 / self._world_size
                self._groups[entry.group].accumulate_grad(entry.spec.partition_offset, grad.reshape(-1), scale=scale)
            return
        if bucket.packed is None:
            like = self._groups[entry.group].params[entry.spec.index]
            bucket.packed = torch.empty(
                (bucket.num_shards, bucket.shard_numel), dtype=self._comm_dtype or like.dtype, device=like.device
            )
        pack_into_columns(bucket.packed, entry.column, entry.spec, grad)

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self._buckets) and not self._buckets[self._next_launch].pending:
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1
        # Retire all but the newest few launched buckets: their memory goes back at once,
        # so at most _IN_FLIGHT packed buckets live beside the model (instead of all of
        # them until backward ends), while the newest still overlap with backward.
        in_flight = _IN_FLIGHT if self._world_size > 1 else 0
        while self._next_retire < self._next_launch - in_flight:
            self._retire(self._next_retire)
            self._next_retire += 1

    def _retire(self, b: int) -> None:
        """Wait for bucket ``b``'s collective and add this rank's averaged slice into the partitions."""
        bucket = self._buckets[b]
        collectives.wait(bucket.work, purpose=self._purpose(b))
        for work in bucket.in_place_works:
            collectives.wait(work, purpose=self._purpose(b))
        bucket.in_place_works = []
        if bucket.quantized is not None:
            bucket.output, bucket.quantized = bucket.quantized.reduce(), None
        scale = self._predivide / self._world_size
        for run in bucket.runs if bucket.output is not None else ():
            reduced = bucket.output[run.column : run.column + run.numel]
            self._groups[run.group].accumulate_grad(run.partition_start, reduced, scale=scale)
        bucket.packed = bucket.output = bucket.work = None

    def _purpose(self, b: int) -> str:
        return f"gradient reduction (bucket {b} of {len(self._buckets)})"

    def _launch(self, bucket: _ReduceBucket) -> None:
        packed = bucket.packed
        purpose = self._purpose(self._next_launch)
        if bucket.comm.size == 1:
            return  # already accumulated by _pack
        process_group = bucket.comm.process_group
        if bucket.in_place:
            for run in bucket.runs:
                group = self._groups[run.group]
                # No gradient of this group arrived yet: the partition starts as zeros.
                view = group.ensure_grad_partition()[run.partition_start : run.partition_start + run.numel]
                bucket.in_place_works.append(
                    collectives.all_reduce(view, group=process_group, purpose=purpose, async_op=True)
                )
            if not self._overlap_comm:
                for work in bucket.in_place_works:
                    collectives.wait(work, purpose=purpose)
                bucket.in_place_works = []
            return
        if self._predivide != 1.0:
            packed.div_(self._predivide)  # gradient_predivide_factor: keep fp16 sums in range
        if bucket.num_shards == 1 or not self._use_reduce_scatter:
            # zero_optimization.reduce_scatter=false: all-reduce everything, keep our row.
            bucket.work = collectives.all_reduce(packed, group=process_group, purpose=purpose, async_op=True)
            bucket.output = packed[0] if bucket.num_shards == 1 else packed[bucket.shard_rank]
        elif self._quantized_bits is not None:
            two_hop = (self._node_groups is not None and process_group is self._process_group
                       and bucket.comm.size == self._world_size)  # not an expert-data sub-group
            if two_hop:
                bucket.work, bucket.quantized = start_two_hop_reduce_scatter(
                    packed, bits=self._quantized_bits, groups=self._node_groups, purpose=purpose)
            else:
                bucket.work, bucket.quantized = start_quantized_reduce_scatter(
                    packed, bits=self._quantized_bits, group=process_group, purpose=purpose)
            if self._next_launch and self._buckets[self._next_launch - 1].quantized is not None:
                # Two hops: the previous bucket's hop 1 has had a bucket's backward to finish; its
                # inter-node hop goes now, not at its retirement, so it too overlaps with backward.
                self._buckets[self._next_launch - 1].quantized.advance()
            if not self._overlap_comm:
                bucket.output, bucket.quantized = bucket.quantized.reduce(), None  # both hops, before backward goes on
        else:
            bucket.output = torch.empty(bucket.shard_numel, dtype=packed.dtype, device=packed.device)
            bucket.work = collectives.reduce_scatter_tensor(
                bucket.output, packed.view(-1), group=process_group, purpose=purpose, async_op=True
            )
        if not self._overlap_comm:
            collectives.wait(bucket.work, purpose=purpose)  # overlap_comm=false: finish before backward goes on
            bucket.work = None

    def finish_backward(self) -> None:
        """Reduce what backward left (parameters that got no gradient count as zeros),
        wait for every collective, and add the averaged results into the fp32 partitions."""
        if not self._armed:
            return
        for bucket in self._buckets[self._next_launch :]:
            for i in sorted(bucket.pending):
                entry = bucket.entries[i]
                param = self._groups[entry.group].params[entry.spec.index]
                if self._streamed:
                    self._received[entry.group][entry.spec.index] |= param.grad is not None
                    continue
                # Gradients accumulated by earlier micro-batches but untouched by this
                # backward still count (stage 0/1 windows); the rest are zeros.
                self._pack(bucket, i, self._take_grad(param))
            bucket.pending.clear()
        self._launch_ready_buckets()
        while self._next_retire < len(self._buckets):
            self._retire(self._next_retire)
            self._next_retire += 1
        for transfer in {id(g.host_transfer): g.host_transfer for g in self._groups if g.host_transfer}.values():
            transfer.drain()  # offloaded partitions: the host adds must be done before the step reads them
        for group in self._groups:
            group.finish_pass()
        self._armed = False

    def take_received(self) -> list[list[bool]]:
        """Per group and parameter: did this rank produce a gradient since the last call?"""
        received = self._received
        self._received = [[False] * len(g.params) for g in self._groups]
        return received

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
