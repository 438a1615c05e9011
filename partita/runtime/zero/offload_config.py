"""``deepspeed.runtime.zero.offload_config``: DeepSpeed's offload enums, refused. partita's offload
is set for the whole run by the config (``zero_optimization.offload_optimizer.device`` and
``offload_param.device``: ``"none"``, ``"cpu"``, ``"nvme"``, plus ``"auto"`` for the optimizer), and
``engine.offload_states()`` / ``reload_states()``, which these enums are arguments of, are not in
partita."""

from partita.runtime._missing import refuse

__all__: list[str] = []

_WHY = ("is not in partita: offload is configured for the whole run (zero_optimization.offload_optimizer.device / "
        "offload_param.device: \"none\", \"cpu\" or \"nvme\"); engine.offload_states() / reload_states(), which take "
        "these enums, are not in partita")

MISSING = {name: f"deepspeed.runtime.zero.offload_config.{name} {_WHY}"
           for name in ("OffloadDeviceEnum", "OffloadStateTypeEnum")}

__getattr__ = refuse(__name__, MISSING)
