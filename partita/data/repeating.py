"""``RepeatingLoader``: DeepSpeed's endless wrapper around a data loader, for client code that
imports it (``deepspeed.runtime.dataloader.RepeatingLoader``, DeepSpeedExamples' pipeline scripts).

It behaves as DeepSpeed 0.19.8's: ``next()`` returns the loader's next batch and, when the loader
runs out, starts a new pass over it, without touching its sampler. So with a sampler that does
not advance by itself (torch's ``DistributedSampler``, or the loader ``partita.initialize``
returns) every pass repeats the first pass's order, exactly as on DeepSpeed. For a new order
every epoch use :func:`partita.data.infinite_batches`, which calls ``set_epoch`` between passes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["RepeatingLoader"]


class RepeatingLoader:
    """Iterate ``loader`` forever, restarting it when a pass ends."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.data_iter: Iterator = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            try:
                return next(self.data_iter)
            except StopIteration:  # a loader with no batch at all would loop forever
                raise ValueError("RepeatingLoader: the loader yielded no batch in a whole pass; the dataset is "
                                 "smaller than one batch (check drop_last, batch size and number of ranks)") from None

    def __len__(self) -> int:
        """One pass's batches (DeepSpeed's has none; handy for progress bars)."""
        return len(self.loader)  # type: ignore[arg-type]
