"""A distributed sampler that can stop mid-epoch and resume at exactly the next sample.

torch's ``DistributedSampler`` always restarts an epoch from its first index, so a job restored
from a checkpoint either repeats or skips data. This sampler yields the same indices as
torch's for an uninterrupted epoch (same permutation from ``torch.randperm`` seeded with
``seed + epoch``, same padding, same strided split over ranks) and also counts what it handed
out, so ``state_dict()`` / ``load_state_dict()`` continue the epoch where it stopped, even on a
different number of ranks.

[Note: position bookkeeping]
The epoch's order is one global list (the shuffled permutation). Ranks take turns: position
``p`` of the list goes to rank ``p % num_replicas``. Since every rank consumes its share at the
same pace, "each rank yielded k indices" means "the first ``k * num_replicas`` positions of the
list are consumed". That global count is what the state stores (``consumed``), which is why a
resumed run may use another world size: the remaining positions are dealt out anew over the new
ranks.

The count is of indices handed to the caller. A ``DataLoader`` with ``num_workers > 0`` pulls
indices ahead of the batches it returns (``prefetch_factor * num_workers`` batches), so a state
saved while such a loader is mid-epoch runs ahead of the training loop by that many batches.
With ``num_workers=0`` (what partita's engine uses) the count is exact at batch boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler


class ResumableDistributedSampler(Sampler[int]):
    """Shuffled, rank-disjoint indices over ``dataset`` with mid-epoch resume.

    By default epochs advance by themselves: when an iteration runs to its end the sampler moves
    to the next epoch (a new permutation). ``advance_epochs=False`` is torch's
    ``DistributedSampler`` and DeepSpeed's data loader instead: an iteration that runs to its end
    starts the same epoch again, so the order changes only when the caller calls ``set_epoch``
    (and DeepSpeed client code that never does trains every epoch in the first epoch's order).
    ``set_epoch(e)`` restarts the position only when ``e`` differs from the current epoch, so
    calling it with the epoch a checkpoint was restored at keeps the restored position.

    Args:
        dataset: anything with ``len()``.
        num_replicas: number of data-parallel ranks.
        rank: this rank, in ``[0, num_replicas)``.
        shuffle: permute indices every epoch (seeded with ``seed + epoch``, identical on all ranks).
        seed: base seed; all ranks must pass the same one.
        drop_last: drop the tail that does not divide evenly over ranks; otherwise pad by
            repeating indices from the start of the epoch's order, as torch does.
        advance_epochs: move to the next epoch when an iteration ends (False: only at
            ``set_epoch``, as torch's and DeepSpeed's samplers).
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        advance_epochs: bool = True,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.advance_epochs = advance_epochs
        self.epoch = 0
        self._start = 0  # global positions of this epoch consumed before the current iteration
        self._yielded = 0  # indices this rank yielded in the current iteration

    # -- epoch order ---------------------------------------------------------------------------
    def _epoch_order(self) -> list[int]:
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(n, generator=generator).tolist()
        return list(range(n))

    def _remaining_for_rank(self, start: int) -> list[int]:
        """This rank's indices from global position ``start`` to the end of the epoch."""
        order = self._epoch_order()
        rest = order[start:]
        if self.drop_last:
            rest = rest[: len(rest) // self.num_replicas * self.num_replicas]
        else:
            padding = math.ceil(len(rest) / self.num_replicas) * self.num_replicas - len(rest)
            # Pad from the head of the epoch's order, repeated if the dataset is tiny (torch does the same).
            if padding and order:
                rest = rest + (order * math.ceil(padding / len(order)))[:padding]
        return rest[self.rank :: self.num_replicas]

    # -- Sampler protocol ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        # A new iteration continues from wherever the previous one (possibly abandoned) stopped.
        self._start = self.consumed
        self._yielded = 0
        for index in self._remaining_for_rank(self._start):
            self._yielded += 1
            yield index
        if self.advance_epochs:
            self.set_epoch(self.epoch + 1)
        else:  # the epoch ran to its end: the next iteration repeats it from its first position
            self._start = 0
            self._yielded = 0

    def __len__(self) -> int:
        """Number of indices the next iteration yields: the rest of a resumed epoch, else a full one."""
        return len(self._remaining_for_rank(self.consumed))

    # -- epochs and state ----------------------------------------------------------------------
    @property
    def consumed(self) -> int:
        """Global positions of the current epoch consumed by all ranks together."""
        return self._start + self._yielded * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its permutation). A different epoch starts from its beginning; the
        current epoch keeps its position."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._start = 0
            self._yielded = 0

    def state_dict(self) -> dict[str, Any]:
        """Position to resume from: epoch and global positions consumed, plus the settings that
        must match on resume (they decide the order)."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "num_replicas": self.num_replicas,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position. ``num_replicas`` may differ from the saving run; seed,
        shuffle and dataset length may not, because they define the order being resumed."""
        mismatched = {
            key: (state[key], mine)
            for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("dataset_len", len(self.dataset)))
            if key in state and state[key] != mine
        }
        if mismatched:
            details = ", ".join(f"{k}: saved {saved!r}, now {now!r}" for k, (saved, now) in mismatched.items())
            raise ValueError(
                f"cannot resume the sampler: {details}; build it with the saved settings and the same dataset"
            )
        self.epoch = int(state["epoch"])
        self._start = int(state["consumed"])
        self._yielded = 0


def infinite_batches(loader: Iterable) -> Iterator[Any]:
    """Yield batches from ``loader`` forever, one epoch after another, each in a new order.

    With :class:`ResumableDistributedSampler` the sampler advances its epoch by itself; with a
    sampler that does not (torch's ``DistributedSampler``, or ours with ``advance_epochs=False``)
    this calls ``set_epoch(epoch + 1)`` between passes so the order still changes.
    """
    sampler = getattr(loader, "sampler", None)
    empty_passes = 0
    while True:
        epoch_before = getattr(sampler, "epoch", None)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        # One empty pass is normal: a state saved right after an epoch's last batch resumes at
        # its end. Two in a row mean the loader can never yield anything.
        empty_passes = empty_passes + 1 if empty else 0
        if empty_passes == 2:
            raise ValueError(
                "the data loader yielded no batch in a whole epoch; the dataset is smaller than one "
                "global batch (check drop_last, batch size and number of ranks)"
            )
        if hasattr(sampler, "set_epoch") and getattr(sampler, "epoch", None) == epoch_before:
            sampler.set_epoch(epoch_before + 1)
