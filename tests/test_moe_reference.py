"""The plain-torch oracle for the MoE tests, and the small MoE model they train.

The reference never uses partita.moe: it routes every token explicitly (a Python loop over
tokens and their top-k experts) with the same gate and expert weights, over the global batch,
with torch SGD (momentum): unlike Adam, it is not blind to a wrongly scaled gradient. Experts start *different* (global expert e's weights come from a seeded
generator), so a layer that swapped or misplaced experts could not pass.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

D = 8  # hidden (multiples of 4: fp32 grouped_mm needs 16-byte strides)
FFN = 16
SEQ = 3
AUX = 0.01  # weight of l_aux in the loss
LR = 0.2
MOMENTUM = 0.9  # SGD, not Adam: Adam is blind to a wrongly scaled gradient


EXPERTS = "moe.deepspeed_moe.experts.deepspeed_experts."  # MoENet's local experts (DeepSpeed's layout)
GATE = "moe.deepspeed_moe.gate.wg.weight"


def expert_weights(num_experts: int) -> dict[str, torch.Tensor]:
    """Global expert weights, expert index first (the stacked layout)."""
    g = torch.Generator().manual_seed(1234)
    return {
        "fc1.weight": torch.randn(num_experts, FFN, D, generator=g) * 0.4,
        "fc1.bias": torch.randn(num_experts, FFN, generator=g) * 0.1,
        "fc2.weight": torch.randn(num_experts, D, FFN, generator=g) * 0.4,
        "fc2.bias": torch.randn(num_experts, D, generator=g) * 0.1,
    }


class MoENet(nn.Module):
    """inp -> tanh -> MoE -> out; the loss is MSE + AUX * l_aux."""

    def __init__(self, *, num_experts: int, ep_size: int, k: int, drop_tokens: bool, capacity_factor: float = 1.0,
                 expert_rank: int = 0, zero_gate: bool = False) -> None:
        super().__init__()
        from partita.moe import ExpertMLP, MoE

        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.moe = MoE(D, ExpertMLP(D, FFN), num_experts=num_experts, ep_size=ep_size, k=k, drop_tokens=drop_tokens,
                       capacity_factor=capacity_factor, use_rts=False, top2_2nd_expert_sampling=False)
        self.out = nn.Linear(D, 1)
        n_local = num_experts // ep_size
        rows = slice(expert_rank * n_local, (expert_rank + 1) * n_local)
        with torch.no_grad():
            if zero_gate:  # every logit ties: argmax sends every token to expert 0 in the first step
                self.moe.gate.wg.weight.zero_()
            for name, value in expert_weights(num_experts).items():
                for j, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                    expert.get_parameter(name).copy_(value[rows][j])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return F.mse_loss(self.out(h), y) + AUX * l_aux


def stacked_view(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MoENet's parameters with its local experts (``moe.deepspeed_moe.experts.deepspeed_experts.<j>.<leaf>``)
    stacked in local order as ``moe.experts.stacked.<leaf>``: the reference's layout."""
    out: dict[str, torch.Tensor] = {}
    rows: dict[str, dict[int, torch.Tensor]] = {}
    for name, value in named.items():
        if name.startswith(EXPERTS):
            j, leaf = name.removeprefix(EXPERTS).split(".", 1)
            rows.setdefault(leaf, {})[int(j)] = value
        else:
            out[name] = value
    for leaf, by_index in rows.items():
        out[f"moe.experts.stacked.{leaf}"] = torch.stack([by_index[j] for j in sorted(by_index)])
    return out


def make_data(steps: int, global_batch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(global_batch, SEQ, D, generator=g) for _ in range(steps)]
    ys = [torch.randn(global_batch, SEQ, 1, generator=g) for _ in range(steps)]
    return xs, ys


