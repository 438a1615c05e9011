"""Mixed-precision support: fp16 loss scaling (the ``fp16``/``bf16`` config sections live in
``partita.precision.config``)."""

from partita.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    LossScaler,
    StaticLossScaler,
    build_loss_scaler,
)

__all__ = [
    "DynamicLossScaler",
    "LossScaleAtMinimumError",
    "LossScaler",
    "StaticLossScaler",
    "build_loss_scaler",
]
