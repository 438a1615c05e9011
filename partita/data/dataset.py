"""Fixed-length (input, target) windows over a flat token array, for next-token prediction."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


class TokenWindowDataset(Dataset):
    """Item ``i`` is ``(x, y)``: ``block_size`` tokens starting at ``i * stride`` and the same
    window shifted by one token, both int64 tensors (what ``F.cross_entropy`` and embeddings take).

    Windows are at fixed offsets rather than random ones so that an index names the same sample
    on every rank and after a restart; the sampler shuffles the indices instead. With the default
    stride (``block_size``) windows do not overlap, so one epoch sees each token once; the last
    ``len(tokens) - 1 - len * stride`` tokens that do not fill a window are never used.

    Args:
        tokens: 1-D token ids (a numpy array or memmap, or a torch tensor), any integer dtype.
        block_size: window length.
        stride: distance between the starts of consecutive windows (default: ``block_size``).
    """

    def __init__(self, tokens: np.ndarray | torch.Tensor, block_size: int, *, stride: int | None = None) -> None:
        stride = block_size if stride is None else stride
        if block_size < 1 or stride < 1:
            raise ValueError(f"block_size and stride must be >= 1, got block_size={block_size}, stride={stride}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        # Each window needs block_size + 1 tokens: the target is the input shifted by one.
        if len(tokens) < block_size + 1:
            raise ValueError(
                f"{len(tokens)} tokens cannot fill one window of block_size={block_size} (needs "
                f"{block_size + 1}); use a smaller block_size or more data"
            )
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride
        self._len = (len(tokens) - block_size - 1) // stride + 1

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self._len <= index < self._len:
            raise IndexError(f"window index {index} out of range for {self._len} windows")
        start = (index % self._len) * self.stride
        chunk = self.tokens[start : start + self.block_size + 1]
        if isinstance(chunk, torch.Tensor):
            chunk = chunk.to(torch.int64)
        else:
            chunk = torch.from_numpy(np.asarray(chunk, dtype=np.int64))
        return chunk[:-1], chunk[1:]
