"""Save on preemption: a scheduler's warning signal becomes a checkpoint and a documented exit.

SLURM (``--signal=USR1@120``) and Kubernetes (SIGTERM, then SIGKILL after the pod's
``terminationGracePeriodSeconds``) warn a job before they kill it. With ``checkpoint.save_dir``
set, partita then:

1. records the signal: the handler only sets a flag (no I/O, no locks, nothing a signal
   could interrupt halfway), so the step in progress finishes normally;
2. at the next optimizer-step boundary (the end of ``engine.step()`` that updated the weights)
   the ranks agree: one all-reduce of a 4-byte flag (MAX), so a signal that reached only some
   ranks (one pod, one node) still stops all of them at the same step, and none waits for
   another inside a collective;
3. every rank saves ``global_step{N}`` (the usual atomic save: ``<tag>.partial``, renamed, then
   ``latest``) and exits with :data:`EXIT_SAVED`; the next launch with ``checkpoint.resume``
   continues from step N, so no finished step is lost.

Exit codes (all >= 128, which Kubeflow's ``restartPolicy: ExitCode`` treats as retryable, and
none of them 128 + a common signal number):

- :data:`EXIT_SAVED` (200): the checkpoint of the last finished step is saved; relaunch to resume.
- :data:`EXIT_DEADLINE` (201): ``checkpoint.signal_save_deadline_seconds`` passed (counted from
  the signal) before the save finished, or before a step boundary came at all (a job stuck in
  data loading or evaluation still exits). What was being written stays a ``.partial``
  directory that loading never reads; the previous complete checkpoint is still ``latest``.
- :data:`EXIT_SAVE_FAILED` (202): the save raised (disk full, a rank gone); the previous complete
  checkpoint is still ``latest``.

A second signal (SLURM's SIGTERM at the time limit after the USR1 warning, a second ``kill``)
is ignored, with a line on stderr: the save in progress is the one worth finishing, the
deadline already bounds it, and SIGKILL still stops the process at once. A signal that arrives
during a save the training loop itself started lets that save finish; the job stops at the
next step boundary, one step later, with that step saved too.

The process ends with ``os._exit`` after ``engine.destroy()`` (monitors flushed, background
threads stopped) so no code after ``engine.step()`` runs and no interpreter teardown (gloo's
destructor can abort on torch 2.13) can change the exit code.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from partita.checkpoint.config import CheckpointConfig
    from partita.engine import Engine

logger = logging.getLogger("partita")

EXIT_SAVED = 200
EXIT_DEADLINE = 201
EXIT_SAVE_FAILED = 202
_WATCH_INTERVAL_S = 0.2


class _SignalState:
    """What the handler records: process-wide, since a signal is delivered to the process."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first preemption signal
        self.deadline_at: float | None = None  # time.monotonic() by which the process must have exited
        self.deadline_s = 60.0
        self.extra_signals = 0
        self.saved = False  # the save on preemption finished: a late deadline still exits with EXIT_SAVED
        self.installed: dict[int, object] = {}  # signal -> the handler that was there before
        self.watchdog: threading.Thread | None = None


_STATE = _SignalState()


def _on_signal(signum: int, frame) -> None:  # noqa: ARG001 - signal handler signature
    # Only assignments and one os.write: safe however the main thread was interrupted.
    if _STATE.signum is None:
        _STATE.signum = signum
        _STATE.deadline_at = time.monotonic() + _STATE.deadline_s
        return
    _STATE.extra_signals += 1
    os.write(2, f"[partita] signal {signum} ignored: a save on preemption is under way (it ends by "
                f"checkpoint.signal_save_deadline_seconds; SIGKILL stops the process now)\n".encode())


def _watch_deadline() -> None:
    """Background thread: exit with EXIT_DEADLINE once the deadline of a received signal passes."""
    while True:
        time.sleep(_WATCH_INTERVAL_S)
        deadline = _STATE.deadline_at
        if deadline is not None and time.monotonic() >= deadline:
            if _STATE.saved:
                os._exit(EXIT_SAVED)  # the checkpoint is complete; only the teardown was slow
            os.write(2, (f"[partita] rank {os.environ.get('RANK', '0')}: no checkpoint was completed within "
                         f"checkpoint.signal_save_deadline_seconds = {_STATE.deadline_s:g} s of the preemption "
                         f"signal; exiting with code {EXIT_DEADLINE} (the previous complete checkpoint stays "
                         "latest)\n").encode())
            os._exit(EXIT_DEADLINE)


