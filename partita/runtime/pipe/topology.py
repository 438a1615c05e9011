"""``deepspeed.runtime.pipe.topology``: DeepSpeed's rank-grid classes, from :mod:`partita.pipe.topology`.

    from partita.runtime.pipe.topology import PipeModelDataParallelTopology
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)
    model = PipelineModule(layers=specs, topology=topo, loss_fn=loss)

``ProcessTopology``, ``PipeDataParallelTopology`` and ``PipeModelDataParallelTopology`` answer
rank queries as DeepSpeed 0.19.8's do. ``PipelineParallelGrid`` (DeepSpeed's process groups built
from a topology) is not in partita: the groups come from the engine's mesh, ``engine.topology``
(:class:`partita.distributed.topology.Topology`: ``pipe_group``, ``data_group``, ``tensor_group``,
``pipe_rank``, ``data_rank``, ``tensor_rank``).
"""

from partita.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from partita.runtime._missing import refuse

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]

MISSING = {
    "PipelineParallelGrid": (
        "deepspeed.runtime.pipe.topology.PipelineParallelGrid (process groups built from a topology) is not in "
        "partita: the engine builds its groups from one mesh; use engine.topology (partita.distributed.topology."
        "Topology: pipe_group / data_group / tensor_group, pipe_rank / data_rank / tensor_rank) and give the "
        "topology to PipelineModule(topology=...)"
    ),
}

__getattr__ = refuse(__name__, MISSING)
