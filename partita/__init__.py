"""partita: ZeRO data-parallel training for a plain PyTorch loop and a DeepSpeed-style config.

    engine, optimizer, dataloader, lr_scheduler = partita.initialize(model=model, config="ds.json")
    loss = engine(batch); engine.backward(loss); engine.step()
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["initialize", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: the `partita` console command imports this package and should not pay for
    # the engine, config and optimizer modules just to print help or launch torchrun.
    if name == "initialize":
        from partita.bootstrap import initialize

        return initialize
    raise AttributeError(f"module 'partita' has no attribute {name!r}")