def _install(signal_names: list[str], deadline_s: float) -> bool:
    """Install the flag-setting handler for ``signal_names``; False where signals cannot be handled."""
    if threading.current_thread() is not threading.main_thread():
        logger.warning("checkpoint.save_on_signal: partita.initialize ran outside the main thread, where Python "
                       "cannot install signal handlers; a preemption signal will not trigger a save")
        return False
    _STATE.deadline_s = deadline_s
    for name in signal_names:
        signum = getattr(signal, name)
        previous = signal.signal(signum, _on_signal)
        if previous is not _on_signal:
            _STATE.installed.setdefault(signum, previous)
            if previous not in (signal.SIG_DFL, signal.SIG_IGN, None, signal.default_int_handler):
                logger.warning("checkpoint.save_on_signal replaces the %s handler that was installed before", name)
    if _STATE.watchdog is None:
        _STATE.watchdog = threading.Thread(target=_watch_deadline, name="partita-preemption-deadline", daemon=True)
        _STATE.watchdog.start()
    return True


def restore_signal_handlers() -> None:
    """Put back the handlers that were there before (tests, or a process that trains again without saving)."""
    for signum, previous in _STATE.installed.items():
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    _STATE.installed.clear()


def reset_signal_state() -> None:
    """Forget a received signal (for tests that simulate several preemptions in one process)."""
    _STATE.signum, _STATE.deadline_at, _STATE.extra_signals, _STATE.saved = None, None, 0, False


def _warn_if_torchrun_cuts_the_save(deadline_s: float) -> None:
    """torchrun before torch 2.12 SIGKILLs ranks 30 s after it forwarded a signal (no shutdown timeout)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or deadline_s < 30:
        return
    from torch.distributed.launcher.api import LaunchConfig

    if "shutdown_timeout" not in getattr(LaunchConfig, "__dataclass_fields__", {}):
        logger.warning(
            "checkpoint.signal_save_deadline_seconds is %g s, but this torch's torchrun kills the ranks 30 s after it "
            "forwards a signal (TORCH_ELASTIC_SHUTDOWN_TIMEOUT needs torch >= 2.12); a save longer than that is cut "
            "short (the previous checkpoint stays latest). Set the deadline below 30 s", deadline_s,
        )


class PreemptionGuard:
    """The engine's end-of-step check; inert when saving on a signal is off."""

    def __init__(self, engine: Engine, section: CheckpointConfig | None) -> None:
        self.enabled = bool(section is not None and section.save_dir and section.save_on_signal)
        self.save_dir = section.save_dir if self.enabled else None
        self.interval = section.signal_check_interval_steps if section is not None else 1
        self._flag: torch.Tensor | None = None
        if self.enabled:
            self.enabled = _install(list(section.save_on_signal), section.signal_save_deadline_seconds)
        if self.enabled:
            _warn_if_torchrun_cuts_the_save(section.signal_save_deadline_seconds)
            # NCCL reduces only device tensors; gloo takes CPU ones.
            self._flag = torch.zeros(1, dtype=torch.int32, device=engine.device)

    def at_step_boundary(self, engine: Engine) -> None:
        """Called by ``engine.step()`` after an optimizer step; saves and exits if any rank got a signal."""
        if not self.enabled or engine.global_steps % self.interval:
            return
        if not self._agreed_signal():
            return
        if _STATE.deadline_at is None:  # this rank learned it from the others: its clock starts now
            _STATE.deadline_at = time.monotonic() + _STATE.deadline_s
        self._save_and_exit(engine)

    def _agreed_signal(self) -> bool:
        from partita.distributed import collectives

        self._flag.fill_(1 if _STATE.signum is not None else 0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            collectives.all_reduce(self._flag, group=None, purpose="preemption signal check", op=dist.ReduceOp.MAX)
        return bool(self._flag.item())

    def _save_and_exit(self, engine: Engine) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        what = signal.Signals(_STATE.signum).name if _STATE.signum is not None else "another rank's signal"
        logger.warning("preemption (%s): saving step %d to %s before exiting", what, engine.global_steps, self.save_dir)
        code = EXIT_SAVED
        try:
            engine.save_checkpoint(self.save_dir, async_save=False)
        except Exception as error:  # noqa: BLE001 - every failure ends the process with the documented code
            logger.error("rank %d: the save on preemption failed (%s: %s); exiting with code %d, the previous "
                         "complete checkpoint stays latest", rank, type(error).__name__, error, EXIT_SAVE_FAILED)
            code = EXIT_SAVE_FAILED
        _STATE.saved = code == EXIT_SAVED
        if code == EXIT_SAVED and rank == 0:
            logger.warning("preemption: checkpoint global_step%d saved; exiting with code %d (relaunch with "
                           "checkpoint.resume \"latest\" to continue)", engine.global_steps, EXIT_SAVED)
        _exit(engine, code)


def _exit(engine: Engine, code: int) -> None:
    try:
        engine.destroy()  # monitors flushed, offload threads stopped; no collective
    except Exception as error:  # noqa: BLE001 - the exit code matters more than a clean teardown
        logger.error("engine.destroy() failed while exiting on preemption: %s", error)
    for handler in logger.handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
