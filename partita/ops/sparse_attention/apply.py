"""``apply_sparse_attention``: the reference GPT's attention under the ``sparse_attention`` pattern.

``initialize`` calls :func:`apply_config` when the config has a ``sparse_attention`` section: every
``CausalSelfAttention.attend`` of partita's GPT becomes a :class:`SparseSelfAttention` over its
heads. A GPT is a causal language model, so the pattern must be ``"unidirectional"``. For other
models the section is the user's to read (as in DeepSpeed): build
``SparseSelfAttention(engine.config.sparse_attention.to_sparsity_config(num_heads))``.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from partita.ops.sparse_attention.config import SparseAttentionConfig
from partita.ops.sparse_attention.sparse_self_attention import SparseSelfAttention

__all__ = ["apply_config", "apply_sparse_attention"]


def apply_sparse_attention(model: nn.Module, config: SparseAttentionConfig) -> int:
    """Run the GPT's attention under ``config``'s pattern; returns the number of layers changed.

    Raises ValueError for a pattern a causal model cannot use or a block size that does not divide
    the model's ``block_size``; NotImplementedError for attention dropout."""
    from partita.models.gpt import GPT, CausalSelfAttention

    if not isinstance(model, GPT):
        raise ValueError(
            f"sparse_attention wires partita's reference GPT; {type(model).__name__} builds its own layers: use "
            "partita.ops.sparse_attention.SparseSelfAttention(engine.config.sparse_attention.to_sparsity_config("
            "num_heads)) in the model and leave the section for it to read"
        )
    gpt = model.config
    if config.mode != "dense" and config.attention_direction != "unidirectional":
        raise ValueError(
            f"sparse_attention.attention is {config.attention_direction!r}, but the reference GPT is a causal language "
            "model: set sparse_attention.attention to \"unidirectional\""
        )
    if gpt.block_size % config.block != 0:
        raise ValueError(
            f"sparse_attention.block={config.block} does not divide the model's block_size={gpt.block_size}; choose "
            "a block that divides it (sequences must be multiples of the block)"
        )
    if gpt.dropout > 0:
        raise NotImplementedError(
            f"sparse attention with attention dropout ({gpt.dropout}) is not implemented: set GPTConfig.dropout to 0"
        )
    changed = 0
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            sparse = SparseSelfAttention(config.to_sparsity_config(gpt.n_head), max_seq_length=gpt.block_size)
            if not sparse.causal:  # dense mode: a full layout, causal inside like the GPT's own attention
                sparse.causal = True
            module.attend = _attend(sparse)
            changed += 1
    return changed


def _attend(sparse: SparseSelfAttention):
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sparse(q, k, v)

    return attend


def apply_config(model: nn.Module, config: SparseAttentionConfig | None, *, sequence_parallel_size: int) -> None:
    """``initialize``'s call: nothing without the section."""
    if config is None:
        return
    if sequence_parallel_size > 1:
        raise NotImplementedError(
            f"sparse_attention with sequence_parallel_size={sequence_parallel_size} is not implemented: the pattern "
            "needs whole sequences on a rank; remove one of them"
        )
    if apply_sparse_attention(model, config) == 0:
        warnings.warn("sparse_attention: the model has no CausalSelfAttention layer; the section changes nothing")
