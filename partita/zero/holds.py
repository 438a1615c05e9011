"""Holds: ZeRO-3 parameters kept whole until whoever gathered them lets go.

[Note: holds]
A unit's hooks free its parameters when its forward ends (eval, no_grad) or when its gradients
are produced (training). That is right for one forward, and wrong for a caller that gathered the
parameters for a longer stretch: ``with GatheredParameters(model.parameters()): model.generate()``
(TRL's pattern) or a generation session (partita/zero/generation.py) would see every unit freed
at the end of its first forward and gathered again for every token: one collective per unit per
token, the 10-90x slowdown DeepSpeed's users report.

A *hold* is a count per parameter. While it is above zero, the gatherer's ``release`` (every
unit hook, ``release_all`` at the end of backward, GatheredParameters' own exit) leaves the
parameter GATHERED: its state, the live-element count and the storage stay consistent, it is
only not freed yet. Holds nest: each holder adds one and takes one away, and on the way out frees
only what it gathered itself (parameters already whole when it started belong to whoever made
them whole: an enclosing holder, or a unit between its training forward and backward). The last
holder out frees the rest through the ordinary ``release``.

A held parameter costs its whole size for the whole hold; holding costs no collective while it
lasts (the gathers happen once, when the hold starts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from torch import nn

if TYPE_CHECKING:
    from partita.zero.param_gatherer import ParameterGatherer

__all__ = ["Holds", "HeldParameters"]


class Holds:
    """How many holders keep each parameter whole (parameters absent: none)."""

    def __init__(self) -> None:
        self._count: dict[nn.Parameter, int] = {}  # tensors hash by identity

    def __contains__(self, param: object) -> bool:
        return param in self._count

    def __len__(self) -> int:
        return len(self._count)

    def add(self, params: Iterable[nn.Parameter]) -> None:
        for param in params:
            self._count[param] = self._count.get(param, 0) + 1

    def drop(self, params: Iterable[nn.Parameter]) -> None:
        for param in params:
            count = self._count.get(param, 0)
            if count <= 0:
                raise RuntimeError(
                    f"ZeRO-3 hold released twice for a parameter of shape {tuple(param.shape)} "
                    "(internal invariant broken: every hold ends once)"
                )
            if count == 1:
                del self._count[param]
            else:
                self._count[param] = count - 1


class HeldParameters:
    """Gather ``params`` (sharded ones of ``gatherer``) and hold them whole until :meth:`end`.

    Every rank must start holds for the same parameters in the same order (the gathers are
    collectives); ending one runs no collective.
    """

    def __init__(self, gatherer: ParameterGatherer, params: Iterable[nn.Parameter]) -> None:
        self._gatherer = gatherer
        self._params = [p for p in params if gatherer.is_sharded_param(p)]
        self._were_whole: list[nn.Parameter] = []
        self._active = False

    @property
    def params(self) -> list[nn.Parameter]:
        return self._params

    def start(self) -> HeldParameters:
        """Gather and hold the parameters: one all-gather per unit they belong to, units in the
        gatherer's order (the same on every rank), so the transient gather buffer is one unit's,
        not the whole model's."""
        gatherer = self._gatherer
        self._were_whole = [p for p in self._params if gatherer.is_gathered(p)]
        wanted = set(self._params)
        for params in gatherer.unit_params().values():
            chunk = [p for p in params if p in wanted]
            if chunk:
                gatherer.gather(chunk)
        gatherer.holds.add(self._params)
        self._active = True
        return self

    def end(self) -> None:
        """Let go; free what this hold gathered unless another hold keeps it."""
        if not self._active:
            return
        self._active = False
        gatherer = self._gatherer
        gatherer.holds.drop(self._params)
        keep = set(self._were_whole)
        gatherer.release([p for p in self._params if p not in keep])
        self._were_whole = []

    def __enter__(self) -> HeldParameters:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.end()
