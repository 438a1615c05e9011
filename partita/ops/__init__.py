"""``deepspeed.ops``: the optimizer classes DeepSpeed scripts construct by hand.

``from partita.ops.adam import FusedAdam, DeepSpeedCPUAdam`` gives torch's Adam with
DeepSpeed's constructor arguments (:mod:`partita.ops.adam`). DeepSpeed's compiled kernels
themselves (op builders, fused transformer, quantizers) are not part of partita.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    from partita.deepspeed_compat import MissingDeepSpeedFeature

    raise MissingDeepSpeedFeature(
        f"deepspeed.ops.{name} is not part of partita: DeepSpeed's compiled kernels have no counterpart here; "
        "partita.ops.adam has FusedAdam and DeepSpeedCPUAdam (torch's Adam), and the config's optimizer "
        "section builds Adam, AdamW, SGD, Lion and 8-bit optimizers"
    )
