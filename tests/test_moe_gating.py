"""MoE routing on one process: gates and aux loss on hand-computed inputs, capacity dropping,
dropless and capacity layers against explicit per-token routing, shared experts, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partita.moe import ExpertMLP, MoE, is_moe_param, split_params_into_different_moe_groups_for_optimizer
from partita.moe.gating import capacity_for, top1_gating, top2_gating, topk_gating, z_loss
from tests.test_moe_reference import D, FFN, expert_weights, reference_moe

# 6 tokens, 3 experts. Argmax experts: 0, 0, 0, 1, 2, 0.
LOGITS = torch.tensor([
    [2.0, 1.0, 0.0],
    [3.0, 0.0, 1.0],
    [1.0, 0.5, 0.2],
    [0.0, 2.0, 1.0],
    [0.0, 1.0, 3.0],
    [4.0, 3.0, 0.0],
])


def test_capacity_rule() -> None:
    assert capacity_for(6, 3, 1.0, 1) == 2
    assert capacity_for(7, 3, 1.0, 1) == 3  # ceil(7/3)
    assert capacity_for(6, 3, 0.5, 4) == 4  # min_capacity wins


def test_top1_positional_dropping_and_aux_loss() -> None:
    r = top1_gating(LOGITS, capacity_factor=1.0, min_capacity=1, use_rts=False)
    probs = torch.softmax(LOGITS, dim=1)
    assert r.capacity == 2
    assert r.experts[:, 0].tolist() == [0, 0, 0, 1, 2, 0]
    # Expert 0 gets tokens 0, 1, 2, 5: only the first two fit.
    assert r.kept[:, 0].tolist() == [True, True, False, True, True, False]
    assert r.slots[:, 0].tolist()[:2] == [0, 1] and r.slots[3, 0] == 0 and r.slots[4, 0] == 0
    expected_w = probs[torch.arange(6), r.experts[:, 0]] * r.kept[:, 0]
    assert torch.equal(r.weights[:, 0], expected_w)  # not renormalised
    assert r.exp_counts.tolist() == [4, 1, 1]  # before dropping (DeepSpeed's exp_counts)
    # GShard: E * sum_e mean_prob_e * fraction_e
    me = probs.mean(dim=0)
    ce = torch.tensor([4, 1, 1]) / 6
    assert torch.allclose(r.l_aux, 3 * (me * ce).sum())
    combine = r.combine_weights()
    assert combine.shape == (6, 3, 2)
    assert combine[0, 0, 0] == expected_w[0] and combine[1, 0, 1] == expected_w[1] and combine[2].sum() == 0
    assert r.dropped_fraction() == pytest.approx(2 / 6)


def test_top1_random_token_selection_keeps_capacity_per_expert() -> None:
    gen = torch.Generator().manual_seed(0)
    r = top1_gating(LOGITS, capacity_factor=1.0, min_capacity=1, use_rts=True, generator=gen)
    kept_of_0 = [s for s in range(6) if r.experts[s, 0] == 0 and r.kept[s, 0]]
    assert len(kept_of_0) == 2 and set(kept_of_0) <= {0, 1, 2, 5}
    assert sorted(r.slots[kept_of_0, 0].tolist()) == [0, 1]  # slots are distinct and within capacity


def test_top2_second_choices_queue_behind_first_choices() -> None:
    r = top2_gating(LOGITS, capacity_factor=0.5, min_capacity=1, top2_2nd_expert_sampling=False)
    probs = torch.softmax(LOGITS, dim=1)
    assert r.capacity == 2  # ceil(6 / 3 * 0.5 * 2)
    assert r.experts.tolist() == [[0, 1], [0, 2], [0, 1], [1, 2], [2, 1], [0, 1]]
    # Expert 0: firsts of tokens 0, 1 kept, 2 and 5 dropped. Expert 1: first of token 3 (slot 0),
    # then seconds in token order 0 (slot 1), 2, 4, 5 (dropped). Expert 2: first of 4, second of 1.
    assert r.kept.tolist() == [[True, True], [True, True], [False, False], [True, False], [True, False], [False, False]]
    assert r.slots[0].tolist() == [0, 1] and r.slots[1].tolist() == [1, 1] and r.slots[3, 0] == 0
    # Renormalised over the kept choices: a token whose second was dropped weighs its first by 1.
    p = probs
    assert torch.allclose(r.weights[0], torch.stack([p[0, 0], p[0, 1]]) / (p[0, 0] + p[0, 1]))
    assert r.weights[3].tolist() == [1.0, 0.0]
    assert r.weights[2].tolist() == [0.0, 0.0]
    assert r.exp_counts.tolist() == [4, 5, 3]
    ce1 = torch.tensor([4, 1, 1]) / 6
    assert torch.allclose(r.l_aux, (p.mean(0) * ce1).mean() * 9)


def test_topk_drop_policies() -> None:
    probs = torch.softmax(LOGITS, dim=1)
    by_probs = topk_gating(LOGITS, k=3, capacity_factor=1 / 3, min_capacity=1, drop_policy="probs")
    assert by_probs.capacity == 2
    for e in range(3):  # each expert keeps its two highest-probability tokens
        kept_tokens = sorted(s for s in range(6) for c in range(3) if by_probs.experts[s, c] == e and by_probs.kept[s, c])
        assert kept_tokens == sorted(torch.topk(probs[:, e], 2).indices.tolist()), e
    by_position = topk_gating(LOGITS, k=3, capacity_factor=1 / 3, min_capacity=1, drop_policy="position")
    kept = {(s, int(by_position.experts[s, c])) for s in range(6) for c in range(3) if by_position.kept[s, c]}
    assert kept == {(0, e) for e in range(3)} | {(1, e) for e in range(3)}  # the first two tokens fill every expert
    full = topk_gating(LOGITS, k=2, capacity_factor=10.0, min_capacity=1)
    w = probs.gather(1, full.experts)
    assert torch.allclose(full.weights, w / w.sum(1, keepdim=True))
    mask = torch.zeros(6, 3).scatter_(1, full.experts, 1)
    assert torch.allclose(full.l_aux, (probs.mean(0) * mask.mean(0)).mean() * 9 / 2)


def test_router_z_loss() -> None:
    assert torch.allclose(z_loss(LOGITS), torch.logsumexp(LOGITS, 1).square().mean())
    m = _layer(k=1, drop_tokens=False, router_z_loss_coef=0.1)
    x = torch.randn(5, D)
    _, with_z, _ = m(x)
    m.gate.router_z_loss_coef = 0.0  # the routing options live on the gate, as in DeepSpeed
    _, without, _ = m(x)
    logits = x @ m.gate.wg.weight.t()
    assert torch.allclose(with_z - without, 0.1 * torch.logsumexp(logits, 1).square().mean())


def _layer(*, k: int, drop_tokens: bool, expert: nn.Module | None = None, **kw) -> MoE:
    torch.manual_seed(0)
    m = MoE(D, expert or ExpertMLP(D, FFN), num_experts=4, k=k, drop_tokens=drop_tokens, use_rts=False,
            top2_2nd_expert_sampling=False, **kw)
    rename = {"fc1": "0", "fc2": "2"} if isinstance(expert, nn.Sequential) else {"fc1": "fc1", "fc2": "fc2"}
    with torch.no_grad():
        for name, value in expert_weights(4).items():
            layer, kind = name.split(".")
            for j, param in enumerate(m.experts.expert_params(f"{rename[layer]}.{kind}")):
                param.copy_(value[j])
    return m


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("path", ["grouped", "loop", "generic"])
def test_dropless_matches_per_token_reference(k: int, path: str, monkeypatch) -> None:
    if path == "loop":
        monkeypatch.setattr("partita.moe.experts.grouped_mm_available", lambda device, dtype: False)
    expert = nn.Sequential(nn.Linear(D, FFN), nn.GELU(), nn.Linear(FFN, D)) if path == "generic" else None
    m = _layer(k=k, drop_tokens=False, expert=expert)
    if path == "generic":  # run the Sequential through each expert's own forward, as any other expert module
        m.experts._mlp = None
    assert m.experts.uses_grouped_mm == (path == "grouped")
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out, l_aux, counts = m(x)
    experts = {n: p.detach().clone().requires_grad_() for n, p in expert_weights(4).items()}
    x_ref = x.detach().clone().requires_grad_()
    ref_out, ref_aux = reference_moe(x_ref.reshape(-1, D), m.gate.wg.weight, experts, k)
    assert torch.allclose(out.reshape(-1, D), ref_out, atol=1e-6)
    assert torch.allclose(l_aux, ref_aux, atol=1e-6)
    assert int(counts.sum()) == 10 * k
    g = torch.randn_like(ref_out)
    (out.reshape(-1, D) * g).sum().backward()
    (ref_out * g).sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-6)
    names = {"grouped": ("fc1", "fc2"), "loop": ("fc1", "fc2"), "generic": ("0", "2")}[path]
    for mine, ref in zip(names, ("fc1", "fc2")):
        grad = torch.stack([p.grad for p in m.experts.expert_params(f"{mine}.weight")])
        assert torch.allclose(grad, experts[f"{ref}.weight"].grad, atol=1e-6)


def test_capacity_mode_drops_exactly_the_rule() -> None:
    """Top-1, capacity 2 per expert: the output of a dropped token is zero (no residual), the
    others equal the reference; an expert that got no token still has a (zero) gradient."""
    m = _layer(k=1, drop_tokens=True, capacity_factor=0.5, min_capacity=2)
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        m.gate.wg.weight.zero_()
        m.gate.wg.weight[1, 0] = 5.0  # tokens with x[:, 0] > 0 pick expert 1, the rest tie -> expert 0
    out, _, counts = m(x)
    to_1 = (x[:, 0] > 0).nonzero().flatten().tolist()
    to_0 = (x[:, 0] <= 0).nonzero().flatten().tolist()
    assert counts.tolist() == [len(to_0), len(to_1), 0, 0]
    kept = set(to_0[:2]) | set(to_1[:2])  # positional: the first two of each expert
    ref, _ = reference_moe(x, m.gate.wg.weight.detach(), expert_weights(4), 1)
    for s in range(8):
        expected = ref[s] if s in kept else torch.zeros(D)
        assert torch.allclose(out[s], expected, atol=1e-6), s
    out.sum().backward()
    grad = torch.stack([p.grad for p in m.experts.expert_params("fc1.weight")])
    assert grad is not None and grad[2:].abs().sum() == 0 and grad[:2].abs().sum() > 0
    assert m.take_routing_stats().dropped_fraction == pytest.approx((8 - len(kept)) / 8)


def test_residual_and_shared_experts() -> None:
    m = _layer(k=1, drop_tokens=False, use_residual=True, num_shared_experts=2)
    x = torch.randn(5, D)
    out, _, _ = m(x)
    m2 = _layer(k=1, drop_tokens=False)
    routed, _, _ = m2(x)
    shared = m.shared_experts
    shared_out = sum(
        F.linear(F.gelu(F.linear(x, shared.stacked("fc1.weight")[j], shared.stacked("fc1.bias")[j])),
                 shared.stacked("fc2.weight")[j], shared.stacked("fc2.bias")[j]) for j in range(2))
    mlp = m.mlp  # the expert module itself, as DeepSpeed's residual MoE
    assert type(mlp) is ExpertMLP
    dense = F.linear(F.gelu(F.linear(x, mlp.fc1.weight, mlp.fc1.bias)), mlp.fc2.weight, mlp.fc2.bias)
    coef = torch.softmax(m.coefficient(x), dim=-1)
    assert torch.allclose(out, (routed + shared_out) * coef[:, :1] + dense * coef[:, 1:], atol=1e-6)
    # Only the routed experts are expert (MoE) parameters; shared and residual ones are dense.
    assert all(is_moe_param(p) for p in m.experts.parameters())
    assert not any(is_moe_param(p) for p in [*m.shared_experts.parameters(), *m.mlp.parameters(), m.gate.wg.weight])


def test_split_params_into_moe_groups() -> None:
    m = _layer(k=1, drop_tokens=False)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(m.parameters()), "lr": 0.5})
    assert len(groups) == 2
    assert groups[0]["lr"] == 0.5 and "moe" not in groups[0] and groups[0]["params"] == [m.gate.wg.weight]
    assert groups[1] == {"params": list(m.experts.parameters()), "lr": 0.5, "name": "ep_size_1", "moe": True}
    cut = split_params_into_different_moe_groups_for_optimizer([{"params": list(m.parameters())}], max_group_size=600)
    # Per-expert parameters of 128 + 16 + 128 + 8 = 280 elements each: two experts, then the next group.
    assert [len(g["params"]) for g in cut[1:]] == [8, 8]
    assert not hasattr(m.experts.deepspeed_experts[0].fc1.weight, "allreduce")  # nothing bolted onto the parameter


def test_construction_errors() -> None:
    expert = ExpertMLP(D, FFN)
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by ep_size=4"):
        MoE(D, expert, num_experts=6, ep_size=4)
    with pytest.raises(ValueError, match=r"k=5 must be between 1 and num_experts=4"):
        MoE(D, expert, num_experts=4, k=5)
    with pytest.raises(ValueError, match=r"noisy_gate_policy='Gaussian'"):
        MoE(D, expert, num_experts=4, noisy_gate_policy="Gaussian")
    with pytest.raises(NotImplementedError, match="use_tutel"):
        MoE(D, expert, num_experts=4, use_tutel=True)
    with pytest.raises(ValueError, match="activation='tanh2'"):
        ExpertMLP(D, FFN, activation="tanh2")
    unbound = MoE(D, expert, num_experts=4, ep_size=2)
    with pytest.raises(RuntimeError, match=r"ep_size=2 but no expert groups: train it through partita.initialize"):
        unbound(torch.randn(3, D))
    with pytest.raises(ValueError, match=r"last dimension is 5, expected hidden_size=8"):
        _layer(k=1, drop_tokens=False)(torch.randn(3, 5))


def test_eval_uses_eval_capacity_factor() -> None:
    m = _layer(k=1, drop_tokens=True, capacity_factor=0.25, eval_capacity_factor=4.0, min_capacity=1)
    x = torch.randn(16, D, generator=torch.Generator().manual_seed(4))
    m.eval()
    out, _, _ = m(x)
    ref, _ = reference_moe(x, m.gate.wg.weight.detach(), expert_weights(4), 1)
    assert torch.allclose(out, ref, atol=1e-6)  # capacity 16: nothing dropped
    m.train()
    out_train, _, _ = m(x)
    assert (out_train.abs().sum(1) == 0).sum() > 0  # capacity 1 per expert: tokens dropped
    assert math.isclose(m.take_routing_stats().forwards, 2)


def test_experts_with_buffers_hold_their_own() -> None:
    """Each local expert is a copy of the module, buffers included (as DeepSpeed's deep copies)."""
    m = MoE(D, nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D)), num_experts=2, k=1, drop_tokens=False)
    keys = [k for k in m.state_dict() if "running_mean" in k]
    assert keys == [f"deepspeed_moe.experts.deepspeed_experts.{j}.1.running_mean" for j in range(2)]
    first, second = (e[1].running_mean for e in m.experts.deepspeed_experts)
    assert first.data_ptr() != second.data_ptr()
    m.eval()
    x = torch.randn(6, D)
    out, _, counts = m(x)
    expert = m.experts.deepspeed_experts
    chosen = torch.softmax(m.gate.logits(x, jitter=False), 1).argmax(1)
    probs = torch.softmax(m.gate.logits(x, jitter=False), 1).max(1).values
    expected = torch.stack([expert[int(e)](x[i : i + 1])[0] * probs[i] for i, e in enumerate(chosen)])
    assert torch.allclose(out, expected, atol=1e-6)
    with pytest.raises(NotImplementedError, match=r"an expert with buffers \(e.g. BatchNorm\) at ep_size=2"):
        MoE(D, nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D)), num_experts=2, ep_size=2)
