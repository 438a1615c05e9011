"""Prefetch in eval forwards: the next units' gathers (and host-to-device copies) start early.

[Note: eval prefetch]
The training trace (partita/zero/unit_trace.py) is recorded on the first training step and only
serves training forwards. An eval forward (``model.eval()``, ``torch.no_grad()``, every token
of ``generate``) gathers each unit on demand when its forward starts and frees it when it ends,
so the all-gather, and with ``offload_param`` the host-to-device copy (or NVMe read), of unit
k+1 waits until unit k is done. Decoding runs the same units in the same order for every token,
so the order is known after one eval forward.

:class:`EvalPrefetch` records the order of the units whose forward starts inside one eval
forward of the root (the first one, and again whenever a forward ran another order). In the
forwards after that, when a unit that the recorded order expects next starts, the gatherer
starts the gathers of the units after it, within ``stage3_prefetch_bucket_size`` elements ahead
and ``stage3_max_live_parameters`` whole at once (the gatherer's own ``_prefetch`` bounds). Once
a forward leaves the recorded order it prefetches nothing more; prefetched gathers nobody used
are finished and freed when the root's forward ends.

Ranks: a prefetch is a collective. Every rank records the same order and issues the same
prefetches as long as the ranks run the same eval forwards, which ZeRO-3 already requires
(every on-demand gather is a collective too; ``generate`` at world > 1 streams with
``synced_gpus``, partita/zero/generation.py). At world size 1 with the shards on the device there
is nothing to overlap and the gatherer's ``_prefetch`` does nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from torch import nn

if TYPE_CHECKING:
    from partita.zero.param_gatherer import ParameterGatherer

__all__ = ["EvalPrefetch"]


class EvalPrefetch:
    """The unit order of eval forwards and the prefetches it allows (see the note)."""

    def __init__(self, gatherer: ParameterGatherer) -> None:
        self._gatherer = gatherer
        self.order: list[nn.Module] | None = None  # recorded unit starts of one eval forward
        self._seen: list[nn.Module] = []
        self._position = 0
        self._following = False  # this forward matches the recorded order so far
        self._active = False  # inside an eval forward of the root
        self.prefetch_count = 0  # eval prefetches started (observability and tests)

    def begin(self, *, active: bool) -> None:
        """The root's forward starts: an eval forward (``active``) or a training one (ignored)."""
        self._active = active
        self._seen = []
        self._position = 0
        self._following = self.order is not None

    def unit_started(self, unit: nn.Module) -> None:
        """``unit`` was just gathered for its eval forward: prefetch what comes after it."""
        if not self._active:
            return  # a unit called outside the root's forward
        self._seen.append(unit)
        if not self._following:
            return
        order = self.order
        if self._position < len(order) and order[self._position] is unit:
            self._position += 1
            before = self._gatherer.prefetch_count
            self._gatherer._prefetch(self._upcoming(order, self._position))
            self.prefetch_count += self._gatherer.prefetch_count - before
        else:
            self._following = False  # another order: on demand from here on

    @staticmethod
    def _upcoming(order: list[nn.Module], position: int) -> Sequence[nn.Module]:
        return order[position:]

    def end(self) -> None:
        """The root's eval forward ended: land unused prefetches, free them, keep the order."""
        if not self._active:
            return
        self._active = False
        if not (self._following and self._position == len(self.order or ())):
            self.order = self._seen  # first forward, or the order changed: record this one
        self._seen = []
        self._gatherer.finish_prefetches()
