"""The ``pipeline`` config section: DeepSpeed 0.19.8's keys plus partita's schedule choice.

DeepSpeed merges this section as a plain dict and ignores most of it (``stages`` and
``partition`` are never read). partita validates every key: ``stages`` sets the topology's pipe
axis and must agree with the ``PipelineModule``; ``partition`` and ``seed_layers`` describe how the
module (already built when ``initialize`` runs) was cut, so a value that disagrees is an error
rather than silently ignored.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import Field

from partita.config.base import PARTITA_KEY, JsonInt, StrictSection

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble")


class PipelineConfig(StrictSection):
    """Pipeline parallelism over a :class:`partita.pipe.PipelineModule`."""

    stages: Union[Literal["auto"], JsonInt] = Field(
        "auto",
        description=(
            "Pipeline stages (the topology's pipe axis). \"auto\": the PipelineModule's num_stages (1 for other "
            "models). An int must equal the module's num_stages. DeepSpeed default \"auto\" (which it ignores)."
        ),
    )
    partition: str = Field(
        "best",
        description=(
            "\"best\": the module's partition_method. Otherwise it must equal the module's partition_method "
            "(\"parameters\", \"uniform\", \"type:<regex>\"): the module is partitioned when it is built. "
            "DeepSpeed default \"best\" (ignored by DeepSpeed)."
        ),
    )
    seed_layers: bool = Field(
        False,
        description="true requires PipelineModule(seed_layers=True) (each layer i built under base_seed + i). Default false.",
    )
    activation_checkpoint_interval: JsonInt = Field(
        0,
        ge=0,
        description=(
            "> 0: checkpoint every run of this many layers of a stage (overrides the module's value, as in "
            "DeepSpeed). Default 0: the module's."
        ),
    )
    pipe_partitioned: bool = Field(
        True,
        description="DeepSpeed: split stage activations across tensor ranks for the send. Accepted; partita sends "
                    "each tensor rank's whole activation to the same tensor rank of the next stage (no split and "
                    "all-gather). Default true.",
    )
    grad_partitioned: bool = Field(
        True,
        description="DeepSpeed: split activation gradients across tensor ranks; as pipe_partitioned. Default true.",
    )
    use_reentrant: bool | None = Field(
        None,
        description="Activation checkpointing of layer runs: true uses torch's reentrant checkpoint; "
                    "null/false the non-reentrant one. Default null (partita: non-reentrant).",
    )
    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "zero_bubble"] = Field(
        "1f1b",
        description=(
            "partita only: torch.distributed.pipelining schedule. \"1f1b\" (DeepSpeed's), \"gpipe\", "
            "\"interleaved_1f1b\" (needs virtual_stages >= 2) and \"zero_bubble\" (ScheduleInterleavedZeroBubble: "
            "virtual_stages 1 is ZB-H1, 2 or more the interleaved zero-bubble schedule). "
            "Default \"1f1b\"."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    zero_bubble_weight_split: Literal["autograd", "linear"] = Field(
        "autograd",
        description=(
            "partita only: how schedule \"zero_bubble\" splits each backward into input (I) and weight (W) "
            "gradients. \"autograd\": torch's own split of the autograd graph (an input pass, then one pass per "
            "parameter group). \"linear\" (experimental): I is one full backward in which every exact nn.Linear "
            "keeps its input and output gradient, W computes those layers' weight and bias gradients; cheaper in "
            "isolation, but slower inside the CPU pipeline benchmark (benchmarks/results/pipeline_cpu_2026-12-04.md). "
            "Default \"autograd\"."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    measure_bubble: bool | None = Field(
        None,
        description=(
            "partita only: time each stage's compute inside the schedule and report its idle (bubble) time "
            "(engine.last_bubble, the step log's pipe_idle_s<k>). null: on for CPU, off for CUDA, where "
            "timing synchronises the device around every micro-batch's forward and backward. Default null."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    virtual_stages: JsonInt | None = Field(
        None,
        ge=1,
        description=(
            "partita only: model chunks per rank for the interleaved schedules; must equal "
            "PipelineModule(virtual_stages=...). Default null: the module's."
        ),
        json_schema_extra=PARTITA_KEY,
    )
