"""The ``zero_optimization`` section: which ZeRO stage to run and how to bucket its traffic.

Keys, meanings and defaults follow DeepSpeed 0.19. Keys for features partita lacks
(MiCS, some ZeRO-3 tuning) are refused by the loader with an explanation
(see ``partita.config.unsupported``) rather than listed here.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from partita.config.base import PARTITA_KEY, JsonInt, StrictSection
from partita.offload.config import OffloadOptimizerConfig, OffloadParamConfig


class ZeroConfig(StrictSection):
    """ZeRO data parallelism: shard optimizer state (stage 1), gradients (stage 2), parameters (stage 3)."""

    auto_fields: ClassVar[frozenset[str]] = frozenset(
        {
            "reduce_bucket_size",
            "allgather_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_prefetch_bucket_size",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
        }
    )

    stage: JsonInt = Field(
        0,
        description=(
            "ZeRO stage. 0: plain data parallelism (every rank keeps full optimizer state); "
            "1: optimizer state sharded across data-parallel ranks; 2: optimizer state and "
            "gradients sharded; 3: parameters sharded too, gathered unit by unit just in time. "
            "DeepSpeed default 0."
        ),
    )
    overlap_comm: bool | None = Field(
        None,
        description=(
            "Overlap gradient reduction with the backward pass. DeepSpeed default null, which "
            "DeepSpeed reads as true for stage 3 only (false for stages 0-2)."
        ),
    )
    contiguous_gradients: bool = Field(
        True,
        description=(
            "Copy gradients into one contiguous buffer as they are produced, to avoid memory "
            "fragmentation. DeepSpeed default true."
        ),
    )
    reduce_bucket_size: JsonInt = Field(
        500_000_000,
        gt=0,
        description=(
            "Number of gradient elements reduced in one collective. Larger buckets use the "
            "network better and need more memory. DeepSpeed default 5e8; \"auto\" means the default."
        ),
    )
    allgather_bucket_size: JsonInt = Field(
        500_000_000,
        gt=0,
        description=(
            "Number of parameter elements gathered in one all-gather after the sharded "
            "optimizer step. DeepSpeed default 5e8; \"auto\" means the default."
        ),
    )
    reduce_scatter: bool = Field(
        True,
        description=(
            "Reduce gradients with reduce-scatter (each rank receives only its shard) instead "
            "of all-reduce. DeepSpeed default true."
        ),
    )

    stage3_param_persistence_threshold: JsonInt = Field(
        100_000,
        ge=0,
        description=(
            "ZeRO-3 only: parameters with at most this many elements are not sharded; every "
            "rank keeps them whole (gathering them would cost more latency than it saves "
            "memory). DeepSpeed default 1e5."
        ),
    )

    stage3_prefetch_bucket_size: JsonInt = Field(
        50_000_000,
        ge=0,
        description=(
            "ZeRO-3 only: how many parameter elements to all-gather ahead of the unit that runs "
            "now (prefetch, overlapped with compute; 0 disables). DeepSpeed default 5e7."
        ),
    )
    stage3_max_live_parameters: JsonInt = Field(
        1_000_000_000,
        gt=0,
        description=(
            "ZeRO-3 only: prefetching never makes more than this many parameter elements whole "
            "(or in flight) on a rank at once. DeepSpeed default 1e9."
        ),
    )
    stage3_max_reuse_distance: JsonInt = Field(
        1_000_000_000,
        ge=0,
        description=(
            "ZeRO-3 only: when a unit's forward ends, keep its parameters whole instead of freeing "
            "them if the first step's trace says it runs again (called again in the forward, or its "
            "backward) before other units gather this many parameter elements; saves the re-gather "
            "at the cost of memory, never past stage3_max_live_parameters. 0 frees every unit at "
            "once. DeepSpeed default 1e9."
        ),
    )

    stage3_generation: Literal["auto", "gather_once", "stream"] = Field(
        "auto",
        description=(
            "partita-only. ZeRO-3: how engine.generate / engine.module.generate get the weights. "
            "\"gather_once\": every unit is gathered once per generate call and held whole until it returns "
            "(no collective per token; ranks may generate different lengths; costs the whole model's bytes "
            "for the call). \"stream\": units are gathered per forward with the next ones prefetched (memory "
            "of a few units; every rank runs every forward: Hugging Face models get synced_gpus=True at world "
            "size > 1). \"auto\": gather_once when the model plus a KV-cache and activation reserve fits in "
            "every rank's free memory, else stream. See docs/guides/zero3-generation.md."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    stage3_one_rank_resident: bool = Field(
        False,
        description=(
            "partita-only. ZeRO-3 with a ZeRO group of one rank (one GPU) and no offload_param: keep every "
            "parameter whole for good, as ZeRO-1 does, instead of filling and freeing each unit per use: no "
            "unit hook runs, fp32 parameters share the fp32 master's storage (no copy of the weights at all), "
            "and 16-bit ones are rewritten from the master after each optimizer step (one cast, ZeRO-1's). "
            "Bitwise the same training. Costs 2 bytes per 16-bit parameter beside the activations (fp32: "
            "nothing); parameters then read outside GatheredParameters give their values, never "
            "ParameterNotGatheredError. Ignored (logged) with more than one ZeRO rank. See "
            "docs/guides/zero.md (ZeRO-3 on one GPU)."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False,
        description=(
            "ZeRO-3: gather whole 16-bit weights in engine.save_16bit_model. Accepted for "
            "compatibility (Hugging Face configs set it): partita's save_16bit_model always "
            "gathers, one parameter at a time, whatever the value. DeepSpeed default false "
            "(DeepSpeed then writes no weights at stage 3)."
        ),
    )

    zero_quantized_weights: bool = Field(
        False,
        description=(
            "ZeRO++ qwZ, ZeRO-3 only: the forward/backward all-gathers send every weight as int8 blocks of 256 "
            "with an fp32 scale each (about half of bf16's bytes) and each rank dequantizes into the model dtype; "
            "the fp32 master weights and the optimizer are untouched, only what crosses the wire is rounded. "
            "Checkpoint, GatheredParameters and state-dict gathers stay exact. DeepSpeed default false."
        ),
    )
    zero_quantized_nontrainable_weights: bool = Field(
        False,
        description=(
            "ZeRO++, ZeRO-3 only: the same int8 all-gather for frozen weights only (requires_grad false, e.g. a "
            "LoRA base); zero_quantized_weights covers frozen weights too. partita keeps the frozen shards in "
            "their own dtype and quantizes on the wire (DeepSpeed also stores them quantized). DeepSpeed default "
            "false."
        ),
    )
    zero_quantized_gradients: bool = Field(
        False,
        description=(
            "ZeRO++ qgZ, ZeRO-3 only: gradients are reduce-scattered through one all-to-all of block-quantized "
            "chunks (zero_quantized_gradients_bits, fp32 scale per 256 elements), dequantized and summed in fp32 "
            "by the rank that owns them. DeepSpeed default false."
        ),
    )
    zero_quantized_gradients_bits: Literal[4, 8] = Field(
        4,
        description=(
            "partita-only. Bits per gradient element with zero_quantized_gradients: 4 (DeepSpeed's qgZ format, "
            "about a quarter of bf16's bytes) or 8 (about half, 16x smaller rounding error)."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    zero_hpz_partition_size: JsonInt = Field(
        1,
        ge=1,
        description=(
            "ZeRO++ hpZ, ZeRO-3 only: G > 1 splits the data-parallel ranks into groups of G consecutive ranks (set "
            "it to the ranks per node). After a unit's forward all-gather each rank keeps its 1/G of the gathered "
            "16-bit weights, and the backward's re-gather of that unit all-gathers inside the group only. Costs "
            "numel*2/G bytes per rank between a forward and its backward; G must divide the data-parallel size. "
            "1: off. DeepSpeed default 1."
        ),
    )

    one_rank_free_weights: bool = Field(
        True,
        description=(
            "partita-only. Stages 0-2 when the whole job is one process and no optimizer state is "
            "offloaded: free each block's 16-bit weights when its forward ends and cast them back "
            "from the fp32 master just before its backward (bitwise the same values), so the start "
            "of backward, the memory peak, holds no whole 16-bit replica (GPT-1.3B: 2.25 GiB less). "
            "Between steps the weights are whole as usual. Set false for a model that reads a "
            "block's weights outside that block's forward."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    one_rank_gradient_fold: Literal["auto", "early", "end", "stream"] = Field(
        "auto",
        description=(
            "partita-only. One process, no optimizer offload: when each gradient is folded into the fp32 "
            "partition. \"early\": as it arrives, freeing param.grad (the partition exists from the first "
            "gradient on); \"end\": after backward (every param.grad is held until then, the partition "
            "allocated only then). The values are the same bit for bit; only the peak differs: early wins "
            "when activations are checkpointed or the micro-batch is large, end when activations still "
            "alive early in backward outweigh the full-size gradients. \"stream\": no fp32 partition at "
            "all: the optimizer step reads param.grad range by range (4 bytes per parameter off the peak); "
            "needs torch's fused Adam or AdamW or a block-wise 8-bit optimizer (AdamW8bit, Adam8bit, Lion8bit), no "
            "offload, and gradient_accumulation_steps 1 at stages 2-3; "
            "values are bitwise the other rules' except that the global norm is summed per gradient, so a "
            "clip coefficient can differ in its last bits. \"auto\": stream where it applies, else the lower "
            "of the early and end peaks by partita estimate for partita's GPT, else early."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    sub_group_size: JsonInt = Field(
        1_000_000_000,
        gt=0,
        description=(
            "Elements of the optimizer partition stepped at a time when it is offloaded: with NVMe, "
            "each sub-group is read, stepped and written back in turn, so CPU memory holds only a "
            "few sub-groups. DeepSpeed default 1e9."
        ),
    )
    offload_optimizer: OffloadOptimizerConfig = Field(
        default_factory=OffloadOptimizerConfig,
        description="Optimizer states and fp32 master weights in CPU memory or on NVMe (ZeRO-Offload).",
    )
    offload_param: OffloadParamConfig = Field(
        default_factory=OffloadParamConfig,
        description="ZeRO-3 parameter shards in CPU memory or on NVMe (ZeRO-Infinity).",
    )

    @field_validator("offload_optimizer", "offload_param", mode="before")
    @classmethod
    def _null_means_off(cls, value: object) -> object:
        return {} if value is None else value  # DeepSpeed configs write "offload_param": null for "off"

    @model_validator(mode="after")
    def _offload_needs_sharding(self) -> ZeroConfig:
        if self.offload_optimizer.enabled and self.stage == 0:
            raise PydanticCustomError(
                "offload_stage",
                "offload_optimizer needs ZeRO stage 1, 2 or 3 (stage 0 keeps the whole optimizer on every "
                "rank); set zero_optimization.stage to 1 or more, or offload_optimizer.device to \"none\"",
            )
        if self.offload_param.enabled and self.stage != 3:
            raise PydanticCustomError(
                "offload_stage",
                "offload_param needs ZeRO stage 3 (only stage 3 shards parameters); set "
                "zero_optimization.stage to 3, or offload_param.device to \"none\"",
            )
        zeropp = [k for k in ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
                              "zero_quantized_gradients") if getattr(self, k)]
        if self.zero_hpz_partition_size > 1:
            zeropp.append(f"zero_hpz_partition_size {self.zero_hpz_partition_size}")
        if zeropp and self.stage != 3:
            raise PydanticCustomError(
                "zeropp_stage",
                "{keys} (ZeRO++) work at ZeRO stage 3 only (they act on its parameter all-gathers and gradient "
                "reduce-scatters); set zero_optimization.stage to 3, or remove them",
                {"keys": ", ".join(zeropp)},
            )
        if self.zero_quantized_gradients and not self.reduce_scatter:
            raise PydanticCustomError(
                "zeropp_reduce_scatter",
                "zero_quantized_gradients replaces the gradient reduce-scatter with a quantized all-to-all, and "
                "reduce_scatter false asks for an all-reduce instead; remove reduce_scatter false, or "
                "zero_quantized_gradients",
            )
        if self.one_rank_gradient_fold in ("end", "stream") and self.offload_optimizer.enabled:
            raise PydanticCustomError(
                "one_rank_gradient_fold",
                "one_rank_gradient_fold \"{fold}\" holds every param.grad on the accelerator until the end of "
                "backward; with offload_optimizer the gradients go to the host as they arrive instead. Remove "
                "one_rank_gradient_fold or set it to \"auto\"",
                {"fold": self.one_rank_gradient_fold},
            )
        if self.one_rank_gradient_fold == "stream" and self.offload_param.enabled:
            raise PydanticCustomError(
                "one_rank_gradient_fold",
                "one_rank_gradient_fold \"stream\" steps the optimizer on the accelerator from param.grad and "
                "is not built for offload_param; remove offload_param or use one_rank_gradient_fold \"auto\"",
            )
        if self.stage3_one_rank_resident and self.offload_param.enabled:
            raise PydanticCustomError(
                "stage3_one_rank_resident",
                "stage3_one_rank_resident keeps every parameter whole on the accelerator, and offload_param keeps "
                "the parameter shards off it (\"{device}\"); remove one of them",
                {"device": self.offload_param.device},
            )
        if self.offload_param.gather_from_master:
            host_master = self.offload_optimizer.device in ("cpu", "auto")
            if self.offload_param.device != "cpu" or not host_master:
                raise PydanticCustomError(
                    "offload_gather_from_master",
                    "offload_param.gather_from_master reads the parameters from the fp32 master in host memory and "
                    "needs offload_param.device \"cpu\" (got \"{param}\") and offload_optimizer.device \"cpu\" or "
                    "\"auto\" (got \"{optimizer}\"); set both, or remove gather_from_master",
                    {"param": self.offload_param.device, "optimizer": self.offload_optimizer.device},
                )
            if self.offload_optimizer.delayed_param_update:
                raise PydanticCustomError(
                    "offload_gather_from_master",
                    "offload_param.gather_from_master cannot be combined with offload_optimizer.delayed_param_update: "
                    "the delayed host step rewrites the master while the next forward gathers from it; remove one",
                )
        return self

    @field_validator("stage")
    @classmethod
    def _implemented_stage(cls, value: int) -> int:
        if value not in (0, 1, 2, 3):
            raise PydanticCustomError(
                "zero_stage_range",
                "ZeRO stage must be 0, 1, 2 or 3",
            )
        return value
