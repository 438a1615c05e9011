"""DeepSpeed's block-sparse attention patterns, with its class names and constructor arguments.

A layout is an int64 tensor ``(num_heads, num_blocks, num_blocks)``: entry ``[h, i, j] = 1`` when
query block ``i`` of head ``h`` attends to key block ``j`` (blocks of ``block`` tokens). The
patterns follow DeepSpeed's ``deepspeed.ops.sparse_attention.sparsity_config`` (same parameters,
defaults and block semantics), built here with tensor slicing. Two deliberate differences:

- random blocks come from a ``torch.Generator`` seeded with ``seed`` (same on every rank, so every
  rank builds the same layout without DeepSpeed's broadcast of rank 0's Python ``random`` draw);
- with ``attention="unidirectional"``, random blocks are drawn from the past (as DeepSpeed's
  BigBird does; its Variable pattern also draws future blocks, which a causal model masks anyway).

Unidirectional layouts are block-lower-triangular; inside a diagonal block the token-level causal
mask is applied by :class:`~partita.ops.sparse_attention.SparseSelfAttention` (DeepSpeed left that
to the caller's ``attn_mask``).
"""

from __future__ import annotations

import torch

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparsityConfig",
    "VariableSparsityConfig",
]

ATTENTIONS = ("unidirectional", "bidirectional")


def _check_attention(attention: str) -> None:
    if attention not in ATTENTIONS:
        raise NotImplementedError(f"attention={attention!r}: only \"unidirectional\" and \"bidirectional\" are supported")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive int")


