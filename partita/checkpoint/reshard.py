"""Reading element ranges of saved per-parameter shards: the whole of resharding.

A saved parameter is a list of shards ``{file, start, end}`` (element ranges of the
flattened parameter, one per saving rank that owned a non-empty part). A loading rank that
now owns ``[a, b)`` reads, from each saved shard overlapping it, exactly the overlap, through
``safe_open(...).get_slice``, which reads those bytes from a memory map and nothing else. So
world size N -> M and stage s -> t need no conversion, and no rank reads the whole model.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from partita.checkpoint.errors import CheckpointCorruptError


class ShardReader:
    """Lazily opened safetensors files of one checkpoint directory. Use as a context manager."""

    def __init__(self, tag_dir: str | os.PathLike[str]) -> None:
        self.tag_dir = Path(tag_dir)
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()
        self._stack.close()

    def handle(self, name: str) -> Any:
        if name not in self._handles:
            path = self.tag_dir / name
            try:
                self._handles[name] = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except Exception as error:  # safetensors raises its own error types for bad headers
                raise CheckpointCorruptError(f"{path} cannot be opened as safetensors: {error}") from None
        return self._handles[name]

    def has(self, name: str, key: str) -> bool:
        return key in self.handle(name).keys()

    def tensor(self, name: str, key: str) -> torch.Tensor:
        handle = self.handle(name)
        if key not in handle.keys():
            raise CheckpointCorruptError(f"{self.tag_dir / name} has no tensor {key!r}")
        return handle.get_tensor(key)

    def metadata(self, name: str) -> dict[str, str]:
        return self.handle(name).metadata() or {}

    def read_range(self, key: str, shards: list[dict[str, Any]], start: int, end: int, out: torch.Tensor) -> None:
        """Fill the 1-D ``out`` (``end - start`` elements) with elements ``[start, end)`` of the
        flattened tensor saved as ``key`` in ``shards``; the dtype is converted if it differs."""
        covered = 0
        for shard in shards:
            lo, hi = max(start, shard["start"]), min(end, shard["end"])
            if lo >= hi:
                continue
            handle = self.handle(shard["file"])
            if key not in handle.keys():
                raise CheckpointCorruptError(f"{self.tag_dir / shard['file']} has no tensor {key!r}")
            piece = handle.get_slice(key)[lo - shard["start"] : hi - shard["start"]]
            out[lo - start : hi - start].copy_(piece)
            covered += hi - lo
        if covered != end - start:
            raise CheckpointCorruptError(
                f"the saved shards of {key!r} cover {covered} of the {end - start} elements [{start}, {end}) needed "
                f"(meta.json in {self.tag_dir} is inconsistent)"
            )

    def read_full(self, key: str, record: dict[str, Any], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole parameter ``key`` assembled from its shards, in its full shape."""
        out = torch.empty(record["numel"], dtype=dtype)
        self.read_range(key, record["shards"], 0, record["numel"], out)
        return out.view(record["shape"])
