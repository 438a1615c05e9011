"""Routing in the monitors: per MoE layer, tokens per expert (min / mean / max over experts,
summed over every rank), the dropped fraction and the mean auxiliary loss since the last print.

The layers accumulate their statistics on the device in each forward (no synchronisation);
at a ``steps_per_print`` step :class:`RoutingMonitor` takes them and sums them over the ranks
with one all-reduce (every rank reaches the print step, see partita/step_log.py). Metric names:
``moe/<layer>/tokens_per_expert_{min,mean,max}``, ``moe/<layer>/dropped_fraction``,
``moe/<layer>/l_aux``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from partita.distributed import collectives
from partita.moe.registry import moe_layers

__all__ = ["RoutingMonitor"]


class RoutingMonitor:
    """Collects the MoE layers' routing statistics of ``module`` (nothing to do without any)."""

    def __init__(self, module: nn.Module, *, device: torch.device) -> None:
        self._layers = moe_layers(module)
        self._device = device

    @property
    def enabled(self) -> bool:
        return bool(self._layers)

    def collect(self) -> dict[str, float]:
        """Take every layer's statistics, summed over ranks (collective when distributed)."""
        if not self._layers:
            return {}
        rows = []
        for _, layer in self._layers:
            stats = layer.take_routing_stats()
            if stats is None:  # no forward since the last print: zeros, so every rank sends the same size
                rows.append(torch.zeros(layer.num_experts + 3))
            else:
                dropped = stats.dropped_fraction * stats.assignments
                rows.append(torch.cat([stats.tokens_per_expert.float(),
                                       torch.tensor([dropped, float(stats.assignments), stats.l_aux])]))
        packed = torch.cat(rows).to(self._device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            collectives.all_reduce(packed, group=None, purpose="MoE routing statistics for the step log")
        values = packed.cpu()
        metrics: dict[str, float] = {}
        offset = 0
        for name, layer in self._layers:
            counts = values[offset : offset + layer.num_experts]
            dropped, assignments, l_aux = values[offset + layer.num_experts : offset + layer.num_experts + 3].tolist()
            offset += layer.num_experts + 3
            key = f"moe/{name or 'moe'}"
            metrics[f"{key}/tokens_per_expert_min"] = float(counts.min())
            metrics[f"{key}/tokens_per_expert_mean"] = float(counts.mean())
            metrics[f"{key}/tokens_per_expert_max"] = float(counts.max())
            metrics[f"{key}/dropped_fraction"] = dropped / assignments if assignments else 0.0
            metrics[f"{key}/l_aux"] = l_aux / world
        return metrics

    def format(self, metrics: dict[str, float]) -> str:
        """`` moe[<layer>] tokens/expert=min/mean/max dropped=x% l_aux=y`` per layer."""
        parts = []
        for name, _ in self._layers:
            key = f"moe/{name or 'moe'}"
            if f"{key}/l_aux" not in metrics:
                continue
            parts.append(
                f"moe[{name}] tokens/expert={metrics[f'{key}/tokens_per_expert_min']:.0f}/"
                f"{metrics[f'{key}/tokens_per_expert_mean']:.1f}/{metrics[f'{key}/tokens_per_expert_max']:.0f} "
                f"dropped={100 * metrics[f'{key}/dropped_fraction']:.1f}% l_aux={metrics[f'{key}/l_aux']:.4f}"
            )
        return "".join(" " + p for p in parts)
