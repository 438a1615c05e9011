"""ZeRO-3's frozen parameters built under ``partita.zero.Init``: sharded, gathered, never stepped.

[Note: frozen parameters at ZeRO-3]
A parameter no optimizer group holds (``requires_grad=False``: LoRA's base weights, frozen
embeddings, a frozen vision tower) has no fp32 master, so the ZeRO groups and their shard storage
(partita/offload/param_offload.py) know nothing of it. Built under ``zero.Init`` it arrives with
its storage freed and only this rank's shard: kept as such. :class:`FrozenShards` holds each
rank's shard in the model's dtype (zero.Init's own shard tensor when the layouts agree: nothing
is materialised or copied), and the gatherer (partita/zero/param_gatherer.py) manages the
parameter like a trainable one: it belongs to its unit, is all-gathered with it (in the same
collective: its pieces follow the trainable ones in the send buffer), counts against
``stage3_max_live_parameters``, and is freed at the unit's end. Nothing reduces or steps it.

Backward: a unit's trainable parameters are freed by their gradient hooks; frozen ones get no
gradient, so :class:`partita.zero.units.ReleaseAfterBackward` sits on the unit's inputs and frees
them once autograd has the inputs' gradients, i.e. once the unit's own backward has run
(DeepSpeed frees every module's parameters at the same point). A unit whose inputs need no
gradient (the first block after a frozen embedding) keeps its frozen parameters whole until the
end of backward, as DeepSpeed does; that unit's backward is the last one anyway.

[Note: one rank]
With a ZeRO group of one rank the shard is the whole parameter. A gather then makes the
parameter share its shard's storage (freed.share_values) instead of copying it into storage of
its own, and freeing moves it back onto its own empty storage, leaving the shard intact: a
gathered frozen unit costs no memory. Copying (as before) held every gathered frozen unit twice,
the root's embedding and LM head for the whole step (1 GiB each at Llama-3-8B's shape, bf16):
DeepSpeed's world-size-1 gather (NoGatherHandle) aliases ``param.data`` to ``ds_tensor`` too.
Values are never written through the parameter outside ``GatheredParameters``, whose edits then
land in the shard directly (``adopt_whole`` copies nothing new).

Small ones (at most ``stage3_param_persistence_threshold`` elements) are gathered once and stay
whole, like persistent trainable ones. So are frozen expert parameters (sharded over another
group than zero.Init's). Frozen parameters built whole (without zero.Init) stay whole on every
rank, as before: the engine broadcasts rank 0's copy and nothing gathers them.
Their shards stay on the device also with ``offload_param`` (not offloaded yet).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from partita.zero.init_context import gather_init_param, init_shard_of, materialize_init_params
from partita.zero.partition import ShardLayout, ShardSpec
from partita.zero.shard_group import ShardComm, ShardedParamGroup

logger = logging.getLogger("partita")

__all__ = ["FrozenShards", "build_frozen_shards", "fetch_pieces"]


class FrozenShards:
    """This rank's model-dtype shard of every sharded frozen parameter (one tensor each).

    The layout is zero.Init's (alignment 1: ``ceil(numel / size)`` elements per rank) over
    ``comm``, the ZeRO group.
    """

    def __init__(self, params: Sequence[nn.Parameter], comm: ShardComm) -> None:
        self.params = list(params)
        self.comm = comm
        layout = ShardLayout.build([p.shape for p in self.params], num_shards=comm.size)
        self._spec: dict[nn.Parameter, ShardSpec] = dict(zip(self.params, layout.specs))
        self._shard: dict[nn.Parameter, torch.Tensor] = {}
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        with torch.no_grad():
            for param, spec in self._spec.items():
                init = init_shard_of(param)
                if init is not None and comm.size == world and comm.rank == rank and init.numel() == spec.shard_numel:
                    self._shard[param] = init  # zero.Init's shard is this rank's piece already
                    continue
                if init is not None:  # another layout: gathered once (collective, same order everywhere)
                    gather_init_param(param)
                start, end = spec.owned_range(comm.rank)
                shard = torch.zeros(spec.shard_numel, dtype=param.dtype, device=param.device)
                shard[: end - start].copy_(param.detach().reshape(-1)[start:end])
                self._shard[param] = shard  # the gatherer frees the whole parameter

    def __contains__(self, param: object) -> bool:
        return param in self._spec

    def spec(self, param: nn.Parameter) -> ShardSpec:
        return self._spec[param]

    def shard(self, param: nn.Parameter) -> torch.Tensor:
        return self._shard[param]

    @property
    def shared_whole(self) -> bool:
        """A ZeRO group of one rank: each shard is its parameter's whole value, so gathering a frozen
        parameter points it at its shard (``whole``, see [Note: one rank]) instead of copying it."""
        return self.comm.size == 1

    def whole(self, param: nn.Parameter) -> torch.Tensor:
        """With ``shared_whole``: the shard, viewed in the parameter's shape (no copy)."""
        return self._shard[param][: param.numel()].view(param.shape)

    def fetch_into(self, out: torch.Tensor, params: Sequence[nn.Parameter]) -> None:
        column = 0
        for param in params:
            shard = self._shard[param]
            out[column : column + shard.numel()].copy_(shard)
            column += shard.numel()

    @torch.no_grad()
    def adopt_whole(self, param: nn.Parameter) -> None:
        """The whole (gathered) parameter's values become this rank's shard (after an edit)."""
        start, end = self._spec[param].owned_range(self.comm.rank)
        shard = self._shard[param][: end - start]
        if shard.data_ptr() != param.data_ptr():  # shared (see [Note: one rank]): the edit is there already
            shard.copy_(param.detach().reshape(-1)[start:end])

    def owned(self) -> Iterator[tuple[nn.Parameter, ShardSpec, int, int, torch.Tensor]]:
        """``(param, spec, start, end, elements)``: the range of each parameter this rank holds."""
        for param, spec in self._spec.items():
            start, end = spec.owned_range(self.comm.rank)
            yield param, spec, start, end, self._shard[param][: end - start]

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._shard.values())


