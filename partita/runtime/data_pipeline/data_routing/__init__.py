"""``deepspeed.runtime.data_pipeline.data_routing``: random layerwise token dropping (random-LTD),
not in partita; see :mod:`partita.runtime.data_pipeline.data_routing.helper`."""

from partita.runtime._missing import submodules  # noqa: E402

__getattr__ = submodules(__name__)  # the submodules, on first use
