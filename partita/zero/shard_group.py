"""One optimizer parameter group under ZeRO: its model parameters, their shard layout, and
this rank's fp32 master partition with its gradient accumulator.

The packing helpers move data between full-size model tensors and the bucket layout of
:mod:`partita.zero.partition`: a ``(num_shards, bucket_shard_numel)`` matrix whose row ``r``
is what rank ``r`` owns. ``reduce_scatter_tensor`` on such a matrix leaves each rank its
row; ``all_gather_into_tensor`` of each rank's row rebuilds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist
from torch import nn

from partita.zero.freed import INIT, free_param
from partita.zero.partition import ShardLayout, ShardSpec

if TYPE_CHECKING:
    from partita.offload.transfer import HostTransfer


@dataclass(frozen=True, eq=False)
class ShardComm:
    """The ranks one ZeRO group reduces its gradients over and shards its partition across.

    Most groups use the whole ZeRO group (data x sequence). Expert parameters use their
    expert-data group (the ranks holding the same experts, partita/moe), so each ZeRO group
    carries its own: ``process_group`` (None: the default group), its ``size`` and this rank's
    ``rank`` in it. Identity matters: groups with the same ShardComm object share buckets.
    """

    process_group: dist.ProcessGroup | None
    size: int
    rank: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"ShardComm(size={self.size}, rank={self.rank}): need size >= 1 and 0 <= rank < size")


def pack_into_columns(out: torch.Tensor, column: int, spec: ShardSpec, full: torch.Tensor | None) -> None:
    """Write a full-size tensor (a gradient) into its columns of a packed bucket matrix.

    ``full=None`` (a parameter that received no gradient) writes zeros, so every rank
    still contributes to every collective and ranks never disagree about what is reduced.
    """
    columns = out[:, column : column + spec.shard_numel]
    if full is None:
        columns.zero_()
        return
    flat = full.detach().reshape(-1)
    padded_numel = spec.shard_numel * out.shape[0]
    if padded_numel != spec.numel:
        flat = torch.nn.functional.pad(flat, (0, padded_numel - spec.numel))
    columns.copy_(flat.view(out.shape[0], spec.shard_numel))


def unpack_from_columns(gathered: torch.Tensor, column: int, spec: ShardSpec, param: torch.Tensor) -> None:
    """Copy a parameter's columns of a gathered bucket matrix back into the full parameter."""
    columns = gathered[:, column : column + spec.shard_numel]
    param.data.view(-1).copy_(columns.reshape(-1)[: spec.numel])


