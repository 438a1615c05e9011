"""``deepspeed.runtime.zero.config``: ``ZeroStageEnum`` is refused. partita's
``zero_optimization.stage`` is a plain int 0-3 (``engine.zero_optimization_stage()``); its section is
:mod:`partita.zero.config`. Scripts import the enum to allow-list it when unpickling DeepSpeed
checkpoints; partita's checkpoints unpickle nothing."""

from partita.runtime._missing import refuse

__all__: list[str] = []

MISSING = {
    "ZeroStageEnum": (
        "deepspeed.runtime.zero.config.ZeroStageEnum is not in partita: zero_optimization.stage is an int 0-3 "
        "(engine.zero_optimization_stage()), and partita's checkpoints are safetensors and JSON, so no "
        "torch.load allow-list needs it"
    ),
}

__getattr__ = refuse(__name__, MISSING)
