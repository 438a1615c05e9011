"""Zero bubble's deferred nn.Linear weight gradients (partita/pipe/weight_grads.py), in one process.

I (an ordinary backward) must leave every exact nn.Linear's weight and bias without a gradient and
give every other parameter its gradient; W (the builder's closure) must then produce exactly the
gradients one plain backward gives, accumulated over micro-batches in order. The pipeline parity
tests (tests/test_pipe_parity.py, test_pipe_compose.py) check the same end to end against torch.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from partita.pipe.weight_grads import DeferredLinearGrads


class _Scaled(nn.Linear):
    """A Linear subclass (LoRA-like wrappers are): left to autograd, not deferred."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6, bias=False), _Scaled(6, 5))


def test_w_gets_exactly_the_linear_gradients_that_i_left_out() -> None:
    reference, deferred = _model(), _model()
    store = DeferredLinearGrads()
    assert store.patch(deferred) == 2  # the two exact nn.Linear layers, not the subclass
    xs = [torch.randn(3, 4, 6) for _ in range(2)]
    for x in xs:
        reference(x).square().sum().backward()
    runners = []
    for x in xs:  # I of both micro-batches first, then their W (as zero bubble's cool-down does)
        inp = x.clone().requires_grad_(True)
        deferred(inp).square().sum().backward()
        runners.append(store.builder())
        assert deferred[1].weight.grad is None and deferred[1].bias.grad is None and deferred[3].weight.grad is None
        assert deferred[0].weight.grad is not None and deferred[4].weight.grad is not None
        assert inp.grad is not None
    assert store.pending == []
    for run in runners:
        run()
    for (name, want), got in zip(reference.named_parameters(), deferred.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_no_grad_and_clear() -> None:
    model = _model()
    plain = copy.deepcopy(model)
    store = DeferredLinearGrads()
    store.patch(model)
    x = torch.randn(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)  # forward unchanged, nothing kept
    model(x.requires_grad_(True)).sum().backward()
    assert len(store.pending) == 2
    store.clear()  # what torch's first-step metadata inference left behind
    store.builder()()
    assert model[1].weight.grad is None


def test_under_activation_checkpointing_the_gradient_reaches_the_parameter() -> None:
    # The recomputed forward's saved weight is a copy, not the parameter: W must still fill the parameter.
    from torch.utils.checkpoint import checkpoint

    reference, deferred = _model(), _model()
    store = DeferredLinearGrads()
    store.patch(deferred)
    x = torch.randn(3, 6)
    checkpoint(reference, x, use_reentrant=False).sum().backward()
    checkpoint(deferred, x.clone().requires_grad_(True), use_reentrant=False).sum().backward()
    store.builder()()
    for (name, want), got in zip(reference.named_parameters(), deferred.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7, msg=name)
