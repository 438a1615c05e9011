"""Zero bubble's weight gradients, deferred per ``nn.Linear`` instead of by torch's graph split.

The zero-bubble schedule runs each micro-batch's backward as two actions: I (the input gradient,
sent upstream at once) and W (the weight gradients, later, in a bubble). torch splits an ordinary
autograd graph for it (``stage_backward_input`` / ``stage_backward_weight``): one ``autograd.grad``
pass for the inputs with the graph retained, then one more pass per parameter group. Measured on
CPU that costs 1.10-1.17x one full backward (``benchmarks/results/pipeline_cpu_2026-12-04.md``),
which at 4 stages and 16 micro-batches is about what the schedule saves.

:class:`DeferredLinearGrads` does what the paper's implementation does (a weight-gradient store):
each ``nn.Linear`` of a stage runs through :class:`_DeferredLinear`, whose backward computes the
input gradient and keeps ``(input, output gradient)`` instead of the weight and bias gradients. I
is then one ordinary full backward (every other parameter, e.g. LayerNorm's, gets its gradient
there), and W computes the kept GEMMs. torch's ``PipelineStage`` takes this through its public
``dw_builder`` argument: called after each backward, it returns the closure the W action runs.

The gradients are the same products and sums as torch's linear backward (``g^T x``,
``g.sum(0)`` over the flattened leading dims), accumulated into ``param.grad`` in micro-batch
order like any other gradient. Only modules whose type is exactly ``nn.Linear`` with plain-tensor
parameters are deferred; subclasses (LoRA, tensor-parallel layers) keep autograd's gradient in I.
The first stage is left alone (:func:`partita.pipe.schedule.build_stages`): it sends no input
gradient, and torch already runs its whole backward as one pass in W.

Measured in one process on the pipeline benchmark's blocks (``benchmarks/pipeline_timeline_split_cost.py``):
I + W = 0.97-1.00x one full backward, against 1.14-1.16x for torch's split. Inside the 2-stage
CPU pipeline benchmark, though, its steps were 1.2x slower than torch's split (not diagnosed), so
it is opt-in: ``pipeline.zero_bubble_weight_split "linear"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["DeferredLinearGrads"]


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns only the input gradient and keeps the rest for W."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                store: "DeferredLinearGrads") -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.store = store
        # The parameters themselves, for W: what saved_tensors gives back is not them under activation
        # checkpointing (the recomputed copy), and a gradient set on that would be lost.
        ctx.params = (weight, bias)
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        param_weight, param_bias = ctx.params
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            ctx.store.pending.append((param_weight if ctx.needs_input_grad[1] else None,
                                      param_bias if ctx.needs_input_grad[2] else None, x, grad))
        return grad_x, None, None, None


def _accumulate(param: torch.Tensor, value: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = value
    else:
        param.grad += value


class DeferredLinearGrads:
    """One stage's store: ``patch(module)`` routes its ``nn.Linear`` layers through the store,
    ``builder`` is the stage's ``dw_builder``, ``clear`` drops what a backward outside the
    schedule's actions left (torch's metadata inference at the first step)."""

    def __init__(self) -> None:
        self.pending: list[tuple] = []
        self.layers = 0

    def patch(self, module: nn.Module) -> int:
        """Defer the weight gradients of every exact ``nn.Linear`` in ``module``; returns how many."""
        for layer in module.modules():
            if type(layer) is nn.Linear and all(type(p) in (torch.Tensor, nn.Parameter) for p in layer.parameters()):
                layer.forward = self._forward(layer)
                self.layers += 1
        return self.layers

    def _forward(self, layer: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        store = self

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not (torch.is_grad_enabled() and layer.weight.requires_grad):
                return nn.functional.linear(x, layer.weight, layer.bias)
            return _DeferredLinear.apply(x, layer.weight, layer.bias, store)

        return forward

    def clear(self) -> None:
        self.pending = []

    def builder(self) -> Callable[[], None]:
        """The W closure of the backward that just ran: its kept GEMMs, accumulated on call."""
        items, self.pending = self.pending, []

        def weight_gradients() -> None:
            for weight, bias, x, grad in items:
                g2 = grad.reshape(-1, grad.shape[-1])
                if weight is not None:
                    # torch's linear backward for the (out, in) weight: g^T x over the flattened leading dims
                    _accumulate(weight, g2.t().mm(x.reshape(-1, x.shape[-1])))
                if bias is not None:
                    _accumulate(bias, g2.sum(0))

        return weight_gradients
