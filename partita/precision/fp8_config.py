"""The ``fp8`` section (partita only; DeepSpeed has no FP8 key of its own): FP8 matmuls in the
model's ``nn.Linear`` layers through torchao's float8 training (``convert_to_float8_training``).

Only the matmuls change: the weights, the fp32 masters, the optimizer and every other op keep the
compute precision (``bf16``/fp32). :func:`partita.precision.fp8.apply_fp8` reads this section at
``initialize``; docs/guides/fp8.md says what each recipe costs.
"""

from __future__ import annotations

import json
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from partita.config.base import PARTITA_KEY, StrictSection

Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]

# Keys that only mean something when FP8 is on; set with enabled false they would be silently
# ignored, which the config refuses (as the compile section does).
_FP8_OPTIONS = ("recipe", "filter", "keep_first_last_bf16", "emulate", "all_gather")


class FP8Config(StrictSection):
    """Run the model's linear layers' matmuls in FP8 (torchao float8 training)."""

    # "auto" is filter's own value (torchao's auto-filter), which is also its default: declared here so the
    # loader does not take it for the Hugging Face Trainer's placeholder.
    auto_fields: ClassVar[frozenset[str]] = frozenset({"filter"})

    enabled: bool = Field(
        False,
        description=(
            "partita only: at initialize, swap the chosen nn.Linear layers for torchao's Float8Linear "
            "(FP8 matmuls with dynamic scaling; weights and optimizer unchanged). Needs torchao >= 0.17 and "
            "FP8 matmuls on the device (NVIDIA compute capability 8.9+), or emulate. Default false."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    recipe: Recipe = Field(
        "tensorwise",
        description=(
            "partita only: torchao's scaling recipe: \"tensorwise\" (one scale per tensor, fastest), "
            "\"rowwise\" (one scale per row, more accurate), \"rowwise_with_gw_hp\" (rowwise, weight "
            "gradients in high precision, most accurate). Default \"tensorwise\"."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    filter: str | list[str] = Field(
        "auto",
        description=(
            "partita only: which linears run in FP8. \"auto\": torchao's auto-filter for the recipe (every "
            "dimension a multiple of 16, and large enough to gain: tensorwise skips in_features <= 4096 with "
            "out_features <= 1024; the rowwise recipes skip out_features <= 2048, in_features <= 1024, or "
            "out_features <= 4096 with in_features <= 2048). A list: fnmatch patterns of module names "
            "(e.g. [\"blocks.*.mlp.*\"]); every pattern must match a linear. Default \"auto\"."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    keep_first_last_bf16: bool = Field(
        False,
        description=(
            "partita only: keep in the compute precision the linears of the first and last repeated block "
            "and every linear outside the blocks (next to the embedding, and the output head). Default false."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    emulate: bool = Field(
        False,
        description=(
            "partita only: torchao's emulation: the FP8 casts and scales as on the GPU, the matmul in high "
            "precision. For testing the numerics without FP8 hardware; no speed-up. Default false."
        ),
        json_schema_extra=PARTITA_KEY,
    )

    all_gather: bool = Field(
        False,
        description=(
            "partita only: at ZeRO-3 (stage 3 only), the unit all-gathers of the FP8 linears' weights send "
            "float8_e4m3fn (1 byte per element, half of bf16) with one scale per weight shared by the ZeRO group "
            "(its amax all-reduced once per gather); every rank rebuilds the weight in the model dtype. Tensorwise "
            "recipe only. Other parameters and gathers outside units stay exact. Default false."
        ),
        json_schema_extra=PARTITA_KEY,
    )

    @model_validator(mode="after")
    def _checks(self) -> FP8Config:
        given = [key for key in _FP8_OPTIONS if key in self.model_fields_set]
        if given and not self.enabled:
            raise ValueError(
                f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} when fp8.enabled is true "
                "(enabled is false, so no linear runs in FP8); set \"enabled\": true, or remove them"
            )
        if self.all_gather and self.recipe != "tensorwise":
            raise ValueError(
                f"all_gather is tensorwise only (recipe is {json.dumps(self.recipe)}): each rank casts its own shard, "
                "which needs one scale per weight, and the rowwise recipes scale each row; set \"recipe\": "
                "\"tensorwise\", or remove all_gather"
            )
        if isinstance(self.filter, str) and self.filter != "auto":
            raise ValueError(
                f"filter is {json.dumps(self.filter)}; give \"auto\" (torchao's size rules) or a list of module-name "
                "patterns such as [\"blocks.*.mlp.*\"]"
            )
        if isinstance(self.filter, list):
            if not self.filter:
                raise ValueError(
                    "filter is []: no linear would run in FP8; give \"auto\" or module-name patterns such as "
                    "[\"blocks.*.mlp.*\"], or set \"enabled\": false"
                )
            blank = [p for p in self.filter if not p.strip()]
            if blank:
                raise ValueError(
                    f"filter has an empty pattern ({json.dumps(self.filter)}); every entry is an fnmatch pattern of "
                    "module names, such as \"blocks.*.attn.*\""
                )
        return self
