"""What ``partita run`` sets up so a scheduler's warning signal reaches the training processes.

The ranks save and exit on SIGTERM / SIGUSR1 (:mod:`partita.checkpoint.preemption`), but under
torchrun the scheduler signals the agent (``partita run`` itself), not the ranks: torchrun starts
each rank in its own session, so a signal to the launcher's process group does not reach them.
torchrun's agent forwards the signals of its ``--signals-to-handle`` option (default SIGTERM,
SIGINT, SIGHUP, SIGQUIT: without SIGUSR1 there, SLURM's usual ``--signal=USR1@120`` would kill
the agent and orphan the ranks) and then waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds
(default 30) before it SIGKILLs ranks still running, which would cut a save short.

The option's default comes from ``PET_SIGNALS_TO_HANDLE`` (torchrun reads ``PET_<OPTION>`` for
every option), so it is set as an environment default, like the timeout: a value the user
exported wins, and a torch without the option ignores it. (torchrun overwrites
``TORCHELASTIC_SIGNALS_TO_HANDLE``, the variable its process code reads, with the option's value,
so setting that one alone does nothing.) torch versions older than 2.12 ignore the shutdown
variable (their 30 s are fixed): keep ``checkpoint.signal_save_deadline_seconds`` below 30 there.
"""

from __future__ import annotations

import signal
from collections.abc import MutableMapping

FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
# checkpoint.signal_save_deadline_seconds' default (60) plus time to finish the step in progress.
SHUTDOWN_TIMEOUT_S = 90


def prepare_signal_forwarding(environ: MutableMapping[str, str]) -> None:
    """Make torchrun's agent forward the preemption signals and give the ranks time to save."""
    environ.setdefault("PET_SIGNALS_TO_HANDLE", FORWARDED_SIGNALS)
    environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))


def signal_exit_code(sigval: int | signal.Signals) -> int:
    """The launcher's status after a signal stopped the job: 128 + N, as a shell reports it.

    The ranks' own codes (200 saved, 201 deadline, 202 save failed) are in their log lines;
    torchrun does not hand them back once the agent itself was signalled.
    """
    return 128 + int(sigval)
