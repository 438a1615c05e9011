"""A streaming safetensors writer that hashes while it writes.

``safetensors.torch.save_file`` turns every tensor into ``bytes`` before writing, so a file
costs a second copy of its whole content in memory, and a checksum needs a second read. The
format is simple enough to write directly (https://huggingface.co/docs/safetensors):

    8 bytes   little-endian u64 N: length of the header
    N bytes   JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
              "__metadata__": {str: str}}, padded with spaces so the data starts 8-byte aligned
    data      the tensors' raw little-endian bytes, back to back, in offset order

Here the header is computed from shapes and dtypes alone, then each tensor is produced (a
callable may build it only now, e.g. gathered from shards), moved to CPU, written and fed to
sha256 straight from its memory, and dropped. Peak extra memory is one tensor. Reading uses
the ``safetensors`` library (``safe_open`` memory-maps and slices without loading a file).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Union

import torch

from partita.checkpoint.errors import CheckpointError

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):  # unsigned wide ints arrived in torch 2.3
        DTYPE_CODES[getattr(torch, _name)] = _code

_CHUNK_BYTES = 64 << 20  # hash/write in pieces so huge tensors do not need one giant buffer view


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write: its name, dtype and shape, and the tensor or a callable producing it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: Union[torch.Tensor, Callable[[], torch.Tensor]]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorEntry:
        return cls(name, tensor.dtype, tuple(tensor.shape), tensor)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def tensor(self) -> torch.Tensor:
        value = self.source() if callable(self.source) else self.source
        if value.dtype != self.dtype or tuple(value.shape) != self.shape:
            raise CheckpointError(
                f"tensor {self.name!r} changed while it was written: expected {self.dtype} {list(self.shape)}, "
                f"got {value.dtype} {list(value.shape)}"
            )
        return value


@dataclass(frozen=True)
class WrittenFile:
    """What the manifest records about a file."""

    size: int
    sha256: str


def _header(entries: list[TensorEntry], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise CheckpointError("safetensors metadata must map str to str")
        header["__metadata__"] = metadata
    offset = 0
    for entry in entries:
        if entry.dtype not in DTYPE_CODES:
            raise CheckpointError(f"tensor {entry.name!r} has dtype {entry.dtype}, which safetensors cannot store")
        if entry.name in header:
            raise CheckpointError(f"two tensors named {entry.name!r} in one file")
        end = offset + entry.nbytes
        header[entry.name] = {"dtype": DTYPE_CODES[entry.dtype], "shape": list(entry.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(len(raw) + 8) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _raw_bytes(tensor: torch.Tensor):
    """The tensor's bytes as a zero-copy numpy view (after one move to CPU if needed)."""
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def write_safetensors(
    path: str | os.PathLike[str],
    entries: Iterable[TensorEntry],
    *,
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[TensorEntry], None] | None = None,
) -> WrittenFile:
    """Write ``entries`` to ``path`` (fsynced) and return its size and sha256.

    ``on_tensor`` is called after each tensor is written (progress bars).
    """
    if sys.byteorder != "little":
        raise NotImplementedError("writing safetensors on a big-endian machine is not supported")
    entries = list(entries)
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        head = _header(entries, metadata)
        f.write(head)
        digest.update(head)
        size += len(head)
        for entry in entries:
            data = _raw_bytes(entry.tensor())
            for start in range(0, data.nbytes, _CHUNK_BYTES):
                chunk = memoryview(data[start : start + _CHUNK_BYTES])
                f.write(chunk)
                digest.update(chunk)
            size += data.nbytes
            del data
            if on_tensor is not None:
                on_tensor(entry)
        f.flush()
        os.fsync(f.fileno())
    return WrittenFile(size=size, sha256=digest.hexdigest())


def write_json(path: str | os.PathLike[str], obj: object) -> WrittenFile:
    """Write ``obj`` as indented JSON (fsynced) and return its size and sha256."""
    raw = (json.dumps(obj, indent=1, allow_nan=True) + "\n").encode("utf-8")
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return WrittenFile(size=len(raw), sha256=hashlib.sha256(raw).hexdigest())


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
