"""``deepspeed.runtime.pipe``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` and
``ProcessTopology``, all partita's (:mod:`partita.pipe`).

Submodules under DeepSpeed's names: ``topology`` (the rank-grid classes), ``module`` (the layer
specs and PipelineModule), ``engine`` (PipelineEngine) and ``schedule`` (DeepSpeed's instruction
schedules, which partita refuses: its pipelines run torch's schedules).
"""

from partita.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from partita.pipe.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]

from partita.runtime._missing import submodules  # noqa: E402

__getattr__ = submodules(__name__)  # the submodules, on first use
