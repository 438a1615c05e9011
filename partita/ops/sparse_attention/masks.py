"""Token-level masks beside DeepSpeed's block patterns: sliding windows and packed documents.

``masked_attention(q, k, v, mask_mod)`` runs any FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` the
way :class:`SparseSelfAttention` runs a layout: compiled FlexAttention with a ``BlockMask`` on CUDA
(fully masked tiles are skipped), SDPA under the same mask made dense elsewhere (torch's CPU
FlexAttention has no backward). Two builders:

- :func:`sliding_window_mask` — causal attention to the last ``window`` tokens (Mistral-style),
  exact per token rather than per DeepSpeed block;
- :func:`document_mask` — packed sequences: ``document_ids`` ``(batch, seq)`` names the document
  of each token, and a token sees only earlier tokens of its own document.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["document_mask", "masked_attention", "sliding_window_mask"]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sliding_window_mask(window: int) -> MaskMod:
    """Causal, and at most ``window`` tokens back (the token itself included)."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding window {window!r}: must be a positive number of tokens")

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return mask_mod


def document_mask(document_ids: torch.Tensor, *, causal: bool = True) -> MaskMod:
    """Attention only within a token's own document (and to earlier tokens when ``causal``)."""
    if document_ids.dim() != 2 or document_ids.is_floating_point():
        raise ValueError(
            f"document_ids must be an integer tensor (batch, seq), got {document_ids.dtype} {tuple(document_ids.shape)}"
        )

    def mask_mod(b, h, q_idx, kv_idx):
        same = document_ids[b, q_idx] == document_ids[b, kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    return mask_mod


def _dense(mask_mod: MaskMod, batch: int, heads: int, seq: int, device: torch.device) -> torch.Tensor:
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.arange(heads, device=device)[None, :, None, None]
    q = torch.arange(seq, device=device)[None, None, :, None]
    k = torch.arange(seq, device=device)[None, None, None, :]
    return mask_mod(b, h, q, k).expand(batch, heads, seq, seq)


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask_mod: MaskMod) -> torch.Tensor:
    """Self-attention of ``(batch, heads, seq, head_dim)`` tensors under ``mask_mod``; same shape out.
    Every query must see at least one key (both builders above guarantee it)."""
    if query.dim() != 4 or key.shape != query.shape or value.shape[:3] != query.shape[:3]:
        raise ValueError(
            f"masked_attention: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}; "
            "expected equal (batch, heads, seq, head_dim) shapes"
        )
    batch, heads, seq, _ = query.shape
    if query.device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask

        from partita.ops.sparse_attention.sparse_self_attention import _flex

        # compiled: evaluated block by block, never the whole (batch, seq, seq) mask (see SparseSelfAttention)
        block_mask = create_block_mask(mask_mod, batch, None, seq, seq, device=query.device, _compile=True)
        return _flex()(query, key, value, block_mask=block_mask)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=_dense(mask_mod, batch, heads, seq, query.device))
