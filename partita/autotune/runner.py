"""Run one autotuning trial: the user's script as its own ``partita run`` launch.

A separate launch per trial, because a trial that runs out of memory or crashes leaves a
process (and a CUDA context, a process group) that cannot be trusted for the next one. The
trial's files live in ``exps_dir/<trial>/``: ``config.json`` (what it ran), ``log.txt``
(stdout and stderr of every rank), ``result.json`` (rank 0's measurements).

Outcomes: ``ok`` (a result was written), ``oom`` (the log shows an out-of-memory error),
``timeout`` (killed after ``timeout_s``) and ``failed`` (anything else: the last error line
of the log is kept). None of them stops the tuner.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partita.autotune.trial_env import OVERRIDE_ENV, REPORT_ENV, STEPS_ENV

__all__ = ["TrialOutcome", "oom_figures", "run_trial"]

_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|out of memory|Cannot allocate memory|std::bad_alloc")
# torch's CUDA out-of-memory message (c10/cuda/CUDACachingAllocator.cpp, format_size's units): each
# figure read on its own, so a torch that words the rest differently still yields the ones it prints.
_SIZE = r"([0-9]+(?:\.[0-9]+)?) (bytes|KiB|MiB|GiB|TiB)"
_UNIT = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_OOM_FIGURES = {
    "oom_requested_bytes": re.compile(r"Tried to allocate " + _SIZE),
    "oom_capacity_bytes": re.compile(r"total capac\w* of " + _SIZE),
    "oom_free_bytes": re.compile(r"of which " + _SIZE + r" is free"),
    "oom_allocated_bytes": re.compile(_SIZE + r" is allocated by PyTorch"),
    "oom_cached_bytes": re.compile(_SIZE + r" is reserved by PyTorch but unallocated"),
}
_ERROR_LINE = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?([A-Za-z_.]*(?:Error|Exception|Interrupt)\b.*)$")
# Another launcher's layout must not turn a single-node trial into part of a cluster job.
_LAYOUT_PREFIXES = ("PET_", "SLURM_", "JOBSET_", "TORCHELASTIC_")
_LAYOUT_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "JOB_COMPLETION_INDEX",
                 "REPLICATED_JOB_NAME", "REPLICATED_JOB_REPLICAS", "JOB_INDEX")


@dataclass
class TrialOutcome:
    status: str  # ok, oom, timeout, failed
    seconds: float
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def _trial_env(config_path: Path, report_path: Path, steps: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAYOUT_NAMES and not k.startswith(_LAYOUT_PREFIXES)}
    env[OVERRIDE_ENV] = str(config_path)
    env[REPORT_ENV] = str(report_path)
    env[STEPS_ENV] = str(steps)
    return env


def oom_figures(log: str) -> dict[str, int]:
    """The figures of the last CUDA out-of-memory message in ``log``, in bytes: what was requested, the
    device's capacity and free memory, what PyTorch had allocated and what it held cached but could
    not use (reserved but unallocated: the fragmentation that made the request fail). Kept in the
    trial's record so a sweep's failures can recalibrate the tuner's guard (partita/autotune/tuner.py)."""
    start = log.rfind("Tried to allocate")
    if start < 0:
        return {}
    text = log[start:].split("\n", 1)[0]
    found = {}
    for name, pattern in _OOM_FIGURES.items():
        match = pattern.search(text)
        if match:
            found[name] = int(float(match.group(1)) * _UNIT[match.group(2)])
    return found


def _last_error(log: str) -> str:
    for line in reversed(log.splitlines()):
        match = _ERROR_LINE.match(line)
        if match:
            return match.group(1).strip()[:300]
    tail = [line.strip() for line in log.splitlines() if line.strip()]
    return tail[-1][:300] if tail else "no output"


def run_trial(
    *,
    folder: Path,
    config: dict[str, Any],
    script: str,
    script_args: list[str],
    nproc: int,
    steps: int,
    module: bool = False,
    timeout_s: float = 600.0,
) -> TrialOutcome:
    """Launch the script once with ``config`` for ``steps`` optimizer steps; never raises for its failure."""
    folder.mkdir(parents=True, exist_ok=True)
    config_path, report_path, log_path = folder / "config.json", folder / "result.json", folder / "log.txt"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    report_path.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "partita.launcher.cli", "run", "--nproc", str(nproc)]
    argv += (["--module"] if module else []) + [script, *script_args]
    begin = time.perf_counter()
    with open(log_path, "w") as log:
        # A session of its own, so a timeout kills torchrun and every worker it started.
        process = subprocess.Popen(argv, env=_trial_env(config_path, report_path, steps), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    seconds = time.perf_counter() - begin
    text = log_path.read_text(errors="replace")
    if code is None:
        return TrialOutcome("timeout", seconds, error=f"no result after {timeout_s:g} s; killed")
    if code == 0 and report_path.exists():
        return TrialOutcome("ok", seconds, result=json.loads(report_path.read_text()))
    if _OOM.search(text):
        return TrialOutcome("oom", seconds, result=oom_figures(text), error=_last_error(text))
    if code == 0:
        return TrialOutcome(
            "failed", seconds,
            error=f"the script ended before {steps} optimizer steps (no result written); give it more data or steps",
        )
    return TrialOutcome("failed", seconds, error=f"exit {code}: {_last_error(text)}")
