"""``recommend_config``: the fastest setup whose per-rank peak fits the accelerator.

Candidates are tried from fastest to slowest and the first that fits wins. The order:

1. optimizer offload, outermost (slowest lever: every step moves gradients and weights over
   PCIe and steps the optimizer on the CPU): none; then, without a CPU memory size, all of it
   to CPU memory; with one (``cpu_memory``), the tiered ``"auto"`` split
   (:func:`partita.estimate.tiers.plan_tiers`, what ``offload_optimizer.device "auto"`` does
   at ``initialize``): as much of the optimizer state on the accelerator as fits beside the
   working set, then host memory, the rest on NVMe, within ``nvme_memory`` (no disk given: no
   NVMe). A split that fits uses every tier it needs and no more, so it beats plain CPU or NVMe
   offload whenever they fit too. Parameter offload
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

The accelerator fit compares the predicted *reserved* memory (``MemoryEstimate.reserved_accelerator``:
the peak plus the caching allocator's rounding and fragmentation, partita/estimate/allocator.py)
with ``(1 - headroom) x gpu_memory``; the headroom is left for the CUDA context and NCCL.
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
"""Offload devices tried without a CPU memory size; with one: none, then the tiered "auto" split."""
DEFAULT_HEADROOM = 0.05
"""Fraction of accelerator memory a recommendation leaves free for the CUDA context and NCCL's
buffers (the allocator's rounding and fragmentation are in the reserved-memory prediction)."""
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
    nvme_memory: int | None = None

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
                    "peak_accelerator_bytes": c.estimate.peak_accelerator,
                    "reserved_accelerator_bytes": c.estimate.reserved_accelerator,
                    "peak_cpu_bytes": c.estimate.peak_cpu, "nvme_bytes": c.estimate.nvme,
                    "offload_tiers": c.setup.offload_tiers}

        return {
            "gpu_memory_bytes": self.gpu_memory,
            "cpu_memory_bytes": self.cpu_memory,
            "nvme_memory_bytes": self.nvme_memory,
            "headroom": self.headroom,
            "usable_gpu_memory_bytes": self.usable,
            "chosen": None if self.chosen is None else self.chosen.estimate.to_dict(),
            "tried": [brief(c) for c in self.tried],
            "explanation": self.explanation(),
        }

    def explanation(self) -> str:
        limit = f"{format_bytes(self.usable)} usable of {format_bytes(self.gpu_memory)} accelerator memory"
        if self.headroom:
            limit += f" ({self.headroom:.0%} kept free for the CUDA context)"
        if self.cpu_memory is not None:
            limit += f", {format_bytes(self.cpu_memory)} of CPU memory"
            limit += (" and no NVMe (none given)" if self.nvme_memory is None
                      else f" and {format_bytes(self.nvme_memory)} of NVMe")
        lines = []
        if self.chosen is None:
            smallest = min(self.tried, key=lambda c: c.estimate.reserved_accelerator)
            lines.append(
                f"Nothing fits in {limit}. The smallest per-rank need is {format_bytes(smallest.estimate.reserved_accelerator)} "
                f"reserved on the accelerator with {_short(smallest.setup)}. Lower the micro-batch, add ranks (stages "
                "1-3 divide model states by the world size) or give more memory"
                + (" (or a disk: --nvme-memory / nvme_memory)." if self.cpu_memory is not None and self.nvme_memory is None
                   else ".")
            )
            tiered = [t for t in self.tried if t.setup.offload_optimizer == "auto"]
            if tiered:
                lines.append(f"Closest tiered split: {tiered[-1].reason}")
        else:
            c = self.chosen
            lines.append(f"Recommended: {_short(c.setup)}: {c.reason}, within {limit}.")
            faster = [t for t in self.tried if t is not c]
            if faster:
                lines.append("Faster setups tried first (fastest first) do not fit:")
                lines += [f"  - {_short(t.setup)}: {t.reason}" for t in faster]
            else:
                lines.append("It is the fastest setup considered: no sharding, offload or checkpointing needed.")
        offloads = "none < tiered (accelerator, then CPU, then NVMe)" if self.cpu_memory is not None else "none < CPU"
        lines.append(f"Order tried: optimizer offload {offloads}; within each, checkpointing none < selective "
                     "< every; within each, ZeRO stage 0 < 1 < 2 < 3; the first that fits wins. Fit: predicted "
                     "reserved memory (tensors + allocator rounding and fragmentation).")
        lines += [f"note: {c}" for c in self.caveats]
        return "\n".join(lines)


def _short(setup: Setup) -> str:
    offload = "no offload" if setup.offload_optimizer == "none" else f"optimizer offloaded to {setup.offload_optimizer}"
    if setup.offload_tiers is not None:
        a, c, n = setup.offload_tiers
        offload = f"optimizer tiered (\"auto\": accelerator {a:.3f} / cpu {c:.3f} / nvme {n:.3f})"
    return f"ZeRO stage {setup.stage}, {offload}, checkpointing {setup.checkpointing}"


