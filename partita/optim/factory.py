"""Build the torch optimizer an ``optimizer`` config section describes.

Adam, AdamW and SGD are torch's own: its fused Adam/AdamW kernels run on CUDA and (since
torch 2.4) on CPU as fast as DeepSpeed's hand-written CPU Adam, so there is nothing to gain
from a custom kernel. Lion is ours (torch has none, see :mod:`partita.optim.lion`). The
8-bit types come from bitsandbytes (:mod:`partita.optim.eight_bit` says why).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from partita.optim.config import (AdamParams, LionParams, OneBitAdamParams, OneBitLambParams, OptimizerConfig, SGDParams,
                                  ZeroOneAdamParams)
from partita.optim.eight_bit import BLOCK_SIZE, EIGHT_BIT_CLASSES, build_eight_bit_optimizer
from partita.optim.lion import Lion

__all__ = ["build_optimizer", "fused_adam_supported", "required_alignment"]


def required_alignment(config: OptimizerConfig | None) -> int:
    """Elements every ZeRO shard must be a multiple of for this optimizer (``ShardLayout`` alignment).

    8-bit optimizers quantise their states in blocks of 256 elements of the flat partition;
    with shards of whole blocks a block never spans two parameters and the result does not
    depend on the world size. Element-wise optimizers need no alignment (1).
    """
    if config is not None and config.type in EIGHT_BIT_CLASSES:
        return BLOCK_SIZE
    return 1


@functools.cache
def fused_adam_supported(device_type: str) -> bool:
    """Whether this torch has a fused Adam/AdamW kernel for ``device_type``.

    Probed by running one fused step on a one-element tensor, because the set of devices
    (and torch versions) with fused kernels is only exposed through private helpers.
    """
    try:
        probe = torch.zeros(1, device=device_type, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        torch.optim.AdamW([probe], fused=True).step()
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        return False
    return True


def build_optimizer(
    config: OptimizerConfig, param_groups: list[dict[str, Any]], *, device_type: str
) -> torch.optim.Optimizer:
    """Construct the optimizer for ``param_groups`` on a ``device_type`` device.

    Args:
        config: the validated ``optimizer`` section; its params are the defaults.
        param_groups: ``[{"params": [tensor, ...], <per-group overrides>}, ...]``. Keys a
            group sets (``lr``, ``weight_decay``, ``betas``, ...) win over the config.
            The dicts are copied, never modified.
        device_type: ``"cuda"``, ``"cpu"``, ...: where the parameters (for ZeRO, the fp32
            master shards) live; decides whether the fused Adam kernel is used.

    DeepSpeed's ``"Adam"`` is AdamW (decoupled weight decay) unless ``adam_w_mode`` is
    false, in which case it is classic Adam with L2 weight decay added to the gradient.
    """
    groups = _copy_groups(param_groups)
    params = config.params
    if config.type in EIGHT_BIT_CLASSES:  # before the isinstance checks: Lion8bit has LionParams
        return build_eight_bit_optimizer(config.type, params, groups)
    if isinstance(params, OneBitAdamParams):
        from partita.optim.onebit import OneBitAdam  # lazily: it imports partita.zero

        return OneBitAdam(groups, lr=params.lr, betas=params.betas, eps=params.eps,
                          weight_decay=params.weight_decay, freeze_step=params.freeze_step)
    if isinstance(params, ZeroOneAdamParams):
        from partita.optim.zero_one_adam import ZeroOneAdam  # lazily: it imports partita.zero

        return ZeroOneAdam(groups, lr=params.lr, betas=params.betas, eps=params.eps, weight_decay=params.weight_decay,
                           var_freeze_step=params.var_freeze_step, var_update_scaler=params.var_update_scaler,
                           local_step_scaler=params.local_step_scaler, local_step_clipper=params.local_step_clipper)
    if isinstance(params, OneBitLambParams):
        from partita.optim.onebit_lamb import OneBitLamb  # lazily: it imports partita.zero

        return OneBitLamb(groups, lr=params.lr, betas=params.betas, eps=params.eps, weight_decay=params.weight_decay,
                          freeze_step=params.freeze_step, max_coeff=params.max_coeff, min_coeff=params.min_coeff,
                          coeff_beta=params.coeff_beta, factor_max=params.factor_max, factor_min=params.factor_min,
                          factor_threshold=params.factor_threshold)
    if isinstance(params, AdamParams):  # covers AdamWParams
        return _build_adam(config.type, params, groups, device_type=device_type)
    if isinstance(params, SGDParams):
        return torch.optim.SGD(
            groups,
            lr=params.lr,
            momentum=params.momentum,
            dampening=params.dampening,
            weight_decay=params.weight_decay,
            nesterov=params.nesterov,
        )
    if isinstance(params, LionParams):
        return Lion(groups, lr=params.lr, betas=params.betas, weight_decay=params.weight_decay)
    raise NotImplementedError(f"no optimizer builder for type {config.type!r}")


def _build_adam(
    kind: str, params: AdamParams, groups: list[dict[str, Any]], *, device_type: str
) -> torch.optim.Optimizer:
    decoupled = kind == "AdamW" or params.adam_w_mode
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    fused = params.fused
    if fused is None:
        fused = fused_adam_supported(device_type)
    elif fused and not fused_adam_supported(device_type):
        raise NotImplementedError(
            f"optimizer.params.fused=true, but torch {torch.__version__} has no fused "
            f"{cls.__name__} kernel for device {device_type!r}; remove 'fused' (partita then "
            "picks the fastest available kernel) or set it to false"
        )
    return cls(
        groups,
        lr=params.lr,
        betas=params.betas,
        eps=params.eps,
        weight_decay=params.weight_decay,
        amsgrad=params.amsgrad,
        # Unfused: foreach=None lets torch use its multi-tensor kernels where it has them.
        fused=fused or None,
    )


def _copy_groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(param_groups, dict) or not isinstance(param_groups, (list, tuple)):
        raise TypeError(
            "param_groups must be a list of dicts like [{'params': [...]}], got "
            f"{type(param_groups).__name__}"
        )
    groups = []
    for index, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(
                f"param_groups[{index}] must be a dict with a 'params' key, got {group!r}"
            )
        group = dict(group)
        if "betas" in group:
            # JSON-style lists become the tuples torch's optimizers store.
            group["betas"] = tuple(group["betas"])
        groups.append(group)
    return groups
