"""``MoE``: DeepSpeed's mixture-of-experts layer (same arguments, same ``(output, l_aux,
exp_counts)`` return), with expert parallelism, a dropless grouped-GEMM mode and shared experts.

Lifecycle. DeepSpeed users build the model (and its MoE layers) before ``initialize``, often
before torch.distributed is started, so construction never needs a process group: it checks
only what it can (``num_experts`` divisible by ``ep_size``; ``ep_size`` dividing the world size
when torch.distributed is already running). ``partita.initialize`` then calls
:func:`partita.moe.registry.bind_experts`, which builds the expert groups from the topology
(``ep_size`` must divide data x sequence) and tells each layer which experts it holds. A layer
with ``ep_size > 1`` that was never bound refuses to run (there is no safe moment to create
process groups inside a forward that only some ranks might run); with ``ep_size == 1`` it
holds every expert and needs no group, so it also runs in plain single-process torch.

Under expert parallelism, local expert ``j`` of expert rank ``r`` is global expert
``r * num_local + j``; experts start identical on every rank (``expert`` is copied, as in
DeepSpeed), and ``initialize`` broadcasts them within each expert-data group only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from partita.moe.dispatch import agree_capacity, capacity_dispatch, dropless_dispatch
from partita.moe.experts import Experts
from partita.moe.gating import Routing, route
from partita.moe.registry import register_expert_params

__all__ = ["MoE", "RoutingStats", "TopKGate"]

_NOISY_POLICIES = (None, "Jitter", "RSample")
_JITTER_EPS = 1e-2


class TopKGate(nn.Module):
    """The router: a bias-free linear map to one logit per expert, computed in fp32 (as DeepSpeed)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden_size, num_experts, bias=False)

    def logits(self, x: torch.Tensor, *, jitter: bool) -> torch.Tensor:
        x = x.float()
        if jitter:  # DeepSpeed's multiplicative jitter (Switch Transformer): x * U(1 - eps, 1 + eps)
            x = x * torch.empty_like(x).uniform_(1.0 - _JITTER_EPS, 1.0 + _JITTER_EPS)
        return F.linear(x, self.wg.weight.float())


