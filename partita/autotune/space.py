"""The search space of ``partita tune`` and the config each trial runs.

A trial is one point of micro-batch x ZeRO stage x activation checkpointing x optimizer
offload, at the user's gradient accumulation and the number of processes tuned for. Its
*tuned config* is the user's config with those four settings in place (what
``best_config.json`` holds); its *trial config* adds what keeps a trial short and free of side
effects: a print step at the last step, the throughput warm-up, no checkpoint saving or
resuming, no monitors, no flops profiler.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CHECKPOINTING", "OFFLOAD", "TrialPoint", "micro_batch_candidates", "points"]

CHECKPOINTING = ("none", "every", "selective")
# none; cpu: the optimizer (fp32 master + states) on the host, stage >= 1; cpu+param: also
# the parameters, stage 3 only (partita's ZeRO config refuses other combinations).
OFFLOAD = ("none", "cpu", "cpu+param")


@dataclass(frozen=True)
class TrialPoint:
    stage: int
    micro_batch: int
    checkpointing: str
    offload: str
    gradient_accumulation_steps: int
    world_size: int

    @property
    def name(self) -> str:
        return f"z{self.stage}_mb{self.micro_batch}_ckpt-{self.checkpointing}_off-{self.offload}"

    @property
    def train_batch_size(self) -> int:
        return self.micro_batch * self.gradient_accumulation_steps * self.world_size

    def tuned_config(self, base: Mapping[str, Any]) -> dict[str, Any]:
        """``base`` with this point's batch sizes, stage, checkpointing and offload."""
        config = copy.deepcopy(dict(base))
        config["train_micro_batch_size_per_gpu"] = self.micro_batch
        config["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        config["train_batch_size"] = self.train_batch_size
        zero = dict(config.get("zero_optimization") or {})
        zero["stage"] = self.stage
        # Whole sections, not merged keys: a base "nvme_path" or "pin_memory" must not be left
        # behind on a device that does not take it.
        old_opt = zero.get("offload_optimizer") or {}
        old_param = zero.get("offload_param") or {}
        zero["offload_optimizer"] = (old_opt if old_opt.get("device") == "cpu" else {"device": "cpu"}) \
            if self.offload in ("cpu", "cpu+param") else {"device": "none"}
        zero["offload_param"] = (old_param if old_param.get("device") == "cpu" else {"device": "cpu"}) \
            if self.offload == "cpu+param" else {"device": "none"}
        config["zero_optimization"] = zero
        ckpt = {k: v for k, v in dict(config.get("activation_checkpointing") or {}).items() if k not in ("policy", "k")}
        if self.checkpointing == "none":
            ckpt.pop("block_types", None)
        else:
            ckpt["policy"] = self.checkpointing
        if ckpt or "activation_checkpointing" in config:
            config["activation_checkpointing"] = ckpt
        return config

    def trial_config(self, base: Mapping[str, Any], *, steps: int, warmup_steps: int) -> dict[str, Any]:
        """The tuned config plus what makes it a short, side-effect-free trial."""
        config = self.tuned_config(base)
        config["steps_per_print"] = steps  # the step logger's metrics are complete at the last step
        config["throughput"] = {**dict(config.get("throughput") or {}), "warmup_steps": warmup_steps}
        checkpoint = {k: v for k, v in dict(config.get("checkpoint") or {}).items() if k not in ("save_dir", "resume")}
        config["checkpoint"] = checkpoint  # never resume from, or write over, the user's checkpoints
        for monitor in ("tensorboard", "csv_monitor", "wandb", "comms_logger", "flops_profiler"):
            if monitor in config:
                config[monitor] = {"enabled": False}
        return config

    def config_value(self, key: str) -> Any:
        """A tuned key's value, for ``arg_mappings`` (dotted keys reach into sections)."""
        return {"train_micro_batch_size_per_gpu": self.micro_batch,
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "train_batch_size": self.train_batch_size,
                "zero_optimization.stage": self.stage}[key]


def micro_batch_candidates(minimum: int, maximum: int) -> list[int]:
    """Powers of two from ``minimum`` to ``maximum``, with both ends included."""
    sizes = {minimum, maximum}
    size = 1
    while size <= maximum:
        if size >= minimum:
            sizes.add(size)
        size *= 2
    return sorted(sizes)


def points(
    *,
    stages: Sequence[int],
    micro_batches: Sequence[int],
    checkpointing: Sequence[str],
    offload: Sequence[str],
    gradient_accumulation_steps: int,
    world_size: int,
) -> list[TrialPoint]:
    """Every valid combination, grid order: stage, offload, checkpointing, then micro-batch.

    Offload needs a ZeRO stage that shards (optimizer: >= 1; parameters: 3); those
    combinations do not exist in partita, so they are left out rather than tried.
    """
    for value in checkpointing:
        if value not in CHECKPOINTING:
            raise ValueError(f"checkpointing {value!r} is not one of {', '.join(CHECKPOINTING)}")
    for value in offload:
        if value not in OFFLOAD:
            raise ValueError(f"offload {value!r} is not one of {', '.join(OFFLOAD)}")
    for stage in stages:
        if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
            raise ValueError(f"ZeRO stage {stage!r} is not one of 0, 1, 2, 3")
    for mb in micro_batches:
        if mb < 1:
            raise ValueError(f"micro-batch {mb} must be >= 1")
    result = []
    for stage in stages:
        for off in offload:
            if (off == "cpu" and stage == 0) or (off == "cpu+param" and stage != 3):
                continue
            for ckpt in checkpointing:
                for mb in micro_batches:
                    result.append(TrialPoint(stage, mb, ckpt, off, gradient_accumulation_steps, world_size))
    if not result:
        raise ValueError(
            f"no valid trial in stages {list(stages)} x offload {list(offload)}: optimizer offload needs stage >= 1 "
            "and parameter offload stage 3"
        )
    return result
