"""``zero_optimization.one_rank_gradient_fold "auto"`` at ``initialize``: early or end, by the estimate.

On one process the reducer has nothing to communicate, so it can fold each gradient into the
fp32 partition as soon as autograd makes it ("early", freeing ``param.grad``), or hold every
``param.grad`` and fold them after backward ("end"). The values are the same; the peaks differ:

- early: the partition (4 bytes per parameter) exists from the first gradient, beside whatever
  activations backward has not freed yet;
- end: the full-size gradients (2 bytes per parameter in bf16) grow as backward frees
  activations, and the partition joins them only at the end (4 + 2 bytes per parameter then);
  at stages 0-2 each block's 16-bit weights are freed again after its backward
  (one_rank_weights.py [Note: freed again after the unit's backward]).

At ZeRO-3 with checkpointing early is lower (GPT-6.7B, checkpointed: 10 GiB lower on one H200);
with small micro-batches end is (GPT-1.3B, ZeRO-2, micro-batch 2: 23.6 against 26.5 GiB by the
estimate; measured on one H200 23.31 against 26.34, FSDP2's 23.31). "auto" asks partita's
estimator for both peaks, which it models block by block for partita's GPT, and takes end only
where it is lower by at least ``END_MIN_SAVING`` of early's: end costs time where the step is
bound by Python, not the GPU (the second cast of every block's weights and the fold after
backward run per parameter: GPT-1.3B, ZeRO-2, micro-batch 1 on one H200, 4-15% fewer tokens/s
than early on two machines for 22.32 against 23.30 GiB; micro-batch 2, 45.5k against 47.0k
for 3 GiB less). Every other model gets early, the behaviour before this choice existed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch import nn

from partita.offload.auto_placement import client_optimizer_name, model_info_for

__all__ = ["resolve_gradient_fold"]

logger = logging.getLogger(__name__)

END_MIN_SAVING = 0.05
"""The fraction of early's estimated peak that end must save to be chosen (see the docstring)."""


def resolve_gradient_fold(
    cfg: Any, model: nn.Module, param_groups: list[dict], *, world_size: int, client_optimizer: Any = None,
    gradient_accumulation_steps: int = 1,
) -> Any:
    """``cfg`` with ``one_rank_gradient_fold`` "auto" decided ("early" or "end"); "stream" checked
    against what it needs (:func:`check_streamed_step`)."""
    zero = cfg.zero_optimization
    job_world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if zero.one_rank_gradient_fold == "stream":
        check_streamed_step(cfg, model, job_world=job_world, gradient_accumulation_steps=gradient_accumulation_steps)
    if zero.one_rank_gradient_fold != "auto":
        return cfg
    choice = "early"
    if world_size == 1 and job_world == 1 and not zero.offload_optimizer.enabled:
        peaks = _peaks(cfg, model, param_groups, client_optimizer)
        if peaks is not None and peaks["end"] <= (1 - END_MIN_SAVING) * peaks["early"]:
            choice = "end"
            logger.info("one_rank_gradient_fold \"auto\" chose \"end\": estimated peak %.2f GiB against %.2f GiB "
                        "folding each gradient as it arrives", peaks["end"] / 2**30, peaks["early"] / 2**30)
    return cfg.model_copy(update={"zero_optimization": zero.model_copy(update={"one_rank_gradient_fold": choice})})


def _peaks(cfg: Any, model: nn.Module, param_groups: list[dict], client_optimizer: Any) -> dict[str, int] | None:
    """Estimated accelerator peaks of both rules, or None where the estimator has no walk of backward."""
    from partita.estimate import estimate_memory
    from partita.estimate.inputs import Setup

    try:
        info = model_info_for(model, param_groups, None)
        if info.gpt is None:
            return None
        extra = {}
        if cfg.optimizer is None and client_optimizer is not None:
            extra["optimizer"] = client_optimizer_name(client_optimizer)
        setup = Setup.from_config(cfg, world_size=1, **extra)
        return {rule: estimate_memory(info, setup.replace(fold_gradients_at_end=rule == "end")).peak_accelerator
                for rule in ("early", "end")}
    except Exception as error:  # noqa: BLE001 - the choice must never stop a run; early is the safe default
        logger.info("one_rank_gradient_fold \"auto\": kept \"early\" (the estimator cannot size this setup: %s)", error)
        return None


def check_streamed_step(cfg: Any, model: nn.Module, *, job_world: int, gradient_accumulation_steps: int) -> None:
    """Refuse ``one_rank_gradient_fold "stream"`` where the streamed step (streamed_step.py) does not
    apply, naming the fix (the optimizer's fused kernel is checked once it is built, in apply_zero)."""
    from partita.config.base import ConfigError
    from partita.pipe import PipelineModule

    key = 'zero_optimization.one_rank_gradient_fold "stream"'
    if job_world != 1:
        raise ConfigError(f"{key} steps from every param.grad of one process; this job has {job_world} processes. "
                          "Remove one_rank_gradient_fold or set it to \"auto\"")
    if isinstance(model, PipelineModule):
        raise ConfigError(f"{key} is not built for a PipelineModule; use one_rank_gradient_fold \"auto\"")
    stage = cfg.zero_optimization.stage
    if stage >= 2 and gradient_accumulation_steps > 1:
        raise ConfigError(
            f"{key} keeps gradients in param.grad, in the model's dtype, while ZeRO stage {stage} sums micro-batches "
            f"in fp32; with gradient_accumulation_steps {gradient_accumulation_steps} the sums would differ. Use "
            "gradient_accumulation_steps 1, ZeRO stage 0 or 1 (which accumulate in param.grad anyway), or "
            "one_rank_gradient_fold \"auto\"")
    if cfg.data_types.grad_accum_dtype == "fp32" and cfg.precision != "fp32":
        raise ConfigError(f"{key} keeps gradients in param.grad, in the model's dtype; data_types.grad_accum_dtype "
                          "\"fp32\" asks for fp32 sums. Remove one of the two")