@dataclass
class RoutingStats:
    """Routing since the last :meth:`MoE.take_routing_stats` (summed over forwards, this rank)."""

    tokens_per_expert: torch.Tensor  # (num_experts,) assignments before dropping
    dropped_fraction: float  # of the (token, choice) assignments
    l_aux: float  # mean over the forwards
    forwards: int
    assignments: float = 0.0  # (token, choice) assignments routed


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE`` (see the module docstring for the lifecycle).

    Args (DeepSpeed's): ``hidden_size``; ``expert`` (module copied per local expert);
    ``num_experts``; ``ep_size`` (ranks the experts are spread over); ``k`` (experts per token);
    ``capacity_factor`` / ``eval_capacity_factor``; ``min_capacity``; ``use_residual``
    (PR-MoE: a dense copy of ``expert`` mixed in by a learned 2-way softmax);
    ``noisy_gate_policy`` (None, "Jitter", "RSample"; training only); ``drop_tokens`` (False:
    dropless, see partita/moe/dispatch.py); ``use_rts`` (random token selection, top-1);
    ``top2_2nd_expert_sampling`` (Gumbel noise on the second choice, training only).
    partita's (keyword-only): ``drop_policy`` for k > 2 ("probs" or "position");
    ``router_z_loss_coef`` (ST-MoE z-loss added to ``l_aux``); ``num_shared_experts`` /
    ``shared_expert`` (DeepSeekMoE: experts every token goes through, added to the output;
    default the ``expert`` module).
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        *,
        drop_policy: str = "probs",
        router_z_loss_coef: float = 0.0,
        num_shared_experts: int = 0,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        _validate(num_experts=num_experts, ep_size=ep_size, k=k, noisy_gate_policy=noisy_gate_policy,
                  drop_policy=drop_policy, capacity_factor=capacity_factor, min_capacity=min_capacity,
                  num_shared_experts=num_shared_experts, router_z_loss_coef=router_z_loss_coef)
        if use_tutel:
            raise NotImplementedError("use_tutel=True: partita has no Tutel kernels; drop_tokens=False gives "
                                      "dropless routing with grouped GEMMs instead")
        if enable_expert_tensor_parallelism:
            raise NotImplementedError("enable_expert_tensor_parallelism=True is not implemented yet in partita")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
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
        self.use_residual = use_residual

        self.gate = TopKGate(hidden_size, num_experts)
        self.experts = Experts(expert, self.num_local_experts)
        if use_residual:
            self.mlp = Experts(expert, 1)
            self.coefficient = nn.Linear(hidden_size, 2)
        self.shared_experts = Experts(shared_expert or expert, num_shared_experts) if num_shared_experts else None
        register_expert_params(self, self.expert_parameters())
        self._groups = None  # ExpertGroups, set by bind()
        self._stats: list[torch.Tensor] | None = None  # [tokens per expert, dropped, assignments, l_aux]
        self._stat_forwards = 0

    # ------------------------------------------------------------------ expert parallelism
    def expert_parameters(self) -> list[nn.Parameter]:
        """The routed experts' (stacked) parameters: the ones reduced over the expert-data group."""
        return list(self.experts.parameters())

    def bind(self, groups) -> None:
        """Use these :class:`~partita.distributed.topology.ExpertGroups` (from ``bind_experts``)."""
        if groups.ep_size != self.ep_size:
            raise ValueError(f"expert groups for ep_size={groups.ep_size} given to a layer with ep_size={self.ep_size}")
        self._groups = groups

    @property
    def expert_rank(self) -> int:
        """This rank's index in its expert group (0 when not expert-parallel)."""
        return self._groups.expert_rank if self._groups is not None else 0

    @property
    def local_expert_indices(self) -> list[int]:
        """Global indices of the experts this rank holds, in local order."""
        first = self.expert_rank * self.num_local_experts
        return list(range(first, first + self.num_local_experts))

    def _expert_group(self):
        if self.ep_size == 1:
            return None
        if self._groups is None:
            raise RuntimeError(
                f"this MoE layer has ep_size={self.ep_size} but no expert groups: train it through "
                "partita.initialize(), or call partita.moe.bind_experts(model, topology) on every rank first"
            )
        return self._groups.expert_group

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """Returns ``(output, l_aux, exp_counts)`` as DeepSpeed's MoE; ``exp_counts`` (tokens
        routed to each expert on this rank, before dropping) stays on the device."""
        if used_token is not None:
            raise NotImplementedError("MoE(..., used_token=...) is not implemented yet in partita")
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE input's last dimension is {hidden_states.shape[-1]}, expected hidden_size={self.hidden_size}")
        group = self._expert_group()
        x = hidden_states.reshape(-1, self.hidden_size)
        training = self.training
        logits = self.gate.logits(x, jitter=training and self.noisy_gate_policy == "Jitter")
        routing = route(
            logits, k=self.k,
            capacity_factor=self.capacity_factor if training else self.eval_capacity_factor,
            min_capacity=self.min_capacity,
            noisy_gate_policy=self.noisy_gate_policy if training else None,
            drop_tokens=self.drop_tokens, use_rts=self.use_rts and training,
            top2_2nd_expert_sampling=self.top2_2nd_expert_sampling and training,
            drop_policy=self.drop_policy, router_z_loss_coef=self.router_z_loss_coef,
        )
        if self.drop_tokens:
            capacity = routing.capacity if group is None else agree_capacity(routing.capacity, group, x.device)
            out = capacity_dispatch(x, routing, self.experts, capacity=capacity, ep_size=self.ep_size, group=group)
        else:
            out = dropless_dispatch(x, routing, self.experts, ep_size=self.ep_size, group=group)
        if self.shared_experts is not None:
            n = self.shared_experts.num_local
            out = out + self.shared_experts.forward_padded(x.unsqueeze(0).expand(n, -1, -1)).sum(dim=0)
        if self.use_residual:
            dense = self.mlp.forward_padded(x.unsqueeze(0))[0]
            coef = F.softmax(self.coefficient(x), dim=-1)
            out = out * coef[:, 0:1] + dense * coef[:, 1:]
        self._record(routing)
        return out.reshape(hidden_states.shape), routing.l_aux, routing.exp_counts

    # ------------------------------------------------------------------ monitoring
    def _record(self, routing: Routing) -> None:
        """Accumulate routing statistics on the device (no host sync in the forward)."""
        with torch.no_grad():
            # Copies: the sums are updated in place and must never alias the returned l_aux / exp_counts.
            fresh = [routing.exp_counts.float().clone(), (~routing.kept).sum().float(),
                     torch.tensor(float(routing.kept.numel()), device=routing.kept.device),
                     routing.l_aux.detach().float().clone()]
            if self._stats is None:
                self._stats = fresh
            else:
                for total, value in zip(self._stats, fresh):
                    total.add_(value)
        self._stat_forwards += 1

    def take_routing_stats(self) -> RoutingStats | None:
        """This rank's routing since the last call (None if no forward ran), and reset."""
        if self._stats is None:
            return None
        counts, dropped, assignments, l_aux = self._stats
        forwards = self._stat_forwards
        self._stats, self._stat_forwards = None, 0
        return RoutingStats(counts.cpu(), float(dropped) / max(float(assignments), 1.0), float(l_aux) / forwards, forwards,
                            float(assignments))


def _validate(*, num_experts: int, ep_size: int, k: int, noisy_gate_policy, drop_policy: str, capacity_factor: float,
              min_capacity: int, num_shared_experts: int, router_z_loss_coef: float) -> None:
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be >= 1")
    if ep_size < 1:
        raise ValueError(f"ep_size={ep_size} must be >= 1")
    if num_experts % ep_size != 0:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by ep_size={ep_size}: each of the {ep_size} expert ranks "
            f"must hold the same number of experts; choose an ep_size that divides {num_experts}"
        )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() % ep_size != 0:
        raise ValueError(
            f"ep_size={ep_size} does not divide the world size {dist.get_world_size()}: experts are spread over "
            f"ranks of the data-parallel group; choose a divisor of the data-parallel size"
        )
    if not 1 <= k <= num_experts:
        raise ValueError(f"k={k} must be between 1 and num_experts={num_experts}")
    if noisy_gate_policy not in _NOISY_POLICIES:
        raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r}: choose one of {list(_NOISY_POLICIES)}")
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"drop_policy={drop_policy!r}: choose 'probs' or 'position'")
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0")
    if min_capacity < 0:
        raise ValueError(f"min_capacity={min_capacity} must be >= 0")
    if num_shared_experts < 0:
        raise ValueError(f"num_shared_experts={num_shared_experts} must be >= 0")
    if router_z_loss_coef < 0:
        raise ValueError(f"router_z_loss_coef={router_z_loss_coef} must be >= 0")
