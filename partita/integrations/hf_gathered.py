"""``GatheredParameters`` as transformers' ZeRO-3 code needs it: also for a model built under
``partita.zero.Init`` and not yet handed to ``partita.initialize``.

transformers calls ``deepspeed.zero.GatheredParameters`` on a ZeRO-3 model *before* any engine
exists: ``from_pretrained`` loads each module's weights inside
``GatheredParameters(params, modifier_rank=0)`` with only rank 0 running
``module._load_from_state_dict``; ``resize_token_embeddings`` reads and copies embedding rows
inside it; ``_initialize_missing_keys`` and ``from_config`` initialise weights inside it.
``partita.zero.GatheredParameters`` serves parameters an engine manages; parameters that
``zero.Init`` sharded at construction have no engine yet. This class serves all three kinds:

- **engine-managed** (after ``initialize``): delegated to ``partita.zero.GatheredParameters``;
- **sharded by zero.Init, no engine yet**: on entry each one is made whole on every rank, in
  place (one all-gather per parameter; the parameter object, its shape and its identity never
  change), so code that runs on one rank only (``if rank == 0: module._load_from_state_dict(...)``)
  reads and writes whole tensors. On exit with a ``modifier_rank`` that rank's whole value is
  broadcast and each rank keeps its slice of it; without one, each rank's shard is put back as it
  was on entry (edits dropped, as DeepSpeed drops them). Either way the whole value is freed: at
  most the listed parameters are whole at once, never the model;
- **plain tensors** (a parameter nobody shards, such as the new embedding transformers builds
  in ``resize_token_embeddings``, or a buffer): nothing to gather; with a ``modifier_rank`` its
  values are broadcast on exit, so every rank agrees with the modifier (DeepSpeed leaves them
  as each rank computed them; ``initialize`` would broadcast them later anyway).

Refused: a block with a ``modifier_rank`` that lists an engine-managed parameter together with a
trainable parameter no engine manages. That is ``resize_token_embeddings`` (or any module swap)
after ``initialize``: the engine's fp32 masters, optimizer state and ZeRO-3 units were built for
the old parameter and would silently keep training it. DeepSpeed does not support it either.

What this needs from partita.zero beyond its public API (partita/zero is not this package's):
"built under zero.Init, no engine yet" (``init_shard_of`` and ``owner_of``), and zero.Init's own
gather/reshard pair for such a parameter (``gather_init_param``: whole on every rank, collective;
``reshard_init_param``: keep this rank's slice of the current value and free it). A public
``partita.zero.GatheredParameters`` that serves these parameters would make this class a thin
delegate.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

import partita.zero
from partita.zero.init_context import gather_init_param, init_shard_of, reshard_init_param

__all__ = ["GatheredParameters", "is_engine_managed"]

# Construction-sharded parameters this module made whole -> [this rank's shard on entry (read-only
# blocks put it back) or None, depth]. The depth lets blocks nest (the outermost block frees).
_WHOLE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _sharded_before_initialize(param: torch.Tensor) -> bool:
    """True for a parameter ``partita.zero.Init`` sharded that no engine manages yet (the same
    test partita/zero/state_dict_guard.py makes for its hints)."""
    from partita.zero.gathered import owner_of

    return isinstance(param, nn.Parameter) and owner_of(param) is None and init_shard_of(param) is not None


def is_engine_managed(param: torch.Tensor) -> bool:
    from partita.zero.gathered import owner_of

    return owner_of(param) is not None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class GatheredParameters:
    """``deepspeed.zero.GatheredParameters`` for transformers' ZeRO-3 paths (see the module doc).

    Args:
        params: a tensor or an iterable of tensors (parameters of any kind, buffers); ``None``
            entries are skipped (transformers passes a missing bias as ``None``).
        modifier_rank: the rank whose edits inside the block are kept and reach every rank;
            None: read-only, edits to sharded parameters are dropped.
        fwd_module: accepted for DeepSpeed's signature; it has no effect in partita.
        enabled: False makes the block a no-op.

    Every rank must enter the block with the same parameters in the same order.
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        unique: dict[int, torch.Tensor] = {}
        for p in params if enabled else ():
            if p is not None:
                unique.setdefault(id(p), p)
        tensors = list(unique.values())
        self._modifier_rank = modifier_rank
        self._engine = [p for p in tensors if is_engine_managed(p)]
        self._sharded = [p for p in tensors if _sharded_before_initialize(p)]
        self._plain = [p for p in tensors if not is_engine_managed(p) and not _sharded_before_initialize(p)]
        self._inner = partita.zero.GatheredParameters(self._engine, modifier_rank=modifier_rank) if self._engine else None
        if modifier_rank is not None and self._engine:
            unmanaged = [p for p in self._plain + self._sharded if isinstance(p, nn.Parameter) and p.requires_grad]
            if unmanaged:
                shapes = ", ".join(str(list(p.shape)) for p in unmanaged)
                raise NotImplementedError(
                    "GatheredParameters(modifier_rank=...) lists parameters a partita engine trains together with "
                    f"trainable parameters no engine manages (shapes {shapes}): this is resize_token_embeddings or "
                    "another module swap after partita.initialize, which the engine's optimizer state and ZeRO-3 "
                    "shards cannot follow. Resize (or swap modules) before initialize: build or load the model "
                    "(under partita.zero.Init if you like), resize it, then call partita.initialize"
                )

    def __enter__(self) -> GatheredParameters:
        if self._inner is not None:
            self._inner.__enter__()
        for p in self._sharded:  # the same parameters in the same order on every rank: one gather each
            entry = _WHOLE.get(p)
            if entry is not None:
                entry[1] += 1  # already whole in an enclosing block
                continue
            # A read-only block drops edits: this rank's shard as it was, to put back on exit.
            kept = init_shard_of(p).clone() if self._modifier_rank is None else None
            gather_init_param(p)  # whole on every rank, in place: the parameter object never changes
            _WHOLE[p] = [kept, 1]
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            keep = self._modifier_rank is not None and exc_type is None
            if keep:
                self._adopt_plain()
            self._release_sharded(keep)
        finally:
            if self._inner is not None:
                self._inner.__exit__(exc_type, *exc)

    @torch.no_grad()
    def _adopt_plain(self) -> None:
        if not _distributed():
            return
        for p in self._plain:
            if p.numel() and p.device.type != "meta":
                dist.broadcast(p.data, src=self._modifier_rank)

    @torch.no_grad()
    def _release_sharded(self, keep: bool) -> None:
        for p in self._sharded:
            entry = _WHOLE[p]
            entry[1] -= 1
            if entry[1]:
                continue  # an enclosing block frees it
            del _WHOLE[p]
            if keep and _distributed():
                dist.broadcast(p.data, src=self._modifier_rank)  # the modifier's whole value on every rank
            reshard_init_param(p)  # this rank keeps its slice; the whole value is freed
            if not keep and entry[0] is not None:
                init_shard_of(p).copy_(entry[0])  # read-only: the shard as it was on entry