class SparsityConfig:
    """Shared settings: ``num_heads``, ``block`` (tokens per block side) and whether each head may get
    its own layout (``different_layout_per_head``; otherwise head 0's layout is copied to all)."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False) -> None:
        _check_positive(num_heads=num_heads, block=block)
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    @property
    def attention_direction(self) -> str:
        return getattr(self, "attention", "bidirectional")

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero layout for ``seq_len`` tokens; ValueError unless ``block`` divides ``seq_len``."""
        if seq_len % self.block != 0:
            raise ValueError(
                f"sequence length {seq_len} is not divisible by the sparse attention block size {self.block}; "
                f"pad sequences to a multiple of {self.block} or choose a block that divides {seq_len}"
            )
        blocks = seq_len // self.block
        return torch.zeros((self.num_heads, blocks, blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not define a layout; use one of its subclasses")


class DenseSparsityConfig(SparsityConfig):
    """Every block: dense attention expressed as a layout (for comparison)."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


def _window_blocks(layout: torch.Tensor, h: int, start: int, end: int, unidirectional: bool) -> None:
    """Blocks ``start..end-1`` attend to each other (only to earlier ones when unidirectional)."""
    window = torch.ones(end - start, end - start, dtype=layout.dtype)
    layout[h, start:end, start:end] = torch.tril(window) if unidirectional else window


class FixedSparsityConfig(SparsityConfig):
    """Sparse Transformer's "fixed" pattern (Child et al. 2019, as DeepSpeed customised it).

    Consecutive windows of ``num_local_blocks`` blocks attend within themselves; the last
    ``num_global_blocks`` blocks of each window are its representatives, which every later block
    (every block, bidirectionally) attends to; with ``horizontal_global_attention`` they also
    attend to every block. With ``different_layout_per_head``, head h uses the representatives
    ``1 + h % num_different_global_patterns`` groups from the end of each window.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_local_blocks: int = 4,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        num_different_global_patterns: int = 1,
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        _check_positive(
            num_local_blocks=num_local_blocks,
            num_global_blocks=num_global_blocks,
            num_different_global_patterns=num_different_global_patterns,
        )
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(
                f"num_local_blocks={num_local_blocks} must be divisible by num_global_blocks={num_global_blocks}; "
                "choose a num_global_blocks that divides num_local_blocks"
            )
        _check_attention(attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ValueError(
                "horizontal_global_attention=true needs attention \"bidirectional\" (a causal block cannot attend "
                "to later blocks); set one of them differently"
            )
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(
                f"num_different_global_patterns={num_different_global_patterns} needs different_layout_per_head=true "
                "(with one layout for all heads there is one pattern)"
            )
        most = num_local_blocks // num_global_blocks
        if num_different_global_patterns > most:
            raise ValueError(
                f"num_different_global_patterns={num_different_global_patterns} exceeds num_local_blocks / "
                f"num_global_blocks = {num_local_blocks} / {num_global_blocks} = {most}; use at most {most}"
            )
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        blocks = layout.size(1)
        local, width = self.num_local_blocks, self.num_global_blocks
        unidirectional = self.attention == "unidirectional"
        for h in range(self.num_layout_heads):
            for start in range(0, blocks, local):
                _window_blocks(layout, h, start, min(start + local, blocks), unidirectional)
            offset = local - (1 + h % self.num_different_global_patterns) * width
            whole = blocks - blocks % local  # blocks covered by complete windows
            starts = list(range(offset, whole, local))
            if whole < blocks:  # a short last window: its representatives, kept inside the sequence
                starts.append(min(whole + offset, blocks - width))
            for g in starts:
                layout[h, (g if unidirectional else 0) :, g : g + width] = 1
                if self.horizontal_global_attention:
                    layout[h, g : g + width, :] = 1
        return self.check_and_propagate_first_head_layout(layout)


def _random_blocks(layout: torch.Tensor, h: int, count: int, generator: torch.Generator, unidirectional: bool) -> None:
    blocks = layout.size(1)
    if count > blocks:
        raise ValueError(
            f"num_random_blocks={count} exceeds the {blocks} blocks of a row (sequence / block); use fewer random "
            "blocks or longer sequences"
        )
    if count == 0:
        return
    for row in range(blocks):
        choices = row + 1 if unidirectional else blocks
        picked = torch.randperm(choices, generator=generator)[: min(count, choices)]
        layout[h, row, picked] = 1


def _global_ranges(starts: list[int], ends: list[int] | None) -> list[tuple[int, int]]:
    return [(s, s + 1) for s in starts] if ends is None else list(zip(starts, ends))


def _check_global_indices(starts: list[int], ends: list[int] | None) -> None:
    if any(not isinstance(s, int) or s < 0 for s in starts):
        raise ValueError(f"global_block_indices={starts}: must be non-negative block indices")
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(
            f"global_block_end_indices has {len(ends)} entries and global_block_indices {len(starts)}; give one end "
            "per start"
        )
    for start, end in zip(starts, ends):
        if start >= end:
            raise ValueError(f"global block range {start}..{end}: the start must be smaller than the end (exclusive)")


def _sliding_window(layout: torch.Tensor, h: int, window: int, *, future: bool) -> None:
    blocks = layout.size(1)
    if window > blocks:
        raise ValueError(
            f"num_sliding_window_blocks={window} exceeds the {blocks} blocks of a row (sequence / block); use a "
            "smaller window or longer sequences"
        )
    half = window // 2
    rows = torch.arange(blocks)[:, None]
    cols = torch.arange(blocks)[None, :]
    near = (cols >= rows - half) & (cols <= rows + (half if future else 0))
    layout[h][near] = 1


class VariableSparsityConfig(SparsityConfig):
    """Fixed's generalisation: local windows of the sizes in ``local_window_blocks`` (the last
    size repeats to the end), global blocks at ``global_block_indices`` (ranges up to
    ``global_block_end_indices``, exclusive, when given), and ``num_random_blocks`` per row."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 0,
        local_window_blocks: list[int] | None = None,
        global_block_indices: list[int] | None = None,
        global_block_end_indices: list[int] | None = None,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        *,
        seed: int = 0,
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        local_window_blocks = [4] if local_window_blocks is None else list(local_window_blocks)
        global_block_indices = [0] if global_block_indices is None else list(global_block_indices)
        if not local_window_blocks or any(not isinstance(w, int) or w < 1 for w in local_window_blocks):
            raise ValueError(f"local_window_blocks={local_window_blocks}: give one or more positive window sizes")
        if num_random_blocks < 0:
            raise ValueError(f"num_random_blocks={num_random_blocks}: must be >= 0")
        _check_global_indices(global_block_indices, global_block_end_indices)
        _check_attention(attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ValueError(
                "horizontal_global_attention=true needs attention \"bidirectional\"; set one of them differently"
            )
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = local_window_blocks
        self.global_block_indices = global_block_indices
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.seed = seed

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        blocks = layout.size(1)
        unidirectional = self.attention == "unidirectional"
        generator = torch.Generator().manual_seed(self.seed)
        for h in range(self.num_layout_heads):
            _random_blocks(layout, h, self.num_random_blocks, generator, unidirectional)
            start, sizes = 0, list(self.local_window_blocks)
            while start < blocks:
                size = sizes.pop(0) if len(sizes) > 1 else sizes[0]
                _window_blocks(layout, h, start, min(start + size, blocks), unidirectional)
                start += size
            for first, end in _global_ranges(self.global_block_indices, self.global_block_end_indices):
                if first >= blocks:
                    continue
                end = min(end, blocks)
                layout[h, (first if unidirectional else 0) :, first:end] = 1
                if self.horizontal_global_attention:
                    layout[h, first:end, :] = 1
        return self.check_and_propagate_first_head_layout(layout)


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (Zaheer et al. 2020): ``num_random_blocks`` random blocks per row, a sliding window
    of ``num_sliding_window_blocks`` blocks centred on the diagonal, and the first
    ``num_global_blocks`` blocks global (attended by and attending to every block)."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 1,
        num_sliding_window_blocks: int = 3,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        *,
        seed: int = 0,
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        if num_random_blocks < 0:
            raise ValueError(f"num_random_blocks={num_random_blocks}: must be >= 0")
        _check_positive(num_sliding_window_blocks=num_sliding_window_blocks, num_global_blocks=num_global_blocks)
        _check_attention(attention)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.seed = seed

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        blocks = layout.size(1)
        if self.num_global_blocks > blocks:
            raise ValueError(
                f"num_global_blocks={self.num_global_blocks} exceeds the {blocks} blocks of a row; use fewer global "
                "blocks or longer sequences"
            )
        unidirectional = self.attention == "unidirectional"
        generator = torch.Generator().manual_seed(self.seed)
        for h in range(self.num_layout_heads):
            _random_blocks(layout, h, self.num_random_blocks, generator, unidirectional)
            _sliding_window(layout, h, self.num_sliding_window_blocks, future=True)
            layout[h, : self.num_global_blocks, :] = 1
            layout[h, :, : self.num_global_blocks] = 1
        if unidirectional:
            layout = torch.tril(layout)
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (Beltagy et al. 2020): a sliding window of
    ``num_sliding_window_blocks`` blocks, plus global blocks at ``global_block_indices`` (ranges
    up to ``global_block_end_indices`` when given) that attend to and are attended by all."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_sliding_window_blocks: int = 3,
        global_block_indices: list[int] | None = None,
        global_block_end_indices: list[int] | None = None,
        attention: str = "bidirectional",
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        global_block_indices = [0] if global_block_indices is None else list(global_block_indices)
        _check_positive(num_sliding_window_blocks=num_sliding_window_blocks)
        _check_global_indices(global_block_indices, global_block_end_indices)
        _check_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = global_block_indices
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = attention

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        blocks = layout.size(1)
        for h in range(self.num_layout_heads):
            _sliding_window(layout, h, self.num_sliding_window_blocks, future=True)
            for first, end in _global_ranges(self.global_block_indices, self.global_block_end_indices):
                if first < blocks:
                    layout[h, first : min(end, blocks), :] = 1
                    layout[h, :, first : min(end, blocks)] = 1
        if self.attention == "unidirectional":
            layout = torch.tril(layout)
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A purely local sliding window of ``num_sliding_window_blocks`` blocks (DeepSpeed's Python-only
    pattern): unidirectional keeps the ``window // 2`` blocks before the diagonal."""

    def __init__(
        self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3, attention: str = "unidirectional"
    ) -> None:
        super().__init__(num_heads, block)
        _check_positive(num_sliding_window_blocks=num_sliding_window_blocks)
        _check_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        _sliding_window(layout, 0, self.num_sliding_window_blocks, future=self.attention == "bidirectional")
        return self.check_and_propagate_first_head_layout(layout)
