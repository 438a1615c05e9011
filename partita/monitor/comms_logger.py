"""The communication logger (``comms_logger``): count, size, latency and bandwidth per collective.

Every collective partita issues goes through :mod:`partita.distributed.collectives`, which
calls :meth:`CommsLogger.start` before and :meth:`CommsLogger.finish` after it (and
:meth:`CommsLogger.waited` after an asynchronous one is waited for). One process-wide
logger, :data:`COMMS_LOGGER`, is configured by ``partita.initialize`` from the config.

Latency is measured from the launch to completion as the issuing rank sees it:
- synchronous collectives: until the call returns (on a GPU: until the current stream is
  past it, read from two CUDA events, so timing adds no synchronisation);
- asynchronous collectives (gradient buckets overlapping backward): until ``wait()``. With
  ``overlap_comm`` that span includes the backward work done meanwhile, so the bandwidth
  shown is a lower bound; ``zero_optimization.overlap_comm: false`` times each alone.

Bandwidths follow nccl-tests (``doc/PERFORMANCE.md``): algbw = message size / time, with
message size = the full buffer (all-reduce, broadcast), the whole gathered output
(all-gather) or the whole input (reduce-scatter, all-to-all); busbw = algbw × 2(n-1)/n for all-reduce,
× (n-1)/n for all-gather, reduce-scatter and all-to-all, × 1 for broadcast — the rate each link must
sustain, comparable with the hardware's bandwidth.
"""

from __future__ import annotations

import collections
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("partita")

OPS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "all_to_all_single")

# Asynchronous collectives not waited for through collectives.wait() are dropped past this.
_MAX_PENDING = 4096


