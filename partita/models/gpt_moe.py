"""The reference GPT's mixture-of-experts MLP: DeepSpeed's MoE layer over ``moe_experts`` copies of
the block's MLP (``GPTConfig.moe_*``), experts spread over ``moe_ep_size`` ranks.

Its load-balancing loss is kept on the module for the model's forward to add to the training
loss (DeepSpeed leaves that to the user; forgetting it lets the router collapse onto a few
experts). Under activation checkpointing the recompute writes the same value again.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from partita.moe.experts import ExpertMLP
from partita.moe.layer import MoE

__all__ = ["MoEFeedForward"]


class MoEFeedForward(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.ep_size = config.moe_experts, config.moe_top_k, config.moe_ep_size
        template = ExpertMLP(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # GPT-2's initialisation (the GPT's own init skips the experts: drawing there would consume the
        # generator by the number of experts this rank holds); every expert starts as a copy of it, as
        # DeepSpeed's MoE copies its expert module (moe.deepspeed_moe.experts.deepspeed_experts[j]).
        with torch.no_grad():
            nn.init.normal_(template.fc1.weight, std=0.02)
            nn.init.normal_(template.fc2.weight, std=0.02 / math.sqrt(2 * config.n_layer))
            for bias in (template.fc1.bias, template.fc2.bias):
                if bias is not None:
                    bias.zero_()
        self.moe = MoE(
            config.n_embd,
            template,
            num_experts=config.moe_experts,
            ep_size=config.moe_ep_size,
            k=config.moe_top_k,
            capacity_factor=config.moe_capacity_factor,
            eval_capacity_factor=config.moe_capacity_factor,
            drop_tokens=config.moe_drop_tokens,
        )
        self.dropout = nn.Dropout(config.dropout)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(x)
        self.aux_loss = l_aux
        return self.dropout(out)

    def active_fraction(self) -> float:
        """Expert parameters a token uses, over those this rank holds (for FLOPs per token)."""
        return self.top_k * self.ep_size / self.num_experts
