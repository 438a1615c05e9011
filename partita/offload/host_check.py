"""Refuse, at ``initialize``, an offload whose host-memory share cannot fit this node.

With the optimizer offloaded to host memory the host keeps 16 bytes per parameter of this rank's
partition (fp32 master, fp32 gradient, two Adam moments), and 18 with the bf16 parameters
offloaded too. When that is more than the node has, the run is killed by the kernel's OOM killer
or pushes the machine into swap, a minute or more into the run and with nothing to act on. On
one H200 host (125 GiB available) an 8.27 B GPT with the optimizer offloaded died that way
(benchmarks/results/2026-12-01-report.md, "The largest GPT per offload setting").

The check compares partita's estimate of its own host buffers (:mod:`partita.estimate`, exact for
the model states) with the host memory available to this rank (``MemAvailable`` divided between
the node's ranks, the minimum over all ranks so every rank decides the same). The estimate leaves
out what every process has besides partita's buffers (libraries, the CUDA context, Python objects:
a few GiB), so it errs towards letting a run start. A refusal means the state cannot fit.
``offload_optimizer.check_host_memory: false`` turns the check off.

On a CPU-only run the "accelerator" is host memory too, so there the whole estimate is compared
with the host's available memory.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from partita.config.base import ConfigError
from partita.offload.auto_placement import client_optimizer_name, min_over_ranks, model_info_for
from partita.offload.capacity import GIB, TierCapacities, measure_capacities

__all__ = ["check_host_capacity"]

logger = logging.getLogger(__name__)


def check_host_capacity(
    cfg: Any, model: nn.Module, param_groups: list[dict], *, world_size: int, device: torch.device,
    batch_world_size: int | None = None, client_optimizer: Any = None, capacities: TierCapacities | None = None,
) -> None:
    """Raise :class:`ConfigError` when the offloaded state surely does not fit in host memory.

    Arguments as :func:`partita.offload.auto_placement.resolve_tiered_placement`, which has
    already decided a ``device "auto"`` (its split fits by construction and is not checked again).
    """
    zero = cfg.zero_optimization
    offload = zero.offload_optimizer
    offloading = offload.device in ("cpu", "nvme") or zero.offload_param.device != "none"
    if not offloading or offload.device == "auto" or not offload.check_host_memory:
        return
    from partita.estimate import estimate_memory
    from partita.estimate.inputs import Setup
    from partita.estimate.result import PHASES

    if capacities is None:
        capacities = measure_capacities(device, nvme_path=None, overrides_gib=(None, None, None), headroom=0.0)
    capacities = min_over_ranks(capacities, device)
    extra = {}
    if cfg.optimizer is None and client_optimizer is not None:
        extra["optimizer"] = client_optimizer_name(client_optimizer)
    try:
        info = model_info_for(model, param_groups, None)
        if info.gpt is None:
            extra["activation_bytes"] = 0  # unknown activations: leave them out (a lower bound)
        setup = Setup.from_config(cfg, world_size=batch_world_size or world_size, **extra)
        if setup.world_size != world_size:
            setup = setup.replace(world_size=world_size)
        estimate = estimate_memory(info, setup)
    except Exception as error:  # noqa: BLE001 - a setup the estimator cannot size must still run
        logger.info("host-memory check of the offload skipped: the estimator cannot size this setup (%s)", error)
        return
    cpu_run = device.type != "cuda"
    if cpu_run:
        # One pool: the model's working set and the offloaded state share the host. The model's
        # own tensors are allocated already, so MemAvailable no longer counts them.
        resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
                       if t.device.type == "cpu")
        needed = max(estimate.total("accelerator", phase=p) + estimate.total("cpu", phase=p) for p in PHASES)
        needed = max(0, needed - resident)
        available, source = capacities.accelerator, capacities.sources[0]
    else:
        needed = estimate.peak_cpu
        available, source = capacities.cpu, capacities.sources[1]
    if needed <= available:
        return
    raise ConfigError(_refusal(estimate, needed, available, source, setup, cpu_run=cpu_run))


def _refusal(estimate: Any, needed: int, available: int, source: str, setup: Any, *, cpu_run: bool) -> str:
    items = sorted(
        ((line.nbytes, line.item) for line in estimate.lines if line.device == "cpu" and line.nbytes >= GIB // 100),
        reverse=True,
    )
    biggest = "; ".join(f"{item} {nbytes / GIB:.2f}" for nbytes, item in items[:4]) or "none"
    shards = sum(line.nbytes for line in estimate.lines if line.device == "cpu" and "offload_param cpu" in line.item)
    gather = ""
    if shards and setup.offload_optimizer != "none" and not setup.param_gather_from_master:
        gather = (f"offload_param.gather_from_master true (no 16-bit parameter copy in host memory: "
                  f"{shards / GIB:.2f} GiB less), or ")
    where = "this CPU run's memory (model, activations and offloaded state)" if cpu_run else "host memory"
    return (
        f"zero_optimization offload needs at least {needed / GIB:.2f} GiB of {where} on each rank, but "
        f"{available / GIB:.2f} GiB is available ({source}); the run would be killed by the kernel's OOM killer. "
        f"Host buffers (GiB): {biggest}. Fixes: {gather}offload_optimizer.device \"auto\" (partita splits the optimizer "
        f"state over the accelerator, host memory and NVMe to fit: `partita estimate --offload-optimizer auto`), "
        f"or offload_optimizer.device \"nvme\" with nvme_path, or offload_param.device \"nvme\", or an 8-bit "
        f"optimizer, or more data-parallel ranks (the state is sharded over {setup.world_size} now). "
        f"If the figures are wrong, set offload_optimizer.check_host_memory to false."
    )