def build_frozen_shards(module: nn.Module, groups: Sequence[ShardedParamGroup], *, dense: ShardComm,
                        param_comms: dict, persistence_threshold: int) -> FrozenShards | None:
    """The parameters of ``module`` no ZeRO group holds that were built under zero.Init, sharded
    (see the note); persistent and expert ones are made whole for good instead."""
    trained = {p for g in groups for p in g.params}
    frozen = [p for p in module.parameters() if p not in trained and init_shard_of(p) is not None]
    whole = [p for p in frozen if p.numel() <= persistence_threshold or p in param_comms]
    materialize_init_params(whole)  # collective, the same parameters in the same order on every rank
    sharded = [p for p in frozen if p not in set(whole)]
    if not sharded:
        return None
    numel = sum(p.numel() for p in sharded)
    logger.info("ZeRO-3: %d frozen parameters (%d elements) built under zero.Init stay sharded over %d ranks and "
                "are gathered with their units like trainable ones (never reduced or stepped)",
                len(sharded), numel, dense.size)
    return FrozenShards(sharded, dense)


def fetch_pieces(storage, frozen: FrozenShards | None, pieces: list, frozen_params: list[nn.Parameter],
                 numel: int, device: torch.device) -> torch.Tensor:
    """One gather's send buffer: the trainable ``pieces`` from the shard storage, then the frozen
    parameters' shards (``numel`` elements in all)."""
    if not frozen_params:
        return storage.fetch(pieces, numel)
    if not pieces and len(frozen_params) == 1:
        return frozen.shard(frozen_params[0])
    trained = sum(piece.numel for piece in pieces)
    out = torch.empty(numel, dtype=frozen_params[0].dtype, device=device)
    if pieces:
        out[:trained].copy_(storage.fetch(pieces, trained))
    frozen.fetch_into(out[trained:], frozen_params)
    return out
