"""One range of a flat fp32 master stepped by torch's fused Adam/AdamW kernel, with the state
torch's own ``Adam`` keeps for the whole master.

The streamed step (partita/zero/streamed_step.py) walks a master in ranges, its gradients cast
from ``param.grad`` range by range, instead of calling the optimizer once over it. It calls the
kernel through torch's functional ``torch.optim.adam.adam(fused=True)`` on views of
``inner.state[master]``, so the state stays torch's (checkpoints load under any step rule) and
each element's update is bitwise the whole-master call's when ranges start at multiples of a
power of two (see [Note: the streamed step]).

Why our own code: torch steps whole parameters only; it has no call for a range of one.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

__all__ = ["adam_state", "fused_adam_optimizer", "step_adam_range"]


def fused_adam_optimizer(inner: torch.optim.Optimizer) -> bool:
    """Whether ``inner`` is torch's Adam or AdamW with the fused kernel in every group."""
    return type(inner) in (torch.optim.Adam, torch.optim.AdamW) and all(g.get("fused") for g in inner.param_groups)


def _scalar_dtype() -> torch.dtype:
    """The dtype torch's fused Adam keeps ``state["step"]`` in (``Adam._init_group``)."""
    try:
        from torch.optim.optimizer import _get_scalar_dtype

        return _get_scalar_dtype(is_fused=True)
    except (ImportError, TypeError):  # private helper; its rule: float32 unless the default is float64
        return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def adam_state(inner: torch.optim.Optimizer, master: torch.Tensor, options: dict) -> dict:
    """torch's state of ``master``, created as ``Adam._init_group`` does on its first step."""
    state = inner.state[master]
    if not state:
        state["step"] = torch.zeros((), dtype=_scalar_dtype(), device=master.device)
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        if options["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return state


def step_adam_range(inner: torch.optim.Optimizer, options: dict, master: torch.Tensor, lo: int, hi: int,
                    grad: torch.Tensor, step_before: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
    """Step master elements ``[lo, hi)`` with the fp32 ``grad`` of that range.

    ``options``: the group's options (lr, betas, ...) as they were when the step began;
    ``step_before``: the group's step count before this step (the kernel adds one to a copy, so
    every range steps with the group's next count; the caller counts the step once per group);
    ``grad_scale``: the unscale + clip divisor the fused kernel applies, or None.
    """
    state = inner.state[master]
    amsgrad = options["amsgrad"]
    adam(
        [master[lo:hi]], [grad], [state["exp_avg"][lo:hi]], [state["exp_avg_sq"][lo:hi]],
        [state["max_exp_avg_sq"][lo:hi]] if amsgrad else [], [step_before.clone()],
        capturable=options["capturable"], differentiable=False, fused=True, grad_scale=grad_scale,
        found_inf=None, has_complex=False,
        decoupled_weight_decay=options.get("decoupled_weight_decay", isinstance(inner, torch.optim.AdamW)),
        amsgrad=amsgrad, beta1=options["betas"][0], beta2=options["betas"][1], lr=options["lr"],
        weight_decay=options["weight_decay"], eps=options["eps"], maximize=options["maximize"],
    )
