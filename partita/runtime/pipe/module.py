"""``deepspeed.runtime.pipe.module``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``
(Megatron-DeepSpeed's GPTModelPipe builds on them) and ``PipelineError``, all partita's
(:mod:`partita.pipe.module`, :mod:`partita.pipe.engine`)."""

from partita.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from partita.runtime._missing import refuse

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec"]

# The engine module imports partita.engine (monitors, ZeRO): loaded only when asked for.
__getattr__ = refuse(__name__, {}, lazy={"PipelineError": ("partita.pipe.engine", "PipelineError")})
