"""partita: ZeRO data-parallel training for a plain PyTorch loop and a DeepSpeed-style config.

    engine, optimizer, dataloader, lr_scheduler = partita.initialize(model=model, config="ds.json")
    loss = engine(batch); engine.backward(loss); engine.step()
"""

from partita.initialize import initialize

__version__ = "0.1.0"

__all__ = ["initialize", "__version__"]
