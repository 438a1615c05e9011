"""``SparseSelfAttention``: DeepSpeed's block-sparse attention module, run on FlexAttention.

DeepSpeed's module needs Triton 1.0 kernels that no current GPU stack builds (DS#4857, open since
2023), so its users have no working path. Here a layout (:mod:`.sparsity_config`) becomes a
FlexAttention ``mask_mod`` that looks up ``layout[h, q // block, k // block]`` (and ``q >= k`` for
unidirectional patterns); ``create_block_mask`` turns it into a ``BlockMask``, whose empty blocks
the fused kernel skips. The mask is exact at token level, so FlexAttention's own tile (128) need
not match DeepSpeed's 16-token blocks.

Where it runs:

- CUDA: ``torch.compile(flex_attention)`` with the block mask (the fused, block-skipping kernel).
- CPU, and whenever ``key_padding_mask`` / ``attn_mask`` are given: SDPA with the same mask made
  dense. torch 2.13's FlexAttention has no CPU backward ("FlexAttention does not support backward
  on CPU"), and eager FlexAttention materialises the whole score matrix anyway, so the dense path
  is the honest CPU implementation (same numbers, no speed-up). ``force_flex=True`` runs eager
  FlexAttention (forward only on CPU), which the tests use to check the block mask itself.

Block masks are cached per (sequence length, device): building one costs a pass over the layout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from partita.ops.sparse_attention.sparsity_config import SparsityConfig

__all__ = ["SparseSelfAttention", "layout_to_dense_mask"]

_COMPILED_FLEX: Any = None


def _flex():
    """``flex_attention``, compiled once per process on first CUDA use."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def layout_to_dense_mask(layout: torch.Tensor, block: int, *, causal: bool) -> torch.Tensor:
    """The token-level boolean mask ``(heads, seq, seq)`` of a block layout (True: attend)."""
    mask = layout.bool().repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)
    if causal:
        mask &= torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    return mask


class SparseSelfAttention(nn.Module):
    """Block-sparse self-attention with DeepSpeed's constructor and call signature.

    Args:
        sparsity_config: the pattern (``FixedSparsityConfig(num_heads=...)``, ...).
        key_padding_mask_mode: how ``key_padding_mask`` (batch, seq) applies: ``"add"`` (added to the
            scores: 0 keeps, -inf drops) or ``"mul"`` (1 keeps, 0 drops). DeepSpeed default ``"add"``.
        attn_mask_mode: the same for ``attn_mask`` (seq, seq). DeepSpeed default ``"mul"``.
        max_seq_length: the layout is built once for this length and cut for shorter sequences, so
            random blocks do not change with the length (DeepSpeed's behaviour). Default 2048.
        force_flex: always run FlexAttention (eager off CUDA; no backward on CPU).
    """

    def __init__(
        self,
        sparsity_config: SparsityConfig | None = None,
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "mul",
        max_seq_length: int = 2048,
        *,
        force_flex: bool = False,
    ) -> None:
        super().__init__()
        if sparsity_config is None:
            raise ValueError(
                "SparseSelfAttention needs sparsity_config=, e.g. FixedSparsityConfig(num_heads=...) (DeepSpeed's "
                "default SparsityConfig(num_heads=4) defines no pattern)"
            )
        if not isinstance(sparsity_config, SparsityConfig) or type(sparsity_config) is SparsityConfig:
            raise ValueError(
                f"sparsity_config must be one of partita.ops.sparse_attention's pattern classes (Fixed, Variable, "
                f"BigBird, BSLongformer, Dense, LocalSlidingWindow), got {type(sparsity_config).__name__}"
            )
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in ("add", "mul"):
                raise NotImplementedError(f"{name}={mode!r}: only \"add\" and \"mul\" are supported")
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.force_flex = force_flex
        self.causal = sparsity_config.attention_direction == "unidirectional"
        # Built here, before any data: every rank gets the same layout from the same seed.
        self.master_layout = sparsity_config.make_layout(max_seq_length)
        self._block_masks: dict[tuple[int, str], Any] = {}

    def layout(self, seq_len: int) -> torch.Tensor:
        """The layout for ``seq_len`` tokens; ValueError naming the values if it cannot be cut."""
        block = self.sparsity_config.block
        if seq_len % block != 0:
            raise ValueError(
                f"sequence length {seq_len} is not divisible by the sparse attention block size {block}; pad "
                f"sequences to a multiple of {block} (e.g. {block * -(-seq_len // block)})"
            )
        if seq_len > self.max_seq_length:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_length={self.max_seq_length} the layout was built for; "
                f"build SparseSelfAttention with max_seq_length >= {seq_len}"
            )
        blocks = seq_len // block
        return self.master_layout[:, :blocks, :blocks]

    def block_mask(self, seq_len: int, device: torch.device):
        """The FlexAttention ``BlockMask`` of the layout at ``seq_len`` (cached)."""
        key = (seq_len, str(device))
        if key not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            layout = self.layout(seq_len).bool().to(device)
            block, causal = self.sparsity_config.block, self.causal

            def mask_mod(b, h, q_idx, kv_idx):
                allowed = layout[h, q_idx // block, kv_idx // block]
                return allowed & (q_idx >= kv_idx) if causal else allowed

            # Uncompiled, create_block_mask evaluates mask_mod on every (head, query, key) triple at
            # once (64 GiB of bools for 16 heads at 64k tokens, measured OOM on an H200); compiled, it
            # evaluates block by block. The layout tensor is tiny, so compiling costs seconds once.
            self._block_masks[key] = create_block_mask(
                mask_mod, None, layout.size(0), seq_len, seq_len, device=device, _compile=device.type == "cuda"
            )
        return self._block_masks[key]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rpe: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``(batch, heads, seq, head_dim)`` tensors under the pattern; same shape out."""
        if rpe is not None:
            raise NotImplementedError(
                "SparseSelfAttention(rpe=...) (relative position embeddings added to the scores) is not implemented "
                "in partita; add position information to query/key instead"
            )
        if query.dim() != 4 or query.shape != key.shape or key.shape[:3] != value.shape[:3]:
            raise ValueError(
                f"SparseSelfAttention: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}; "
                "expected equal (batch, heads, seq, head_dim) shapes (self-attention)"
            )
        heads, seq = query.size(1), query.size(2)
        if heads != self.sparsity_config.num_heads:
            raise ValueError(
                f"SparseSelfAttention: the input has {heads} heads but the sparsity config was built for "
                f"num_heads={self.sparsity_config.num_heads}; build the config with num_heads={heads}"
            )
        layout = self.layout(seq)  # validates the length before any kernel runs
        extra = key_padding_mask is not None or attn_mask is not None
        if query.device.type == "cuda" and not extra:
            return _flex()(query, key, value, block_mask=self.block_mask(seq, query.device))
        if self.force_flex and not extra:
            from torch.nn.attention.flex_attention import flex_attention

            return flex_attention(query, key, value, block_mask=self.block_mask(seq, query.device))
        mask = layout_to_dense_mask(layout.to(query.device), self.sparsity_config.block, causal=self.causal)
        bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
        bias = bias[None]  # (1, heads, seq, seq)
        if attn_mask is not None:
            bias = bias + self._as_bias(attn_mask, self.attn_mask_mode, query.dtype)[None, None]
        if key_padding_mask is not None:
            bias = bias + self._as_bias(key_padding_mask, self.key_padding_mask_mode, query.dtype)[:, None, None, :]
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias)

    @staticmethod
    def _as_bias(mask: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
        if mode == "add":
            return mask.to(dtype)
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask == 0, float("-inf"))
