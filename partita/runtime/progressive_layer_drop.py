"""``deepspeed.runtime.progressive_layer_drop``: DeepSpeed's ``ProgressiveLayerDrop`` (the schedule of the
``"progressive_layer_drop"`` config section), partita's :class:`partita.schedules.progressive_layer_drop.ProgressiveLayerDrop`."""

from partita.schedules.progressive_layer_drop import ProgressiveLayerDrop

__all__ = ["ProgressiveLayerDrop"]