def reference_moe(x: torch.Tensor, wg: torch.Tensor, experts: dict[str, torch.Tensor], k: int):
    """Explicit per-token top-k routing of ``x`` (S, D): DeepSpeed's gate values, no dropping.

    top-1: the softmax probability of the argmax expert; top-2: first = argmax, second =
    argmax of the remaining logits, both renormalised; top-k: the k largest, renormalised.
    Returns (output, l_aux) with GShard's aux loss over these S tokens.
    """
    logits = x @ wg.t()
    probs = torch.softmax(logits, dim=1)
    S, E = probs.shape
    rows = []
    first_choice = torch.zeros(E)
    assigned = torch.zeros(E)
    for s in range(S):
        order = torch.argsort(probs[s].detach(), descending=True, stable=True).tolist()  # ties: lowest index, as argmax
        chosen = order[:k]
        first_choice[chosen[0]] += 1
        for e in chosen:
            assigned[e] += 1
        p = probs[s, chosen]
        w = p if k == 1 else p / p.sum()
        out = 0
        for weight, e in zip(w, chosen):
            h = F.gelu(x[s] @ experts["fc1.weight"][e].t() + experts["fc1.bias"][e])
            out = out + weight * (h @ experts["fc2.weight"][e].t() + experts["fc2.bias"][e])
        rows.append(out)
    me = probs.mean(dim=0)
    if k <= 2:
        l_aux = (me * first_choice / S).sum() * E
    else:
        l_aux = (me * assigned / S).sum() * E / k
    return torch.stack(rows), l_aux


def reference_train(*, num_experts: int, k: int, steps: int, global_batch: int, world: int, clip: float = 0.0,
                    zero_gate: bool = False, starve_rank: int | None = None):
    """Plain torch over the global batch: the loss is the mean over the ``world`` rank chunks of
    each chunk's MSE + AUX * l_aux (the aux loss is per rank, as in DeepSpeed)."""
    net = MoENet(num_experts=num_experts, ep_size=1, k=k, drop_tokens=False, zero_gate=zero_gate)  # dense initial weights
    params = {
        "inp.weight": net.inp.weight.detach().clone(), "inp.bias": net.inp.bias.detach().clone(),
        GATE: net.moe.gate.wg.weight.detach().clone(),
        "out.weight": net.out.weight.detach().clone(), "out.bias": net.out.bias.detach().clone(),
        **{f"moe.experts.stacked.{n}": v.clone() for n, v in expert_weights(num_experts).items()},
    }
    for p in params.values():
        p.requires_grad_(True)
    opt = torch.optim.SGD(list(params.values()), lr=LR, momentum=MOMENTUM)
    xs, ys = make_data(steps, global_batch)
    experts = {n.removeprefix("moe.experts.stacked."): p for n, p in params.items() if n.startswith("moe.experts")}
    norms = []
    for step in range(steps):
        opt.zero_grad()
        total = 0
        chunk = global_batch // world
        for r in range(world):
            x = xs[step][r * chunk : (r + 1) * chunk].reshape(-1, D)
            if r == starve_rank:
                x = torch.zeros_like(x)
            y = ys[step][r * chunk : (r + 1) * chunk].reshape(-1, 1)
            h = torch.tanh(x @ params["inp.weight"].t() + params["inp.bias"])
            out, l_aux = reference_moe(h, params[GATE], experts, k)
            pred = out @ params["out.weight"].t() + params["out.bias"]
            total = total + (F.mse_loss(pred, y) + AUX * l_aux) / world
        total.backward()
        for p in params.values():  # an expert without tokens gets a zero gradient, as under partita
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), clip if clip > 0 else math.inf)))
        opt.step()
    return {n: p.detach() for n, p in params.items()}, norms


def test_reference_matches_dense_formula_for_one_token() -> None:
    """The oracle itself: one token, top-2, by hand."""
    torch.manual_seed(3)
    x = torch.randn(1, D)
    wg = torch.randn(4, D)
    experts = {n: v for n, v in expert_weights(4).items()}
    out, l_aux = reference_moe(x, wg, experts, 2)
    p = torch.softmax(x @ wg.t(), dim=1)[0]
    e1, e2 = torch.topk(p, 2).indices.tolist()

    def mlp(e):
        return F.gelu(x[0] @ experts["fc1.weight"][e].t() + experts["fc1.bias"][e]) @ experts["fc2.weight"][e].t() + experts["fc2.bias"][e]

    expected = (p[e1] * mlp(e1) + p[e2] * mlp(e2)) / (p[e1] + p[e2])
    assert torch.allclose(out[0], expected, atol=1e-6)
    assert torch.allclose(l_aux, p[e1] * 4, atol=1e-6)  # E * me[e1] * ce[e1] with ce[e1] = 1
