"""``deepspeed.runtime.dataloader``: ``RepeatingLoader`` is :class:`partita.data.RepeatingLoader`
(DeepSpeed's: a new pass over the loader when one ends, the sampler left alone).
``DeepSpeedDataLoader`` is refused: ``partita.initialize(training_data=dataset)`` returns the
loader.
"""

from partita.runtime._missing import refuse

__all__ = ["RepeatingLoader"]

MISSING = {
    "DeepSpeedDataLoader": (
        "deepspeed.runtime.dataloader.DeepSpeedDataLoader is not in partita: pass training_data=dataset (and "
        "collate_fn=...) to partita.initialize, which returns a DataLoader sharded over the data-parallel ranks"
    ),
}

__getattr__ = refuse(__name__, MISSING, lazy={"RepeatingLoader": ("partita.data.repeating", "RepeatingLoader")})
