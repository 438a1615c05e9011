"""Config sections of the monitoring features: DeepSpeed's monitor, comms-logger and
flops-profiler sections, plus partita's own ``throughput`` section.

Keys, meanings and defaults follow DeepSpeed 0.19 (``deepspeed/monitor/config.py``,
``deepspeed/comm/config.py``, ``deepspeed/profiling/config.py``), so a DeepSpeed config
carries over unchanged. ``throughput`` is partita only: DeepSpeed has no MFU.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from partita.config.base import JsonInt, StrictSection

CollectiveName = Literal["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "all_to_all_single"]


class _FileMonitorConfig(StrictSection):
    """Where a file-writing monitor puts its run directory (shared by TensorBoard and CSV)."""

    output_path: str = Field(
        "",
        description=(
            "Directory the job directory is created in; empty means the directory training was "
            "launched from. DeepSpeed default \"\"."
        ),
    )
    job_name: str = Field(
        "DeepSpeedJobName",
        min_length=1,
        description="Name of this run: a sub-directory of output_path. DeepSpeed default \"DeepSpeedJobName\".",
    )


class TensorBoardConfig(_FileMonitorConfig):
    """TensorBoard event files written by rank 0 (needs the ``tensorboard`` package)."""

    enabled: bool = Field(False, description="Write TensorBoard event files. DeepSpeed default false.")


class CSVMonitorConfig(_FileMonitorConfig):
    """One CSV file per metric (``step,<name>`` rows), as DeepSpeed's csv_monitor writes."""

    enabled: bool = Field(False, description="Write CSV files. DeepSpeed default false.")


class WandbConfig(StrictSection):
    """Weights & Biases logging by rank 0 (needs the ``wandb`` package).

    Offline runs (no network) use wandb's own switch: set ``WANDB_MODE=offline``; the run is
    kept under ``./wandb`` and can be uploaded later with ``wandb sync``.
    """

    enabled: bool = Field(False, description="Log to Weights & Biases. DeepSpeed default false.")
    group: str | None = Field(None, description="W&B group, to show several runs together. DeepSpeed default null.")
    team: str | None = Field(None, description="W&B team (entity). DeepSpeed default null (your default entity).")
    project: str = Field("deepspeed", min_length=1, description="W&B project. DeepSpeed default \"deepspeed\".")


class CommsLoggerConfig(StrictSection):
    """Per-collective count, size, latency and bandwidth, kept by every rank."""

    enabled: bool = Field(False, description="Record every collective partita issues. DeepSpeed default false.")
    verbose: bool = Field(
        False, description="Log each collective as it completes (rank 0). DeepSpeed default false."
    )
    prof_all: bool = Field(True, description="Record every kind of collective. DeepSpeed default true.")
    prof_ops: list[CollectiveName] = Field(
        default_factory=list,
        description=(
            "With prof_all false: the collectives to record, by torch.distributed name. DeepSpeed default []."
        ),
    )
    debug: bool = Field(
        False,
        description=(
            "Also break the summary down by what each collective was for (partita's purpose of the "
            "call; DeepSpeed adds the caller's name). DeepSpeed default false."
        ),
    )


class FlopsProfilerConfig(StrictSection):
    """Parameters, FLOPs, MACs and latency per module, measured at one training step on rank 0."""

    enabled: bool = Field(False, description="Profile one step. DeepSpeed default false.")
    profile_step: JsonInt = Field(
        1,
        ge=0,
        description=(
            "Profile the step that starts after this many optimizer steps (DeepSpeed's counting: 1 "
            "profiles the second step, after one warm-up step). DeepSpeed default 1."
        ),
    )
    module_depth: JsonInt = Field(
        -1,
        ge=-1,
        description="Deepest module level shown; -1 shows every level. DeepSpeed default -1.",
    )
    top_modules: JsonInt = Field(
        1, ge=1, description="Modules listed per depth in the aggregated view. DeepSpeed default 1."
    )
    detailed: bool = Field(True, description="Also print the whole module tree. DeepSpeed default true.")
    output_file: str | None = Field(
        None, description="Write the report to this file instead of the log. DeepSpeed default null."
    )


class ThroughputConfig(StrictSection):
    """partita only: what throughput, TFLOP/s and MFU are computed from."""

    warmup_steps: JsonInt = Field(
        2,
        ge=0,
        description=(
            "Optimizer steps left out of throughput averages (allocator warm-up, kernel selection). "
            "Default 2, as DeepSpeed's throughput timer."
        ),
    )
    flops_per_token: float | None = Field(
        None,
        gt=0,
        description=(
            "Training FLOPs (forward + backward) per token, e.g. 6N + 12·L·d·T for a transformer. "
            "Default null: engine.set_flops_per_token(), else the model's flops_per_token() method, "
            "else the flops profiler's measurement."
        ),
    )
    tokens_per_sample: JsonInt | None = Field(
        None,
        ge=1,
        description=(
            "Tokens in one sample. Default null: counted from the first integer tensor of at least "
            "two dimensions (batch, sequence) passed to the engine's forward."
        ),
    )
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description=(
            "Peak dense TFLOP/s of one device in the compute precision, for MFU. Default null: "
            "looked up by device name (H100/H200 989 bf16, A100 312, ...); none on CPU."
        ),
    )