def bus_factor(op: str, group_size: int) -> float:
    """busbw / algbw for ``op`` over ``group_size`` ranks (nccl-tests)."""
    n = group_size
    if n <= 1:
        return 0.0  # nothing crosses a link
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One completed collective as this rank saw it."""

    op: str
    purpose: str
    message_bytes: int
    group_size: int
    seconds: float

    @property
    def algbw(self) -> float:
        """Bytes per second: message size / latency."""
        return self.message_bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.group_size)


@dataclass(slots=True)
class _Pending:
    op: str
    purpose: str
    message_bytes: int
    group_size: int
    start: Any  # perf_counter seconds, or a CUDA event
    end: Any = None
    work: Any = None  # keeps the Work alive so its id() is not reused while pending


@dataclass(frozen=True, slots=True)
class CommsRow:
    """Collectives of one op (and purpose, in debug mode) and one message size."""

    op: str
    purpose: str | None
    message_bytes: int
    count: int
    total_seconds: float
    group_size: int

    @property
    def avg_latency_s(self) -> float:
        return self.total_seconds / self.count

    @property
    def algbw(self) -> float:
        return self.message_bytes * self.count / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.group_size)


@dataclass(frozen=True)
class CommsSummary:
    """Aggregated records, grouped by op (and purpose) and message size."""

    rows: tuple[CommsRow, ...]
    rank: int

    def counts(self) -> dict[str, int]:
        """Number of collectives per op."""
        totals: dict[str, int] = collections.Counter()
        for row in self.rows:
            totals[row.op] += row.count
        return dict(totals)

    def total_bytes(self) -> dict[str, int]:
        """Message bytes per op (summed over every collective)."""
        totals: dict[str, int] = collections.Counter()
        for row in self.rows:
            totals[row.op] += row.message_bytes * row.count
        return dict(totals)

    def format(self) -> str:
        if not self.rows:
            return f"communication summary (rank {self.rank}): no collectives recorded"
        debug = any(row.purpose is not None for row in self.rows)
        head = f"{'op':<24}" + (f"{'purpose':<52}" if debug else "")
        lines = [
            f"communication summary (rank {self.rank}; latency until completion or wait(), "
            f"bandwidth in GB/s as nccl-tests):",
            head + f"{'msg size':>12}{'count':>8}{'total ms':>12}{'avg ms':>10}{'algbw':>10}{'busbw':>10}",
        ]
        for row in self.rows:
            purpose = f"{(row.purpose or '')[:51]:<52}" if debug else ""
            lines.append(
                f"{row.op:<24}{purpose}{format_bytes(row.message_bytes):>12}{row.count:>8}"
                f"{row.total_seconds * 1e3:>12.2f}{row.avg_latency_s * 1e3:>10.3f}"
                f"{row.algbw / 1e9:>10.3g}{row.busbw / 1e9:>10.3g}"
            )
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000.0
    return f"{n:.2f} GB"


def _purpose_family(purpose: str) -> str:
    # "gradient reduction (bucket 3 of 5)" -> "gradient reduction": one row per kind of call.
    return re.sub(r"\s*\([^)]*\)\s*$", "", purpose)


class CommsLogger:
    """Records collectives when enabled; costs one attribute check per collective when not."""

    def __init__(self) -> None:
        self.enabled = False
        self.verbose = False
        self.debug = False
        self._ops: frozenset[str] = frozenset(OPS)
        self._records: list[CommRecord] = []
        self._unresolved: collections.deque[_Pending] = collections.deque()
        self._pending: dict[int, _Pending] = {}

    def configure(self, config: Any) -> None:
        """Apply a ``comms_logger`` section (:class:`partita.monitor.config.CommsLoggerConfig`)."""
        self.enabled = bool(config.enabled)
        self.verbose = bool(config.verbose)
        self.debug = bool(config.debug)
        self._ops = frozenset(OPS) if config.prof_all else frozenset(config.prof_ops)
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self._records = []
        self._unresolved.clear()
        self._pending.clear()

    # ------------------------------------------------------------------ called by collectives
    def start(self, op: str, message_bytes: int, tensor: torch.Tensor, group: Any, purpose: str) -> _Pending | None:
        """Begin timing a collective; None when it is not recorded."""
        if not self.enabled or op not in self._ops:
            return None
        group_size = dist.get_world_size(group) if dist.is_initialized() else 1
        if tensor.is_cuda:
            start: Any = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        return _Pending(op, purpose, int(message_bytes), group_size, start)

    def finish(self, token: _Pending | None, work: Any) -> None:
        """The call returned: a synchronous collective is complete, an asynchronous one is in flight."""
        if token is None:
            return
        if work is None:
            self._stop(token)
            return
        token.work = work
        if len(self._pending) >= _MAX_PENDING:
            self._pending.pop(next(iter(self._pending)))
        self._pending[id(work)] = token

    def waited(self, work: Any) -> None:
        """``work`` was waited for: its collective is complete as this rank sees it."""
        if not self._pending:
            return
        token = self._pending.pop(id(work), None)
        if token is not None:
            token.work = None
            self._stop(token)

    def _stop(self, token: _Pending) -> None:
        if isinstance(token.start, float):
            self._add(token, time.perf_counter() - token.start)
            return
        token.end = torch.cuda.Event(enable_timing=True)
        token.end.record()
        self._unresolved.append(token)
        self._resolve(block=False)

    def _resolve(self, *, block: bool) -> None:
        while self._unresolved:
            token = self._unresolved[0]
            if block:
                token.end.synchronize()
            elif not token.end.query():
                return
            self._unresolved.popleft()
            self._add(token, token.start.elapsed_time(token.end) / 1000.0)

    def _add(self, token: _Pending, seconds: float) -> None:
        record = CommRecord(token.op, token.purpose, token.message_bytes, token.group_size, seconds)
        self._records.append(record)
        if self.verbose:
            logger.info(
                "comm op: %s | %s | time (ms): %.3f | msg size: %s | algbw (GB/s): %.2f | busbw (GB/s): %.2f",
                record.op, record.purpose, seconds * 1e3, format_bytes(record.message_bytes),
                record.algbw / 1e9, record.busbw / 1e9,
            )

    # ------------------------------------------------------------------ reading
    def records(self) -> list[CommRecord]:
        """Every completed record (waits for outstanding GPU timings)."""
        self._resolve(block=True)
        return list(self._records)

    def summary(self) -> CommsSummary:
        """Totals per op and message size (and per purpose when ``debug`` is on)."""
        groups: dict[tuple[str, str | None, int], list[CommRecord]] = collections.defaultdict(list)
        for record in self.records():
            # Tensor-parallel traffic is always its own row (it is per layer, the rest per step).
            tensor_parallel = "tensor parallel" if record.purpose.startswith("tensor parallel") else None
            purpose = _purpose_family(record.purpose) if self.debug else tensor_parallel
            groups[(record.op, purpose, record.message_bytes)].append(record)
        rows = tuple(
            CommsRow(op, purpose, size, len(items), sum(r.seconds for r in items), items[0].group_size)
            for (op, purpose, size), items in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or "", kv[0][2]))
        )
        rank = dist.get_rank() if dist.is_initialized() else 0
        return CommsSummary(rows=rows, rank=rank)


COMMS_LOGGER = CommsLogger()
"""The process-wide logger that :mod:`partita.distributed.collectives` reports to."""
