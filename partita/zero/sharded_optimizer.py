"""The sharded optimizer: fp32 master partitions, one inner torch optimizer, and the step
epilogue shared by every ZeRO stage (global norm, overflow, unscale + clip, parameter
write-back).

The inner optimizer is a plain ``torch.optim.Optimizer`` whose parameter groups hold one
flat fp32 master tensor each, so a fused optimizer makes one call per group over this
rank's whole partition. LR schedulers drive its ``param_groups`` as usual.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from partita.distributed import collectives
from partita.optim.eight_bit import step_eight_bit
from partita.optim.fused_adam_range import fused_adam_optimizer
from partita.offload.overlapped_update import can_overlap, start_overlapped_update
from partita.offload.pipelined_step import (
    can_pipeline,
    reads_16bit_grads,
    snapshot_options,
    step_16bit_groups,
    step_accelerator_groups,
    step_and_upload,
    step_offloaded_groups,
)
from partita.zero.partition import Bucket
from partita.zero.shard_group import ShardedParamGroup, unpack_from_columns
from partita.zero.unused_params import restore_unused, save_unused

if TYPE_CHECKING:
    from partita.offload.nvme_optimizer import SwappedOptimizerStates
    from partita.offload.overlapped_step import OverlappedStep
    from partita.zero.streamed_step import StreamedStep


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one optimizer step did.

    Attributes:
        applied: False when the step was skipped because a gradient was inf/nan.
        grad_norm: global L2 norm of the unscaled gradients, before clipping.
    """

    applied: bool
    grad_norm: float


