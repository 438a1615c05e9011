"""The ``distributed`` section (partita only): how the process group is started.

DeepSpeed takes these as ``deepspeed.initialize`` / ``init_distributed`` arguments; partita
reads them from the config so a run is described by one file.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from partita.config.base import StrictSection


class DistributedConfig(StrictSection):
    """Process-group settings passed to ``partita.distributed.init.init_distributed``."""

    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto",
        description=(
            "torch.distributed backend. \"auto\": nccl when CUDA is available, else gloo. "
            "Default \"auto\" (DeepSpeed's dist_backend argument defaults to the accelerator's backend)."
        ),
    )
    timeout_seconds: float = Field(
        1800.0,
        gt=0,
        description=(
            "Seconds a collective may wait before failing, so a dead rank ends the job with an "
            "error instead of a hang. Default 1800 (torch's and DeepSpeed's 30 minutes)."
        ),
    )
