"""Lion optimizer (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

Why our own: torch.optim has no Lion, and DeepSpeed's config accepts ``"type": "Lion"``
(its FusedLion is a CUDA extension). The update is a handful of elementwise ops, so torch's
multi-tensor ``_foreach`` kernels give a fast, device-agnostic implementation without a
compiled extension.

Per step, for each parameter ``p`` with gradient ``g`` and momentum ``m``::

    update = sign(beta1 * m + (1 - beta1) * g)
    p      = p - lr * (update + weight_decay * p)      # decoupled weight decay
    m      = beta2 * m + (1 - beta2) * g

Lion keeps one state tensor per parameter (``exp_avg``, the momentum ``m``), half of
Adam's optimizer memory. The state dict follows torch.optim conventions (``state[p] =
{"exp_avg": tensor}``; groups carry ``lr``, ``betas``, ``weight_decay``, ``foreach``), so
torch's ``state_dict``/``load_state_dict`` and the ZeRO sharded optimizer handle it like
any torch optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion with decoupled weight decay.

    Args:
        params: parameters or param-group dicts, as for any torch optimizer.
        lr: learning rate. The paper's default 1e-4: Lion's sign update has unit magnitude
            per element, so it wants a 3-10x smaller lr than AdamW.
        betas: (beta1, beta2): interpolation for the update direction and momentum decay.
        weight_decay: decoupled weight decay; the paper uses 3-10x AdamW's value.
        foreach: use the multi-tensor kernels (default) or a per-tensor loop.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        foreach: bool = True,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Lion lr must be >= 0, got {lr}")
        for index, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Lion betas[{index}] must be in [0, 1), got {beta}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Lion weight_decay must be >= 0, got {weight_decay}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "weight_decay": weight_decay,
            "foreach": foreach,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs = self._collect(group)
            if not params:
                continue
            kernel = _lion_foreach if group["foreach"] else _lion_loop
            beta1, beta2 = group["betas"]
            kernel(
                params,
                grads,
                exp_avgs,
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
            )
        return loss

    def _collect(
        self, group: dict[str, Any]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        params, grads, exp_avgs = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise NotImplementedError("Lion does not support sparse gradients")
            state = self.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
        return params, grads, exp_avgs


def _lion_foreach(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    # Decay first: the paper's p - lr * wd * p uses p before the sign update.
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    update = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(update, grads, alpha=1.0 - beta1)
    torch._foreach_sign_(update)
    torch._foreach_add_(params, update, alpha=-lr)
    torch._foreach_mul_(exp_avgs, beta2)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta2)


def _lion_loop(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    # Same arithmetic as _lion_foreach, one tensor at a time (bit-identical results).
    for p, g, m in zip(params, grads, exp_avgs):
        if weight_decay != 0.0:
            p.mul_(1.0 - lr * weight_decay)
        update = m.mul(beta1).add_(g, alpha=1.0 - beta1).sign_()
        p.add_(update, alpha=-lr)
        m.mul_(beta2).add_(g, alpha=1.0 - beta2)
