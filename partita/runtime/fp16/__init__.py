"""``deepspeed.runtime.fp16``: its ``loss_scaler`` module is :mod:`partita.runtime.fp16.loss_scaler`."""

from partita.runtime._missing import submodules  # noqa: E402

__getattr__ = submodules(__name__)  # the submodules, on first use
