"""How a training script becomes an autotuning trial without changing a line of it.

``partita tune`` launches the user's script once per trial with three variables:

- ``PARTITA_CONFIG_OVERRIDE``: a JSON config file used in place of the config the script
  passes to ``partita.initialize``: the user's ``--config`` with the trial's micro-batch,
  ZeRO stage, checkpointing and offload, and settings that keep a trial short and free of
  side effects (no checkpoints, no monitors).
- ``PARTITA_TRIAL_STEPS``: after this many optimizer steps the trial reports and exits.
- ``PARTITA_TRIAL_REPORT``: where rank 0 writes the trial's measurements (JSON): tokens/s,
  samples/s, TFLOP/s, peak memory (maximum over ranks), the parameter count.

The hooks are two calls: :func:`apply_config_override` in ``initialize`` and
:class:`TrialReporter` in the step logger. Without the variables both do nothing.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["OVERRIDE_ENV", "REPORT_ENV", "STEPS_ENV", "TrialReporter", "apply_config_override"]

OVERRIDE_ENV = "PARTITA_CONFIG_OVERRIDE"
REPORT_ENV = "PARTITA_TRIAL_REPORT"
STEPS_ENV = "PARTITA_TRIAL_STEPS"


def apply_config_override(config: Any) -> Any:
    """The trial's config file when ``PARTITA_CONFIG_OVERRIDE`` is set, else ``config`` unchanged.

    The trial's file replaces the script's config whole: ``partita tune`` built it from the
    same ``--config`` the script uses, with the trial's settings in place, so what a trial
    runs is exactly the file in its ``exps_dir`` folder.
    """
    path = os.environ.get(OVERRIDE_ENV)
    if not path:
        return config
    from partita.config.loader import read_json_config

    return read_json_config(Path(path))


class TrialReporter:
    """Ends a trial after ``steps`` optimizer steps: rank 0 writes the metrics, every rank exits 0."""

    def __init__(self, *, steps: int, report_path: str) -> None:
        self.steps = steps
        self.report_path = report_path

    @classmethod
    def from_env(cls) -> TrialReporter | None:
        steps, path = os.environ.get(STEPS_ENV), os.environ.get(REPORT_ENV)
        if not steps or not path:
            return None
        if not steps.isdigit() or int(steps) < 1:
            raise ValueError(f"{STEPS_ENV}={steps!r} must be a positive integer (set by partita tune)")
        return cls(steps=int(steps), report_path=path)

    def after_step(self, engine: Any, metrics: Mapping[str, float]) -> None:
        """Called after every optimizer step with the step logger's latest print-step metrics."""
        if engine.global_steps < self.steps:
            return
        import torch.distributed as dist

        if engine.topology.rank == 0:
            report = {
                "steps": engine.global_steps,
                "parameters": sum(p.numel() for p in engine.module.parameters()),
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "train_batch_size": engine.train_batch_size(),
                **{key: metrics[key] for key in ("avg_tokens_per_sec", "avg_samples_per_sec", "tflops_per_device",
                                                 "memory_peak_gib") if key in metrics},
            }
            tmp = f"{self.report_path}.tmp"
            with open(tmp, "w") as f:
                json.dump(report, f, indent=2)
            os.replace(tmp, self.report_path)
        if dist.is_initialized():
            dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave now: the rest of the script (evaluation, saving, more steps) is not the trial's,
        # and skipping interpreter teardown avoids gloo's occasional abort at exit.
        os._exit(0)