class ShardedOptimizer:
    """Owns the master partitions and runs the optimizer step on them.

    Args:
        groups: the ZeRO parameter groups (all with the same number of shards).
        inner: a torch optimizer whose i-th param group holds ``groups[i].master``.
        process_group: the data-parallel group.
        world_size: data-parallel size.
        gradient_clipping: max global norm; 0 disables clipping.
        allgather_bucket_numel: elements per all-gather when writing parameters back.
        delayed_update: apply each step's update one step late, from a background thread
            (the ZeRO-Offload paper's delayed parameter update; changes the math).
        host_step_16bit_grads: offload_optimizer.host_step_16bit_grads (see reads_16bit_grads).
    """

    def __init__(
        self,
        groups: list[ShardedParamGroup],
        inner: torch.optim.Optimizer,
        *,
        process_group: dist.ProcessGroup | None,
        world_size: int,
        gradient_clipping: float,
        allgather_bucket_numel: int,
        delayed_update: bool = False,
        host_step_16bit_grads: bool = False,
        model_parallel_group: dist.ProcessGroup | None = None,
        uncounted_params: Collection[torch.Tensor] = (),
    ) -> None:
        self.groups = groups
        self.inner = inner
        self._process_group = process_group
        self._world_size = world_size
        self._num_shards = groups[0].layout.num_shards
        self._clip = gradient_clipping
        self._allgather_bucket_numel = allgather_bucket_numel
        self._gather_buckets = [g.layout.buckets(allgather_bucket_numel) for g in groups]
        # ZeRO-3: the gatherer keeps sharded parameters' low-precision shards; only
        # persistent (small) parameters are written back whole after a step.
        self.param_store = None
        # Called once the master has been written into the model (partita/zero/one_rank_weights.py).
        self.after_write_back: list[Callable[[], None]] = []
        # ZeRO-Infinity (offload_optimizer.device "nvme"): the optimizer states of offloaded groups
        # live in swap files and are stepped sub-group by sub-group (partita/offload/nvme_optimizer.py).
        self._swapper: SwappedOptimizerStates | None = None
        # Delayed parameter update: one background thread runs the (host) optimizer step
        # while the accelerator computes the next step; at most one update is in flight.
        self._background = ThreadPoolExecutor(1, thread_name_prefix="partita-step") if delayed_update else None
        # torch's fused Adam/AdamW take a gradient divisor (``grad_scale``): the step's unscale and
        # clip multiplier can ride along instead of a separate pass (see _apply_update).
        self._fused_adam = fused_adam_optimizer(inner)
        # 16-bit host gradients of this step (a 16-bit tensor cannot be an fp32 master's ``.grad``).
        self.grads_16bit: dict[int, torch.Tensor] = {}
        for g, group in enumerate(groups):
            if host_step_16bit_grads and world_size == 1 and reads_16bit_grads(inner, g, group):
                group.host_grad_dtype = group.model_dtype
        self._pending: tuple[Future, Callable[[], None] | None] | None = None
        self._eight_bit = type(inner).__module__.startswith("bitsandbytes")
        self._uploads_queued: torch.cuda.Event | None = None  # see _note_uploads_queued
        # offload_optimizer.overlap_step_with_forward: the exact step runs on beside the next
        # forward (partita/offload/overlapped_step.py); set by apply_zero.
        self.overlapped: OverlappedStep | None = None
        # zero_optimization.one_rank_gradient_fold "stream": no gradient partition; the step reads
        # param.grad range by range (partita/zero/streamed_step.py); set by apply_zero.
        self.streamed: StreamedStep | None = None
        # Model parallelism (tensor axis): the global norm sums over the ranks holding different
        # parts of the model too, and a parameter every tensor rank holds whole (a LayerNorm) is
        # counted on one of them only: ``uncounted_params`` are this rank's such copies, and these
        # are their slices of each group's gradient partition.
        self._model_parallel_group = model_parallel_group
        uncounted = {id(p) for p in uncounted_params}
        self._uncounted_ids = set(uncounted)
        self._uncounted_slices = [
            [slice(spec.partition_offset, spec.partition_offset + (end - start))
             for param, spec, (start, end) in group.owned_slices() if id(param) in uncounted and end > start]
            for group in groups
        ]
        # 1-bit optimizers (partita/optim/onebit.py) step themselves in their compressed phase.
        attach = getattr(inner, "attach_zero", None)
        if attach is not None:
            attach(self)

    @property
    def swapper(self) -> SwappedOptimizerStates | None:
        return self._swapper

    @swapper.setter
    def swapper(self, swapper: SwappedOptimizerStates | None) -> None:
        self._swapper = swapper
        if swapper is not None:  # the swapped step reads ``master.grad``: fp32 partitions
            for group in self.groups:
                group.host_grad_dtype = torch.float32

    def count_norm_across(self, group: dist.ProcessGroup, *, uncounted_params: Collection[torch.Tensor] = (),
                          covers_tensor_group: bool = False) -> None:
        """Sum the global gradient norm over ``group`` too (pipeline stages, partita/pipe): each
        stage holds different parameters, like the tensor axis; ``uncounted_params`` are this
        rank's copies of parameters another rank of ``group`` counts (a tied embedding's second owner).
        One model-parallel group only: with tensor parallelism ``group`` must span pipe x tensor
        (``covers_tensor_group=True``) and replaces the tensor group; a parameter uncounted for
        both reasons is subtracted once."""
        if self._model_parallel_group is not None and not covers_tensor_group:
            raise NotImplementedError("the gradient norm already sums over the tensor axis: pass a group over "
                                      "pipe x tensor with covers_tensor_group=True")
        self._model_parallel_group = group
        uncounted = {id(p) for p in uncounted_params} - self._uncounted_ids
        self._uncounted_ids |= uncounted
        for slices, shard_group in zip(self._uncounted_slices, self.groups):
            slices.extend(slice(spec.partition_offset, spec.partition_offset + (end - start))
                          for param, spec, (start, end) in shard_group.owned_slices() if id(param) in uncounted and end > start)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group the partitions are split over."""
        return self._process_group

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's param groups (lr, weight_decay, ...), as torch exposes them."""
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self) -> None:
        for group in self.groups:
            group.zero_grad()

    def _reduce_norm_and_usage(self, received: list[list[bool]]) -> tuple[float, list[list[bool]]]:
        """One all-reduce for both the global squared norm and which parameters got a
        gradient on any rank (they are summed: > 0 means someone produced one)."""
        # The collective runs where the model lives (offloaded masters are in host memory).
        device = self.groups[0].params[0].device
        local = torch.zeros((), dtype=torch.float32, device=device)
        for group, uncounted in zip(self.groups, self._uncounted_slices):
            if group.grad_partition is None:  # nothing reduced into it (all zeros)
                continue
            if group.layout.num_shards == 1 and self._replica_rank(group) != 0:
                # Unsharded (stage 0): every rank of the group's comm holds the same gradients;
                # its first rank counts them. Per group, because expert groups replicate over their
                # expert-data group only, and other expert ranks hold other experts.
                continue
            local += group.grad_norm_sq(device)
            for part in uncounted:
                local -= torch.linalg.vector_norm(group.grad_partition[part], dtype=torch.float32).square().to(device)
        flags = torch.tensor([f for group_flags in received for f in group_flags], dtype=torch.float32)
        packed = torch.cat([local.reshape(1), flags.to(device)])
        if self._world_size > 1:
            collectives.all_reduce(packed, group=self._process_group, purpose="gradient-norm all-reduce in the optimizer step")
        if self._model_parallel_group is not None:
            norm_sq = packed[:1].clamp(min=0)  # clamp: the subtraction above may leave -0.0 or -1 ulp
            collectives.all_reduce(norm_sq, group=self._model_parallel_group, purpose="gradient-norm all-reduce over the tensor axis")
            packed[:1] = norm_sq
        values = packed.tolist()
        used, i = [], 1
        for group in self.groups:
            used.append([v > 0 for v in values[i : i + len(group.params)]])
            i += len(group.params)
        return values[0], used

    def _replica_rank(self, group: ShardedParamGroup) -> int:
        """This rank's index among the ranks holding the same copy of ``group`` (its comm)."""
        if group.comm is not None:
            return group.comm.rank
        return dist.get_rank(self._process_group) if self._world_size > 1 else 0

    def step(self, *, loss_scale: float, received: list[list[bool]], after: Callable[[], None] | None = None) -> StepResult:
        """Unscale, clip, step and write the new weights back into the model.

        Args:
            loss_scale: the scale the loss was multiplied by before backward.
            received: per group and parameter, whether this rank produced a gradient.
            after: runs once the update has been applied (the engine steps its LR scheduler
                there, so a delayed update never reads a learning rate meant for the next step).

        An inf/nan anywhere (on any rank) skips the step on every rank: the norm is
        all-reduced, so all ranks see the same non-finite value and decide alike.
        Parameters that got no gradient on any rank keep their weights and optimizer
        moments, as torch optimizers skip parameters whose ``grad`` is None (a flat
        partition would otherwise apply weight decay and moment decay to them).

        With a delayed update (``offload_optimizer.delayed_param_update``) the update runs on
        a background thread and reaches the model at the next call (or
        :meth:`finish_pending_step`): the next micro-batches run on weights one update old.
        """
        self.finish_pending_step(into_forward=True)
        compressed = getattr(self.inner, "compressed_phase", None)
        if compressed is not None and compressed():
            applied, norm = self.inner.compressed_step(loss_scale=loss_scale, clip=self._clip)
            if applied:
                self.write_back_params()
                if after is not None:
                    after()
            return StepResult(applied=applied, grad_norm=norm)
        if self.streamed is not None:  # one process, no gradient partition (streamed_step.py)
            norm_sq, used = self.streamed.grad_norm_sq(), received
        else:
            norm_sq, used = self._reduce_norm_and_usage(received)
        norm = math.sqrt(norm_sq) / loss_scale
        if not math.isfinite(norm):
            if self.streamed is not None:
                self.streamed.discard()
            else:
                self.zero_grad()
            return StepResult(applied=False, grad_norm=norm)
        multiplier = 1.0 / loss_scale
        if self._clip > 0:
            # torch.nn.utils.clip_grad_norm_'s rule, so results match it exactly.
            multiplier *= min(1.0, self._clip / (norm + 1e-6))
        if self.streamed is not None:
            self._apply_streamed_update(multiplier, used)
        else:
            grads = [group.take_grad_partition() for group in self.groups]  # the next backward starts a new one
            if self._background is not None:
                self._pending = (self._background.submit(self._apply_update, grads, multiplier, used,
                                                         cast_for_upload=True), after)
                return StepResult(applied=True, grad_norm=norm)
            if self.overlapped is not None and can_overlap(self):
                # Runs on beside the next forward, host and NVMe tiers alike (offload/overlapped_update.py).
                start_overlapped_update(self, grads, multiplier, used)
            elif can_pipeline(self):
                self._apply_update(grads, multiplier, used, upload=True)  # stepped and written back bucket by bucket
            else:
                self._apply_update(grads, multiplier, used)
                self.write_back_params()
        if after is not None:
            after()
        return StepResult(applied=True, grad_norm=norm)

    def _apply_streamed_update(self, multiplier: float, used: list[list[bool]]) -> None:
        """The update without a gradient partition (streamed_step.py): unused parameters kept as
        in the flat step; stages 0-2 write back by plain copies, ZeRO-3 refreshes its shards."""
        kept = save_unused(self.groups, self.inner, used)
        self.streamed.step(multiplier)
        restore_unused(kept)
        if self.param_store is not None:
            self.write_back_params()
            return
        self.streamed.write_back()
        for listener in self.after_write_back:
            listener()

    @torch.no_grad()
    def _apply_update(
        self, grads: list[torch.Tensor | None], multiplier: float, used: list[list[bool]], *, upload: bool = False,
        cast_for_upload: bool = False,
    ) -> None:
        """Run the inner optimizer on the master partitions with these gradient partitions.

        ``upload``: ZeRO-Offload, step the offloaded groups bucket by bucket and write each
        bucket back as soon as it is stepped (partita/offload/pipelined_step.py).
        ``cast_for_upload``: the delayed update (on the background thread) also casts each
        offloaded master into its pinned upload copy, so that landing the update in
        :meth:`finish_pending_step` is a plain host-to-device copy, not a host cast as well.
        """
        in_kernel = self._prepare_update(grads, multiplier, scale_offloaded=True)
        try:
            self._step_inner(used, upload=upload)
        finally:
            if in_kernel:
                del self.inner.grad_scale
        self.grads_16bit = {}
        for group, grad in zip(self.groups, grads):
            group.master.grad = None
            group.recycle_grad_buffer(grad)
            if cast_for_upload and group.offloaded and not group.aliases_params and not group.master_pinned:
                group.fill_upload_copy()
        # The caller's list held the last references to the on-device partitions: drop them here,
        # so that the write-back after this (and its cast buffers) does not run beside them
        # (GPT-1.3B at one rank: 4.9 GiB, the step's peak at micro-batch 1).
        grads.clear()

    def _prepare_update(self, grads: list[torch.Tensor | None], multiplier: float, *, scale_offloaded: bool) -> bool:
        """The start of every update: wait for uploads still reading the masters, put the
        unscale + clip ``multiplier`` into the fused kernel (returns whether it went there) or
        into the gradients, and set each master's ``.grad``."""
        if self._uploads_queued is not None:
            # Weights go up straight from page-locked masters: no copy may still be reading
            # a master this step is about to change.
            self._uploads_queued.synchronize()
            self._uploads_queued = None
        if self.param_store is not None:
            self.param_store.wait_shard_reads()  # offload_param.gather_from_master: gathers read the masters
        in_kernel = multiplier != 1.0 and self._fused_adam
        if in_kernel:
            # Unscale + clip inside the fused Adam/AdamW kernel (its GradScaler input: grads are
            # divided by ``grad_scale``) instead of a separate pass over the gradient partition,
            # which for a host-offloaded 1.3 B model is ~70 ms of the step.
            self.inner.grad_scale = torch.tensor(1.0 / multiplier, dtype=torch.float32)
        self.grads_16bit = {}
        for g, (group, grad) in enumerate(zip(self.groups, grads)):
            if grad is not None and grad.dtype != group.master.dtype:  # fused AdamW: multiplier in grad_scale
                self.grads_16bit[g] = grad
                group.master.grad = None
                continue
            if grad is not None and multiplier != 1.0 and not in_kernel and (scale_offloaded or not group.offloaded):
                grad.mul_(multiplier)
            group.master.grad = grad  # None: the group got no gradient; torch skips it
        return in_kernel

    def finish_overlapped_update(self) -> None:
        """Wait for an overlapped update (``overlap_step_with_forward``) to be wholly in the
        model; the engine calls it at the start of every backward. A no-op without one."""
        if self.overlapped is not None:
            self.overlapped.finish()

    def _note_uploads_queued(self) -> None:
        """Record (CUDA) that the uploads queued so far read the masters until this point."""
        if any(g.master_pinned for g in self.groups):
            self._uploads_queued = torch.cuda.Event()
            self._uploads_queued.record()

    def _lands_into_forward(self) -> bool:
        """Whether a delayed update lands bucket by bucket beside the next forward (see
        :meth:`finish_pending_step`): Adam/AdamW with its state made, stages 1-2, every group
        offloaded, nothing listening for whole write-backs."""
        return (self._background is not None and self.overlapped is not None and can_pipeline(self)
                and all(g.offloaded for g in self.groups) and not self.after_write_back)

    def _land_into_forward(self, on_bucket) -> None:
        """Write the (delayed) update back bucket by bucket in the forward's order, on the
        overlap worker; each module's forward waits for its own buckets."""
        for g in reversed(range(len(self.groups))):
            for b in reversed(range(len(self.bucket_layout(g)))):
                self.write_back_group(g, [self.bucket_layout(g)[b]])
                on_bucket(g, b)
            self.groups[g].upload_copy_sent()

    def _step_inner(self, used: list[list[bool]], *, upload: bool) -> None:
        kept = save_unused(self.groups, self.inner, used)  # swapped groups: their masters only (their states are kept by the swapper)

        def restore(g: int, start: int, end: int) -> None:
            restore_unused(kept, group=g, start=start, end=end)

        if upload:
            step_and_upload(self, restore)
            self._note_uploads_queued()
        elif self._lands_into_forward():
            # A delayed step while the last update is still going up beside the forward: each
            # bucket is stepped (in the same order) once its upload has landed, so no copy
            # reads a master range this step is changing.
            held = step_accelerator_groups(self, restore)
            step_offloaded_groups(self, held, restore, snapshot_options(self), forward_order=True, write_back=False,
                                  before_bucket=self.overlapped.wait_landed)
        elif self.swapper is None and self._eight_bit:
            step_eight_bit(self.inner)  # partitions over bitsandbytes' 32-bit limit go in chunks
        elif self.swapper is None:
            self.inner.step()
            step_16bit_groups(self)  # first step (no state yet): whole groups at once
        else:
            self.swapper.step(self.inner, used)
        restore_unused(kept)

    @property
    def update_pending(self) -> bool:
        """A delayed update has been computed (or is being computed) but is not in the model yet."""
        return self._pending is not None

    def finish_pending_step(self, *, into_forward: bool = False) -> None:
        """Wait for a delayed update and write it into the model (a no-op without one).

        The engine calls this before checkpoints and exports, so what is saved is the
        state of one consistent step. ``into_forward`` (from :meth:`step`): where it can, the
        update goes up bucket by bucket beside the next forward instead of before it
        (:meth:`_land_into_forward`); the next delayed step waits per bucket for it.
        """
        self.finish_overlapped_update()
        if self._pending is None:
            return
        (future, after), self._pending = self._pending, None
        future.result()  # re-raises what failed in the background step
        if into_forward and self._lands_into_forward():
            self.overlapped.start(self._land_into_forward)
        else:
            self.write_back_params()
        if after is not None:
            after()

    @torch.no_grad()
    def write_back_params(self) -> None:
        """Copy the updated master partitions into the model's parameters on every rank."""
        store = self.param_store
        if store is not None:
            store.refresh_shards()
        for g, group in enumerate(self.groups):
            self.write_back_group(g)
            group.upload_copy_sent()
        self._note_uploads_queued()
        for listener in self.after_write_back:
            listener()

    def refine_write_back_buckets(self, g: int, max_numel: int) -> None:
        """Cut group ``g``'s write-back buckets to at most ``max_numel`` elements each (never
        coarser than ``allgather_bucket_size``; the same on every rank, as the layout is)."""
        self._gather_buckets[g] = self.groups[g].layout.buckets(min(max_numel, self._allgather_bucket_numel))

    def bucket_layout(self, g: int) -> list[Bucket]:
        """Group ``g``'s write-back (all-gather) buckets, in the order they are gathered."""
        return self._gather_buckets[g]

    def write_back_group(self, g: int, buckets: Sequence[Bucket] | None = None) -> None:
        """Write group ``g``'s updated master (or only ``buckets`` of it) into the model.

        A collective per bucket (the same buckets in the same order on every rank).
        """
        group = self.groups[g]
        if group.aliases_params:
            return  # the parameters are views of the master: already up to date
        if self.param_store is not None:
            self._write_back_persistent(group)
            return
        for bucket in self._gather_buckets[g] if buckets is None else buckets:
            self._write_back_bucket(group, bucket)

    @torch.no_grad()
    def _write_back_bucket(self, group: ShardedParamGroup, bucket: Bucket) -> None:
        # Cast bucket by bucket: a whole-partition low-precision copy would cost
        # another 2 bytes per parameter at the memory peak.
        mine = self._low_precision(group, bucket.partition_start, bucket.partition_end)
        gathered = self._gather_rows(mine, bucket.shard_numel, group)
        for spec in group.layout.specs[bucket.first : bucket.last]:
            column = spec.partition_offset - bucket.partition_start
            unpack_from_columns(gathered, column, spec, group.params[spec.index])

    @torch.no_grad()
    def _write_back_persistent(self, group: ShardedParamGroup) -> None:
        """ZeRO-3: only the persistent (small, always whole) parameters are held whole; the
        sharded ones are gathered from the master at their next use. Their shards are packed
        and all-gathered alone: gathering whole buckets for them moved the entire model after
        every step (2.6 GB for GPT-1.3B), which was most of ZeRO-3's step-time gap to FSDP2."""
        store = self.param_store
        specs = [spec for spec in group.layout.specs if not store.is_sharded_param(group.params[spec.index])]
        if not specs:
            return  # same decision on every rank: the sharded set is identical
        source = group.upload_copy if group.upload_copy_ready else group.master
        if group.layout.num_shards == 1 and group.host_transfer is None:
            # One rank, master beside the model: nothing to gather, so cast each master slice
            # straight into its parameter (the pack, its cast and the unpack were 2 extra copies).
            torch._foreach_copy_(
                [group.params[s.index].data.view(-1) for s in specs],
                [source[s.partition_offset : s.partition_offset + s.numel] for s in specs],
            )
            return
        packed = torch.cat([source[s.partition_offset : s.partition_offset + s.shard_numel] for s in specs])
        if group.host_transfer is not None:
            mine = group.host_transfer.upload(packed, group.model_dtype)  # one upload for all of them
        else:
            mine = packed.to(group.model_dtype)
        gathered = self._gather_rows(mine, sum(s.shard_numel for s in specs), group)
        column = 0
        for spec in specs:
            unpack_from_columns(gathered, column, spec, group.params[spec.index])
            column += spec.shard_numel

    def _low_precision(self, group: ShardedParamGroup, lo: int, hi: int) -> torch.Tensor:
        """Master elements ``[lo, hi)`` in the model's dtype, on the model's device."""
        if group.upload_copy_ready:
            # The delayed update's pinned copy is cast already: one host-to-device copy.
            return group.host_transfer.upload(group.upload_copy[lo:hi], group.model_dtype)
        if group.host_transfer is not None:
            return group.host_transfer.upload(group.master[lo:hi], group.model_dtype)  # cast on the host, copy asynchronously
        return group.master[lo:hi].to(group.model_dtype)

    def _gather_rows(self, mine: torch.Tensor, row_numel: int, group: ShardedParamGroup) -> torch.Tensor:
        """Every rank's ``mine`` as the rows of a ``(num_shards, row_numel)`` matrix, over the
        group's own comm (expert groups: their expert-data group; see ShardComm)."""
        num_shards = group.layout.num_shards
        if num_shards == 1:
            return mine.view(1, -1)
        gathered = torch.empty((num_shards, row_numel), dtype=mine.dtype, device=mine.device)
        process_group = self._process_group if group.comm is None else group.comm.process_group
        collectives.all_gather_into_tensor(
            gathered.view(-1), mine, group=process_group, purpose="parameter all-gather after the optimizer step"
        )
        return gathered

    def materialize_states(self) -> None:
        """NVMe offload: read the swapped optimizer states into ``inner.state`` (whole partitions,
        in host memory) so a checkpoint can read them there; undo with :meth:`release_states`.
        A no-op without NVMe offload."""
        if self.swapper is not None:
            self.finish_pending_step()
            self.swapper.materialize(self.inner)

    def release_states(self, *, loaded: bool = False) -> None:
        """NVMe offload: drop the states :meth:`materialize_states` put in ``inner.state``; with
        ``loaded=True`` (after ``inner.load_state_dict``) write them to the swap files first."""
        if self.swapper is not None:
            self.swapper.release(self.inner, write_back=loaded)

    def close(self) -> None:
        """Land a delayed update and release what offload holds: the background step thread,
        the staging workers and pools, the NVMe swap files. The optimizer cannot step afterwards."""
        self.finish_pending_step()
        if self.overlapped is not None:
            self.overlapped.close()
            self.overlapped = None
        if self._background is not None:
            self._background.shutdown(wait=True)
            self._background = None
        if self.swapper is not None:
            self.swapper.close()
        for transfer in {id(g.host_transfer): g.host_transfer for g in self.groups if g.host_transfer}.values():
            transfer.close()

    def state_dict(self) -> dict:
        self.finish_pending_step()
        self.materialize_states()
        try:
            return {"inner": self.inner.state_dict()}
        finally:
            self.release_states()

    def load_state_dict(self, state: dict) -> None:
        self.finish_pending_step()
        self.inner.load_state_dict(state["inner"])
        self.release_states(loaded=True)
