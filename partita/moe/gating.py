"""Routing: which experts each token goes to, with what weight, and which tokens are dropped.

The gates follow DeepSpeed's ``sharded_moe`` semantics (which follow GShard and Switch):

- **top-1** (Switch): softmax over the experts; each token goes to its argmax expert (with
  ``noisy_gate_policy="RSample"`` the argmax of logits + Gumbel noise) weighted by that
  expert's softmax probability, *not* renormalised.
- **top-2** (GShard): first expert = argmax of the softmax; second = argmax of the other
  experts' logits (plus Gumbel noise when ``top2_2nd_expert_sampling``, DeepSpeed's default);
  the two probabilities are renormalised to sum to 1 *after* capacity dropping, so a token whose
  second choice was dropped keeps weight 1 on its first.
- **top-k** (k > 2): the k largest probabilities, renormalised over the kept choices.

Auxiliary load-balancing loss (GShard eq. 4, DeepSpeed's formula): with ``me_e`` the mean
gate probability of expert ``e`` and ``ce_e`` the fraction of tokens whose *first* choice is
``e`` (top-1/top-2) or the fraction of (token, choice) assignments to ``e`` (top-k),
``l_aux = E * sum_e me_e * ce_e`` for top-1 and top-2 and ``E * sum_e me_e * ce_e / k`` for
top-k: 1.0 for a perfectly balanced router. Optional router z-loss (ST-MoE, Zoph et al. 2022):
``mean_tokens(logsumexp(logits)^2)`` times ``router_z_loss_coef``, added to ``l_aux``.

Capacity (DeepSpeed's ``_capacity``): ``ceil(tokens / E * capacity_factor * k)``, at least
``min_capacity``. Tokens are kept per expert in priority order:
- ``use_rts=True`` (random token selection, top-1 only, DeepSpeed's default): a uniform random
  priority per token;
- otherwise by position: the first ``capacity`` assignments of each expert are kept, all
  first choices before any second choice (GShard's rule; top-k with ``drop_policy="position"``).
- top-k with ``drop_policy="probs"`` (DeepSpeed's default for top-k) keeps each expert's
  ``capacity`` highest-probability assignments. DeepSpeed ranks them by the raw *logit* with
  unselected entries at 0, which mis-ranks negative logits; this ranks by probability.

The result is a :class:`Routing` of per-(token, choice) indices rather than DeepSpeed's dense
``(tokens, E, capacity)`` combine tensor, which is ``E * capacity`` times larger than needed;
:meth:`Routing.combine_weights` builds that tensor for comparison with DeepSpeed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Routing", "capacity_for", "top1_gating", "top2_gating", "topk_gating", "route", "z_loss"]


@dataclass(frozen=True)
class Routing:
    """Where each (token, choice) goes.

    Attributes:
        experts: ``(S, k)`` int64 expert of each choice.
        weights: ``(S, k)`` combine weight of each choice (0 where dropped); differentiable.
        kept: ``(S, k)`` bool, False where capacity dropped the choice.
        slots: ``(S, k)`` int64 position in the expert's capacity buffer (meaningful where kept).
        capacity: slots per expert, or None in dropless mode.
        l_aux: the auxiliary loss (z-loss included when enabled), a scalar tensor.
        exp_counts: ``(E,)`` tokens routed to each expert *before* dropping (DeepSpeed's).
        z_loss: the unscaled router z-loss, or None when not computed.
    """

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    slots: torch.Tensor
    capacity: int | None
    l_aux: torch.Tensor
    exp_counts: torch.Tensor
    z_loss: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return int(self.exp_counts.numel())

    def combine_weights(self) -> torch.Tensor:
        """DeepSpeed's dense ``(S, E, capacity)`` combine tensor (for tests and comparison)."""
        if self.capacity is None:
            raise ValueError("dropless routing has no capacity buffer; combine_weights() needs capacity mode")
        S, k = self.experts.shape
        out = torch.zeros(S, self.num_experts, self.capacity, dtype=self.weights.dtype, device=self.weights.device)
        tokens = torch.arange(S, device=self.experts.device).unsqueeze(1).expand(S, k)
        kept = self.kept
        out.index_put_((tokens[kept], self.experts[kept], self.slots[kept]), self.weights[kept], accumulate=True)
        return out

    def dropped_fraction(self) -> float:
        """Fraction of (token, choice) assignments dropped by capacity."""
        return float(1.0 - self.kept.float().mean()) if self.kept.numel() else 0.0


def capacity_for(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed's ``_capacity``: ``ceil(tokens / experts * factor)``, at least ``min_capacity``."""
    capacity = math.ceil(num_tokens / num_experts * capacity_factor)
    return max(capacity, int(min_capacity))


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean squared log-partition of the router logits."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def _gumbel(shape: torch.Size, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    uniform = torch.rand(shape, device=device, generator=generator).clamp(1e-10, 1 - 1e-7)
    return -torch.log(-torch.log(uniform))


def _one_hot(index: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``F.one_hot(index, num_classes)`` without its range check, which reads the index's min and
    max on the host (a synchronisation per gate on an accelerator); argmax indices are in range."""
    return torch.zeros(index.shape[0], num_classes, dtype=torch.int64, device=index.device).scatter_(
        1, index.unsqueeze(1), 1)


def _positional_slots(mask: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """Per (token, expert): the assignment's position among the expert's assignments, in token order."""
    slots = torch.cumsum(mask.long(), dim=0) - 1
    return slots if offset is None else slots + offset


def top1_gating(
    logits: torch.Tensor,
    *,
    capacity_factor: float,
    min_capacity: int,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    generator: torch.Generator | None = None,
) -> Routing:
    """Switch-style top-1 routing (see the module docstring)."""
    gates = F.softmax(logits, dim=1)
    S, E = gates.shape
    chooser = logits + _gumbel(logits.shape, logits.device, generator) if noisy_gate_policy == "RSample" else gates
    index = torch.argmax(chooser, dim=1)
    mask = _one_hot(index, E)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * E
    if drop_tokens:
        capacity = capacity_for(S, E, capacity_factor, min_capacity)
        if use_rts:
            # Random token selection: keep a random `capacity` of each expert's tokens.
            priority = mask * torch.rand(mask.shape, device=logits.device, generator=generator)
            top = torch.topk(priority, k=min(capacity, S), dim=0).indices
            keep = torch.zeros_like(mask).scatter_(0, top, 1)
            mask = mask * keep
            slot_of = _positional_slots(mask)
            kept = mask.sum(dim=1).bool()
        else:
            slot_of = _positional_slots(mask)
            kept = (slot_of * mask).sum(dim=1) < capacity
            mask = mask * kept.unsqueeze(1)
        slots = (slot_of * mask).sum(dim=1)
    else:
        capacity = None
        kept = torch.ones(S, dtype=torch.bool, device=logits.device)
        slots = (_positional_slots(mask) * mask).sum(dim=1)
    weights = gates.gather(1, index.unsqueeze(1)).squeeze(1) * kept
    return Routing(index.unsqueeze(1), weights.unsqueeze(1), kept.unsqueeze(1), slots.unsqueeze(1), capacity,
                   l_aux, exp_counts)


def top2_gating(
    logits: torch.Tensor,
    *,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    top2_2nd_expert_sampling: bool = True,
    generator: torch.Generator | None = None,
) -> Routing:
    """GShard-style top-2 routing (see the module docstring)."""
    gates = F.softmax(logits, dim=1)
    S, E = gates.shape
    index1 = torch.argmax(gates, dim=1)
    mask1 = _one_hot(index1, E)
    chooser = logits + _gumbel(logits.shape, logits.device, generator) if top2_2nd_expert_sampling else logits
    index2 = torch.argmax(chooser.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = _one_hot(index2, E)
    slot1 = _positional_slots(mask1)
    # Second choices queue behind every first choice of the same expert.
    slot2 = _positional_slots(mask2, mask1.sum(dim=0, keepdim=True))
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * E * E
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = capacity_for(S, E, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (slot1 < capacity)
        mask2 = mask2 * (slot2 < capacity)
    else:
        capacity = None
    kept = torch.stack([mask1.sum(dim=1).bool(), mask2.sum(dim=1).bool()], dim=1)
    slots = torch.stack([(slot1 * mask1).sum(dim=1), (slot2 * mask2).sum(dim=1)], dim=1)
    g1 = (gates * mask1).sum(dim=1)
    g2 = (gates * mask2).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(gates.dtype).eps)
    weights = torch.stack([g1 / denom, g2 / denom], dim=1)
    return Routing(torch.stack([index1, index2], dim=1), weights, kept, slots, capacity, l_aux, exp_counts)


def topk_gating(
    logits: torch.Tensor,
    *,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    drop_policy: str = "probs",
) -> Routing:
    """General top-k routing (DeepSpeed's ``topkgating``; see the module docstring)."""
    gates = F.softmax(logits, dim=1)
    S, E = gates.shape
    if not 1 <= k <= E:
        raise ValueError(f"k={k} must be between 1 and the number of experts {E}")
    index = torch.topk(gates, k=k, dim=1).indices  # (S, k), highest first
    mask = torch.zeros_like(gates, dtype=torch.long).scatter_(1, index, 1)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * E * E / k
    if drop_tokens:
        capacity = capacity_for(S, E, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            ranked = gates.detach().masked_fill(~mask.bool(), float("-inf"))
            top = torch.topk(ranked, k=min(capacity, S), dim=0).indices
            mask = mask * torch.zeros_like(mask).scatter_(0, top, 1)
        elif drop_policy == "position":
            mask = mask * (_positional_slots(mask) < capacity)
        else:
            raise ValueError(f"drop_policy={drop_policy!r}: use 'probs' or 'position'")
    else:
        capacity = None
    slot_of = _positional_slots(mask)
    kept = mask.gather(1, index).bool()
    slots = slot_of.gather(1, index)
    chosen = gates.gather(1, index) * kept
    weights = chosen / torch.clamp(chosen.sum(dim=1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    return Routing(index, weights, kept, slots, capacity, l_aux, exp_counts)


def route(
    logits: torch.Tensor,
    *,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    noisy_gate_policy: str | None,
    drop_tokens: bool,
    use_rts: bool,
    top2_2nd_expert_sampling: bool,
    drop_policy: str,
    router_z_loss_coef: float,
    generator: torch.Generator | None = None,
) -> Routing:
    """Dispatch to the gate for ``k`` and add the z-loss; ``logits`` are fp32 ``(S, E)``."""
    if k == 1:
        routing = top1_gating(logits, capacity_factor=capacity_factor, min_capacity=min_capacity,
                              noisy_gate_policy=noisy_gate_policy, drop_tokens=drop_tokens, use_rts=use_rts,
                              generator=generator)
    elif k == 2:
        routing = top2_gating(logits, capacity_factor=capacity_factor, min_capacity=min_capacity,
                              drop_tokens=drop_tokens, top2_2nd_expert_sampling=top2_2nd_expert_sampling,
                              generator=generator)
    else:
        routing = topk_gating(logits, k=k, capacity_factor=capacity_factor, min_capacity=min_capacity,
                              drop_tokens=drop_tokens, drop_policy=drop_policy)
    if router_z_loss_coef > 0:
        z = z_loss(logits)
        routing = Routing(routing.experts, routing.weights, routing.kept, routing.slots, routing.capacity,
                          routing.l_aux + router_z_loss_coef * z, routing.exp_counts, z)
    return routing
