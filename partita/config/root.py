"""The whole config: :class:`PartitaConfig`, one field per DeepSpeed top-level key.

Build it with :func:`partita.config.load_config`, which reports every mistake at once with
the key path and a fix; constructing the model directly validates too, with plainer errors.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from partita.activation_checkpointing.config import ActivationCheckpointingConfig
from partita.autotune.config import AutotuningConfig
from partita.checkpoint.config import CheckpointConfig
from partita.compile.config import CompileConfig
from partita.config.base import PARTITA_KEY, JsonInt, Problem, StrictSection
from partita.config.elasticity import ElasticityConfig
from partita.distributed.config import DistributedConfig
from partita.monitor.config import (
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    ThroughputConfig,
    WandbConfig,
)
from partita.offload.config import AioConfig
from partita.optim.config import OptimizerConfig, SchedulerConfig
from partita.precision.config import BF16Config, DataTypesConfig, DtypeName, FP16Config
from partita.precision.fp8_config import FP8Config
from partita.schedules.config import CurriculumLearningConfig, ProgressiveLayerDropConfig
from partita.inference.generation_config import GenerationSectionConfig
from partita.ops.sparse_attention.config import SparseAttentionConfig
from partita.pipe.config import PipelineConfig
from partita.sequence.config import SequenceParallelConfig, SequenceTilingConfig
from partita.tensor_parallel.config import TensorParallelConfig
from partita.zero.config import ZeroConfig

Precision = Literal["fp32", "bf16", "fp16"]

# Skips the model-level cross check when the loader has already reported it from the raw dict.
CROSS_CHECKED = "partita_cross_checked"


class PartitaConfig(StrictSection):
    """A validated DeepSpeed-style training config.

    ``to_dict()`` returns the config exactly as given (before "auto" was resolved), which is
    what checkpoints record.
    """

    auto_fields: ClassVar[frozenset[str]] = frozenset(
        {
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "gradient_clipping",
            "steps_per_print",
            "wall_clock_breakdown",
        }
    )
    key_aliases: ClassVar[Mapping[str, str]] = {"bfloat16": "bf16"}

    train_batch_size: JsonInt | None = Field(
        None,
        ge=1,
        description=(
            "Samples per optimizer step over all data-parallel ranks: micro-batch x "
            "gradient_accumulation_steps x ranks. DeepSpeed default null (inferred from the "
            "other two); \"auto\" means null."
        ),
    )
    train_micro_batch_size_per_gpu: JsonInt | None = Field(
        None,
        ge=1,
        description=(
            "Samples each rank processes in one forward/backward. DeepSpeed default null "
            "(inferred); \"auto\" means null."
        ),
    )
    gradient_accumulation_steps: JsonInt | None = Field(
        None,
        ge=1,
        description=(
            "Micro-batches whose gradients are summed before one optimizer step. DeepSpeed "
            "default null (inferred, 1 when only one batch size is given); \"auto\" means null."
        ),
    )
    optimizer: OptimizerConfig | None = Field(
        None,
        description=(
            "The optimizer built by initialize(): {\"type\": ..., \"params\": {...}}. DeepSpeed "
            "default null (the optimizer is passed to initialize())."
        ),
    )
    scheduler: SchedulerConfig | None = Field(
        None,
        description=(
            "The learning-rate schedule built by initialize(), stepped once per optimizer step. "
            "DeepSpeed default null (no schedule, or one passed to initialize())."
        ),
    )
    fp16: FP16Config = Field(
        default_factory=FP16Config,
        description="fp16 training and loss scaling. DeepSpeed default: disabled.",
    )
    bf16: BF16Config = Field(
        default_factory=BF16Config,
        description="bf16 training (DeepSpeed also reads the key \"bfloat16\"). DeepSpeed default: disabled.",
    )
    fp8: FP8Config = Field(
        default_factory=FP8Config,
        description=(
            "partita only: FP8 matmuls in the model's linears through torchao's float8 training (recipe, "
            "filter, keep_first_last_bf16, emulate). Default: off."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    gradient_clipping: float = Field(
        1.0,
        ge=0,
        description=(
            "Clip the global gradient norm to this value; 0 disables clipping. DeepSpeed 0.19 "
            "default 1.0 (0.0 before DeepSpeed PR #8068); \"auto\" means the default."
        ),
    )
    zero_optimization: ZeroConfig = Field(
        default_factory=ZeroConfig,
        description="ZeRO stage and communication buckets. DeepSpeed default: stage 0.",
    )
    steps_per_print: JsonInt = Field(
        10,
        ge=1,
        description="Log progress every this many optimizer steps. DeepSpeed documents 10.",
    )
    wall_clock_breakdown: bool = Field(
        False,
        description="Time forward, backward and step separately and log the split. DeepSpeed default false.",
    )
    seed: JsonInt | None = Field(
        None,
        ge=0,
        description=(
            "partita only: seed torch, numpy and random on every rank before the model is "
            "placed. Default null (leave the generators alone)."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig,
        description="partita only: process-group backend and collective timeout.",
        json_schema_extra=PARTITA_KEY,
    )
    data_types: DataTypesConfig = Field(
        default_factory=DataTypesConfig,
        description="Gradient accumulation dtype (grad_accum_dtype). DeepSpeed's section.",
    )
    communication_data_type: DtypeName | None = Field(
        None,
        description=(
            "dtype gradients are reduced in across ranks. null: the model's dtype (bf16/fp16 halve "
            "the traffic); 'fp32' sums more precisely at twice the bytes. DeepSpeed default null."
        ),
    )
    gradient_predivide_factor: float = Field(
        1.0,
        gt=0,
        description=(
            "Gradients are divided by this factor before the cross-rank sum and by world/factor "
            "after, so fp16 sums over many ranks do not overflow. DeepSpeed default 1.0."
        ),
    )
    prescale_gradients: bool = Field(
        False,
        description=(
            "Divide each gradient by the data-parallel size before the cross-rank sum instead of after (the "
            "sum is then the mean; fp16 sums stay in range). Leave gradient_predivide_factor at 1.0 with it. "
            "DeepSpeed default false."
        ),
    )
    progressive_layer_drop: ProgressiveLayerDropConfig = Field(
        default_factory=ProgressiveLayerDropConfig,
        description=(
            "Progressive layer drop: training forwards get progressive_layer_drop=True, pld_theta=theta(t). "
            "DeepSpeed 0.18.9's section (0.19 removed it). Default: disabled."
        ),
    )
    curriculum_learning: CurriculumLearningConfig = Field(
        default_factory=CurriculumLearningConfig,
        description=(
            "Legacy curriculum learning: a difficulty schedule; for curriculum_type seqlen training forwards get "
            "curriculum_seqlen=<difficulty>. DeepSpeed 0.18.9's section (0.19 removed it). Default: disabled."
        ),
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig,
        description=(
            "DeepSpeed's tag_validation / load_universal / use_node_local_storage, plus partita's "
            "save_dir, resume, async_save, handshake_timeout_seconds, verify_checksums."
        ),
    )
    tensorboard: TensorBoardConfig = Field(
        default_factory=TensorBoardConfig,
        description="TensorBoard event files of the step metrics (rank 0). DeepSpeed default: disabled.",
    )
    csv_monitor: CSVMonitorConfig = Field(
        default_factory=CSVMonitorConfig,
        description="One CSV file per step metric (rank 0). DeepSpeed default: disabled.",
    )
    wandb: WandbConfig = Field(
        default_factory=WandbConfig,
        description="Weights & Biases logging of the step metrics (rank 0). DeepSpeed default: disabled.",
    )
    comms_logger: CommsLoggerConfig = Field(
        default_factory=CommsLoggerConfig,
        description="Count, size, latency and bandwidth of every collective. DeepSpeed default: disabled.",
    )
    flops_profiler: FlopsProfilerConfig = Field(
        default_factory=FlopsProfilerConfig,
        description="Params, FLOPs, MACs and latency per module at one step. DeepSpeed default: disabled.",
    )
    throughput: ThroughputConfig = Field(
        default_factory=ThroughputConfig,
        description="partita only: warm-up steps, FLOPs per token and device peak for throughput and MFU.",
        json_schema_extra=PARTITA_KEY,
    )
    aio: AioConfig = Field(
        default_factory=AioConfig,
        description="Block I/O for NVMe offload swap files (zero_optimization.offload_*.device \"nvme\").",
    )
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig,
        description="Recompute activations in backward; \"policy\" wraps the model's blocks. DeepSpeed default: off.",
    )
    autotuning: AutotuningConfig = Field(
        default_factory=AutotuningConfig,
        description=(
            "DeepSpeed's autotuning keys, read by `partita tune` (a training run ignores them, as DeepSpeed "
            "does without `deepspeed --autotuning`). Default: disabled."
        ),
    )
    compile: CompileConfig = Field(
        default_factory=CompileConfig,
        description=(
            "torch.compile each repeated block at initialize (\"enabled\"); DeepSpeed's \"deepcompile\" only "
            "as false. Default: off."
        ),
    )

    generation: GenerationSectionConfig = Field(
        default_factory=GenerationSectionConfig,
        description=(
            "partita only: how engine.generate decodes Hugging Face models (\"cuda_graph\": a static KV cache and "
            "CUDA-graph decode steps, for rollouts from the model being trained). Default: Hugging Face's generate."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    tensor_parallel: TensorParallelConfig = Field(
        default_factory=TensorParallelConfig,
        description=(
            "DeepSpeed's AutoTP training: autotp_size ranks split each layer (the topology's tensor axis), "
            "partition_config rules, plus partita's sequence_parallel. Default: off."
        ),
    )
    sequence_parallel_size: JsonInt = Field(
        1,
        ge=1,
        description=(
            "Ranks one sequence is split across (the topology's sequence axis; DeepSpeed-Ulysses). They read "
            "the same samples; ZeRO shards over data x sequence. DeepSpeed default 1."
        ),
    )
    sequence_parallel: SequenceParallelConfig = Field(
        default_factory=SequenceParallelConfig,
        description=(
            "partita only: how the sequence_parallel_size ranks of one sequence run attention, \"mode\": "
            "\"ulysses\" (default) or \"ring\"."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    sequence_tiling: SequenceTilingConfig = Field(
        default_factory=SequenceTilingConfig,
        description=(
            "partita only: long-context memory levers, loss_tile_tokens (LM head + loss over token tiles, no "
            "full logits) and mlp_tile_tokens (MLPs over token tiles, recomputed in backward). Default: off."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    sparse_attention: SparseAttentionConfig | None = Field(
        None,
        description=(
            "DeepSpeed's block-sparse attention patterns (dense, fixed, variable, bigbird, bslongformer), run on "
            "FlexAttention; the reference GPT's attention uses it. Default null (dense attention)."
        ),
    )

    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig,
        description=(
            "Pipeline parallelism over a partita.pipe.PipelineModule (the topology's pipe axis): DeepSpeed's keys "
            "plus partita's schedule (1f1b, gpipe, interleaved_1f1b, zero_bubble) and virtual_stages. Default: "
            "the module's settings, schedule 1f1b."
        ),
    )

    elasticity: ElasticityConfig = Field(
        default_factory=ElasticityConfig,
        description=(
            "DeepSpeed's elastic batch: one global batch valid on every GPU count in [min_gpus, max_gpus]; "
            "picks train_batch_size, the micro-batch and accumulation per run. Default: off."
        ),
    )

    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _one_precision(self, info: ValidationInfo) -> PartitaConfig:
        if (info.context or {}).get(CROSS_CHECKED):
            return self
        problems = cross_section_problems(self.model_dump())
        if problems:
            raise PydanticCustomError("partita_cross_section", problems[0].message)
        return self

    @property
    def precision(self) -> Precision:
        """The compute precision: "bf16", "fp16", or "fp32" when neither is enabled."""
        if self.bf16.enabled:
            return "bf16"
        if self.fp16.enabled:
            return "fp16"
        return "fp32"

    def to_dict(self) -> dict[str, Any]:
        """The config as the user gave it (a deep copy), for checkpoints and logs."""
        return copy.deepcopy(self._raw)


def cross_section_problems(raw: Mapping[str, Any]) -> list[Problem]:
    """Mistakes that involve more than one section, read leniently from a raw dict.

    Runs on the raw input so these are reported together with every other problem, even
    when some sections failed their own validation.
    """
    problems = []
    if _enabled(raw.get("fp16")) and _enabled(raw.get("bf16")):
        problems.append(
            Problem(
                path="fp16.enabled, bf16.enabled",
                message=(
                    "fp16 and bf16 are both enabled; a run trains in one precision. Set "
                    "bf16.enabled to false to train in fp16, or fp16.enabled to false to train "
                    "in bf16 (bf16 needs no loss scaling; prefer it on GPUs that support it)"
                ),
            )
        )
    predivide = raw.get("gradient_predivide_factor", 1.0)
    if raw.get("prescale_gradients") is True and isinstance(predivide, (int, float)) and predivide != 1.0:
        problems.append(
            Problem(
                path="prescale_gradients, gradient_predivide_factor",
                message=(
                    f"prescale_gradients divides by the data-parallel size before the sum, so gradient_predivide_factor "
                    f"{predivide} has no effect (DeepSpeed ignores it); remove gradient_predivide_factor, or set "
                    "prescale_gradients to false to divide by the factor before the sum and by world/factor after"
                ),
            )
        )
    return problems


def _enabled(section: Any) -> bool:
    if isinstance(section, Mapping):
        return section.get("enabled") is True
    return getattr(section, "enabled", False) is True
