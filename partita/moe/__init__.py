"""Mixture of experts with expert parallelism (DeepSpeed's ``deepspeed.moe``).

``MoE`` (partita/moe/layer.py) is the layer; ``bind_experts`` (called by ``partita.initialize``)
gives its layers their expert groups; ``is_moe_param`` and
``split_params_into_different_moe_groups_for_optimizer`` are DeepSpeed's helpers.
"""

from partita.moe.embedding import ShardedEmbedding
from partita.moe.experts import ExpertMLP, Experts
from partita.moe.layer import MoE, RoutingStats, TopKGate
from partita.moe.registry import bind_experts, expert_layout, is_moe_param, moe_layers
from partita.moe.utils import split_params_into_different_moe_groups_for_optimizer

__all__ = [
    "ExpertMLP",
    "Experts",
    "MoE",
    "RoutingStats",
    "ShardedEmbedding",
    "TopKGate",
    "bind_experts",
    "expert_layout",
    "is_moe_param",
    "moe_layers",
    "split_params_into_different_moe_groups_for_optimizer",
]
