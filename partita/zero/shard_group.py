"""One optimizer parameter group under ZeRO: its model parameters, their shard layout, and
this rank's fp32 master partition with its gradient accumulator.

The packing helpers move data between full-size model tensors and the bucket layout of
:mod:`partita.zero.partition`: a ``(num_shards, bucket_shard_numel)`` matrix whose row ``r``
is what rank ``r`` owns. ``reduce_scatter_tensor`` on such a matrix leaves each rank its
row; ``all_gather_into_tensor`` of each rank's row rebuilds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from partita.zero.partition import ShardLayout, ShardSpec

if TYPE_CHECKING:
    from partita.offload.transfer import HostTransfer


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
    ) -> None:
        self.params = list(params)
        # The user's param group this came from: offload_optimizer.ratio < 1 cuts one user
        # group into two ZeRO groups, and checkpoints match groups across such cuts by it.
        self.source_index = source_index
        self.options = dict(options)
        self.shard_rank = shard_rank
        self.layout = ShardLayout.build([p.shape for p in self.params], num_shards=num_shards, alignment=alignment)
        # ZeRO-Offload: the master, its gradient and the optimizer states live in host
        # memory, and gradients/weights cross through ``host_transfer``.
        self.host_transfer = host_transfer
        device = torch.device("cpu") if host_transfer is not None else self.params[0].device
        self.master = torch.zeros(self.layout.partition_numel, dtype=torch.float32, device=device)
        self.aliases_params = False
        # The fp32 gradient partition exists only from the first reduced gradient of a step
        # until the optimizer step: allocated during backward (as activations are freed),
        # not held through the forward, where the memory peak is. It is kept apart from
        # ``master.grad``, which the inner optimizer reads and which is set only for the
        # duration of a step: a delayed (background) step can then read one step's
        # gradients while the next backward accumulates into a fresh partition.
        self.grad_partition: torch.Tensor | None = None
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
                    param.data.untyped_storage().resize_(0)

    def accumulate_grad(self, partition_start: int, reduced: torch.Tensor, *, scale: float) -> None:
        """Add a reduced bucket row (this rank's slice) into the fp32 gradient partition."""
        target = self.ensure_grad_partition()[partition_start : partition_start + reduced.numel()]
        if self.host_transfer is not None:
            self.host_transfer.add_to_host(target, reduced, scale=scale)  # asynchronous; drained after backward
            return
        # In-place add promotes bf16/fp16 into the fp32 target without a full-size fp32 temporary.
        target.add_(reduced, alpha=scale)

    def ensure_grad_partition(self) -> torch.Tensor:
        """The fp32 gradient partition, allocated (zeros) on first use after a step."""
        if self.grad_partition is None:
            self.grad_partition = torch.zeros_like(self.master)
        return self.grad_partition

    def zero_grad(self) -> None:
        self.grad_partition = None
