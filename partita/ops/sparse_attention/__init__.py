"""``deepspeed.ops.sparse_attention``: block-sparse attention patterns on torch's FlexAttention.

- the pattern classes with DeepSpeed's constructors: :class:`FixedSparsityConfig`,
  :class:`VariableSparsityConfig`, :class:`BigBirdSparsityConfig`,
  :class:`BSLongformerSparsityConfig`, :class:`DenseSparsityConfig`,
  :class:`LocalSlidingWindowSparsityConfig` (:mod:`.sparsity_config`);
- :class:`SparseSelfAttention` with DeepSpeed's call signature (:mod:`.sparse_self_attention`);
- token-level sliding-window and packed-document masks (:mod:`.masks`);
- the ``sparse_attention`` config section (:mod:`.config`) and what ``initialize`` does with it
  (:mod:`.apply`).
"""

from __future__ import annotations

from partita.ops.sparse_attention.apply import apply_sparse_attention
from partita.ops.sparse_attention.config import SparseAttentionConfig
from partita.ops.sparse_attention.masks import document_mask, masked_attention, sliding_window_mask
from partita.ops.sparse_attention.sparse_self_attention import SparseSelfAttention, layout_to_dense_mask
from partita.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseAttentionConfig",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "apply_sparse_attention",
    "document_mask",
    "layout_to_dense_mask",
    "masked_attention",
    "sliding_window_mask",
]
