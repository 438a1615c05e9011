"""What every stage does when one stage of a pipeline fails, so no rank hangs.

Stages wait on each other (activations forward, gradients back, the data-parallel reduction
after the batch): a stage that raises leaves its neighbours waiting for messages that never
come, until the collective timeout (``distributed.timeout_seconds``, 30 minutes by default),
and their error (a gloo "Connection closed" or a timeout) does not say which stage failed.
Two cases:

- **Reading the batch** (only the first and last stages read the data iterator): every rank
  reports whether it read its micro-batches in one small all-reduce per batch (the lowest
  failed rank), before any stage starts the schedule. A rank that failed raises its own error;
  the others raise :class:`StageFailure` naming the lowest failed rank, its stage and error (sent
  through the job's store), and the engine stays usable (nothing was sent).
- **Inside the batch** (a layer raising in forward or backward, a shape that does not fit the
  next stage, a failed reduction): the batch cannot be finished on any stage. The failing rank
  writes ``stage, rank, error`` to the job's store (the first failure wins) and tears down its
  process groups (:func:`partita.distributed.shutdown.teardown_process_groups`), which closes its
  connections: every neighbour's wait ends at once with a connection error, reads the report
  and raises :class:`StageFailure` naming the failed stage and rank, then tears down its own
  groups, so the failure spreads to every stage and data rank in seconds. The process groups are
  gone afterwards: the job must restart (as after any rank failure).

The store is the one the default process group was created with (``_get_default_store``, a
private torch function with the same name and meaning from torch 2.0 to 2.13); without it the
errors still end every rank, naming only this rank.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from partita.distributed import collectives
from partita.distributed.collective_errors import CollectiveError

__all__ = ["FailureReporter", "StageFailure", "describe"]

# Backend messages that mean "a peer went away", not "this rank's own code failed".
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
              "Timed out", "timed out", "Socket Timeout", "communicator was aborted", "has been destroyed",
              "not been initialized", "Default process group has not been initialized")
# How long a rank that lost a peer waits for the peer's report in the store.
_REPORT_WAIT_S = 20.0


class StageFailure(RuntimeError):
    """A pipeline stage failed; raised on every stage, naming the failed stage and rank."""


def describe(value: Any) -> str:
    """``(2, 5, 8) float32`` for a tensor, ``((2, 5, 8) float32, (2, 5) int64)`` for a tuple."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    return type(value).__name__


def _peer_lost(error: BaseException) -> bool:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, (CollectiveError, dist.DistError)) or any(s in str(seen) for s in _PEER_LOST):
            return True
        seen = seen.__cause__
    return False


def _explain(error: BaseException) -> str:
    """The error and its causes, innermost last (torch wraps a stage's error in its own)."""
    parts, seen = [], error
    while seen is not None and len(parts) < 4:
        if seen.__cause__ is not None and "failed to run" in str(seen) and type(seen) is RuntimeError:
            # PipelineStage's wrapper ("[Stage 1] failed to run forward: args: ..."), raised on some
            # steps and torch versions only: the error it wraps (with partita's note) says more.
            seen = seen.__cause__
            continue
        text = " ".join(str(seen).split())  # torch's messages span indented lines
        notes = "".join(f" [{n}]" for n in getattr(seen, "__notes__", ()))
        parts.append(f"{type(seen).__name__}: {text}{notes}")
        seen = seen.__cause__
    return " <- caused by ".join(parts)


class FailureReporter:
    """One pipeline engine's failure handling (see the module docstring)."""

    _engines = 0  # engines built in this process; every rank builds them in the same order

    def __init__(self, *, stage: int, rank: int, device: torch.device) -> None:
        FailureReporter._engines += 1
        self.stage, self.rank, self.device = stage, rank, device
        self._prefix = f"partita/pipe/engine{FailureReporter._engines}"
        self._reads = 0
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self._store: Any = _get_default_store()
        except Exception:  # noqa: BLE001 - no store: failures still end every rank, unnamed
            self._store = None

    # ------------------------------------------------------------------ reading the batch
    def agree_on_read(self, error: Exception | None, caller: str) -> None:
        """Every rank: raise ``error`` on the rank that had it, StageFailure on the others."""
        self._reads += 1
        key = f"{self._prefix}/read{self._reads}"
        if error is not None and self._store is not None:
            self._store.set(f"{key}/rank{self.rank}", f"stage {self.stage} (rank {self.rank}): {_explain(error)}")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            # The lowest failed rank (world: none failed): the one every other rank names.
            flag = torch.tensor([self.rank if error is not None else world], dtype=torch.int64, device=self.device)
            collectives.all_reduce(flag, group=None, op=dist.ReduceOp.MIN, purpose="pipeline: did every stage read its data")
            failed = int(flag.item())
        else:
            failed = self.rank if error is not None else world
        if error is not None:
            raise error
        if failed < world:
            report = self._read_report(f"{key}/rank{failed}", fallback=f"rank {failed}")
            raise StageFailure(f"{caller}() on stage {self.stage} (rank {self.rank}) did not run: reading the batch "
                               f"failed on {report}")

    # ------------------------------------------------------------------ inside the batch
    @contextlib.contextmanager
    def guard(self, caller: str) -> Iterator[None]:
        """Around work every stage must finish together: a failure ends every stage."""
        try:
            yield
        except StageFailure:
            raise
        except Exception as error:  # noqa: BLE001 - re-raised as StageFailure below
            self._fail(error, caller)

    def _fail(self, error: Exception, caller: str) -> None:
        key = f"{self._prefix}/failure"
        mine = f"stage {self.stage} (rank {self.rank}): {_explain(error)}"
        lost = _peer_lost(error)
        report = None
        if self._store is not None:
            try:
                if not lost and self._store.add(f"{key}/count", 1) == 1:
                    self._store.set(key, mine)  # the first failure is the one every stage names
                elif lost:
                    report = self._read_report(key, fallback=None)
            except Exception:  # noqa: BLE001 - the store itself may be gone: report what this rank knows
                report = None
        _teardown()
        if not lost:
            raise StageFailure(f"{caller}(): pipeline stage {self.stage} (rank {self.rank}) failed; every stage "
                               f"stops: {_explain(error)}") from error
        if report is not None:
            raise StageFailure(f"{caller}() on stage {self.stage} (rank {self.rank}) stopped: pipeline {report}") from error
        raise StageFailure(f"{caller}() on stage {self.stage} (rank {self.rank}) stopped: another stage or data rank "
                           f"failed or died without a report: {_explain(error)}") from error

    def _read_report(self, key: str, *, fallback: str | None) -> str | None:
        if self._store is None:
            return fallback
        try:
            self._store.wait([key], timedelta(seconds=_REPORT_WAIT_S))
            return self._store.get(key).decode()
        except Exception:  # noqa: BLE001 - no report in time
            return fallback


def _teardown() -> None:
    from partita.distributed.shutdown import teardown_process_groups

    if dist.is_initialized():
        try:
            teardown_process_groups()
        except Exception:  # noqa: BLE001 - already failing; the caller raises the real error
            pass
