"""``deepspeed.runtime.fp16.loss_scaler``: partita's loss scalers (:mod:`partita.precision.loss_scaler`).

``LossScaler`` (DeepSpeed's fixed scale) is :class:`partita.precision.loss_scaler.StaticLossScaler`
and ``DynamicLossScaler`` is partita's, with DeepSpeed's dynamics; the engine builds them from the
config's ``"fp16"`` section. Their methods are partita's: ``scale`` and ``update(overflow)``
(DeepSpeed: ``loss_scale`` and ``update_scale``), and ``DynamicLossScaler`` takes keyword
arguments only, ``hysteresis`` being DeepSpeed's ``delayed_shift``. ``CreateLossScaler`` and the
``dynamic_loss_args`` key names are refused: the ``"fp16"`` config keys set the same values.
"""

from partita.precision.loss_scaler import DynamicLossScaler
from partita.precision.loss_scaler import StaticLossScaler as LossScaler
from partita.runtime._missing import refuse

__all__ = ["DynamicLossScaler", "LossScaler"]

_KEYS = ("the \"fp16\" config keys set the scaler: initial_scale_power (init_scale = 2**power), loss_scale_window "
         "(scale_window), hysteresis (delayed_shift), min_loss_scale (min_scale), loss_scale (> 0: a fixed scale); "
         "partita.precision.loss_scaler.build_loss_scaler(config.fp16) builds the scaler from that section")

MISSING = {
    "CreateLossScaler": f"deepspeed.runtime.fp16.loss_scaler.CreateLossScaler is not in partita: {_KEYS}",
    **{name: f"deepspeed.runtime.fp16.loss_scaler.{name} (a dynamic_loss_args key name) is not in partita: {_KEYS}"
       for name in ("INITIAL_LOSS_SCALE", "SCALE_WINDOW", "DELAYED_SHIFT", "MIN_LOSS_SCALE", "CONSECUTIVE_HYSTERESIS")},
}

__getattr__ = refuse(__name__, MISSING)
