"""Read a SLURM allocation for ``partita run``: node count, this node's rank, master address.

The intended use is one launcher per node, ``srun --ntasks-per-node=1 partita run train.py``:
each launcher starts the node's workers through torchrun. Node-list parsing and the port
rule are shared with :mod:`partita.distributed.init`, which handles the other style,
``srun python train.py`` with one task per rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from partita.distributed.init import first_slurm_host, slurm_master_port

__all__ = ["SlurmAllocation", "slurm_allocation"]


@dataclass(frozen=True)
class SlurmAllocation:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer") from None


def slurm_allocation(environ: Mapping[str, str] | None = None) -> SlurmAllocation | None:
    """The allocation this launcher runs in, or None outside SLURM.

    "Inside SLURM" means SLURM_JOB_ID and SLURM_NNODES are both set. Raises ValueError when
    several launcher tasks share a node (each would start a full set of workers) or when a
    multi-node job does not say which node this is.
    """
    env = os.environ if environ is None else environ
    if not env.get("SLURM_JOB_ID") or not env.get("SLURM_NNODES"):
        return None
    nnodes = _int(env, "SLURM_NNODES")
    step_tasks, step_nodes = env.get("SLURM_STEP_NUM_TASKS"), env.get("SLURM_STEP_NUM_NODES")
    if step_tasks and step_nodes and int(step_tasks) > int(step_nodes):
        raise ValueError(
            f"partita run is running as {step_tasks} SLURM tasks on {step_nodes} node(s); it must be "
            "one task per node: `srun --ntasks-per-node=1 partita run ...`, or skip the launcher "
            "and use `srun python train.py` (init_distributed reads the SLURM task variables)"
        )
    if env.get("SLURM_NODEID"):
        node_rank = _int(env, "SLURM_NODEID")
    elif nnodes == 1:
        node_rank = 0
    else:
        raise ValueError(
            f"SLURM job spans {nnodes} nodes but SLURM_NODEID is not set; start the launcher on every "
            "node with `srun --ntasks-per-node=1 partita run ...`"
        )
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError("SLURM_JOB_ID is set but SLURM_JOB_NODELIST is not; cannot find the master node")
    master_port = (_int(env, "MASTER_PORT") if env.get("MASTER_PORT")
                   else slurm_master_port(env.get("SLURM_JOB_ID")))
    return SlurmAllocation(
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
        master_port=master_port,
    )
