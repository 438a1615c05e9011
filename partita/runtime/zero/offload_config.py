"""``deepspeed.runtime.zero.offload_config``: DeepSpeed's offload enums, the arguments of
``engine.offload_states(include=[...], device=...)``. They are partita's own
(:mod:`partita.zero.offload_states`), re-exported here under DeepSpeed's path. Offload for the whole
run is configured instead by ``zero_optimization.offload_optimizer.device`` / ``offload_param.device``."""

from partita.zero.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
