"""The ``fp16`` and ``bf16`` sections: which half precision to train in, and fp16 loss scaling.

Keys, meanings and defaults follow DeepSpeed 0.19. Enabling both sections is an error
(reported by the loader, which sees both). Extra DeepSpeed keys (``fp16.auto_cast``,
``bf16.immediate_grad_update``, ...) are refused with an explanation by
``partita.config.unsupported`` unless set to their no-op default.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from partita.config.base import JsonInt, StrictSection


# Bound on the loss scale (DeepSpeed has none: 4000 overflowed to inf in Python, 1e30 was accepted).
# fp16 gradients run from 2**-24 (the smallest subnormal) to 65504 (< 2**16), so past 2**40 even
# the smallest representable gradient overflows once scaled: every step would be skipped while
# the dynamic scale halves its way back down. 2**40 is finite in fp32 (the loss is scaled in fp32)
# and far above the powers DeepSpeed configs use (8 to 32).
MAX_SCALE_POWER = 40
MAX_LOSS_SCALE = float(2**MAX_SCALE_POWER)


class FP16Config(StrictSection):
    """fp16 training with a loss scale that keeps small gradients from flushing to zero."""

    # "auto" for a scaling knob means DeepSpeed's default, which is what the Hugging Face
    # Trainer writes too. "auto" for `enabled` is refused: only the user knows the precision.
    auto_fields: ClassVar[frozenset[str]] = frozenset(
        {
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "consecutive_hysteresis",
            "min_loss_scale",
        }
    )

    enabled: bool = Field(False, description="Train in fp16. DeepSpeed default false.")
    loss_scale: float = Field(
        0.0,
        ge=0,
        le=MAX_LOSS_SCALE,
        description=(
            "Static loss scale; 0 selects dynamic loss scaling. At most 2**40 (see MAX_SCALE_POWER). "
            "DeepSpeed default 0 (dynamic)."
        ),
    )
    initial_scale_power: JsonInt = Field(
        16,
        ge=0,
        le=MAX_SCALE_POWER,
        description=(
            "Dynamic scaling starts at 2**initial_scale_power; at most 40 (see MAX_SCALE_POWER). "
            "DeepSpeed default 16 (65536)."
        ),
    )
    loss_scale_window: JsonInt = Field(
        1000,
        ge=1,
        description="Dynamic scaling doubles the scale after this many steps without overflow. DeepSpeed default 1000.",
    )
    hysteresis: JsonInt = Field(
        2,
        ge=1,
        description="Overflowing steps tolerated before the dynamic scale is halved. DeepSpeed default 2.",
    )
    consecutive_hysteresis: bool = Field(
        False,
        description="Refill the hysteresis budget after every step without overflow. DeepSpeed default false.",
    )
    min_loss_scale: float = Field(
        1.0,
        gt=0,
        description="The dynamic scale never drops below this. DeepSpeed default 1.",
    )

    @property
    def dynamic(self) -> bool:
        """True when the loss scale adapts (``loss_scale`` is 0)."""
        return self.loss_scale == 0


class BF16Config(StrictSection):
    """bf16 training: fp32's exponent range, so no loss scaling is needed."""

    enabled: bool = Field(False, description="Train in bf16. DeepSpeed default false.")


DtypeName = Literal["fp32", "bf16", "fp16"]


class DataTypesConfig(StrictSection):
    """The ``data_types`` section: dtypes of gradient bookkeeping in mixed precision."""

    grad_accum_dtype: DtypeName | None = Field(
        None,
        description=(
            "dtype gradients are summed in across the micro-batches of one optimizer step. "
            "null: the model's dtype at ZeRO 0/1 (bf16 sums lose precision with many micro-batches, "
            "DeepSpeed issues 1800 and 2352) and fp32 at ZeRO 2/3 (reduced gradients go straight "
            "into the fp32 partition). \"fp32\" at ZeRO 0/1 keeps an fp32 accumulator per parameter "
            "(4 bytes per parameter). DeepSpeed default null."
        ),
    )
