"""Process groups and the rank layout: how partita starts torch.distributed and names its axes."""

from partita.distributed.init import current_device, detect_launch_env, init_distributed, local_rank
from partita.distributed.topology import AXIS_ORDER, Axis, Topology, build_topology

__all__ = [
    "AXIS_ORDER",
    "Axis",
    "Topology",
    "build_topology",
    "current_device",
    "detect_launch_env",
    "init_distributed",
    "local_rank",
]
