"""``recommend_config``: the fastest setup whose per-rank peak fits the accelerator.

Candidates are tried from fastest to slowest and the first that fits wins. The order:

1. optimizer offload, outermost (slowest lever: every step moves gradients and weights over
   PCIe and steps the optimizer on the CPU): none; to CPU memory; then, only when a CPU
   memory size is given and CPU offload exceeds it, to NVMe. Parameter offload
   (``offload_param``) is not tried: it adds a host-to-device copy to every gather of every
   unit, a cost the memory estimate cannot weigh; estimate it explicitly when stage 3 with
   optimizer offload still does not fit;
2. activation checkpointing, in the middle (one extra forward of the recomputed part):
   none; selective (recomputes only elementwise ops); every block;
3. ZeRO stage, innermost (cheapest: communication that overlaps with compute): 0, 1, 2, 3.

So a setup that needs no offload always beats one that does, and within an offload tier a
setup without checkpointing beats one with it; the stage is raised first. Offloading
needs stage >= 1, so stage 0 is skipped in the offload tiers. When
activations are unknown (a model without a shape, no ``activation_bytes``), checkpointing
cannot change the estimate and is not varied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from partita.estimate.core import estimate_for_info
from partita.estimate.inputs import Checkpointing, EstimateError, GPTShape, Setup, parse_bytes
from partita.estimate.model_info import ModelInfo, model_info
from partita.estimate.report import format_bytes
from partita.estimate.result import MemoryEstimate

__all__ = ["CHECKPOINTING_ORDER", "DEFAULT_HEADROOM", "OFFLOAD_TIERS", "Candidate", "Recommendation", "recommend_config"]

OFFLOAD_TIERS: tuple[str, ...] = ("none", "cpu")
DEFAULT_HEADROOM = 0.05
"""Fraction of accelerator memory a recommendation leaves free. The estimate counts tensors
(it is within 3% of torch.cuda.max_memory_allocated on H200s, see tests/test_estimate_formulas.py);
the CUDA context, the caching allocator's rounding and fragmentation come on top."""
NVME_TIERS: tuple[str, ...] = ("nvme",)
CHECKPOINTING_ORDER: tuple[Checkpointing, ...] = (Checkpointing("none"), Checkpointing("selective"), Checkpointing("every"))


@dataclass(frozen=True)
class Candidate:
    """One setup tried, its per-rank peaks and why it was (not) chosen."""

    setup: Setup
    estimate: MemoryEstimate
    fits: bool
    reason: str


@dataclass(frozen=True)
class Recommendation:
    """The first candidate that fits (``chosen``, None when nothing does) and every candidate tried before it."""

    gpu_memory: int
    cpu_memory: int | None
    headroom: float
    chosen: Candidate | None
    tried: tuple[Candidate, ...] = field(default_factory=tuple)
    caveats: tuple[str, ...] = field(default_factory=tuple)

    @property
    def usable(self) -> int:
        """Accelerator bytes a setup may use: ``gpu_memory`` less the headroom."""
        return int(self.gpu_memory * (1.0 - self.headroom))

    @property
    def setup(self) -> Setup | None:
        return None if self.chosen is None else self.chosen.setup

    def to_dict(self) -> dict[str, Any]:
        def brief(c: Candidate) -> dict[str, Any]:
            return {"setup": _short(c.setup), "fits": c.fits, "reason": c.reason,
                    "peak_accelerator_bytes": c.estimate.peak_accelerator, "peak_cpu_bytes": c.estimate.peak_cpu}

        return {
            "gpu_memory_bytes": self.gpu_memory,
            "cpu_memory_bytes": self.cpu_memory,
            "headroom": self.headroom,
            "usable_gpu_memory_bytes": self.usable,
            "chosen": None if self.chosen is None else self.chosen.estimate.to_dict(),
            "tried": [brief(c) for c in self.tried],
            "explanation": self.explanation(),
        }

    def explanation(self) -> str:
        limit = f"{format_bytes(self.usable)} usable of {format_bytes(self.gpu_memory)} accelerator memory"
        if self.headroom:
            limit += f" ({self.headroom:.0%} kept free for the CUDA context, allocator rounding and fragmentation)"
        if self.cpu_memory is not None:
            limit += f" and {format_bytes(self.cpu_memory)} of CPU memory"
        lines = []
        if self.chosen is None:
            smallest = min(self.tried, key=lambda c: c.estimate.peak_accelerator)
            lines.append(
                f"Nothing fits in {limit}. The smallest per-rank peak is {format_bytes(smallest.estimate.peak_accelerator)} "
                f"with {_short(smallest.setup)}. Lower the micro-batch, add ranks (stages 1-3 divide model states "
                "by the world size) or give more memory."
            )
        else:
            c = self.chosen
            lines.append(f"Recommended: {_short(c.setup)}: {c.reason}, within {limit}.")
            faster = [t for t in self.tried if t is not c]
            if faster:
                lines.append("Faster setups tried first (fastest first) do not fit:")
                lines += [f"  - {_short(t.setup)}: {t.reason}" for t in faster]
            else:
                lines.append("It is the fastest setup considered: no sharding, offload or checkpointing needed.")
        lines.append("Order tried: optimizer offload none < CPU (< NVMe); within each, checkpointing none < selective "
                     "< every; within each, ZeRO stage 0 < 1 < 2 < 3; the first that fits wins.")
        lines += [f"note: {c}" for c in self.caveats]
        return "\n".join(lines)


