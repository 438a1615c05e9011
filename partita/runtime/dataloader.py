"""``deepspeed.runtime.dataloader``: ``RepeatingLoader`` is the pipeline engine's endless loader
(:func:`partita.pipe.engine._repeat`): ``RepeatingLoader(loader)`` is an iterator that starts a
new pass over ``loader`` when one ends, as DeepSpeed's, and also calls ``sampler.set_epoch(k)``
before pass ``k`` so a ``DistributedSampler`` reshuffles each epoch. It is a generator, not a
class: ``next()``, ``iter()`` and ``for`` work, ``isinstance(x, RepeatingLoader)`` does not.
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

__getattr__ = refuse(__name__, MISSING, lazy={"RepeatingLoader": ("partita.pipe.engine", "_repeat")})
