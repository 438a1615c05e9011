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

Layout: DeepSpeed's module tree and state_dict keys (``deepspeed_moe.gate.wg``,
``deepspeed_moe.experts.deepspeed_experts.<j>``, then ``mlp`` and ``coefficient`` with
``use_residual``; partita/moe/sharded_moe.py, experts.py), checked against DeepSpeed 0.19.8 in
tests/test_moe_layout.py. Checkpoints rename local expert ``j`` to its global index
(partita/moe/registry.py), so they load at any ``ep_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from partita.moe.experts import Experts
from partita.moe.gating import Routing
from partita.moe.registry import register_expert_params
from partita.moe.sharded_moe import MOELayer, TopKGate

__all__ = ["MoE", "RoutingStats", "TopKGate"]

_NOISY_POLICIES = (None, "Jitter", "RSample")


@dataclass
class RoutingStats:
    """Routing since the last :meth:`MoE.take_routing_stats` (summed over forwards, this rank)."""

    tokens_per_expert: torch.Tensor  # (num_experts,) assignments before dropping
    dropped_fraction: float  # of the (token, choice) assignments
    l_aux: float  # mean over the forwards
    forwards: int
    assignments: float = 0.0  # (token, choice) assignments routed


def _gate_option(name: str) -> property:
    """A routing option of ``MoE`` that is the gate's (``deepspeed_moe.gate.<name>``)."""
    return property(lambda self: getattr(self.deepspeed_moe.gate, name),
                    lambda self, value: setattr(self.deepspeed_moe.gate, name, value),
                    doc=f"``deepspeed_moe.gate.{name}``")


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
        if ep_size > 1 and any(True for _ in expert.buffers()):
            raise NotImplementedError(
                f"an expert with buffers (e.g. BatchNorm) at ep_size={ep_size}: checkpoints key experts' parameters by "
                "global expert index but not yet their buffers, which would load another expert rank's values; use "
                "ep_size=1, or an expert without buffers (e.g. LayerNorm instead of BatchNorm)"
            )
        if enable_expert_tensor_parallelism:
            raise NotImplementedError("enable_expert_tensor_parallelism=True is not implemented yet in partita")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        # DeepSpeed's module tree (child order included): deepspeed_moe.{gate.wg, experts.deepspeed_experts.<j>},
        # then mlp and coefficient with use_residual; partita's shared experts come last.
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling,
                        drop_policy=drop_policy, router_z_loss_coef=router_z_loss_coef)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert  # the module itself, as DeepSpeed (the experts are copies of it)
            self.coefficient = nn.Linear(hidden_size, 2)
        self.shared_experts = Experts(shared_expert or expert, num_shared_experts) if num_shared_experts else None
        for j, local in enumerate(experts.deepspeed_experts):
            register_expert_params(self, list(local.parameters()), local_index=j)
        self._groups = None  # ExpertGroups, set by bind()
        self._stats: list[torch.Tensor] | None = None  # [tokens per expert, dropped, assignments, l_aux]
        self._stat_forwards = 0

    # Routing options live on the gate (DeepSpeed's place); readable and settable here as well.
    k = _gate_option("k")
    capacity_factor = _gate_option("capacity_factor")
    eval_capacity_factor = _gate_option("eval_capacity_factor")
    min_capacity = _gate_option("min_capacity")
    noisy_gate_policy = _gate_option("noisy_gate_policy")
    drop_tokens = _gate_option("drop_tokens")
    use_rts = _gate_option("use_rts")
    top2_2nd_expert_sampling = _gate_option("top2_2nd_expert_sampling")
    drop_policy = _gate_option("drop_policy")
    router_z_loss_coef = _gate_option("router_z_loss_coef")

    @property
    def gate(self) -> TopKGate:
        """``deepspeed_moe.gate`` (a shortcut, not a second entry in the module tree)."""
        return self.deepspeed_moe.gate

    @property
    def experts(self) -> Experts:
        """``deepspeed_moe.experts`` (a shortcut, not a second entry in the module tree)."""
        return self.deepspeed_moe.experts

    # ------------------------------------------------------------------ expert parallelism
    def expert_parameters(self) -> list[nn.Parameter]:
        """The routed experts' parameters (every local expert's, in local order): the ones
        reduced over the expert-data group."""
        return list(self.deepspeed_moe.experts.parameters())

    def bind(self, groups) -> None:
        """Use these :class:`~partita.distributed.topology.ExpertGroups` (from ``bind_experts``)."""
        if groups.ep_size != self.ep_size:
            raise ValueError(f"expert groups for ep_size={groups.ep_size} given to a layer with ep_size={self.ep_size}")
        self._groups = groups
        self.deepspeed_moe._set_ep_group(groups.expert_group if self.ep_size > 1 else None)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's call to create the expert groups: partita does it in ``initialize``
        (``bind_experts``, from the topology), so this only checks that it happened."""
        if use_data_before_expert_parallel_:
            raise NotImplementedError("use_data_before_expert_parallel_=True: partita's expert groups follow the "
                                      "topology (experts borrow data x sequence ranks); leave it False")
        if self.ep_size > 1 and self._groups is None:
            raise RuntimeError("MoE.set_deepspeed_parallelism: partita builds expert groups in partita.initialize() "
                               "(or partita.moe.bind_experts(model, topology)); call that instead")

    @property
    def expert_rank(self) -> int:
        """This rank's index in its expert group (0 when not expert-parallel)."""
        return self._groups.expert_rank if self._groups is not None else 0

    @property
    def local_expert_indices(self) -> list[int]:
        """Global indices of the experts this rank holds, in local order: ``deepspeed_experts[j]``
        is global expert ``local_expert_indices[j]``."""
        first = self.expert_rank * self.num_local_experts
        return list(range(first, first + self.num_local_experts))

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """Returns ``(output, l_aux, exp_counts)`` as DeepSpeed's MoE; ``exp_counts`` (tokens
        routed to each expert on this rank, before dropping) stays on the device."""
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE input's last dimension is {hidden_states.shape[-1]}, expected hidden_size={self.hidden_size}")
        out = self.deepspeed_moe(hidden_states, used_token)
        routing, self.deepspeed_moe.routing = self.deepspeed_moe.routing, None
        if self.shared_experts is not None:
            x = hidden_states.reshape(-1, self.hidden_size)
            n = self.shared_experts.num_local
            out = out + self.shared_experts.forward_padded(x.unsqueeze(0).expand(n, -1, -1)).sum(dim=0).reshape(out.shape)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense  # (output, bias) experts, as DeepSpeed
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            out = out * coef[..., 0:1] + dense * coef[..., 1:]
        self._record(routing)
        return out, routing.l_aux, routing.exp_counts

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
