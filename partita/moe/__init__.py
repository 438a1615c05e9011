"""Mixture of experts with expert parallelism (DeepSpeed's ``deepspeed.moe``).

``MoE`` (partita/moe/layer.py) is the layer; ``bind_experts`` (called by ``partita.initialize``)
gives its layers their expert groups; ``is_moe_param`` and
``split_params_into_different_moe_groups_for_optimizer`` are DeepSpeed's helpers.
"""

from partita.moe.embedding import ShardedEmbedding
from partita.moe.experts import ExpertList, ExpertMLP, Experts
from partita.moe.layer import MoE, RoutingStats
from partita.moe.registry import bind_experts, checkpoint_name, expert_index, is_moe_param, moe_layers
from partita.moe.sharded_moe import MOELayer, TopKGate
from partita.moe.utils import split_params_into_different_moe_groups_for_optimizer

__all__ = [
    "ExpertList",
    "ExpertMLP",
    "Experts",
    "MOELayer",
    "MoE",
    "RoutingStats",
    "ShardedEmbedding",
    "TopKGate",
    "bind_experts",
    "checkpoint_name",
    "expert_index",
    "is_moe_param",
    "moe_layers",
    "split_params_into_different_moe_groups_for_optimizer",
]
