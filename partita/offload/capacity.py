"""How much of each tier this rank may use: accelerator, host memory, disk at ``nvme_path``.

Read once, at ``initialize``, for tiered placement (``offload_optimizer.device "auto"``):

- accelerator: ``torch.cuda.mem_get_info``'s free bytes plus what torch's caching allocator
  already reserves in this process (the model placed on the device is part of the working set
  the estimator counts, so its bytes belong to the budget, not to "used by others").
  On a CPU-only run the accelerator *is* host memory: it gets the host's available bytes and
  the host tier gets none (the two would otherwise be counted twice).
- host: ``MemAvailable`` of ``/proc/meminfo`` (what Linux can give without swapping), else
  ``os.sysconf``'s available pages; split evenly between the ranks of this node.
- disk: free bytes of the filesystem holding ``nvme_path`` (``shutil.disk_usage``), split
  between the ranks of this node; 0 when the directory does not exist.

Every value can be replaced from the config (``tiers.capacity_gib``), and a ``headroom``
fraction of each is kept free. The ranks then take the minimum of every tier over the world,
so all of them decide the same split (a different split per rank would desynchronise the
collectives).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass(frozen=True)
class TierCapacities:
    """Usable bytes per tier (after headroom), and where each figure came from."""

    accelerator: int
    cpu: int
    nvme: int
    sources: tuple[str, str, str] = ("given", "given", "given")
    headroom: float = 0.0

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.accelerator, self.cpu, self.nvme)

    @property
    def total(self) -> int:
        return self.accelerator + self.cpu + self.nvme


def host_available_bytes() -> int:
    """Bytes the OS can give this machine's processes now without swapping."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def disk_free_bytes(path: str) -> int:
    """Free bytes of the filesystem at ``path`` (0 when it does not exist)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def local_ranks() -> int:
    """Ranks sharing this node's host memory and disk (torchrun's LOCAL_WORLD_SIZE; 1 alone)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def measure_capacities(
    device: torch.device, *, nvme_path: str | None, overrides_gib: tuple[float | None, float | None, float | None],
    headroom: float,
) -> TierCapacities:
    """This rank's usable bytes per tier: measured (or ``overrides_gib``), less ``headroom``."""
    ranks = local_ranks()
    host = host_available_bytes() // ranks
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        measured = [free + torch.cuda.memory_reserved(device), host]
        sources = ["cuda free + reserved", f"MemAvailable / {ranks} local rank(s)"]
    else:
        measured = [host, 0]  # the accelerator is host memory: one pool, counted once
        sources = [f"host MemAvailable / {ranks} local rank(s) (CPU run)", "0 (CPU run: the accelerator is host memory)"]
    if nvme_path is not None:
        measured.append(disk_free_bytes(nvme_path) // ranks)
        sources.append(f"free at {nvme_path} / {ranks} local rank(s)")
    else:
        measured.append(0)
        sources.append("no nvme_path")
    usable = []
    for i, given in enumerate(overrides_gib):
        if given is not None:
            measured[i] = int(given * GIB)
            sources[i] = "given (tiers.capacity_gib / --tier-capacity)"
        usable.append(int(measured[i] * (1.0 - headroom)))
    return TierCapacities(*usable, sources=tuple(sources), headroom=headroom)