def _short(setup: Setup) -> str:
    offload = "no offload" if setup.offload_optimizer == "none" else f"optimizer offloaded to {setup.offload_optimizer}"
    return f"ZeRO stage {setup.stage}, {offload}, checkpointing {setup.checkpointing}"


def recommend_config(
    model: nn.Module | GPTShape | int | ModelInfo,
    gpu_memory: int | str,
    setup: Setup | None = None,
    *,
    cpu_memory: int | str | None = None,
    headroom: float = DEFAULT_HEADROOM,
    param_groups: list[Any] | None = None,
    **options: Any,
) -> Recommendation:
    """The fastest setup (see the module docstring for the order) whose per-rank accelerator
    peak is at most ``(1 - headroom) x gpu_memory`` (bytes or a size such as ``"141GB"``,
    ``"80GiB"``) and, when ``cpu_memory`` (per rank) is given, whose CPU peak fits in it.
    dtype, world size, batch, optimizer and bucket sizes come from ``setup`` / ``options``
    and are not varied.
    """
    gpu = parse_bytes(gpu_memory, what="gpu memory")
    cpu = None if cpu_memory is None else parse_bytes(cpu_memory, what="cpu memory")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0.0 <= headroom < 1.0:
        raise EstimateError(f"headroom must be a fraction in [0, 1), e.g. 0.05, got {headroom!r}")
    usable = int(gpu * (1.0 - headroom))
    base = Setup.resolve(setup, options)
    info = model if isinstance(model, ModelInfo) else model_info(model, param_groups=param_groups)
    caveats = []
    activations_vary = info.gpt is not None and base.activation_bytes is None
    policies = CHECKPOINTING_ORDER if activations_vary else (base.checkpointing,)
    if info.gpt is None and base.activation_bytes is None:
        caveats.append("activations are unknown (no model shape): the fit ignores them; pass activation_bytes")
    elif not activations_vary:
        caveats.append("activations were given as a number, so checkpointing is not varied")
    tiers = OFFLOAD_TIERS + (NVME_TIERS if cpu is not None else ())
    tried: list[Candidate] = []
    for optimizer_device in tiers:
        for checkpointing in policies:
            for stage in (0, 1, 2, 3):
                if optimizer_device != "none" and stage == 0:
                    continue
                try:
                    candidate_setup = base.replace(
                        stage=stage, checkpointing=checkpointing, offload_optimizer=optimizer_device,
                        offload_param="none", delayed_param_update=False,
                        offload_ratio=1.0 if optimizer_device != "none" else base.offload_ratio,
                    )
                except EstimateError:
                    continue
                estimate = estimate_for_info(info, candidate_setup)
                candidate = _judge(candidate_setup, estimate, usable, cpu)
                tried.append(candidate)
                if candidate.fits:
                    return Recommendation(gpu, cpu, headroom, candidate, tuple(tried), tuple(caveats))
    return Recommendation(gpu, cpu, headroom, None, tuple(tried), tuple(caveats))


def _judge(setup: Setup, estimate: MemoryEstimate, gpu: int, cpu: int | None) -> Candidate:
    peak, phase = estimate.peak("accelerator")
    cpu_peak = estimate.peak_cpu
    if peak > gpu:
        return Candidate(setup, estimate, False, f"needs {format_bytes(peak)} per rank ({phase})")
    if cpu is not None and cpu_peak > cpu:
        return Candidate(setup, estimate, False,
                         f"accelerator {format_bytes(peak)} fits, but CPU needs {format_bytes(cpu_peak)} per rank")
    return Candidate(setup, estimate, True, f"peak {format_bytes(peak)} per rank ({phase})")