def recommend_config(
    model: nn.Module | GPTShape | int | ModelInfo,
    gpu_memory: int | str,
    setup: Setup | None = None,
    *,
    cpu_memory: int | str | None = None,
    nvme_memory: int | str | None = None,
    headroom: float = DEFAULT_HEADROOM,
    param_groups: list[Any] | None = None,
    **options: Any,
) -> Recommendation:
    """The fastest setup (see the module docstring for the order) whose predicted reserved
    accelerator memory per rank is at most ``(1 - headroom) x gpu_memory`` (bytes or a size such
    as ``"141GB"``, ``"80GiB"``) and, when ``cpu_memory`` (per rank) is given, whose CPU peak fits
    in it and whose NVMe files fit ``nvme_memory`` (per rank; not given: no NVMe is used).
    dtype, world size, batch, optimizer and bucket sizes come from ``setup`` / ``options``
    and are not varied.
    """
    gpu = parse_bytes(gpu_memory, what="gpu memory")
    cpu = None if cpu_memory is None else parse_bytes(cpu_memory, what="cpu memory")
    nvme = None if nvme_memory is None else parse_bytes(nvme_memory, what="nvme memory")
    if nvme is not None and cpu is None:
        raise EstimateError("nvme_memory (--nvme-memory) needs cpu_memory (--cpu-memory) too: NVMe offload keeps "
                            "the fp32 master and gradients in host memory, so the host's size decides the split")
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
    if cpu is not None and nvme is None:
        caveats.append("no NVMe capacity given (--nvme-memory, or --nvme-path to measure it): NVMe was not used")
    tiers = ("none", "auto") if cpu is not None else OFFLOAD_TIERS
    tried: list[Candidate] = []
    for optimizer_device in tiers:
        for checkpointing in policies:
            for stage in (0, 1, 2, 3):
                if optimizer_device != "none" and stage == 0:
                    continue
                try:
                    candidate_setup = base.replace(
                        stage=stage, checkpointing=checkpointing, offload_optimizer=optimizer_device,
                        offload_param="none", delayed_param_update=False, offload_tiers=None,
                        offload_ratio=1.0 if optimizer_device != "none" else base.offload_ratio,
                    )
                except (EstimateError, NotImplementedError):
                    continue  # a combination partita refuses (e.g. selective with a tiled MLP)
                if optimizer_device == "auto":
                    candidate = _tiered(info, candidate_setup, usable, cpu, nvme or 0)
                else:
                    candidate = _judge(candidate_setup, estimate_for_info(info, candidate_setup), usable, cpu)
                tried.append(candidate)
                if candidate.fits:
                    return Recommendation(gpu, cpu, headroom, candidate, tuple(tried), tuple(caveats), nvme)
    return Recommendation(gpu, cpu, headroom, None, tuple(tried), tuple(caveats), nvme)


def _tiered(info: ModelInfo, setup: Setup, gpu: int, cpu: int, nvme: int) -> Candidate:
    """The tiered split for these capacities (plan_tiers, on predicted reserved accelerator memory),
    or the closest one with the reason it does not fit."""
    from partita.estimate.tiers import TierFitError, plan_tiers
    from partita.offload.capacity import TierCapacities

    capacities = TierCapacities(gpu, cpu, nvme, sources=("--gpu-memory", "--cpu-memory", "--nvme-memory"))
    try:
        plan = plan_tiers(info, setup, capacities, reserved=True, bisections=20)  # shares to 1e-6
    except TierFitError as error:
        closest = error.closest if getattr(error, "closest", None) is not None else estimate_for_info(
            info, setup.replace(offload_tiers=(0.0, 1.0, 0.0)))
        return Candidate(closest.setup, closest, False, str(error).split(": ", 1)[-1])
    chosen = _judge(plan.estimate.setup, plan.estimate, gpu, cpu)
    if chosen.fits:
        need = plan.estimate.nvme
        reason = chosen.reason + (f", {format_bytes(need)} of NVMe" if need else ", no NVMe")
        return Candidate(chosen.setup, chosen.estimate, True, reason)
    return chosen


def _judge(setup: Setup, estimate: MemoryEstimate, gpu: int, cpu: int | None) -> Candidate:
    peak, phase = estimate.peak("accelerator")
    reserved = estimate.reserved_accelerator
    cpu_peak = estimate.peak_cpu
    if reserved > gpu:
        return Candidate(setup, estimate, False,
                         f"needs {format_bytes(reserved)} reserved per rank ({format_bytes(peak)} allocated, {phase})")
    if cpu is not None and cpu_peak > cpu:
        return Candidate(setup, estimate, False,
                         f"accelerator {format_bytes(reserved)} fits, but CPU needs {format_bytes(cpu_peak)} per rank")
    return Candidate(setup, estimate, True,
                     f"peak {format_bytes(peak)} allocated, {format_bytes(reserved)} reserved per rank ({phase})")
