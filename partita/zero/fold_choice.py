"""``zero_optimization.one_rank_gradient_fold "auto"`` at ``initialize``: stream, early or end.

On one process the reducer has nothing to communicate, so it can fold each gradient into the
fp32 partition as soon as autograd makes it ("early", freeing ``param.grad``), hold every
``param.grad`` and fold them after backward ("end"), or never build the partition and let the
optimizer step read ``param.grad`` itself ("stream", streamed_step.py). The values are the same
(with "stream", up to the last bits of an active clip coefficient); the peaks differ:

- early: the partition (4 bytes per parameter) exists from the first gradient, beside whatever
  activations backward has not freed yet;
- end: the full-size gradients (2 bytes per parameter in bf16) grow as backward frees
  activations, and the partition joins them only at the end (4 + 2 bytes per parameter then);
  at stages 0-2 each block's 16-bit weights are freed again after its backward
  (one_rank_weights.py [Note: freed again after the unit's backward]);
- stream: the full-size gradients as with end (the blocks' weights back for good before their
  backward, as with early), never a partition. At no point does it hold more than early (the
  step's fp32 buffer is one 64 MiB range), so "auto" takes it wherever it applies, for any model:
  one process, no offload, torch's fused Adam/AdamW or a block-wise 8-bit optimizer, no fp32
  accumulation, and accumulation only at stages 0-1. Measured on one H200 (benchmarks/results/2026-12-01-report.md):
  GPT-1.3B micro-batch 1 20.05 GiB at ZeRO-1/2 (19.14 at ZeRO-3) against early's 23.30, end's
  22.32 and FSDP2's 20.24, at early's tokens/s; GPT-6.7B ZeRO-3 checkpointed 88.04 against 101.38
  and FSDP2's 100.81.

Where stream does not apply: at ZeRO-3 with checkpointing early is lower (GPT-6.7B,
checkpointed: 10 GiB lower on one H200); with small micro-batches end is (GPT-1.3B, ZeRO-2,
micro-batch 2: 23.6 against 26.5 GiB by the estimate; measured on one H200 23.31 against 26.34,
FSDP2's 23.31). "auto" asks partita's estimator for both peaks, which it models block by block
for partita's GPT, and takes end only where it is lower by at least ``END_MIN_SAVING`` of early's:
end costs time where the step is bound by Python, not the GPU (the second cast of every block's
weights and the fold after backward run per parameter: GPT-1.3B, ZeRO-2, micro-batch 1 on one
H200, 4-15% fewer tokens/s than early on two machines for 22.32 against 23.30 GiB; micro-batch 2,
45.5k against 47.0k for 3 GiB less). Every other model gets early.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch import nn

from partita.estimate.core import estimate_memory
from partita.estimate.inputs import Setup
from partita.offload.auto_placement import client_optimizer_name, model_info_for
# The streamed step's rule is shared with the estimator, so it lives below both; re-exported here.
from partita.zero.stream_eligibility import auto_streams, check_streamed_step

__all__ = ["auto_streams", "check_streamed_step", "resolve_gradient_fold"]

logger = logging.getLogger(__name__)

END_MIN_SAVING = 0.05
"""The fraction of early's estimated peak that end must save to be chosen (see the docstring)."""


def resolve_gradient_fold(
    cfg: Any, model: nn.Module, param_groups: list[dict], *, world_size: int, client_optimizer: Any = None,
    gradient_accumulation_steps: int = 1, device_type: str = "cpu",
) -> Any:
    """``cfg`` with ``one_rank_gradient_fold`` "auto" decided ("stream", "early" or "end"); "stream"
    checked against what it needs (:func:`check_streamed_step`). ``device_type``: where the
    optimizer steps (whether torch has a fused Adam kernel there)."""
    zero = cfg.zero_optimization
    job_world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if zero.one_rank_gradient_fold == "stream":
        check_streamed_step(cfg, model, job_world=job_world, gradient_accumulation_steps=gradient_accumulation_steps)
    if zero.one_rank_gradient_fold != "auto":
        return cfg
    choice = "early"
    if world_size == 1 and auto_streams(cfg, model, job_world=job_world, gradient_accumulation_steps=gradient_accumulation_steps,
                                        client_optimizer=client_optimizer, device_type=device_type):
        choice = "stream"
        logger.info("one_rank_gradient_fold \"auto\" chose \"stream\": no fp32 gradient partition")
    elif world_size == 1 and job_world == 1 and not zero.offload_optimizer.enabled:
        peaks = _peaks(cfg, model, param_groups, client_optimizer)
        if peaks is not None and peaks["end"] <= (1 - END_MIN_SAVING) * peaks["early"]:
            choice = "end"
            logger.info("one_rank_gradient_fold \"auto\" chose \"end\": estimated peak %.2f GiB against %.2f GiB "
                        "folding each gradient as it arrives", peaks["end"] / 2**30, peaks["early"] / 2**30)
    return cfg.model_copy(update={"zero_optimization": zero.model_copy(update={"one_rank_gradient_fold": choice})})


def _peaks(cfg: Any, model: nn.Module, param_groups: list[dict], client_optimizer: Any) -> dict[str, int] | None:
    """Estimated accelerator peaks of both rules, or None where the estimator has no walk of backward."""
    try:
        info = model_info_for(model, param_groups, None)
        if info.gpt is None:
            return None
        extra = {}
        if cfg.optimizer is None and client_optimizer is not None:
            extra["optimizer"] = client_optimizer_name(client_optimizer)
        setup = Setup.from_config(cfg, world_size=1, **extra)
        return {rule: estimate_memory(info, setup.replace(fold_gradients_at_end=rule == "end",
                                                          streamed_step=False)).peak_accelerator
                for rule in ("early", "end")}
    except Exception as error:  # noqa: BLE001 - the choice must never stop a run; early is the safe default
        logger.info("one_rank_gradient_fold \"auto\": kept \"early\" (the estimator cannot size this setup: %s)", error)
        return None
