"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` with DeepSpeed's arguments, on torch's Adam.

DeepSpeed ships them as hand-written CUDA and AVX kernels. torch's own Adam computes the same
update (its fused kernel on CUDA and CPU, measured as fast as DeepSpeed's CPU Adam on this
project's CPUs, see GUIDE.md), so these are subclasses of ``torch.optim.Adam`` that accept
DeepSpeed's constructor: ``adam_w_mode`` / ``adamw_mode`` (default True) selects decoupled
weight decay (AdamW), as in DeepSpeed. Pass an instance to ``partita.initialize(optimizer=...)``;
its hyperparameters are kept and its parameters become the fp32 master partitions.

Not supported: ``bias_correction=False`` (torch's Adam always corrects) and DeepSpeed CPU Adam's
``fp32_optimizer_states=False`` (partita keeps optimizer states in fp32); both raise
NotImplementedError.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _refuse_unsupported(cls: str, *, bias_correction: bool) -> None:
    if not bias_correction:
        raise NotImplementedError(
            f"{cls}(bias_correction=False) is not supported: partita's Adam is torch's, which always applies bias "
            "correction; drop the argument"
        )


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad, set_grad_none)``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        _refuse_unsupported("FusedAdam", bias_correction=bias_correction)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adam_w_mode)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none  # torch's zero_grad sets None by default already


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
    adamw_mode, fp32_optimizer_states)``: where it steps follows partita's config (``offload_optimizer``)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        _refuse_unsupported("DeepSpeedCPUAdam", bias_correction=bias_correction)
        if not fp32_optimizer_states:
            raise NotImplementedError(
                "DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported: partita keeps optimizer states in "
                "fp32 next to the fp32 master weights; drop the argument"
            )
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adamw_mode)
        self.adam_w_mode = adamw_mode
