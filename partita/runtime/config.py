"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` is refused; partita's config is
:func:`partita.config.load_config` (validated pydantic sections, ``engine.config`` on a running
engine)."""

from partita.deepspeed_compat import TOP_LEVEL
from partita.runtime._missing import refuse

__all__: list[str] = []

MISSING = {"DeepSpeedConfig": TOP_LEVEL["DeepSpeedConfig"].replace("deepspeed.", "deepspeed.runtime.config.", 1)}

__getattr__ = refuse(__name__, MISSING)
