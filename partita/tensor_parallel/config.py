"""The ``tensor_parallel`` config section: DeepSpeed 0.19.8's AutoTP training keys, plus partita's.

``autotp_size`` sets the size of the topology's ``tensor`` axis (1 or 0: no tensor parallelism;
DeepSpeed uses 0 for "off"). The model's layers are split across those ranks by a plan: the
reference GPT's own plan, the Hugging Face architectures partita recognises (GPT-2, Llama-style,
BERT), or ``partition_config.layer_specs`` (module-name regexes with ``row`` / ``column``).

DeepSpeed keys partita accepts only at their defaults (they tune DeepSpeed's inference-era
AutoTP): ``dtype``, ``preset_model``, ``keep_module_on_host`` and ``tp`` (its ``tp_size`` must
agree with ``autotp_size`` when given).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from partita.config.base import PARTITA_KEY, JsonInt, StrictSection


class LayerSpec(StrictSection):
    """One rule of ``partition_config.layer_specs``: modules whose name matches a pattern."""

    patterns: list[str] = Field(
        ..., min_length=1, description="Regular expressions matched (re.search) against module names."
    )
    partition_type: Literal["row", "column"] = Field(
        ...,
        description=(
            "\"column\": split the output features (the weight's rows of nn.Linear); \"row\": split the "
            "input features and all-reduce the output."
        ),
    )


class PartitionConfig(StrictSection):
    """Which layers AutoTP splits and how."""

    use_default_specs: bool = Field(
        True,
        description=(
            "Also apply partita's built-in plan for the recognised architectures; the given layer_specs "
            "take priority where both match. DeepSpeed default true."
        ),
    )
    layer_specs: list[LayerSpec] = Field(default_factory=list, description="Custom rules, first match wins.")


class TPSubConfig(StrictSection):
    """DeepSpeed's ``tensor_parallel.tp`` block (its older spelling of the size)."""

    tp_size: JsonInt = Field(1, ge=1, description="DeepSpeed's older spelling of autotp_size.")
    tp_grain_size: JsonInt = Field(1, ge=1, description="Only 1: partita splits whole rows/columns per head.")


class TensorParallelConfig(StrictSection):
    """Tensor parallelism over the topology's ``tensor`` axis (see the module docstring)."""

    autotp_size: JsonInt = Field(
        0,
        ge=0,
        description="Ranks each layer is split across; 0 or 1 disables tensor parallelism. DeepSpeed default 0.",
    )
    tp_overlap_comm: bool = Field(
        False,
        description=(
            "DeepSpeed: overlap the row-parallel all-reduce with compute. partita issues it asynchronously "
            "where autograd allows; accepted for compatibility. Default false."
        ),
    )
    vocab_parallel_lm_head: bool = Field(
        True,
        description=(
            "Split the LM head over the vocabulary and compute cross-entropy without gathering the "
            "full-vocabulary logits (the reference GPT). Default true."
        ),
    )
    sequence_parallel: bool = Field(
        False,
        description=(
            "partita only: Megatron sequence parallelism — LayerNorm and dropout regions run on sequence "
            "shards; a reduce-scatter and an all-gather replace each all-reduce. Default false."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    partition_config: PartitionConfig = Field(default_factory=PartitionConfig)
    dtype: Literal["fp16", "bf16", "fp32"] | None = Field(
        None, description="DeepSpeed's AutoTP dtype; partita uses the run's precision (bf16/fp16 sections)."
    )
    tp: TPSubConfig = Field(default_factory=TPSubConfig)

    @model_validator(mode="after")
    def _sizes_agree(self) -> TensorParallelConfig:
        if self.tp.tp_size > 1 and self.autotp_size > 1 and self.tp.tp_size != self.autotp_size:
            raise ValueError(
                f"tensor_parallel.tp.tp_size={self.tp.tp_size} and tensor_parallel.autotp_size={self.autotp_size} "
                "disagree; give one of them (autotp_size is the current spelling)"
            )
        return self

    @property
    def size(self) -> int:
        """The tensor axis size: ``autotp_size`` (or the older ``tp.tp_size``); 0 means 1."""
        return max(self.autotp_size, self.tp.tp_size, 1)

    @property
    def enabled(self) -> bool:
        return self.size > 1
