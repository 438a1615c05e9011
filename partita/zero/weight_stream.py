"""``engine.iter_16bit_weight_buckets``: the whole model in its 16-bit dtype, streamed in buckets of
bounded size, for the weight sync to a generator (vLLM's ``model.load_weights(weights)`` takes an
iterable of ``(name, tensor)``; SGLang's ``update_weights_from_tensor`` a list of them).

[Note: bounded weight streaming]
Gathering the whole model on one rank first (``_zero3_consolidated_16bit_state_dict``, or TRL's
``GatheredParameters(model.parameters())``) needs the model's size in free memory, which is what
runs a ZeRO-3 run out of memory at sync time. Here the model's state-dict entries are made whole
one at a time, in ``module.state_dict()`` order, and handed out in lists of at most ``bucket_bytes``
(a tensor larger than that comes alone):

- ZeRO-3: a parameter is gathered (partita/zero/param_gatherer.py) and held whole until its bucket
  has been handed out, then freed; the yielded tensor *is* the gathered parameter, no copy;
- stages 0-2: every rank holds every parameter already; the yielded tensor is the parameter's own
  storage (detached), nothing is allocated;
- tensor parallelism: the tensor shards are gathered over the tensor group into a new whole tensor
  (the ZeRO-3 gather of the local piece is freed at once); expert parallelism: every expert rank's
  copy of each local expert comes back under its global checkpoint name (partita/moe/registry.py).
  Both through partita/zero/export.py's ``whole_copies``, the code ``save_16bit_model`` uses, so names
  and values are the same as its (``.bin``: a tied weight under each of its names, one tensor).

So besides its own shards a rank holds at most one bucket plus the entry being made whole (under
tensor parallelism also that entry's local piece while it is assembled). The decision to hand out the
bucket is taken from the entry's size before it is gathered (its whole shape is known from the
metadata), so the bucket goes out before the next entry's memory is taken.
Every rank yields the same buckets (the gathers are collectives): every rank must iterate to the end,
or stop on every rank at the same bucket (``close()`` the iterator: held parameters are freed).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from partita.moe.registry import global_expert_names
from partita.zero.api import ZeroState
from partita.zero.export import _split_of, state_dict_entries, whole_copies
from partita.zero.gathered import owner_of

__all__ = ["WeightStream", "iter_16bit_weight_buckets"]

Bucket = list[tuple[str, torch.Tensor]]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def export_nbytes(name: str, tensor: torch.Tensor) -> int:
    """Bytes of the whole tensors ``whole_copies`` will return for ``tensor``, from metadata only."""
    shard = _split_of(tensor)
    numel = math.prod(shard.full_shape) if shard is not None else tensor.numel()
    return numel * tensor.element_size() * len(global_expert_names(name, tensor))


class WeightStream:
    """Iterable of buckets (lists of ``(name, whole tensor)``); ``peak_extra_bytes`` is the most this rank
    held at once beyond its own model storage (gathered parameters, assembled whole tensors), counted
    while it streams; ``largest_bytes`` the largest entry's whole size."""

    def __init__(self, module: nn.Module, zero: ZeroState, *, bucket_bytes: int,
                 exclude_frozen_parameters: bool = False) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"iter_16bit_weight_buckets(bucket_bytes={bucket_bytes!r}): bucket_bytes must be a positive "
                             "int, the most bytes of tensors one bucket holds (e.g. 512 << 20 for 512 MiB)")
        self.bucket_bytes = bucket_bytes
        self._module, self._zero, self._exclude = module, zero, exclude_frozen_parameters
        self.peak_extra_bytes = 0
        self.largest_bytes = 0
        self.buckets = 0
        self._extra = 0
        self._started = False

    def __iter__(self) -> Iterator[Bucket]:
        if self._started:
            raise RuntimeError("iter_16bit_weight_buckets: this stream was iterated already; call the engine method "
                               "again for a new one (every rank together)")
        self._started = True
        return self._stream()

    def _count(self, delta: int) -> None:
        self._extra += delta
        self.peak_extra_bytes = max(self.peak_extra_bytes, self._extra)

    @torch.no_grad()
    def _stream(self) -> Iterator[Bucket]:
        entries, unique, first_name = state_dict_entries(self._module, exclude_frozen_parameters=self._exclude)
        names_of: dict[str, list[str]] = {}  # first key -> every key of that tensor (tied aliases)
        for name, tensor in entries.items():
            names_of.setdefault(first_name[id(tensor)], []).append(name)
        bucket: Bucket = []
        size = 0
        held: list[nn.Parameter] = []  # ZeRO-3 parameters this stream gathered, freed with their bucket
        held_extra = 0  # bytes of the current bucket this stream allocated
        gatherer = self._zero.gatherer
        try:
            for name, tensor in unique:
                nbytes = export_nbytes(name, tensor)
                self.largest_bytes = max(self.largest_bytes, nbytes)
                if bucket and size + nbytes > self.bucket_bytes:
                    self.buckets += 1
                    yield bucket
                    bucket, size = [], 0
                    self._release(held)
                    self._count(-held_extra)
                    held, held_extra = [], 0
                mine = (gatherer is not None and isinstance(tensor, nn.Parameter) and owner_of(tensor) is self._zero
                        and gatherer.is_sharded_param(tensor) and not gatherer.is_gathered(tensor))
                if mine:
                    gatherer.gather([tensor])
                    self._count(_nbytes(tensor))
                full = tensor.detach()
                copies = whole_copies(name, tensor, full)
                fresh = sum(_nbytes(t) for _, t in copies if t is not full)
                self._count(fresh)
                if mine and fresh:  # the whole copy is what goes out: the gathered piece is freed now
                    gatherer.release([tensor])
                    self._count(-_nbytes(tensor))
                    mine = False
                if mine:
                    held.append(tensor)
                    held_extra += _nbytes(tensor)
                held_extra += fresh
                values = [t for _, t in copies]
                for alias in names_of[name]:  # a tied weight under each of its names, the same tensor
                    bucket.extend(zip(global_expert_names(alias, tensor), values))
                size += nbytes
            if bucket:
                self.buckets += 1
                yield bucket
        finally:  # the end, or close() / an error: nothing stays gathered
            self._release(held)
            self._count(-held_extra)

    def _release(self, params: list[nn.Parameter]) -> None:
        if params:
            self._zero.gatherer.release(params)


def iter_16bit_weight_buckets(module: nn.Module, zero: ZeroState, *, bucket_bytes: int,
                              exclude_frozen_parameters: bool = False) -> WeightStream:
    """The stream (see the note); every rank calls it and iterates it alike."""
    return WeightStream(module, zero, bucket_bytes=bucket_bytes, exclude_frozen_parameters=exclude_frozen_parameters)