class ShardedParamGroup:
    """The parameters of one optimizer group and this rank's fp32 share of them.

    Attributes:
        params: the model's parameters in layout order (never modified in identity or keys).
        layout: where each parameter's shard lives.
        master: this rank's fp32 master partition; the inner optimizer updates it.
        options: per-group optimizer options (lr, weight_decay, ...) given by the user.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        options: dict,
        num_shards: int,
        shard_rank: int,
        alignment: int = 1,
        may_alias_params: bool = True,
        host_transfer: HostTransfer | None = None,
        source_index: int = 0,
        comm: ShardComm | None = None,
        padding: tuple[int, int] = (0, 0),
        master_dtype: torch.dtype = torch.float32,
        master_device: torch.device | None = None,
    ) -> None:
        self.params = list(params)
        # Who this group's gradients are reduced with and its partition is sharded across
        # (None: the reducer's and optimizer's default group, the whole ZeRO group).
        self.comm = comm
        # The user's param group this came from: offload_optimizer.ratio < 1 cuts one user
        # group into two ZeRO groups, and checkpoints match groups across such cuts by it.
        self.source_index = source_index
        self.options = dict(options)
        self.shard_rank = shard_rank
        # padding: (lead, tail) zeros of a tier's part of a group (partita/offload/tiers.py).
        self.layout = ShardLayout.build([p.shape for p in self.params], num_shards=num_shards, alignment=alignment,
                                        lead_padding=padding[0], tail_padding=padding[1])
        # ZeRO-Offload: the master, its gradient and the optimizer states live in host
        # memory, and gradients/weights cross through ``host_transfer``.
        self.host_transfer = host_transfer
        device = torch.device("cpu") if host_transfer is not None else self.params[0].device
        # master_dtype/master_device: an inference-only group's "master" is its model-dtype shard
        # (partita/zero/inference.py); training groups keep fp32 where the optimizer steps them.
        self.master = torch.zeros(self.layout.partition_numel, dtype=master_dtype, device=master_device or device)
        # Page-locked where it is (CUDA, pin_memory): the weights then go up from it in fp32
        # and are cast on the device, so neither step needs a host cast for the upload.
        self.master_pinned = host_transfer is not None and host_transfer.pin_in_place(self.master)
        self.aliases_params = False
        # The fp32 gradient partition exists only from the first reduced gradient of a step
        # until the optimizer step: allocated during backward (as activations are freed),
        # not held through the forward, where the memory peak is. It is kept apart from
        # ``master.grad``, which the inner optimizer reads and which is set only for the
        # duration of a step: a delayed (background) step can then read one step's
        # gradients while the next backward accumulates into a fresh partition.
        self.grad_partition: torch.Tensor | None = None
        # Offloaded groups: see [Note: offloaded gradient partitions] below.
        self._spare_grad_buffers: list[torch.Tensor] = []
        # The dtype an offloaded partition starts each step in: the model's 16-bit dtype when
        # the host step reads it directly (partita/optim/host_adamw_compiled.py; set by the
        # ShardedOptimizer), else fp32. See [Note: 16-bit host gradient partitions].
        self.host_grad_dtype = torch.float32
        self._first_pass = False
        self._written: list[tuple[int, int]] = []
        self._written_starts: set[int] = set()
        self._sum_of_squares: torch.Tensor | None = None
        # Delayed update: the updated master cast to the model dtype in pinned host memory.
        self.upload_copy: torch.Tensor | None = None
        self.upload_copy_ready = False
        self._upload_copy_in_flight = None  # event: the last upload from it has finished
        self.load_master_from_params()
        if (
            may_alias_params
            and num_shards == 1
            and host_transfer is None  # an offloaded master is a host copy (even when the model is on the host)
            and all(p.dtype == torch.float32 for p in self.params)
        ):
            self._alias_params_to_master()

    @torch.no_grad()
    def _alias_params_to_master(self) -> None:
        """fp32 training with unsharded optimizer state (stage 0, or one rank): the master
        would be a second copy of the parameters. Make each parameter a view of it instead,
        so the optimizer updates the model in place and no write-back copy is needed."""
        for param, spec in zip(self.params, self.layout.specs):
            param.data = self.master[spec.partition_offset : spec.partition_offset + spec.numel].view(spec.shape)
        self.aliases_params = True

    @property
    def offloaded(self) -> bool:
        """Whether this group's master partition lives in host memory (ZeRO-Offload)."""
        return self.host_transfer is not None

    @property
    def model_dtype(self) -> torch.dtype:
        return self.params[0].dtype

    def owned_slices(self):
        """Yield ``(param, spec, (start, end))`` for the elements this rank owns of each parameter."""
        for param, spec in zip(self.params, self.layout.specs):
            yield param, spec, spec.owned_range(self.shard_rank)

    def load_master_from_params(self) -> None:
        """Set the master partition from the current model parameters (padding stays zero).

        A parameter built under ``partita.zero.Init`` has no storage, only this rank's shard:
        that shard is used directly when the layouts agree, else the parameter is gathered
        once, sliced, and freed again (a collective: every rank loads every group in order).
        """
        from partita.zero.init_context import gather_init_param, init_shard_of

        with torch.no_grad():
            for param, spec, (start, end) in self.owned_slices():
                piece = self.master[spec.partition_offset : spec.partition_offset + (end - start)]
                shard = init_shard_of(param)
                if shard is None:
                    piece.copy_(param.detach().reshape(-1)[start:end])
                elif shard.numel() == spec.shard_numel and self.layout.num_shards > 1:
                    piece.copy_(shard[: end - start])
                else:
                    gather_init_param(param)
                    piece.copy_(param.detach().reshape(-1)[start:end])
                    free_param(param, INIT)

    # [Note: offloaded gradient partitions]
    # An offloaded group's fp32 gradient partition is a reused (pinned) host buffer, not a
    # fresh zero-filled tensor per step: filling and page-faulting 4 bytes/parameter of host
    # memory every step costs more than the optimizer step itself. The first reducing pass of
    # a step *writes* each reduced slice (cast and scaled on the accelerator, copied straight
    # into the buffer) and records which ranges it wrote; once that pass is drained, ranges
    # nobody wrote (padding, parameters without a gradient at world size 1) are zeroed. Later
    # passes of the same step (gradient accumulation at stage 2) add through the staging pool.
    # While only the first pass has written, its sum of squares (accumulated on the
    # accelerator) is the partition's squared norm, so the step needs no host pass for it.
    # A buffer being stepped (possibly on the delayed-update thread) is owned by that step
    # and comes back through :meth:`recycle_grad_buffer`; at most two exist.

    # [Note: first write on the device]
    # An accelerator partition that receives unscaled slices (one rank: scale 1) starts empty, not
    # zero-filled: the first pass of a step *copies* each slice in (an exact bf16/fp32 -> fp32 cast,
    # one read and one write) instead of a memset followed by a read-add-write, which saves 8 bytes
    # per element per step (3 ms for GPT-1.3B on an H200). Ranges nobody wrote are zeroed by
    # finish_pass, as for offloaded partitions; a range written twice in one pass (a parameter
    # whose gradient arrives twice) adds the second time. The one difference from zeros + add is
    # the sign of a zero gradient (-0.0 stays -0.0, as in torch's own param.grad).

    # [Note: 16-bit host gradient partitions]
    # With ``host_grad_dtype`` bf16/fp16 an offloaded partition holds the reduced gradients as they
    # came (2 bytes down and 2 read by the host step instead of 4 and 4, and no fp32 write-back of
    # the unscaled gradient). That is exact only for plain first-pass writes of that dtype with
    # scale 1 (one rank): anything else (a second accumulating pass, an fp32 sum, a scale) first
    # widens the partition to fp32, exactly, and goes on as before (and in fp32 from then on).

    def accumulate_grad(self, partition_start: int, reduced: torch.Tensor, *, scale: float) -> None:
        """Add a reduced bucket row (this rank's slice) into the gradient partition."""
        if self.host_transfer is None and scale == 1.0 and (self.grad_partition is None or self._first_pass):
            self._write_on_device(partition_start, reduced)
            return
        target = self.ensure_grad_partition()
        if target.dtype != torch.float32 and not (self._first_pass and scale == 1.0 and reduced.dtype == target.dtype):
            target = self._widen_grad_partition()
        target = target[partition_start : partition_start + reduced.numel()]
        if self.host_transfer is not None:
            # Asynchronous either way; drained after backward.
            if self._first_pass:
                self._written.append((partition_start, partition_start + reduced.numel()))
                self.host_transfer.write_to_host(target, reduced, scale=scale, sum_of_squares=self._sum_of_squares)
            else:
                self._sum_of_squares = None  # the partition is a sum now: its norm is computed on the host
                self.host_transfer.add_to_host(target, reduced, scale=scale)
            return
        # In-place add promotes bf16/fp16 into the fp32 target without a full-size fp32 temporary.
        target.add_(reduced, alpha=scale)

    def _write_on_device(self, partition_start: int, reduced: torch.Tensor) -> None:
        """The first pass of an accelerator partition (see [Note: first write on the device])."""
        if self.grad_partition is None:
            self.grad_partition = torch.empty_like(self.master)
            self._first_pass, self._written, self._written_starts = True, [], set()
        end = partition_start + reduced.numel()
        target = self.grad_partition[partition_start:end]
        if partition_start in self._written_starts:
            target.add_(reduced)
            return
        self._written_starts.add(partition_start)
        self._written.append((partition_start, end))
        target.copy_(reduced)

    def ensure_grad_partition(self) -> torch.Tensor:
        """The fp32 gradient partition, allocated (zeros) on first use after a step; for an
        offloaded group a reused host buffer whose first pass overwrites it (see the note)."""
        if self.grad_partition is None:
            if self.host_transfer is None:
                self.grad_partition = torch.zeros_like(self.master)
            else:
                self.grad_partition = self._host_grad_buffer(self.host_grad_dtype)
                self._first_pass, self._written = True, []
                device = self.params[0].device
                self._sum_of_squares = torch.zeros((), dtype=torch.float32, device=device) if device.type == "cuda" else None
        return self.grad_partition

    def _host_grad_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """A spare offloaded gradient buffer of ``dtype``, or a new one."""
        spare = self._spare_grad_buffers
        for i, buffer in enumerate(spare):
            if buffer.dtype == dtype:
                return spare.pop(i)
        return self.host_transfer.empty_host(self.master.numel(), dtype)

    def _widen_grad_partition(self) -> torch.Tensor:
        """Replace a 16-bit offloaded partition by an exact fp32 copy (see the note)."""
        self.host_transfer.drain()  # the copies already queued into the 16-bit buffer land first
        wide = self._host_grad_buffer(torch.float32)
        wide.copy_(self.grad_partition)
        self.grad_partition = wide
        # This run's gradients need fp32 (it accumulates, or is scaled): stay there, and free the
        # 16-bit buffers, so at most two partitions exist, as without 16-bit ones.
        self.host_grad_dtype = torch.float32
        self._spare_grad_buffers = [b for b in self._spare_grad_buffers if b.dtype == torch.float32]
        return wide

    def finish_pass(self) -> None:
        """End of a reducing backward whose host copies are drained: zero what the first pass
        of an offloaded partition did not write."""
        if not self._first_pass or self.grad_partition is None:
            return
        self._first_pass = False
        end = 0
        for lo, hi in sorted(self._written):
            if lo < end:
                raise RuntimeError(f"partita: partition range [{lo}, {hi}) was written twice in one backward pass")
            if lo > end:
                self.grad_partition[end:lo].zero_()
            end = hi
        if end < self.grad_partition.numel():
            self.grad_partition[end:].zero_()
        self._written = []

    def grad_norm_sq(self, device: torch.device) -> torch.Tensor:
        """Squared L2 norm of the gradient partition, as an fp32 scalar on ``device``."""
        if self._sum_of_squares is not None and not self._first_pass:
            return self._sum_of_squares.to(device)
        return torch.linalg.vector_norm(self.grad_partition, dtype=torch.float32).square().to(device)

    def take_grad_partition(self) -> torch.Tensor | None:
        """Hand the gradient partition to an optimizer step (which gives an offloaded buffer
        back through :meth:`recycle_grad_buffer`); the next backward starts a new one."""
        grad, self.grad_partition = self.grad_partition, None
        self._first_pass, self._written, self._sum_of_squares = False, [], None
        return grad

    def recycle_grad_buffer(self, grad: torch.Tensor | None) -> None:
        """A stepped offloaded gradient buffer is free for a later step (thread-safe: list ops)."""
        if grad is not None and self.host_transfer is not None and grad.dtype == self.host_grad_dtype:
            self._spare_grad_buffers.append(grad)  # (a 16-bit one after widening is dropped)

    def zero_grad(self) -> None:
        self.recycle_grad_buffer(self.take_grad_partition())

    def fill_upload_copy(self) -> None:
        """Cast the (offloaded) master into the pinned upload copy (on the delayed update's
        thread: the host cast then overlaps the next step's forward and backward)."""
        if self.upload_copy is None:
            self.upload_copy = self.host_transfer.empty_host(self.master.numel(), self.model_dtype)
        if self._upload_copy_in_flight is not None:
            self._upload_copy_in_flight.synchronize()  # the previous upload may still read it
            self._upload_copy_in_flight = None
        self.upload_copy.copy_(self.master)
        self.upload_copy_ready = True

    def upload_copy_sent(self) -> None:
        """The upload copy has been queued for the accelerator: it may be refilled once done."""
        if self.upload_copy_ready:
            self.upload_copy_ready = False
            self._upload_copy_in_flight = self.host_transfer.event()
