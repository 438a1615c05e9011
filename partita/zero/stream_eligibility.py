"""Whether ZeRO's streamed step (streamed_step.py) applies to a config: the rule that
``one_rank_gradient_fold "stream"`` is checked against and that "auto" takes "stream" by.

Two layers ask it: ``initialize`` (:mod:`partita.zero.fold_choice`, which also weighs "early"
against "end" with the estimator) and the estimator itself (``Setup.from_config`` predicts what
initialize will choose). The rule reads only the config, the model's type and the optimizer, so it
lives here, below both, and imports nothing of the estimator.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from partita.config.base import ConfigError
from partita.optim.factory import fused_adam_supported
from partita.pipe.module import PipelineModule
from partita.zero.streamed_step import STREAMABLE_EIGHT_BIT, streamable_optimizer

__all__ = ["auto_streams", "check_streamed_step"]


def check_streamed_step(cfg: Any, model: nn.Module, *, job_world: int, gradient_accumulation_steps: int) -> None:
    """Refuse ``one_rank_gradient_fold "stream"`` where the streamed step (streamed_step.py) does not
    apply, naming the fix (the optimizer's fused kernel is checked once it is built, in apply_zero)."""
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


def auto_streams(cfg: Any, model: nn.Module | None, *, job_world: int, gradient_accumulation_steps: int,
                 client_optimizer: Any = None, device_type: str = "cuda", assume_fused_kernel: bool = False) -> bool:
    """Whether "auto" takes "stream": what :func:`check_streamed_step` asks, nothing offloaded, and
    an optimizer the streamed step drives: torch's fused Adam/AdamW (``assume_fused_kernel``: the estimator's
    view of an accelerator, where torch has the kernel, instead of probing ``device_type``) or a
    block-wise 8-bit one (streamed_step.STREAMABLE_EIGHT_BIT)."""
    zero = cfg.zero_optimization
    if zero.offload_optimizer.enabled or zero.offload_param.enabled:
        return False
    try:
        check_streamed_step(cfg, model, job_world=job_world, gradient_accumulation_steps=gradient_accumulation_steps)
    except ConfigError:
        return False
    if client_optimizer is not None:
        # A torch optimizer is kept as it is (bootstrap._inner_optimizer_factory); a callable builds
        # an optimizer not known until then.
        return isinstance(client_optimizer, torch.optim.Optimizer) and streamable_optimizer(client_optimizer)
    optimizer = cfg.optimizer
    if optimizer is not None and optimizer.type in STREAMABLE_EIGHT_BIT:
        return True
    if optimizer is None or optimizer.type not in ("Adam", "AdamW"):
        return False
    fused = getattr(optimizer.params, "fused", None)
    if fused is None:
        return assume_fused_kernel or fused_adam_supported(device_type)  # what optim.factory._build_adam decides
    return bool(fused)
