"""DeepSpeed's ``deepspeed.moe.sharded_moe`` modules: ``TopKGate`` (the router) and ``MOELayer``
(route, dispatch to the experts, combine), the two halves of ``MoE.deepspeed_moe``.

They carry DeepSpeed's names and attributes, so client code that walks the module tree finds
``deepspeed_moe.gate.wg`` and ``deepspeed_moe.experts.deepspeed_experts``, and reads
``deepspeed_moe.l_aux`` / ``deepspeed_moe.exp_counts`` after a forward. The routing itself is
partita's (partita/moe/gating.py returns per-(token, choice) indices instead of DeepSpeed's
dense combine tensor), and so is dispatch (partita/moe/dispatch.py: capacity buffers, or
dropless grouped rows). ``TopKGate.forward`` therefore returns a :class:`Routing`, not
DeepSpeed's tuple.

Options that DeepSpeed applies in evaluation too are applied in training only here: random
token selection (``use_rts``) and the second expert's sampling (``top2_2nd_expert_sampling``),
so an evaluation forward is deterministic. Where no token is dropped, both give the same output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from partita.moe.dispatch import agree_capacity, capacity_dispatch, dropless_dispatch
from partita.moe.experts import Experts
from partita.moe.gating import Routing, route

__all__ = ["MOELayer", "TopKGate"]

_JITTER_EPS = 1e-2


class TopKGate(nn.Module):
    """The router: a bias-free linear map ``wg`` to one logit per expert, computed in fp32 (as
    DeepSpeed), and the routing options (DeepSpeed's names and order; partita's keyword-only)."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None, top2_2nd_expert_sampling: bool = True,
                 *, drop_policy: str = "probs", router_z_loss_coef: float = 0.0) -> None:
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.drop_policy = drop_policy
        self.router_z_loss_coef = router_z_loss_coef

    def logits(self, x: torch.Tensor, *, jitter: bool) -> torch.Tensor:
        x = x.float()
        if jitter:  # DeepSpeed's multiplicative jitter (Switch Transformer): x * U(1 - eps, 1 + eps)
            x = x * torch.empty_like(x).uniform_(1.0 - _JITTER_EPS, 1.0 + _JITTER_EPS)
        return F.linear(x, self.wg.weight.float())

    def forward(self, x: torch.Tensor) -> Routing:
        """Route the ``(tokens, hidden)`` rows ``x`` (training options apply in training mode)."""
        training = self.training
        logits = self.logits(x, jitter=training and self.noisy_gate_policy == "Jitter")
        return route(
            logits, k=self.k,
            capacity_factor=self.capacity_factor if training else self.eval_capacity_factor,
            min_capacity=self.min_capacity,
            noisy_gate_policy=self.noisy_gate_policy if training else None,
            drop_tokens=self.drop_tokens, use_rts=self.use_rts and training,
            top2_2nd_expert_sampling=self.top2_2nd_expert_sampling and training,
            drop_policy=self.drop_policy, router_z_loss_coef=self.router_z_loss_coef,
        )


class MOELayer(nn.Module):
    """``gate`` then ``experts``: tokens routed, sent to their experts (an all-to-all over
    ``ep_group`` when ``ep_size > 1``) and combined. After a forward, ``l_aux`` and
    ``exp_counts`` hold the gate's auxiliary loss and tokens per expert (as DeepSpeed's), and
    ``routing`` the :class:`Routing` itself."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str | None, ep_size: int,
                 num_local_experts: int) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.routing: Routing | None = None

    def _set_ep_group(self, ep_group) -> None:
        """DeepSpeed's setter; partita's ``MoE.bind`` calls it with the expert group."""
        self.ep_group = ep_group
        self.gate.ep_group = ep_group

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        if used_token is not None:
            raise NotImplementedError("MoE(..., used_token=...) is not implemented yet in partita")
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"this MoE layer has ep_size={self.ep_size} but no expert groups: train it through "
                "partita.initialize(), or call partita.moe.bind_experts(model, topology) on every rank first"
            )
        hidden = hidden_states.shape[-1]
        x = hidden_states.reshape(-1, hidden)
        routing = self.gate(x)
        group = self.ep_group if self.ep_size > 1 else None
        if self.gate.drop_tokens:
            capacity = routing.capacity if group is None else agree_capacity(routing.capacity, group, x.device)
            out = capacity_dispatch(x, routing, self.experts, capacity=capacity, ep_size=self.ep_size, group=group)
        else:
            out = dropless_dispatch(x, routing, self.experts, ep_size=self.ep_size, group=group)
        self.l_aux, self.exp_counts, self.routing = routing.l_aux, routing.exp_counts, routing
        return out.reshape(hidden_states.shape)
