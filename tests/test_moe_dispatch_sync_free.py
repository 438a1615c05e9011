"""Capacity-mode dispatch without host synchronisation (partita/moe/dispatch.py).

The dispatch routes every (token, choice) pair, sending dropped ones to a dump row, instead of
selecting the kept pairs with a boolean mask (whose size must reach the host). These tests pin
that it is the masked dispatch bit for bit (outputs and every gradient) with many drops, and that
no op in its forward or backward needs a value on the host (a dispatch mode records every op).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from partita.moe import ExpertMLP
from partita.moe.dispatch import capacity_dispatch
from partita.moe.experts import Experts
from partita.moe.gating import route

HIDDEN, FFN, TOKENS, EXPERTS = 8, 16, 24, 4


def _masked_reference(x, routing, experts, capacity):
    """The masked selection this module used before (one rank): the behaviour to keep."""
    S, k = routing.experts.shape
    E = routing.num_experts
    kept = routing.kept & (routing.slots < capacity)
    tokens = torch.arange(S).unsqueeze(1).expand(S, k)[kept]
    dest = routing.experts[kept] * capacity + routing.slots[kept]
    buffer = x.new_zeros(E * capacity, x.shape[1]).index_add(0, dest, x[tokens])
    out = experts.forward_padded(buffer.view(E, capacity, -1)).reshape(E * capacity, -1)
    weights = routing.weights[kept].to(x.dtype).unsqueeze(1)
    return x.new_zeros(S, x.shape[1]).index_add(0, tokens, out[dest] * weights)


def _setup(k: int, seed: int = 0):
    torch.manual_seed(seed)
    experts = Experts(ExpertMLP(HIDDEN, FFN), num_local_experts=EXPERTS)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    # Skewed logits: most tokens want expert 0, so capacity drops many pairs.
    logits = torch.randn(TOKENS, EXPERTS) + torch.tensor([3.0, 0.0, 0.0, 0.0])
    logits.requires_grad_(True)
    return experts, x, logits


def _route(logits, k):
    return route(logits, k=k, capacity_factor=1.0, min_capacity=1, noisy_gate_policy=None, drop_tokens=True,
                 use_rts=False, top2_2nd_expert_sampling=False, drop_policy="position", router_z_loss_coef=0.0)


def _run(fn, k):
    experts, x, logits = _setup(k)
    routing = _route(logits, k)
    out = fn(x, routing, experts, routing.capacity)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [x.grad, logits.grad] + [p.grad for p in experts.parameters()]
    return out.detach(), grads, routing


@pytest.mark.parametrize("k", [1, 2, 3])
def test_equals_the_masked_dispatch_bit_for_bit(k):
    ref_out, ref_grads, routing = _run(_masked_reference, k)
    out, grads, _ = _run(lambda x, r, e, c: capacity_dispatch(x, r, e, capacity=c, ep_size=1, group=None), k)
    dropped = (~(routing.kept & (routing.slots < routing.capacity))).sum().item()
    assert dropped >= 3, "the case must drop pairs, or it tests nothing"
    assert torch.equal(out, ref_out)
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)


def test_a_dropped_token_gets_an_exact_zero_even_when_slot_zero_is_not_finite():
    # Dropped pairs read slot 0 of the expert outputs (any real slot would do) and are zeroed by
    # where(), not by their zero weight: NaN * 0 is NaN.
    experts, x, logits = _setup(1)
    routing = _route(logits, 1)
    kept = (routing.kept & (routing.slots < routing.capacity)).squeeze(1)
    assert (~kept).sum() >= 3
    at_slot_zero = int(torch.nonzero(kept & (routing.experts.squeeze(1) == 0) & (routing.slots.squeeze(1) == 0)))
    with torch.no_grad():
        x[at_slot_zero] = float("nan")
    out = capacity_dispatch(x, routing, experts, capacity=routing.capacity, ep_size=1, group=None)
    assert torch.isnan(out[at_slot_zero]).all()
    assert torch.equal(out[~kept], torch.zeros_like(out[~kept]))


class _HostSyncRecorder(TorchDispatchMode):
    """Records every op whose result needs a value on the host: a boolean-mask index (its size is
    the mask's count), nonzero, masked_select, .item()/int()."""

    SYNCING = {"aten::nonzero", "aten::masked_select", "aten::_local_scalar_dense", "aten::item"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        bool_index = name == "aten::index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []))
        if name in self.SYNCING or bool_index:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_no_host_synchronisation_in_forward_or_backward():
    experts, x, logits = _setup(2)
    routing = _route(logits, 2)
    with _HostSyncRecorder() as masked:
        _masked_reference(x, routing, experts, routing.capacity)
    assert masked.seen, "the recorder must see the masked dispatch's syncs, or it proves nothing"
    with _HostSyncRecorder() as recorder:
        out = capacity_dispatch(x, routing, experts, capacity=routing.capacity, ep_size=1, group=None)
        out.sum().backward()
    assert recorder.seen == []


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_capacity_mode_moe_layer_trains_without_host_synchronisation(k):
    # The gate too: F.one_hot checks its index range on the host, so the gates build one-hot masks
    # by scatter. (A CPU tensor's .tolist() reads memory without an op, so this recorder cannot
    # see it; the dispatch has none.)
    from tests.test_moe_reference import MoENet

    model = MoENet(num_experts=4, ep_size=1, k=k, drop_tokens=True)
    x = torch.randn(6, 3, 8)
    with _HostSyncRecorder() as recorder:
        out = model.moe(torch.tanh(model.inp(x)))
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    assert recorder.seen == []
