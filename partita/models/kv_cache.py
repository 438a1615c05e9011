"""A static key/value cache for the reference GPT's generation (:mod:`partita.models.gpt_generate`).

Each block gets one preallocated key buffer and one value buffer of shape
``(batch, local_heads, max_len, head_dim)``; a forward with the cache writes the new tokens' keys
and values at their positions and attends over the buffer.

Why static (preallocated at ``max_len``, never concatenated onto): a decode step must have the
same shapes and the same tensor addresses at every token, so that
``torch.compile(mode="reduce-overhead")`` can capture it once as a CUDA graph and replay it for
each new token. A cache that grows by ``torch.cat`` changes shape every step (a recompile per
token) and allocates every step (no graph). The price: every decode step attends over all
``max_len`` slots, the ones not written yet masked out, so its attention costs ``O(max_len)``
instead of ``O(position)``; generation sizes ``max_len`` to prompt + new tokens, not block_size.

The buffers are allocated at the prefill from the keys the attention produced, so batch, head
count, dtype and device are whatever the model computes: under tensor parallelism a rank holds
its own heads only (``local_heads = n_head / tensor size``), under autocast the compute dtype.
The decode step's position is a tensor, not a Python int, for the same reason as the static
shapes: a new int per token would be a new constant in the captured graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["LayerKVCache", "StaticKVCache"]


class LayerKVCache:
    """One block's key and value buffers (``None`` until the first prefill)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0) -> torch.Tensor:
        """Attention of a prompt at positions ``0..T-1`` (causal over the prompt itself, so SDPA's
        flash kernels apply), its keys and values written to slots ``0..T-1``. Earlier contents
        past ``T`` stay but are never read: later steps mask every slot past their position."""
        seq = k.size(2)
        if seq > self.max_len:
            raise ValueError(
                f"a prompt of {seq} tokens does not fit a KV cache of max_len {self.max_len}; "
                f"build the cache with max_len >= prompt + new tokens (GPT.new_kv_cache(max_len))"
            )
        self._allocate_like(k)
        self.key[:, :, :seq].copy_(k)
        self.value[:, :, :seq].copy_(v)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)

    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               *, dropout_p: float = 0.0) -> torch.Tensor:
        """Attention of tokens at ``positions`` (a (T,) long tensor, T = 1 for a decode step) over
        every cached slot at or before each token's position; their keys and values written first.

        Shapes do not depend on the positions' values (the whole buffer is attended, the mask
        selects): capturable as one CUDA graph."""
        if self.key is None:
            raise RuntimeError("the KV cache is empty: run a prefill (the model's forward with kv_cache and no "
                               "position_ids) before decode steps")
        if k.shape[0] != self.key.shape[0] or k.shape[1] != self.key.shape[1]:
            raise ValueError(
                f"decode step of batch {k.shape[0]} with {k.shape[1]} heads on a KV cache prefilled for batch "
                f"{self.key.shape[0]} with {self.key.shape[1]} heads: decode the same batch that was prefilled"
            )
        self.key.index_copy_(2, positions, k)
        self.value.index_copy_(2, positions, v)
        slots = torch.arange(self.max_len, device=positions.device)
        visible = slots.unsqueeze(0) <= positions.unsqueeze(1)  # (T, max_len): True = attend
        return F.scaled_dot_product_attention(q, self.key, self.value, attn_mask=visible, dropout_p=dropout_p)

    def _allocate_like(self, k: torch.Tensor) -> None:
        shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
        key = self.key
        if key is not None and key.shape == shape and key.dtype == k.dtype and key.device == k.device:
            return  # reused: same addresses, so a captured decode graph stays valid
        self.key = torch.zeros(shape, dtype=k.dtype, device=k.device)
        self.value = torch.zeros(shape, dtype=k.dtype, device=k.device)
        # In-place writes to these buffers inside a CUDA-graph-captured step are only allowed on
        # tensors whose address dynamo may treat as fixed (as Hugging Face's StaticCache marks its own).
        torch._dynamo.mark_static_address(self.key)
        torch._dynamo.mark_static_address(self.value)


class StaticKVCache:
    """The cache of a whole model: one :class:`LayerKVCache` per block, all of ``max_len`` slots.

    Build it with ``GPT.new_kv_cache(max_len)``; pass it as ``kv_cache=`` to the GPT's forward
    (prefill) and ``decode_step``. One cache can serve successive ``generate`` calls of the same
    batch size (``generate(..., kv_cache=cache)``): its buffers, and so a captured decode graph's
    addresses, are reused.
    """

    def __init__(self, num_layers: int, max_len: int) -> None:
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"KV cache max_len must be a positive int (slots per sequence), got {max_len!r}")
        self.max_len = max_len
        self.layers = [LayerKVCache(max_len) for _ in range(num_layers)]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> LayerKVCache:
        return self.layers[index]

    def nbytes(self) -> int:
        """Bytes the allocated buffers hold (0 before the first prefill): 2 x layers x batch x
        local heads x max_len x head_dim x element size."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.key, layer.value) if t is not None)
