"""``deepspeed.runtime.engine.DeepSpeedEngine``: partita's :class:`partita.engine.Engine`.

``isinstance(engine, DeepSpeedEngine)`` holds for what ``partita.initialize`` returns. Unlike
DeepSpeed's, the engine is not an ``nn.Module`` subclass; like it, unknown attributes fall
through to ``engine.module``.
"""

from partita.engine import Engine

DeepSpeedEngine = Engine

__all__ = ["DeepSpeedEngine"]
