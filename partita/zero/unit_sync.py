"""ZeRO-3's rank-agreement check: one small all-gather that says what every rank is doing.

Every ZeRO-3 parameter gather is a collective, so every rank must run the same units in the
same order. When ranks take different branches (``if rank == 0: self.extra(x)``, per-rank
routing between blocks), their all-gathers pair up wrongly: same-sized ones silently swap
parameters, the rest wait until the collective timeout. The gatherer instead meets the other
ranks at points every rank reaches (see [Note: rank divergence] below) and
exchanges one row of four integers per rank through :meth:`UnitSync.exchange`; if the rows
differ, every rank raises :class:`RankDivergenceError` naming what each rank ran.

Rows (``kind``, a, b, c):
- ``GATHER``: about to all-gather ``unit`` a's parameters for its forward (b=0) or backward (b=1);
- ``END``: the training forward ended; a = the number of forward events when the trace is
  ready (the ranks followed it), 0 otherwise;
- ``DEVIATED``: the forward left the first step's trace at event a: it ran event code b where
  the trace has code c (code = 2 * unit index + 1 for an end, + 0 for a start; -1: none).

[Note: rank divergence]
Every gather is a collective, so all ranks must run the same units in the same order. To fail
loudly instead of hanging (or silently swapping same-sized parameters) when they do not,
ranks meet at points every rank reaches and compare what they did (``unit_sync``):
- every training forward ends with one all-gather of four integers per rank (the only cost
  once the trace is ready: one tiny collective and a host read per micro-batch);
- while the trace is not ready (the first step, or after the unit order changed), each
  on-demand parameter all-gather is preceded by such a check as well;
- once the trace is ready, a rank whose forward leaves it (a start or end event that differs
  from the first step's) knows which collectives the ranks still on the trace issue until
  the end of their forward: it issues the same ones (``_replay``), then takes part in the
  end-of-forward check with what it saw. If every rank left the trace at the same event with
  the same unit, the order changed everywhere: the trace is disabled and the forward goes on
  with checked on-demand gathers. Otherwise every rank raises ``RankDivergenceError``.
A difference that shows only in the backward (same forward units on every rank, but a unit's
output feeding the loss on one rank only) is not detected: it still waits for the timeout.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from partita.distributed import collectives

GATHER, END, DEVIATED = 1, 2, 3
_WIDTH = 4
_LIMIT = 8  # rank groups shown in the message


def ranks_agree(encoded: list[int], *, world_size: int, process_group, device: torch.device) -> bool:
    """Whether every rank recorded the same trace (``encoded``): iff the digests' variance is zero.
    Digests are kept below 2**16 so the sums of squares stay exact in float64 up to 1024 ranks;
    every rank computes the same answer from the same two sums (one all-reduce)."""
    if world_size == 1:
        return True
    digest = float(zlib.crc32(str(encoded).encode()) % (1 << 16))
    sums = torch.tensor([digest, digest * digest], dtype=torch.float64, device=device)
    collectives.all_reduce(sums, group=process_group, purpose="ZeRO-3 trace check")
    total, total_sq = sums.tolist()
    return total_sq * world_size == total * total


class RankDivergenceError(ValueError):
    """Ranks ran different ZeRO-3 units in one training forward (a model control-flow mistake)."""


class UnitSync:
    def __init__(self, *, process_group, world_size: int, device: torch.device, unit_names: list[str]) -> None:
        self._group = process_group
        self._world = world_size
        self._device = device
        self._names = unit_names
        self.exchanges = 0  # observability: how many checks this rank issued

    def exchange(self, kind: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        """All-gather this rank's row; return if every rank sent the same one, raise otherwise."""
        mine = torch.tensor([kind, a, b, c], dtype=torch.int64, device=self._device)
        rows_t = torch.empty(self._world * _WIDTH, dtype=torch.int64, device=self._device)
        collectives.all_gather_into_tensor(rows_t, mine, group=self._group, purpose="ZeRO-3 unit-order check")
        self.exchanges += 1
        rows = [tuple(r) for r in rows_t.view(self._world, _WIDTH).tolist()]
        if any(row != rows[0] for row in rows):
            raise RankDivergenceError(self._explain(rows))

    # ------------------------------------------------------------------ message
    def _explain(self, rows: list[tuple[int, ...]]) -> str:
        by_row: dict[tuple[int, ...], list[int]] = {}
        for group_rank, row in enumerate(rows):
            by_row.setdefault(row, []).append(group_rank)
        lines = [f"  {_ranks(ranks)}: {self._describe(row)}" for row, ranks in list(by_row.items())[:_LIMIT]]
        if len(by_row) > _LIMIT:
            lines.append(f"  ... and {len(by_row) - _LIMIT} more different behaviours")
        me = dist.get_rank() if dist.is_initialized() else 0
        return (
            f"partita rank {me}: ZeRO-3 ranks ran different modules in one training forward pass. Each ZeRO-3 "
            "unit's parameters are gathered by a collective that every data-parallel rank must issue in the same "
            "order, so the gathers no longer match (they would swap parameters between modules or wait until the "
            "collective timeout); stopping on every rank instead. What each rank did at this point "
            "(ranks in the data-parallel group):\n" + "\n".join(lines) + "\n"
            "Fix: run the same ZeRO-3 units (children of an nn.ModuleList, modules given to "
            "partita.zero.set_z3_leaf_modules, and the model itself) in the same order on every rank, e.g. call "
            "the module on every rank and discard its output where it does not apply, or mark a block that routes "
            "inputs to different sub-modules per rank (MoE experts) with partita.zero.set_z3_leaf_modules so it is "
            "gathered whole."
        )

    def _describe(self, row: tuple[int, ...]) -> str:
        kind, a, b, c = row
        if kind == GATHER:
            return f"gathers the parameters of {self._names[a]} for its {'backward' if b else 'forward'}"
        if kind == END:
            return "finished the forward pass" + (" as the first training step ran it" if a else "")
        if kind == DEVIATED:
            return f"at unit event {a} of its forward {self._event(b)}, where the first training step {self._event(c)}"
        return f"sent an unknown check {row}"

    def _event(self, code: int) -> str:
        if code < 0:
            return "had ended its forward"
        unit, end = divmod(code, 2)
        return f"{'ended' if end else 'started'} the forward of {self._names[unit]}"


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16])) + (", ..." if len(ranks) > 16 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"
